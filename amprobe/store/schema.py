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

from amprobe.store.layout import END_MARKER, FORMAT, RANK_MANIFEST, RUN_MANIFEST, rank_dirname

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
        "input_nonfinite": pa.int64(),  # non-finite elements in the root models' float inputs
        "loss_nonfinite": pa.bool_(),  # the loss was inf/NaN
        "numerics_sampled": pa.bool_(),  # per-layer numerics were captured on this step
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
    # per module, kind and sampled step; see amprobe.collectors.numerics for units
    "numerics": {
        "step": pa.int64(),
        "module": pa.string(),  # qualified name; "<input R>[i]" for root model R's i-th float input
        "module_type": pa.string(),
        "kind": pa.string(),  # input | output | grad_output | grad_param
        "dtype": pa.string(),
        "calls": pa.int64(),
        "order": pa.int64(),  # first call's position in execution order of this kind
        "elements": pa.int64(),
        "zeros": pa.int64(),
        "nan": pa.int64(),
        "inf": pa.int64(),
        "finite": pa.int64(),
        "over_fp16": pa.int64(),  # finite values >= 2**16 (would overflow fp16)
        "below_normal": pa.int64(),  # nonzero values < 2**-14 (gradients: after unscaling)
        "below_subnormal": pa.int64(),  # nonzero values < 2**-24 (gradients: after unscaling)
        "underflow_at_scale": pa.int64(),  # nonzero grads < 2**-24 even times the loss scale
        "loss_scale": pa.float64(),  # scale gradients were divided by (1 without a scaler)
        "amax": pa.float64(),  # null when NaN present
        "in_nonfinite": pa.int64(),  # non-finite elements in the module's float inputs
        "exp_hist": pa.string(),  # JSON {unbiased exponent: count}; -127 zeros, 128 inf/NaN
    },
    "offenders": {
        "step": pa.int64(),
        "kind": pa.string(),  # forward | backward | input
        "module": pa.string(),
        "module_type": pa.string(),
        "detail": pa.string(),  # JSON object
    },
    # compute collector: one row per distinct matmul/conv/attention op of a captured step
    "compute_ops": {
        "step": pa.int64(),  # the captured step
        "module": pa.string(),  # qualified name of the innermost module (relative to the root)
        "op": pa.string(),  # aten op, e.g. addmm, mm, convolution_backward
        "phase": pa.string(),  # forward | backward
        "batch": pa.int64(),  # bmm batch, conv N, attention B x heads
        "m": pa.int64(),  # GEMM M (rows of the output); conv: N x input pixels; attention: query length
        "n": pa.int64(),  # GEMM N; conv: Cout / groups; attention: key length
        "k": pa.int64(),  # GEMM K (reduction); conv: Cin / groups x kernel; attention: head dim
        "cin": pa.int64(),  # conv input channels
        "cout": pa.int64(),  # conv output channels
        "kernel": pa.string(),  # conv kernel size, e.g. 3x3
        "in_dtype": pa.string(),  # dtype of the first matrix operand, after autocast
        "out_dtype": pa.string(),
        "autocast": pa.string(),  # enabled | disabled | outside | backward
        "autocast_dtype": pa.string(),  # the autocast region's dtype when enabled
        "count": pa.int64(),  # calls with these shapes in the step
        "flops": pa.float64(),  # FLOPs of those calls (torch.utils.flop_counter; FMA = 2)
    },
    # compute collector: one row per captured step
    "compute_steps": {
        "step": pa.int64(),
        "matmul_flops": pa.float64(),  # FLOPs of every matmul/conv/attention op, forward + backward
        "matmul_ops": pa.int64(),
        "other_ops": pa.int64(),  # other forward/backward ops (views excluded)
        "other_bytes": pa.float64(),  # bytes they read and wrote (inputs + outputs)
        "optimizer_bytes": pa.float64(),  # bytes read and written inside optimizer.step()
        "tf32": pa.bool_(),  # fp32 CUDA matmuls may use TF32
        "capture_s": pa.float64(),  # wall time of the captured step, capture overhead included
    },
}
