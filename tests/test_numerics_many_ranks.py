"""The numerics and what-if sections of a run of many ranks show what the merged table shows.

A run of more than 8 ranks is drawn from its summaries and its derived store (the report and
the dashboard never read every rank's ``numerics`` rows there). Runs of 9 to 16 ranks are
written by amprobe's writer from ``sample_runs/overflow``'s rows, the ranks made to differ
(counts scaled per rank, a spike on one rank, a step one rank did not sample, a row another
dropped, a count not recorded, a rank without numerics, a layer not measured on one rank);
each figure is drawn both ways, from the merged table (as a run of few ranks is) and from the
summaries, and must be the same figure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import amprobe
from amprobe.analysis.frames import section_keys
from amprobe.analysis.numerics import (
    HIST_HIGH,
    HIST_LOW,
    compute_layer_histograms,
    compute_layer_summary,
    compute_layer_summary_summaries,
    compute_scale_hint,
    compute_scale_hint_summaries,
    layer_histograms,
)
from amprobe.analysis.whatif import _E_LO, _FINITE, compute_whatif
from amprobe.report.numerics import (
    HEATMAP_METRICS,
    RankNumerics,
    build_numerics_section,
    layer_recorded,
    make_exponent_histogram_figure,
    make_numerics_heatmap_figure,
    worst_layers,
)
from amprobe.report.scale import step_ends, steps_of
from amprobe.report.whatif import (
    HEATMAP_GROUPS,
    build_whatif_section,
    heatmap_groups,
    make_exponent_heatmap,
    make_run_exponent_heatmap,
)
from amprobe.store.writer import RunWriter
from tests.helpers import recorded_rows

SOURCE = Path(__file__).resolve().parent.parent / "sample_runs" / "overflow"
COUNTS = ("nan", "inf", "over_fp16", "below_subnormal")


def write_ranks(root: Path, ranks: int, repeat: bool = False) -> Path:
    """``sample_runs/overflow`` as ``ranks`` ranks of one run (see the module docstring);
    ``repeat``: rank 2 writes one of its rows twice (a retried write)."""
    steps = recorded_rows(SOURCE, "steps")
    # the first 10 sampled steps: step 0 and the overflow's first (NaN gradients, offenders)
    sampled = sorted({r["step"] for r in recorded_rows(SOURCE, "numerics")})[:10]
    numerics = [r for r in recorded_rows(SOURCE, "numerics") if r["step"] in sampled]
    offenders = [r for r in recorded_rows(SOURCE, "offenders") if r["step"] <= sampled[-1]]
    first, spike = sampled[0], sampled[5]
    for rank in range(ranks):
        writer = RunWriter(root, rank, ranks, {"device": "cpu"}, max_buffered_rows=100_000)
        writer.append("steps", steps)
        rows = []
        for i, r in enumerate(numerics):
            row = {**r, **{c: r[c] * (1 + rank % 3) for c in COUNTS}}
            if rank == 5 and r["step"] == spike and r["kind"] == "output":
                row["nan"] += 1000  # one rank's spike: its bucket's cell, never summed
            if rank == 1 and r["step"] == first:
                continue  # rank 1 did not sample the first step
            if rank == 3 and i == 40:
                continue  # a layer without a row at one sampled step
            if rank == 6 and i == 30:
                row["inf"] = None  # a count not recorded
            if rank == 4 and r["kind"] == "output" and i < 20:
                row["in_nonfinite"] = None  # inputs not read
            rows.append(row)
            if repeat and rank == 2 and i == 50:
                rows.append(row)
        if rank != 7:  # rank 7 records no numerics
            writer.append("numerics", rows)
            writer.append("offenders", offenders[rank % 3 :])
        if rank == 2:
            detail = {"what": "subclass_tensors", "first_at": "ghost", "reason": "a subclass"}
            writer.append(
                "events",
                [
                    {
                        "step": 0,
                        "t": 0.0,
                        "kind": "numerics_not_checked",
                        "detail": json.dumps(detail),
                    }
                ],
            )
        writer.close({"status": "finished", "steps": len(steps)})
    return root


@pytest.fixture(scope="module", params=[12, 16], ids=["12-ranks", "16-ranks-bucketed"])
def many(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp(f"ranks{request.param}") / "run"
    return amprobe.load_run(write_ranks(root, request.param))


def _same(a: Any, b: Any) -> None:
    assert json.loads(a.to_json()) == json.loads(b.to_json())


def test_the_heatmaps_are_the_merged_tables(many: Any) -> None:
    numerics = many.table("numerics")
    ends = step_ends(steps_of(many))
    not_checked = many.events_of("numerics_not_checked")
    cells = RankNumerics.of(many)
    bucketed = len(many.ranks) == 16
    assert (cells.buckets is not None) == bucketed
    for metric in HEATMAP_METRICS:
        frame_fig = make_numerics_heatmap_figure(numerics, metric, ends, not_checked)
        _same(cells.heatmap(metric, ends, not_checked), frame_fig)
    fig = cells.heatmap("nonfinite", ends, not_checked)
    trace = next(t for t in fig.data if t.name == "nonfinite")
    z = np.asarray(trace.z, dtype=float)
    assert np.nanmax(z) >= 1000  # rank 5's spike, never averaged away
    # the layer rank 2 could not measure: a row of its own (its bucket's when bucketed)
    ghost = [y for y in trace.y if "ghost" in y]
    assert ghost == [("r2\u20133" if bucketed else "r2") + " \u00b7 ghost \u00b7 (not measured)"]


def test_the_totals_hint_and_histograms_are_the_merged_tables(many: Any) -> None:
    numerics = many.table("numerics")
    summaries = many.summaries()
    frame_summary = compute_layer_summary(numerics)
    steps = numerics.groupby(["module", "kind"])["step"].nunique().to_dict()
    assert RankNumerics.of(many).layer_steps() == steps
    from_summaries = compute_layer_summary_summaries(summaries, steps)
    assert list(from_summaries.columns) == list(frame_summary.columns)
    for column in frame_summary.columns:
        assert from_summaries[column].tolist() == frame_summary[column].tolist(), column
    assert compute_scale_hint_summaries(summaries) == compute_scale_hint(numerics)
    layers = worst_layers(numerics)
    assert layers == worst_layers(None, summary=from_summaries)
    section = build_numerics_section(many, None)
    _same(section.figures[-1], make_exponent_histogram_figure(numerics, layers))
    assert section.text[0].startswith(f"{numerics['step'].nunique()} sampled step(s)")
    assert "summed over sampled steps and ranks" in section.text[1]
    assert layer_recorded(many, "ghost") is False and layer_recorded(many, layers[0][0])


def test_the_whatif_heatmaps_are_the_merged_tables(many: Any) -> None:
    numerics = many.table("numerics")
    whatif = compute_whatif(many)
    assert heatmap_groups(many) == list(HEATMAP_GROUPS)
    for group in HEATMAP_GROUPS:
        _same(
            make_run_exponent_heatmap(many, group, whatif),
            make_exponent_heatmap(numerics, group, whatif),
        )
    section = build_whatif_section(many, None)
    assert len(section.figures) == 2 and not section.missing


def test_repeated_rows_are_summed_as_the_merged_table_sums_them(tmp_path: Path) -> None:
    """A rank that wrote one row twice: the summaries cannot prove each cell one row, so the
    cells are summed per rank first (as the table's are), then the largest rank taken."""
    run = amprobe.load_run(write_ranks(tmp_path / "run", 16, repeat=True))
    numerics = run.table("numerics")
    cells = RankNumerics.of(run)
    assert cells.buckets is not None
    ends = step_ends(steps_of(run))
    for metric in HEATMAP_METRICS:
        _same(cells.heatmap(metric, ends), make_numerics_heatmap_figure(numerics, metric, ends))


def test_the_histogram_columns_are_the_whatif_columns() -> None:
    """compute_exponent_shares_summaries reads LayerHistograms' columns as the what-if's."""
    assert (HIST_LOW, HIST_HIGH - HIST_LOW + 1) == (_E_LO, _FINITE)


def test_the_sections_read_no_merged_table(many: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """At many ranks the sections never build the merged numerics table."""
    fresh = amprobe.load_run(many.path)
    read = []
    original = type(fresh).table

    def table(self: Any, name: str) -> Any:
        read.append(name)
        return original(self, name)

    monkeypatch.setattr(type(fresh), "table", table)
    assert build_numerics_section(fresh, None).figures
    assert build_whatif_section(fresh, None).figures
    assert layer_histograms(fresh).keys
    assert "numerics" not in read


def test_equal_sections_are_read_once_and_weighted(many: Any) -> None:
    """Classes of ranks with equal numerics sections, read once and weighted by their size,
    give what every rank read alone gives."""
    summaries = many.summaries()
    keys = section_keys(many, "numerics")
    assert len(set(keys.values())) < len(keys)  # some ranks share their section
    alone, once = compute_layer_histograms(summaries), compute_layer_histograms(summaries, keys)
    assert alone.keys == once.keys
    assert (alone.counts == once.counts).all() and (alone.wide == once.wide).all()
    steps = RankNumerics.of(many).layer_steps()
    assert compute_layer_summary_summaries(summaries, steps).equals(
        compute_layer_summary_summaries(summaries, steps, keys)
    )
    assert compute_scale_hint_summaries(summaries) == compute_scale_hint_summaries(
        summaries, keys=keys
    )


def test_without_the_derived_store_the_sections_say_what_is_not_drawn(
    many: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that can be neither read nor written (a read-only run, no writable cache):
    the totals, hint and histograms still come from the summaries, the section says which
    parts are not drawn and why, and the merged table is not read instead."""
    fresh = amprobe.load_run(many.path)

    def no_store(self: Any, name: str) -> Any:
        raise OSError("read-only file system")

    table = type(fresh).table

    def no_table(self: Any, name: str) -> Any:
        assert name != "numerics", "read the merged numerics table"
        return table(self, name)

    import amprobe.store.derived as derived

    monkeypatch.setattr(type(fresh), "relation", no_store)
    monkeypatch.setattr(derived, "ensure", no_store)
    monkeypatch.setattr(type(fresh), "table", no_table)
    section = build_numerics_section(fresh, None)
    assert not section.missing and len(section.figures) == 1  # the exponent histogram
    assert "read-only file system" in section.text[-1] and "not drawn" in section.text[-1]
    assert section.tables[0][1]["steps"].isna().all()  # not known, never 0
    assert section.text[0].startswith("Sampled steps not counted")
    fig = make_run_exponent_heatmap(fresh, "activations")
    assert "not named: the derived store could not be read" in fig.layout.title.text
