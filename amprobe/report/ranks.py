"""Ranks section: per-rank series (loss scale, step time) and the spread across ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from amprobe.analysis.rankbands import StepsRelation, compute_rank_bands, compute_rank_matrix
from amprobe.report.downsample import downsample
from amprobe.report.rankmarks import RankMark, RankMarks, compute_rank_marks
from amprobe.report.registry import Section, section
from amprobe.report.scale import (
    MAX_RANK_LINES,
    RANK_STATS_SQL,
    _ys,
    add_rank_bands,
    bands_note,
    has_values,
    many_ranks,
    rank_color,
    run_ranks,
    steps_relation,
)

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from amprobe.analysis.rankbands import RankBands
    from amprobe.rules.engine import Diagnosis
    from amprobe.store.loader import Run


__all__ = [
    "compute_rank_summary",
    "compute_rank_spread",
    "make_ranks_figure",
    "make_rank_heatmap_figure",
    "add_rank_marks",
]

#: ranks drawn one by one; beyond this the figure shows bands across ranks and the outliers
MAX_RANK_TRACES = MAX_RANK_LINES
#: a rank x step heatmap's columns (step bins) and rows (ranks; more share a row), at most
HEATMAP_BINS = 200
HEATMAP_ROWS = 256
#: a rank x step heatmap's colours: faster or lower than the median of ranks blue, equal white,
#: slower or higher red
_DIVERGING = [[0.0, "#2166ac"], [0.5, "#ffffff"], [1.0, "#b2182b"]]
#: what the figure's two series are called in its legend and hover text
SERIES_LABELS = {"scale_after": "loss scale", "wall_s": "step time (ms)"}
#: a marked rank's marker (:mod:`amprobe.report.rankmarks`), by the kind of mark: black, so
#: that it shows on a rank's own colour and on the heatmap's red, white and blue alike
_MARK_SYMBOLS = {
    "origin": "x",
    "divergent": "diamond-open",
    "replica-pair": "diamond-open",
    "fault": "triangle-up-open",
}
_MARK_COLOR = "#000000"
_RECEIVED_SYMBOL = "circle-open"


def compute_rank_summary(steps: pd.DataFrame | StepsRelation) -> pd.DataFrame:
    """One row per rank: steps, skipped steps, final scale, median and p90 step time (ms)
    (of a run of many ranks: one query of its derived store)."""
    if isinstance(steps, StepsRelation):
        stats = steps.query_by_rank(RANK_STATS_SQL)
        frame = pd.DataFrame(
            {
                "rank": stats["rank"],
                "steps": stats["rows"],
                "skipped": stats["skipped_rows"].astype(int),
                "final scale": stats["final_scale"],
                "median step (ms)": stats["median_wall"] * 1e3,
                "p90 step (ms)": stats["p90_wall"] * 1e3,
                "median data wait (ms)": stats["median_wait"] * 1e3,
            }
        )
        return frame.round(3)
    skipped = steps["skipped"].fillna(False).astype(bool)
    frame = steps.assign(_skipped=skipped)
    grouped = frame.groupby("rank", sort=True)
    out = pd.DataFrame(
        {
            "steps": grouped["step"].size(),
            "skipped": grouped["_skipped"].sum().astype(int),
            "final scale": grouped["scale_after"].last(),
            "median step (ms)": grouped["wall_s"].median() * 1e3,
            "p90 step (ms)": grouped["wall_s"].quantile(0.9) * 1e3,
        }
    )
    if "data_wait_s" in steps.columns:
        out["median data wait (ms)"] = grouped["data_wait_s"].median() * 1e3
    return out.reset_index().round(3)


def compute_rank_spread(steps: pd.DataFrame, column: str) -> pd.DataFrame:
    """Per step: min, median and max of ``column`` across ranks, and how many ranks reported it."""
    grouped = steps.groupby("step", sort=True)[column]
    return pd.DataFrame(
        {
            "min": grouped.min(),
            "median": grouped.median(),
            "max": grouped.max(),
            "ranks": grouped.count(),
        }
    ).reset_index()


def make_ranks_figure(
    steps: pd.DataFrame | StepsRelation, marks: RankMarks | None = None
) -> go.Figure:
    """Loss scale and step time per step: one line per rank (up to 16, each rank in its own
    colour in both panels and on the loss-scale tab: :func:`~amprobe.report.scale.rank_color`), min-max band across ranks. Legend entries are in words
    (``rank 0 step time (ms)``, :data:`SERIES_LABELS`).

    Args:
        steps: the run's ``steps`` frame (``rank``, ``step``, ``scale_after``, ``wall_s``),
            or a run of many ranks' :class:`~amprobe.analysis.rankbands.StepsRelation`.
        marks: the ranks the findings single out (:func:`~amprobe.report.rankmarks.compute_rank_marks`):
            each gets a black marker at its step (:func:`add_rank_marks`), and where ranks are
            drawn as bands, a line of its own as an outlier has.
    """
    import plotly.graph_objects as go  # plotly loads only when a figure is made
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=("loss scale per rank (log)", "step time per rank (ms)"),
    )
    ranks = run_ranks(steps)
    if many_ranks(ranks) or isinstance(steps, StepsRelation):
        notes = []
        drawn: dict[int, RankBands] = {}
        for row, column, scale in ((1, "scale_after", 1.0), (2, "wall_s", 1e3)):
            label = SERIES_LABELS[column]
            if has_values(steps, column):
                bands = add_rank_bands(
                    fig,
                    steps,
                    column,
                    label,
                    lambda r, lb=label: f"rank {r} {lb}",
                    ranks,
                    row,
                    scale,
                    shape="hv" if row == 1 else None,
                )
                notes.append(bands_note(label, bands))
                drawn[row] = bands
                if marks:
                    _add_marked_lines(fig, bands, marks, label, ranks, row, scale)
        if marks:
            notes.append(
                f"marked by findings, each drawn on its own: rank{'s' if len(marks.ranks()) > 1 else ''} "
                + ", ".join(str(r) for r in marks.ranks())
            )
            add_rank_marks(fig, marks, lambda r, s, row: _band_value(drawn.get(row), r, s, row))
        fig.update_yaxes(type="log", row=1, col=1)
        fig.update_xaxes(title_text="step", row=2, col=1)
        fig.update_layout(
            height=560 + 14 * len(notes),
            title={"text": "<br>".join(notes), "font": {"size": 11}},
            margin={"l": 50, "r": 20, "t": 60 + 16 * len(notes), "b": 40},
            legend={"orientation": "h", "y": -0.15},
        )
        return fig
    assert isinstance(steps, pd.DataFrame)
    draw_each = len(ranks) <= MAX_RANK_TRACES
    for row, column, scale in ((1, "scale_after", 1.0), (2, "wall_s", 1e3)):
        label = SERIES_LABELS[column]
        values = steps[steps[column].notna()]
        if values.empty:
            continue
        spread = downsample(compute_rank_spread(values, column))
        # the loss scale holds its value until the step it changes (as each rank's line is
        # drawn): a straight segment between two steps would show scales no rank had
        held = {"shape": "hv"} if row == 1 else {}
        fig.add_trace(
            go.Scatter(
                x=spread["step"],
                y=spread["max"] * scale,
                mode="lines",
                line={"width": 0, **held},
                name=f"{label} max across ranks",
                showlegend=False,
            ),
            row=row,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=spread["step"],
                y=spread["min"] * scale,
                mode="lines",
                line={"width": 0, **held},
                fill="tonexty",
                fillcolor="rgba(100,100,100,0.2)",
                name=f"{label} min-max across ranks",
            ),
            row=row,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=spread["step"],
                y=spread["median"] * scale,
                mode="lines",
                line={"dash": "dot", "color": "black", **held},
                name=f"{label} median of ranks",
            ),
            row=row,
            col=1,
        )
        if draw_each:
            for rank, part in values.groupby("rank", sort=True):
                shown = downsample(part.sort_values("step"))
                fig.add_trace(
                    go.Scatter(
                        x=shown["step"],
                        y=shown[column] * scale,
                        mode="lines",
                        line={
                            "color": rank_color(int(rank), ranks),
                            **({"shape": "hv"} if row == 1 else {}),
                        },
                        name=f"rank {rank} {label}",
                        legendgroup=f"rank {rank}",
                    ),
                    row=row,
                    col=1,
                )
    if marks:
        add_rank_marks(fig, marks, lambda r, s, row: _frame_value(steps, r, s, row))
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(
        height=520,
        margin={"l": 50, "r": 20, "t": 40, "b": 40},
        legend={"orientation": "h", "y": -0.15},
    )
    return fig


#: the panels of :func:`make_ranks_figure`: row -> (column, scale to the panel's unit)
_PANELS = {1: ("scale_after", 1.0), 2: ("wall_s", 1e3)}


def _usable(value: float | None, row: int) -> float | None:
    """``value`` where a marker can stand on panel ``row`` (finite; positive on the log axis)."""
    if value is None or not np.isfinite(value) or (row == 1 and value <= 0):
        return None
    return float(value)


def _frame_value(steps: pd.DataFrame, rank: int, step: int, row: int) -> float | None:
    """``rank``'s value at ``step`` on panel ``row`` (its unit), from the steps frame."""
    column, scale = _PANELS[row]
    if column not in steps:
        return None
    at = steps.loc[(steps["rank"] == rank) & (steps["step"] == step), column].dropna()
    return _usable(float(at.iloc[-1]) * scale, row) if len(at) else None


def _band_value(bands: RankBands | None, rank: int, step: int, row: int) -> float | None:
    """``rank``'s value in the step bin of ``step`` on panel ``row`` (its unit), from the
    bands' rank x bin matrix (no query: the matrix is at hand)."""
    if bands is None or not len(bands.bins) or not np.isin(rank, bands.ranks):
        return None
    if step < bands.bins.first[0] or step > bands.bins.last[-1]:
        return None
    at = int(bands.bins.of(np.array([step]))[0])
    return _usable(float(bands.series(rank)[at]) * _PANELS[row][1], row)


def _add_marked_lines(
    fig: go.Figure,
    bands: RankBands,
    marks: RankMarks,
    label: str,
    ranks: list[int],
    row: int,
    scale: float,
) -> None:
    """A line of its own for each marked rank of a banded panel that the outlier rule did not
    already draw: a marked rank is never folded into the bands."""
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    named = {o.rank for o in bands.outliers}
    present = set(int(r) for r in bands.ranks[np.isin(bands.ranks, marks.ranks())])
    for rank in marks.ranks():
        if rank in named or rank not in present:
            continue
        fig.add_trace(
            go.Scatter(
                x=bands.bins.first.astype("int32"),
                y=_ys(bands.series(rank) * scale),
                mode="lines",
                line={
                    "color": rank_color(rank, ranks),
                    "width": 2,
                    **({"shape": "hv"} if row == 1 else {}),
                },
                connectgaps=False,
                name=f"rank {rank} {label} (marked: {marks.label(rank)})",
                legendgroup=f"rank {rank}",
            ),
            row=row,
            col=1,
        )


def add_rank_marks(
    fig: go.Figure, marks: RankMarks, value_at: Callable[[int, int, int], float | None]
) -> None:
    """Mark each of ``marks`` on the two panels of :func:`make_ranks_figure`: a black marker
    (its symbol by kind: :data:`_MARK_SYMBOLS`) at the mark's step on its rank's loss scale
    (else its step time; ``value_at(rank, step, row)``, None where it has no value), labelled
    with the rank, its hover text the mark in words; a mark without a step or a value there
    gets a dotted vertical line and a label instead. A finding's ranks that received an
    origin's value get an open circle each at that step when they are few (at most
    :data:`MAX_RANK_TRACES`, as the lines are drawn)."""
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    for mark in marks.marks:
        if mark.rank not in marks.ranks():
            continue  # past MAX_MARKED_RANKS: named in the table and the text only
        hover = (
            f"rank {mark.rank}"
            + (f" ({mark.host})" if mark.host else "")
            + (f": {mark.text} ({mark.finding})")
        )
        placed = None
        if mark.step is not None:
            for row in _PANELS:
                y = value_at(mark.rank, mark.step, row)
                if y is not None:
                    placed = (row, y)
                    break
        if placed is None:
            if mark.step is not None:
                fig.add_vline(
                    x=mark.step,
                    line={"color": _MARK_COLOR, "dash": "dot", "width": 1},
                    annotation_text=f"rank {mark.rank}: {mark.label}",
                    annotation_hovertext=hover,
                )
            continue
        row, y = placed
        fig.add_trace(
            _mark_trace(
                mark,
                mark.step,
                y,
                14,
                hover,
                mode="markers+text",
                text=[f"rank {mark.rank}"],
                textposition="top center",
            ),
            row=row,
            col=1,
        )
        got = mark.received
        if got and len(got) <= MAX_RANK_TRACES:
            points = [
                (r, y2)
                for r in got
                if (y2 := value_at(r, mark.step, row)) is not None  # type: ignore[arg-type]
            ]
            if points:
                fig.add_trace(
                    go.Scatter(
                        x=[mark.step] * len(points),
                        y=[y2 for _, y2 in points],
                        mode="markers",
                        marker={
                            "symbol": _RECEIVED_SYMBOL,
                            "size": 22,  # a ring around the origin's marker where they meet
                            "color": _MARK_COLOR,
                            "line": {"width": 1.5, "color": _MARK_COLOR},
                        },
                        name=f"received from rank {mark.rank} ({mark.finding})",
                        hovertext=[
                            f"rank {r}: received rank {mark.rank}'s non-finite value through "
                            "the collective; did not produce it"
                            for r, _ in points
                        ],
                        hovertemplate="%{hovertext}<extra></extra>",
                    ),
                    row=row,
                    col=1,
                )


def make_rank_heatmap_figure(
    steps: pd.DataFrame | StepsRelation, column: str, marks: RankMarks | None = None
) -> go.Figure:
    """Rank x step heatmap of ``column``'s deviation from the median of ranks (%), per step
    bin (:func:`~amprobe.analysis.rankbands.compute_rank_matrix`): white where a rank is the
    median, red above, blue below. With more than :data:`HEATMAP_ROWS` ranks, consecutive
    ranks share a row and each cell is the one of them that deviates most (named on hover),
    never their average, so a single diverging rank shows in full. Each rank of ``marks``
    has a row of its own whatever the bucketing, labelled with its mark ("r2749 · NaN
    origin"), and a black marker at the mark's step.
    """
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    alone = marks.ranks() if marks else []
    bands = compute_rank_bands(steps, column, max_bins=HEATMAP_BINS)
    matrix = compute_rank_matrix(bands, max_rows=HEATMAP_ROWS, relative=True, alone=alone)
    labels = list(matrix.labels)
    row_of: dict[int, str] = {}
    for i, bucket in enumerate(matrix.buckets):
        if len(bucket) == 1 and int(bucket[0]) in alone:
            rank = int(bucket[0])
            labels[i] = row_of[rank] = f"{labels[i]} \u00b7 {marks.short(rank)}"  # type: ignore[union-attr]
    z = matrix.z * 100
    finite = z[np.isfinite(z)]
    cap = max(1.0, float(np.abs(finite).max())) if len(finite) else 1.0
    label = SERIES_LABELS.get(column, column)
    size = max(len(b) for b in matrix.buckets) if matrix.buckets else 1
    rows = "rank" if size == 1 else f"ranks ({size} consecutive a row: the one that deviates most)"
    if row_of and size > 1:
        rows = f"ranks ({size} consecutive a row, the one that deviates most; a marked rank alone)"
    width = bands.bins.width()
    fig = go.Figure(
        go.Heatmap(
            x=bands.bins.first.astype("int32"),
            y=labels,
            z=z.astype("float32"),
            customdata=matrix.rank_at.astype(
                "int16" if bands.ranks.max(initial=0) < 2**15 else "int32"
            ),
            zmid=0,
            zmin=-cap,
            zmax=cap,
            colorscale=_DIVERGING,
            colorbar={"title": "% off the<br>median"},
            hoverongaps=False,
            hovertemplate=(
                "%{y}, "
                + ("step %{x}" if width == 1 else f"{width} steps from step %{{x}}")
                + f"<br>rank %{{customdata}}: {label} %{{z:+.1f}}% off the median of ranks"
                "<extra></extra>"
            ),
        )
    )
    _add_heatmap_marks(fig, bands, marks, row_of)
    fig.update_layout(
        title={
            "text": f"{label}: each rank against the median of ranks<br><sup>"
            f"{bands.binning_text()}; {bands.outliers_text()}</sup>",
            "font": {"size": 13},
        },
        xaxis={"title": "step"},
        yaxis={
            "title": rows,
            "autorange": "reversed",
            "type": "category",
            **({"automargin": True} if row_of else {}),
        },
        height=max(300, min(900, 6 * len(labels) + 160)),
        margin={"l": 70, "r": 20, "t": 70, "b": 40},
        plot_bgcolor="#e8e8e8",  # a cell without a value stays grey, never white (= the median)
    )
    return fig


def _add_heatmap_marks(
    fig: go.Figure, bands: RankBands, marks: RankMarks | None, row_of: dict[int, str]
) -> None:
    """A black marker on each marked rank's heatmap row (``row_of``: rank -> row label) at
    the bin of the mark's step, its hover text the mark in words."""

    if not marks or not row_of or not len(bands.bins):
        return
    for mark in marks.marks:
        label = row_of.get(mark.rank)
        if label is None or mark.step is None:
            continue
        if mark.step < bands.bins.first[0] or mark.step > bands.bins.last[-1]:
            continue
        at = int(bands.bins.first[bands.bins.of(np.array([mark.step]))[0]])
        hover = f"rank {mark.rank}, step {mark.step}: {mark.text} ({mark.finding})"
        fig.add_trace(_mark_trace(mark, at, label, 12, hover, mode="markers", showlegend=False))


def _mark_trace(mark: RankMark, x: Any, y: Any, size: int, hover: str, **extra: Any) -> go.Scatter:
    """One marked rank's black marker (its symbol by kind) at (``x``, ``y``), named after the
    mark and its finding, ``hover`` its hover text."""
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    return go.Scatter(
        x=[x],
        y=[y],
        marker={
            "symbol": _MARK_SYMBOLS.get(mark.kind, "x"),
            "size": size,
            "color": _MARK_COLOR,
            "line": {"width": 2, "color": _MARK_COLOR},
        },
        name=f"rank {mark.rank}: {mark.label} ({mark.finding})",
        hovertext=[hover],
        hovertemplate="%{hovertext}<extra></extra>",
        **extra,
    )


def _scale_steps_differing(steps: pd.DataFrame | StepsRelation) -> tuple[int, int]:
    """Steps with a loss scale, and of those the steps where ranks' scales differ."""
    if isinstance(steps, StepsRelation):
        frame = steps.query(
            "SELECT count(*) AS n, count(*) FILTER (WHERE lo <> hi) AS differ FROM "
            "(SELECT step, min(scale_after) AS lo, max(scale_after) AS hi FROM s "
            "WHERE scale_after IS NOT NULL GROUP BY step)"
        )
        return int(frame["n"].iloc[0]), int(frame["differ"].iloc[0])
    scales = steps[steps["scale_after"].notna()]
    if not len(scales):
        return 0, 0
    per_step = scales.groupby("step")["scale_after"].nunique()
    return len(per_step), int((per_step > 1).sum())


@section("ranks", order=80, tab="Ranks")
def build_ranks_section(run: Run, diagnosis: Diagnosis) -> Section:
    title = "Ranks"
    many = steps_relation(run)
    steps: pd.DataFrame | StepsRelation = run.steps if many is None else many
    if many is None:
        n = int(run.steps["rank"].nunique()) if len(run.steps) else 0
    else:
        n = len(many.ranks)
    if n < 2:
        return Section(
            "ranks",
            title,
            missing=f"single-rank run ({n} rank with recorded steps): nothing to compare",
        )
    summary = compute_rank_summary(steps)
    medians = summary["median step (ms)"].dropna()
    text = [
        f"{n} ranks. Median step time across ranks: {medians.median():.1f} ms "
        f"(fastest rank {medians.min():.1f} ms, slowest {medians.max():.1f} ms)."
        if len(medians)
        else f"{n} ranks; no step time recorded.",
    ]
    scaled, differ = _scale_steps_differing(steps)
    if scaled:
        text.append(
            f"Loss scale identical on every rank at all {scaled} steps."
            if differ == 0
            else f"Loss scale differs between ranks at {differ} of {scaled} steps (see AMP-D01)."
        )
    marks = compute_rank_marks(diagnosis, run)
    text.extend(marks.lines)
    if n > MAX_RANK_TRACES:
        text.append(
            "The figures show the spread across ranks and each rank against the median of "
            "ranks; the table lists every rank."
            + (
                " A rank a finding marks is drawn on its own (a line, a heatmap row), never "
                "folded into a band."
                if marks
                else ""
            )
        )
    said = {m.finding for m in marks.marks}
    d_findings = [f for f in diagnosis.findings if f.category == "distributed"]
    for f in d_findings:
        if f.id not in said:
            text.append(f"{f.id} {f.name}: {f.title}")
    figures = [make_ranks_figure(steps, marks)]
    if n > MAX_RANK_TRACES:
        for column in ("wall_s", "scale_after"):
            if has_values(steps, column):
                figures.append(make_rank_heatmap_figure(steps, column, marks))
    tables: tuple[tuple[str, pd.DataFrame], ...] = (("per-rank summary", summary),)
    if marks:
        marked = summary.assign(marked=marks.column(summary["rank"]))
        tables = (("ranks marked by findings", marks.table()), ("per-rank summary", marked))
    return Section("ranks", title, figures=tuple(figures), tables=tables, text=tuple(text))
