"""The run directory's layout and every table's columns, defined once.

Layout of a run directory::

    RUN/
      manifest.json            run-level manifest (schema version, versions, argv, world size)
      rank0/
        manifest.json          this rank's manifest (device, GPU name, pid, host, start time)
        steps.jsonl            one line per training iteration (append-only)
        events.jsonl           one line per event: scaler created, state loaded, collector error, ...
        <table>.jsonl          further tables written by collectors (append-only)
        end.json               written at a clean close: final step, rows lost; absent after a crash
      rank1/ ...

Every record file is JSON Lines, appended in whole lines with one ``write`` per flush; a reader
ignores an unterminated last line, so a reader never sees half a record and a killed process
loses only what it had not flushed.
"""

from __future__ import annotations

import pyarrow as pa

__all__ = [
    "SCHEMA_VERSION",
    "FORMAT",
    "RUN_MANIFEST",
    "RANK_MANIFEST",
    "END_MARKER",
    "TABLES",
    "rank_dirname",
]

SCHEMA_VERSION = 1
FORMAT = "amprobe-run"
RUN_MANIFEST = "manifest.json"
RANK_MANIFEST = "manifest.json"
END_MARKER = "end.json"


def rank_dirname(rank: int) -> str:
    return f"rank{rank}"


#: Table name -> column name -> arrow type. The loader reads with these types; columns a
#: writer did not emit come back as nulls, extra fields are ignored.
TABLES: dict[str, dict[str, pa.DataType]] = {
    "steps": {
        "step": pa.int64(),  # iteration index, counted from 0; skipped iterations count
        "window": pa.int64(),  # recording window (attach/detach cycles), 0 for a plain run
        "t": pa.float64(),  # seconds since the rank's start, at the end of the step
        "wall_s": pa.float64(),  # user time of the step, probe's own flush time excluded
        "probe_s": pa.float64(),  # time the probe itself spent during this step (flushes)
        "scaler_enabled": pa.bool_(),
        "scale_before": pa.float64(),  # loss scale used for this step's backward
        "scale_after": pa.float64(),  # loss scale after update()
        "growth_tracker": pa.float64(),  # consecutive unskipped steps after update()
        "found_inf": pa.float64(),  # inf/NaN found in gradients (sum over optimizers/devices)
        "skipped": pa.bool_(),  # the optimizer update was not applied
        "opt_steps": pa.int64(),  # optimizer.step() calls that actually ran
        "unscale_calls": pa.int64(),
        "clip_calls": pa.int64(),
        "clip_scaled": pa.int64(),  # clip calls on gradients still multiplied by the scale
        "loss": pa.float64(),
        "loss_dtype": pa.string(),
        "autocast_device": pa.string(),
        "autocast_dtype": pa.string(),
        # runtime collector (host clock, probe time excluded)
        "data_wait_s": pa.float64(),  # time inside DataLoader __next__ (waiting for batches)
        "batches": pa.int64(),  # batches fetched during the step
        "fwd_s": pa.float64(),  # root models' forward (host time; CUDA device time: cuda_phases)
        "bwd_s": pa.float64(),  # torch.autograd.backward
        "opt_s": pa.float64(),  # optimizer.step
        "peak_mem_bytes": pa.int64(),  # CUDA peak allocated memory during the step
        "rss_bytes": pa.int64(),  # host resident set size at the end of the step
        "syncs_sampled": pa.bool_(),  # host-device syncs were counted on this step
        "syncs": pa.int64(),  # synchronizing ops issued by user code (sampled steps only)
    },
    "syncs": {  # runtime collector: synchronizing ops per sampled step and source line
        "step": pa.int64(),
        "site": pa.string(),  # file:line of the user code that issued the op
        "op": pa.string(),  # item | nonzero | equal | bool-mask-index | to-cpu | copy-to-cpu | ...
        "kind": pa.string(),  # user | scaler (GradScaler's check) | optimizer | dataloader (internals)
        "count": pa.int64(),
        "device": pa.string(),  # device type; "cpu" means it would synchronize on a GPU
    },
    "cuda_phases": {  # runtime collector: device time per phase from CUDA events
        "step": pa.int64(),
        "fwd_s": pa.float64(),
        "bwd_s": pa.float64(),
        "opt_s": pa.float64(),
    },
    "gpu": {  # runtime collector: NVML samples (amprobe.collectors.nvml)
        "t": pa.float64(),  # seconds since the rank's start (same clock as steps.t)
        "step": pa.int64(),  # step in progress when sampled
        "gpu": pa.int64(),  # torch CUDA device index
        "gpu_util": pa.float64(),  # % of time a kernel ran (NVML sample period)
        "mem_util": pa.float64(),  # % of time device memory was read or written
        "mem_used_bytes": pa.float64(),
        "mem_total_bytes": pa.float64(),
        "power_w": pa.float64(),
        "sm_clock_mhz": pa.float64(),
        "temp_c": pa.float64(),
        "clock_event_reasons": pa.int64(),  # NVML clocks-event (throttle) reason bit mask
        "throttle": pa.string(),  # decoded reason names, comma-separated
        "sm_util": pa.float64(),  # GPM, % (Hopper+)
        "sm_occupancy": pa.float64(),  # GPM, %
        "tensor_any": pa.float64(),  # GPM: any tensor pipe active, %
        "tensor_hmma": pa.float64(),  # GPM: fp16/bf16 tensor pipe, %
        "tensor_imma": pa.float64(),  # GPM: integer tensor pipe, %
        "tensor_dfma": pa.float64(),  # GPM: fp64 tensor pipe, %
    },
    "events": {
        "step": pa.int64(),  # step during which the event happened
        "t": pa.float64(),
        "kind": pa.string(),
        "detail": pa.string(),  # JSON object with the event's fields
    },
}
