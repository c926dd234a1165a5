"""Rules on the precision set-up: dtypes of autocast, loss and weights (checklist section A)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pandas as pd

from amprobe.analysis.frames import MAX_LISTED_STEPS, percent_text
from amprobe.analysis.numerics import layer_overflow_evidence, nonfinite_input_steps
from amprobe.analysis.runtime import expand_steps, rank_runtime, rank_step_counts, summary_steps
from amprobe.analysis.scaler import (
    calibration_steps,
    count_in_runs,
    cut_steps,
    distinct_step_count,
    expand_runs,
    rank_scaler,
    rank_scaler_rows,
    runs_without,
    scaler_ranks,
    scaler_summaries,
)
from amprobe.rules.data import HALF_DTYPES, autocast_dtypes, step_ranges, steps_list
from amprobe.rules.engine import Finding, RuleContext, rule
from amprobe.rules.refs import AMP_DOCS, AUTOCAST_OPS, GRADIENT_SCALING, TYPICAL_EXAMPLE
from amprobe.rules.replay import NOT_PRECISION_CAUSES, measured_causes

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
    # a bad step whose replay measured a cause that bf16 does not fix is not counted
    after=("AMP-N17",),
)
def check_prefer_bf16(ctx: RuleContext) -> Iterator[Finding]:
    """An fp16 run with overflow cuts or NaN on hardware that supports bf16.

    Info when the scale was cut at all; warning when more than ``warn_skip_share`` of the
    steps were skipped. The steps of the initial calibration
    (:func:`~amprobe.analysis.scaler.compute_calibration`), steps with a non-finite model input
    (AMP-N04's) and the bad steps whose replay (AMP-N17) measured a cause that no precision
    change fixes (``data-or-model``, ``loss-computation``), with the skipped steps that follow
    each of them in one run, are left out of both. bf16 support comes from the rank manifest (CUDA capability
    >= 8.0, or a CPU with AVX512-BF16/AMX).

    Read from each rank's ``scaler`` summary (cuts from its change points, skipped steps from
    its runs, the steps left out taken out of both); a rank whose step numbers repeat is judged
    from its own rows. The first rank that overflowed gives the finding.
    """
    run = ctx.run
    if "float16" not in autocast_dtypes(run):
        return
    supported = [r.rank for r in run.ranks if r.manifest.get("bf16_supported")]
    if not supported:
        return
    # the replayed bad steps that bf16 would not have fixed
    not_precision = {s for s, c in measured_causes(ctx.prior).items() if c in NOT_PRECISION_CAUSES}
    for rank in scaler_ranks(run):
        calibration = calibration_steps(run, rank)
        left_out = set(nonfinite_input_steps(run, rank)) | set(calibration)  # bad data: AMP-N04
        facts = rank_scaler(run, rank)
        left_out |= _with_their_runs(not_precision, facts.get("skipped_runs") or [])
        if facts["ordered"]:
            counts = _overflow_facts(facts, left_out)
        else:  # a step number repeats: the runs of steps cannot place its rows
            counts = _overflow_rows(rank_scaler_rows(run, rank), left_out)
        if counts is None:
            continue
        cuts, skipped_count, share, skipped_steps, skipped_ranges = counts
        if cuts == 0 and not skipped_count:
            continue
        device = run.rank_manifest.get("gpu_name") or run.rank_manifest.get("device")
        yield ctx.finding(
            title=f"fp16 run overflowed ({cuts} scale cuts, {percent_text(share, space=False)} steps skipped"
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
                "skipped_steps": skipped_steps,
                "skipped_step_ranges": skipped_ranges,
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


_Overflow = tuple[int, int, float, list[int], list[list[int]]]


def _with_their_runs(steps: set[int], runs: list[Any]) -> set[int]:
    """``steps`` and, for each, the skipped steps that follow it in its run of skipped steps
    (the replay replays the first bad step of a run: its cause is the run's)."""
    out = set(steps)
    for first, last in runs:
        for step in steps:
            if int(first) <= step <= int(last):
                out.update(range(step, int(last) + 1))
    return out


def _overflow_facts(facts: dict[str, Any], left_out: set[int]) -> _Overflow | None:
    """AMP-N11's counts from a rank's scaler section (every change point listed, steps
    ascending), the steps in ``left_out`` not counted: scale cuts, skipped steps, their share of
    the steps counted, the first skipped steps and runs (:data:`MAX_LISTED_STEPS` each); None
    when no step is left to count."""
    kept = facts["n"] - count_in_runs(facts["step_runs"], left_out)
    if kept <= 0:
        return None
    cuts = sum(1 for step in cut_steps(facts) if step not in left_out)
    skipped_runs = runs_without(facts["skipped_runs"], left_out)
    skipped = sum(last - first + 1 for first, last in skipped_runs)
    listed = expand_runs(skipped_runs, MAX_LISTED_STEPS)
    return cuts, skipped, skipped / kept, listed, [list(r) for r in skipped_runs[:MAX_LISTED_STEPS]]


def _overflow_rows(frame: pd.DataFrame, left_out: set[int]) -> _Overflow | None:
    """:func:`_overflow_facts` from one rank's scaler-step rows in step order."""
    frame = frame[~frame["step"].isin(left_out)] if len(frame) else frame
    if frame.empty:
        return None
    skipped = frame["skipped"].fillna(False).astype(bool)
    cuts = int((frame["scale_after"] < frame["scale_before"]).sum())
    steps = frame.loc[skipped, "step"]
    return cuts, int(skipped.sum()), float(skipped.mean()), steps_list(steps), step_ranges(steps)


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
            "step_count": distinct_step_count(run),
        },
        fix=(
            "Use torch.amp.GradScaler: scaler.scale(loss).backward(); scaler.step(opt); "
            "scaler.update(). Unscaled fp16 gradients below 6e-8 become zero."
        ),
    )


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
