"""Figures the dashboard draws from a run's step frame: pure ``make_*_figure(frame)`` functions.

Each takes the ``steps`` frame (``Run.steps`` or the live tail's frame; columns from
:data:`amprobe.store.schema.TABLES`) and returns a plotly figure whose long series are thinned
to :data:`dashboard.downsample.MAX_POINTS` for display. They draw what was recorded and derive
nothing beyond reading the scale before/after each update.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboard.downsample import MAX_POINTS, minmax_indices

__all__ = [
    "make_loss_scale_figure",
    "make_step_time_figure",
    "make_compare_figure",
    "scale_events",
    "scaler_rows",
]

_SKIP_COLOR = "#d62728"
_GROW_COLOR = "#2ca02c"
_CUT_COLOR = "#ff7f0e"


def _empty(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(height=240, xaxis_visible=False, yaxis_visible=False, template="plotly_white")
    return fig


def _sorted(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values(["rank", "step"] if "rank" in frame else ["step"], kind="stable")


def scaler_rows(steps: pd.DataFrame) -> pd.DataFrame:
    """The steps taken with an enabled GradScaler and a recorded scale."""
    if steps.empty or "scale_before" not in steps:
        return steps.iloc[0:0]
    enabled = steps["scaler_enabled"].fillna(False).astype(bool) if "scaler_enabled" in steps else True
    return _sorted(steps[enabled & steps["scale_before"].notna()])


def _series(frame: pd.DataFrame, column: str, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    part = frame[frame[column].notna()]
    x = part["step"].to_numpy()
    y = part[column].to_numpy(dtype="float64")
    keep = minmax_indices(y, max_points)
    return x[keep], y[keep]


def _ranks(frame: pd.DataFrame) -> list[tuple[int, pd.DataFrame]]:
    if "rank" not in frame or frame.empty:
        return [(0, frame)]
    return [(int(r), part) for r, part in frame.groupby("rank", sort=True)]


def _cap(frame: pd.DataFrame, max_points: int) -> pd.DataFrame:
    """Evenly spaced rows when there are too many markers to draw."""
    if len(frame) <= max_points:
        return frame
    return frame.iloc[np.linspace(0, len(frame) - 1, max_points).astype(int)]


def scale_events(steps: pd.DataFrame) -> pd.DataFrame:
    """Growth and backoff of the loss scale: one row per update that changed it.

    Returns columns ``rank, step, event ("growth" | "backoff"), scale_before, scale_after``.
    """
    rows = scaler_rows(steps)
    columns = ["rank", "step", "event", "scale_before", "scale_after"]
    if rows.empty or "scale_after" not in rows:
        return pd.DataFrame(columns=columns)
    changed = rows[rows["scale_after"].notna() & (rows["scale_after"] != rows["scale_before"])]
    out = pd.DataFrame({
        "rank": changed["rank"] if "rank" in changed else 0,
        "step": changed["step"],
        "event": np.where(changed["scale_after"] > changed["scale_before"], "growth", "backoff"),
        "scale_before": changed["scale_before"],
        "scale_after": changed["scale_after"],
    })
    return out.reset_index(drop=True)[columns]


def make_loss_scale_figure(steps: pd.DataFrame, max_points: int = MAX_POINTS) -> go.Figure:
    """Loss scale per step on a log axis (skipped steps, growth and backoff marked), loss beneath.

    Args:
        steps: the run's steps frame.
        max_points: points kept per drawn series.
    """
    rows = scaler_rows(steps)
    has_loss = not steps.empty and "loss" in steps and steps["loss"].notna().any()
    if rows.empty and not has_loss:
        return _empty("not recorded: no step with an enabled GradScaler or a loss value")
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4],
        subplot_titles=("loss scale (log)", "loss"),
    )
    multi = "rank" in steps and steps["rank"].nunique() > 1
    for rank, part in _ranks(rows):
        suffix = f" (rank {rank})" if multi else ""
        x, y = _series(part, "scale_before", max_points)
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=f"scale{suffix}", line_shape="hv"), 1, 1)
        skipped = part[part["skipped"].fillna(False).astype(bool)] if "skipped" in part else part.iloc[0:0]
        if len(skipped):
            skipped = _cap(skipped, max_points)
            fig.add_trace(go.Scatter(
                x=skipped["step"], y=skipped["scale_before"], mode="markers",
                name=f"skipped step{suffix}", marker={"symbol": "x", "color": _SKIP_COLOR, "size": 8},
            ), 1, 1)
    events = scale_events(rows)
    for kind, color, symbol in (("growth", _GROW_COLOR, "triangle-up"), ("backoff", _CUT_COLOR, "triangle-down")):
        part = _cap(events[events["event"] == kind], max_points)
        if len(part):
            fig.add_trace(go.Scatter(
                x=part["step"], y=part["scale_after"], mode="markers", name=kind,
                marker={"symbol": symbol, "color": color, "size": 7},
            ), 1, 1)
    if rows.empty:
        fig.add_annotation(text="not recorded: no enabled GradScaler", showarrow=False,
                           xref="x domain", yref="y domain", x=0.5, y=0.5, row=1, col=1)
    if has_loss:
        for rank, part in _ranks(_sorted(steps)):
            x, y = _series(part, "loss", max_points)
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=f"loss (rank {rank})" if multi else "loss",
                                     line={"color": "#444"}), 2, 1)
    else:
        fig.add_annotation(text="not recorded: no loss value (capture_loss off?)", showarrow=False,
                           xref="x2 domain", yref="y2 domain", x=0.5, y=0.5)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(height=520, template="plotly_white", margin={"t": 40, "b": 40, "l": 60, "r": 20},
                      legend={"orientation": "h", "y": -0.15})
    return fig


def make_step_time_figure(steps: pd.DataFrame, max_points: int = MAX_POINTS) -> go.Figure:
    """Wall time of each step and the probe's own share of it, in milliseconds."""
    if steps.empty or "wall_s" not in steps or not steps["wall_s"].notna().any():
        return _empty("not recorded: no step time")
    fig = go.Figure()
    multi = "rank" in steps and steps["rank"].nunique() > 1
    for rank, part in _ranks(_sorted(steps)):
        suffix = f" (rank {rank})" if multi else ""
        x, y = _series(part, "wall_s", max_points)
        fig.add_trace(go.Scatter(x=x, y=y * 1e3, mode="lines", name=f"step time{suffix}"))
        if "probe_s" in part and part["probe_s"].fillna(0).gt(0).any():
            x, y = _series(part, "probe_s", max_points)
            fig.add_trace(go.Scatter(x=x, y=y * 1e3, mode="lines", name=f"probe time{suffix}",
                                     line={"dash": "dot"}))
    fig.update_layout(height=300, template="plotly_white", xaxis_title="step", yaxis_title="ms",
                      margin={"t": 30, "b": 40, "l": 60, "r": 20})
    return fig


def make_compare_figure(
    a: pd.DataFrame, b: pd.DataFrame, names: tuple[str, str] = ("A", "B"), max_points: int = MAX_POINTS
) -> go.Figure:
    """Two runs overlaid: step time, loss and loss scale (log) against step."""
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.07,
                        subplot_titles=("step time (ms)", "loss", "loss scale (log)"))
    colors = ("#1f77b4", "#d62728")
    for frame, name, color in zip((a, b), names, colors, strict=True):
        if frame.empty:
            continue
        first = frame[frame["rank"] == frame["rank"].min()] if "rank" in frame else frame
        first = first.sort_values("step")
        for row, column, scale in ((1, "wall_s", 1e3), (2, "loss", 1.0), (3, "scale_before", 1.0)):
            if column not in first or not first[column].notna().any():
                continue
            x, y = _series(first, column, max_points)
            fig.add_trace(go.Scatter(x=x, y=y * scale, mode="lines", name=name, legendgroup=name,
                                     showlegend=row == 1, line={"color": color}), row, 1)
    fig.update_yaxes(type="log", row=3, col=1)
    fig.update_xaxes(title_text="step", row=3, col=1)
    fig.update_layout(height=640, template="plotly_white", margin={"t": 40, "b": 40, "l": 60, "r": 20})
    return fig
