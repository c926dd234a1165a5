"""The loss-scale trajectory: cuts and growth, runs of cuts, the scaler success rate.

The per-rank facts come from the ``scaler`` summary section
(:mod:`amprobe.store.sections.scaler`); :func:`rank_scaler` gives one rank's section with every
change point listed, reading that rank's rows alone when its summary's lists were capped or
its steps are not in ascending order; :func:`rank_scaler_rows` gives one rank's scaler steps as
rows, for a rank whose steps repeat a step number (the summary's runs of steps cannot say which
row is which there). :func:`scale_events` (a frame of every rank's scaler steps, read from the
merged ``steps`` frame) stays for notebooks; ``diagnose`` no longer calls it.
"""

from __future__ import annotations

import bisect
import json
from typing import Any

import numpy as np
import pandas as pd

from amprobe.analysis.frames import scaler_steps
from amprobe.store.loader import Run
from amprobe.store.sections.scaler import ScalerSection

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
    "scaler_summaries",
    "rank_scaler",
    "scaler_ranks",
    "rank_scaler_rows",
    "row_indices",
    "distinct_step_count",
    "scaled_before",
    "run_autocast_dtypes",
    "cut_steps",
    "count_in_runs",
    "expand_runs",
    "runs_without",
    "nth_step",
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
    facts = list(scaler_summaries(run).values())
    count = sum(f["n"] for f in facts)
    if not count:
        return None
    skipped = sum(f["skipped"] for f in facts)
    return {
        "value": 1.0 - skipped / count,
        "step_count": int(count),
        "skipped_count": int(skipped),
    }


def success_rate_metric(run: Run) -> dict[str, Any]:
    """The success rate as a reported metric: :func:`compute_success_rate`'s dict, or
    ``{"value": None, "note": why}`` (the one answer of the health metric and the comparison)."""
    rate = compute_success_rate(run)
    if rate is not None:
        return dict(rate)
    if any(f["rows"] for f in scaler_summaries(run).values()):
        why = "not applicable: no enabled GradScaler (every step applied its update)"
    else:
        why = "not measured: no training step was recorded"
    return {"value": None, "note": why}


def growth_interval(run: Run, rank: int) -> int:
    """The ``growth_interval`` of ``rank``'s last GradScaler (PyTorch's default when unknown)."""
    interval = scaler_summaries(run).get(rank, _NONE)["growth_interval"]
    return int(interval) if interval else DEFAULT_GROWTH_INTERVAL


def init_scale(run: Run, rank: int) -> float | None:
    """The ``init_scale`` of ``rank``'s last GradScaler, if recorded."""
    value = scaler_summaries(run).get(rank, _NONE)["init_scale"]
    return None if value is None else float(value)


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
    facts = rank_scaler(run, rank)
    init = facts["init_scale"]
    if not facts["n"] or init is None or float(facts["first_before"]) != init:
        return []
    leading = facts["leading_cuts"]
    return [int(h[0]) for h in facts["head"][:leading]] if leading < MAX_CALIBRATION_CUTS else []


# -- the summary's facts ---------------------------------------------------------------------
_NONE: dict[str, Any] = ScalerSection().to_json()  # a rank without the section: no rows


def scaler_summaries(run: Run) -> dict[int, dict[str, Any]]:
    """Every rank's ``scaler`` section (a rank that lacks one: a section of no rows); built
    once per run (rules ask for it per rank: a new dict each call cost O(ranks) per rank)."""
    return run.cached(  # type: ignore[no-any-return]
        "scaler_summaries",
        lambda r: {rank: parts.get("scaler", _NONE) for rank, parts in r.summaries().items()},
    )


def scaler_ranks(run: Run) -> list[int]:
    """The ranks with at least one scaler step, lowest first (those ``per_rank(scaler_steps)``
    walks)."""
    return sorted(rank for rank, facts in scaler_summaries(run).items() if facts["n"])


def run_autocast_dtypes(run: Run) -> frozenset[str]:
    """The dtypes of enabled autocast regions seen on any rank (events and steps)."""
    return frozenset(d for f in scaler_summaries(run).values() for d in f["autocast_dtypes"])


def rank_scaler(run: Run, rank: int) -> dict[str, Any]:
    """``rank``'s scaler section with every change point and run listed, in step order.

    The summary's when its lists are complete and its scaler steps ascend; otherwise the section
    of that rank's rows alone (:meth:`Run.rank_table`), sorted by step (stably, as
    ``per_rank`` sorts), without a cap. The events facts are the summary's either way.
    """
    facts = scaler_summaries(run).get(rank, _NONE)
    if not facts["n"] or (facts["complete"] and facts["ordered"]):
        return facts
    return run.cached(f"rank_scaler:{rank}", lambda r: _rank_scaler_from_rows(r, rank, facts))


def _rank_scaler_from_rows(run: Run, rank: int, facts: dict[str, Any]) -> dict[str, Any]:
    frame = run.rank_table("steps", rank)
    section = ScalerSection(uncapped=True)
    if len(frame):
        frame = frame.sort_values("step", kind="stable").drop(columns=["rank"])
        for row in frame.to_dict("records"):
            section.add("steps", {k: (None if v is pd.NA else v) for k, v in row.items()})
    steps = section.to_json()
    steps.update({k: facts[k] for k in _EVENT_FACTS})
    return steps


def rank_scaler_rows(run: Run, rank: int) -> pd.DataFrame:
    """``rank``'s scaler steps (enabled GradScaler, known ``scale_before``) from its own rows
    (:meth:`Run.rank_table`), sorted by step stably: the rows ``per_rank(scaler_steps(run))``
    gave for that rank, without reading the other ranks."""
    frame = run.rank_table("steps", rank)
    if not len(frame):
        return frame
    mask = frame["scaler_enabled"].fillna(False).astype(bool) & frame["scale_before"].notna()
    return frame[mask].sort_values("step", kind="stable")


def row_indices(step_runs: list[list[int]], steps: list[int]) -> list[int]:
    """The row index (from 0) of each of ``steps`` (ascending, each in ``step_runs``) among the
    steps of ``step_runs`` (ascending ``[first, last]`` runs of distinct steps)."""
    out: list[int] = []
    run, before = 0, 0  # the run searched and the rows of the runs before it
    for step in steps:
        while step > step_runs[run][1]:
            before += step_runs[run][1] - step_runs[run][0] + 1
            run += 1
        out.append(before + step - step_runs[run][0])
    return out


def count_in_runs(step_runs: list[list[int]], steps: set[int]) -> int:
    """How many of ``steps`` lie in ``[first, last]`` runs (ascending, disjoint)."""
    firsts = [r[0] for r in step_runs]
    count = 0
    for s in steps:
        i = bisect.bisect_right(firsts, s) - 1
        count += i >= 0 and s <= step_runs[i][1]
    return count


def scaled_before(run: Run, rank: int, step: int) -> bool:
    """Whether ``rank`` recorded a scaler step (an enabled GradScaler) before ``step``."""
    facts = rank_scaler(run, rank)
    return bool(facts["n"]) and bool(facts["step_runs"]) and facts["step_runs"][0][0] < step


def distinct_step_count(run: Run) -> int:
    """How many distinct step numbers the ranks recorded (``run.steps["step"].nunique()``),
    from each rank's runs of steps in its ``scaler`` section (its rows, read alone, for a rank
    whose summary capped them). Computed once per run."""
    count: int = run.cached("distinct_step_count", _distinct_step_count)
    return count


def _distinct_step_count(run: Run) -> int:
    runs: list[list[int]] = []
    for rank, facts in scaler_summaries(run).items():
        if facts["complete"]:
            runs.extend(facts["all_runs"])
        else:
            steps = run.rank_table("steps", rank)
            if len(steps):
                runs.extend([int(s), int(s)] for s in steps["step"].unique())
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


#: the section's facts that come from events (a rank's rows re-read give only the steps')
_EVENT_FACTS = (
    "autocast_dtypes",
    "created",
    "disabled",
    "sites",
    "sites_complete",
    "init_scale",
    "growth_interval",
    "optimizer_loads",
    "scaler_loads",
    "scaler_loads_nonempty",
)


def expand_runs(runs: list[list[int]], limit: int | None = None) -> list[int]:
    """The steps of ``[first, last]`` runs, ascending (the first ``limit``)."""
    out: list[int] = []
    for first, last in runs:
        stop = last + 1 if limit is None else min(last + 1, first + limit - len(out))
        out.extend(range(first, stop))
        if limit is not None and len(out) >= limit:
            break
    return out


def runs_without(runs: list[list[int]], left_out: set[int]) -> list[list[int]]:
    """``runs`` with the steps in ``left_out`` (a few) taken out."""
    out: list[list[int]] = []
    for first, last in runs:
        cut = sorted(s for s in left_out if first <= s <= last)
        start = first
        for s in cut:
            if s > start:
                out.append([start, s - 1])
            start = s + 1
        if start <= last:
            out.append([start, last])
    return out


def nth_step(runs: list[list[int]], index: int) -> int:
    """The ``index``-th step (from 0) of ``[first, last]`` runs."""
    for first, last in runs:
        if index <= last - first:
            return first + index
        index -= last - first + 1
    raise IndexError(index)


def cut_steps(facts: dict[str, Any]) -> list[int]:
    """The steps whose update cut the scale (``scale_after < scale_before``), ascending."""
    return [int(u[0]) for u in facts["updates"] if u[2] is not None and u[2] < u[1]]


def scale_trajectory_classes(
    run: Run,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ranks' scale and skip trajectories, one column per class of equal trajectories.

    Returns ``(ranks, class_of, steps, present, scales, skipped)``: the ranks with a scaler
    step (ascending) and the class of each; the step numbers any rank recorded; per step and
    class whether the class recorded it, its ``scale_before`` (NaN where absent) and whether it
    skipped it. Ranks whose summaries list the same scaler steps, first scale, change points and
    skipped runs share a class, so agreeing ranks cost one comparison of their facts each and
    no step x rank grid is built. A rank whose summary lists are capped or out of step order is
    a class of its own, read from its rows (the last row of a repeated step wins, as in
    :func:`~amprobe.analysis.ranks.compute_rank_grid`).
    """
    summaries = scaler_summaries(run)
    ranks = np.array(scaler_ranks(run), dtype=np.int64)
    keys: dict[str, int] = {}
    columns: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    class_of = np.empty(len(ranks), dtype=np.int64)
    for i, rank in enumerate(ranks.tolist()):
        facts = summaries[rank]
        if facts["complete"] and facts["ordered"]:
            parts = ("step_runs", "first_before", "updates", "jumps", "skipped_runs")
            key = json.dumps([facts[k] for k in parts])
            if key not in keys:
                keys[key] = len(columns)
                columns.append(_summary_column(facts))
        else:
            key = f"rows of rank {rank}"
            keys[key] = len(columns)
            columns.append(_rows_column(run, rank))
        class_of[i] = keys[key]
    if not columns:
        empty = np.zeros((0, 0))
        return ranks, class_of, np.zeros(0, dtype=np.int64), empty.astype(bool), empty, empty
    steps = np.unique(np.concatenate([c[0] for c in columns]))
    present = np.zeros((len(steps), len(columns)), dtype=bool)
    scales = np.full((len(steps), len(columns)), np.nan)
    skipped = np.zeros((len(steps), len(columns)), dtype=bool)
    for j, (col_steps, col_scales, col_skipped) in enumerate(columns):
        at = np.searchsorted(steps, col_steps)
        present[at, j] = True
        scales[at, j] = col_scales
        skipped[at, j] = col_skipped
    return ranks, class_of, steps, present, scales, skipped


def _summary_column(facts: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One rank's steps, scales before and skipped flags, rebuilt from its change points."""
    steps = np.array(expand_runs(facts["step_runs"]), dtype=np.int64)
    points = [(int(steps[0]), 0, float(facts["first_before"]))]
    for step, _before, after in facts["updates"]:  # the scale after an update holds next
        points.append((int(step) + 1, 0, np.nan if after is None else float(after)))
    for step, _prev_after, before in facts["jumps"]:  # a jump sets the step's own scale
        points.append((int(step), 1, float(before)))
    points.sort(key=lambda p: (p[0], p[1]))
    where = np.array([p[0] for p in points], dtype=np.int64)
    values = np.array([p[2] for p in points], dtype=float)
    scales = values[np.searchsorted(where, steps, side="right") - 1]
    skipped_steps = np.array(expand_runs(facts["skipped_runs"]), dtype=np.int64)
    return steps, scales, np.isin(steps, skipped_steps)


def _rows_column(run: Run, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    frame = run.rank_table("steps", rank)
    if len(frame):
        mask = frame["scaler_enabled"].fillna(False).astype(bool) & frame["scale_before"].notna()
        frame = frame[mask]
    steps = frame["step"].to_numpy(dtype=np.int64) if len(frame) else np.zeros(0, np.int64)
    scales = frame["scale_before"].to_numpy(dtype=float) if len(frame) else np.zeros(0)
    skipped = (
        frame["skipped"].to_numpy(dtype=float, na_value=np.nan) == 1
        if len(frame)
        else np.zeros(0, bool)
    )
    # the last row of a repeated step wins: keep each step's last occurrence
    last = len(steps) - 1 - np.unique(steps[::-1], return_index=True)[1]
    return steps[last], scales[last], skipped[last]
