"""The block-scaled what-if as users see it: a layer x format matrix and its JSON records.

:func:`make_block_fit_figure` draws :func:`~amprobe.analysis.blockfit.compute_block_fit`'s
rows: matmul layers (execution order) by format (narrowest first, by bits per element with
scales), colour how far the limiting operand row is from its thresholds (SQNR or lost share,
whichever is nearer its limit), the limiting operand and orientation written in the cell with
its SQNR and lost share (``dY wgrad``, ``19.9 dB · 4 % lost``), a cross where the layer fails
the format. The report's what-if section draws it beside
the exponent heatmaps, the dashboard's what-if tab too. :func:`block_fit_json` is the
``block_fit`` list of ``amprobe diagnose --format json``.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from amprobe.analysis.blockfit import (
    NO_FINITE,
    UNJUDGED,
    block_fit,
    block_fit_missing_reason,
    block_unmeasured,
    format_order,
    thresholds_by_element,
)
from amprobe.report.whatif_json import PER_RANK_UP_TO
from amprobe.rules.engine import REGISTRY, format_ranks
from amprobe.store.blockformats import FORMATS

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from amprobe.rules.engine import Diagnosis
    from amprobe.store.loader import Run

__all__ = [
    "FIGURE_META",
    "THRESHOLD_RULE",
    "SCORE_RANGE_LOG10",
    "SCORE_COLOURS",
    "fit_thresholds",
    "run_block_fit",
    "make_block_fit_figure",
    "block_fit_json",
    "block_fit_text",
]

#: ``layout.meta`` of the matrix: how the dashboard finds it among the section's figures
FIGURE_META = "amprobe-block-fit"
#: the rule whose thresholds (as the diagnosis ran them) judge the matrix's cells
THRESHOLD_RULE = "AMP-P04"
#: the colour scale's range, log10 of the limiting row's score (its measure over the threshold:
#: flushed / max flushed, clipped / max clipped, or its noise over the noise the minimum SQNR
#: allows): from 1/30 of the allowance (and lossless) to 10 times over it; 0 is the threshold
SCORE_RANGE_LOG10 = (-1.5, 1.0)
#: within the allowance: greens, lightest at the threshold; over it: orange to dark red. The
#: break at the threshold is the verdict, so a cell's colour never says "fits" where it fails
#: (an SQNR colour did: an outlier-channel block flushing 94 % of its values kept 48 dB, its
#: energy being the outliers').
_LOW, _HIGH = SCORE_RANGE_LOG10
_AT = (0.0 - _LOW) / (_HIGH - _LOW)
SCORE_COLOURS = [
    [0.0, "#1a9850"],
    [_AT, "#d9ef8b"],
    [_AT, "#fdae61"],
    [1.0, "#a50026"],
]
_NOT_MEASURED = "not measured: no block statistics of this format for this layer"
#: the matrix's columns of a JSON record
_JSON_COLUMNS = [
    "rank",
    "layer",
    "layer_type",
    "format",
    "label",
    "bits",
    "status",
    "limit",
    "sqnr_db",
    "flushed_share",
    "clipped_share",
    "lost_share",
    "scale_under_share",
    "failing",
    "approx",
    "nonfinite",
]


def fit_thresholds(diagnosis: Diagnosis | None = None) -> dict[str, Any]:
    """The per-element thresholds as the diagnosis ran AMP-P04 (overrides included), else the
    registered ones."""
    flat: Mapping[str, float] = {}
    if diagnosis is not None and THRESHOLD_RULE in diagnosis.thresholds:
        flat = diagnosis.thresholds[THRESHOLD_RULE]
    elif THRESHOLD_RULE in REGISTRY:
        flat = REGISTRY[THRESHOLD_RULE].thresholds
    return thresholds_by_element(flat)


def run_block_fit(run: Run, diagnosis: Diagnosis | None = None) -> pd.DataFrame:
    """:func:`~amprobe.analysis.blockfit.block_fit` of ``run`` with the diagnosis's
    thresholds (:func:`fit_thresholds`)."""
    return block_fit(run, fit_thresholds(diagnosis))


def _pct(value: Any) -> str:
    return "—" if value is None or pd.isna(value) else f"{float(value) * 100:.3g} %"


def _db(value: Any) -> str:
    if value is None or pd.isna(value):
        return "all zero"
    return "lossless (no error)" if math.isinf(float(value)) else f"{float(value):.1f} dB"


def make_block_fit_figure(fit: pd.DataFrame, message: str | None = None) -> go.Figure:
    """Matmul layers x block formats: colour = how far the limiting operand row is from its
    thresholds.

    One cell per (layer, format) of :func:`~amprobe.analysis.blockfit.compute_block_fit`'s
    rows (at several ranks, the rank whose limiting row is furthest over its thresholds,
    named on hover). The cell's text is the limiting operand and orientation (``dY wgrad``),
    with ``✗`` where the layer fails the format and ``≈`` where a row is approximate, then
    its SQNR and lost (flushed + clipped) share; the hover adds the flushed, clipped and
    scale underflow shares and the approximation, if any. The colour is the row's score
    (:data:`SCORE_RANGE_LOG10`, log scale): greens within the thresholds, lightest at them,
    orange to red over them, so colour and verdict agree (SQNR alone does not judge a block:
    outliers carry its energy while the values beside them flush);
    cells with no data (the format was not measured for the layer) are blank, cells whose
    values were all zero grey, and the subtitle says so. Formats are ordered by bits per
    element with scales, narrowest first. Run text (layer names) is data of the traces
    (axis labels, ``customdata``), escaped by the renderers
    (:func:`~amprobe.report.escape.escape_figure_text`), never part of the hover template.

    Args:
        fit: :func:`~amprobe.analysis.blockfit.compute_block_fit`'s frame.
        message: what an empty figure says (why nothing was measured).
    """
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    fig = go.Figure()
    fig.update_layout(meta=FIGURE_META)
    if fit.empty:
        note = html.escape(message or "no block statistics were recorded")
        fig.update_layout(
            title="Block formats per matmul layer: not recorded",
            annotations=[
                {
                    "text": note,
                    "showarrow": False,
                    "xref": "paper",
                    "yref": "paper",
                    "x": 0.5,
                    "y": 0.5,
                }
            ],
            height=240,
            xaxis_visible=False,
            yaxis_visible=False,
            template="plotly_white",
        )
        return fig
    several = fit["rank"].nunique() > 1
    # the worst rank of each (layer, format): the highest score, all-zero cells last
    ordered = fit.assign(_s=fit["score"].astype(float).fillna(-np.inf)).sort_values(
        ["_s", "rank"], ascending=[False, True], kind="stable"
    )
    cells = ordered.drop_duplicates(["layer", "format"])
    layers = list(
        dict.fromkeys(fit.sort_values(["order", "rank"], kind="stable")["layer"].astype(str))
    )
    formats = format_order(fit["format"].astype(str))
    labels = [f"{FORMATS[f].label} ({FORMATS[f].bits:g})" if f in FORMATS else f for f in formats]
    lo, hi = SCORE_RANGE_LOG10
    z = np.full((len(layers), len(formats)), np.nan)
    text = [["" for _ in formats] for _ in layers]
    grey = [["" for _ in formats] for _ in layers]  # an unjudged cell's status, as its text
    # hover lines as data (the renderers escape run text in customdata; the template's <br>
    # stays markup): head, verdict, limiting row, shares, approximation
    hover = [
        [[f"{layers[i]} · {labels[j]}", _NOT_MEASURED, "", "", ""] for j in range(len(formats))]
        for i in range(len(layers))
    ]
    li = {layer: i for i, layer in enumerate(layers)}
    fj = {f: j for j, f in enumerate(formats)}
    for r in cells.itertuples():
        i, j = li[str(r.layer)], fj[str(r.format)]
        head = f"{layers[i]} · {labels[j]}" + (f" (rank {r.rank})" if several else "")
        if r.status in UNJUDGED:
            grey[i][j] = str(r.status)  # drawn, with its text, by the grey trace
            hover[i][j] = [
                head,
                "no finite value (every value inf/NaN): not judged"
                if r.status == NO_FINITE
                else "every value of every operand was 0: nothing to cast",
                "",
                "",
                "",
            ]
            continue
        sqnr = float(r.sqnr_db)
        score = float(r.score)
        z[i, j] = lo if not score > 0 else min(max(math.log10(score), lo), hi)
        mark = (" ✗" if r.status == "fails" else "") + (" ≈" if r.approx else "")
        sqnr_text = "lossless" if math.isinf(sqnr) else f"{sqnr:.1f} dB"
        # one line: the renderers escape trace text (a <br> would show) and a heatmap's
        # texttemplate reads no customdata
        text[i][j] = f"{r.limit}{mark} · {sqnr_text} · {_pct(r.lost_share)} lost"
        verdict = (
            "fits"
            if r.status == "fits"
            else "fails: " + ", ".join(str(x) for x in r.failing) + " over the thresholds"
        )
        hover[i][j] = [
            head,
            verdict,
            f"limiting operand {r.limit}: SQNR {_db(sqnr)}",
            f"lost {_pct(r.lost_share)} (flushed {_pct(r.flushed_share)}, clipped "
            f"{_pct(r.clipped_share)}); block scales underflowing {_pct(r.scale_under_share)}",
            f"approximate: {r.approx}" if r.approx else "exact",
        ]
    template = "<br>".join(f"%{{customdata[{k}]}}" for k in range(5)) + "<extra></extra>"
    fig.add_trace(
        go.Heatmap(
            z=z,
            x=labels,
            y=layers,
            text=text,
            texttemplate="%{text}",
            textfont={"size": 10},
            customdata=hover,
            hovertemplate=template,
            colorscale=SCORE_COLOURS,
            zmin=lo,
            zmax=hi,
            xgap=2,
            ygap=2,
            colorbar={
                "title": "limiting<br>measure ÷<br>threshold",
                "tickvals": [-1.5, -1.0, -0.5, 0.0, 0.5, 1.0],
                "ticktext": ["≤ 1/30", "1/10", "1/3", "threshold", "3×", "≥ 10×"],
            },
            name="limiting operand against its thresholds",
        )
    )
    zero = np.where(np.array(grey, dtype=object) != "", 1.0, np.nan).reshape(z.shape)
    if not np.isnan(zero).all():
        fig.add_trace(
            go.Heatmap(
                z=zero,
                x=labels,
                y=layers,
                text=grey,
                texttemplate="%{text}",
                customdata=hover,
                hovertemplate=template,
                colorscale=[[0, "#d9d9d9"], [1, "#d9d9d9"]],
                showscale=False,
                xgap=2,
                ygap=2,
                name="all zero",
            )
        )
    blank = int(np.isnan(z).sum() - (~np.isnan(zero)).sum())
    notes = [
        "✗: fails the thresholds (AMP-P04)",
        "colour: the limiting measure over its threshold (greens within, reds over)",
    ]
    if (cells["approx"].astype(str) != "").any():
        notes.append("≈: approximate (hover says why)")
    if blank:
        notes.append(f"{blank} blank cell(s): format not measured for the layer")
    if several:
        notes.append("each cell: the rank furthest over its thresholds")
    fig.update_layout(
        title={
            "text": "Block formats per matmul layer: the limiting operand against its thresholds"
            f"<br><sup>{'; '.join(notes)}</sup>"
        },
        xaxis={"title": "format (bits per element with scales), narrowest first", "side": "top"},
        yaxis={"autorange": "reversed", "type": "category"},
        plot_bgcolor="white",
        height=max(460, 30 * len(layers) + 240),
        margin={"t": 150},
    )
    return fig


def _plain(value: Any) -> Any:
    """A JSON-safe value: numbers rounded, inf SQNR as ``"lossless"``, NaN as None."""
    if isinstance(value, list | tuple | np.ndarray):
        return [str(v) for v in value]
    if value is None:
        return None
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        v = float(value)
        if math.isnan(v):
            return None
        if math.isinf(v):
            return "lossless" if v > 0 else None
        return round(v, 6)
    return value


def block_fit_json(fit: pd.DataFrame) -> list[dict[str, Any]]:
    """The ``block_fit`` records of ``amprobe diagnose --format json``: one per (rank, layer,
    format) of :func:`~amprobe.analysis.blockfit.compute_block_fit` for a run of up to
    :data:`~amprobe.report.whatif_json.PER_RANK_UP_TO` ranks; for more ranks, one per
    (layer, format) and set of values: ranks whose records agree share one, naming them in
    ``ranks`` (``"0-21, 23-63"``) and ``rank_count``, so the list grows with the ranks that
    differ, not with the rank count. ``sqnr_db`` is ``"lossless"`` where nothing was lost
    and null where every value was zero (``status`` ``all zero``)."""
    if fit.empty:
        return []
    records = [
        {c: _plain(v) for c, v in zip(_JSON_COLUMNS, row, strict=True)}
        for row in fit[_JSON_COLUMNS].itertuples(index=False)
    ]
    if fit["rank"].nunique() <= PER_RANK_UP_TO:
        return records
    merged: dict[str, tuple[dict[str, Any], list[int]]] = {}
    for rec in records:
        rank = rec.pop("rank")
        key = repr(sorted(rec.items()))
        merged.setdefault(key, (rec, []))[1].append(int(rank))
    return [
        {**rec, "ranks": format_ranks(ranks), "rank_count": len(ranks)}
        for rec, ranks in merged.values()
    ]


def block_fit_text(run: Run, fit: pd.DataFrame) -> list[str]:
    """One line for the what-if section: how many layers fit each format, or why the matrix
    is empty."""
    if fit.empty:
        reason = block_fit_missing_reason(run)
        return [f"Block formats: not checked, {reason}."] if reason else []
    judged = fit[fit["fits"].notna()]
    parts = []
    for f in format_order(judged["format"].astype(str)):
        part = judged[judged["format"] == f].drop_duplicates("layer")
        fits = judged[(judged["format"] == f)].groupby("layer")["fits"].all()
        label = FORMATS[f].label if f in FORMATS else f
        parts.append(f"{label} {int(fits.sum())} of {len(part)}")
    return [
        "Block formats (matmul layers that fit, every operand within AMP-P04's thresholds): "
        + ", ".join(parts)
        + ". Per-tensor fp8 is shown beside, not a candidate; MX and NVFP4 tensor cores are "
        "Blackwell's, blockwise fp8 on Hopper is a software recipe."
    ] + [f"Not measured: {line}." for line in block_unmeasured(run)]
