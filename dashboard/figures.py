"""Figures the dashboard draws from a run's step frame: pure ``make_*_figure(frame)`` functions.

Each takes the ``steps`` frame (``Run.steps`` or the live tail's frame; columns from
:data:`amprobe.store.schema.TABLES`) and returns a plotly figure whose long series are thinned
to :data:`amprobe.report.downsample.MAX_POINTS` for display. They draw what was recorded and derive
nothing beyond reading the scale before/after each update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from amprobe.analysis.rankbands import StepsRelation, compute_rank_bands
from amprobe.report.blockfit import FIGURE_META as BLOCK_FIT_META
from amprobe.report.blockfit import make_block_fit_figure
from amprobe.report.downsample import MAX_POINTS
from amprobe.report.escape import escape_figure_text, escape_plotly_text
from amprobe.report.scale import (
    add_loss_bands,
    add_rank_bands,
    bands_note,
    empty_figure,
    gaps_as_null,
    make_loss_scale_figure,
    many_ranks,
    rank_color,
    run_ranks,
    scale_events,
    scaler_rows,
    sort_steps,
    split_ranks,
    thin_series,
)
from amprobe.report.whatif import HEATMAP_GROUPS, heatmap_groups, make_run_exponent_heatmap

if TYPE_CHECKING:
    from amprobe.store.loader import Run

__all__ = [
    "make_whatif_figure",
    "make_block_fit_figure",
    "split_block_fit",
    "whatif_groups",
    "make_loss_scale_figure",
    "make_step_time_figure",
    "make_compare_figure",
    "scale_events",
    "scaler_rows",
]


def make_step_time_figure(
    steps: pd.DataFrame | StepsRelation, max_points: int = MAX_POINTS
) -> go.Figure:
    """Wall time of each step and the probe's own share of it, in milliseconds (one colour
    per rank: step time solid, probe time dotted). A run of many ranks may give its
    :class:`~amprobe.analysis.rankbands.StepsRelation` (bands reduced in DuckDB)."""
    if isinstance(steps, StepsRelation):
        if not steps.has("wall_s"):
            return empty_figure("not recorded: no step time")
        return _step_time_bands(go.Figure(), steps, run_ranks(steps))
    if steps.empty or "wall_s" not in steps or not steps["wall_s"].notna().any():
        return empty_figure("not recorded: no step time")
    fig = go.Figure()
    ranks = run_ranks(steps)
    multi = len(ranks) > 1
    if many_ranks(ranks):
        return _step_time_bands(fig, steps, ranks)
    for rank, part in split_ranks(sort_steps(steps)):
        suffix = f" (rank {rank})" if multi else ""
        color = rank_color(rank, ranks)
        x, y = thin_series(part, "wall_s", max_points)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y * 1e3,
                mode="lines",
                name=f"step time{suffix}",
                legendgroup=f"rank {rank}",
                line={"color": color},
            )
        )
        if "probe_s" in part and part["probe_s"].fillna(0).gt(0).any():
            x, y = thin_series(part, "probe_s", max_points)
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=y * 1e3,
                    mode="lines",
                    name=f"probe time{suffix}",
                    legendgroup=f"rank {rank}",
                    line={"dash": "dot", "color": color},
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


def _probe_recorded(steps: pd.DataFrame | StepsRelation) -> bool:
    """Whether some step recorded a positive probe time."""
    if isinstance(steps, StepsRelation):
        return bool(steps.query("SELECT count(*) AS n FROM s WHERE probe_s > 0")["n"].iloc[0])
    return "probe_s" in steps and bool(steps["probe_s"].fillna(0).gt(0).any())


def _step_time_bands(
    fig: go.Figure, steps: pd.DataFrame | StepsRelation, ranks: list[int]
) -> go.Figure:
    """:func:`make_step_time_figure` for many ranks: step time as bands across ranks (each
    rank's median in a bin) with the outlier ranks alone; probe time as its median of ranks."""
    bands = add_rank_bands(
        fig, steps, "wall_s", "step time", lambda r: f"step time (rank {r})", ranks, scale=1e3
    )
    notes = [bands_note("step time", bands)]
    if _probe_recorded(steps):
        probe = compute_rank_bands(steps, "probe_s")
        fig.add_trace(
            go.Scatter(
                x=probe.bins.first.astype("int32"),
                y=gaps_as_null(probe.median * 1e3),
                mode="lines",
                line={"dash": "dot", "color": "#555"},
                connectgaps=False,
                name="probe time: median of ranks",
            )
        )
    fig.update_layout(
        height=340,
        template="plotly_white",
        xaxis_title="step",
        yaxis_title="ms",
        title={"text": "<br>".join(notes), "font": {"size": 11}},
        margin={"t": 60, "b": 40, "l": 60, "r": 20},
    )
    return fig


def make_compare_figure(
    a: pd.DataFrame,
    b: pd.DataFrame,
    names: tuple[str, str] = ("A", "B"),
    max_points: int = MAX_POINTS,
) -> go.Figure:
    """Two runs overlaid: step time, loss and loss scale (log) against step.

    Each run's lowest rank is drawn (named so when the run has several). Steps whose loss
    was NaN/inf are gaps in that run's loss line, shaded in its colour and labelled
    ("A: loss NaN, steps 80–119").
    """
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.07,
        subplot_titles=("step time (ms)", "loss", "loss scale (log)"),
    )
    colors = ("#1f77b4", "#d62728")
    positions = ("top", "bottom")
    for frame, name, color, position in zip((a, b), names, colors, positions, strict=True):
        if frame.empty:
            continue
        first = frame[frame["rank"] == frame["rank"].min()] if "rank" in frame else frame
        first = first.sort_values("step")
        label = name
        if "rank" in frame and frame["rank"].nunique() > 1:
            label = f"{name} (rank {int(frame['rank'].min())})"
        for row, column, scale in ((1, "wall_s", 1e3), (2, "loss", 1.0), (3, "scale_before", 1.0)):
            if column not in first or not first[column].notna().any():
                continue
            x, y = thin_series(first, column, max_points, keep_gaps=column == "loss")
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=gaps_as_null(y * scale),
                    mode="lines",
                    name=label,
                    legendgroup=name,
                    showlegend=row == 1,
                    line={"color": color},
                    connectgaps=False,
                ),
                row,
                1,
            )
        # the band's label is layout text, not escaped with the traces: escape the name here
        add_loss_bands(
            fig,
            first,
            row=2,
            prefix=f"{escape_plotly_text(label)}: ",
            color=color,
            position=position,
        )
    escape_figure_text(fig)  # run names are folder names: drawn as text, never as HTML
    fig.update_yaxes(type="log", row=3, col=1)
    fig.update_xaxes(title_text="step", row=3, col=1)
    fig.update_layout(
        height=640, template="plotly_white", margin={"t": 40, "b": 40, "l": 60, "r": 20}
    )
    return fig


def whatif_groups(run: Run) -> list[str]:
    """The what-if heatmap groups (activations, gradients) that the run has numerics rows for
    (from its summaries at many ranks: :func:`amprobe.report.whatif.heatmap_groups`)."""
    return heatmap_groups(run)


def make_whatif_figure(run: Run, whatif: pd.DataFrame, group: str) -> go.Figure:
    """The report's per-layer exponent-range heatmap of ``group`` (amprobe's own figure, from
    the run's summaries at many ranks: :func:`amprobe.report.whatif.make_run_exponent_heatmap`)."""

    if group not in HEATMAP_GROUPS:
        group = next(iter(HEATMAP_GROUPS))
    return make_run_exponent_heatmap(run, group, whatif)


def split_block_fit(figures: tuple[Any, ...]) -> tuple[Any | None, tuple[Any, ...]]:
    """The what-if section's layer x block-format matrix (amprobe's own figure,
    :func:`amprobe.report.blockfit.make_block_fit_figure`, drawn with the diagnosis's
    thresholds) and the section's other figures."""
    block = next((f for f in figures if getattr(f.layout, "meta", None) == BLOCK_FIT_META), None)
    return block, tuple(f for f in figures if f is not block)
