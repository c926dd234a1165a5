"""A run at a glance, for a listing or a page header: how many steps, the autocast dtypes,
when it started and how long it ran (to each rank's end marker, or an open rank's last step),
and why a run that wrote step records has none that can be read.

Read from the per-rank summaries (:meth:`amprobe.store.run.Run.summaries`: one small record a
rank) and the end of each open rank's steps file, never from every rank's steps table, so that a
run of thousands of ranks costs milliseconds per rank (issue #33). The one exception is a rank
whose summary could not list its steps (more than the summary's cap of step runs): that rank's
steps are read alone to count the distinct steps.
"""

from __future__ import annotations

import os
from typing import Any

from amprobe.analysis.scaler import run_autocast_dtypes, scaler_summaries
from amprobe.store.layout import table_filename
from amprobe.store.run import Run, rank_last_rows

__all__ = [
    "distinct_step_count",
    "autocast_dtype_text",
    "open_rank_last_times",
    "lost_steps",
    "run_times",
    "run_period",
]


def distinct_step_count(run: Run) -> int:
    """How many distinct step numbers the ranks recorded (what ``run.steps["step"].nunique()``
    counts), from each rank's runs of steps in its summary; a rank whose summary capped them is
    read alone (:meth:`Run.rank_table`)."""
    runs: list[tuple[int, int]] = []
    for rank, facts in scaler_summaries(run).items():
        if not facts["rows"]:
            continue
        if facts["complete"]:
            runs.extend((int(a), int(b)) for a, b in facts["all_runs"])
        else:
            steps = run.rank_table("steps", rank)["step"].unique()
            runs.extend((int(s), int(s)) for s in steps)
    count, end = 0, None
    for first, last in sorted(runs):
        if end is None or first > end:
            count += last - first + 1
            end = last
        elif last > end:
            count += last - end
            end = last
    return count


def autocast_dtype_text(run: Run) -> str:
    """The dtypes autocast ran in (steps and ``autocast_seen`` events, any rank), joined by
    commas, or ``"not recorded"``."""
    dtypes = run_autocast_dtypes(run)
    return ", ".join(sorted(dtypes)) if dtypes else "not recorded"


def open_rank_last_times(run: Run) -> dict[int, float]:
    """For each rank without an end marker (live, or stopped without closing): the time (``t``,
    seconds from the rank's start) of its last complete steps row, read from the end of its
    steps file. Ranks with no such row, or a last row without a time, are left out."""
    open_ranks = [info.rank for info in run.ranks if info.end is None]
    out: dict[int, float] = {}
    for rank, row in rank_last_rows(run, ranks=open_ranks).items():
        t = (row or {}).get("t")
        if isinstance(t, (int, float)) and not isinstance(t, bool) and t == t:
            out[rank] = float(t)
    return out


def lost_steps(run: Run) -> list[str]:
    """Why a run that holds no readable step record is garbage, one line per rank, or [] when
    it may truly have none: a rank's steps file holds bytes but no step record that can be
    read, holds records without a valid step, or its end marker counts steps the file does
    not hold. Call it on a run whose summaries count no step."""
    filename = table_filename("steps")
    reasons: list[str] = []
    summaries = run.summaries()
    for info in run.ranks:
        facts = summaries.get(info.rank, {}).get("steps") or {}
        if facts.get("rows"):
            continue
        invalid = int(facts.get("invalid") or 0)
        try:
            size = os.stat(info.path / filename).st_size
        except OSError:
            size = 0
        claimed = (info.end or {}).get("steps")
        if invalid:
            reasons.append(
                f"rank {info.rank}: {filename} holds {invalid} record(s), none with a valid step"
            )
        elif size:
            reasons.append(
                f"rank {info.rank}: {filename} holds {size:,} bytes but no step record that "
                "can be read"
            )
        elif isinstance(claimed, int) and not isinstance(claimed, bool) and claimed > 0:
            reasons.append(
                f"rank {info.rank}: its end marker counts {claimed} steps but {filename} "
                "holds none that can be read"
            )
    return reasons


def _unix(obj: Any, key: str) -> float | None:
    value = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def run_times(
    run_manifest: Any, ranks: list[tuple[Any, Any, float | None]]
) -> tuple[float | None, float | None, bool]:
    """``(started, duration_s, open)`` of a run from its manifests and end markers.

    ``ranks`` holds per rank ``(manifest, end marker or None, seconds from the rank's start to
    its last recorded step or None)``. A run whose every rank ended lasts to the last
    ``end_unix``; otherwise (``open``) to the last step recorded so far, if any.
    """
    starts = [s for s in (_unix(m, "start_unix") for m, _, _ in ranks) if s is not None]
    started = min(starts) if starts else _unix(run_manifest, "created_unix")
    if started is None:
        return None, None, False
    ends = [_unix(end, "end_unix") for _, end, _ in ranks]
    if ranks and all(e is not None for e in ends):
        return started, max(0.0, max(e for e in ends if e is not None) - started), False
    lasts = [
        start + last
        for start, last in ((_unix(m, "start_unix"), t) for m, _, t in ranks)
        if start is not None and last is not None
    ]
    return started, (max(0.0, max(lasts) - started) if lasts else None), True


def run_period(run: Run) -> tuple[float | None, float | None, bool]:
    """:func:`run_times` of a loaded run: ``(started, duration_s, open)``, an open rank's last
    step time read from the end of its steps file."""
    last_t = open_rank_last_times(run)
    return run_times(run.manifest, [(i.manifest, i.end, last_t.get(i.rank)) for i in run.ranks])
