"""The derived Parquet store (amprobe.store.derived) and Run.relation: layout, job columns,
staleness, the user-cache fallback, atomic writes, and the docs' fleet query (issue #33).

Every test works on copies of sample runs in tmp_path: nothing is written into sample_runs/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

pytest.importorskip("duckdb")

from amprobe.store import derived, is_run_dir, list_ranks, list_runs, load_run  # noqa: E402
from amprobe.store.run import write_rank_summary  # noqa: E402
from amprobe.store.summary import SUMMARY_FILE  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "sample_runs"
JOB = list(derived.JOB_COLUMNS)


def _copy_sample(name: str, dest: Path) -> Path:
    shutil.copytree(SAMPLES / name, dest, ignore=shutil.ignore_patterns(derived.DERIVED_DIR))
    return dest


def _two_ranks(dest: Path) -> Path:
    """The overflow sample as a 2-rank run: rank 1 a copy of rank 0 without its first 10 steps."""
    run = _copy_sample("overflow", dest)
    shutil.copytree(run / "rank0", run / "rank1")
    steps = (run / "rank1" / "steps.jsonl").read_text().splitlines(keepends=True)
    (run / "rank1" / "steps.jsonl").write_text("".join(steps[10:]))
    for path, key, value in (
        (run / "manifest.json", "world_size", 2),
        (run / "rank1" / "manifest.json", "rank", 1),
    ):
        manifest = json.loads(path.read_text())
        manifest[key] = value
        path.write_text(json.dumps(manifest))
    return run


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder))
    return folder


def _manifest(folder: Path) -> dict:
    return json.loads((folder / derived.MANIFEST).read_text())


def test_build_one_row_group_per_rank_sorted_with_job_columns(tmp_path: Path, cache: Path) -> None:
    run = load_run(_two_ranks(tmp_path / "run"))
    assert run.relation("steps").aggregate("count(*)").fetchall() == [(390,)]
    folder = tmp_path / "run" / derived.DERIVED_DIR
    manifest = _manifest(folder)
    assert manifest["derived_version"] == derived.DERIVED_VERSION
    assert set(manifest["tables"]) == {
        "steps", "syncs", "events", "numerics", "offenders", "compute_ops", "compute_steps", "summaries"
    }  # fmt: skip
    assert "rank1/steps.jsonl" in manifest["sources"] and "manifest.json" in manifest["sources"]

    # a big table: one row group per rank, told apart by the rank statistics
    meta = pq.ParquetFile(folder / "steps.parquet").metadata
    rank_col = meta.schema.to_arrow_schema().get_field_index("rank")
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
    ranges = [
        (g.column(rank_col).statistics.min, g.column(rank_col).statistics.max) for g in groups
    ]
    # the steps of a rank are fewer than BLOCK_ROWS here: one block of ranks, then per rank
    assert meta.num_row_groups == 1 and ranges == [(0, 1)]
    derived.BLOCK_ROWS, old = 100, derived.BLOCK_ROWS
    try:
        derived.build(run, tmp_path / "small-blocks")
    finally:
        derived.BLOCK_ROWS = old
    meta = pq.ParquetFile(tmp_path / "small-blocks" / "steps.parquet").metadata
    ranges = [
        (
            meta.row_group(i).column(rank_col).statistics.min,
            meta.row_group(i).column(rank_col).statistics.max,
        )
        for i in range(meta.num_row_groups)
    ]
    assert ranges == [(0, 0), (1, 1)]
    assert [meta.row_group(i).num_rows for i in range(2)] == [200, 190]
    meta = pq.ParquetFile(tmp_path / "small-blocks" / "compute_steps.parquet").metadata
    assert meta.num_row_groups == 1 and meta.num_rows == 2  # a tiny table: one block of ranks

    steps = pq.read_table(folder / "steps.parquet").to_pandas()
    assert list(steps.columns[:5]) == JOB + ["rank"]
    assert steps[["rank", "step"]].equals(steps[["rank", "step"]].sort_values(["rank", "step"]))
    for table in manifest["tables"]:
        frame = pq.read_table(folder / f"{table}.parquet").to_pandas()
        assert list(frame.columns[:4]) == JOB and frame[JOB].notna().all().all(), table
        assert set(frame["run_id"]) == {derived.run_id_of(run)}
        assert set(frame["job_name"]) == {"run"}
        assert set(frame["world_size"]) == {2}
        start = frame["start_time"].iloc[0].timestamp()
        assert start == pytest.approx(run.manifest["created_unix"], abs=1e-6)
    # the run id is the manifest's hash: the same for a copy of the run elsewhere
    assert derived.run_id_of(load_run(shutil.copytree(tmp_path / "run", tmp_path / "moved"))) == (
        derived.run_id_of(run)
    )


def _same(a: object, b: object) -> bool:
    """Equal values, or both missing (None, NaN, pd.NA: pandas and DuckDB spell it apart)."""
    if pd.isna(a) is True or pd.isna(b) is True:
        return pd.isna(a) is True and pd.isna(b) is True
    return bool(a == b)


def test_relation_equals_the_steps_frame(tmp_path: Path, cache: Path) -> None:
    path = _two_ranks(tmp_path / "run")
    with open(path / "rank1" / "steps.jsonl", "a") as fh:  # repeated steps: the first is kept
        fh.write(json.dumps({"step": 20, "window": 0, "wall_s": 9.0}) + "\n")
        fh.write(json.dumps({"step": 11, "window": 0, "wall_s": 8.0}) + "\n")
        fh.write(json.dumps({"step": 300, "window": 0, "wall_s": 7.0}) + "\n")
    run = load_run(path)
    expected = (
        run.table("steps").sort_values(["rank", "step"], kind="stable").reset_index(drop=True)
    )
    got = run.relation("steps").order("rank, step").df().drop(columns=JOB)
    assert list(got.columns) == list(expected.columns)
    assert len(got) == 391 and got["wall_s"].iloc[-1] == 7.0
    for column in expected.columns:
        left, right = expected[column].tolist(), got[column].tolist()
        same = [_same(a, b) for a, b in zip(left, right, strict=True)]
        assert all(same), column
    # a filter on rank is pushed down and reads only that rank
    assert run.relation("steps").filter("rank = 1").aggregate("min(step), count(*)").fetchall() == [
        (10, 191)
    ]
    # a table no rank recorded: an empty relation with its columns; an unknown one: KeyError
    gpu = run.relation("gpu")
    assert gpu.fetchall() == [] and "gpu_util" in gpu.columns and "rank" in gpu.columns
    with pytest.raises(KeyError):
        run.relation("nope")


def test_summaries_one_row_per_rank(tmp_path: Path, cache: Path) -> None:
    run = load_run(_two_ranks(tmp_path / "run"))
    rows = run.relation("summaries").order("rank").df()
    steps = run.steps
    assert rows["rank"].tolist() == [0, 1]
    for rank in (0, 1):
        mine = steps[steps["rank"] == rank]
        row = rows[rows["rank"] == rank].iloc[0]
        assert row["steps"] == len(mine)
        assert row["skipped_steps"] == int(mine["skipped"].fillna(False).astype(bool).sum())
        assert (row["first_step"], row["last_step"]) == (mine["step"].min(), mine["step"].max())
        assert json.loads(row["summary"]) == json.loads(
            json.dumps(derived._json_safe(run.summaries()[rank]))
        )
    assert rows["skipped_steps"].tolist()[0] == 40  # the sample's 40 overflow steps


def test_stale_on_size_mtime_version_new_file_and_new_rank(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _two_ranks(tmp_path / "run")
    folder = path / derived.DERIVED_DIR
    run = load_run(path)
    run.relation("steps")
    built = _manifest(folder)["built_unix"]

    def rebuilt() -> bool:
        nonlocal built
        run.relation("steps")
        now = _manifest(folder)["built_unix"]
        changed, built = now != built, now
        return changed

    assert not rebuilt()  # fresh: nothing rebuilt
    st = (path / "rank1" / "offenders.jsonl").stat()
    os.utime(path / "rank1" / "offenders.jsonl", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert not derived.is_fresh(folder, derived.source_files(run))
    assert rebuilt()  # mtime
    with open(path / "rank1" / "steps.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 500, "window": 0, "wall_s": 0.5, "skipped": True}) + "\n")
    assert rebuilt()  # size
    assert run.relation("steps").filter("rank = 1").aggregate("max(step)").fetchall() == [(500,)]
    monkeypatch.setattr(derived, "DERIVED_VERSION", derived.DERIVED_VERSION + 1)
    assert rebuilt()  # the derived layout's version
    assert _manifest(folder)["derived_version"] == derived.DERIVED_VERSION
    monkeypatch.undo()
    assert rebuilt()
    shutil.copy(path / "rank0" / "syncs.jsonl", path / "rank1" / "cuda_phases.jsonl")
    assert rebuilt()  # a file appeared
    (path / "rank1" / "cuda_phases.jsonl").unlink()
    assert rebuilt()  # and went away
    assert "cuda_phases" not in _manifest(folder)["tables"]

    shutil.copytree(path / "rank1", path / "rank2")  # a new rank: seen by a new load
    run = load_run(path)
    assert rebuilt()
    assert run.relation("summaries").aggregate("count(*)").fetchall() == [(3,)]


def test_a_summary_record_written_again_makes_the_summaries_stale_and_keeps_the_tables(
    tmp_path: Path, cache: Path
) -> None:
    """The summaries table holds each rank's record: a record written again (a live writer,
    ``write_rank_summary``) rebuilds it, while the tables, whose files did not change, are kept."""
    path = _two_ranks(tmp_path / "run")
    for rank_dir in (path / "rank0", path / "rank1"):
        write_rank_summary(rank_dir)
    folder = path / derived.DERIVED_DIR
    load_run(path).relation("steps")
    record = path / "rank1" / SUMMARY_FILE
    assert json.loads(record.read_text())["sections"]
    st = record.stat()
    os.utime(record, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    run = load_run(path)
    assert not derived.is_fresh(folder, derived.source_files(run))
    before = _manifest(folder)["built_unix"]
    rows = run.relation("summaries").order("rank").df()
    manifest = _manifest(folder)
    assert manifest["built_unix"] != before
    assert manifest["tables"]["steps"].get("kept") is True
    assert json.loads(rows["summary"].iloc[1]) == json.loads(
        json.dumps(derived._json_safe(run.summaries()[1]))
    )


def test_refresh_parses_only_what_was_appended(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _two_ranks(tmp_path / "run")
    folder = path / derived.DERIVED_DIR
    run = load_run(path)
    run.relation("steps")
    reads: list[tuple[str, int]] = []
    real = derived._read_from

    def spy(file: Path, table: str, offset: int):  # type: ignore[no-untyped-def]
        reads.append((f"{file.parent.name}/{file.name}", offset))
        return real(file, table, offset)

    monkeypatch.setattr(derived, "_read_from", spy)
    steps1 = path / "rank1" / "steps.jsonl"
    size = steps1.stat().st_size
    with open(steps1, "a") as fh:  # a repeated step (dropped, as run.steps does) and a new one
        fh.write(json.dumps({"step": 15, "window": 0, "wall_s": 9.0}) + "\n")
        fh.write(json.dumps({"step": 200, "window": 0, "wall_s": 0.5, "skipped": True}) + "\n")
    run.relation("steps")
    assert ("rank1/steps.jsonl", size) in reads
    assert all(offset > 0 for _, offset in reads), reads  # no file parsed whole again
    tables = _manifest(folder)["tables"]
    assert tables["steps"]["ranks_appended"] == 2 and not tables["steps"].get("kept")
    # the tables no rank appended to are kept as they are, their files not read at all
    assert tables["numerics"]["kept"] and not any("numerics" in name for name, _ in reads)

    # the same files as a build from scratch
    def same_as_scratch() -> None:
        scratch = derived.build(load_run(path), tmp_path / "scratch", incremental=False)
        for table in _manifest(folder)["tables"]:
            mine = pq.read_table(folder / f"{table}.parquet")
            theirs = pq.read_table(scratch / f"{table}.parquet")
            assert mine.schema.equals(theirs.schema), table
            # pandas' equals: NaN (the overflow steps' loss) equal to NaN in the same place
            assert mine.to_pandas().equals(theirs.to_pandas()), table

    same_as_scratch()
    assert run.relation("summaries").filter("rank = 1").aggregate(
        "steps, skipped_steps, last_step"
    ).fetchall() == [(191, 41, 200)]
    # a file written anew in place (not an append): parsed whole
    reads.clear()
    lines = steps1.read_text().splitlines(keepends=True)
    steps1.write_text(
        lines[0].replace('"wall_s": ', '"wall_s": 1') + "".join(lines[1:]) + lines[-1]
    )
    run.relation("steps")
    assert ("rank1/steps.jsonl", 0) in reads
    same_as_scratch()


@pytest.mark.parametrize("damage", ["not json", '{"format": "amprobe-derived"}', "sources"])
def test_damaged_manifest_is_stale(tmp_path: Path, cache: Path, damage: str) -> None:
    path = _copy_sample("overflow", tmp_path / "run")
    run = load_run(path)
    run.relation("steps")
    manifest = path / derived.DERIVED_DIR / derived.MANIFEST
    if damage == "sources":
        broken = {**_manifest(manifest.parent), "sources": [1], "tables": {"steps": 3}}
        manifest.write_text(json.dumps(broken))
    else:
        manifest.write_text(damage)
    assert not derived.is_fresh(manifest.parent, derived.source_files(run))
    assert run.relation("steps").aggregate("count(*)").fetchall() == [(200,)]
    assert derived.is_fresh(manifest.parent, derived.source_files(run))


def test_read_only_run_folder_uses_the_user_cache(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tests run as root here, where chmod cannot forbid a write: the writability probe is made
    # to fail for the run's folder instead (the non-root variant below chmods for real)
    path = _copy_sample("overflow", tmp_path / "run")
    real = derived._writable
    monkeypatch.setattr(derived, "_writable", lambda f: f.parent != path and real(f))
    run = load_run(path)
    assert run.relation("steps").aggregate("count(*)").fetchall() == [(200,)]
    assert not (path / derived.DERIVED_DIR / derived.MANIFEST).exists()
    stores = list((cache / "amprobe" / derived.DERIVED_DIR).iterdir())
    assert [s.name for s in stores] == [derived._cache_key(run)]
    assert (stores[0] / "steps.parquet").is_file()
    assert derived.ensure(run).folder == stores[0]  # fresh: used as it is
    # the key follows the run's path and creation time
    moved = load_run(shutil.copytree(path, tmp_path / "elsewhere"))
    assert derived._cache_key(moved) != derived._cache_key(run)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod 0o555")
def test_read_only_run_folder_by_chmod(tmp_path: Path, cache: Path) -> None:
    path = _copy_sample("overflow", tmp_path / "run")
    path.chmod(0o555)
    try:
        run = load_run(path)
        assert run.relation("steps").aggregate("count(*)").fetchall() == [(200,)]
        assert not (path / derived.DERIVED_DIR).exists()
        assert derived.ensure(run).folder.parent == cache / "amprobe" / derived.DERIVED_DIR
    finally:
        path.chmod(0o755)


def test_failed_build_leaves_the_old_store_or_none(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _two_ranks(tmp_path / "run")
    folder = path / derived.DERIVED_DIR

    def boom(*args: object) -> None:
        raise RuntimeError("killed mid-build")

    # no store yet: a failure after the tables were written leaves none
    with monkeypatch.context() as m:
        m.setattr(derived, "_write_summaries", boom)
        with pytest.raises(RuntimeError):
            load_run(path).relation("steps")
    assert sorted(p.name for p in folder.iterdir()) == []
    run = load_run(path)
    run.relation("steps")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with open(path / "rank1" / "steps.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 900, "window": 0}) + "\n")
    with monkeypatch.context() as m:
        m.setattr(derived, "_write_summaries", boom)
        with pytest.raises(RuntimeError):
            run.relation("steps")
    after = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert after == before  # the old files, whole, and no temporary file left
    assert run.relation("steps").aggregate("max(step)").fetchall() == [(900,)]


def test_damaged_records_are_reported_as_the_loader_does(tmp_path: Path, cache: Path) -> None:
    path = _two_ranks(tmp_path / "run")
    with open(path / "rank1" / "events.jsonl", "a") as fh:
        fh.write("not json\n")
    run = load_run(path)
    rows = run.relation("events").aggregate("count(*)").fetchall()[0][0]
    assert rows == len(run.table("events"))  # the damaged line is skipped by both
    assert run.warnings.count("rank 1: 1 unreadable record(s) skipped in events.jsonl") == 1


def test_loader_ignores_the_derived_folder(tmp_path: Path, cache: Path) -> None:
    path = _two_ranks(tmp_path / "runs" / "run")
    load_run(path).relation("summaries")
    assert (path / derived.DERIVED_DIR / derived.MANIFEST).is_file()
    listing = list_ranks(path)
    assert [r.rank for r in listing.ranks] == [0, 1] and listing.warnings == []
    again = load_run(path)
    assert [r.rank for r in again.ranks] == [0, 1]
    assert not any("derived" in w for w in again.warnings)
    assert not is_run_dir(path / derived.DERIVED_DIR)
    assert list_runs(tmp_path / "runs") == [path.resolve()]


def _docs_query() -> str:
    text = (REPO / "docs" / "derived.md").read_text()
    section = text[text.index("## Fleet queries") :]
    match = re.search(r"```sql\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


def test_fleet_query_of_the_docs_on_two_runs(tmp_path: Path, cache: Path) -> None:
    import duckdb

    for name in ("overflow", "healthy"):
        path = _copy_sample(name, tmp_path / "runs" / name)
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["created_unix"] = time.time() - 3600  # started this week
        (path / "manifest.json").write_text(json.dumps(manifest))
        load_run(path).relation("summaries")
    con = duckdb.connect()
    glob = str(tmp_path / "runs" / "*" / "derived" / "summaries.parquet")
    con.sql(f"CREATE VIEW summaries AS FROM read_parquet('{glob}')")
    rows = con.sql(_docs_query()).fetchall()
    assert len(rows) == 1
    run_id, job_name, _start, steps, skipped, share = rows[0]
    assert (job_name, steps, skipped, share) == ("overflow", 200, 40, 0.2)
    assert run_id == derived.run_id_of(load_run(tmp_path / "runs" / "overflow"))
    # both runs were scanned: the healthy one skipped nothing
    every = con.sql("SELECT job_name, sum(skipped_steps) FROM summaries GROUP BY 1 ORDER BY 1")
    assert every.fetchall() == [("healthy", 0), ("overflow", 40)]


def test_diagnose_does_not_import_duckdb(tmp_path: Path) -> None:
    path = _copy_sample("overflow", tmp_path / "run")
    code = (
        "import sys, amprobe\n"
        f"amprobe.diagnose(amprobe.load_run({str(path)!r}))\n"
        "assert 'duckdb' not in sys.modules, 'diagnose imported duckdb'\n"
        "assert 'amprobe.store.derived' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert not (path / derived.DERIVED_DIR).exists()


def test_a_refresh_leaves_the_runs_own_facts_as_they_were(tmp_path: Path, cache: Path) -> None:
    """Review of #33: a relation's refresh re-read the summaries into the run itself, so one
    diagnosis or report mixed facts from before and after an append."""
    from amprobe.analysis.scaler import compute_success_rate

    path = _two_ranks(tmp_path / "run")
    run = load_run(path)
    before = compute_success_rate(run)
    steps = path / "rank1" / "steps.jsonl"
    with open(steps, "a") as fh:
        row = {"step": 500, "window": 0, "wall_s": 0.5, "skipped": True, "scaler_enabled": True}
        fh.write(json.dumps({**row, "scale_before": 8.0, "scale_after": 4.0}) + "\n")
    last = run.relation("summaries").filter("rank = 1").aggregate("last_step").fetchall()
    assert last == [(500,)]  # the derived store has the appended row
    assert compute_success_rate(run) == before  # the run's own facts did not move


def test_a_cut_parquet_file_is_stale_and_rebuilt(tmp_path: Path, cache: Path) -> None:
    """Review of #33: a Parquet file left short (a machine crash before it reached the disk)
    counted as fresh, and every later read failed ("No magic bytes found")."""
    path = _two_ranks(tmp_path / "run")
    folder = path / derived.DERIVED_DIR
    count = load_run(path).relation("steps").aggregate("count(*)").fetchall()
    steps = folder / "steps.parquet"
    steps.write_bytes(steps.read_bytes()[:100])
    assert load_run(path).relation("steps").aggregate("count(*)").fetchall() == count
