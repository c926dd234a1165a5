"""Report section for the precision what-if: exponent-range heatmaps and the per-layer table."""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Any

import pandas as pd

from amprobe.analysis.whatif import (
    FORMATS,
    KINDS,
    compute_exponent_shares,
    compute_whatif,
    compute_whatif_frame,
)
from amprobe.report.registry import Section, section

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from amprobe.rules.engine import Diagnosis
    from amprobe.store.loader import Run


__all__ = [
    "HEATMAP_GROUPS",
    "FORMAT_COLORS",
    "make_exponent_heatmap",
    "whatif_table",
    "build_whatif_section",
]

#: heatmap name -> (title, numerics kinds, fp8 format whose per-tensor window is drawn per row)
HEATMAP_GROUPS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "activations": ("activations (layer outputs)", ("output",), "e4m3"),
    "gradients": ("gradients (unscaled)", ("grad_output", "grad_param"), "e5m2"),
}
#: line colour and dash of each format's window
FORMAT_COLORS: dict[str, tuple[str, str]] = {
    "fp16": ("#1565c0", "solid"),
    "bf16": ("#2e7d32", "dot"),
    "e4m3": ("#c62828", "dash"),
    "e5m2": ("#ef6c00", "dashdot"),
}
_KIND_SUFFIX = {"output": "", "grad_output": " · output grad", "grad_param": " · param grad"}
_MIN_LOG_SHARE = -6.0
MISSING = "no per-layer exponent histogram was recorded (the numerics table is empty)"
TOLERANCE = (
    "Shares come from exponent-only histograms and classify values as a round-to-nearest cast "
    "does (overflow from the max plus half a step: fp16 65520; flush at or below half the min "
    "subnormal). Overflow and flush-to-zero are exact except in the edge binades (the binade "
    "from half the min subnormal, whose exact ties flush; the binade holding the max when amax "
    "reaches the overflow bound; fp32 values below 2^-133, whose binade is not resolved); "
    "subnormal shares are upper bounds but for those fp32 values (the last binade below the "
    "min normal partly rounds up). The edge_share column bounds the error; per-tensor scaling is "
    "the power of two that maps each step's amax just under the format max; gradients are "
    "measured after the loss scale was removed."
)


def _labels(frame: pd.DataFrame) -> pd.Series:
    return frame["module"].astype(str) + frame["kind"].map(_KIND_SUFFIX).fillna("")


def make_exponent_heatmap(
    numerics: pd.DataFrame, group: str = "activations", whatif: pd.DataFrame | None = None
) -> go.Figure:
    """Layers (execution order) x base-2 exponent, colour = share of the layer's values.

    Outlined on top: the representable windows (min subnormal .. max) of fp16, bf16, e4m3 and
    e5m2 cast as-is, with a dotted line at each min normal; per row, a black segment marks the
    fp8 window (e4m3 for activations, e5m2 for gradients) after that layer's per-tensor scale
    (last sampled step). Layer names are HTML-escaped in axis and hover text.

    Args:
        numerics: a ``numerics`` table.
        group: a :data:`HEATMAP_GROUPS` key.
        whatif: :func:`amprobe.analysis.whatif.compute_whatif_frame` of ``numerics`` (computed
            when not given), for the per-row scaled windows.
    """
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    title, kinds, scaled_fmt = HEATMAP_GROUPS[group]
    shares = compute_exponent_shares(numerics, kinds)
    fig = go.Figure()
    if shares.empty:
        fig.update_layout(
            title=f"Exponent range of {title}: not recorded",
            annotations=[
                {
                    "text": f"no {title} were sampled",
                    "showarrow": False,
                    "xref": "paper",
                    "yref": "paper",
                    "x": 0.5,
                    "y": 0.5,
                }
            ],
        )
        return fig
    shares = shares.assign(label=_labels(shares).map(html.escape))
    rows = list(dict.fromkeys(shares["label"]))
    lo = int(min(shares["exponent"].min(), -26)) - 1
    hi = int(max(shares["exponent"].max(), 16)) + 1
    exps = list(range(lo, hi + 1))
    z = pd.DataFrame(float("nan"), index=rows, columns=exps)
    text = pd.DataFrame("", index=rows, columns=exps)
    for r in shares.itertuples():
        z.loc[r.label, r.exponent] = math.log10(r.share) if r.share > 0 else _MIN_LOG_SHARE
        text.loc[r.label, r.exponent] = (
            f"{r.label}<br>2^{r.exponent} ≤ |x| < 2^{r.exponent + 1}<br>"
            f"{r.share:.3%} of values ({r.count:,})"
        )
    ticks = list(range(int(_MIN_LOG_SHARE), 1))
    fig.add_trace(
        go.Heatmap(
            z=z.clip(lower=_MIN_LOG_SHARE).to_numpy(),
            x=exps,
            y=rows,
            text=text.to_numpy(),
            hoverinfo="text",
            colorscale="Viridis",
            zmin=_MIN_LOG_SHARE,
            zmax=0,
            colorbar={
                "title": "share",
                "tickvals": ticks,
                "ticktext": [f"{10.0**t:.0e}" if t < -2 else f"{10.0**t:.0%}" for t in ticks],
            },
            name="share of values",
        )
    )
    # per-row scaled fp8 window
    wf = whatif if whatif is not None else compute_whatif_frame(numerics)
    fmt = FORMATS[scaled_fmt]
    sel = wf[
        wf["kind"].isin(list(kinds))
        & (wf["format"] == scaled_fmt)
        & (wf["scaling"] == "per-tensor")
    ]
    if len(sel):
        sel = sel.groupby(["module", "kind"], sort=False)["scale_exp"].last().reset_index()
        labels = _labels(sel).map(html.escape)
        xs: list[Any] = []
        ys: list[Any] = []
        for label, k in zip(labels, sel["scale_exp"], strict=True):
            if label in rows:
                xs += [fmt.min_subnormal_exp - int(k) - 0.5, fmt.top_exp - int(k) + 0.5, None]
                ys += [label, label, None]
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines",
                line={"color": "black", "width": 2},
                name=f"{fmt.label} window with per-tensor scaling",
                hoverinfo="skip",
            )
        )
    # as-is windows of every format, over the heatmap
    for name, f in FORMATS.items():
        color, dash = FORMAT_COLORS[name]
        x0 = max(f.min_subnormal_exp - 0.5, lo - 0.5)
        x1 = min(f.top_exp + 0.5, hi + 0.5)
        fig.add_shape(
            type="rect",
            xref="x",
            yref="paper",
            x0=x0,
            x1=x1,
            y0=0,
            y1=1,
            line={"color": color, "dash": dash, "width": 2},
            fillcolor="rgba(0,0,0,0)",
        )
        if lo < f.min_normal_exp - 0.5 < hi:
            fig.add_shape(
                type="line",
                xref="x",
                yref="paper",
                x0=f.min_normal_exp - 0.5,
                x1=f.min_normal_exp - 0.5,
                y0=0,
                y1=1,
                line={"color": color, "dash": "dot", "width": 1},
            )
        clipped = " (beyond the axis)" if x0 > f.min_subnormal_exp - 0.5 else ""
        fig.add_trace(  # a legend entry naming the window drawn by the shapes
            go.Scatter(
                x=[None],
                y=[None],
                mode="lines",
                line={"color": color, "dash": dash, "width": 2},
                name=(
                    f"{f.label} as-is: 2^{f.min_subnormal_exp} … {f.max:.5g}, normal from "
                    f"2^{f.min_normal_exp}{clipped}"
                ),
            )
        )
    fig.update_layout(
        title={"text": f"Exponent range of {title} per layer, with each format's window"},
        xaxis_title="base-2 exponent of |x| (bin e holds 2^e ≤ |x| < 2^(e+1))",
        yaxis={"autorange": "reversed", "type": "category"},
        height=max(360, 22 * len(rows) + 260),
        margin={"t": 160},
        legend={"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"},
    )
    return fig


def whatif_table(whatif: pd.DataFrame) -> pd.DataFrame:
    """One row per layer and kind: range and lost (overflow + flush) % per format and scaling."""
    if whatif.empty:
        return pd.DataFrame()
    keys = ["rank", "module", "kind"]
    base = whatif.drop_duplicates(keys)[[*keys, "dtype", "min_exp", "max_exp", "nonzero"]]
    wide = whatif.assign(col=whatif["format"] + " " + whatif["scaling"] + " lost %").pivot_table(
        index=keys, columns="col", values="lost_share", sort=False
    )
    wide = (wide * 100).round(4)
    cols = [f"{f} {s} lost %" for f in FORMATS for s in ("none", "per-tensor")]
    wide = wide[[c for c in cols if c in wide.columns]].reset_index()
    out = base.merge(wide, on=keys, how="left")
    out["kind"] = out["kind"].map(KINDS).fillna(out["kind"])
    if out["rank"].nunique() == 1:
        out = out.drop(columns="rank")
    return out


@section("whatif", order=35, tab="Precision what-if")
def build_whatif_section(run: Run, diagnosis: Diagnosis) -> Section:
    """The precision what-if, or why it cannot be computed."""
    title = "Precision what-if (fp16 / bf16 / fp8)"
    numerics = run.table("numerics")
    whatif = compute_whatif(run)
    if whatif.empty:
        return Section(key="whatif", title=title, missing=MISSING)
    text = []
    scaled = whatif[whatif["scaling"] == "per-tensor"]
    for kind, fmt in (("output", "e4m3"), ("grad_output", "e5m2")):
        part = scaled[(scaled["kind"] == kind) & (scaled["format"] == fmt)]
        if len(part):
            fit = int((part["lost_share"] <= 0.001).sum())
            text.append(
                f"{fit} of {len(part)} layers keep ≥ 99.9 % of their {KINDS[kind]}s in "
                f"{FORMATS[fmt].label} with per-tensor scaling."
            )
    text.append(TOLERANCE)
    figures = tuple(
        make_exponent_heatmap(numerics, group, whatif)
        for group in HEATMAP_GROUPS
        if numerics["kind"].isin(list(HEATMAP_GROUPS[group][1])).any()
    )
    return Section(
        key="whatif",
        title=title,
        figures=figures,
        tables=(
            (
                "Per layer: share of nonzero values lost (overflow + flush to zero), cast as-is "
                "and with per-tensor scaling, summed over sampled steps",
                whatif_table(whatif),
            ),
        ),
        text=tuple(text),
    )
