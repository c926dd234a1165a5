"""Why is AMP not faster, from the compute profile: thin model, misaligned GEMMs, autocast misses.

Pure functions of the ``compute_ops`` / ``compute_steps`` tables written by the ``compute``
collector, plus the rules AMP-S02, AMP-S04 and AMP-S05 and the MFU health metric.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pandas as pd

from amprobe.rules.data import HALF_DTYPES, autocast_dtypes
from amprobe.rules.engine import Finding, RuleContext, requirement, rule
from amprobe.rules.peaks import lookup_peak, precision_of
from amprobe.store.loader import Run

__all__ = [
    "ALIGNMENT",
    "MATMUL_GUIDE",
    "FC_GUIDE",
    "FP32_REASONS",
    "pad_to",
    "required_multiple",
    "latest_capture",
    "alignment_frame",
    "autocast_coverage",
    "fp32_modules",
    "compute_mfu",
]

MATMUL_GUIDE = (
    "NVIDIA Matrix Multiplication Background User's Guide, Tensor Core Requirements: "
    "https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/index.html"
)
FC_GUIDE = (
    "NVIDIA Linear/Fully-Connected Layers User's Guide: "
    "https://docs.nvidia.com/deeplearning/performance/dl-performance-fully-connected/index.html"
)

#: operand dtype (or ``tf32``) -> the multiple of elements Tensor Cores need (MATMUL_GUIDE).
ALIGNMENT: dict[str, int] = {
    "float16": 8,
    "bfloat16": 8,
    "tf32": 4,
    "float8_e4m3fn": 16,
    "float8_e5m2": 16,
    "float8_e4m3fnuz": 16,
    "float8_e5m2fnuz": 16,
    "int8": 16,
}

#: autocast state of an fp32 forward op -> why it stayed fp32.
FP32_REASONS: dict[str, str] = {
    "outside": "outside autocast (no autocast region for its device)",
    "disabled": "autocast disabled (inside autocast(enabled=False))",
    "enabled": "op on autocast's fp32 list (or a custom_fwd that casts to fp32)",
}

_CONV = {
    "convolution",
    "_convolution",
    "convolution_backward",
    "cudnn_convolution",
    "convolution_overrideable",
}
# tile-quantization check (MATMUL_GUIDE "Tile Quantization"; checklist G§5.2 #4: 96 -> 128)
_TILE_OPS = {"mm", "addmm", "_addmm_activation", "convolution", "_convolution"}


def pad_to(size: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` not below ``size`` (100, 8 -> 104)."""
    return -(-int(size) // multiple) * multiple


def required_multiple(in_dtype: str | None, tf32: bool = False) -> int | None:
    """The element multiple Tensor Cores need for an operand dtype; None when they do not run."""
    if in_dtype == "float32":
        return ALIGNMENT["tf32"] if tf32 else None
    return ALIGNMENT.get(in_dtype or "")


def _is_attention(op: str) -> bool:
    return op.startswith(("_scaled_dot_product_", "_flash_attention", "_efficient_attention"))


def _checked_dims(row: Any) -> dict[str, int]:
    """The dimensions whose alignment matters for an op row: GEMM M/N/K, conv channels, head dim."""
    op = str(row["op"])
    if op in _CONV:
        dims = {"Cin": row["cin"], "Cout": row["cout"]}
    elif _is_attention(op):
        dims = {"head_dim": row["k"]}
    else:
        dims = {"M": row["m"], "N": row["n"], "K": row["k"]}
    return {name: int(v) for name, v in dims.items() if v is not None and not pd.isna(v)}


def _tile_dims(row: Any) -> dict[str, int]:
    if row["phase"] != "forward" or str(row["op"]) not in _TILE_OPS:
        return {}
    dims = (
        {"Cin": row["cin"], "Cout": row["cout"]}
        if str(row["op"]) in _CONV
        else {"N": row["n"], "K": row["k"]}
    )
    return {name: int(v) for name, v in dims.items() if v is not None and not pd.isna(v)}


def latest_capture(run: Run) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The op rows and step row of the last captured step of each rank."""
    ops, steps = run.table("compute_ops"), run.table("compute_steps")
    if steps.empty:
        return ops.iloc[0:0], steps
    last = steps.groupby("rank")["step"].max()
    steps = steps[steps["step"] == steps["rank"].map(last)]
    ops = ops[ops["step"] == ops["rank"].map(last)]
    return ops, steps


def alignment_frame(
    ops: pd.DataFrame,
    tf32: bool = False,
    tile: int = 64,
    min_tile_efficiency: float = 0.8,
    small_dim: int = 256,
) -> pd.DataFrame:
    """Per op row: the Tensor Core multiple, the dims that break it, padded sizes, FLOP share.

    Columns added to ``ops``: ``multiple`` (None when Tensor Cores do not apply, e.g. fp32
    without TF32), ``misaligned`` ({dim: size}), ``suggested`` ({dim: padded size}),
    ``aligned`` (bool or None), ``flop_share`` (of the rank's step matmul FLOPs), ``tile_waste``
    ({size: next multiple of ``tile``} for aligned forward weight dims under ``small_dim`` that
    fill less than ``min_tile_efficiency`` of their last tile).
    """
    out = ops.copy()
    totals = out.groupby(["rank", "step"])["flops"].transform("sum")
    out["flop_share"] = (out["flops"] / totals.where(totals > 0)).fillna(0.0)
    multiples: list[int | None] = []
    bad: list[dict[str, int]] = []
    suggested: list[dict[str, int]] = []
    aligned: list[bool | None] = []
    waste: list[dict[int, int]] = []
    for row in out.to_dict("records"):
        multiple = required_multiple(row["in_dtype"], tf32)
        multiples.append(multiple)
        if multiple is None:
            bad.append({})
            suggested.append({})
            aligned.append(None)
            waste.append({})
            continue
        broken = {d: v for d, v in _checked_dims(row).items() if v % multiple}
        bad.append(broken)
        suggested.append({d: pad_to(v, multiple) for d, v in broken.items()})
        aligned.append(not broken)
        small = {}
        for d, v in _tile_dims(row).items():
            if d in broken or v >= small_dim:
                continue
            padded = pad_to(v, tile)
            if v / padded < min_tile_efficiency:
                small[v] = padded
        waste.append(small)
    out["multiple"] = multiples
    out["misaligned"] = bad
    out["suggested"] = suggested
    out["aligned"] = aligned
    out["tile_waste"] = waste
    return out


def autocast_coverage(ops: pd.DataFrame) -> pd.DataFrame:
    """Matmul/conv/attention FLOPs per rank and operand dtype, with their share."""
    if ops.empty:
        return pd.DataFrame(columns=["rank", "in_dtype", "flops", "share"])
    frame = ops.assign(in_dtype=ops["in_dtype"].fillna("unknown"))
    cov = frame.groupby(["rank", "in_dtype"], as_index=False)["flops"].sum()
    cov["share"] = cov["flops"] / cov.groupby("rank")["flops"].transform("sum")
    return cov.sort_values(["rank", "flops"], ascending=[True, False]).reset_index(drop=True)


def fp32_modules(ops: pd.DataFrame) -> pd.DataFrame:
    """Modules whose forward matmul FLOPs ran in fp32, with why and their FLOP share."""
    cols = ["rank", "module", "reason", "flops", "flop_share"]
    if ops.empty:
        return pd.DataFrame(columns=cols)
    total = ops.groupby("rank")["flops"].sum()
    fwd = ops[(ops["phase"] == "forward") & (ops["in_dtype"] == "float32")]
    if fwd.empty:
        return pd.DataFrame(columns=cols)
    fwd = fwd.assign(reason=fwd["autocast"].map(FP32_REASONS).fillna("unknown"))
    mods = fwd.groupby(["rank", "module", "reason"], as_index=False)["flops"].sum()
    # the module's backward GEMMs follow its forward dtype: count them in its share
    bwd = ops[(ops["phase"] == "backward") & (ops["in_dtype"] == "float32")]
    bwd_flops = bwd.groupby(["rank", "module"])["flops"].sum()
    mods["flops"] = [
        f + float(bwd_flops.get((r, m), 0.0))
        for r, m, f in zip(mods["rank"], mods["module"], mods["flops"], strict=True)
    ]
    mods["flop_share"] = mods["flops"] / mods["rank"].map(total)
    return mods.sort_values("flops", ascending=False).reset_index(drop=True)[cols]


def _framework_amp(run: Run) -> dict[str, Any] | None:
    """The first rank whose manifest says a framework asked for mixed precision, if any.

    Framework integrations (``amprobe.integrations``) write ``framework``,
    ``framework_precision_setting`` and ``framework_amp_dtype`` to the rank manifest.
    """
    for info in run.ranks:
        m = info.manifest
        if m.get("framework_amp_dtype") and m.get("framework"):
            return {
                "rank": info.rank,
                "framework": str(m["framework"]),
                "framework_precision": m.get("framework_precision"),
                "framework_precision_setting": str(
                    m.get("framework_precision_setting") or m.get("framework_precision")
                ),
                "framework_amp_dtype": str(m["framework_amp_dtype"]),
                "device": m.get("device"),
            }
    return None


def _amp_configured(run: Run) -> list[str]:
    seen = []
    if run.events_of("scaler_created"):
        seen.append("GradScaler")
    if autocast_dtypes(run):
        seen.append("autocast(" + ", ".join(sorted(autocast_dtypes(run))) + ")")
    return seen


def compute_mfu(run: Run) -> dict[str, Any]:
    """Model FLOPs utilization of the lowest rank: ideal matmul time at peak over step time.

    Algorithm: FLOPs per step come from the last captured step (forward + backward
    matmul/conv/attention FLOPs, per operand precision); the step time is the median
    ``wall_s`` of the steps that were not captured (capture slows a step down) and, when
    others exist, not step 0 (warm-up). MFU = sum(FLOPs_p / peak_p) / step time, which is
    achieved FLOP/s over peak when one precision is used. Peaks come from
    :mod:`amprobe.rules.peaks`; without a known peak (CPU, unlisted GPU) only the achieved
    FLOP/s is returned.
    """
    ops, csteps = latest_capture(run)
    if csteps.empty:
        return {
            "value": None,
            "note": "not measured: no step was captured by the compute collector",
        }
    rank = int(csteps["rank"].min())
    row = csteps[csteps["rank"] == rank].iloc[0]
    steps = run.steps
    steps = steps[steps["rank"] == rank] if len(steps) else steps
    captured = set(run.table("compute_steps").query("rank == @rank")["step"].astype(int))
    plain = steps[~steps["step"].isin(captured)] if len(steps) else steps
    if len(plain) > 1:
        plain = plain[plain["step"] != 0]
    wall = plain["wall_s"].dropna() if len(plain) else pd.Series(dtype=float)
    if wall.empty or float(wall.median()) <= 0:
        return {
            "value": None,
            "note": "not measured: no uncaptured step with a step time was recorded",
        }
    t_step = float(wall.median())
    flops = float(row["matmul_flops"])
    result: dict[str, Any] = {
        "achieved_flops_per_s": flops / t_step,
        "step_flops": flops,
        "step_s": t_step,
        "rank": rank,
    }
    manifest = next((r.manifest for r in run.ranks if r.rank == rank), run.rank_manifest)
    device = manifest.get("gpu_name") or manifest.get("device")
    peak = lookup_peak(manifest.get("gpu_name"))
    if peak is None:
        result.update(
            value=None,
            device=device,
            note=f"MFU not available: no peak throughput known for {device}; "
            f"achieved {flops / t_step / 1e12:.3g} TFLOP/s",
        )
        return result
    tf32 = bool(row["tf32"]) if not pd.isna(row["tf32"]) else False
    mine = ops[ops["rank"] == rank]
    ideal = 0.0
    by_precision: dict[str, float] = {}
    for dtype, part in mine.groupby(mine["in_dtype"].fillna("unknown")):
        precision = precision_of(str(dtype), tf32)
        tflops = peak.tflops.get(precision or "") or peak.tflops.get("fp32")
        f = float(part["flops"].sum())
        by_precision[precision or str(dtype)] = by_precision.get(precision or str(dtype), 0.0) + f
        if tflops:
            ideal += f / (tflops * 1e12)
    result.update(
        value=ideal / t_step,
        device=peak.name,
        peak_source=peak.source,
        flops_by_precision=by_precision,
    )
    return result


# -- requirements ---------------------------------------------------------------------------------
@requirement("compute")
def _has_compute(run: Run) -> str | None:
    if len(run.table("compute_steps")):
        return None
    collectors = (run.rank_manifest.get("config") or {}).get("collectors") or []
    if "compute" not in collectors:
        return 'the compute collector was not enabled (add "compute" to Config.collectors)'
    return "no step was captured (the first capture is at step 1, then every shapes_every steps)"


# -- rules ----------------------------------------------------------------------------------------
@rule(
    "AMP-S02",
    "thin-model",
    "info",
    "speed",
    requires=("compute",),
    thresholds={"min_params": 1_000_000, "min_flops_per_byte": 8.0},
    refs=("G§5.2 #2", "G§5.3 #1"),
)
def check_thin_model(ctx: RuleContext) -> Iterator[Finding]:
    """Matmul/conv work is small next to the memory traffic of the rest, or the model is tiny.

    Algorithm: on the last captured step, arithmetic intensity = matmul/conv/attention FLOPs
    over the bytes read and written by every other forward/backward op (optimizer excluded);
    below ``min_flops_per_byte`` the step is dominated by memory traffic and launches, which
    half precision speeds up far less than Tensor Core math. Independently, fewer trainable
    parameters than ``min_params`` (from ``model_params`` events) marks a small model.
    """
    run = ctx.run
    _, csteps = latest_capture(run)
    params = sum(
        int(e.get("trainable_params") or 0)
        for e in run.events_of("model_params")
        if e.get("rank", 0) == int(csteps["rank"].min())
    )
    for row in csteps.sort_values("rank").to_dict("records"):
        flops, moved = float(row["matmul_flops"] or 0.0), float(row["other_bytes"] or 0.0)
        intensity = flops / moved if moved > 0 else math.inf
        low = intensity < ctx.thresholds["min_flops_per_byte"]
        small = 0 < params < ctx.thresholds["min_params"]
        if not (low or small):
            continue
        why = []
        if low:
            why.append(f"{intensity:.2g} matmul FLOPs per byte moved by other ops")
        if small:
            why.append(f"{params:,} trainable parameters")
        yield ctx.finding(
            title="thin model: " + " and ".join(why),
            evidence={
                "rank": int(row["rank"]),
                "step": int(row["step"]),
                "matmul_flops": flops,
                "other_bytes": moved,
                "flops_per_byte": round(intensity, 3) if math.isfinite(intensity) else None,
                "trainable_params": params or None,
                "min_flops_per_byte": ctx.thresholds["min_flops_per_byte"],
                "min_params": ctx.thresholds["min_params"],
            },
            fix=(
                "AMP's gain here is memory, not speed: keep it to fit larger batches or stay in fp32. "
                "For speed, give the GPU more matmul work per step (larger batch, wider layers) "
                "or fuse the elementwise ops (torch.compile)."
            ),
        )
        return


@rule(
    "AMP-S04",
    "tc-misaligned",
    "warning",
    "speed",
    requires=("compute",),
    thresholds={"min_flop_share": 0.01, "tile": 64, "min_tile_efficiency": 0.8, "small_dim": 256},
    refs=("G§1.2", "G§5.2 #4", MATMUL_GUIDE, FC_GUIDE),
)
def check_tc_misaligned(ctx: RuleContext) -> Iterator[Finding]:
    """Tensor Core matmuls whose dimensions are not multiples of what their dtype needs.

    Algorithm: for each op of the last captured step that runs in a Tensor Core precision
    (fp16/bf16: 8, TF32: 4, fp8/int8: 16 elements; fp32 without TF32 is skipped), check GEMM
    M/N/K, conv Cin/Cout and attention head dim; a warning when the misaligned ops carry at
    least ``min_flop_share`` of the step's matmul FLOPs, naming each module, its dims and the
    padded sizes. Aligned forward weight dims under ``small_dim`` that fill less than
    ``min_tile_efficiency`` of a ``tile``-wide tile (96 -> 128) are reported as info.
    """
    ops, csteps = latest_capture(ctx.run)
    if ops.empty:
        return
    th = ctx.thresholds
    tf32 = bool(csteps["tf32"].fillna(False).any())
    frame = alignment_frame(
        ops,
        tf32=tf32,
        tile=int(th["tile"]),
        min_tile_efficiency=th["min_tile_efficiency"],
        small_dim=int(th["small_dim"]),
    )
    roots = {str(e.get("model_class")) for e in ctx.run.events_of("model_registered")}
    for rank, part in frame.groupby("rank", sort=True):
        manifests = [r.manifest for r in ctx.run.ranks if r.rank == int(rank)]
        on_cpu = bool(manifests) and str(manifests[0].get("device") or "").startswith("cpu")
        gpu_note = " (would waste Tensor Core tiles on a GPU)" if on_cpu else ""
        bad = part[part["aligned"].eq(False)]
        share = float(bad["flop_share"].sum())
        # ops booked on a root model ran in no named layer (e.g. the backward of the last layer)
        named_bad = bad[~bad["module"].astype(str).isin(roots)]
        if len(bad) and share >= th["min_flop_share"]:
            layers: list[dict[str, Any]] = []
            for module, mods in (named_bad if len(named_bad) else bad).groupby(
                "module", sort=False
            ):
                sizes: dict[int, int] = {}
                for mis, sug in zip(mods["misaligned"], mods["suggested"], strict=True):
                    for dim, size in mis.items():
                        sizes[int(size)] = int(sug[dim])
                layers.append(
                    {
                        "module": str(module),
                        "ops": sorted(set(mods["op"])),
                        "dims": {str(k): v for k, v in sorted(sizes.items())},
                        "dtype": str(mods["in_dtype"].mode().iloc[0]),
                        "multiple": int(mods["multiple"].iloc[0]),
                        "flop_share": round(float(mods["flop_share"].sum()), 4),
                    }
                )
            layers.sort(key=lambda d: -d["flop_share"])
            named = "; ".join(
                f"{d['module']} (" + ", ".join(f"{k} -> {v}" for k, v in d["dims"].items()) + ")"
                for d in layers[:6]
            )
            yield ctx.finding(
                title=f"{share:.1%} of matmul FLOPs run with dims that are not Tensor Core multiples{gpu_note}: {named}",
                evidence={
                    "rank": int(rank),
                    "step": int(part["step"].iloc[0]),
                    "misaligned_flop_share": round(share, 4),
                    "layers": layers,
                    "min_flop_share": th["min_flop_share"],
                },
                fix=(
                    "Pad these sizes to the suggested multiple (fp16/bf16: 8, TF32: 4, fp8/int8: 16): "
                    "hidden sizes and channels in the model definition, the vocabulary by adding "
                    "unused tokens, the batch x sequence product by choosing them accordingly. "
                    + "Suggested: "
                    + "; ".join(
                        f"{d['module']}: " + ", ".join(f"{k} -> {v}" for k, v in d["dims"].items())
                        for d in layers
                    )
                ),
            )
        waste = part[part["tile_waste"].map(bool)]
        if len(waste) and float(waste["flop_share"].sum()) >= th["min_flop_share"]:
            items: dict[str, dict[int, int]] = {}
            for module, tw in zip(waste["module"], waste["tile_waste"], strict=True):
                if str(module) not in roots:
                    items.setdefault(str(module), {}).update(tw)
            verb = "would waste Tensor Core tiles on a GPU" if on_cpu else "waste Tensor Core tiles"
            yield ctx.finding(
                title=f"aligned but small layer sizes {verb}: "
                + "; ".join(
                    f"{m} (" + ", ".join(f"{v} -> {p}" for v, p in sorted(dims.items())) + ")"
                    for m, dims in list(items.items())[:6]
                ),
                evidence={
                    "rank": int(rank),
                    "layers": [
                        {"module": m, "dims": {str(v): p for v, p in sorted(dims.items())}}
                        for m, dims in items.items()
                    ],
                    "tile": th["tile"],
                    "min_tile_efficiency": th["min_tile_efficiency"],
                },
                fix=(
                    "Small dimensions fill only part of a Tensor Core tile; rounding them up to the "
                    "tile size (e.g. 96 -> 128 channels, G§5.2 #4) can be faster at little cost."
                ),
                severity="info",
            )


@rule(
    "AMP-S05",
    "autocast-ineffective",
    "error",
    "speed",
    requires=("compute",),
    thresholds={"min_half_share": 0.5},
    refs=("G§4.1",),
)
def check_autocast_ineffective(ctx: RuleContext) -> Iterator[Finding]:
    """AMP is configured, yet most matmul FLOPs still run in fp32.

    Algorithm: when a framework integration recorded that the framework was asked for mixed
    precision (``framework_amp_dtype`` in the manifest) and no enabled autocast region ran, the
    finding names that setting (the job trained in fp32). Otherwise AMP counts as configured
    when a GradScaler or an enabled autocast region was seen. On the last captured step, the share of matmul/conv/attention FLOPs whose operands
    were fp16/bf16/fp8 is compared with ``min_half_share``; the finding names the modules that
    stayed fp32 and why (outside autocast, autocast disabled, op on autocast's fp32 list).
    """
    run = ctx.run
    asked = _framework_amp(run)
    if asked is not None and not autocast_dtypes(run):
        yield ctx.finding(
            title=(
                f"{asked['framework_precision_setting']} asks {asked['framework']} for mixed "
                f"precision, but no enabled autocast region ran: the job trained in fp32"
            ),
            evidence={
                "rank": int(asked["rank"]),
                "framework": asked["framework"],
                "framework_precision": asked.get("framework_precision"),
                "framework_precision_setting": asked["framework_precision_setting"],
                "framework_amp_dtype": asked["framework_amp_dtype"],
                "device": asked.get("device"),
                "autocast_regions": 0,
            },
            fix=(
                "The framework's mixed-precision setting had no effect on this device. On a CPU the "
                "Hugging Face Trainer (fp16=True) and accelerate (mixed_precision='fp16') run no "
                "fp16 autocast: use bf16 there (bf16=True / mixed_precision='bf16'), or train on "
                "a GPU; with a custom loop, run the forward pass inside accelerator.autocast()."
            ),
        )
        return
    configured = _amp_configured(run)
    if not configured:
        return
    ops, _ = latest_capture(run)
    if ops.empty:
        return
    cov = autocast_coverage(ops)
    modules = fp32_modules(ops)
    for rank, part in cov.groupby("rank", sort=True):
        low = part["in_dtype"].isin(HALF_DTYPES) | part["in_dtype"].str.startswith("float8")
        half = float(part.loc[low, "share"].sum())
        if half >= ctx.thresholds["min_half_share"]:
            continue
        mods = modules[modules["rank"] == rank].head(10)
        reasons = sorted(set(mods["reason"]))
        yield ctx.finding(
            title=(
                f"AMP is configured ({', '.join(configured)}) but only {half:.0%} of matmul FLOPs "
                f"run in half precision"
            ),
            evidence={
                "rank": int(rank),
                "half_flop_share": round(half, 4),
                "flops_by_dtype": {
                    str(d): float(f) for d, f in zip(part["in_dtype"], part["flops"], strict=True)
                },
                "fp32_modules": [
                    {"module": m, "reason": r, "flop_share": round(float(s), 4)}
                    for m, r, s in zip(
                        mods["module"], mods["reason"], mods["flop_share"], strict=True
                    )
                ],
                "reasons": reasons,
                "amp_seen": configured,
                "min_half_share": ctx.thresholds["min_half_share"],
            },
            fix=(
                "Run the forward pass and the loss inside torch.autocast(device_type, dtype=...); a "
                "GradScaler alone changes no dtype. Modules that run outside that region, in an "
                "autocast(enabled=False) block, or were built/loaded outside the policy stay fp32."
            ),
        )
