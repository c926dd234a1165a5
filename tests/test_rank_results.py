"""Band matrices and per-rank queries of many ranks by blocks of ranks, kept next to the store.

At 4,096 ranks x 10,000 steps one ``GROUP BY rank, bin`` query with a median ran out of
DuckDB's memory limit, and each report scanned the 41 M rows again. Here (12 ranks x 300
steps, the blocks made small): a query by blocks of ranks gives the frame of one query, the
phase medians taken in numpy are DuckDB's, and a second load of the run reads the sections'
results from the :class:`~amprobe.analysis.rankbands.ResultStore` (no query runs) and draws
the same figures; a rebuilt store is not read from the earlier results.
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import pytest

import amprobe
import amprobe.analysis.rankbands as rankbands
import amprobe.report.runtime as runtime
from amprobe.analysis.rankbands import ResultStore, StepsRelation
from amprobe.report.runtime import build_runtime_section
from amprobe.report.scale import RANK_STATS_SQL, build_scale_section
from amprobe.store import derived
from amprobe.store.writer import RunWriter

RANKS, STEPS = 12, 300


def _write(root: Path) -> Path:
    rng = np.random.default_rng(2)
    for rank in range(RANKS):
        writer = RunWriter(root, rank, RANKS, {"device": "cpu"}, max_buffered_rows=100_000)
        rows = []
        for step in range(STEPS):
            if rank == 3 and 100 <= step < 110:
                continue
            scale = 32768.0 if (rank == 9 and step >= 150) else 65536.0
            rows.append(
                {
                    "step": step,
                    "wall_s": 0.01 * (2 if rank == 5 else 1) * (1 + 0.1 * rng.random()),
                    "data_wait_s": 1e-3 * rng.random(),
                    "fwd_s": 3e-3 * rng.random(),
                    "scaler_enabled": True,
                    "scale_before": 65536.0 if (rank == 9 and step == 150) else scale,
                    "scale_after": scale,
                    "skipped": rank == 9 and step == 150,
                    "loss": 2 - step / STEPS + 0.01 * rng.standard_normal(),
                    "syncs_sampled": step % 50 == 0,
                }
            )
        writer.append("steps", rows)
        writer.close({"status": "finished", "steps": len(rows)})
    return root


@pytest.fixture()
def path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return _write(tmp_path / "run")


def _sections(run: amprobe.Run) -> str:
    diagnosis = amprobe.diagnose(run)
    out = []
    for section in (build_scale_section(run, diagnosis), build_runtime_section(run, diagnosis)):
        out.append([f.to_json() for f in section.figures])
        out.append([(c, t.to_json()) for c, t in section.tables])
        out.append(list(section.text))
    return json.dumps(out)


def test_blocks_of_ranks_give_the_frame_of_one_query(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = amprobe.load_run(path)
    whole = StepsRelation(run.relation("steps"))
    one = {
        (c, r): whole.rank_bin_matrix(c, 37, r)
        for c, r in (("wall_s", "median"), ("loss", "mean"), ("scale_before", "min"))
    }
    stats = whole.query(RANK_STATS_SQL)
    monkeypatch.setattr(rankbands, "CHUNK_ROWS", 700)  # 2 to 3 ranks a block
    blocks = StepsRelation(run.relation("steps"))
    assert len(blocks._rank_blocks()) >= 4
    for (column, reduce), (bins, ranks, matrix) in one.items():
        got_bins, got_ranks, got = blocks.rank_bin_matrix(column, 37, reduce)
        assert np.array_equal(got_bins.first, bins.first)
        assert np.array_equal(got_bins.last, bins.last)
        assert np.array_equal(got_ranks, ranks)
        assert np.array_equal(got, matrix, equal_nan=True), column
    assert blocks.query_by_rank(RANK_STATS_SQL).equals(stats)


def test_median_is_duckdbs() -> None:
    rng = np.random.default_rng(0)
    con = duckdb.connect()
    for n in (1, 2, 3, 10, 11, 1000, 1001):
        values = rng.standard_normal(n) * 1e-3
        if n > 3:
            values[::7] = np.nan  # NaN sorts above every number in both
        want = con.execute(
            "SELECT median(x) FROM (SELECT unnest($1::DOUBLE[]) AS x)", [values.tolist()]
        ).fetchone()[0]
        got = runtime._median(values.copy())
        assert (np.isnan(got) and np.isnan(want)) or got == want, n


def test_phase_medians_by_column_equal_duckdbs(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = amprobe.load_run(path)
    want = runtime.make_phase_table(StepsRelation(run.relation("steps")))
    monkeypatch.setattr(runtime, "CHUNK_ROWS", 100)
    got = runtime.make_phase_table(StepsRelation(run.relation("steps")))
    assert list(got["part"]) == ["step", "data wait", "forward"]
    assert got.equals(want)


def test_a_second_report_reads_the_kept_results(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _sections(amprobe.load_run(path))
    kept = list((path / derived.DERIVED_DIR / derived.RESULTS_DIR).glob("steps-*/*"))
    assert any(p.suffix == ".npz" for p in kept) and any(p.suffix == ".parquet" for p in kept)

    real = StepsRelation._run

    def no_query(self: StepsRelation, sql: str, where: str) -> object:
        # the steps' results are kept; the gpu table (a few rows a step) is queried as before
        assert self.store is None, f"a kept result was queried again: {sql}"
        return real(self, sql, where)

    with monkeypatch.context() as m:
        m.setattr(StepsRelation, "_run", no_query)
        assert _sections(amprobe.load_run(path)) == first

    # a rebuilt store (a rank's file grew): a new folder, the earlier results removed
    with open(path / "rank0" / "steps.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 400, "window": 0, "wall_s": 5.0}) + "\n")
    run = amprobe.load_run(path)
    again = _sections(run)
    assert again != first  # step 400 is drawn
    folders = list((path / derived.DERIVED_DIR / derived.RESULTS_DIR).iterdir())
    assert len(folders) == 1 and not any(p in kept for p in folders[0].iterdir())


def test_a_result_of_another_key_is_not_read(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "results")
    key = ("matrix", "TRUE", "wall_s", 1000, "median")
    bins = rankbands.StepBins(np.array([0, 5]), np.array([4, 9]))
    store.save(key, (bins, np.array([0, 1]), np.array([[1.0, np.nan], [2.0, 3.0]])))
    got = store.load(key)
    assert got is not None and np.array_equal(got[2], [[1.0, np.nan], [2.0, 3.0]], equal_nan=True)
    other = ("matrix", "TRUE", "wall_s", 1000, "mean")
    store._path(key, ".npz").rename(store._path(other, ".npz"))  # a file under another name
    assert store.load(other) is None and store.load(key) is None
    store._path(other, ".npz").write_bytes(b"not a file")  # unreadable: computed again
    assert store.load(other) is None


def test_results_kept_by_other_code_are_not_read(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kept results are named after the code that computed them, not only the version: a
    development tree changes its figures' code without a new version."""
    amprobe.load_run(path).relation("steps")
    store = derived.ensure(amprobe.load_run(path))
    before = derived.results_dir(store)
    monkeypatch.setattr(derived, "code_fingerprint", lambda: "another-code-0000000")
    after = derived.results_dir(store)
    assert before is not None and after is not None and before != after
