"""Comparing two runs: an FP32 baseline and an AMP run (checklist section C)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pandas as pd

from amprobe.analysis.frames import autocast_dtypes
from amprobe.analysis.scaler import success_rate_metric
from amprobe.store.loader import Run, RunLoadError, load_run

__all__ = [
    "WARMUP_SHARE",
    "COMPARED_METRICS",
    "baseline_path",
    "load_baseline",
    "compute_comparison",
    "pairing_warnings",
    "baseline_comparison",
]

WARMUP_SHARE = 0.1  # the first 10 % of steps (at least 2) are warm-up and not timed
#: the metrics of a comparison that may be missing; each has its note in ``notes[metric]``.
COMPARED_METRICS = ("speedup", "memory_ratio", "loss_diff")


def baseline_path(run: Run) -> Path | None:
    """The FP32 baseline run named in the run's rank manifests (``amprobe baseline``), if any."""
    path = next(
        (r.manifest.get("baseline_run") for r in run.ranks if r.manifest.get("baseline_run")), None
    )
    if not path:
        return None
    target = Path(path)
    return target if target.is_absolute() else run.path / target


def load_baseline(run: Run) -> Run | None:
    """The FP32 baseline run named in the run's manifest, if readable (loaded once per run)."""
    return run.cached("baseline", _load_baseline)


def _load_baseline(run: Run) -> Run | None:
    target = baseline_path(run)
    if target is None:
        return None
    try:
        return load_run(target)
    except RunLoadError:
        return None


def baseline_comparison(run: Run) -> dict[str, Any] | None:
    """:func:`compute_comparison` of the run against its own baseline (computed once per run)."""
    return run.cached("baseline_comparison", _baseline_comparison)


def _baseline_comparison(run: Run) -> dict[str, Any] | None:
    baseline = load_baseline(run)
    return None if baseline is None else compute_comparison(baseline, run)


def _timed(steps: pd.DataFrame) -> pd.DataFrame:
    steps = steps[steps["rank"] == steps["rank"].min()].sort_values("step") if len(steps) else steps
    skip = max(2, int(len(steps) * WARMUP_SHARE))
    return steps.iloc[skip:] if len(steps) > skip + 2 else steps


def _step_range(steps: Any) -> tuple[int, int]:
    """The first and last of a column or index of step numbers."""
    return int(min(steps)), int(max(steps))


def _peak_memory(run: Run) -> tuple[float | None, str | None]:
    steps = run.steps
    for column, label in (("peak_mem_bytes", "device"), ("rss_bytes", "host RSS")):
        if column in steps.columns and steps[column].notna().any():
            return float(steps[column].max()), label
    return None, None


def _command(run: Run) -> list[str] | None:
    """The training process's ``sys.argv`` as recorded in the manifests, if it was."""
    argv = run.rank_manifest.get("argv") or run.manifest.get("argv")
    return [str(a) for a in argv] if isinstance(argv, list) and argv else None


def pairing_warnings(baseline: Run, candidate: Run) -> list[str]:
    """Why two runs may not be an FP32 baseline and its AMP run, one line each.

    The baseline ran an enabled autocast region (it is not an FP32 run), or the two runs'
    commands (``argv`` in their manifests) differ. A command not recorded is not compared.
    """
    out = []
    dtypes = autocast_dtypes(baseline)
    if dtypes:
        out.append(
            f"the baseline {baseline.path} is not an FP32 run (it ran autocast with "
            f"{', '.join(sorted(dtypes))}); it is compared as the FP32 baseline anyway"
        )
    a, b = _command(baseline), _command(candidate)
    if a is not None and b is not None and a != b:
        out.append(
            f"the two runs' commands differ ({shlex.join(a)} vs {shlex.join(b)}); "
            "the comparison may not be like for like"
        )
    return out


def compute_comparison(baseline: Run, candidate: Run) -> dict[str, Any]:
    """Side-by-side metrics of two runs (checklist section C).

    Throughput uses the median step wall time after warm-up (``WARMUP_SHARE``), so the first
    steps and the probe's own flushes do not count; ``timed_step_ranges`` holds the first and
    last timed step of each run (the lowest rank's). The loss is compared at the steps both runs
    recorded one (``shared_loss_steps``, ``shared_loss_step_range``); the final losses are the
    mean over the last 10 of those (``final_loss_step_range``) and ``loss_diff`` is candidate
    minus baseline there. A metric of :data:`COMPARED_METRICS` that
    cannot be measured is ``None`` and ``notes[metric]`` says why; so is a run's scaler success
    rate (``scaler_success_rate_baseline`` / ``_candidate``) without an enabled GradScaler, with
    the note of the health metric (:func:`~amprobe.analysis.scaler.success_rate_metric`).
    ``warnings`` are :func:`pairing_warnings`: the runs are compared all the same.
    """
    notes: dict[str, str] = {}
    out: dict[str, Any] = {
        "baseline": str(baseline.path),
        "candidate": str(candidate.path),
        "warnings": pairing_warnings(baseline, candidate),
        "notes": notes,
    }
    a, b = _timed(baseline.steps), _timed(candidate.steps)
    if len(a) and len(b) and a["wall_s"].median() > 0 and b["wall_s"].median() > 0:
        sps_a, sps_b = 1.0 / a["wall_s"].median(), 1.0 / b["wall_s"].median()
        out.update(
            steps_per_s_baseline=sps_a,
            steps_per_s_candidate=sps_b,
            speedup=sps_b / sps_a,
            timed_steps=(len(a), len(b)),
            timed_step_ranges=(_step_range(a["step"]), _step_range(b["step"])),
        )
    else:
        out["speedup"] = None
        notes["speedup"] = "one of the runs has no timed steps"
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
        notes["memory_ratio"] = "peak memory was not recorded in both runs"
    la = baseline.steps[["step", "loss"]].dropna().groupby("step")["loss"].mean()
    lb = candidate.steps[["step", "loss"]].dropna().groupby("step")["loss"].mean()
    shared = la.index.intersection(lb.index)
    if len(shared):
        diff = (lb.loc[shared] - la.loc[shared]).abs()
        tail = shared[-min(10, len(shared)) :]
        out.update(
            shared_loss_steps=len(shared),
            shared_loss_step_range=_step_range(shared),
            final_loss_step_range=_step_range(tail),
            loss_mean_abs_diff=float(diff.mean()),
            final_loss_baseline=float(la.loc[tail].mean()),
            final_loss_candidate=float(lb.loc[tail].mean()),
            loss_diff=float(lb.loc[tail].mean() - la.loc[tail].mean()),
        )
    else:
        out["loss_diff"] = None
        notes["loss_diff"] = "the runs share no step with a recorded loss"
    for side, run in (("baseline", baseline), ("candidate", candidate)):
        rate = success_rate_metric(run)
        out[f"scaler_success_rate_{side}"] = rate["value"]
        if rate["value"] is None:
            notes[f"scaler_success_rate_{side}"] = rate["note"]
    return out
