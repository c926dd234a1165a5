"""Loss-scale section: the scale trajectory with skipped steps marked, and the loss curve."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

import amprobe.store
from amprobe.analysis.frames import range_text, steps_text
from amprobe.analysis.rankbands import (
    RankBands,
    ResultStore,
    StepsRelation,
    compute_rank_bands,
)
from amprobe.report.downsample import MAX_POINTS, minmax_indices
from amprobe.report.evidence import Table, render_evidence
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
    "rank_color",
    "run_ranks",
    "RANK_COLORS",
    "gaps_as_null",
    "loss_recorded",
    "LossSpan",
    "nonfinite_loss_spans",
    "add_loss_bands",
    "MAX_RANK_LINES",
    "many_ranks",
    "add_rank_bands",
    "bands_note",
    "rank_groups_text",
    "steps_relation",
    "many_relations",
    "steps_of",
    "has_values",
    "SCALER_ROWS_SQL",
    "step_ends",
    "event_rows",
    "RANK_STATS_SQL",
    "ReplayMark",
    "replay_marks",
    "replay_tables",
    "add_replay_marks",
]

_SKIP_COLOR = "#d62728"
_GROW_COLOR = "#2ca02c"
_CUT_COLOR = "#ff7f0e"
_REPLAY_COLOR = "#9467bd"
#: the finding whose replayed steps the loss-scale chart marks (AMP-N17 nonfinite-cause)
REPLAY_FINDING = "AMP-N17"
#: one colour per rank, by the rank's position among the run's ranks (:func:`rank_color`), the
#: same on every tab; none is a marker's red, green or orange (skipped step, growth, backoff,
#: loss NaN band), black (the median of ranks) or grey (the spread, not measured)
RANK_COLORS = (
    "#1f77b4",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#393b79",
    "#a55194",
    "#8c6d31",
    "#6b6ecf",
    "#c49c94",
    "#aec7e8",
)
#: hues (degrees) of the colours beyond :data:`RANK_COLORS`: cyan to purple, away from the
#: markers' red, orange and green
_HUES = (170, 320)
_BAND_COLOR = "#d62728"
#: loss NaN stretches drawn as bands, at most (the rest are named in one note)
MAX_BANDS = 20
#: ranks drawn one line each; a run of more ranks is drawn as bands across ranks (min-max,
#: p10-p90, the median) with one line per outlier rank (:func:`add_rank_bands`)
MAX_RANK_LINES = 8
_SPREAD_FILL = "rgba(100,100,100,0.18)"
_INNER_FILL = "rgba(100,100,100,0.32)"


def many_ranks(ranks: Sequence[int]) -> bool:
    """Whether a run of ``ranks`` is drawn as bands rather than a line per rank."""
    return len(ranks) > MAX_RANK_LINES


#: :func:`scaler_rows`' filter as SQL on the derived ``steps`` (a rank of many)
SCALER_ROWS_SQL = "coalesce(scaler_enabled, false) AND scale_before IS NOT NULL"
#: rows a figure of many ranks draws one by one (skipped steps, scale changes, NaN/inf
#: losses), read from the derived store; at most this many
_EVENT_ROWS = 1_000_000


def steps_relation(run: Run) -> StepsRelation | None:
    """The run's steps through its derived store (DuckDB) when it has more than
    :data:`MAX_RANK_LINES` ranks (its figures are bands, reduced in the engine; the merged
    frame of every rank is never loaded), else None (few ranks: drawn from ``run.steps``).
    One per run, so its query results are shared by the sections and tabs."""
    if len(run.ranks) <= MAX_RANK_LINES:
        return None

    def make(r: Run) -> StepsRelation:
        rels = many_relations(r)
        summaries = rels["summaries"].filter("steps > 0").order("rank")
        ranks = summaries.project("rank").df()["rank"].to_numpy(dtype=np.int64)
        return StepsRelation(rels["steps"], ranks=ranks, store=rels.get("results"))

    return run.cached("steps_relation", make)  # type: ignore[no-any-return]


#: the tables a run of many ranks' figures read from its derived store (numerics and offenders:
#: the numerics section's heatmaps and offenders table, amprobe.report.numerics)
_MANY_TABLES = ("summaries", "steps", "gpu", "syncs", "numerics", "offenders")


def many_relations(run: Run) -> dict[str, Any]:
    """Relations over the derived tables the sections of a run of many ranks read
    (:data:`_MANY_TABLES`), after one freshness check of the store, once per run, and
    ``"results"``: the :class:`ResultStore` of its steps' results (absent when it cannot be
    named)."""

    def make(r: Run) -> dict[str, Any]:
        derived = amprobe.store.derived  # loaded on first use (with duckdb), as Run.relation
        store, rels = derived.relations(r, _MANY_TABLES)
        with contextlib.suppress(OSError):
            folder = derived.results_dir(store)
            if folder is not None:
                rels["results"] = ResultStore(folder)
        return rels

    return run.cached("many_relations", make)  # type: ignore[no-any-return]


#: each rank's aggregates that the scale and ranks sections read, one query for both
RANK_STATS_SQL = (
    "SELECT rank, count(*) AS rows, "
    "count(*) FILTER (WHERE coalesce(skipped, false)) AS skipped_rows, "
    # a step repeats in a rank's rows only across windows (a (window, step) once): the
    # distinct steps of a rank of one window are its rows (count DISTINCT cost 2.6 s of 3)
    "count(*) FILTER (WHERE scale_after IS NOT NULL) AS scaled_steps, "
    'min(coalesce("window", -1)) <> max(coalesce("window", -1)) AS windows, '
    "count(*) FILTER (WHERE scale_after IS NOT NULL AND coalesce(skipped, false)) "
    "AS scaled_skipped, "
    "count(*) FILTER (WHERE scale_after < scale_before) AS cuts, "
    "count(*) FILTER (WHERE scale_after > scale_before) AS grows, "
    "arg_max(scale_after, step) FILTER (WHERE scale_after IS NOT NULL) AS final_scale, "
    "median(wall_s) AS median_wall, quantile_cont(wall_s, 0.9) AS p90_wall, "
    "median(data_wait_s) AS median_wait "
    "FROM s GROUP BY rank ORDER BY rank"
)


def steps_of(run: Run) -> pd.DataFrame | StepsRelation:
    """:func:`steps_relation` for a run of many ranks, else ``run.steps``."""
    rel = steps_relation(run)
    return run.steps if rel is None else rel


def has_values(steps: pd.DataFrame | StepsRelation, column: str) -> bool:
    """Whether ``column`` holds a value (not null) on some row."""
    if isinstance(steps, StepsRelation):
        return steps.has(column)
    return column in steps and bool(steps[column].notna().any())


def event_rows(steps: StepsRelation) -> pd.DataFrame:
    """The rows of a run of many ranks that figures mark one by one: skipped steps, scale
    changes and NaN/inf losses (at most :data:`_EVENT_ROWS`, in rank and step order)."""
    return steps.query(
        "SELECT rank, step, scaler_enabled, scale_before, scale_after, skipped, loss, "
        "loss_nonfinite FROM s WHERE coalesce(skipped, false) OR scale_after <> scale_before "
        "OR coalesce(loss_nonfinite, false) OR isinf(loss) "
        f"ORDER BY rank, step LIMIT {_EVENT_ROWS}"
    )


def step_ends(steps: pd.DataFrame | StepsRelation) -> pd.DataFrame:
    """``steps`` itself, or for a run of many ranks a frame of a few rows per rank with the
    same first and last step and each rank's last recorded loss scale (``rank``, ``step``,
    ``scale_after``): what a figure that only says where the run starts and ends, or its
    final scales, reads."""
    if not isinstance(steps, StepsRelation):
        return steps
    return steps.query(
        "SELECT rank, min(step) AS step, NULL::DOUBLE AS scale_after FROM s GROUP BY rank "
        "UNION ALL SELECT rank, max(step), NULL::DOUBLE FROM s GROUP BY rank "
        "UNION ALL SELECT rank, max(step), arg_max(scale_after, step) FROM s "
        "WHERE scale_after IS NOT NULL GROUP BY rank ORDER BY rank, step"
    )


def _ys(y: np.ndarray) -> Any:
    """A band's y values for plotly: float32 (binary, 4 bytes a point) when every value is
    finite, else a list with JSON null at each gap (:func:`gaps_as_null`)."""
    y = np.asarray(y, dtype="float64")
    if np.isfinite(y).all():
        return y.astype("float32")
    return gaps_as_null(np.where(np.isfinite(y), y, np.nan))


def add_rank_bands(
    fig: go.Figure,
    frame: pd.DataFrame | StepsRelation,
    column: str,
    label: str,
    name_of: Any,
    ranks: Sequence[int],
    row: int | None = None,
    scale: float = 1.0,
    shape: str | None = None,
    legendgroup: str | None = None,
) -> RankBands:
    """Draw ``column`` across ranks on ``fig`` (subplot ``row``) as bands computed on the server
    (:func:`~amprobe.analysis.rankbands.compute_rank_bands`): min-max filled light grey, p10-p90
    darker, the median of ranks a black dotted line, and one line per named outlier rank in its
    own colour (:func:`rank_color`), named ``name_of(rank)``. Hover on the band gives the bin's
    steps and the ranks at its edges. Returns the bands (their text says how they were made).
    """
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    bands = compute_rank_bands(frame, column)
    where: dict[str, Any] = {"row": row, "col": 1} if row is not None else {}
    x = bands.bins.first.astype("int32")
    last = bands.bins.last.astype("int32")
    line = {"width": 0, **({"shape": shape} if shape else {})}
    group = legendgroup or f"{label} bands"
    steps_hover = "steps %{x}\u2013%{customdata[0]}" if not bands.bins.single else "step %{x}"
    n = len(bands.ranks)
    edges = (
        ("max", bands.high, bands.max_rank, None, None),
        ("min", bands.low, bands.min_rank, "tonexty", _SPREAD_FILL),
        ("p90", bands.p90, None, None, None),
        ("p10", bands.p10, None, "tonexty", _INNER_FILL),
    )
    for edge, values, at, fill, color in edges:
        # hover data: the bin's last step (when a bin holds several), the rank at an edge
        parts = ([] if bands.bins.single else [last]) + ([at] if at is not None else [])
        custom = np.stack(parts, axis=1).astype("int32") if parts else None
        hover = steps_hover
        if at is not None:
            hover += f"<br>{edge} %{{y:.4g}} (rank %{{customdata[{len(parts) - 1}]}})"
        else:
            hover += f"<br>{edge} %{{y:.4g}}"
        fig.add_trace(
            go.Scatter(
                x=x,
                y=_ys(values * scale),
                customdata=custom,
                mode="lines",
                line=line,
                fill=fill,
                fillcolor=color,
                connectgaps=False,
                name=(
                    f"{label}: min\u2013max of {n} ranks"
                    if edge == "min"
                    else f"{label}: p10\u2013p90 of ranks"
                    if edge == "p10"
                    else f"{label} {edge} across ranks"
                ),
                showlegend=edge in ("min", "p10"),
                legendgroup=group,
                hovertemplate=hover + "<extra></extra>",
            ),
            **where,
        )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=_ys(bands.median * scale),
            mode="lines",
            line={"dash": "dot", "color": "black", **({"shape": shape} if shape else {})},
            connectgaps=False,
            name=f"{label}: median of ranks",
            legendgroup=group,
        ),
        **where,
    )
    for outlier in bands.outliers:
        fig.add_trace(
            go.Scatter(
                x=x,
                y=_ys(bands.series(outlier.rank) * scale),
                mode="lines",
                line={
                    "color": rank_color(outlier.rank, ranks),
                    **({"shape": shape} if shape else {}),
                },
                connectgaps=False,
                name=name_of(outlier.rank),
                legendgroup=f"rank {outlier.rank}",
            ),
            **where,
        )
    return bands


def rank_groups_text(per_rank: dict[int, Any], sentence: Any) -> str:
    """``sentence(value)`` once per distinct value of ``per_rank`` (rank -> value), with the
    ranks it holds on, the most common first: ``"on 62 of 64 ranks (0, 2–21, 23–63): ...;
    rank 1: ..."`` (a run of many ranks, where a sentence per rank would be a wall of text)."""
    groups: dict[Any, list[int]] = {}
    for rank, value in sorted(per_rank.items()):
        groups.setdefault(value, []).append(rank)
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    parts = []
    for value, members in ordered:
        where = steps_text(members, limit=12)
        if len(members) == 1:
            parts.append(f"rank {where}: {sentence(value)}")
        else:
            parts.append(f"on {len(members)} of {len(per_rank)} ranks ({where}): {sentence(value)}")
    return "; ".join(parts)


def bands_note(what: str, bands: RankBands) -> str:
    """One line that says how ``what``'s bands were made and which ranks are drawn alone."""
    return (
        f"{what}: {len(bands.ranks)} ranks as bands ({bands.binning_text()}); "
        f"{bands.outliers_text()}"
    )


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


def thin_series(
    frame: pd.DataFrame, column: str, max_points: int, keep_gaps: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Steps and values of ``column``, min/max-thinned to ``max_points``.

    Rows whose value is null are left out, unless ``keep_gaps``: then they stay as NaN (and
    an inf value becomes NaN), so that a plotted line breaks there instead of running
    straight across steps that have no finite value (a NaN loss); thinning keeps the breaks.
    """
    part = frame if keep_gaps else frame[frame[column].notna()]
    x = part["step"].to_numpy()
    y = part[column].to_numpy(dtype="float64")
    if keep_gaps:
        y = np.where(np.isfinite(y), y, np.nan)
    keep = minmax_indices(y, max_points)
    return x[keep], y[keep]


def gaps_as_null(y: np.ndarray) -> list[float | None]:
    """``y`` as a list with ``None`` for each NaN: serialised as JSON null, which every plotly
    draws as a gap (a binary NaN array depends on how the browser side decodes it)."""
    return [None if v != v else float(v) for v in y.tolist()]


def run_ranks(frame: pd.DataFrame | StepsRelation) -> list[int]:
    """The ranks of a frame's rows, ascending (``[0]`` for a frame without ranks)."""
    if isinstance(frame, StepsRelation):
        return [int(r) for r in frame.ranks] or [0]
    if "rank" not in frame or frame.empty:
        return [0]
    return sorted(int(r) for r in frame["rank"].dropna().unique())


def rank_color(rank: int, ranks: Sequence[int]) -> str:
    """The colour of ``rank``'s lines, among the run's ``ranks`` (:func:`run_ranks`): picked by
    the rank's position among them, so that every rank has its own (ranks 0 and 10 of a
    two-rank run too) and the same one on every tab. :data:`RANK_COLORS` for up to 12 ranks,
    else evenly spaced hues in :data:`_HUES`."""
    ordered = sorted(set(ranks))
    at = ordered.index(rank)
    if len(ordered) <= len(RANK_COLORS):
        return RANK_COLORS[at]
    low, high = _HUES
    return f"hsl({round(low + (high - low) * at / (len(ordered) - 1))}, 65%, {42 + 12 * (at % 2)}%)"


@dataclass(frozen=True)
class LossSpan:
    """Consecutive steps whose loss was non-finite: ``first``..``last``, the ranks where it
    was, and ``label`` ("loss NaN", "loss inf" or "loss NaN/inf")."""

    first: int
    last: int
    ranks: tuple[int, ...]
    label: str

    def text(self, prefix: str = "", all_ranks: int = 1) -> str:
        """``"loss NaN, steps 80–119"`` (with the ranks when not every rank's loss was)."""
        where = range_text(self.first, self.last, word=True)
        on = ""
        if all_ranks > 1 and len(self.ranks) < all_ranks:
            shown = ", ".join(str(r) for r in self.ranks[:8]) + (
                ", …" if len(self.ranks) > 8 else ""
            )
            on = f" on rank {shown}" if len(self.ranks) == 1 else f" on ranks {shown}"
        return f"{prefix}{self.label}, {where}{on}"


def nonfinite_loss_spans(steps: pd.DataFrame) -> list[LossSpan]:
    """Stretches of consecutive steps whose loss was NaN or inf on some rank, in step order.

    A step counts when its ``loss_nonfinite`` flag is set or its recorded loss is inf (a null
    loss without the flag was not recorded, which is not the same).
    """
    if steps.empty or "step" not in steps or "loss" not in steps:
        return []
    loss = steps["loss"].to_numpy(dtype="float64")
    bad = np.isinf(loss)
    if "loss_nonfinite" in steps:
        bad |= steps["loss_nonfinite"].fillna(False).astype(bool).to_numpy()
    if not bad.any():
        return []
    ranks = steps["rank"].to_numpy() if "rank" in steps else np.zeros(len(steps), dtype=int)
    step = steps["step"].to_numpy()[bad].astype(np.int64)
    order = np.argsort(step, kind="stable")
    step, rank, nan = step[order], ranks[bad][order], np.isnan(loss[bad])[order]
    unique = np.unique(step)
    # a new stretch wherever a step does not follow the previous bad step
    starts = unique[np.flatnonzero(np.diff(unique, prepend=unique[0] - 2) != 1)]
    span_of = np.searchsorted(starts, step, side="right") - 1
    rows = pd.DataFrame({"span": span_of, "step": step, "rank": rank, "nan": nan})
    per = rows.groupby("span", sort=True).agg(
        first=("step", "min"), last=("step", "max"), nan=("nan", "all"), any_nan=("nan", "any")
    )
    span_ranks = rows.drop_duplicates(["span", "rank"]).groupby("span")["rank"].agg(list)
    spans: list[LossSpan] = []
    for i, first, last, all_nan, any_nan in zip(
        per.index, per["first"], per["last"], per["nan"], per["any_nan"], strict=True
    ):
        label = "loss NaN" if all_nan else "loss NaN/inf" if any_nan else "loss inf"
        ranks_in = tuple(sorted(int(r) for r in span_ranks[i]))
        spans.append(LossSpan(int(first), int(last), ranks_in, label))
    return spans


def _axis_refs(row: int) -> tuple[str, str]:
    """The x axis and y-axis domain references of subplot ``row`` (one column)."""
    return ("x", "y domain") if row == 1 else (f"x{row}", f"y{row} domain")


def add_loss_bands(
    fig: go.Figure,
    steps: pd.DataFrame,
    row: int,
    rows: tuple[int, ...] = (),
    prefix: str = "",
    color: str = _BAND_COLOR,
    position: str = "top",
    n_ranks: int | None = None,
) -> list[LossSpan]:
    """Shade the steps whose loss was NaN/inf (:func:`nonfinite_loss_spans`) on subplot
    ``row`` with a labelled band ("loss NaN, steps 80–119"), and unlabelled on ``rows``.

    The loss line has gaps there; a gap alone is easy to miss. At most :data:`MAX_BANDS`
    bands, the longest stretches; the others are counted in a note. ``position`` puts the
    labels at the ``top`` or ``bottom`` of the band. ``n_ranks``: the run's ranks (by
    default those of ``steps``; give it when ``steps`` holds only some rows). Returns every
    span.
    """
    spans = nonfinite_loss_spans(steps)
    if n_ranks is None:
        n_ranks = int(steps["rank"].nunique()) if "rank" in steps and not steps.empty else 1
    banded = sorted(spans, key=lambda s: (s.first - s.last, s.first))[:MAX_BANDS]
    banded.sort(key=lambda s: s.first)
    shapes: list[dict[str, object]] = []
    notes: list[dict[str, object]] = []
    for span in banded:
        x0, x1 = span.first - 0.5, span.last + 0.5
        for where, opacity in [(r, 0.1) for r in rows] + [(row, 0.15)]:
            xref, yref = _axis_refs(where)
            shapes.append(
                {
                    "type": "rect",
                    "xref": xref,
                    "yref": yref,
                    "x0": x0,
                    "x1": x1,
                    "y0": 0,
                    "y1": 1,
                    "fillcolor": color,
                    "opacity": opacity,
                    "line": {"width": 0},
                    "layer": "below",
                }
            )
        xref, yref = _axis_refs(row)
        notes.append(
            {
                "text": span.text(prefix, n_ranks),
                "xref": xref,
                "yref": yref,
                "x": x0,
                "y": 1 if position == "top" else 0,
                "xanchor": "left",
                "yanchor": "top" if position == "top" else "bottom",
                "showarrow": False,
                "font": {"size": 11, "color": color},
            }
        )
    if len(spans) > len(banded):
        rest = [s for s in spans if s not in banded]
        notes.append(
            {
                "text": (
                    f"{prefix}{len(rest)} more loss NaN/inf stretches (gaps in the line, not "
                    f"shaded) between steps {rest[0].first} and {rest[-1].last}"
                ),
                "showarrow": False,
                "xref": "paper",
                "yref": "paper",
                "x": 1,
                "y": 1.02 if position == "top" else 1.06,
                "xanchor": "right",
                "yanchor": "bottom",
                "font": {"size": 11, "color": color},
            }
        )
    # one layout update: plotly's add_vrect re-validates every shape at each call
    fig.update_layout(
        shapes=[*fig.layout.shapes, *shapes], annotations=[*fig.layout.annotations, *notes]
    )
    return spans


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


def loss_recorded(steps: pd.DataFrame) -> bool:
    """Whether any step recorded a loss: a value, or a NaN/inf loss (stored as NaN, flagged
    ``loss_nonfinite``), which is recorded too."""
    return (
        not steps.empty
        and "loss" in steps
        and (steps["loss"].notna().any() or bool(nonfinite_loss_spans(steps)))
    )


@dataclass(frozen=True)
class ReplayMark:
    """A bad step amprobe replayed, as the loss-scale chart marks it.

    Attributes:
        step: the step replayed.
        scale: the loss scale it ran at (None: no GradScaler, or not recorded).
        cause: the measured cause (None: not replayed, or no cause measured).
        text: the hover text: the cause in words.
    """

    step: int
    scale: float | None
    cause: str | None
    text: str


def replay_marks(diagnosis: Diagnosis | None) -> list[ReplayMark]:
    """The replayed steps of AMP-N17's findings (its ``replays`` rows), the first with the
    finding's title as its hover text; none without a diagnosis."""
    marks: list[ReplayMark] = []
    for f in diagnosis.findings if diagnosis is not None else ():
        if f.id != REPLAY_FINDING:
            continue
        for row in f.evidence.get("replays") or []:
            step = int(row["step"])
            cause = row.get("cause")
            if step == f.evidence.get("step"):
                text = f"step {step} replayed: {cause or 'no cause measured'}<br>{f.title}"
            elif cause:
                text = f"step {step} replayed: {cause}"
            else:
                text = f"step {step}: {row.get('outcome') or 'not replayed'}"
            scale = row.get("scale")
            marks.append(ReplayMark(step, float(scale) if scale is not None else None, cause, text))
    return marks


def replay_tables(diagnosis: Diagnosis | None) -> list[tuple[str, pd.DataFrame]]:
    """AMP-N17's experiments as a section table (its evidence renderer's cells), captioned with
    the step and the cause; none without a diagnosis."""
    out: list[tuple[str, pd.DataFrame]] = []
    for f in diagnosis.findings if diagnosis is not None else ():
        if f.id != REPLAY_FINDING:
            continue
        for block in render_evidence(f):
            if isinstance(block, Table) and block.caption == "experiments":
                cause = f.evidence.get("cause") or "no cause measured"
                caption = f"replay of step {f.evidence.get('step')}: experiments (cause: {cause})"
                out.append((caption, pd.DataFrame(list(block.rows), columns=list(block.columns))))
    return out


def add_replay_marks(
    fig: go.Figure, marks: Sequence[ReplayMark], rows: pd.DataFrame | None = None
) -> None:
    """Mark the replayed steps on the loss-scale panel (row 1): a marker at the step's scale
    (its ``scale``, else the lowest ``scale_before`` of ``rows`` at that step), hover text its
    cause; a step without a known scale gets a dotted vertical line instead. Markers only:
    nothing joins them (they are sampled steps, not a series)."""
    import plotly.graph_objects as go

    placed: list[tuple[ReplayMark, float]] = []
    for mark in marks:
        y = mark.scale
        if y is None and rows is not None and len(rows) and "scale_before" in rows:
            at = rows.loc[rows["step"] == mark.step, "scale_before"].dropna()
            y = float(at.min()) if len(at) else None
        if y is not None and np.isfinite(y) and y > 0:
            placed.append((mark, y))
        else:
            fig.add_vline(
                x=mark.step,
                line={"color": _REPLAY_COLOR, "dash": "dot", "width": 1},
                annotation_text=f"replayed: {mark.cause or 'not measured'}",
                annotation_hovertext=mark.text,
            )
    if placed:
        fig.add_trace(
            go.Scatter(
                x=[m.step for m, _ in placed],
                y=[y for _, y in placed],
                mode="markers",
                name="replayed step",
                marker={
                    "symbol": "star",
                    "size": 14,
                    "color": _REPLAY_COLOR,
                    "line": {"width": 1, "color": "#333"},
                },
                text=[m.text for m, _ in placed],
                hovertemplate="%{text}<extra></extra>",
            ),
            1,
            1,
        )


def make_loss_scale_figure(
    steps: pd.DataFrame | StepsRelation,
    max_points: int = MAX_POINTS,
    replays: Sequence[ReplayMark] = (),
) -> go.Figure:
    """Loss scale per step on a log axis (skipped steps, growth and backoff marked), loss beneath.

    Each rank has its own colour (its scale and loss lines). Steps whose loss was NaN/inf
    are gaps in the loss line, shaded and labelled ("loss NaN, steps 80–119").

    Args:
        steps: the run's steps frame, or a run of many ranks' :class:`StepsRelation`
            (:func:`steps_of`: bands reduced in DuckDB, the marked rows read alone).
        max_points: points kept per drawn series.
        replays: the bad steps amprobe replayed (:func:`replay_marks`), marked on the scale
            panel with their measured cause as hover text.
    """
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    if isinstance(steps, StepsRelation):
        fig = _loss_scale_relation_figure(steps, max_points)
        if replays and fig.data:
            add_replay_marks(fig, replays)
        return fig
    rows = scaler_rows(steps)
    has_loss = loss_recorded(steps)
    if rows.empty and not has_loss:
        return empty_figure("not recorded: no step with an enabled GradScaler or a loss value")
    fig = _scale_loss_subplots()
    ranks = run_ranks(steps)
    multi = len(ranks) > 1
    if many_ranks(ranks):
        _loss_scale_bands(fig, steps, rows, has_loss, ranks, max_points)
        if replays:
            add_replay_marks(fig, replays, rows)
        return fig
    for rank, part in split_ranks(rows):
        suffix = f" (rank {rank})" if multi else ""
        x, y = thin_series(part, "scale_before", max_points)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines",
                name=f"scale{suffix}",
                legendgroup=f"rank {rank}",
                line={"shape": "hv", "color": rank_color(rank, ranks)},
            ),
            1,
            1,
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
    if replays:
        add_replay_marks(fig, replays, rows)
    if rows.empty:
        _no_scale_note(fig)
    if has_loss:
        for rank, part in split_ranks(sort_steps(steps)):
            x, y = thin_series(part, "loss", max_points, keep_gaps=True)
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=gaps_as_null(y),
                    mode="lines",
                    name=f"loss (rank {rank})" if multi else "loss",
                    legendgroup=f"rank {rank}",
                    line={"color": rank_color(rank, ranks)},
                    connectgaps=False,
                ),
                2,
                1,
            )
        add_loss_bands(fig, steps, row=2, rows=(1,))
    else:
        _no_loss_note(fig)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(
        height=520,
        template="plotly_white",
        margin={"t": 40, "b": 40, "l": 60, "r": 20},
        legend={"orientation": "h", "y": -0.15},
    )
    return fig


def _scale_loss_subplots() -> go.Figure:
    """The loss-scale figure's two panels: the scale (log) above, the loss below."""
    from plotly.subplots import make_subplots

    return make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        row_heights=[0.6, 0.4],
        subplot_titles=("loss scale (log)", "loss"),
    )


def _loss_scale_relation_figure(steps: StepsRelation, max_points: int) -> go.Figure:
    """:func:`make_loss_scale_figure` of a run of many ranks from its derived store: the
    bands from one query per series, the skipped steps, scale changes and NaN/inf losses
    from the few rows that hold them (:func:`event_rows`)."""
    events = event_rows(steps)
    scaled = steps.filtered(SCALER_ROWS_SQL)
    has_scale = scaled.has("scale_before")
    has_loss = steps.has("loss") or bool(nonfinite_loss_spans(events))
    if not has_scale and not has_loss:
        return empty_figure("not recorded: no step with an enabled GradScaler or a loss value")
    fig = _scale_loss_subplots()
    ranks = run_ranks(steps)
    _loss_scale_bands(
        fig,
        steps,
        scaler_rows(events),
        has_loss,
        ranks,
        max_points,
        scale_source=scaled if has_scale else None,
        loss_rows=events,
    )
    return fig


def _loss_scale_bands(
    fig: go.Figure,
    steps: pd.DataFrame | StepsRelation,
    rows: pd.DataFrame,
    has_loss: bool,
    ranks: list[int],
    max_points: int,
    scale_source: StepsRelation | None = None,
    loss_rows: pd.DataFrame | None = None,
) -> None:
    """:func:`make_loss_scale_figure` for a run of many ranks: the scale (each rank's lowest
    in a bin, so a drop is never hidden) and the loss (each rank's mean in a bin) as bands
    across ranks with the outlier ranks drawn alone; skipped steps and scale changes once per
    step with how many ranks had them. From the derived store (``steps`` a
    :class:`StepsRelation`): the scale's bands from ``scale_source``, ``rows`` and
    ``loss_rows`` only the marked rows (:func:`event_rows`)."""
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    notes = []
    if len(rows) or scale_source is not None:
        bands = add_rank_bands(
            fig,
            rows if scale_source is None else scale_source,
            "scale_before",
            "scale",
            lambda r: f"scale (rank {r})",
            ranks,
            1,
            shape="hv",
        )
        notes.append(bands_note("scale", bands))
        skipped = (
            rows[rows["skipped"].fillna(False).astype(bool)] if "skipped" in rows else rows[:0]
        )
        if len(skipped):
            per = skipped.groupby("step", sort=True).agg(
                scale=("scale_before", "min"), ranks=("rank", "nunique")
            )
            per = cap_rows(per.reset_index(), max_points)
            fig.add_trace(
                go.Scatter(
                    x=per["step"].to_numpy(dtype="int32"),
                    y=per["scale"].to_numpy(dtype="float32"),
                    customdata=per["ranks"].to_numpy(dtype="int32"),
                    mode="markers",
                    name="skipped step",
                    marker={"symbol": "x", "color": _SKIP_COLOR, "size": 8},
                    hovertemplate="step %{x}: skipped on %{customdata} rank(s)<br>"
                    "lowest scale before %{y:.4g}<extra></extra>",
                ),
                1,
                1,
            )
        events = scale_events(rows)
        for kind, color, symbol in (
            ("growth", _GROW_COLOR, "triangle-up"),
            ("backoff", _CUT_COLOR, "triangle-down"),
        ):
            part = events[events["event"] == kind]
            if not len(part):
                continue
            per = part.groupby(["step", "scale_after"], sort=True)["rank"].nunique()
            per = cap_rows(per.rename("ranks").reset_index(), max_points)
            fig.add_trace(
                go.Scatter(
                    x=per["step"].to_numpy(dtype="int32"),
                    y=per["scale_after"].to_numpy(dtype="float32"),
                    customdata=per["ranks"].to_numpy(dtype="int32"),
                    mode="markers",
                    name=kind,
                    marker={"symbol": symbol, "color": color, "size": 7},
                    hovertemplate=f"step %{{x}}: {kind} to %{{y:.4g}} on %{{customdata}} "
                    "rank(s)<extra></extra>",
                ),
                1,
                1,
            )
    else:
        _no_scale_note(fig)
    if has_loss:
        bands = add_rank_bands(fig, steps, "loss", "loss", lambda r: f"loss (rank {r})", ranks, 2)
        notes.append(bands_note("loss", bands) + "; NaN/inf losses left out, shaded below")
        if loss_rows is None:
            add_loss_bands(fig, steps, row=2, rows=(1,))
        else:
            add_loss_bands(fig, loss_rows, row=2, rows=(1,), n_ranks=len(ranks))
    else:
        _no_loss_note(fig)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(
        height=560 + 14 * len(notes),
        template="plotly_white",
        title={"text": "<br>".join(notes), "font": {"size": 11}},
        margin={"t": 50 + 16 * len(notes), "b": 40, "l": 60, "r": 20},
        legend={"orientation": "h", "y": -0.15},
    )


def _scaler_counts(part: pd.DataFrame) -> tuple[int, int, int, int, float]:
    """Scaled steps, skipped steps, backoffs, growths and the last scale of one rank's rows."""
    part = part.sort_values("step", kind="stable")
    return (
        int(part["step"].nunique()),
        int(part["skipped"].fillna(False).astype(bool).sum()),
        int((part["scale_after"] < part["scale_before"]).sum()),
        int((part["scale_after"] > part["scale_before"]).sum()),
        float(part["scale_after"].iloc[-1]),
    )


def _scaled_steps_text(scaled: pd.DataFrame | dict[int, tuple[int, int, int, int, float]]) -> str:
    """The scaler summary, counting steps (per rank in a run of several ranks, never
    rank-steps added up); ``scaled`` the rows with a scale, or each rank's counts."""
    counts = (
        scaled
        if isinstance(scaled, dict)
        else {rank: _scaler_counts(part) for rank, part in split_ranks(scaled)}
    )

    def sentence(c: tuple[int, int, int, int, float], each: str) -> str:
        n, skipped, cuts, grows, final = c
        return (
            f"{n} scaled steps{each}: {skipped} skipped, {cuts} scale cuts (backoff), "
            f"{grows} growth events; final scale {final:g}"
        )

    if len(counts) == 1:
        return sentence(next(iter(counts.values())), "") + "."
    if len(set(counts.values())) == 1:
        return sentence(next(iter(counts.values())), f" on each of {len(counts)} ranks") + "."
    if many_ranks(list(counts)):
        return rank_groups_text(counts, lambda c: sentence(c, "")) + "."
    return "; ".join(f"rank {r}: " + sentence(c, "") for r, c in counts.items()) + "."


def _scaler_counts_sql(steps: StepsRelation) -> dict[int, tuple[int, int, int, int, float]]:
    """:func:`_scaler_counts` of every rank in one query of the derived store."""
    frame = steps.query_by_rank(RANK_STATS_SQL)
    frame = frame[frame["scaled_steps"] > 0].copy()
    several = frame["rank"][frame["windows"].astype(bool)].astype(int).tolist()
    if several:  # ranks of several windows: their distinct steps counted apart
        distinct = steps.query(
            "SELECT rank, count(DISTINCT step) AS n FROM s WHERE scale_after IS NOT NULL "
            f"AND rank IN ({', '.join(map(str, several))}) GROUP BY rank"
        ).set_index("rank")["n"]
        at = frame["rank"].isin(distinct.index)
        frame.loc[at, "scaled_steps"] = frame.loc[at, "rank"].map(distinct).to_numpy()
    return {
        int(r): (int(n), int(sk), int(c), int(g), float(f))
        for r, n, sk, c, g, f in zip(
            frame["rank"],
            frame["scaled_steps"],
            frame["scaled_skipped"],
            frame["cuts"],
            frame["grows"],
            frame["final_scale"],
            strict=True,
        )
    }


def _build_scale_section_many(
    steps: StepsRelation, title: str, diagnosis: Diagnosis | None = None
) -> Section:
    """:func:`build_scale_section` of a run of many ranks, from its derived store."""
    has_scale = steps.has("scale_after")
    figure = make_loss_scale_figure(steps, replays=replay_marks(diagnosis))
    has_loss = steps.has("loss") or bool(nonfinite_loss_spans(event_rows(steps)))
    if not has_scale and not has_loss:
        return Section("scale", title, missing="no GradScaler and no loss tensor were seen")
    text = []
    if not has_scale:
        text.append("No enabled GradScaler was used in this run: only the loss is shown.")
    else:
        text.append(_scaled_steps_text(_scaler_counts_sql(steps)))
    tables = tuple(replay_tables(diagnosis))
    return Section("scale", title, figures=(figure,), tables=tables, text=tuple(text))


@section("scale", order=10, tab="Loss scale")
def build_scale_section(run: Run, diagnosis: Diagnosis) -> Section:
    title = "Loss scale and loss"
    many = steps_relation(run)
    if many is not None:
        if not len(many.ranks):
            return Section("scale", title, missing="no training step was recorded")
        return _build_scale_section_many(many, title, diagnosis)
    steps = run.steps
    if steps.empty:
        return Section("scale", title, missing="no training step was recorded")
    has_scale = steps["scale_after"].notna().any()
    has_loss = loss_recorded(steps)
    if not has_scale and not has_loss:
        return Section("scale", title, missing="no GradScaler and no loss tensor were seen")
    text = []
    if not has_scale:
        text.append("No enabled GradScaler was used in this run: only the loss is shown.")
    scaled = steps[steps["scale_after"].notna()]
    if len(scaled):
        text.append(_scaled_steps_text(scaled))
    figure = make_loss_scale_figure(steps, replays=replay_marks(diagnosis))
    return Section(
        "scale",
        title,
        figures=(figure,),
        tables=tuple(replay_tables(diagnosis)),
        text=tuple(text),
    )


def _panel_note(fig: go.Figure, text: str, axis: str, **cell: int) -> None:
    """``text`` in the middle of the panel of axes ``x<axis>``/``y<axis>``."""
    fig.add_annotation(
        text=text,
        showarrow=False,
        xref=f"x{axis} domain",
        yref=f"y{axis} domain",
        x=0.5,
        y=0.5,
        **cell,
    )


def _no_scale_note(fig: go.Figure) -> None:
    """Say in the loss-scale panel (row 1) that the run used no enabled GradScaler."""
    _panel_note(fig, "not recorded: no enabled GradScaler", "", row=1, col=1)


def _no_loss_note(fig: go.Figure) -> None:
    """Say in the loss panel (row 2) that the run recorded no loss."""
    _panel_note(fig, "not recorded: no loss value (capture_loss off?)", "2")
