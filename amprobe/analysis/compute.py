"""The compute profile: Tensor Core alignment, autocast coverage, fp32 modules and MFU.

Pure functions of the ``compute_ops`` / ``compute_steps`` tables written by the ``compute``
collector.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from amprobe.analysis.frames import autocast_dtypes
from amprobe.analysis.peaks import lookup_peak, precision_of
from amprobe.store.loader import Run

__all__ = [
    "ALIGNMENT",
    "FP32_REASONS",
    "pad_to",
    "required_multiple",
    "latest_capture",
    "latest_alignment",
    "alignment_frame",
    "autocast_coverage",
    "fp32_modules",
    "amp_configured",
    "compute_mfu",
]

#: operand dtype (or ``tf32``) -> the multiple of elements Tensor Cores need (NVIDIA's
#: Matrix Multiplication Background User's Guide, Tensor Core Requirements).
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
# tile-quantization check (NVIDIA matmul guide, "Tile Quantization": 96 -> 128)
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
    """The op rows and step row of the last captured step of each rank (computed once per run)."""
    ops, steps = run.cached("latest_capture", _latest_capture)
    return ops, steps


def _latest_capture(run: Run) -> tuple[pd.DataFrame, pd.DataFrame]:
    ops, steps = run.table("compute_ops"), run.table("compute_steps")
    if steps.empty:
        return ops.iloc[0:0], steps
    # each rank's last captured step (a row without a rank or a step is in no rank's)
    last: dict[Any, Any] = {}
    for rank, step in zip(steps["rank"].tolist(), steps["step"].tolist(), strict=True):
        if not (pd.isna(rank) or pd.isna(step)) and (rank not in last or step > last[rank]):
            last[rank] = step
    steps = steps[steps["step"].to_numpy() == steps["rank"].map(last).to_numpy()]
    ops = ops[ops["step"].to_numpy() == ops["rank"].map(last).to_numpy()]
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
    # a row's results depend on these columns alone, and a run's rows repeat a few layer
    # shapes (every rank of a data-parallel job, every capture of a rank): each distinct
    # one is judged once (the dicts copied per row, each row's its own)
    columns = [c for c in _ALIGNMENT_COLUMNS if c in out.columns]
    judged: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for values in zip(*(out[c].tolist() for c in columns), strict=True):
        key = tuple(None if _missing(v) else v for v in values)
        if key not in judged:
            judged[key] = _alignment(
                dict(zip(columns, key, strict=True)), tf32, tile, min_tile_efficiency, small_dim
            )
        multiple, broken, padded, ok, small = judged[key]
        multiples.append(multiple)
        bad.append(dict(broken))
        suggested.append(dict(padded))
        aligned.append(ok)
        waste.append(dict(small))
    out["multiple"] = multiples
    out["misaligned"] = bad
    out["suggested"] = suggested
    out["aligned"] = aligned
    out["tile_waste"] = waste
    return out


#: the op columns :func:`alignment_frame` judges a row by
_ALIGNMENT_COLUMNS = ("in_dtype", "op", "phase", "m", "n", "k", "cin", "cout")


def _missing(value: Any) -> bool:
    """A missing cell (None, NaN, NA) of a frame column's ``tolist()``."""
    return value is None or value is pd.NA or (isinstance(value, float) and value != value)


def _alignment(
    row: dict[str, Any], tf32: bool, tile: int, min_tile_efficiency: float, small_dim: int
) -> tuple[int | None, dict[str, int], dict[str, int], bool | None, dict[int, int]]:
    """One op row's (multiple, misaligned dims, padded sizes, aligned, tile waste) as
    :func:`alignment_frame` describes them."""
    multiple = required_multiple(row.get("in_dtype"), tf32)
    if multiple is None:
        return None, {}, {}, None, {}
    broken = {d: v for d, v in _checked_dims(row).items() if v % multiple}
    small = {}
    for d, v in _tile_dims(row).items():
        if d in broken or v >= small_dim:
            continue
        padded = pad_to(v, tile)
        if v / padded < min_tile_efficiency:
            small[v] = padded
    return multiple, broken, {d: pad_to(v, multiple) for d, v in broken.items()}, not broken, small


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


def amp_configured(run: Run) -> list[str]:
    seen = []
    # GradScaler(enabled=args.amp) with AMP off is the usual switch for fp32 runs: not AMP
    if any(e.get("enabled", True) is not False for e in run.events_of("scaler_created")):
        seen.append("GradScaler")
    if autocast_dtypes(run):
        seen.append("autocast(" + ", ".join(sorted(autocast_dtypes(run))) + ")")
    return seen


def latest_alignment(
    run: Run,
    tf32: bool | None = None,
    tile: int = 64,
    min_tile_efficiency: float = 0.8,
    small_dim: int = 256,
) -> pd.DataFrame:
    """:func:`alignment_frame` of the last captured step of each rank (computed once per run).

    ``tf32`` defaults to whether the captured step allowed TF32 matmuls. The rules and the
    report ask with the same parameters, so the frame is computed once.
    """
    ops, steps = latest_capture(run)
    if tf32 is None:
        tf32 = bool(steps["tf32"].fillna(False).any()) if len(steps) else False
    key = f"alignment:{tf32}:{tile}:{min_tile_efficiency}:{small_dim}"
    return run.cached(
        key,
        lambda _: alignment_frame(
            ops, tf32=tf32, tile=tile, min_tile_efficiency=min_tile_efficiency, small_dim=small_dim
        ),
    )


def compute_mfu(run: Run) -> dict[str, Any]:
    """Model FLOPs utilization of the lowest rank (computed once per run; see :func:`_mfu`)."""
    return dict(run.cached("mfu", _mfu))


def _mfu(run: Run) -> dict[str, Any]:
    """Model FLOPs utilization of the lowest rank: ideal matmul time at peak over step time.

        Algorithm: FLOPs per step come from the last captured step (forward + backward
        matmul/conv/attention FLOPs, per operand precision); the step time is the median
        ``wall_s`` of the steps that were not captured (capture slows a step down) and, when
        others exist, not step 0 (warm-up). MFU = sum(FLOPs_p / peak_p) / step time, which is
        achieved FLOP/s over peak when one precision is used. Peaks come from
    :mod:`amprobe.analysis.peaks`; without a known peak (CPU, unlisted GPU) only the achieved
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
    steps = run.rank_table("steps", rank)  # the one rank's rows, not every rank's
    captured_steps = run.table("compute_steps")
    captured = set(captured_steps.loc[captured_steps["rank"] == rank, "step"].astype(int))
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
