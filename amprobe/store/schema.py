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

from amprobe.store.fields import steps_schema
from amprobe.store.layout import END_MARKER, FORMAT, RANK_MANIFEST, RUN_MANIFEST, rank_dirname

__all__ = [
    "SCHEMA_VERSION",
    "FORMAT",
    "RUN_MANIFEST",
    "RANK_MANIFEST",
    "END_MARKER",
    "TABLES",
    "MANIFEST_FIELDS",
    "END_FIELDS",
    "rank_dirname",
]

SCHEMA_VERSION = 1

#: ``numerics`` kinds of a matmul layer's GEMM operands (its input X and weight W; issue 36):
#: another layer's output and a parameter again, so the readers of layers' own values (heatmaps,
#: summaries, overflow evidence) leave them out; the block statistics are ``blockstats``
NUMERICS_OPERAND_KINDS = ("gemm_input", "gemm_weight")

#: Table name -> column name -> arrow type. The loader reads with these types; columns a
#: writer did not emit come back as nulls, extra fields are ignored.
TABLES: dict[str, dict[str, pa.DataType]] = {
    "steps": steps_schema(),  # declared with units and meaning in amprobe.store.fields
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
    "gpu": {  # runtime collector: NVML samples (amprobe.capture.collectors.nvml)
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
    # per module, kind and sampled step; see amprobe.capture.collectors.numerics for units
    "numerics": {
        "step": pa.int64(),
        "module": pa.string(),  # qualified name; "<input R>[i]" for root model R's i-th float input
        "module_type": pa.string(),
        "kind": pa.string(),  # input | output | grad_output | grad_param | gemm_input | gemm_weight
        "dtype": pa.string(),
        "calls": pa.int64(),
        "order": pa.int64(),  # first call's position in execution order of this kind
        "elements": pa.int64(),
        "zeros": pa.int64(),
        "nan": pa.int64(),
        "inf": pa.int64(),
        "finite": pa.int64(),
        "over_fp16": pa.int64(),  # finite values a real fp16 cast makes inf: >= 65520
        "below_normal": pa.int64(),  # nonzero values < 2**-14 (gradients: after unscaling)
        "below_subnormal": pa.int64(),  # nonzero values < 2**-24 (gradients: after unscaling)
        "underflow_at_scale": pa.int64(),  # nonzero, fp16(v * loss scale) == 0: <= 2**-25
        "loss_scale": pa.float64(),  # scale gradients were divided by (1 without a scaler)
        "amax": pa.float64(),  # null when NaN present
        "in_nonfinite": pa.int64(),  # non-finite elements in the module's float inputs
        "exp_hist": pa.string(),  # JSON {exponent: count}; -127 +zeros, -149 <2**-133, 128 inf/NaN
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
        "phase": pa.string(),  # forward | backward | recompute (checkpointing, in backward)
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
    # replicas collector: one row per parameter and sampled step (AMP-D05)
    "fingerprints": {
        "step": pa.int64(),  # the sampled step (values after its optimizer update)
        "param": pa.string(),  # qualified name, as in the user's model
        "fingerprint": pa.int64(),  # sum of the local tensor's bit patterns as integers (mod 2**64)
        "group": pa.string(),  # ranks holding a replica of it, this one included ("0,2")
        "dtype": pa.string(),
        "numel": pa.int64(),  # elements of the local tensor (a DTensor's shard)
    },
    # numerics collector: one row per sampled step, matmul layer, GEMM operand, orientation and block-scaled format (amprobe.capture.collectors.operands; definitions: amprobe.store.blockformats)
    "blockstats": {
        "step": pa.int64(),
        "layer": pa.string(),  # qualified module name, as numerics' ``module``
        "layer_type": pa.string(),  # class name
        "operand": pa.string(),  # x (input) | w (weight) | dy (output gradient)
        "orientation": pa.string(),  # fwd | wgrad | dgrad | both (2-D tiles) | tensor (one scale)
        "format": pa.string(),  # a blockformats.FORMATS key
        "dtype": pa.string(),  # the operand's dtype
        "rows": pa.int64(),  # canonical 2-D shape of the last call: X [T, K], W [N, K], dY [T, N]
        "cols": pa.int64(),
        "calls": pa.int64(),  # calls pooled in the step
        "approx": pa.string(),  # "" when exact, else why (a DTensor's local shard, conv blocks)
        # blockformats.STAT_FIELDS, summed over the step's calls
        "elements": pa.int64(),
        "nonzero": pa.int64(),  # finite and not 0
        "nonfinite": pa.int64(),  # inf/NaN: left out of every count below
        "flushed": pa.int64(),  # nonzero values the cast makes 0
        "clipped": pa.int64(),  # nonzero values the cast saturates
        "blocks": pa.int64(),  # blocks (or tiles; 1 per tensor), all-zero ones included
        "scale_under": pa.int64(),  # blocks whose own scale underflows its format
        "scale_sat": pa.int64(),  # blocks whose own scale saturates its format
        "signal": pa.float64(),  # sum of x**2 (gradients divided by the loss scale)
        "noise": pa.float64(),  # sum of (x - cast(x))**2; SQNR dB = 10 log10(signal / noise)
    },
}


#: Types of the manifest fields that amprobe reads back (run and rank manifests). A field of
#: another type is reported by the loader as damaged and ignored. ``int`` never admits ``bool``.
MANIFEST_FIELDS: dict[str, tuple[type, ...]] = {
    "world_size": (int,),
    "rank": (int,),
    "local_rank": (int,),
    "pid": (int,),
    "hostname": (str,),
    "nccl_nan_check": (str,),  # TORCH_NCCL_NAN_CHECK's value; None: not set
    "argv": (list,),
    "device": (str,),
    "gpu_name": (str,),
    "gpu_capability": (str,),
    "gpu_memory_bytes": (int,),
    "bf16_supported": (bool,),
    "cuda_version": (str,),
    "config": (dict,),
    "control": (dict,),
    "baseline_run": (str,),
    "forced_fp32": (bool,),
    "start_unix": (int, float),
    "created_unix": (int, float),
}

#: Types of the fields of ``end.json`` (the clean-close marker) that amprobe reads back.
END_FIELDS: dict[str, tuple[type, ...]] = {
    "status": (str,),
    "steps": (int,),
    "end_unix": (int, float),
    "lost_rows": (dict,),  # table name -> rows lost
    "lost_steps": (list,),  # [first, last] step of the rows lost
    "write_errors": (list,),  # one line per distinct write error
}
