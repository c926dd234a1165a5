"""Rules on the loss-scale trajectory and GradScaler usage (checklist section A)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pandas as pd

from amprobe.analysis.frames import MAX_LISTED_STEPS, percent_text
from amprobe.analysis.numerics import offender_evidence
from amprobe.analysis.runtime import expand_steps, rank_runtime, rank_step_counts, summary_steps
from amprobe.analysis.scaler import (
    calibration_steps,
    compute_scale_events,
    cut_steps,
    expand_runs,
    growth_interval,
    init_scale,
    longest_run,
    nth_step,
    rank_scaler,
    rank_scaler_rows,
    row_indices,
    runs_without,
    scaler_ranks,
)
from amprobe.rules.data import step_ranges, steps_list
from amprobe.rules.engine import Finding, RuleContext, rule
from amprobe.rules.refs import (
    AUTOCAST_OPS,
    CHECKPOINT_EXAMPLE,
    CLIPPING_EXAMPLE,
    GRADIENT_SCALING,
    TYPICAL_EXAMPLE,
)
from amprobe.rules.replay import NOT_PRECISION_CAUSES, measured_causes
from amprobe.store.loader import Run

__all__: list[str] = []


def _scale(value: float | None) -> float:
    """A scale from a summary as the frame's ``float(...)`` gave it (None: NaN, no value)."""
    return float("nan") if value is None else float(value)


@rule(
    "AMP-N01",
    "scale-backoff",
    "warning",
    "nan",
    requires=("amp_as_written", "scaler"),
    thresholds={"frequent_cuts_per_interval": 1.0},
    refs=(GRADIENT_SCALING,),
    # the cuts follow a forward overflow, a bad batch, or a scaler that restarts at init_scale
    explained_by=("AMP-N05", "AMP-N04", "AMP-N08", "AMP-N10"),
)
def check_scale_backoff(ctx: RuleContext) -> Iterator[Finding]:
    """The loss scale was cut because gradients held inf/NaN.

    Algorithm: a cut is a step whose ``scale_after < scale_before``. The initial calibration
    (:func:`~amprobe.analysis.scaler.compute_calibration`: the run of cuts that starts the
    recording at ``init_scale``, shorter than a collapse) is reported but not judged. Cuts per growth
    interval = later cuts / max(steps / growth_interval, 1); above the threshold the finding is
    a warning (the scaler cannot settle), else info.
    """
    for rank in scaler_ranks(ctx.run):
        facts = rank_scaler(ctx.run, rank)
        cuts = cut_steps(facts)
        if not cuts:
            continue
        step_count = facts["n"]
        interval = growth_interval(ctx.run, rank)
        calibration = len(calibration_steps(ctx.run, rank))
        later = len(cuts) - calibration
        per_interval = later / max(step_count / interval, 1.0)
        frequent = per_interval > ctx.thresholds["frequent_cuts_per_interval"]
        note = ""
        if calibration and not later:
            note = " (initial calibration down from init_scale)"
        elif frequent:
            note = f" ({per_interval:.1f} cuts per growth interval of {interval})"
        yield ctx.finding(
            title=f"loss scale cut {len(cuts)} time(s) in {step_count} steps{note}",
            evidence={
                "rank": rank,
                "cut_count": len(cuts),
                "calibration_cut_count": calibration,
                "step_count": step_count,
                "cut_steps": steps_list(cuts),
                "cut_step_ranges": step_ranges(cuts),
                "cuts_per_growth_interval": round(per_interval, 3),
                "growth_interval": interval,
                "threshold": ctx.thresholds["frequent_cuts_per_interval"],
                "min_scale": _scale(facts["min_after"]),
                "max_scale": _scale(facts["max_after"]),
            },
            fix=(
                "Gradients overflowed at these steps. Look at the loss-scale history first when "
                "the loss turns NaN; frequent cuts mean a layer overflows again and again "
                "(see AMP-N05) or init_scale is too high."
                if later
                else "Only the first steps were skipped while the scaler calibrated down from init_scale: "
                "normal. A lower init_scale (e.g. 2**12) avoids those skipped first updates."
            ),
            severity="warning" if frequent else "info",
        )


@rule(
    "AMP-N02",
    "skip-rate",
    "error",
    "nan",
    requires=("amp_as_written", "scaler"),
    thresholds={"warn_below": 0.95, "error_below": 0.90, "min_steps": 10},
    refs=(GRADIENT_SCALING,),
    # a step is skipped when its gradients overflowed: the same causes as the scale cuts, and
    # the cause the replay of the first bad step measured
    explained_by=("AMP-N17", "AMP-N05", "AMP-N04", "AMP-N08", "AMP-N10"),
    after=("AMP-N17",),  # its advice follows the measured cause
)
def check_skip_rate(ctx: RuleContext) -> Iterator[Finding]:
    """Scaler success rate = iterations whose optimizer update was applied / all iterations.

    Every iteration counts, skipped ones included, except the steps of the initial calibration
    (:func:`~amprobe.analysis.scaler.compute_calibration`), which AMP-N01 reports and no rule
    judges. Runs with fewer than ``min_steps`` judged steps are not judged. Warning below
    ``warn_below``, error below ``error_below``.
    """
    th = ctx.thresholds
    for rank in scaler_ranks(ctx.run):
        facts = rank_scaler(ctx.run, rank)
        calibration = calibration_steps(ctx.run, rank)
        step_count = facts["n"] - len(calibration)
        if step_count < th["min_steps"]:
            continue
        left_out = set(calibration)
        calibration_skipped = sum(
            1 for step, skipped in facts["head"] if skipped and step in left_out
        )
        skipped_count = facts["skipped"] - calibration_skipped
        rate = 1.0 - skipped_count / step_count
        if rate >= th["warn_below"]:
            continue
        skipped_runs = runs_without(facts["skipped_runs"], left_out)
        severity = "error" if rate < th["error_below"] else "warning"
        calibrated = (
            f"; {len(calibration)} step(s) of initial calibration not judged" if calibration else ""
        )
        yield ctx.finding(
            title=f"only {percent_text(rate, space=False)} of {step_count} steps applied their update "
            f"({skipped_count} skipped{calibrated})",
            evidence={
                "rank": rank,
                "success_rate": round(rate, 4),
                "skipped_count": skipped_count,
                "step_count": step_count,
                "calibration_step_count": len(calibration),
                "skipped_steps": expand_runs(skipped_runs, MAX_LISTED_STEPS),
                "skipped_step_ranges": [list(r) for r in skipped_runs[:MAX_LISTED_STEPS]],
                "warn_below": th["warn_below"],
                "error_below": th["error_below"],
            },
            fix=_skip_fix(measured_causes(ctx.prior)),
            severity=severity,
        )


def _skip_fix(causes: dict[int, str]) -> str:
    """AMP-N02's advice: no change of precision where every cause the replay measured is one
    that precision does not fix (AMP-N17)."""
    if causes and set(causes.values()) <= NOT_PRECISION_CAUSES:
        return (
            "Each skipped step silently lowers the effective learning rate. The replay of the bad "
            "step measured a cause outside AMP (AMP-N17: "
            + ", ".join(sorted(set(causes.values())))
            + "): fix that; a change of precision will not help."
        )
    return (
        "Each skipped step silently lowers the effective learning rate. Lower init_scale "
        "(e.g. 65536 -> 4096), fix the overflowing layer (AMP-N05), or move to bf16."
    )


@rule(
    "AMP-N03",
    "scale-collapse",
    "error",
    "nan",
    requires=("amp_as_written", "scaler"),
    thresholds={"min_scale": 1.0, "max_consecutive_cuts": 16},
    refs=(AUTOCAST_OPS,),
    explained_by=("AMP-N05", "AMP-N04"),  # an op overflows at any scale, or the data is bad
)
def check_scale_collapse(ctx: RuleContext) -> Iterator[Finding]:
    """The scale keeps halving to a tiny value.

    Triggers when the scale after any update falls below ``min_scale`` or the longest run of
    consecutive cuts reaches ``max_consecutive_cuts``. Halving the scale cannot help then: a
    forward op produces inf/NaN whatever the scale.

    Read from each rank's ``scaler`` summary (:func:`~amprobe.analysis.scaler.rank_scaler`):
    the cuts, their row positions among the scaler steps and the change points give the same
    values as the rows; a rank whose step numbers repeat is judged from its own rows.
    """
    th = ctx.thresholds
    for rank in scaler_ranks(ctx.run):
        facts = rank_scaler(ctx.run, rank)
        if facts["ordered"]:
            min_scale, run_len, first_step, below_step = _collapse_facts(facts, th["min_scale"])
        else:  # a step number repeats: the runs of steps cannot place its rows
            min_scale, run_len, first_step, below_step = _collapse_rows(
                rank_scaler_rows(ctx.run, rank), th["min_scale"]
            )
        if min_scale >= th["min_scale"] and run_len < th["max_consecutive_cuts"]:
            continue
        evidence = {
            "rank": rank,
            "min_scale": min_scale,
            "consecutive_cut_count": run_len,
            "cut_run_starts_at_step": first_step,
            "first_step_below_min": below_step,
            "min_scale_threshold": th["min_scale"],
            "max_consecutive_cuts": th["max_consecutive_cuts"],
        }
        evidence.update(offender_evidence(ctx.run, rank))
        yield ctx.finding(
            title=(
                f"loss scale collapsed to {min_scale:.3g} after {run_len} consecutive cuts"
                + (f" starting at step {first_step}" if first_step is not None else "")
            ),
            evidence=evidence,
            fix=(
                "This is not a gradient-range problem: a forward op produces inf/NaN at any scale. "
                "Find the first module whose output overflows (AMP-N05) or a non-finite input "
                "batch (AMP-N04); pin that op to fp32 or fix the data."
            ),
        )


def _collapse_facts(
    facts: dict[str, Any], threshold: float
) -> tuple[float, int, int | None, int | None]:
    """AMP-N03's measures from a rank's scaler section (every change point listed, steps
    ascending): the lowest scale after an update (NaN when none is known, as a frame's
    ``min`` of NaNs), the longest run of consecutive cuts (rows, not step numbers) and the
    step it starts at, and the first step whose scale after its update is below
    ``threshold``. A row's scale after is its update's when it has one, else its scale before:
    the first row's, a jump's, or the previous row's scale after, so the first row below
    ``threshold`` is the first row, an update or a jump."""
    cuts = cut_steps(facts)
    run_len, first_step = 0, None
    if cuts:
        rows = row_indices(facts["step_runs"], cuts)
        start = 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                if i - start > run_len:  # the first of the longest runs
                    run_len, first_step = i - start, cuts[start]
                start = i
    after = {int(u[0]): _scale(u[2]) for u in facts["updates"]}
    changes = {int(j[0]): float(j[2]) for j in facts["jumps"]}
    changes[int(facts["step_runs"][0][0])] = float(facts["first_before"])
    changes.update(after)  # a step's update sets its scale after
    below = [step for step, scale in changes.items() if scale < threshold]
    return _scale(facts["min_after"]), run_len, first_step, min(below) if below else None


def _collapse_rows(
    frame: pd.DataFrame, threshold: float
) -> tuple[float, int, int | None, int | None]:
    """:func:`_collapse_facts` from one rank's scaler-step rows in step order."""
    indexed = compute_scale_events(frame).reset_index(drop=True)
    run_len, start = longest_run(indexed["backoff"])
    first_step = int(indexed.loc[start, "step"]) if start is not None else None
    below = indexed[indexed["scale_after"] < threshold]
    below_step = int(below["step"].iloc[0]) if len(below) else None
    return float(indexed["scale_after"].min()), run_len, first_step, below_step


@rule(
    "AMP-N07",
    "scale-chronically-low",
    "warning",
    "nan",
    requires=("amp_as_written", "scaler"),
    thresholds={"min_intervals": 4, "below_init_factor": 256.0},
    refs=(GRADIENT_SCALING,),
)
def check_scale_chronically_low(ctx: RuleContext) -> Iterator[Finding]:
    """The scale never grows over many growth intervals and sits far below its initial value.

    Looks at the last ``min_intervals * growth_interval`` steps: no growth there, and the final
    scale at most ``init_scale / below_init_factor``.
    """
    th = ctx.thresholds
    for rank in scaler_ranks(ctx.run):
        facts = rank_scaler(ctx.run, rank)
        interval = growth_interval(ctx.run, rank)
        window = int(th["min_intervals"] * interval)
        n = facts["n"]
        if n < window:
            continue
        init = init_scale(ctx.run, rank) or float(facts["first_before"])
        final = _scale(facts["last_after"])
        # the tail is the last `window` scaler steps: rows n - window .. n - 1
        if facts["last_growth"] >= n - window or final > init / th["below_init_factor"]:
            continue
        tail_start = nth_step(facts["step_runs"], n - window) if window > 0 else None
        tail_cuts = (
            sum(1 for step in cut_steps(facts) if step >= tail_start)
            if tail_start is not None
            else 0
        )
        yield ctx.finding(
            title=(
                f"loss scale stuck at {final:g}, {init / final:.0f}x below init_scale {init:g}, "
                f"with no growth in the last {window} steps"
            ),
            evidence={
                "rank": rank,
                "final_scale": final,
                "init_scale": init,
                "no_growth_step_count": window,
                "growth_interval": interval,
                "window_cut_count": tail_cuts,
                "min_intervals": th["min_intervals"],
                "below_init_factor": th["below_init_factor"],
            },
            fix=(
                "Gradients are persistently large: check weight initialization and the learning "
                "rate. Such a configuration is fragile under fp16 AMP; bf16 avoids the problem."
            ),
        )


@rule(
    "AMP-N08",
    "scaler-recreated",
    "error",
    "nan",
    requires=("amp_as_written", "scaler"),
    thresholds={"max_instances_per_site": 1, "max_scale_resets": 1},
    refs=(TYPICAL_EXAMPLE,),
)
def check_scaler_recreated(ctx: RuleContext) -> Iterator[Finding]:
    """A new GradScaler is built during training.

    Counts ``scaler_created`` events per rank and call site; more than
    ``max_instances_per_site`` from one site means the scaler is built inside the loop. Also
    counts steps where the scale jumps back to ``init_scale`` from a lower value.
    """
    th = ctx.thresholds
    run = ctx.run
    for rank in scaler_ranks(run):
        facts = rank_scaler(run, rank)
        sites = Counter(facts["sites"])
        if not facts["sites_complete"]:  # more call sites than the summary counts one by one
            sites = Counter(
                c.get("site") for c in _created(run, rank) if c.get("site") not in (None, "?")
            )
        repeated = {site: n for site, n in sites.items() if n > th["max_instances_per_site"]}
        init = init_scale(ctx.run, rank)
        resets: list[int] = []
        reset_steps: list[int] = []
        if init is not None:
            # a reset: a step that starts at init_scale from a previous step that ended elsewhere
            reset_steps = [int(j[0]) for j in facts["jumps"] if j[2] == init]
            resets = steps_list(reset_steps)
        if not repeated and len(resets) <= th["max_scale_resets"]:
            continue
        site, count = (
            max(repeated.items(), key=lambda kv: kv[1]) if repeated else (None, facts["created"])
        )
        created = _created(run, rank) if site else []
        created_steps = [c.get("step") for c in created if c.get("site") == site] if site else []
        yield ctx.finding(
            title=(
                f"GradScaler created {count} times"
                + (f" at {site}" if site else "")
                + (f"; scale reset to init_scale {len(resets)} times" if resets else "")
            ),
            evidence={
                "rank": rank,
                "instance_count": facts["created"],
                "site": site,
                "site_instance_count": count,
                "created_at_steps": steps_list(created_steps),
                "created_at_step_ranges": step_ranges(created_steps),
                "scale_reset_steps": resets,
                "scale_reset_step_ranges": step_ranges(reset_steps),
                "init_scale": init,
            },
            fix=(
                "Create the GradScaler once, outside the training loop; a new scaler forgets the "
                "calibrated scale and restarts at init_scale every time."
            ),
        )


def _created(run: Run, rank: int) -> list[dict[str, Any]]:
    """``rank``'s ``scaler_created`` events, from its own events file (for a finding's detail)."""
    frame = run.rank_table("events", rank)
    if not len(frame):
        return []
    out = []
    for step, kind, raw in zip(frame["step"], frame["kind"], frame["detail"], strict=True):
        if kind != "scaler_created":
            continue
        try:
            detail = json.loads(raw) if isinstance(raw, str) else {}
        except ValueError:
            detail = {}
        out.append({"rank": rank, "step": step, **(detail if isinstance(detail, dict) else {})})
    return out


@rule(
    "AMP-N09",
    "clip-before-unscale",
    "error",
    "nan",
    requires=("amp_as_written", "steps"),
    thresholds={"max_scaled_clips": 0},
    refs=(CLIPPING_EXAMPLE,),
)
def check_clip_before_unscale(ctx: RuleContext) -> Iterator[Finding]:
    """``clip_grad_norm_`` / ``clip_grad_value_`` ran on gradients still multiplied by the scale.

    The collector flags a clip call when a GradScaler scaled the loss this iteration and the
    clipped gradients do not all belong to optimizers that ``unscale_`` was called on. Read
    from each rank's summary (the steps with ``clip_scaled`` > 0 as ranges).
    """
    counts = rank_step_counts(ctx.run)
    for rank, runtime in rank_runtime(ctx.run).items():
        clip = runtime["clip"]
        bad_count = int(clip["scaled"]["n"])
        if bad_count <= ctx.thresholds["max_scaled_clips"]:
            continue
        # clipping is a detail (Config.details_every): counted on the steps that observed it
        observed = int(clip["observed"])
        total = counts[rank]
        where = f"{observed} steps" + (" observed" if observed < total else "")
        bad = summary_steps(clip["scaled"])
        events = [e for e in ctx.run.events_of("clip_before_unscale") if e.get("rank") == rank]
        functions = sorted({str(e["function"]) for e in events if e.get("function")})
        sites = sorted({str(e["site"]) for e in events if e.get("site")})
        yield ctx.finding(
            title=f"gradients clipped while still scaled in {bad_count} of {where}",
            evidence={
                "rank": rank,
                "affected_step_count": bad_count,
                "step_count": total,
                "observed_step_count": observed,
                "clipped_steps": expand_steps(bad, MAX_LISTED_STEPS),
                "clipped_step_ranges": bad[:MAX_LISTED_STEPS],
                "functions": functions,
                "call_sites": sites,
            },
            fix=(
                "Call scaler.unscale_(optimizer) before clipping. Order: scaler.scale(loss).backward()"
                " -> scaler.unscale_(optimizer) -> clip_grad_norm_ -> scaler.step(optimizer) -> "
                "scaler.update(). Clipping scaled gradients compares max_norm with the norm times the loss "
                "scale, so the clip fires almost always and the real update is shrunk by the scale."
            ),
        )


@rule(
    "AMP-N10",
    "scaler-not-restored",
    "warning",
    "nan",
    requires=("amp_as_written", "scaler", "optimizer"),
    refs=(CHECKPOINT_EXAMPLE,),
)
def check_scaler_not_restored(ctx: RuleContext) -> Iterator[Finding]:
    """A resumed run (optimizer state loaded) whose GradScaler state was never loaded.

    The scale then restarts at ``init_scale`` and the first steps after the resume are skipped
    while it re-calibrates.
    """
    run = ctx.run
    for rank in scaler_ranks(run):
        facts = rank_scaler(run, rank)
        if not facts["optimizer_loads"] or facts["scaler_loads_nonempty"]:
            continue
        skipped = sum(1 for _, was_skipped in facts["head"][:20] if was_skipped)
        yield ctx.finding(
            title="optimizer state was restored but the GradScaler state was not",
            evidence={
                "rank": rank,
                "optimizer_load_count": facts["optimizer_loads"],
                "scaler_load_count": facts["scaler_loads"],
                "first_scale": float(facts["first_before"]),
                "init_scale": init_scale(ctx.run, rank),
                "early_skipped_count": skipped,  # among the first 20 steps
            },
            fix=(
                "Save scaler.state_dict() in the checkpoint with the model and optimizer, and call "
                "scaler.load_state_dict(...) when resuming."
            ),
        )
