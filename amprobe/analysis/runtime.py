"""The runtime profile: data-loader wait, GPU utilization, host-device sync sites.

The step facts of a rank come from its summary's ``steps`` and ``runtime`` sections
(:mod:`amprobe.store.sections.runtime`): :func:`rank_runtime`, :func:`timed_hist`,
:func:`summary_data_wait`, :func:`summary_steps`. Quantiles read from those histograms are
within :data:`~amprobe.store.sections.runtime.QUANTILE_REL_ERROR` (0.27 %) of the exact ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from amprobe.store.loader import Run
from amprobe.store.sections.runtime import (
    BUCKETS_PER_OCTAVE,
    Ranges,
    hist_add,
    hist_buckets,
    new_hist,
)

__all__ = [
    "rank_runtime",
    "rank_step_counts",
    "timed_hist",
    "hist_quantiles",
    "median_of",
    "step_rows_from",
    "summary_steps",
    "summary_data_wait",
    "expand_steps",
    "column",
    "compute_data_wait",
    "compute_gpu_util",
    "compute_sync_sites",
    "gpu_unavailable_reason",
    "training_samples",
]


def column(frame: pd.DataFrame, name: str) -> pd.Series:
    return frame[name] if name in frame else pd.Series([], dtype="float64")


def gpu_unavailable_reason(run: Run) -> str | None:
    """Why the run has no GPU samples (from the sampler's events), or None if it has some."""
    gpu = run.table("gpu")
    if len(gpu) and column(gpu, "gpu_util").notna().any():
        return None
    notes = run.events_of("gpu_sampler")
    for note in notes:
        if note.get("status") in ("not available", "not sampled", "stopped") and note.get("reason"):
            return str(note["reason"])
    if notes:
        return "the GPU sampler recorded no utilization sample"
    return "the GPU sampler did not run (runtime collector off or gpu_sample_hz=0)"


def training_samples(gpu: pd.DataFrame, skip_steps: int) -> pd.DataFrame:
    """GPU samples taken while training ran, after the first ``skip_steps`` steps (warm-up)."""
    if gpu.empty:
        return gpu
    return gpu[gpu["step"] >= skip_steps]


def compute_data_wait(steps: pd.DataFrame, skip_steps: int) -> dict[str, Any] | None:
    """Data-wait share of one rank's steps: sum(data_wait_s) / sum(wall_s), warm-up skipped.

    Steps whose syncs were counted are left out (the dispatch mode inflates their time) unless
    no other step is left.
    """
    # the rows kept, as positions: three masked copies of the steps table cost more than the
    # arithmetic; the sums and medians are taken on the same values, in the same order
    rows = np.flatnonzero((steps["data_wait_s"].notna() & steps["wall_s"].notna()).to_numpy())
    if len(rows):
        step = steps["step"].iloc[rows]
        rows = rows[(step >= step.min() + skip_steps).to_numpy()]
    sampled = steps["syncs_sampled"].iloc[rows].fillna(False).astype(bool).to_numpy()
    if not sampled.all():
        rows = rows[~sampled]
    walls = steps["wall_s"].iloc[rows]
    wall = float(walls.sum())
    if not len(rows) or wall <= 0:
        return None
    waits = steps["data_wait_s"].iloc[rows]
    return {
        "data_wait_share": float(waits.sum()) / wall,
        "data_wait_s_median": float(waits.median()),
        "wall_s_median": float(walls.median()),
        "measured_step_count": int(len(rows)),
    }


def compute_gpu_util(gpu: pd.DataFrame, skip_steps: int) -> dict[str, Any] | None:
    """Median NVML GPU utilization of one rank's training-time samples."""
    samples = training_samples(gpu, skip_steps)
    util = column(samples, "gpu_util").dropna()
    if not len(util):
        return None
    return {"gpu_util_median": float(util.median()), "gpu_sample_count": int(len(util))}


def compute_sync_sites(syncs: pd.DataFrame, sampled_steps: int, kind: str = "user") -> pd.DataFrame:
    """Syncs per sampled step by source line and op, most frequent first."""
    rows = syncs[syncs["kind"] == kind] if len(syncs) else syncs
    if rows.empty or sampled_steps <= 0:
        return pd.DataFrame(columns=["site", "op", "per_step", "total"])
    grouped = rows.groupby(["site", "op"], as_index=False)["count"].sum()
    grouped = grouped.rename(columns={"count": "total"})
    grouped["per_step"] = grouped["total"] / sampled_steps
    return grouped.sort_values(["total", "site"], ascending=[False, True])[
        ["site", "op", "per_step", "total"]
    ].reset_index(drop=True)


# -- from the per-rank summaries -----------------------------------------------------------------
def rank_runtime(run: Run) -> dict[int, dict[str, Any]]:
    """rank -> its summary's ``runtime`` section, for the ranks that recorded a step."""
    return {
        rank: facts["runtime"]
        for rank, facts in sorted(run.summaries().items())
        if facts.get("runtime") and (facts.get("steps") or {}).get("rows")
    }


def rank_step_counts(run: Run) -> dict[int, int]:
    """rank -> rows with a valid step (each (window, step) once: see the "steps" section)."""
    return {
        rank: int(facts["steps"]["rows"])
        for rank, facts in sorted(run.summaries().items())
        if (facts.get("steps") or {}).get("rows")
    }


def timed_hist(runtime: Mapping[str, Any], metric: str, min_step: int) -> dict[str, Any]:
    """Histogram of ``metric`` (``"wall"`` or ``"wait"``) over the rank's steps >= ``min_step``,
    with its buckets as arrays: ``n``, ``sum``, ``min``, ``max``, ``zero`` and ``keys`` (bucket
    indexes ascending) / ``counts`` (numpy), for :func:`hist_quantiles`.

    Exact in which rows it counts while the rows below ``min_step`` are all in the summary's
    head (``min_step`` up to :data:`~amprobe.store.sections.runtime.HEAD_ROWS` steps past the
    first); rows beyond the head are all counted.
    """
    times = runtime.get("times") or {}
    parts = [times["both"]["plain"][metric], times["both"]["sampled"][metric]] if times else []
    if times:
        parts.append(times["wall_only" if metric == "wall" else "wait_only"])
    extra = new_hist()
    column = 1 if metric == "wall" else 2
    for row in runtime.get("head", ()):
        if row[0] >= min_step and row[column] is not None:
            hist_add(extra, row[column])
    return _array_hist([*parts, extra])


def _array_hist(parts: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The sum of histograms (either form) with its buckets as sorted numpy arrays."""
    # the parts' buckets as one pair of lists, then one array each (a rank's histograms are
    # read for several rules at thousands of ranks: no dict and no array per part)
    keys: list[Any] = []
    counts: list[Any] = []
    for h in parts:
        b = h["b"]
        if not isinstance(b, dict) and b and len(b[0]) == len(b[1]) == len(set(b[0])):
            keys += b[0]  # the JSON form, its indexes distinct: as hist_buckets reads it
            counts += b[1]
        else:
            b = hist_buckets(h)
            keys += b
            counts += b.values()
    key_all = np.array(keys, dtype=np.int64)
    count_all = np.array(counts, dtype=np.int64)
    if len(key_all) < 2 or (key_all[1:] > key_all[:-1]).all():
        uniq, summed = key_all, count_all  # ascending and distinct already
    else:
        uniq, where = np.unique(key_all, return_inverse=True)
        summed = np.zeros(len(uniq), dtype=np.int64)
        np.add.at(summed, where, count_all)
    mins = [h["min"] for h in parts if h["min"] is not None]
    maxs = [h["max"] for h in parts if h["max"] is not None]
    return {
        "n": int(sum(h["n"] for h in parts)),
        "sum": float(sum(h["sum"] for h in parts)),
        "min": min(mins) if mins else None,
        "max": max(maxs) if maxs else None,
        "zero": int(sum(h["zero"] for h in parts)),
        "keys": uniq,
        "counts": summed,
    }


def hist_quantiles(hist: Mapping[str, Any], ks: np.ndarray) -> np.ndarray:
    """The order statistics ``ks`` (0-based) of a :func:`timed_hist` histogram: 0 for a value
    <= 0, else the bucket's geometric midpoint clipped to the exact min/max (within
    :data:`~amprobe.store.sections.runtime.QUANTILE_REL_ERROR` of the value)."""
    ks = np.asarray(ks, dtype=np.int64)
    out = np.full(len(ks), min(0.0, float(hist["min"] if hist["min"] is not None else 0.0)))
    positive = ks >= hist["zero"]
    if positive.any() and len(hist["keys"]):
        ends = hist["zero"] + np.cumsum(hist["counts"])
        at = np.minimum(np.searchsorted(ends, ks[positive], side="right"), len(ends) - 1)
        mids = np.exp2((hist["keys"][at] + 0.5) / BUCKETS_PER_OCTAVE)
        out[positive] = np.clip(mids, float(hist["min"]), float(hist["max"]))
    return out


def median_of(hist: Mapping[str, Any]) -> float | None:
    """The median of a :func:`timed_hist` histogram (the mean of the two middle values for an
    even count), or None when empty."""
    n = int(hist["n"])
    if not n:
        return None
    ks = [n // 2] if n % 2 else [n // 2 - 1, n // 2]
    return float(hist_quantiles(hist, np.asarray(ks)).mean())


def step_rows_from(runtime: Mapping[str, Any], rows: int, min_step: int) -> int:
    """How many of a rank's ``rows`` have a step >= ``min_step`` (the head holds the lowest)."""
    return rows - sum(1 for r in runtime.get("head", ()) if r[0] < min_step)


def summary_steps(
    *ranges: Mapping[str, Any] | None, min_step: int | None = None
) -> list[list[int]]:
    """Sorted, disjoint ``[first, last]`` runs of the steps in one or more of a summary's
    ranges (from ``min_step`` on when given); the runs a capped list left out are missing."""
    runs = sorted(list(r) for one in ranges for r in Ranges.runs(one))
    out: list[list[int]] = []
    for a, b in runs:
        if min_step is not None:
            if b < min_step:
                continue
            a = max(a, min_step)
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def expand_steps(runs: list[list[int]], limit: int) -> list[int]:
    """The first ``limit`` step numbers of sorted runs."""
    out: list[int] = []
    for a, b in runs:
        out.extend(range(a, min(b, a + limit - len(out) - 1) + 1))
        if len(out) >= limit:
            break
    return out


def summary_data_wait(runtime: Mapping[str, Any], skip_steps: int) -> dict[str, Any] | None:
    """:func:`compute_data_wait` from a rank's ``runtime`` summary.

    The steps are those that measured both the step time and the data wait, from the lowest
    such step + ``skip_steps`` on (exact while that lies within the summary's head of
    :data:`~amprobe.store.sections.runtime.HEAD_ROWS` rows), sync-sampled steps left out unless
    no other is left. The sums are exact (up to the order of float additions); the medians come
    from the histograms (within 0.27 %).
    """
    head = [r for r in runtime.get("head", ()) if r[1] is not None and r[2] is not None]
    # without a paired row in the head (its first HEAD_ROWS rows miss a time) the paired rows
    # all lie in the histograms, and none can be left out: they are all counted
    start = min(r[0] for r in head) + skip_steps if head else -(2**62)
    head = [r for r in head if r[0] >= start]
    both = (runtime.get("times") or {}).get("both")
    plain = [r for r in head if not r[3]]
    use_plain = bool(plain) or bool(both and both["plain"]["wall"]["n"])
    group = both["plain" if use_plain else "sampled"] if both else None
    rows = plain if use_plain else head
    extra = {"wall": new_hist(), "wait": new_hist()}
    for _, wall, wait, _ in rows:
        hist_add(extra["wall"], wall)
        hist_add(extra["wait"], wait)
    walls = _array_hist([*([group["wall"]] if group else []), extra["wall"]])
    waits = _array_hist([*([group["wait"]] if group else []), extra["wait"]])
    n = int(walls["n"])
    if not n or walls["sum"] <= 0:
        return None
    return {
        "data_wait_share": float(waits["sum"]) / float(walls["sum"]),
        "data_wait_s_median": median_of(waits),
        "wall_s_median": median_of(walls),
        "measured_step_count": n,
    }
