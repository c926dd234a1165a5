"""The ranks of one job side by side: step x rank grids and per-rank medians."""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["compute_rank_grid", "compute_rank_medians"]


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


def compute_rank_medians(steps: pd.DataFrame, column: str, warmup_steps: int) -> pd.Series:
    """Median of ``column`` per rank over the steps after ``warmup_steps`` (NaN rows ignored)."""
    body = steps.loc[steps["step"].to_numpy() >= warmup_steps, ["rank", column]]
    return body.groupby("rank", sort=True)[column].median().dropna()
