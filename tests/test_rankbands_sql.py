"""Band matrices of many ranks reduced in the derived store's DuckDB equal those from frames.

A 12-rank x 300-step run written by amprobe's writer (rank 5 twice as slow, rank 9's scale
halved for one step, rank 3 with a NaN loss stretch and missing steps): for every series and
reducer the rank x bin matrix, the bins, the bands and the named ranks from
:class:`~amprobe.analysis.rankbands.StepsRelation` are those of the merged frame.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import amprobe
from amprobe.analysis.rankbands import StepsRelation, compute_rank_bands, rule_for
from amprobe.store.writer import RunWriter

RANKS, STEPS = 12, 300


def _write(root: Path) -> Path:
    rng = np.random.default_rng(1)
    for rank in range(RANKS):
        writer = RunWriter(root, rank, RANKS, {"device": "cpu"}, max_buffered_rows=100_000)
        rows = []
        for step in range(STEPS):
            if rank == 3 and 100 <= step < 110:
                continue  # steps this rank did not record
            scale = 32768.0 if (rank == 9 and step == 150) else 65536.0
            loss = float("nan") if (rank == 3 and 200 <= step < 205) else 2 - step / STEPS
            rows.append(
                {
                    "step": step,
                    "wall_s": 0.01 * (2 if rank == 5 else 1) * (1 + 0.1 * rng.random()),
                    "data_wait_s": 1e-3 * rng.random(),
                    "scaler_enabled": True,
                    "scale_before": scale,
                    "scale_after": scale,
                    "skipped": False,
                    "loss": loss + 0.01 * rng.standard_normal(),
                    "loss_nonfinite": bool(np.isnan(loss)),
                }
            )
        writer.append("steps", rows)
        writer.close({"status": "finished", "steps": len(rows)})
    return root


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> amprobe.Run:
    root = tmp_path_factory.mktemp("many")
    cache = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(cache))
    yield amprobe.load_run(_write(root / "run"))
    mp.undo()


@pytest.mark.parametrize("max_bins", [1000, 37])
@pytest.mark.parametrize(
    "column,reduce",
    [
        ("wall_s", "median"),
        ("wall_s", "max"),
        ("scale_before", "min"),
        ("loss", "mean"),
        ("data_wait_s", "last"),
    ],
)
def test_matrix_from_duckdb_equals_the_frames(
    run: amprobe.Run, column: str, reduce: str, max_bins: int
) -> None:
    rule = rule_for(column)
    rule = type(rule)(rule.ratio, rule.floor, rule.min_share, rule.max_named, reduce)
    frame = compute_rank_bands(run.steps, column, max_bins=max_bins, rule=rule)
    sql = compute_rank_bands(
        StepsRelation(run.relation("steps")), column, max_bins=max_bins, rule=rule
    )
    assert len(sql.bins) == len(frame.bins) == (STEPS if max_bins > STEPS else 34)
    assert np.array_equal(sql.bins.first, frame.bins.first)
    assert np.array_equal(sql.bins.last, frame.bins.last)
    assert np.array_equal(sql.ranks, np.arange(RANKS))
    assert sql.values.shape == (RANKS, len(frame.bins))
    np.testing.assert_allclose(sql.values, frame.values, rtol=1e-12, equal_nan=True)
    for edge in ("low", "p10", "median", "p90", "high"):
        np.testing.assert_allclose(getattr(sql, edge), getattr(frame, edge), rtol=1e-12)
    assert [o.rank for o in sql.outliers] == [o.rank for o in frame.outliers]
    if max_bins > STEPS:  # one step a bin: rank 3's unrecorded steps are empty cells
        assert np.isnan(sql.values[3, 100:110]).all()
        assert np.isfinite(sql.values[3, 110:200]).all()


@pytest.mark.parametrize("max_bins", [150, 60, 40])
def test_sparse_steps_bin_as_on_frames(run: amprobe.Run, max_bins: int) -> None:
    """Every third step only: 100 distinct steps over 298, one bin each when they fit (the
    engine's bin width from the first and last step is not taken as proof then)."""
    frame = run.steps[run.steps["step"] % 3 == 0]
    rel = StepsRelation(run.relation("steps")).filtered("step % 3 = 0")
    a = compute_rank_bands(frame, "wall_s", max_bins=max_bins)
    b = compute_rank_bands(rel, "wall_s", max_bins=max_bins)
    assert a.bins.single == (max_bins >= 100) == b.bins.single
    assert np.array_equal(a.bins.first, b.bins.first)
    assert np.array_equal(a.bins.last, b.bins.last)
    np.testing.assert_allclose(b.values, a.values, rtol=1e-12, equal_nan=True)


def test_outliers_named_from_duckdb(run: amprobe.Run) -> None:
    rel = StepsRelation(run.relation("steps"))
    assert [o.rank for o in compute_rank_bands(rel, "wall_s").outliers] == [5]
    assert [o.rank for o in compute_rank_bands(rel, "scale_before").outliers] == [9]
    assert rel.has("loss") and not rel.has("probe_s")
    assert list(rel.filtered("rank < 4").ranks) == [0, 1, 2, 3]


def test_figures_from_the_store_equal_those_from_frames(run: amprobe.Run) -> None:
    """The report's figures of a run of many ranks drawn from the derived store are those
    drawn from the merged frame, to the byte of their JSON (bands, named ranks, NaN-loss
    shading, skipped-step and scale-change markers, the rank x step heatmap)."""
    from amprobe.report.ranks import (
        compute_rank_summary,
        make_rank_heatmap_figure,
        make_ranks_figure,
    )
    from amprobe.report.runtime import make_phase_table, make_runtime_figure
    from amprobe.report.scale import make_loss_scale_figure, steps_relation
    from dashboard.figures import make_step_time_figure

    rel = steps_relation(run)
    assert rel is not None and list(rel.ranks) == list(range(RANKS))
    frame = run.steps
    pairs = [
        (make_loss_scale_figure(frame), make_loss_scale_figure(rel)),
        (make_ranks_figure(frame), make_ranks_figure(rel)),
        (make_rank_heatmap_figure(frame, "wall_s"), make_rank_heatmap_figure(rel, "wall_s")),
        (
            make_runtime_figure(frame, frame.iloc[:0]),
            make_runtime_figure(rel, rel.filtered("FALSE")),
        ),
        (make_step_time_figure(frame), make_step_time_figure(rel)),
    ]
    for a, b in pairs:
        assert a.to_json() == b.to_json()
    assert "loss NaN" in pairs[0][1].to_json()
    assert compute_rank_summary(frame).equals(compute_rank_summary(rel))
    assert make_phase_table(frame).equals(make_phase_table(rel))
