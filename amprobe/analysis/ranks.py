"""The ranks of one job side by side: step x rank grids, per-rank medians and the median of the
other ranks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from amprobe.analysis.runtime import hist_quantiles

__all__ = [
    "QUANTILES",
    "compute_hist_quantiles",
    "compute_others_median",
    "compute_rank_grid",
    "compute_rank_medians",
    "compute_reduce_peaks",
]


def compute_rank_grid(
    frame: pd.DataFrame, *columns: str
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """``(steps, ranks, grids)``: per column, ``grid[i, j]`` = its value at ``steps[i]`` on ``ranks[j]``.

    Missing values are NaN; when a rank recorded a step twice (several recording windows) the
    last row wins. Vectorized: 256 ranks x 10,000 steps take well under a second.
    """
    steps_u, step_idx = np.unique(frame["step"].to_numpy(), return_inverse=True)
    ranks_u, rank_idx = np.unique(frame["rank"].to_numpy(), return_inverse=True)
    grids = []
    for column in columns:
        grid = np.full((len(steps_u), len(ranks_u)), np.nan)
        grid[step_idx, rank_idx] = frame[column].to_numpy(dtype=float, na_value=np.nan)
        grids.append(grid)
    return steps_u, ranks_u, grids


#: The quantiles at which ranks' step-time distributions are paired (AMP-D02): 200, evenly
#: spaced, so a share of them is read to 0.5 %.
QUANTILES = (np.arange(200) + 0.5) / 200


def compute_hist_quantiles(
    hists: Sequence[Mapping[str, Any]], qs: np.ndarray = QUANTILES
) -> np.ndarray:
    """``out[i, j]``: quantile ``qs[i]`` of histogram ``hists[j]`` (as
    :func:`~amprobe.analysis.runtime.timed_hist` returns them), the order statistic of rank
    ``round(q * (n - 1))`` (within 0.27 %); NaN for an empty histogram. A quantile x rank grid
    of a few hundred rows replaces the step x rank grid when ranks are compared from summaries."""
    out = np.full((len(qs), len(hists)), np.nan)
    for j, hist in enumerate(hists):
        n = int(hist["n"])
        if n:
            out[:, j] = hist_quantiles(hist, np.rint(qs * (n - 1)).astype(np.int64))
    return out


def compute_rank_medians(steps: pd.DataFrame, column: str, warmup_steps: int) -> pd.Series:
    """Median of ``column`` per rank over the steps after ``warmup_steps`` (NaN rows ignored)."""
    body = steps.loc[steps["step"].to_numpy() >= warmup_steps, ["rank", column]]
    return body.groupby("rank", sort=True)[column].median().dropna()


def compute_others_median(grid: np.ndarray, columns: np.ndarray | None = None) -> np.ndarray:
    """Per row of ``grid`` (no NaN, at least 2 columns), the median of the row without column ``j``.

    Returns an array of shape ``(rows, len(columns))`` (every column when ``columns`` is None):
    ``out[i, c]`` is the median of ``grid[i]`` with ``grid[i, columns[c]]`` left out. It needs
    only two or three order statistics of each row (``np.partition``, taken in blocks of rows
    so that memory stays a few MB), not a sort per left-out column: with the row sorted as
    ``s`` and ``m = n - 1`` values left, the left-out value ``x`` shifts each order statistic
    ``s[k]`` of the rest to ``s[k + 1]`` when ``x <= s[k]`` (ties leave the same values).
    """
    rows, n = grid.shape
    if n < 2:
        raise ValueError("the median of the other columns needs at least 2 columns")
    picked = np.arange(n) if columns is None else np.asarray(columns, dtype=int)
    out = np.empty((rows, len(picked)))
    m = n - 1
    k2 = m // 2
    kth = [k2, k2 + 1] if m % 2 else [k2 - 1, k2, k2 + 1]
    block = max(1, 1_000_000 // n)
    for start in range(0, rows, block):
        part = grid[start : start + block]
        stats = np.partition(part, kth, axis=1)
        x = part[:, picked]
        upper = np.where(x <= stats[:, [k2]], stats[:, [k2 + 1]], stats[:, [k2]])
        if m % 2:
            out[start : start + block] = upper
        else:
            lower = np.where(x <= stats[:, [k2 - 1]], stats[:, [k2]], stats[:, [k2 - 1]])
            out[start : start + block] = (lower + upper) / 2
    return out


def compute_reduce_peaks(
    numerics: pd.DataFrame, world_size: int, pre_divide: float, measured: str
) -> pd.DataFrame:
    """Per ``grad_param`` row, the largest magnitude inside a fp16 gradient reduction.

    ``peak = amax * loss_scale * max(1, world_size / pre_divide)``: the recorded maximum is
    divided by the loss scale, the reduction runs on scaled gradients, and summing
    ``world_size`` ranks' values each divided by ``pre_divide`` grows them by at most
    ``world_size / pre_divide`` (a cast before a full pre-division, as DDP's hook does, is
    bounded by the rank's own maximum). With ``measured == "reduced"`` (FSDP2 hands the
    reduced mean to the hooks) ``amax`` is the mean's maximum and the bound is the sum's
    own value. ``nonfinite`` marks rows whose reduced gradient is inf/NaN while the same
    module's output gradient on that rank and step was finite: the overflow happened in the
    reduction (only for ``measured == "reduced"``).
    """
    rows = numerics[numerics["kind"] == "grad_param"].copy()
    factor = max(1.0, world_size / pre_divide) if pre_divide > 0 else float(world_size)
    scale = rows["loss_scale"].astype(float).fillna(1.0)
    rows["peak"] = rows["amax"].astype(float) * scale * factor
    bad = (rows["inf"].fillna(0) + rows["nan"].fillna(0)) > 0
    if measured == "reduced" and bad.any():
        gout = numerics[numerics["kind"] == "grad_output"]
        gout_bad = gout.assign(g_bad=(gout["inf"].fillna(0) + gout["nan"].fillna(0)) > 0)[
            ["rank", "step", "module", "g_bad"]
        ]
        merged = rows[["rank", "step", "module"]].merge(
            gout_bad, on=["rank", "step", "module"], how="left"
        )
        upstream_bad = merged["g_bad"].fillna(False).astype(bool).to_numpy()
        rows["nonfinite"] = bad.to_numpy() & ~upstream_bad
    else:
        rows["nonfinite"] = False
    return rows
