"""Small frame helpers shared by every analysis: per-rank slicing, scaler steps, autocast dtypes,
and whether amprobe itself forced the run to fp32."""

from __future__ import annotations

import marshal
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd

from amprobe.store.loader import Run

__all__ = [
    "percent_text",
    "points_text",
    "HALF_DTYPES",
    "MAX_LISTED_STEPS",
    "per_rank",
    "scaler_steps",
    "scaler_configs",
    "autocast_dtypes",
    "steps_list",
    "step_ranges",
    "range_text",
    "steps_text",
    "RANGE_DASH",
    "forced_fp32",
    "FORCED_FP32",
    "section_keys",
]

HALF_DTYPES = ("float16", "bfloat16")
RANGE_DASH = "\u2013"  # en dash, between the first and last step of a run
MAX_LISTED_STEPS = 20  # step numbers spelled out in a ``*_steps`` evidence list
#: what a run forced to fp32 is, in the words of "not checked" reasons and health notes
FORCED_FP32 = "the FP32 leg of `amprobe baseline` (amprobe forced fp32)"


def steps_list(steps: pd.Series | list[int] | Any, limit: int = MAX_LISTED_STEPS) -> list[int]:
    """The first ``limit`` step numbers, for evidence."""
    return [int(s) for s in list(steps)[:limit]]


def step_ranges(
    steps: pd.Series | list[int] | Any, limit: int | None = MAX_LISTED_STEPS
) -> list[list[int]]:
    """Every step as ``[first, last]`` runs of consecutive step numbers, ascending, for evidence.

    Beside a ``*_steps`` list (the first ``limit`` steps), the runs say which steps the list
    left out: ``[[120, 179]]`` for 60 consecutive skipped steps. At most the first ``limit`` runs
    (every run when ``limit`` is None).
    """
    values = np.unique(np.asarray(list(steps), dtype=np.int64))
    if not len(values):
        return []
    breaks = np.flatnonzero(np.diff(values) != 1)
    starts = np.concatenate(([0], breaks + 1))[:limit]
    ends = np.concatenate((breaks, [len(values) - 1]))[:limit]
    return [[int(values[a]), int(values[b])] for a, b in zip(starts, ends, strict=True)]


def range_text(first: int, last: int, word: bool = False) -> str:
    """A run of steps as every view writes it: ``81–83`` (en dash), ``81`` for one step; with
    ``word``, ``steps 81–83`` / ``step 81``."""
    text = str(first) if first == last else f"{first}{RANGE_DASH}{last}"
    if not word:
        return text
    return ("step " if first == last else "steps ") + text


def steps_text(
    steps: pd.Series | list[int] | Any, limit: int | None = None, word: bool = False
) -> str:
    """Step numbers as runs: ``[0, 81, 82, 83]`` -> ``0, 81–83`` (:func:`range_text` each).

    Args:
        steps: step numbers, in any order, repeats allowed.
        limit: the first ``limit`` runs, then ``…`` (every run when None).
        word: start with ``step`` (one step) or ``steps``.
    """
    runs = step_ranges(steps, limit=None)
    text = ", ".join(range_text(a, b) for a, b in runs[:limit])
    if limit is not None and len(runs) > limit:
        text += ", \u2026"
    if not word:
        return text
    return ("step " if len(runs) == 1 and runs[0][0] == runs[0][1] else "steps ") + text


def points_text(points: float, digits: int) -> str:
    """``points`` (a percentage) with ``digits`` decimals, more where rounding would say what is
    not so: below 100 never ``100.0`` (99.95: ``99.95``), above zero never ``0.0`` (0.004:
    ``0.004``); past 8 decimals a value just under 100 is cut, not rounded."""
    text = f"{points:.{digits}f}"
    while digits < 8 and ((float(text) >= 100.0 > points) or (float(text) == 0.0 and points > 0.0)):
        digits += 1
        text = f"{points:.{digits}f}"
    if float(text) >= 100.0 > points:  # closer to 100 % than 8 decimals tell: cut, not round
        text = f"{math.floor(points * 10**digits) / 10**digits:.{digits}f}"
    return text


def percent_text(fraction: float, digits: int = 1, space: bool = True) -> str:
    """A fraction as a percentage with ``digits`` decimals (:func:`points_text`: a share below
    100 % never reads ``100.0 %``, a share above zero never ``0.0 %``)."""
    text = points_text(100.0 * float(fraction), digits)
    return f"{text} %" if space else f"{text}%"


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
    """The dtypes of enabled autocast regions seen in the run: the ``autocast_seen`` events and
    the steps' ``autocast_dtype``, from each rank's ``scaler`` summary section."""
    return {
        str(d)
        for parts in run.summaries().values()
        for d in parts.get("scaler", {}).get("autocast_dtypes", ())
    }


def forced_fp32(run: Run) -> bool:
    """Whether amprobe itself turned autocast and GradScalers off in this run.

    True for the FP32 leg of ``amprobe baseline`` (``forced_fp32`` in a rank manifest, written
    by :mod:`amprobe.control.autoattach`): its missing autocast and disabled scaler are amprobe's doing,
    not the script's, so the rules that judge the script's AMP setup do not judge it.
    """
    return any(info.manifest.get("forced_fp32") is True for info in run.ranks)


def section_keys(run: Run, name: str) -> dict[int, int]:
    """rank -> the class of its summary's ``name`` section (None when it has none): two ranks
    get the same number only when their sections are equal, order included (their
    ``marshal`` bytes are, as :func:`amprobe.rules.engine.data_key` compares them; ``repr``
    for a value marshal cannot write). Computed once per run and section, for every rule
    and table that works once per class of ranks with equal sections (a ``numerics``
    section's bytes took 0.27 s at 4,096 ranks, and three readers made them again); the
    bytes are not kept, only the class numbers."""

    def compute(run: Run) -> dict[int, int]:
        classes: dict[bytes | str, int] = {}
        out: dict[int, int] = {}
        for rank, summary in run.summaries().items():
            section = summary.get(name)
            try:
                key: bytes | str = marshal.dumps(section)
            except ValueError:  # not plain values (marshal cannot write them)
                key = repr(section)
            out[rank] = classes.setdefault(key, len(classes))
        return out

    return run.cached(f"section_keys:{name}", compute)  # type: ignore[no-any-return]
