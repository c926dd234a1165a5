"""Why is AMP not faster, from the compute profile: thin model, misaligned GEMMs, autocast misses.

Rules AMP-S02, AMP-S04 and AMP-S05 over the analysis of :mod:`amprobe.analysis.compute`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd

from amprobe.analysis.compiled import is_compiled
from amprobe.analysis.compute import (
    amp_configured,
    autocast_coverage,
    fp32_modules,
    latest_alignment,
    latest_capture,
)
from amprobe.rules.data import HALF_DTYPES, autocast_dtypes
from amprobe.rules.engine import Finding, RuleContext, requirement, rule
from amprobe.rules.refs import AMP_DOCS, AUTOCAST_OPS, FC_GUIDE, MATMUL_GUIDE, TUNING_GUIDE
from amprobe.store.loader import Run

__all__: list[str] = []


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
    refs=(TUNING_GUIDE, MATMUL_GUIDE),
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
    compiled = is_compiled(run)
    _, csteps = latest_capture(run)
    first_rank = int(csteps["rank"].min())
    params = sum(
        int(e.get("trainable_params") or 0)
        for e in run.events_of("model_params")
        if e.get("rank", 0) == first_rank
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
                "trainable_param_count": params or None,
                "min_flops_per_byte": ctx.thresholds["min_flops_per_byte"],
                "min_params": ctx.thresholds["min_params"],
            },
            fix=(
                "AMP's gain here is memory, not speed: keep it to fit larger batches or stay in fp32. "
                "For speed, give the GPU more matmul work per step (larger batch, wider layers)"
                + (
                    "; the model is compiled already, so its elementwise ops are fused."
                    if compiled
                    else " or fuse the elementwise ops (torch.compile)."
                )
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
    refs=(MATMUL_GUIDE, FC_GUIDE),
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
    ops, _ = latest_capture(ctx.run)
    if ops.empty:
        return
    th = ctx.thresholds
    frame = latest_alignment(
        ctx.run,
        tile=int(th["tile"]),
        min_tile_efficiency=th["min_tile_efficiency"],
        small_dim=int(th["small_dim"]),
    )
    registered = ctx.run.events_of("model_registered")
    roots = {str(e.get("model_class")) for e in registered}
    if len(registered) > 1:  # several roots: ops outside their layers are booked on root names
        roots |= {str(e["name"]) for e in registered if e.get("name")}
    # ranks whose rows (and device) are equal get equal findings: judged once per class of
    # them, the key being the rows themselves (thousands of data-parallel ranks run one model)
    device = {r.rank: str(r.manifest.get("device") or "") for r in ctx.run.ranks}
    ranks_col = frame["rank"].to_numpy()
    # the rows as tuples of the columns' values (a frame's to_dict boxes every cell: 0.4 s at
    # 4,096 ranks); only compared with each other, as the key of a class of ranks
    rows = list(zip(*(frame[c].tolist() for c in frame.columns if c != "rank"), strict=True))
    positions: dict[int, list[int]] = {}
    for i, r in enumerate(ranks_col.tolist()):
        positions.setdefault(int(r), []).append(i)
    judged: dict[str, list[Finding]] = {}
    for rank in sorted(positions):
        at = positions[rank]
        on_cpu = device.get(rank, "").startswith("cpu")
        key = repr((on_cpu, [rows[i] for i in at]))
        if key not in judged:
            part = frame.iloc[at]
            judged[key] = list(_tc_findings(ctx, rank, part, on_cpu, roots))
            yield from judged[key]
            continue
        for f in judged[key]:
            yield dataclasses.replace(f, evidence={**f.evidence, "rank": rank})


def _tc_findings(
    ctx: RuleContext, rank: int, part: pd.DataFrame, on_cpu: bool, roots: set[str]
) -> Iterator[Finding]:
    """AMP-S04's findings on one rank's alignment rows."""
    th = ctx.thresholds
    gpu_note = " (would waste Tensor Core tiles on a GPU)" if on_cpu else ""
    bad = part[part["aligned"].eq(False)]
    share = float(bad["flop_share"].sum())
    # ops booked on a root model ran in no named layer (e.g. the backward of the last layer);
    # they are named only when no named layer is misaligned (the root is itself the layer)
    named_bad = bad[~bad["module"].astype(str).isin(roots)]
    if len(bad) and share >= th["min_flop_share"]:
        layers: list[dict[str, Any]] = []
        for module, mods in (named_bad if len(named_bad) else bad).groupby("module", sort=False):
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
        # as above: a root's ops are its own layer's when no named layer wastes tiles
        # (a bare nn.Linear as the model is booked under its class name)
        named_waste = waste[~waste["module"].astype(str).isin(roots)]
        shown = named_waste if len(named_waste) else waste
        items: dict[str, dict[int, int]] = {}
        for module, tw in zip(shown["module"], shown["tile_waste"], strict=True):
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
                "tile size (e.g. 96 -> 128 channels) can be faster at little cost."
            ),
            severity="info",
        )


def _framework_amp(run: Run) -> dict[str, Any] | None:
    """The first rank whose manifest says a framework asked for autocast mixed precision, if
    any; a framework that casts the parameters itself (FSDP2's ``MixedPrecisionPolicy``,
    ``framework_casts_params``) needs no autocast region."""
    for info in run.ranks:
        m = info.manifest
        if m.get("framework_casts_params"):
            continue
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


@rule(
    "AMP-S05",
    "autocast-ineffective",
    "error",
    "speed",
    requires=("amp_as_written", "compute"),
    thresholds={"min_half_share": 0.5},
    refs=(AMP_DOCS, AUTOCAST_OPS),
)
def check_autocast_ineffective(ctx: RuleContext) -> Iterator[Finding]:
    """AMP is configured, yet most matmul FLOPs still run in fp32.

    Algorithm: when the framework was asked for autocast mixed precision
    (``framework_amp_dtype`` in the manifest, written by the integrations or read from the
    framework's state in zero-code runs; not when it casts the parameters itself, as FSDP2's
    ``MixedPrecisionPolicy`` does) and no enabled autocast region ran, the finding names that setting (the job trained
    in fp32). Otherwise AMP counts as configured when a GradScaler or an enabled autocast
    region was seen. On the last captured step, the share of matmul/conv/attention FLOPs whose
    operands were fp16/bf16/fp8 is compared with ``min_half_share``; the finding names the
    modules that stayed fp32 and why (outside autocast, autocast disabled, op on autocast's
    fp32 list).
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
                "autocast_region_count": 0,
            },
            fix=(
                "The framework's mixed-precision setting had no effect on this device. On a CPU the "
                "Hugging Face Trainer (fp16=True) and accelerate (mixed_precision='fp16') run no "
                "fp16 autocast: use bf16 there (bf16=True / mixed_precision='bf16'), or train on "
                "a GPU; with a custom loop, run the forward pass inside accelerator.autocast()."
            ),
        )
        return
    configured = amp_configured(run)
    if not configured:
        return
    ops, _ = latest_capture(run)
    if ops.empty:
        return
    cov = autocast_coverage(ops)
    modules = None  # the fp32 modules, computed for the first rank that needs them
    # the half-precision share of every rank from whole columns, each rank's rows summed as
    # pandas sums a rank's part (numpy's sum of its half rows, in order; NaN as 0): a frame
    # operation per rank cost 0.3 ms, 1.3 s at 4,096 ranks
    dtypes = cov["in_dtype"]
    low = (dtypes.isin(HALF_DTYPES) | dtypes.str.startswith("float8")).to_numpy(dtype=bool)
    shares = np.nan_to_num(cov["share"].to_numpy(dtype=float), nan=0.0)
    for rank, (start, end) in _rank_spans(cov["rank"].to_numpy()):
        half = float(shares[start:end][low[start:end]].sum())
        if half >= ctx.thresholds["min_half_share"]:
            continue
        part = cov.iloc[start:end]
        if modules is None:
            modules = fp32_modules(ops)
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


def _rank_spans(ranks: np.ndarray) -> list[tuple[Any, tuple[int, int]]]:
    """``(rank, (start, end))`` of each rank's rows of a frame sorted by rank, in rank order
    (as ``groupby("rank", sort=True)`` iterates a frame whose ranks are together)."""
    if not len(ranks):
        return []
    starts = np.flatnonzero(np.r_[True, ranks[1:] != ranks[:-1]])
    ends = [*starts[1:].tolist(), len(ranks)]
    return [(ranks[a], (int(a), int(b))) for a, b in zip(starts.tolist(), ends, strict=True)]
