"""Report section for per-layer numerics: layer table, layer x step heatmaps, exponent histograms."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from amprobe.analysis.frames import percent_text, range_text, section_keys, steps_text
from amprobe.analysis.numerics import (
    COUNT_COLUMNS,
    COUNT_DEFINITIONS,
    HIST_LOW,
    compute_layer_summary,
    compute_layer_summary_summaries,
    compute_scale_hint,
    compute_scale_hint_summaries,
    layer_histograms,
    layer_summary,
    numerics_cells,
    numerics_missing_reason,
    own_layer_rows,
    summary_layers,
)
from amprobe.analysis.rankbands import bucket_ranks, rank_range_text
from amprobe.report.downsample import MAX_COLUMNS
from amprobe.report.escape import escape_plotly_text
from amprobe.report.registry import Section, section
from amprobe.report.scale import many_ranks, many_relations, rank_groups_text, step_ends, steps_of

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
    "MAX_HEATMAP_ROWS",
    "RankNumerics",
    "layer_recorded",
    "summary_step_ends",
]

#: heatmap name -> the :data:`~amprobe.analysis.numerics.COUNT_COLUMNS` column it draws per
#: sampled step (the per-layer totals table shows the same column summed)
HEATMAP_METRICS: dict[str, str] = {
    "nonfinite": "nonfinite",
    "overflow": "fp16_inf",
    "underflow": "below_subnormal",
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
    "fp16_inf",
    "below_normal",
    "below_subnormal",
    "zero_share",
    "amax",
]
#: what each count column of the totals table holds (one definition: the heatmaps' too)
_COLUMN_NOTES = (
    "; ".join(
        f"{column} = {COUNT_DEFINITIONS[column]}"
        for column in ("nonfinite", "over_fp16", "fp16_inf", "below_normal", "below_subnormal")
    )
    + ". An fp16 cast makes the over_fp16 and inf values inf: fp16_inf counts every value it "
    "makes inf. The heatmaps draw nonfinite, fp16_inf and below_subnormal per sampled step."
)
#: zero is white; any count (1 and up) at least a visible pink, then darker up to the largest
_WHITE, _LOW, _HIGH = "#ffffff", "#fcae91", "#a50f15"
_NOT_MEASURED = "#bdbdbd"
#: the name of the markers on pooled cells some of whose samples were not measured
PARTLY_NOT_MEASURED = "partly not measured"
_GAP_LINE = "#969696"
#: unsampled stretches labelled above the heatmap, at most (more: the dashed lines only)
_MAX_GAP_LABELS = 12
#: gap labels: rows above the plot, their height, a character's width and the plot's width that
#: the spacing assumes (px; the dashboard and report draw the heatmap about this wide)
_GAP_LABEL_ROWS = 2
_GAP_LABEL_ROW_PX = 11
_GAP_LABEL_CHAR_PX = 5.5
_GAP_LABEL_AXIS_PX = 1000
#: hover detail (the parts of each count) only up to this many cells: it is text per cell
_MAX_DETAIL_CELLS = 20_000
#: heatmap rows, at most, in a run of several ranks: beyond, consecutive ranks share a row
#: (each cell the largest count of the bucket's ranks, the rank named on hover)
MAX_HEATMAP_ROWS = 256
#: numerics_not_checked kinds that leave every layer's activations unmeasured
_ACTIVATION_KINDS = ("output", "grad_output")


def _label(frame: pd.DataFrame, with_rank: bool = False) -> pd.Series:
    label = frame["module"].astype(str) + " · " + frame["kind"].astype(str)
    if with_rank:
        label = "r" + frame["rank"].astype(int).astype(str) + " · " + label
    return label


def _colorscale(zmax: float) -> list[list[Any]]:
    """A scale from 0: zero white, a count of 1 already visibly coloured."""
    if zmax <= 1:
        return [[0.0, _WHITE], [1.0, _HIGH]]
    return [[0.0, _WHITE], [1.0 / zmax, _LOW], [1.0, _HIGH]]


def _rank_layers(frame: pd.DataFrame) -> dict[int, list[tuple[str, str]]]:
    """Rank (ascending) -> its (module, kind) pairs (as text) in order of first appearance."""
    # plain object arrays: iterating arrow-backed strings costs ~7 µs a value
    plain = pd.DataFrame(
        {
            "rank": frame["rank"].to_numpy(),
            "module": frame["module"].astype(str).to_numpy(dtype=object),
            "kind": frame["kind"].astype(str).to_numpy(dtype=object),
        }
    )
    return {
        int(rank): list(dict.fromkeys(zip(part["module"], part["kind"], strict=True)))
        for rank, part in plain.groupby("rank", sort=True)
    }


def _missing_rows(
    layers: dict[int, list[tuple[str, str]]], not_checked: Sequence[Mapping[str, Any]]
) -> dict[tuple[int, str, str], str]:
    """(rank, module, kind) -> why (short), for layers that ``numerics_not_checked`` events say
    were not measured and that have no row of that kind (kind ``"?"``: the event names no
    kind): every module with parameter gradients but no activations when the activations
    were not measured (a compiled region), the first layer an event names when it has no row
    at all (a tensor subclass). ``layers``: :func:`_rank_layers` (or the same from the
    ranks' summaries)."""
    out: dict[tuple[int, str, str], str] = {}
    if not not_checked:
        return out
    for rank in sorted(layers):
        pairs = layers[rank]
        seen = set(pairs)
        modules = {module for module, _ in pairs}
        for event in not_checked:
            if "rank" in event and event.get("rank") != rank:
                continue
            # the full reason is the note under the figure (once, not in every cell)
            reason = f"{event.get('what', 'not measured')}: see the note under the figure"
            if event.get("what") == "activations":
                with_params = [module for module, kind in pairs if kind == "grad_param"]
                for module in dict.fromkeys(with_params):
                    for kind in _ACTIVATION_KINDS:
                        if (module, kind) not in seen:
                            out[(int(rank), module, kind)] = reason
            first = event.get("first_at")
            if isinstance(first, str) and first not in modules:
                out[(int(rank), first, "?")] = reason
    return out


def _pool(steps: list[int], max_columns: int) -> list[list[int]]:
    """Sampled steps in at most ``max_columns`` runs of consecutive samples (one each if few)."""
    if len(steps) <= max_columns:
        return [[s] for s in steps]
    size = -(-len(steps) // max_columns)
    return [steps[i : i + size] for i in range(0, len(steps), size)]


def make_numerics_heatmap_figure(
    frame: pd.DataFrame,
    metric: str,
    steps: pd.DataFrame | None = None,
    not_checked: Sequence[Mapping[str, Any]] = (),
    max_columns: int = MAX_COLUMNS,
) -> go.Figure:
    """Layer (module · kind) x sampled step heatmap of one :data:`HEATMAP_METRICS` count.

    One column per sampled step, at that step (a categorical axis: the columns are the steps
    the ``numerics`` table holds, nothing in between), dashed lines labelled with the steps
    where unsampled steps lie (between two columns, and before the first or after the last
    when the run has steps there); each cell is the recorded count of that layer at that
    step, its parts on hover (up to 20,000 cells). The
    colour scale starts at 0 (white): a run with no count anywhere has no coloured cell.
    Cells that were not measured (a layer without a row at a sampled step, a rank that did
    not sample the step, a layer that ``numerics_not_checked`` names) are grey with the
    reason on hover, never 0. In a run of several ranks each rank has its own rows.

    Args:
        frame: the run's ``numerics`` table.
        metric: a :data:`HEATMAP_METRICS` key.
        steps: the run's steps frame, to say which steps were not sampled (optional).
        not_checked: the run's ``numerics_not_checked`` events.
        max_columns: more sampled steps than this are pooled into columns of consecutive
            samples (each the largest count of its measured samples, a grey dot where some
            were not measured), labelled with their step range.
    """
    column = HEATMAP_METRICS[metric]
    count = COUNT_COLUMNS[column][1]
    if "rank" not in frame:
        frame = frame.assign(rank=0)
    n_ranks = frame["rank"].nunique()
    multi = n_ranks > 1
    data = frame.assign(layer=_label(frame, multi), value=count(frame))
    sampled = sorted({int(s) for s in data["step"].dropna()})
    buckets = _rank_buckets(frame) if multi else None
    rank_names = None
    if buckets is not None:
        data, rank_names = _bucketed(data, buckets)
    missing_rows = _missing_rows(_rank_layers(frame), not_checked) if not_checked else {}
    return _heatmap_figure(
        column, data, sampled, buckets, rank_names, missing_rows, n_ranks, steps, not_checked,
        max_columns,
    )  # fmt: skip


def _heatmap_figure(
    column: str,
    data: pd.DataFrame,
    sampled: list[int],
    buckets: list[np.ndarray] | None,
    rank_names: list[str] | None,
    missing_rows: dict[tuple[int, str, str], str],
    n_ranks: int,
    steps: pd.DataFrame | None,
    not_checked: Sequence[Mapping[str, Any]],
    max_columns: int,
) -> go.Figure:
    """:func:`make_numerics_heatmap_figure` of ``data``: one row per drawn layer and sampled
    step (``layer``, ``step``, ``value``, ``rank``: the rank or, ``buckets`` given, the bucket's
    index, with ``rank_at`` and ``n_ranks``; the recorded rows with their counts' parts
    otherwise), ``missing_rows`` from :func:`_missing_rows`, ``n_ranks`` the ranks with a row."""
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    what = COUNT_COLUMNS[column][0]
    multi = n_ranks > 1
    grid = _Grid(data, sampled, rank_names)
    for (rank, module, kind), reason in missing_rows.items():
        label = f"{module} · {kind}" if kind != "?" else f"{module} · (not measured)"
        if buckets is not None:
            bucket = next(b for b in buckets if rank in b)
            label = f"{rank_range_text(bucket)} · {label}"
            if label in grid.layers:
                continue
        elif multi:
            label = f"r{rank} · {label}"
        grid.add_unmeasured_row(label, reason)
    columns = _pool(sampled, max_columns)
    pooled = len(columns) < len(sampled)
    x: list[Any] = [range_text(c[0], c[-1]) for c in columns] if pooled else list(sampled)
    z, why, missing = grid.pooled(columns)
    # pooled cells with a count that some of their samples were not measured for
    partly = pooled & ~np.isnan(z) & (missing > 0)
    text: list[list[str]] | None = None
    if pooled:
        text = [
            [
                f"largest of sampled steps {x[j]}"
                + (
                    f"; {missing[i, j]} of its {len(columns[j])} samples not measured"
                    if partly[i, j]
                    else ""
                )
                for j in range(len(columns))
            ]
            for i in range(len(z))
        ]
    elif buckets is not None:
        text = None  # the rank holding each cell's count is in customdata (compact, binary)
    elif len(grid.layers) * len(sampled) <= _MAX_DETAIL_CELLS:
        detail = _cell_detail(data, column)
        text = [[detail.get((layer, s), "") for s in sampled] for layer in grid.layers]
    # NaN: no cell in this trace (a binary array, which plotly draws as a gap)
    unmeasured = np.array([[r is not None for r in row] for row in why], dtype=bool)
    grey = np.where(unmeasured, 1.0, np.nan)
    if buckets is not None:  # many ranks: compact binary arrays (float32 holds counts < 2**24)
        grey = grey.astype("float32")
        if not (z >= 2**24).any():
            z = z.astype("float32")
    layers = grid.layers
    zmax = max(1.0, float(np.nanmax(z))) if (~np.isnan(z)).any() else 1.0
    fig = go.Figure()
    # what both heatmaps share: the cells' places and the lines between them
    cells: dict[str, Any] = {
        "x": x,
        "y": layers,
        "xgap": 1 if len(x) <= 200 else 0,
        "ygap": 1 if len(layers) <= 200 else 0,
        "hoverongaps": False,
    }
    if unmeasured.any():
        fig.add_trace(
            go.Heatmap(
                z=grey,
                text=why,
                zmin=0,
                zmax=1,
                colorscale=[[0.0, _NOT_MEASURED], [1.0, _NOT_MEASURED]],
                showscale=False,
                name="not measured",
                hovertemplate="%{y}<br>step %{x}: not measured<br>%{text}<extra></extra>",
                **cells,
            )
        )
    custom = None
    hover_rank = ""
    if buckets is not None and not pooled:
        custom = _bucket_customdata(data, grid.layers, sampled)
        if custom.max(initial=0) < 2**15:
            custom = custom.astype(np.int16)
        hover_rank = (
            "<br>the largest of the row's ranks: rank %{customdata[0]} "
            "(%{customdata[1]} of its ranks measured)"
        )
    fig.add_trace(
        go.Heatmap(
            z=z,
            text=text,
            customdata=custom,
            zmin=0,
            zmax=zmax,
            colorscale=_colorscale(zmax),
            colorbar={"title": "count<br>(0: white)"},
            name=column,
            hovertemplate=f"%{{y}}<br>step %{{x}}<br>{column}: %{{z}}"
            + ("<br>%{text}" if text is not None else "")
            + hover_rank
            + "<extra></extra>",
            **cells,
        )
    )
    if partly.any():
        rows, cols = np.nonzero(partly)
        fig.add_trace(
            go.Scatter(
                x=[x[j] for j in cols],
                y=[layers[i] for i in rows],
                mode="markers",
                marker={"symbol": "circle", "size": 5, "color": _NOT_MEASURED},
                text=[
                    f"{missing[i, j]} of its {len(columns[j])} samples not measured"
                    for i, j in zip(rows, cols, strict=True)
                ],
                name=PARTLY_NOT_MEASURED,
                hovertemplate="%{y}<br>steps %{x}: %{text}<extra></extra>",
                showlegend=False,
            )
        )
    notes = [_sampling_note(sampled, steps, pooled, len(columns))]
    bucket_note = ""
    if buckets is not None:
        size = max(len(b) for b in buckets)
        bucket_note = (
            f"<br><sup>{n_ranks} ranks, up to {size} consecutive ranks a row: "
            "each cell the largest count of its ranks (the rank on hover), never a sum</sup>"
        )
    if unmeasured.any():
        notes.append("grey: not measured (hover for why), never 0")
    if partly.any():
        notes.append("grey dot: some samples of the column not measured (its count is of the rest)")
    if not pooled:
        _mark_gaps(fig, sampled, steps)
    for i, event in enumerate(not_checked):
        fig.add_annotation(
            text=escape_plotly_text(f"not measured: {event.get('what', '?')} (hover for why)"),
            hovertext=escape_plotly_text(str(event.get("reason", ""))),
            showarrow=False,
            xref="paper",
            yref="paper",
            x=0,
            y=0,
            yshift=-62 - 16 * i,  # below the axis title
            xanchor="left",
            yanchor="top",
            font={"size": 11, "color": "#555"},
        )
    fig.update_layout(
        title={"text": f"Per-layer {column}: {what}<br><sup>{'; '.join(notes)}</sup>{bucket_note}"},
        xaxis={"title": "sampled step", "type": "category"},
        yaxis={"title": "layer", "autorange": "reversed"},
        height=max(320, 18 * len(layers) + 180 + 16 * len(not_checked)),
        margin={"t": 110, "b": 70 + 16 * len(not_checked)},
        plot_bgcolor="#e8e8e8",  # shows between the cells: a white (0) cell stays visible
    )
    return fig


def _rank_buckets(frame: pd.DataFrame) -> list[np.ndarray] | None:
    """Consecutive ranks that share a heatmap row, when a row per rank and layer would make
    more than :data:`MAX_HEATMAP_ROWS` rows (None: a row per rank, as recorded)."""
    ranks = frame["rank"].dropna().astype(int).unique()
    layers = len(frame[["module", "kind"]].drop_duplicates())
    if len(ranks) * max(layers, 1) <= MAX_HEATMAP_ROWS:
        return None
    return bucket_ranks(ranks, max(1, MAX_HEATMAP_ROWS // max(layers, 1)))


def _bucketed(data: pd.DataFrame, buckets: list[np.ndarray]) -> tuple[pd.DataFrame, list[str]]:
    """``data`` (one row per rank, layer and step) with one row per bucket of ranks, layer and
    step: its ``value`` the largest of the bucket's ranks (``rank_at``: which), ``n_ranks`` how
    many of them have a row; ``rank`` becomes the bucket's index, ``layer`` its label."""
    names = [rank_range_text(b) for b in buckets]
    bucket_of = np.full(int(max(int(b[-1]) for b in buckets)) + 1, -1, dtype=np.int64)
    for i, bucket in enumerate(buckets):
        bucket_of[bucket] = i
    plain = _label(data)  # "module · kind", in the order the rows came
    codes, layers = pd.factorize(plain)
    per = (
        pd.DataFrame(
            {
                "rank": data["rank"].to_numpy(dtype=np.int64),
                "code": codes,
                "step": data["step"].to_numpy(),
                "value": data["value"].to_numpy(dtype="float64"),
            }
        )
        .groupby(["rank", "code", "step"], sort=False)["value"]
        .sum(min_count=1)
        .reset_index()
    )
    per["bucket"] = bucket_of[per["rank"].to_numpy()]
    keys = ["bucket", "code", "step"]
    counted = per.groupby(keys, sort=False)["rank"].size().rename("n_ranks")
    top = (
        per.sort_values(["value", "rank"], ascending=[False, True], na_position="last")
        .drop_duplicates(keys)
        .rename(columns={"rank": "rank_at"})
        .join(counted, on=keys)
        .sort_values(["bucket", "code", "step"], kind="stable")
    )
    bucket_names = np.asarray(names, dtype=object)[top["bucket"].to_numpy()]
    layer_names = np.asarray(layers, dtype=object)[top["code"].to_numpy()]
    label = [f"{b} · {layer}" for b, layer in zip(bucket_names, layer_names, strict=True)]
    return top.assign(rank=top["bucket"], layer=label).reset_index(drop=True), names


def _bucket_customdata(data: pd.DataFrame, layers: list[str], sampled: list[int]) -> np.ndarray:
    """rows x columns x (the rank holding the cell's count, how many ranks have a row there);
    -1 and 0 where no rank has."""
    index = pd.Index(sampled)
    cells = data.set_index(["layer", "step"])
    out = np.zeros((len(layers), len(sampled), 2), dtype=np.int32)
    for k, col in enumerate(("rank_at", "n_ranks")):
        grid = (
            cells[col]
            .unstack("step")
            .reindex(index=layers, columns=index)
            .to_numpy(dtype="float64")
        )
        out[:, :, k] = np.where(np.isnan(grid), -1 if k == 0 else 0, grid).astype(np.int32)
    return out


class _Grid:
    """A heatmap's layers x sampled steps: the recorded counts, and why a cell has none."""

    def __init__(
        self, data: pd.DataFrame, sampled: list[int], rank_names: Sequence[str] | None = None
    ) -> None:
        self.layers: list[str] = list(dict.fromkeys(data["layer"]))
        index = pd.Index(sampled)
        cells = data.groupby(["layer", "step"], sort=False)["value"]
        self.values = (
            cells.sum(min_count=1).unstack("step").reindex(index=self.layers, columns=index)
        ).to_numpy(dtype="float64")
        present = cells.size().unstack("step").reindex(index=self.layers, columns=index)
        self.present = present.notna().to_numpy()
        ranks = (
            data.drop_duplicates("layer").set_index("layer")["rank"].reindex(self.layers)
        ).to_numpy(dtype=int)
        steps = np.asarray(sampled, dtype=int)
        by_rank = {
            int(r): np.isin(steps, p["step"].to_numpy(dtype=int)) for r, p in data.groupby("rank")
        }
        rank_sampled = np.array([by_rank[int(r)] for r in ranks]).reshape(self.values.shape)
        first = (
            data.groupby("layer", sort=False)["step"].min().reindex(self.layers).to_numpy(dtype=int)
        )
        why = np.full(self.values.shape, None, dtype=object)
        absent = rank_sampled & ~self.present
        early = absent & (steps[None, :] < first[:, None])
        null = self.present & np.isnan(self.values)
        why[absent] = (
            "no record of this layer at this sampled step (it did not run, or was not measured)"
        )
        for i, j in zip(*np.nonzero(early), strict=True):
            why[i, j] = f"not yet measured: this layer's first record is at step {first[i]}"
        why[null] = "this count was not recorded in the layer's row"
        for i, j in zip(*np.nonzero(~rank_sampled), strict=True):
            who = f"rank {ranks[i]}" if rank_names is None else f"ranks {rank_names[ranks[i]]}"
            why[i, j] = f"{who} did not sample step {steps[j]}"
        self.why: list[list[str | None]] = why.tolist()

    def add_unmeasured_row(self, label: str, reason: str) -> None:
        """A layer with no record at all (named by a ``numerics_not_checked`` event)."""
        self.layers.append(label)
        n = self.values.shape[1]
        self.values = np.vstack([self.values, np.full((1, n), np.nan)])
        self.why.append([reason] * n)

    def pooled(
        self, columns: list[list[int]]
    ) -> tuple[np.ndarray, list[list[str | None]], np.ndarray]:
        """Counts (the largest of each column's measured samples; NaN: none measured), the
        reason for each cell without one, and how many of each cell's samples were not
        measured (a pooled cell can hold measured and unmeasured samples: its count says
        nothing of the unmeasured ones)."""
        unread = np.array([[r is not None for r in row] for row in self.why], dtype=bool)
        if all(len(group) == 1 for group in columns):  # one column per sample: as recorded
            return self.values, self.why, unread.astype(int)
        z = np.full((len(self.layers), len(columns)), np.nan)
        missing = np.zeros((len(self.layers), len(columns)), dtype=int)
        why: list[list[str | None]] = []
        for i in range(len(self.layers)):
            wrow: list[str | None] = []
            j = 0
            for c, group in enumerate(columns):
                part = self.values[i, j : j + len(group)]
                measured = ~unread[i, j : j + len(group)] & ~np.isnan(part)
                missing[i, c] = len(group) - int(measured.sum())
                if measured.any():
                    z[i, c] = part[measured].max()
                    wrow.append(None)
                else:
                    first = next(r for r in self.why[i][j : j + len(group)] if r is not None)
                    wrow.append(
                        first if len(group) == 1 else f"none of its {len(group)} samples: {first}"
                    )
                j += len(group)
            why.append(wrow)
        return z, why, missing


def _cell_detail(data: pd.DataFrame, column: str) -> dict[tuple[str, int], str]:
    """Hover detail per (layer, step): the parts of the count and, for forward outputs,
    whether the layer's inputs were read."""
    parts = {
        "nonfinite": ("nan", "inf"),
        "fp16_inf": ("over_fp16", "inf"),
        "below_subnormal": ("elements",),  # "of N values"
    }[column]
    out: dict[tuple[str, int], str] = {}
    kinds = data["kind"].tolist()
    inputs = data["in_nonfinite"].tolist() if "in_nonfinite" in data else [None] * len(data)
    values = {p: data[p].tolist() for p in parts}
    for i, (layer, step) in enumerate(zip(data["layer"], data["step"], strict=True)):
        bits = [f"{p} {_count(values[p][i])}" for p in parts]
        if parts == ("elements",):
            bits = [f"of {_count(values['elements'][i])} values"]
        if kinds[i] == "output":
            bits.append(
                "inputs not read (e.g. a tensor subclass): not checked"
                if pd.isna(inputs[i])
                else f"inputs: {_count(inputs[i])} non-finite"
            )
        out[(layer, int(step))] = ", ".join(bits)
    return out


def _count(value: Any) -> str:
    return "not recorded" if pd.isna(value) else f"{int(value):,}"


def _sampling_note(
    sampled: list[int], steps: pd.DataFrame | None, pooled: bool, columns: int
) -> str:
    """Which steps the columns are, and which steps of the run were not sampled."""
    note = f"{len(sampled)} sampled step(s): {steps_text(sampled, limit=8)}"
    if pooled:
        note += f", pooled into {columns} columns (each the largest of its measured samples)"
    else:
        note += "; one column each, dashed lines where unsampled steps lie (labelled above)"
    if steps is not None and not steps.empty and "step" in steps and sampled:
        first, last = int(steps["step"].min()), int(steps["step"].max())
        if first < sampled[0]:
            note += f"; nothing sampled before step {sampled[0]}"
        if last > sampled[-1]:
            note += f"; nothing sampled after step {sampled[-1]} (last step {last})"
    return note


def _mark_gaps(fig: go.Figure, sampled: list[int], steps: pd.DataFrame | None) -> None:
    """A dashed line where unsampled steps lie: between two columns whose steps are not
    consecutive, and before the first / after the last column when the run has steps there;
    labelled with those steps (when there are few such gaps)."""
    gaps = [
        (i + 0.5, sampled[i] + 1, sampled[i + 1] - 1)
        for i in range(len(sampled) - 1)
        if sampled[i + 1] - sampled[i] > 1
    ]
    if steps is not None and not steps.empty and "step" in steps and sampled:
        first, last = int(steps["step"].min()), int(steps["step"].max())
        if first < sampled[0]:
            gaps.insert(0, (-0.5, first, sampled[0] - 1))
        if last > sampled[-1]:
            gaps.append((len(sampled) - 0.5, sampled[-1] + 1, last))
    line = {"color": _GAP_LINE, "dash": "dash", "width": 1.5}
    # one layout update: add_shape re-validates every shape at each call (up to 1,000 gaps)
    fig.update_layout(
        shapes=[
            *fig.layout.shapes,
            *(
                {
                    "type": "line",
                    "xref": "x",
                    "yref": "paper",
                    "x0": at,
                    "x1": at,
                    "y0": 0,
                    "y1": 1,
                    "line": line,
                }
                for at, _, _ in gaps
            ),
        ]
    )
    if len(gaps) > _MAX_GAP_LABELS:
        return
    # labels of close gaps go on alternate rows above the plot, so that none is drawn over
    # another ("1–99" beside "101–120"); a label with no free row is left out (its line stays)
    columns = max(len(sampled), 1)
    row_end = [-float("inf")] * _GAP_LABEL_ROWS  # the x where each row's last label ends
    for at, a, b in gaps:
        text = range_text(a, b)
        half = len(text) * _GAP_LABEL_CHAR_PX / 2 * columns / _GAP_LABEL_AXIS_PX  # in columns
        row = next((r for r, end in enumerate(row_end) if at - half > end), None)
        if row is None:
            continue
        row_end[row] = at + half
        fig.add_annotation(
            text=text,
            hovertext=f"{range_text(a, b, word=True)} not sampled",
            xref="x",
            yref="paper",
            x=at,
            y=1.0,
            yanchor="bottom",
            yshift=row * _GAP_LABEL_ROW_PX,
            showarrow=False,
            font={"size": 9, "color": "#555"},
        )


def worst_layers(
    frame: pd.DataFrame | None, n: int = 4, summary: pd.DataFrame | None = None
) -> list[tuple[str, str]]:
    """(module, kind) pairs with the most non-finite, overflowing and underflowing values.

    ``summary`` is the frame's :func:`~amprobe.analysis.numerics.compute_layer_summary` when the
    caller already has it (``frame`` is then not read).
    """
    if summary is None:
        summary = compute_layer_summary(frame if frame is not None else pd.DataFrame())
    if summary.empty:
        return []
    score = summary["nonfinite"] * 1e6 + summary["over_fp16"] * 1e3 + summary["below_subnormal"]
    summary = summary.assign(score=score / summary["elements"].clip(lower=1))
    top = summary.sort_values("score", ascending=False).head(n)
    return [(str(m), str(k)) for m, k in zip(top["module"], top["kind"], strict=True)]


def make_exponent_histogram_figure(frame: pd.DataFrame, layers: list[tuple[str, str]]) -> go.Figure:
    """Base-2 exponent histograms (summed over sampled steps) of ``layers``, with fp16 limits."""
    histograms = []
    for module, kind in layers:
        rows = frame[(frame["module"] == module) & (frame["kind"] == kind)]
        merged: dict[int, int] = {}
        for text, zeros in zip(rows["exp_hist"], rows["zeros"].fillna(0), strict=True):
            if not isinstance(text, str):
                continue
            for e, count in json.loads(text).items():
                merged[int(e)] = merged.get(int(e), 0) + int(count)
            merged[-127] = merged.get(-127, 0) - int(zeros)  # bin -127 also holds the zeros
        histograms.append((module, kind, merged))
    return _exponent_histogram_figure(histograms)


def _exponent_histogram_figure(histograms: list[tuple[str, str, dict[int, int]]]) -> go.Figure:
    """:func:`make_exponent_histogram_figure` of each layer's binade -> count (binades 128 and
    up, inf/NaN, and counts below 1 left out; -149: every nonzero value below 2**-133)."""
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    fig = go.Figure()
    for module, kind, merged in histograms:
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


def _final_scales(steps: pd.DataFrame) -> str:
    """The run's last recorded loss scale, per rank where ranks differ."""
    if steps.empty or "scale_after" not in steps:
        return ""
    scaled = steps[steps["scale_after"].notna()].sort_values("step", kind="stable")
    if scaled.empty:
        return ""
    ranks = scaled["rank"] if "rank" in scaled else pd.Series(0, index=scaled.index)
    last = scaled.groupby(ranks)[["step", "scale_after"]].last()
    if last["scale_after"].nunique() == 1:
        return (
            f"the run's final scale, at step {int(last['step'].max())}, is "
            f"{last['scale_after'].iloc[0]:g}"
        )
    if many_ranks(list(last.index)):
        per = {
            int(r): (float(v), int(s))
            for r, s, v in zip(last.index, last["step"], last["scale_after"], strict=True)
        }
        return "the run's final scales are " + rank_groups_text(
            per, lambda vs: f"{vs[0]:g} (step {vs[1]})"
        )
    return "the run's final scales are " + ", ".join(
        f"{v:g} on rank {r} (step {int(s)})"
        for r, s, v in zip(last.index, last["step"], last["scale_after"], strict=True)
    )


def _hint_text(hint: Mapping[str, Any], steps: pd.DataFrame) -> str:
    """The loss-scale hint as a sentence that says which step each scale is from."""
    line = (
        f"Loss-scale hint: {hint['hint_scale']:g} is the largest power of two keeping the largest "
        f"gradient ({hint['grad_amax']:.3g}) under 65504/{hint['margin']:g}"
    )
    if hint["underflow_share_at_current"] is None:
        return line + (
            "; every measured gradient is held in fp16, where values flushed to zero cannot "
            "be told from true zeros (AMP-N06 measures their subnormal share instead)."
        )
    step = hint.get("current_step")
    where = (
        f"at step {step}'s scale {hint['current_scale']:g} (the last sampled step with gradients"
        if step is not None
        else f"at scale {hint['current_scale']:g} (no gradient row recorded a scale"
    )
    final = _final_scales(steps)
    where += f"; {final})" if final else ")"
    return line + (
        f"; {where}, {percent_text(hint['underflow_share_at_current'], 2, space=False)} of the nonzero gradients held "
        f"wider than fp16 would flush to zero in fp16 ({percent_text(hint['underflow_share_at_hint'], 2, space=False)} "
        "at the hint)."
    )


@section("numerics", order=30, tab="Numerics")
def build_numerics_section(run: Run, diagnosis: Diagnosis) -> Section:
    """Per-layer numerics, or why they are missing.

    A run of more than :data:`~amprobe.report.scale.MAX_RANK_LINES` ranks is drawn from its
    summaries and its derived store (:class:`RankNumerics`), never from the merged table of
    every rank's rows; the figures show the same values.
    """
    if many_ranks([info.rank for info in run.ranks]):
        return RankNumerics.of(run).section(run)
    frame = own_layer_rows(run.table("numerics"))
    if frame.empty:
        return Section(key="numerics", title=_TITLE, missing=numerics_missing_reason(run))
    # the run's first and last steps and final scales (few rows per rank of many)
    ends = step_ends(steps_of(run))
    not_checked = run.events_of("numerics_not_checked")
    summary = layer_summary(run)
    figures = [
        make_numerics_heatmap_figure(frame, metric, ends, not_checked) for metric in HEATMAP_METRICS
    ]
    layers = worst_layers(frame, summary=summary)
    if layers:
        figures.append(make_exponent_histogram_figure(frame, layers))
    return _numerics_section(
        summary,
        run.table("offenders"),
        frame["step"].nunique(),
        "rank" in frame and frame["rank"].nunique() > 1,
        compute_scale_hint(frame),
        ends,
        figures,
    )


_TITLE = "Per-layer numerics"


def _numerics_section(
    summary: pd.DataFrame,
    offenders: pd.DataFrame,
    sampled: int | None,
    ranked: bool,
    hint: Mapping[str, Any] | None,
    ends: pd.DataFrame,
    figures: list[go.Figure],
) -> Section:
    """The section of a run's per-layer totals (``summary``), offenders, ``sampled`` steps,
    its scale hint and figures; ``ranked``: the totals are summed over several ranks;
    ``sampled`` None: not counted (the text after says why)."""
    tables: list[tuple[str, pd.DataFrame]] = [
        ("Per-layer totals over sampled steps (gradients unscaled)", summary[_TABLE_COLUMNS])
    ]
    if not offenders.empty:
        tables.append(
            (
                "First offenders per step",
                offenders[["rank", "step", "kind", "module", "module_type"]],
            )
        )
    counted = f"{sampled} sampled step(s)" if sampled is not None else "Sampled steps not counted"
    text = [
        f"{counted}, {summary['module'].nunique()} module(s) recorded.",
        "Totals table, summed over sampled steps"
        + (" and ranks" if ranked else "")
        + f": {_COLUMN_NOTES}",
    ]
    if hint is not None:
        text.append(_hint_text(hint, ends))
    return Section(
        key="numerics", title=_TITLE, figures=tuple(figures), tables=tuple(tables), text=tuple(text)
    )


#: the columns of the ``numerics`` rows a heatmap of a rank per row reads (counts and parts)
_ROW_COLUMNS = (
    "rank, step, module, kind, elements, nan, inf, over_fp16, below_subnormal, in_nonfinite"
)


@dataclasses.dataclass(frozen=True)
class RankNumerics:
    """The per-layer numerics of a run of many ranks as the section draws them, without the
    merged table of every rank's rows: the totals, the scale hint and the exponent histograms
    from the ranks' summaries (exact: :mod:`amprobe.analysis.numerics`), the heatmaps' cells
    from the derived store (:meth:`amprobe.store.run.Run.relation`): when the ranks are
    bucketed, one ``GROUP BY`` per bucket, layer and step (each cell the largest count of the
    bucket's ranks and the rank holding it, as :func:`make_numerics_heatmap_figure` draws a
    frame's), else the rows themselves (a row per rank and layer: at most
    :data:`MAX_HEATMAP_ROWS` of them), drawn as a frame is.

    Attributes:
        layers: rank (ascending) -> its (module, kind) pairs in order of first appearance, the
            ranks with a numerics row only.
        buckets: the ranks sharing a heatmap row (None: a row per rank).
        rows: the recorded rows (a row per rank), None when bucketed or ``unavailable``.
        cells: :func:`~amprobe.analysis.numerics.numerics_cells` of the buckets, None when not
            bucketed or ``unavailable``.
        unavailable: why the derived store could not be read (None: it was).
    """

    layers: dict[int, list[tuple[str, str]]]
    buckets: list[np.ndarray] | None
    rows: pd.DataFrame | None
    cells: pd.DataFrame | None
    unavailable: str | None

    @classmethod
    def of(cls, run: Run) -> RankNumerics:
        """The run's (computed once per run: the section and the dashboard's tab share it)."""
        return run.cached("rank_numerics", cls._read)  # type: ignore[no-any-return]

    @classmethod
    def _read(cls, run: Run) -> RankNumerics:
        summaries = run.summaries()
        layers: dict[int, list[tuple[str, str]]] = {}
        for rank, layer in summary_layers(summaries):
            layers.setdefault(rank, []).append((str(layer["module"]), str(layer["kind"])))
        pairs = dict.fromkeys(p for rank in layers for p in layers[rank])
        buckets = None
        if len(layers) > 1 and len(layers) * max(len(pairs), 1) > MAX_HEATMAP_ROWS:
            buckets = bucket_ranks(list(layers), max(1, MAX_HEATMAP_ROWS // max(len(pairs), 1)))
        rows = cells = None
        try:
            relation = many_relations(run)["numerics"]
            if buckets is None:
                rows = _in_rank_order(
                    relation.query(
                        "s",
                        f"SELECT {_ROW_COLUMNS} FROM s "
                        "WHERE module IS NOT NULL AND kind IS NOT NULL AND step IS NOT NULL",
                    ).df(),
                    layers,
                )
            else:
                cells = _drawn_cells(
                    numerics_cells(
                        relation,
                        list(HEATMAP_METRICS.values()),
                        np.asarray(list(layers), dtype=np.int64),
                        len(buckets[0]),
                        exact=not _no_repeated_rows(summaries),
                    ),
                    layers,
                    buckets,
                )
        except OSError as exc:  # neither the run folder nor the user cache can be written
            return cls(layers, buckets, None, None, f"{type(exc).__name__}: {exc}")
        return cls(layers, buckets, rows, cells, None)

    @property
    def steps_frame(self) -> pd.DataFrame | None:
        """The frame of (module, kind, step) rows the heatmaps draw (rows or cells)."""
        return self.rows if self.buckets is None else self.cells

    def sampled(self) -> list[int]:
        """The sampled steps (of any rank and layer), ascending."""
        frame = self.steps_frame
        return [] if frame is None else sorted({int(s) for s in frame["step"].dropna()})

    def layer_steps(self) -> dict[tuple[str, str], int]:
        """(module, kind) -> its distinct sampled steps over the ranks."""
        frame = self.steps_frame
        if frame is None or frame.empty:
            return {}
        steps = frame.groupby(["module", "kind"], sort=False)["step"].nunique()
        return {(str(m), str(k)): int(n) for (m, k), n in steps.items()}

    def heatmap(
        self,
        metric: str,
        steps: pd.DataFrame | None = None,
        not_checked: Sequence[Mapping[str, Any]] = (),
        max_columns: int = MAX_COLUMNS,
    ) -> go.Figure:
        """:func:`make_numerics_heatmap_figure` of the run's rows, from these cells: the same
        figure (a bucket's cell is the largest count of its ranks, the rank holding it on
        hover, never a sum)."""
        if self.buckets is None or self.cells is None:
            frame = self.rows if self.rows is not None else pd.DataFrame(columns=["rank", "step"])
            return make_numerics_heatmap_figure(frame, metric, steps, not_checked, max_columns)
        column = HEATMAP_METRICS[metric]
        cells = self.cells
        data = cells[["bucket", "code", "step", "n_ranks", "rank", "layer"]].assign(
            value=cells[column].to_numpy(dtype="float64"),
            rank_at=cells[f"{column}_rank"].to_numpy(dtype=np.int64),
        )
        names = [rank_range_text(b) for b in self.buckets]
        missing = _missing_rows(self.layers, not_checked) if not_checked else {}
        return _heatmap_figure(
            column, data, self.sampled(), self.buckets, names, missing, len(self.layers), steps,
            not_checked, max_columns,
        )  # fmt: skip

    def section(self, run: Run) -> Section:
        """The numerics section of ``run`` (the run these are of)."""
        if not self.layers:
            return Section(key="numerics", title=_TITLE, missing=numerics_missing_reason(run))
        summaries = run.summaries()
        histograms = layer_histograms(run)
        keys = section_keys(run, "numerics")
        summary = compute_layer_summary_summaries(summaries, self.layer_steps(), keys)
        ends = summary_step_ends(run) if self.unavailable is None else pd.DataFrame()
        not_checked = run.events_of("numerics_not_checked")
        figures = []
        if self.unavailable is None:
            figures = [self.heatmap(metric, ends, not_checked) for metric in HEATMAP_METRICS]
        layers = worst_layers(None, summary=summary)
        if layers:
            figures.append(
                _exponent_histogram_figure(
                    [(m, k, _figure_binades(histograms.binades((m, k)))) for m, k in layers]
                )
            )
        offenders = pd.DataFrame()
        if self.unavailable is None:
            offenders = (
                many_relations(run)["offenders"]
                .query("s", "SELECT rank, step, kind, module, module_type FROM s")
                .df()
            )
        section = _numerics_section(
            summary,
            offenders,
            len(self.sampled()) if self.unavailable is None else None,
            len(self.layers) > 1,
            compute_scale_hint_summaries(summaries, histograms=histograms, keys=keys),
            ends,
            figures,
        )
        if self.unavailable is None:
            return section
        note = (
            "The per-step heatmaps, the count of sampled steps and the totals' steps column are "
            "read from the run's derived store, which could not be read or written "
            f"({self.unavailable}): not drawn (the totals and histograms are from the ranks' "
            "summaries)."
        )
        return dataclasses.replace(section, text=(*section.text, note))


def _drawn_cells(
    cells: pd.DataFrame, layers: dict[int, list[tuple[str, str]]], buckets: list[np.ndarray]
) -> pd.DataFrame:
    """:func:`~amprobe.analysis.numerics.numerics_cells` as the frame path's bucketed rows
    (:func:`_bucketed`): ``code`` each layer's position in order of first appearance over the
    ranks, ``rank`` the bucket, ``layer`` its label, sorted by bucket, code and step."""
    code_of: dict[str, int] = {}
    for rank in layers:
        for module, kind in layers[rank]:
            code_of.setdefault(f"{module} · {kind}", len(code_of))
    names = [rank_range_text(b) for b in buckets]
    plain = (cells["module"].astype(str) + " · " + cells["kind"].astype(str)).tolist()
    # (a layer the summaries do not hold, in a store built after them, comes last)
    codes = np.array([code_of.setdefault(p, len(code_of)) for p in plain], dtype=np.int64)
    labels = list(code_of)
    out = cells.assign(code=codes).sort_values(
        ["bucket", "code", "step"], kind="stable", ignore_index=True
    )
    label = [
        f"{names[b]} · {labels[c]}"
        for b, c in zip(out["bucket"].tolist(), out["code"].tolist(), strict=True)
    ]
    return out.assign(rank=out["bucket"].to_numpy(dtype=np.int64), layer=label)


def summary_step_ends(run: Run) -> pd.DataFrame:
    """:func:`~amprobe.report.scale.step_ends` of a run of many ranks from its summaries
    (the steps of thousands of ranks are not scanned): per rank its first and last step
    (the ``steps`` section's) and, with the scale after it, its last scaler step (the
    ``scaler`` section's ``last_step`` and ``last_after``: the final scale the loss-scale
    rules read). A rank whose scaler section cannot say (its steps not in order, its last
    scale not a number) is read from the derived store, as ``step_ends`` reads every rank;
    so is every rank when one has no ``steps`` section."""
    rows: list[tuple[int, int, float]] = []
    unsure: list[int] = []
    for rank, summary in sorted(run.summaries().items()):
        steps = summary.get("steps")
        if not isinstance(steps, dict):
            return step_ends(steps_of(run))
        if steps.get("first") is None:
            continue  # no steps row
        rows += [(rank, int(steps["first"]), np.nan), (rank, int(steps["last"]), np.nan)]
        scaler = summary.get("scaler") or {}
        if not scaler.get("n"):
            continue  # no scaler step: no scale recorded
        if scaler.get("ordered") and scaler.get("last_after") is not None:
            rows.append((rank, int(scaler["last_step"]), float(scaler["last_after"])))
        else:
            unsure.append(rank)
    ends = pd.DataFrame(rows, columns=["rank", "step", "scale_after"])
    if unsure:
        relation = steps_of(run)
        if isinstance(relation, pd.DataFrame):  # a run of few ranks: its steps frame
            return step_ends(relation)
        read = relation.query(
            "SELECT rank, max(step) AS step, arg_max(scale_after, step) AS scale_after FROM s "
            f"WHERE scale_after IS NOT NULL AND rank IN ({', '.join(map(str, unsure))}) "
            "GROUP BY rank"
        )
        ends = pd.concat([ends, read], ignore_index=True)
    return ends.sort_values(["rank", "step"], kind="stable", ignore_index=True)


def _figure_binades(binades: dict[int, int]) -> dict[int, int]:
    """A summed histogram's binades as :func:`make_exponent_histogram_figure` keys them: the
    values below 2**-133 at -149 (the summaries key them by their top binade, -134)."""
    return {(-149 if e == HIST_LOW else e): n for e, n in binades.items()}


def _in_rank_order(rows: pd.DataFrame, layers: dict[int, list[tuple[str, str]]]) -> pd.DataFrame:
    """The derived store's rows (by rank and step, rows of one step in file order) with each
    rank's layers in order of first appearance in its file (the summaries' order), as the
    merged table holds them: the rows of a layer stay in step order."""
    if rows.empty:
        return rows
    position = {
        (rank, module, kind): i
        for rank, pairs in layers.items()
        for i, (module, kind) in enumerate(pairs)
    }
    ranks = rows["rank"].to_numpy(dtype=np.int64)
    key = np.array(
        [
            position.get((r, m, k), len(position))
            for r, m, k in zip(ranks.tolist(), rows["module"], rows["kind"], strict=True)
        ],
        dtype=np.int64,
    )
    return rows.iloc[np.lexsort((key, ranks))].reset_index(drop=True)


def _no_repeated_rows(summaries: dict[int, dict[str, Any]]) -> bool:
    """Whether the summaries prove that no rank holds two rows of one (module, kind, step):
    every rank's rows never went down in step (its ``step_facts``' ``ordered``) and each of its
    layers has as many rows as distinct consecutive steps (a repeat would follow its step)."""
    for summary in summaries.values():
        section = summary.get("numerics") or {}
        layers = section.get("layers") or []
        if not layers:
            continue
        facts = section.get("step_facts")
        if not facts or not facts.get("ordered"):
            return False
        if any(layer["rows"] != layer["steps"] for layer in layers):
            return False
    return True


def layer_recorded(run: Run, module: str) -> bool:
    """Whether the run's numerics hold a row of ``module`` (from the summaries at many ranks)."""
    if many_ranks([info.rank for info in run.ranks]):
        return any(str(layer["module"]) == module for _, layer in summary_layers(run.summaries()))
    numerics = run.table("numerics")
    return "module" in numerics and bool((numerics["module"].astype(str) == module).any())
