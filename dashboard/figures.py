"""Figures the dashboard draws from a run's step frame: pure ``make_*_figure(frame)`` functions.

Each takes the ``steps`` frame (``Run.steps`` or the live tail's frame; columns from
:data:`amprobe.store.schema.TABLES`) and returns a plotly figure whose long series are thinned
to :data:`amprobe.report.downsample.MAX_POINTS` for display. They draw what was recorded and derive
nothing beyond reading the scale before/after each update.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from amprobe.report.downsample import MAX_POINTS
from amprobe.report.escape import escape_figure_text
from amprobe.report.scale import (
    empty_figure,
    make_loss_scale_figure,
    scale_events,
    scaler_rows,
    sort_steps,
    split_ranks,
    thin_series,
)
from amprobe.report.whatif import HEATMAP_GROUPS, make_exponent_heatmap

__all__ = [
    "make_whatif_figure",
    "whatif_groups",
    "make_loss_scale_figure",
    "make_step_time_figure",
    "make_compare_figure",
    "scale_events",
    "scaler_rows",
]


def make_step_time_figure(steps: pd.DataFrame, max_points: int = MAX_POINTS) -> go.Figure:
    """Wall time of each step and the probe's own share of it, in milliseconds."""
    if steps.empty or "wall_s" not in steps or not steps["wall_s"].notna().any():
        return empty_figure("not recorded: no step time")
    fig = go.Figure()
    multi = "rank" in steps and steps["rank"].nunique() > 1
    for rank, part in split_ranks(sort_steps(steps)):
        suffix = f" (rank {rank})" if multi else ""
        x, y = thin_series(part, "wall_s", max_points)
        fig.add_trace(go.Scatter(x=x, y=y * 1e3, mode="lines", name=f"step time{suffix}"))
        if "probe_s" in part and part["probe_s"].fillna(0).gt(0).any():
            x, y = thin_series(part, "probe_s", max_points)
            fig.add_trace(
                go.Scatter(
                    x=x, y=y * 1e3, mode="lines", name=f"probe time{suffix}", line={"dash": "dot"}
                )
            )
    fig.update_layout(
        height=300,
        template="plotly_white",
        xaxis_title="step",
        yaxis_title="ms",
        margin={"t": 30, "b": 40, "l": 60, "r": 20},
    )
    return fig


def make_compare_figure(
    a: pd.DataFrame,
    b: pd.DataFrame,
    names: tuple[str, str] = ("A", "B"),
    max_points: int = MAX_POINTS,
) -> go.Figure:
    """Two runs overlaid: step time, loss and loss scale (log) against step."""
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.07,
        subplot_titles=("step time (ms)", "loss", "loss scale (log)"),
    )
    colors = ("#1f77b4", "#d62728")
    for frame, name, color in zip((a, b), names, colors, strict=True):
        if frame.empty:
            continue
        first = frame[frame["rank"] == frame["rank"].min()] if "rank" in frame else frame
        first = first.sort_values("step")
        for row, column, scale in ((1, "wall_s", 1e3), (2, "loss", 1.0), (3, "scale_before", 1.0)):
            if column not in first or not first[column].notna().any():
                continue
            x, y = thin_series(first, column, max_points)
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=y * scale,
                    mode="lines",
                    name=name,
                    legendgroup=name,
                    showlegend=row == 1,
                    line={"color": color},
                ),
                row,
                1,
            )
    escape_figure_text(fig)  # run names are folder names: drawn as text, never as HTML
    fig.update_yaxes(type="log", row=3, col=1)
    fig.update_xaxes(title_text="step", row=3, col=1)
    fig.update_layout(
        height=640, template="plotly_white", margin={"t": 40, "b": 40, "l": 60, "r": 20}
    )
    return fig


def whatif_groups(numerics: pd.DataFrame) -> list[str]:
    """The what-if heatmap groups (activations, gradients) that ``numerics`` has rows for."""

    if numerics.empty:
        return []
    kinds = set(numerics["kind"].dropna().unique())
    return [g for g, (_, wanted, _) in HEATMAP_GROUPS.items() if kinds & set(wanted)]


def make_whatif_figure(numerics: pd.DataFrame, whatif: pd.DataFrame, group: str) -> go.Figure:
    """The report's per-layer exponent-range heatmap of ``group`` (amprobe's own figure)."""

    if group not in HEATMAP_GROUPS:
        group = next(iter(HEATMAP_GROUPS))
    return make_exponent_heatmap(numerics, group, whatif)
