"""The loss-scale trajectory: cuts and growth, runs of cuts, the scaler success rate."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from amprobe.analysis.frames import per_rank, scaler_steps
from amprobe.store.loader import Run

__all__ = [
    "compute_scale_events",
    "scale_events",
    "longest_run",
    "compute_success_rate",
    "success_rate_metric",
    "growth_interval",
    "init_scale",
    "MAX_CALIBRATION_CUTS",
    "compute_calibration",
    "calibration_steps",
]

DEFAULT_GROWTH_INTERVAL = 2000  # torch.amp.GradScaler's default
#: a leading run of this many cuts or more is a collapse (AMP-N03's ``max_consecutive_cuts``:
#: as many halvings as take PyTorch's default init_scale 2**16 to 1), not a calibration
MAX_CALIBRATION_CUTS = 16


def compute_scale_events(frame: pd.DataFrame) -> pd.DataFrame:
    """Add ``backoff`` and ``growth`` columns (scale cut / grown by ``update()``)."""
    out = frame.copy()
    out["backoff"] = out["scale_after"] < out["scale_before"]
    out["growth"] = out["scale_after"] > out["scale_before"]
    return out


def scale_events(run: Run) -> pd.DataFrame:
    """The run's scaler steps with ``backoff``/``growth`` columns (computed once per run)."""
    return run.cached("scale_events", lambda r: compute_scale_events(scaler_steps(r)))


def longest_run(flags: pd.Series) -> tuple[int, Any]:
    """Length and first index label of the longest run of True values."""
    values = flags.to_numpy(dtype=bool, na_value=False)
    if not values.any():
        return 0, None
    edges = np.diff(np.concatenate(([0], values.astype(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    lengths = np.flatnonzero(edges == -1) - starts
    best = int(np.argmax(lengths))  # the first of the longest runs
    return int(lengths[best]), flags.index[starts[best]]


def compute_success_rate(run: Run) -> dict[str, Any] | None:
    """Loss-scale success rate: steps whose update was applied / all scaler steps.

    Every scaler step counts, skipped ones included (checklist section C, metric 4). Computed
    once per run. Returns ``{"value", "step_count", "skipped_count"}``, or ``None`` when the
    run has no step with an enabled GradScaler.
    """
    return run.cached("success_rate", _success_rate)


def _success_rate(run: Run) -> dict[str, Any] | None:
    steps = scaler_steps(run)
    if not len(steps):
        return None
    skipped = int(steps["skipped"].fillna(False).astype(bool).sum())
    return {
        "value": 1.0 - skipped / len(steps),
        "step_count": int(len(steps)),
        "skipped_count": skipped,
    }


def success_rate_metric(run: Run) -> dict[str, Any]:
    """The success rate as a reported metric: :func:`compute_success_rate`'s dict, or
    ``{"value": None, "note": why}`` (the one answer of the health metric and the comparison)."""
    rate = compute_success_rate(run)
    if rate is not None:
        return dict(rate)
    if len(run.steps):
        why = "not applicable: no enabled GradScaler (every step applied its update)"
    else:
        why = "not measured: no training step was recorded"
    return {"value": None, "note": why}


def growth_interval(run: Run, rank: int) -> int:
    """The ``growth_interval`` of ``rank``'s last GradScaler (PyTorch's default when unknown)."""
    seen = [
        c.get("growth_interval") for c in run.events_of("scaler_created") if c.get("rank") == rank
    ]
    intervals = [int(i) for i in seen if isinstance(i, (int, float)) and i > 0]
    return intervals[-1] if intervals else DEFAULT_GROWTH_INTERVAL


def init_scale(run: Run, rank: int) -> float | None:
    """The ``init_scale`` of ``rank``'s last GradScaler, if recorded."""
    values = [c.get("init_scale") for c in run.events_of("scaler_created") if c.get("rank") == rank]
    numbers = [float(v) for v in values if isinstance(v, (int, float))]
    return numbers[-1] if numbers else None


def compute_calibration(frame: pd.DataFrame, init: float | None) -> int:
    """How many of one rank's first scaler steps are the GradScaler's initial calibration.

    The calibration is the run of scale cuts (skipped steps) that starts the recording while
    the scale comes down from ``init_scale``: PyTorch's docs call a few skipped first iterations
    normal. It is empty when the first recorded step did not start at ``init`` (a resumed scaler
    or a live attach: those cuts are overflows of a calibrated scale), when ``init`` is not
    known (None: no ``scaler_created`` event), and when the run of cuts is
    :data:`MAX_CALIBRATION_CUTS` long or longer (a collapse). ``frame``: the rank's scaler steps
    in step order. Every rule that judges cuts or skipped steps leaves these steps out.
    """
    if frame.empty or init is None or float(frame["scale_before"].iloc[0]) != init:
        return 0
    cuts = (frame["scale_after"] < frame["scale_before"]).to_numpy(dtype=bool, na_value=False)
    leading = int(np.argmin(cuts)) if not cuts.all() else len(cuts)
    return leading if leading < MAX_CALIBRATION_CUTS else 0


def calibration_steps(run: Run, rank: int) -> list[int]:
    """The step numbers of ``rank``'s initial calibration (:func:`compute_calibration`)."""
    table = run.cached("calibration_steps", _calibration_steps)
    return table.get(rank, [])


def _calibration_steps(run: Run) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for rank, frame in per_rank(scaler_steps(run)):
        n = compute_calibration(frame, init_scale(run, rank))
        out[rank] = [int(s) for s in frame["step"].iloc[:n]]
    return out
