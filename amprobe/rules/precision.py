"""Rules on the precision set-up: dtypes of autocast, loss and weights (checklist section A)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from amprobe.analysis.frames import MAX_LISTED_STEPS
from amprobe.analysis.numerics import layer_overflow_evidence, nonfinite_input_steps
from amprobe.analysis.runtime import expand_steps, rank_runtime, rank_step_counts, summary_steps
from amprobe.analysis.scaler import calibration_steps, scaler_summaries
from amprobe.rules.data import (
    HALF_DTYPES,
    autocast_dtypes,
    per_rank,
    scaler_steps,
    step_ranges,
    steps_list,
)
from amprobe.rules.engine import Finding, RuleContext, rule
from amprobe.rules.refs import AMP_DOCS, AUTOCAST_OPS, GRADIENT_SCALING, TYPICAL_EXAMPLE
from amprobe.store.loader import Run

__all__: list[str] = []


@rule(
    "AMP-N11",
    "prefer-bf16",
    "warning",
    "nan",
    requires=("amp_as_written", "scaler", "autocast", "device_facts"),
    thresholds={"warn_skip_share": 0.05},
    refs=(AMP_DOCS,),
    # the overflow it reads comes from these; bf16 is the alternative to fixing them
    explained_by=("AMP-N05", "AMP-N08", "AMP-N10"),
)
def check_prefer_bf16(ctx: RuleContext) -> Iterator[Finding]:
    """An fp16 run with overflow cuts or NaN on hardware that supports bf16.

    Info when the scale was cut at all; warning when more than ``warn_skip_share`` of the
    steps were skipped. The steps of the initial calibration
    (:func:`~amprobe.analysis.scaler.compute_calibration`) and steps with a non-finite model input
    (AMP-N04's) are left out of both. bf16 support comes from the rank manifest (CUDA capability
    >= 8.0, or a CPU with AVX512-BF16/AMX).
    """
    run = ctx.run
    if "float16" not in autocast_dtypes(run):
        return
    supported = [r.rank for r in run.ranks if r.manifest.get("bf16_supported")]
    if not supported:
        return
    for rank, frame in per_rank(scaler_steps(run)):
        calibration = calibration_steps(run, rank)
        left_out = set(nonfinite_input_steps(run, rank)) | set(calibration)  # bad data: AMP-N04
        frame = frame[~frame["step"].isin(left_out)]
        if frame.empty:
            continue
        skipped = frame["skipped"].fillna(False).astype(bool)
        cuts = int((frame["scale_after"] < frame["scale_before"]).sum())
        if cuts == 0 and not skipped.any():
            continue
        share = float(skipped.mean())
        device = run.rank_manifest.get("gpu_name") or run.rank_manifest.get("device")
        yield ctx.finding(
            title=f"fp16 run overflowed ({cuts} scale cuts, {share:.1%} steps skipped"
            + (
                f", not counting {len(calibration)} step(s) of initial calibration"
                if calibration
                else ""
            )
            + f") on {device}, which supports bf16",
            evidence={
                "rank": rank,
                "scale_cut_count": cuts,
                "skipped_share": round(share, 4),
                "skipped_steps": steps_list(frame.loc[skipped, "step"]),
                "skipped_step_ranges": step_ranges(frame.loc[skipped, "step"]),
                "calibration_step_count": len(calibration),
                "device": device,
                "warn_skip_share": ctx.thresholds["warn_skip_share"],
                **layer_overflow_evidence(run, rank),
            },
            fix=(
                "Use torch.autocast(..., dtype=torch.bfloat16): bf16 has fp32's exponent range, "
                "so these overflows disappear and the GradScaler can be dropped."
            ),
            severity="warning" if share > ctx.thresholds["warn_skip_share"] else "info",
        )
        return


@rule(
    "AMP-N12",
    "fp16-without-scaler",
    "warning",
    "nan",
    requires=("amp_as_written", "steps", "autocast"),
    refs=(GRADIENT_SCALING, TYPICAL_EXAMPLE),
)
def check_fp16_without_scaler(ctx: RuleContext) -> Iterator[Finding]:
    """fp16 autocast with no enabled GradScaler: small gradients underflow to zero."""
    run = ctx.run
    dtypes = autocast_dtypes(run)
    facts = scaler_summaries(run)
    if "float16" not in dtypes or any(f["n"] for f in facts.values()):
        return
    scaler_count = sum(f["created"] for f in facts.values())
    disabled = sum(f["disabled"] for f in facts.values())
    yield ctx.finding(
        title="fp16 autocast without a GradScaler"
        + (" (the scaler is disabled)" if disabled else ""),
        evidence={
            "autocast_dtypes": sorted(dtypes),
            "scaler_count": scaler_count,
            "disabled_scaler_count": disabled,
            "step_count": _distinct_step_count(run, facts),
        },
        fix=(
            "Use torch.amp.GradScaler: scaler.scale(loss).backward(); scaler.step(opt); "
            "scaler.update(). Unscaled fp16 gradients below 6e-8 become zero."
        ),
    )


def _distinct_step_count(run: Run, facts: dict[int, dict[str, Any]]) -> int:
    """How many distinct step numbers the ranks recorded, from each rank's runs of steps (its
    rows, read alone, for a rank whose summary capped them)."""
    runs: list[list[int]] = []
    for rank, rank_facts in facts.items():
        if rank_facts["complete"]:
            runs.extend(rank_facts["all_runs"])
        else:
            steps = run.rank_table("steps", rank)["step"].unique()
            runs.extend([int(s), int(s)] for s in steps)
    count, end = 0, None
    for first, last in sorted(runs):
        if end is not None and first <= end:
            if last > end:
                count += last - end
                end = last
            continue
        count += last - first + 1
        end = last
    return count


@rule("AMP-N13", "half-loss", "warning", "nan", requires=("loss",), refs=(AUTOCAST_OPS,))
def check_half_loss(ctx: RuleContext) -> Iterator[Finding]:
    """The loss tensor handed to backward (or scaler.scale) is fp16/bf16.

    From each rank's summary (the steps of each loss dtype as ranges); the first rank with a
    half-precision loss gives the finding. The dtype named is the most frequent half one.
    """
    for rank, runtime in rank_runtime(ctx.run).items():
        dtypes = runtime["loss_dtypes"]
        half = {d: dtypes[d] for d in HALF_DTYPES if d in dtypes and dtypes[d]["n"]}
        if not half:
            continue
        dtype = max(sorted(half), key=lambda d: half[d]["n"])
        count = sum(int(r["n"]) for r in half.values())
        total = rank_step_counts(ctx.run)[rank]
        runs = summary_steps(*half.values())
        yield ctx.finding(
            title=f"the loss is computed in {dtype} in {count} of {total} steps",
            evidence={
                "rank": rank,
                "loss_dtype": dtype,
                "affected_step_count": count,
                "step_count": total,
                "half_loss_steps": expand_steps(runs, MAX_LISTED_STEPS),
                "half_loss_step_ranges": runs[:MAX_LISTED_STEPS],
            },
            fix="Compute the loss in fp32: cast the logits with .float() before the loss function.",
        )
        return


@rule("AMP-N14", "half-master-weights", "error", "nan", requires=("optimizer",), refs=(AMP_DOCS,))
def check_half_master_weights(ctx: RuleContext) -> Iterator[Finding]:
    """Trainable parameters stored in fp16/bf16 are updated by an optimizer (no fp32 master copy)."""
    for opt in ctx.run.events_of("optimizer_seen"):
        half = int(opt.get("trainable_half_params") or 0)
        if half <= 0:
            continue
        total = int(opt.get("trainable_params") or 0)
        yield ctx.finding(
            title=f"{opt.get('optimizer_class')} updates {half:,} of {total:,} parameters stored in half precision",
            evidence={
                "rank": opt.get("rank"),
                "optimizer": opt.get("optimizer_class"),
                "param_dtypes": opt.get("param_dtypes"),
                "half_param_count": half,
                "trainable_param_count": total,
            },
            fix=(
                "Keep fp32 master weights: do not call model.half()/.bfloat16() for training; let "
                "autocast cast per op. Small updates vanish when added to half-precision weights."
            ),
        )


@rule(
    "AMP-N15",
    "bf16-needless-scaler",
    "info",
    "nan",
    requires=("amp_as_written", "scaler", "autocast"),
    refs=(GRADIENT_SCALING,),
)
def check_bf16_needless_scaler(ctx: RuleContext) -> Iterator[Finding]:
    """bf16 autocast combined with dynamic loss scaling."""
    dtypes = autocast_dtypes(ctx.run)
    if "bfloat16" not in dtypes or "float16" in dtypes:
        return
    yield ctx.finding(
        title="GradScaler used with bf16 autocast",
        evidence={
            "autocast_dtypes": sorted(dtypes),
            "scaled_step_count": sum(f["n"] for f in scaler_summaries(ctx.run).values()),
        },
        fix="bf16 has fp32's range: drop the GradScaler (or construct it with enabled=False).",
    )
