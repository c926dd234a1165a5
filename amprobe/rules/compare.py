"""Comparing two runs (an FP32 baseline and an AMP run), and rule AMP-S06."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from amprobe.rules.engine import Finding, RuleContext, requirement, rule
from amprobe.store.loader import Run, RunLoadError, load_run

__all__ = ["compute_comparison", "load_baseline", "WARMUP_SHARE", "SPEED_RULES"]

WARMUP_SHARE = 0.1  # the first 10 % of steps (at least 2) are warm-up and not timed
SPEED_RULES = ("AMP-S01", "AMP-S02", "AMP-S03", "AMP-S04", "AMP-S05", "AMP-S07")


def load_baseline(run: Run) -> Run | None:
    """The FP32 baseline run named in the run's manifest (``amprobe baseline``), if readable.

    Loaded once per loaded run (the rules, the health metrics and the report share it).
    """
    return run.cached("baseline", _load_baseline)


def _load_baseline(run: Run) -> Run | None:
    path = next(
        (r.manifest.get("baseline_run") for r in run.ranks if r.manifest.get("baseline_run")), None
    )
    if not path:
        return None
    target = Path(path)
    if not target.is_absolute():
        target = run.path / target
    try:
        return load_run(target)
    except RunLoadError:
        return None


def _timed(steps: pd.DataFrame) -> pd.DataFrame:
    steps = steps[steps["rank"] == steps["rank"].min()].sort_values("step") if len(steps) else steps
    skip = max(2, int(len(steps) * WARMUP_SHARE))
    return steps.iloc[skip:] if len(steps) > skip + 2 else steps


def _peak_memory(run: Run) -> tuple[float | None, str | None]:
    steps = run.steps
    for column, label in (("peak_mem_bytes", "device"), ("rss_bytes", "host RSS")):
        if column in steps.columns and steps[column].notna().any():
            return float(steps[column].max()), label
    return None, None


def _success_rate(run: Run) -> float | None:
    steps = run.steps
    scaled = steps[steps["scaler_enabled"].fillna(False).astype(bool)] if len(steps) else steps
    if not len(scaled):
        return None
    return 1.0 - float(scaled["skipped"].fillna(False).astype(bool).mean())


def compute_comparison(baseline: Run, candidate: Run) -> dict[str, Any]:
    """Side-by-side metrics of two runs (checklist section C).

    Throughput uses the median step wall time after warm-up (``WARMUP_SHARE``), so the first
    steps and the probe's own flushes do not count. Missing data gives ``None`` with a note.
    """
    out: dict[str, Any] = {
        "baseline": str(baseline.path),
        "candidate": str(candidate.path),
        "notes": [],
    }
    a, b = _timed(baseline.steps), _timed(candidate.steps)
    if len(a) and len(b) and a["wall_s"].median() > 0 and b["wall_s"].median() > 0:
        sps_a, sps_b = 1.0 / a["wall_s"].median(), 1.0 / b["wall_s"].median()
        out.update(
            steps_per_s_baseline=sps_a,
            steps_per_s_candidate=sps_b,
            speedup=sps_b / sps_a,
            timed_steps=(len(a), len(b)),
        )
        if (
            "batch_size" in a.columns
            and a["batch_size"].notna().any()
            and b["batch_size"].notna().any()
        ):
            out.update(
                samples_per_s_baseline=sps_a * float(a["batch_size"].median()),
                samples_per_s_candidate=sps_b * float(b["batch_size"].median()),
            )
    else:
        out["speedup"] = None
        out["notes"].append("throughput: one of the runs has no timed steps")
    mem_a, kind_a = _peak_memory(baseline)
    mem_b, kind_b = _peak_memory(candidate)
    if mem_a and mem_b and kind_a == kind_b:
        out.update(
            peak_memory_baseline=mem_a,
            peak_memory_candidate=mem_b,
            memory_ratio=mem_b / mem_a,
            memory_kind=kind_a,
        )
    else:
        out["memory_ratio"] = None
        out["notes"].append("memory: peak memory was not recorded in both runs")
    la = baseline.steps[["step", "loss"]].dropna().groupby("step")["loss"].mean()
    lb = candidate.steps[["step", "loss"]].dropna().groupby("step")["loss"].mean()
    shared = la.index.intersection(lb.index)
    if len(shared):
        diff = (lb.loc[shared] - la.loc[shared]).abs()
        tail = shared[-min(10, len(shared)) :]
        out.update(
            shared_loss_steps=len(shared),
            loss_mean_abs_diff=float(diff.mean()),
            final_loss_baseline=float(la.loc[tail].mean()),
            final_loss_candidate=float(lb.loc[tail].mean()),
            loss_diff=float(lb.loc[tail].mean() - la.loc[tail].mean()),
        )
    else:
        out["loss_diff"] = None
        out["notes"].append("loss: the runs share no step with a recorded loss")
    out["scaler_success_rate_baseline"] = _success_rate(baseline)
    out["scaler_success_rate_candidate"] = _success_rate(candidate)
    return out


@requirement("baseline")
def _has_baseline(run: Run) -> str | None:
    if not any(r.manifest.get("baseline_run") for r in run.ranks):
        return "no FP32 baseline was measured (use `amprobe baseline`)"
    if load_baseline(run) is None:
        return "the FP32 baseline run named in the manifest cannot be read"
    return None


@rule(
    "AMP-S06",
    "no-speedup",
    "warning",
    "speed",
    requires=("baseline",),
    thresholds={"min_speedup": 1.1},
    refs=("G§5.2", "G§5.4", "S§11"),
)
def check_no_speedup(ctx: RuleContext) -> Iterator[Finding]:
    """A measured FP32-vs-AMP comparison gives a speedup under ``min_speedup``.

    The finding lists which other speed findings (S01-S05, S07) of the run explain it.
    """
    baseline = load_baseline(ctx.run)
    assert baseline is not None  # guaranteed by the requirement
    yield from no_speedup_findings(ctx, compute_comparison(baseline, ctx.run))


def no_speedup_findings(ctx: RuleContext, comparison: dict[str, Any]) -> Iterator[Finding]:
    from amprobe.rules.engine import diagnose

    speedup = comparison.get("speedup")
    if speedup is None or not math.isfinite(speedup) or speedup >= ctx.thresholds["min_speedup"]:
        return
    explained = [f.id for f in diagnose(ctx.run, only=SPEED_RULES).findings]
    yield ctx.finding(
        title=f"AMP is {speedup:.2f}x the FP32 baseline's throughput (below {ctx.thresholds['min_speedup']:g}x)",
        evidence={
            "speedup": round(speedup, 3),
            "steps_per_s_fp32": round(comparison["steps_per_s_baseline"], 3),
            "steps_per_s_amp": round(comparison["steps_per_s_candidate"], 3),
            "min_speedup": ctx.thresholds["min_speedup"],
            "explained_by": explained,
            "baseline": comparison["baseline"],
        },
        fix=(
            ("Start with " + ", ".join(explained) + ". " if explained else "")
            + "AMP speeds up large, aligned matrix multiplies on Tensor Cores; input pipelines, "
            "host syncs, small or misaligned layers and code outside autocast eat the gain."
        ),
    )
