"""Loss-scale section: the scale trajectory with skipped steps marked, and the loss curve."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from amprobe.report.downsample import MAX_POINTS, minmax_indices
from amprobe.report.registry import Section, section

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from amprobe.rules.engine import Diagnosis
    from amprobe.store.loader import Run


__all__ = [
    "make_loss_scale_figure",
    "scale_events",
    "scaler_rows",
    "empty_figure",
    "sort_steps",
    "split_ranks",
    "thin_series",
    "cap_rows",
]

_SKIP_COLOR = "#d62728"
_GROW_COLOR = "#2ca02c"
_CUT_COLOR = "#ff7f0e"


def empty_figure(message: str) -> go.Figure:
    """A blank figure that says why nothing is drawn."""
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(height=240, xaxis_visible=False, yaxis_visible=False, template="plotly_white")
    return fig


def sort_steps(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows in (rank, step) order."""
    return frame.sort_values(["rank", "step"] if "rank" in frame else ["step"], kind="stable")


def scaler_rows(steps: pd.DataFrame) -> pd.DataFrame:
    """The steps taken with an enabled GradScaler and a recorded scale."""
    if steps.empty or "scale_before" not in steps:
        return steps.iloc[0:0]
    enabled = (
        steps["scaler_enabled"].fillna(False).astype(bool) if "scaler_enabled" in steps else True
    )
    return sort_steps(steps[enabled & steps["scale_before"].notna()])


def thin_series(frame: pd.DataFrame, column: str, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """Steps and values of ``column`` (non-null), min/max-thinned to ``max_points``."""
    part = frame[frame[column].notna()]
    x = part["step"].to_numpy()
    y = part[column].to_numpy(dtype="float64")
    keep = minmax_indices(y, max_points)
    return x[keep], y[keep]


def split_ranks(frame: pd.DataFrame) -> list[tuple[int, pd.DataFrame]]:
    """``(rank, rows)`` pairs; a frame without ranks is rank 0."""
    if "rank" not in frame or frame.empty:
        return [(0, frame)]
    return [(int(r), part) for r, part in frame.groupby("rank", sort=True)]


def cap_rows(frame: pd.DataFrame, max_points: int) -> pd.DataFrame:
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
    out = pd.DataFrame(
        {
            "rank": changed["rank"] if "rank" in changed else 0,
            "step": changed["step"],
            "event": np.where(
                changed["scale_after"] > changed["scale_before"], "growth", "backoff"
            ),
            "scale_before": changed["scale_before"],
            "scale_after": changed["scale_after"],
        }
    )
    return out.reset_index(drop=True)[columns]


def make_loss_scale_figure(steps: pd.DataFrame, max_points: int = MAX_POINTS) -> go.Figure:
    """Loss scale per step on a log axis (skipped steps, growth and backoff marked), loss beneath.

    Args:
        steps: the run's steps frame.
        max_points: points kept per drawn series.
    """
    import plotly.graph_objects as go  # plotly loads only when a figure is made
    from plotly.subplots import make_subplots

    rows = scaler_rows(steps)
    has_loss = not steps.empty and "loss" in steps and steps["loss"].notna().any()
    if rows.empty and not has_loss:
        return empty_figure("not recorded: no step with an enabled GradScaler or a loss value")
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        row_heights=[0.6, 0.4],
        subplot_titles=("loss scale (log)", "loss"),
    )
    multi = "rank" in steps and steps["rank"].nunique() > 1
    for rank, part in split_ranks(rows):
        suffix = f" (rank {rank})" if multi else ""
        x, y = thin_series(part, "scale_before", max_points)
        fig.add_trace(
            go.Scatter(x=x, y=y, mode="lines", name=f"scale{suffix}", line_shape="hv"), 1, 1
        )
        skipped = (
            part[part["skipped"].fillna(False).astype(bool)]
            if "skipped" in part
            else part.iloc[0:0]
        )
        if len(skipped):
            skipped = cap_rows(skipped, max_points)
            fig.add_trace(
                go.Scatter(
                    x=skipped["step"],
                    y=skipped["scale_before"],
                    mode="markers",
                    name=f"skipped step{suffix}",
                    marker={"symbol": "x", "color": _SKIP_COLOR, "size": 8},
                ),
                1,
                1,
            )
    events = scale_events(rows)
    for kind, color, symbol in (
        ("growth", _GROW_COLOR, "triangle-up"),
        ("backoff", _CUT_COLOR, "triangle-down"),
    ):
        part = cap_rows(events[events["event"] == kind], max_points)
        if len(part):
            fig.add_trace(
                go.Scatter(
                    x=part["step"],
                    y=part["scale_after"],
                    mode="markers",
                    name=kind,
                    marker={"symbol": symbol, "color": color, "size": 7},
                ),
                1,
                1,
            )
    if rows.empty:
        fig.add_annotation(
            text="not recorded: no enabled GradScaler",
            showarrow=False,
            xref="x domain",
            yref="y domain",
            x=0.5,
            y=0.5,
            row=1,
            col=1,
        )
    if has_loss:
        for rank, part in split_ranks(sort_steps(steps)):
            x, y = thin_series(part, "loss", max_points)
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=y,
                    mode="lines",
                    name=f"loss (rank {rank})" if multi else "loss",
                    line={"color": "#444"},
                ),
                2,
                1,
            )
    else:
        fig.add_annotation(
            text="not recorded: no loss value (capture_loss off?)",
            showarrow=False,
            xref="x2 domain",
            yref="y2 domain",
            x=0.5,
            y=0.5,
        )
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(
        height=520,
        template="plotly_white",
        margin={"t": 40, "b": 40, "l": 60, "r": 20},
        legend={"orientation": "h", "y": -0.15},
    )
    return fig


@section("scale", order=10, tab="Loss scale")
def build_scale_section(run: Run, diagnosis: Diagnosis) -> Section:
    steps = run.steps
    title = "Loss scale and loss"
    if steps.empty:
        return Section("scale", title, missing="no training step was recorded")
    has_scale = steps["scale_after"].notna().any()
    has_loss = steps["loss"].notna().any()
    if not has_scale and not has_loss:
        return Section("scale", title, missing="no GradScaler and no loss tensor were seen")
    text = []
    if not has_scale:
        text.append("No enabled GradScaler was used in this run: only the loss is shown.")
    scaled = steps[steps["scale_after"].notna()]
    if len(scaled):
        skipped = int(scaled["skipped"].fillna(False).astype(bool).sum())
        cuts = int((scaled["scale_after"] < scaled["scale_before"]).sum())
        grows = int((scaled["scale_after"] > scaled["scale_before"]).sum())
        text.append(
            f"{len(scaled)} scaled steps: {skipped} skipped, {cuts} scale cuts (backoff), "
            f"{grows} growth events; final scale {scaled['scale_after'].iloc[-1]:g}."
        )
    return Section("scale", title, figures=(make_loss_scale_figure(steps),), text=tuple(text))
