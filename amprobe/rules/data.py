"""Named data requirements and the small frame helpers that rules share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd

from amprobe.rules.engine import requirement
from amprobe.store.loader import Run

__all__ = [
    "HALF_DTYPES",
    "per_rank",
    "scaler_steps",
    "scaler_configs",
    "autocast_dtypes",
    "steps_list",
]

HALF_DTYPES = ("float16", "bfloat16")


def steps_list(steps: pd.Series | list[int], limit: int = 20) -> list[int]:
    """The first ``limit`` step numbers, for evidence."""
    return [int(s) for s in list(steps)[:limit]]


def per_rank(frame: pd.DataFrame) -> Iterator[tuple[int, pd.DataFrame]]:
    """``(rank, rows of that rank sorted by step)`` for each rank, lowest first.

    The loader returns rows grouped by rank in recording order, so the common case is sliced
    without sorting or grouping (hundreds of ranks stay cheap); other frames are sorted once.
    """
    if frame.empty:
        return
    ranks = frame["rank"].to_numpy()
    steps = frame["step"].to_numpy()
    new_rank = ranks[1:] != ranks[:-1]
    ordered = bool((ranks[1:] >= ranks[:-1]).all()) and bool(
        ((steps[1:] >= steps[:-1]) | new_rank).all()
    )
    if not ordered:
        frame = frame.sort_values(["rank", "step"], kind="stable")
        ranks = frame["rank"].to_numpy()
        new_rank = ranks[1:] != ranks[:-1]
    bounds = [0, *(np.flatnonzero(new_rank) + 1).tolist(), len(frame)]
    for start, stop in zip(bounds[:-1], bounds[1:], strict=False):
        yield int(ranks[start]), frame.iloc[start:stop]


def scaler_steps(run: Run) -> pd.DataFrame:
    """Steps recorded with an enabled GradScaler and a known scale (computed once per run)."""
    return run.cached("scaler_steps", _scaler_steps)


def _scaler_steps(run: Run) -> pd.DataFrame:
    steps = run.steps
    if steps.empty:
        return steps
    mask = steps["scaler_enabled"].fillna(False).astype(bool) & steps["scale_before"].notna()
    return steps[mask]


def scaler_configs(run: Run) -> list[dict[str, Any]]:
    """Every GradScaler seen (``scaler_created`` events)."""
    return run.events_of("scaler_created")


def autocast_dtypes(run: Run) -> set[str]:
    """The dtypes of enabled autocast regions seen in the run."""
    dtypes = {e.get("dtype") for e in run.events_of("autocast_seen") if e.get("enabled")}
    steps = run.steps
    if not steps.empty:
        dtypes |= set(steps["autocast_dtype"].dropna().unique())
    return {d for d in dtypes if d}


@requirement("steps")
def _has_steps(run: Run) -> str | None:
    return None if len(run.steps) else "no training step was recorded"


@requirement("scaler")
def _has_scaler(run: Run) -> str | None:
    if not len(run.steps):
        return "no training step was recorded"
    if len(scaler_steps(run)):
        return None
    return "no enabled GradScaler was used (bf16/fp32 run, scaler disabled or absent)"


@requirement("autocast")
def _has_autocast(run: Run) -> str | None:
    return None if autocast_dtypes(run) else "no enabled autocast region was seen"


@requirement("optimizer")
def _has_optimizer(run: Run) -> str | None:
    return None if run.events_of("optimizer_seen") else "no optimizer step was seen"


@requirement("loss")
def _has_loss(run: Run) -> str | None:
    steps = run.steps
    if len(steps) and steps["loss_dtype"].notna().any():
        return None
    return "no loss tensor was seen (no backward() or scaler.scale() call recorded)"


@requirement("device_facts")
def _has_device_facts(run: Run) -> str | None:
    if any("bf16_supported" in r.manifest for r in run.ranks):
        return None
    return "the training device was not recorded"
