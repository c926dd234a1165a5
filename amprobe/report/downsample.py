"""Thin long series for display; the full data stays in the run and in the frames.

Min/max bucketing: the series is cut into equal buckets and each bucket keeps its lowest and
highest point, so spikes (an overflow, a loss jump) survive where plain striding would drop
them. It is vectorised (one reshape) and costs a few milliseconds for 100,000 points.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["MAX_POINTS", "MAX_COLUMNS", "minmax_indices", "thin_figure", "downsample"]

#: Points kept per displayed series.
MAX_POINTS = 2000
#: Columns kept per displayed heatmap (e.g. a layer x step grid).
MAX_COLUMNS = 1000


def minmax_indices(values: Any, max_points: int = MAX_POINTS) -> np.ndarray:
    """Indices of the points to draw from ``values`` (sorted, first and last always kept).

    Args:
        values: the series' y values, in x order; NaN counts as neither low nor high, but a
            bucket that holds one keeps its first NaN, so a gap in the series (a NaN loss)
            stays a gap in the thinned series.
        max_points: the most points to return (at least 4).

    Returns:
        Sorted integer indices into ``values``; ``arange(n)`` when the series is short.
    """
    y = np.asarray(values, dtype="float64")
    n = len(y)
    if n <= max_points:
        return np.arange(n)
    gaps = bool(np.isnan(y).any())
    buckets = max(max_points // (3 if gaps else 2) - 1, 1)
    size = -(-n // buckets)
    padded = np.full(buckets * size, np.nan)
    padded[:n] = y
    grid = padded.reshape(buckets, size)
    nan = np.isnan(grid)
    low = np.where(nan, np.inf, grid).argmin(axis=1)
    high = np.where(nan, -np.inf, grid).argmax(axis=1)
    base = np.arange(buckets) * size
    parts = [base + low, base + high, np.array([0, n - 1])]
    if gaps:
        has = nan.any(axis=1)
        parts.append((base + nan.argmax(axis=1))[has])
    keep = np.concatenate(parts)
    keep = keep[keep < n]
    return np.unique(keep)


def _values(value: Any) -> Any:
    """A trace array as plotly holds it, as an array: plotly 6+ stores a numpy array it has
    copied (``copy.deepcopy`` of a figure) as a binary ``{"dtype", "bdata"[, "shape"]}`` dict,
    which ``np.asarray`` cannot read; a list or tuple is returned as it is."""
    if isinstance(value, dict) and "bdata" in value and "dtype" in value:
        data = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
        shape = value.get("shape")
        if shape:
            data = data.reshape([int(n) for n in str(shape).split(",")])
        return data
    return value


def _thin_heatmap(trace: Any, max_columns: int) -> None:
    z = _values(trace.z)
    if z is None:
        return
    try:
        grid = np.asarray(z, dtype="float64")
    except (TypeError, ValueError):
        return
    if grid.ndim != 2 or grid.shape[1] <= max_columns:
        return
    cols = grid.shape[1]
    size = -(-cols // max_columns)
    groups = -(-cols // size)
    padded = np.full((grid.shape[0], groups * size), np.nan)
    padded[:, :cols] = grid
    pooled = padded.reshape(grid.shape[0], groups, size)
    empty = np.isnan(pooled).all(axis=2)
    # max keeps "something happened in this span" visible; an all-NaN span stays NaN
    reduced = np.where(empty, np.nan, np.where(np.isnan(pooled), -np.inf, pooled).max(axis=2))
    update: dict[str, Any] = {"z": reduced}
    x = _values(trace.x)
    if x is not None and len(x) == cols:
        update["x"] = [x[i * size] for i in range(groups)]
    trace.update(**update)


def thin_figure(fig: Any, max_points: int = MAX_POINTS, max_columns: int = MAX_COLUMNS) -> Any:
    """Thin every long scatter trace and wide heatmap of a plotly figure, in place.

    Figures built by report sections carry full series; the dashboard thins them for the
    browser. Scatter traces keep their min/max points per bucket; heatmaps are max-pooled
    along x. Returns the figure.
    """
    for trace in getattr(fig, "data", ()):
        kind = getattr(trace, "type", None)
        if kind in ("scatter", "scattergl"):
            y = _values(trace.y)
            if y is None or len(y) <= max_points:
                continue
            try:
                keep = minmax_indices(np.asarray(y, dtype="float64"), max_points)
            except (TypeError, ValueError):
                continue
            kept = np.asarray(y, dtype=object if isinstance(y, (list, tuple)) else None)[keep]
            # a list keeps its None (a gap: JSON null); an array keeps its NaN
            update: dict[str, Any] = {"y": kept.tolist() if isinstance(y, (list, tuple)) else kept}
            x = _values(trace.x)
            if x is None or len(x) != len(y):
                continue  # x and y could no longer be paired: leave the trace whole
            update["x"] = np.asarray(x)[keep]
            for key in ("text", "customdata", "hovertext"):
                value = _values(getattr(trace, key, None))
                if value is not None and not isinstance(value, str) and len(value) == len(y):
                    update[key] = np.asarray(value)[keep]
            trace.update(**update)
        elif kind == "heatmap":
            _thin_heatmap(trace, max_columns)
    return fig


def downsample(frame: pd.DataFrame, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Every k-th row so that at most ``max_points`` remain (first and last rows kept)."""
    if len(frame) <= max_points:
        return frame
    step = -(-len(frame) // max_points)
    keep = frame.iloc[::step]
    if keep.index[-1] != frame.index[-1]:
        keep = pd.concat([keep, frame.iloc[[-1]]])
    return keep
