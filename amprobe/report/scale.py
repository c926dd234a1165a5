"""Loss-scale section: the scale trajectory with skipped steps marked, and the loss curve."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from amprobe.report.sections import Section, section

if TYPE_CHECKING:
    from amprobe.rules.engine import Diagnosis
    from amprobe.store.loader import Run

__all__ = ["make_scale_figure", "downsample"]

MAX_POINTS = 4000  # per trace, for display only; the run keeps every step


def downsample(frame: pd.DataFrame, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Every k-th row so that at most ``max_points`` remain (first and last rows kept)."""
    if len(frame) <= max_points:
        return frame
    step = -(-len(frame) // max_points)
    keep = frame.iloc[::step]
    if keep.index[-1] != frame.index[-1]:
        keep = pd.concat([keep, frame.iloc[[-1]]])
    return keep


def make_scale_figure(steps: pd.DataFrame) -> go.Figure:
    """Loss scale per step on a log axis (skipped steps marked) above the loss curve.

    Args:
        steps: the run's ``steps`` frame (columns ``rank``, ``step``, ``scale_before``,
            ``scale_after``, ``skipped``, ``loss``).
    """
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("loss scale (log)", "loss"), row_heights=[0.6, 0.4])
    multi = steps["rank"].nunique() > 1 if len(steps) else False
    for rank, part in steps.groupby("rank", sort=True):
        part = part.sort_values("step")
        suffix = f" r{rank}" if multi else ""
        scaled = part[part["scale_after"].notna()]
        if len(scaled):
            shown = downsample(scaled)
            fig.add_trace(go.Scatter(x=shown["step"], y=shown["scale_after"], mode="lines",
                                     name=f"scale{suffix}", line={"shape": "hv"}), row=1, col=1)
            skipped = scaled[scaled["skipped"].fillna(False).astype(bool)]
            if len(skipped):
                shown_skipped = downsample(skipped)
                fig.add_trace(go.Scatter(x=shown_skipped["step"], y=shown_skipped["scale_before"],
                                         mode="markers", name=f"skipped step{suffix}",
                                         marker={"symbol": "x", "color": "#d62728", "size": 7}),
                              row=1, col=1)
        losses = part[part["loss"].notna()]
        if len(losses):
            shown = downsample(losses)
            fig.add_trace(go.Scatter(x=shown["step"], y=shown["loss"], mode="lines",
                                     name=f"loss{suffix}"), row=2, col=1)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_xaxes(title_text="step (iteration; skipped steps count)", row=2, col=1)
    fig.update_layout(height=480, margin={"l": 50, "r": 20, "t": 40, "b": 40},
                      legend={"orientation": "h", "y": -0.15})
    return fig


@section("scale", order=10)
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
    return Section("scale", title, figures=(make_scale_figure(steps),), text=tuple(text))
