"""Report section for per-layer numerics: layer table, layer x step heatmaps, exponent histograms."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pandas as pd

from amprobe.analysis.numerics import (
    compute_layer_summary,
    compute_scale_hint,
    layer_summary,
    numerics_missing_reason,
)
from amprobe.report.registry import Section, section

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from amprobe.rules.engine import Diagnosis
    from amprobe.store.loader import Run


__all__ = [
    "HEATMAP_METRICS",
    "make_numerics_heatmap_figure",
    "make_exponent_histogram_figure",
    "worst_layers",
    "build_numerics_section",
]

#: heatmap name -> (title, function of a numerics frame giving the per-row count)
HEATMAP_METRICS: dict[str, tuple[str, Any]] = {
    "nonfinite": ("non-finite values (NaN + inf)", lambda f: f["nan"] + f["inf"]),
    "overflow": (
        "values an fp16 cast makes inf (finite >= 65520, plus inf)",
        lambda f: f["over_fp16"] + f["inf"],
    ),
    "underflow": (
        "nonzero values below the fp16 min subnormal (gradients unscaled)",
        lambda f: f["below_subnormal"],
    ),
}
#: fp16 limits drawn on the exponent histograms: label -> base-2 exponent
FP16_LIMITS = {"fp16 min subnormal": -24, "fp16 min normal": -14, "fp16 max": 16}
_TABLE_COLUMNS = [
    "module",
    "kind",
    "module_type",
    "dtype",
    "steps",
    "elements",
    "nonfinite",
    "over_fp16",
    "below_normal",
    "below_subnormal",
    "zero_share",
    "amax",
]


def _label(frame: pd.DataFrame) -> pd.Series:
    return frame["module"].astype(str) + " · " + frame["kind"].astype(str)


def make_numerics_heatmap_figure(frame: pd.DataFrame, metric: str) -> go.Figure:
    """Layer (module · kind) x step heatmap of one :data:`HEATMAP_METRICS` count."""
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    title, fn = HEATMAP_METRICS[metric]
    data = frame.assign(layer=_label(frame), value=fn(frame))
    pivot = data.pivot_table(
        index="layer", columns="step", values="value", aggfunc="sum", sort=False
    )
    fig = go.Figure(
        go.Heatmap(
            z=pivot.to_numpy(),
            x=[int(s) for s in pivot.columns],
            y=list(pivot.index),
            colorscale="Reds",
            colorbar={"title": "count"},
        )
    )
    fig.update_layout(
        title=f"Per-layer {title}",
        xaxis_title="step",
        yaxis_title="layer",
        height=max(300, 18 * len(pivot.index) + 120),
    )
    return fig


def worst_layers(
    frame: pd.DataFrame, n: int = 4, summary: pd.DataFrame | None = None
) -> list[tuple[str, str]]:
    """(module, kind) pairs with the most non-finite, overflowing and underflowing values.

    ``summary`` is the frame's :func:`~amprobe.analysis.numerics.compute_layer_summary` when the
    caller already has it.
    """
    summary = compute_layer_summary(frame) if summary is None else summary
    if summary.empty:
        return []
    score = summary["nonfinite"] * 1e6 + summary["over_fp16"] * 1e3 + summary["below_subnormal"]
    summary = summary.assign(score=score / summary["elements"].clip(lower=1))
    top = summary.sort_values("score", ascending=False).head(n)
    return [(str(m), str(k)) for m, k in zip(top["module"], top["kind"], strict=True)]


def make_exponent_histogram_figure(frame: pd.DataFrame, layers: list[tuple[str, str]]) -> go.Figure:
    """Base-2 exponent histograms (summed over sampled steps) of ``layers``, with fp16 limits."""
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    fig = go.Figure()
    for module, kind in layers:
        rows = frame[(frame["module"] == module) & (frame["kind"] == kind)]
        merged: dict[int, int] = {}
        for text, zeros in zip(rows["exp_hist"], rows["zeros"].fillna(0), strict=True):
            if not isinstance(text, str):
                continue
            for e, count in json.loads(text).items():
                merged[int(e)] = merged.get(int(e), 0) + int(count)
            merged[-127] = merged.get(-127, 0) - int(zeros)  # bin -127 also holds the zeros
        # fp32 subnormal binades included (-149: every value below 2**-133)
        exps = sorted(e for e, n in merged.items() if e < 128 and n > 0)
        fig.add_trace(
            go.Bar(x=exps, y=[merged[e] for e in exps], name=f"{module} · {kind}", opacity=0.6)
        )
    for label, exponent in FP16_LIMITS.items():
        fig.add_vline(x=exponent, line_dash="dash", annotation_text=label)
    fig.update_layout(
        title="Exponent histogram of the worst layers (zeros and inf/NaN left out)",
        xaxis_title="base-2 exponent of |x| (gradients unscaled)",
        yaxis_title="values",
        barmode="overlay",
    )
    return fig


@section("numerics", order=30, tab="Numerics")
def build_numerics_section(run: Run, diagnosis: Diagnosis) -> Section:
    """Per-layer numerics, or why they are missing."""
    title = "Per-layer numerics"
    frame = run.table("numerics")
    if frame.empty:
        return Section(
            key="numerics",
            title=title,
            missing=numerics_missing_reason(run),
        )
    summary = layer_summary(run)
    tables: list[tuple[str, pd.DataFrame]] = [
        ("Per-layer totals over sampled steps (gradients unscaled)", summary[_TABLE_COLUMNS])
    ]
    offenders = run.table("offenders")
    if not offenders.empty:
        tables.append(
            (
                "First offenders per step",
                offenders[["rank", "step", "kind", "module", "module_type"]],
            )
        )
    text = [
        f"{frame['step'].nunique()} sampled step(s), {summary['module'].nunique()} module(s) recorded."
    ]
    hint = compute_scale_hint(frame)
    if hint is not None:
        line = (
            f"Loss-scale hint: {hint['hint_scale']:g} is the largest power of two keeping the largest "
            f"gradient ({hint['grad_amax']:.3g}) under 65504/{hint['margin']:g}"
        )
        if hint["underflow_share_at_current"] is None:
            line += (
                "; every measured gradient is held in fp16, where values flushed to zero cannot "
                "be told from true zeros (AMP-N06 measures their subnormal share instead)."
            )
        else:
            line += (
                f"; at the current scale {hint['current_scale']:g}, "
                f"{hint['underflow_share_at_current']:.2%} of the nonzero gradients held wider "
                f"than fp16 would flush to zero in fp16 ({hint['underflow_share_at_hint']:.2%} "
                "at the hint)."
            )
        text.append(line)
    figures = [make_numerics_heatmap_figure(frame, metric) for metric in HEATMAP_METRICS]
    layers = worst_layers(frame, summary=summary)
    if layers:
        figures.append(make_exponent_histogram_figure(frame, layers))
    return Section(
        key="numerics", title=title, figures=tuple(figures), tables=tuple(tables), text=tuple(text)
    )
