"""Runtime section: step time, data wait and GPU utilization over time; syncs by source line."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from amprobe.analysis.rankbands import CHUNK_ROWS, StepsRelation
from amprobe.analysis.runtime import compute_sync_sites, gpu_unavailable_reason
from amprobe.report.downsample import downsample
from amprobe.report.registry import Section, section
from amprobe.report.scale import (
    add_rank_bands,
    bands_note,
    has_values,
    many_ranks,
    many_relations,
    run_ranks,
    steps_relation,
)

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from amprobe.rules.engine import Diagnosis
    from amprobe.store.loader import Run


__all__ = ["make_runtime_figure", "make_sync_table", "make_phase_table"]


def make_runtime_figure(
    steps: pd.DataFrame | StepsRelation, gpu: pd.DataFrame | StepsRelation
) -> go.Figure:
    """Step time and data wait per step (ms, top); GPU and Tensor Core utilization (%, bottom).

    Args:
        steps: the ``steps`` frame (``rank``, ``step``, ``wall_s``, ``data_wait_s``).
        gpu: the ``gpu`` frame (``rank``, ``step``, ``t``, ``gpu``, ``gpu_util``, ``tensor_any``);
            may be empty, then the GPU panel is left out (the section says why). A run of
            many ranks gives both as :class:`~amprobe.analysis.rankbands.StepsRelation`
            (bands reduced in DuckDB).
    """
    import plotly.graph_objects as go  # plotly loads only when a figure is made
    from plotly.subplots import make_subplots

    has_gpu = gpu.has("step") if isinstance(gpu, StepsRelation) else bool(len(gpu))
    fig = make_subplots(
        rows=2 if has_gpu else 1,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.1,
        subplot_titles=("step time and data wait (ms)", "GPU utilization (%)")[
            : 2 if has_gpu else 1
        ],
        row_heights=[0.55, 0.45] if has_gpu else None,
    )
    ranks = run_ranks(steps)
    if many_ranks(ranks) or isinstance(steps, StepsRelation):
        _runtime_bands(fig, steps, gpu, ranks, has_gpu)
        return fig
    assert isinstance(steps, pd.DataFrame) and isinstance(gpu, pd.DataFrame)
    multi = steps["rank"].nunique() > 1 if len(steps) else False
    for rank, part in steps.groupby("rank", sort=True):
        part = downsample(part.sort_values("step"))
        suffix = f" r{rank}" if multi else ""
        fig.add_trace(
            go.Scatter(
                x=part["step"], y=part["wall_s"] * 1e3, mode="lines", name=f"step time{suffix}"
            ),
            row=1,
            col=1,
        )
        if part["data_wait_s"].notna().any():
            fig.add_trace(
                go.Scatter(
                    x=part["step"],
                    y=part["data_wait_s"] * 1e3,
                    mode="lines",
                    name=f"data wait{suffix}",
                    fill="tozeroy",
                ),
                row=1,
                col=1,
            )
    if len(gpu):
        for (rank, index), part in gpu.groupby(["rank", "gpu"], sort=True):
            part = part.sort_values("t")
            # samples carry the step in progress; spread them evenly within it for the x axis
            x = part["step"] + part.groupby("step").cumcount() / part.groupby("step")[
                "t"
            ].transform("size")
            suffix = f" r{rank} gpu{index}" if multi or gpu["gpu"].nunique() > 1 else ""
            shown = downsample(part.assign(x=x))
            fig.add_trace(
                go.Scatter(
                    x=shown["x"], y=shown["gpu_util"], mode="lines", name=f"GPU util{suffix}"
                ),
                row=2,
                col=1,
            )
            if shown["tensor_any"].notna().any():
                fig.add_trace(
                    go.Scatter(
                        x=shown["x"],
                        y=shown["tensor_any"],
                        mode="lines",
                        name=f"Tensor Core activity{suffix}",
                    ),
                    row=2,
                    col=1,
                )
    if has_gpu:
        fig.update_yaxes(range=[0, 100], row=2, col=1)
    fig.update_xaxes(title_text="step", row=2 if has_gpu else 1, col=1)
    fig.update_layout(
        height=480 if has_gpu else 300,
        margin={"l": 50, "r": 20, "t": 40, "b": 40},
        legend={"orientation": "h", "y": -0.15},
    )
    return fig


def _runtime_bands(
    fig: go.Figure,
    steps: pd.DataFrame | StepsRelation,
    gpu: pd.DataFrame | StepsRelation,
    ranks: list[int],
    has_gpu: bool,
) -> None:
    """:func:`make_runtime_figure` for many ranks: step time and data wait (each rank's median
    in a bin), GPU and Tensor Core utilization (each rank's mean in a bin, its GPUs together)
    as bands across ranks, the outlier ranks drawn alone."""
    notes = []
    bands = add_rank_bands(
        fig, steps, "wall_s", "step time (ms)", lambda r: f"step time r{r}", ranks, 1, scale=1e3
    )
    notes.append(bands_note("step time", bands))
    if has_values(steps, "data_wait_s"):
        bands = add_rank_bands(
            fig, steps, "data_wait_s", "data wait (ms)", lambda r: f"data wait r{r}", ranks, 1, 1e3
        )
        notes.append(bands_note("data wait", bands))
    if has_gpu:
        for column, label in (("gpu_util", "GPU util"), ("tensor_any", "Tensor Core activity")):
            if has_values(gpu, column):
                bands = add_rank_bands(
                    fig, gpu, column, label, lambda r, lb=label: f"{lb} r{r}", ranks, 2
                )
                notes.append(bands_note(label, bands))
        fig.update_yaxes(range=[0, 100], row=2, col=1)
    fig.update_xaxes(title_text="step", row=2 if has_gpu else 1, col=1)
    fig.update_layout(
        height=(520 if has_gpu else 340) + 14 * len(notes),
        title={"text": "<br>".join(notes), "font": {"size": 11}},
        margin={"l": 50, "r": 20, "t": 60 + 16 * len(notes), "b": 40},
        legend={"orientation": "h", "y": -0.15},
    )


def make_sync_table(steps: pd.DataFrame | StepsRelation, syncs: pd.DataFrame) -> pd.DataFrame:
    """Syncs per sampled step by source line, op and kind (user first), all ranks together."""
    sampled = _sync_sampled(steps)
    parts = []
    for kind in ("user", "scaler", "optimizer", "dataloader"):
        frame = compute_sync_sites(syncs, sampled, kind=kind)
        if len(frame):
            parts.append(frame.assign(kind=kind))
    if not parts:
        return pd.DataFrame(columns=["site", "op", "kind", "per_step", "total"])
    return pd.concat(parts, ignore_index=True)[["site", "op", "kind", "per_step", "total"]]


def _sync_sampled(steps: pd.DataFrame | StepsRelation) -> int:
    """Rows (rank-steps) whose syncs were counted."""
    if isinstance(steps, StepsRelation):
        frame = steps.query("SELECT count(*) AS n FROM s WHERE coalesce(syncs_sampled, false)")
        return int(frame["n"].iloc[0])
    return int(steps["syncs_sampled"].fillna(False).astype(bool).sum()) if len(steps) else 0


#: the parts of a step in the phase table: column -> its name
_PHASES = {
    "wall_s": "step",
    "data_wait_s": "data wait",
    "fwd_s": "forward",
    "bwd_s": "backward",
    "opt_s": "optimizer",
}


def _phase_table_sql(steps: StepsRelation) -> pd.DataFrame:
    """:func:`make_phase_table` of a run of many ranks' derived store: each part's median
    over the rows not sync-sampled (all rows when every row is), exact (DuckDB's
    ``median``, the mean of the two middle values). On a run of more than
    :data:`~amprobe.analysis.rankbands.CHUNK_ROWS` rows each column is read alone and its
    median selected in numpy: DuckDB keeps every value of a median, which at 41 M rows x 5
    columns ran out of its memory limit."""
    plain = "NOT coalesce(syncs_sampled, false)"
    counts = ", ".join(f'count("{c}") AS "n_{c}"' for c in _PHASES)
    rows_sql = f"SELECT count(*) FILTER (WHERE {plain}) AS plain, count(*) AS n, {counts} FROM s"

    def compute() -> pd.DataFrame:
        sizes = steps.query(rows_sql).iloc[0]
        where = plain if sizes["plain"] > 0 else "TRUE"
        if int(sizes["n"]) <= CHUNK_ROWS:
            medians = ", ".join(f'median("{c}") AS "{c}", count("{c}") AS "n_{c}"' for c in _PHASES)
            return steps.query(
                f"SELECT {medians} FROM s WHERE {plain} OR NOT EXISTS (SELECT 1 FROM s WHERE {plain})"
            )
        out: dict[str, list[Any]] = {}
        for column in _PHASES:
            rel = steps.relation.filter(f"({steps.where}) AND ({where})")
            values = rel.filter(f'"{column}" IS NOT NULL').project(f'"{column}"::DOUBLE AS v')
            table = values.to_arrow_table()
            array = table["v"].to_numpy()
            del table  # the array is a copy when the column came in several chunks
            out[column] = [_median(array)]
            out[f"n_{column}"] = [len(array)]
            del array
        return pd.DataFrame(out)

    row = steps.result(("query", steps.where, "phase medians " + rows_sql), compute).iloc[0]
    rows = [
        {"part": label, "median_ms": float(row[col]) * 1e3}
        for col, label in _PHASES.items()
        if row[f"n_{col}"] > 0
    ]
    return pd.DataFrame(rows, columns=["part", "median_ms"])


def _median(values: np.ndarray) -> float:
    """DuckDB's ``median`` of ``values`` (not null; NaN sorts above every number): the middle
    value, or the mean of the two middle values ``(lo + hi) / 2``; NaN when there is none.
    ``values`` is reordered (partitioned) when it can be written."""
    n = len(values)
    if not n:
        return float("nan")
    if not values.flags.writeable or values.dtype != np.float64:
        values = np.array(values, dtype="float64")  # partitioned in place below
    hi_at, lo_at = n // 2, (n - 1) // 2
    values.partition([lo_at, hi_at] if lo_at != hi_at else hi_at)
    lo, hi = float(values[lo_at]), float(values[hi_at])
    return lo if lo_at == hi_at else (lo + hi) / 2


def make_phase_table(steps: pd.DataFrame | StepsRelation) -> pd.DataFrame:
    """Median seconds per step of each part of the step (host clock)."""
    if isinstance(steps, StepsRelation):
        return _phase_table_sql(steps)
    cols = _PHASES
    plain = steps[~steps["syncs_sampled"].fillna(False).astype(bool)] if len(steps) else steps
    plain = plain if len(plain) else steps
    rows = [
        {"part": label, "median_ms": float(plain[col].median()) * 1e3}
        for col, label in cols.items()
        if col in plain and plain[col].notna().any()
    ]
    return pd.DataFrame(rows, columns=["part", "median_ms"])


def _build_runtime_section_many(run: Run, steps: StepsRelation, title: str) -> Section:
    """:func:`build_runtime_section` of a run of many ranks, from its derived store: the
    figure's bands and the phase medians in DuckDB; the syncs (a few rows per sampled step)
    read from their derived table, not from every rank's file."""
    if not steps.has("data_wait_s"):
        return Section(
            "runtime",
            title,
            missing="step timing was not recorded (enable the 'runtime' collector)",
        )
    rels = many_relations(run)
    gpu = StepsRelation(rels["gpu"])
    syncs = (lambda: rels["syncs"].df()) if _sync_sampled(steps) else None
    return _runtime_section(run, title, steps, gpu, syncs)


def _runtime_section(
    run: Run,
    title: str,
    steps: Any,
    gpu: Any,
    syncs: Callable[[], pd.DataFrame] | None,
) -> Section:
    """The runtime section of ``steps`` (a frame, or a relation of many ranks) and ``gpu``;
    ``syncs`` reads the syncs table, None when no step was sync-sampled."""
    text = []
    reason = gpu_unavailable_reason(run)
    if reason:
        text.append(f"GPU utilization not recorded: {reason}.")
    tables: list[tuple[str, pd.DataFrame]] = [
        ("Median time per step (host clock)", make_phase_table(steps))
    ]
    if syncs is not None:
        rows = syncs()
        tables.append((_sync_caption(rows), make_sync_table(steps, rows)))
    else:
        text.append("Host-device syncs were not counted (syncs_every=0 or no sampled step).")
    return Section(
        "runtime",
        title,
        figures=(make_runtime_figure(steps, gpu),),
        tables=tuple(tables),
        text=tuple(text),
    )


def _sync_caption(syncs: pd.DataFrame) -> str:
    device_types = set(syncs["device"].dropna()) if len(syncs) else set()
    caption = "Host-device syncs per sampled step by source line"
    if device_types and device_types <= {"cpu"}:
        caption += (
            " (CPU run: these would synchronize on a GPU; counted on tensors derived from "
            "the model's parameters, outputs or loss)"
        )
    return caption


@section("runtime", order=40, tab="Utilization")
def build_runtime_section(run: Run, diagnosis: Diagnosis) -> Section:
    title = "Runtime: step time, data loading, syncs, GPU"
    many = steps_relation(run)
    if many is not None:
        return _build_runtime_section_many(run, many, title)
    steps = run.steps
    if steps.empty or not steps["data_wait_s"].notna().any():
        return Section(
            "runtime",
            title,
            missing="step timing was not recorded (enable the 'runtime' collector)",
        )
    sampled = steps["syncs_sampled"].fillna(False).astype(bool).any()
    syncs = (lambda: run.table("syncs")) if sampled else None
    return _runtime_section(run, title, steps, run.table("gpu"), syncs)
