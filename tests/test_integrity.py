"""Damage in place inside a rank's already-summarized bytes is reported (issue #33): the writer
records the CRC-32 of each table file's summarized bytes in ``summary.json``, the loader
compares, and keeps a cache of verified files so that a warm read re-reads none of them."""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from amprobe.store import integrity
from amprobe.store import writer as writer_mod
from amprobe.store.run import load_run, write_rank_summary
from amprobe.store.summary import SUMMARY_FILE
from amprobe.store.writer import RunWriter


@pytest.fixture(autouse=True)
def _a_record_at_every_flush(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(writer_mod, "SUMMARY_INTERVAL_S", 0.0)
    monkeypatch.setattr(writer_mod, "SUMMARY_COST_FACTOR", 0.0)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _steps(a: int, b: int) -> list[dict[str, Any]]:
    return [
        {"step": i, "window": 0, "t": i * 0.1, "wall_s": 0.1, "loss": float(i % 7), "scale": 1024.0}
        for i in range(a, b)
    ]


def _events(a: int, b: int) -> list[dict[str, Any]]:
    return [{"step": i, "t": i * 0.1, "kind": "note", "detail": "{}"} for i in range(a, b, 10)]


def _run(path: Path, ranks: int = 2, steps: int = 60, close: bool = True) -> Path:
    """A tiny run by the real writer: ``ranks`` ranks, flushed in three chunks, its files'
    mtimes set a minute back (a check within the file system's timestamp granularity of a
    write is not cached: see integrity.RACY_NS)."""
    for rank in range(ranks):
        w = RunWriter(path, rank, ranks, {}, max_buffered_rows=10_000)
        for a in range(0, steps, steps // 3):
            w.append("steps", _steps(a, a + steps // 3))
            w.append("events", _events(a, a + steps // 3))
            assert w.flush()
        if close:
            w.close({"status": "finished"})
    back = time.time() - 60
    for f in path.glob("rank*/*"):
        os.utime(f, (back, back))
    return path


def _record(rank_dir: Path) -> dict[str, Any]:
    return json.loads((rank_dir / SUMMARY_FILE).read_bytes())


def _damage(path: Path, line: int = 5) -> None:
    """Overwrite one line in place by garbage of the same length (size and line ends kept)."""
    lines = path.read_bytes().split(b"\n")
    lines[line] = b"\xff" * len(lines[line])
    with open(path, "r+b") as fh:  # written through: same inode, as a disk damages it
        fh.write(b"\n".join(lines))


def _integrity_warnings(run: Any) -> list[str]:
    return [w for w in run.warnings if "(checksum mismatch)" in w]


def test_the_recorded_crc_is_that_of_the_file_prefix(tmp_path: Path) -> None:
    rank_dir = _run(tmp_path / "r", ranks=1, close=False) / "rank0"
    record = _record(rank_dir)
    assert set(record["checksums"]) == set(record["offsets"]) >= {"steps.jsonl", "events.jsonl"}
    for name, crc in record["checksums"].items():
        data = (rank_dir / name).read_bytes()
        assert record["offsets"][name] == len(data)
        assert crc == zlib.crc32(data)
    # write_rank_summary (the compaction step) records them too, from the files
    (rank_dir / SUMMARY_FILE).unlink()
    again = write_rank_summary(rank_dir)
    assert again["checksums"] == record["checksums"]
    assert _record(rank_dir)["checksums"] == record["checksums"]


def test_damage_inside_the_summarized_bytes_is_reported_with_rank_and_file(
    tmp_path: Path,
) -> None:
    run_dir = _run(tmp_path / "r")
    clean = load_run(run_dir)
    clean.summaries()
    assert not _integrity_warnings(clean) and clean.summary_sources()[1] == "records"
    _damage(run_dir / "rank1" / "steps.jsonl")
    loaded = load_run(run_dir)
    summaries = loaded.summaries()
    [line] = _integrity_warnings(loaded)
    assert line.startswith("rank 1: steps.jsonl differs from what its writer recorded")
    assert "record written at close" in line
    # the damaged rank's facts are still used (from its record), and the other rank's alike
    assert loaded.summary_sources() == {0: "records", 1: "records"}
    assert summaries[1] == clean.summaries()[1]
    # a record written at a flush (no close) says at which step
    crashed = _run(tmp_path / "c", ranks=1, close=False)
    _damage(crashed / "rank0" / "events.jsonl", line=1)
    loaded = load_run(crashed)
    loaded.summaries()
    [line] = _integrity_warnings(loaded)
    assert line.startswith("rank 0: events.jsonl differs") and "written at step 59" in line


def test_a_copied_run_is_verified_again_and_not_reported(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "r")
    calls: list[str] = []

    def counting(path: str, end: int, start: int = 0, crc: int = 0) -> int:
        calls.append(path)
        return integrity.crc_of(path, end, start, crc)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(integrity, "CACHE_MIN_BYTES", 0)  # the tiny run keeps a cache
        mp.setattr(integrity.verify, "__defaults__", (None, counting))
        load_run(run_dir).summaries()
        assert (run_dir / "derived" / integrity.CACHE_FILE).is_file()
        shutil.copytree(run_dir, tmp_path / "copy")  # new inodes and mtimes, the cache too
        calls.clear()
        copy = load_run(tmp_path / "copy")
        copy.summaries()
        assert not _integrity_warnings(copy)
        assert copy.summary_sources() == {0: "records", 1: "records"}
        assert len(calls) == 4  # each file of each rank read again: nothing taken on trust


def test_a_record_without_checksums_says_not_checked(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "r", ranks=3)
    for rank in (0, 2):  # written by an older amprobe
        path = run_dir / f"rank{rank}" / SUMMARY_FILE
        record = _record(path.parent)
        del record["checksums"]
        path.write_text(json.dumps(record))
    _damage(run_dir / "rank2" / "steps.jsonl")
    loaded = load_run(run_dir)
    loaded.summaries()
    assert loaded.summary_sources() == {0: "records", 1: "records", 2: "records"}
    said = [w for w in loaded.warnings if "not checked" in w]
    assert said == [
        "rank(s) 0, 2: table files not checked for damage after they were summarized (their "
        "summary records carry no checksums: written by an older amprobe)"
    ]
    assert not _integrity_warnings(loaded)  # rank 2's damage cannot be seen: not claimed fine


def test_the_warm_path_reads_no_file_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = _run(tmp_path / "r")
    monkeypatch.setattr(integrity, "CACHE_MIN_BYTES", 0)
    # the files were just written (their ctime is now, whatever mtime _run set): trust a check
    # made at once, as a check two seconds later would be
    monkeypatch.setattr(integrity, "RACY_NS", 0)
    crcs: list[int] = []
    real = zlib.crc32

    def counting(data: Any, value: int = 0) -> int:
        crcs.append(len(data))
        return real(data, value)

    monkeypatch.setattr(integrity.zlib, "crc32", counting)
    load_run(run_dir).summaries()
    assert sum(crcs) == sum(sum(_record(run_dir / f"rank{r}")["offsets"].values()) for r in (0, 1))
    crcs.clear()
    warm = load_run(run_dir)
    warm.summaries()
    assert crcs == [] and not _integrity_warnings(warm)
    # damage after the cache was written changes the file's mtime: read again, and reported
    _damage(run_dir / "rank0" / "steps.jsonl")
    loaded = load_run(run_dir)
    loaded.summaries()
    assert crcs and [w[:25] for w in _integrity_warnings(loaded)] == ["rank 0: steps.jsonl diffe"]
    # a run that only grew (a live run's appends) is read from where its last check ended
    grown = _run(tmp_path / "g", ranks=1, close=False)
    load_run(grown).summaries()
    # rows appended and a new record, as the live run's writer leaves them
    record = _record(grown / "rank0")
    extra = b"".join(json.dumps(r).encode() + b"\n" for r in _steps(60, 70))
    steps = grown / "rank0" / "steps.jsonl"
    with open(steps, "ab") as fh:
        fh.write(extra)
    record["offsets"]["steps.jsonl"] += len(extra)
    record["checksums"]["steps.jsonl"] = zlib.crc32(steps.read_bytes())
    (grown / "rank0" / SUMMARY_FILE).write_text(json.dumps(record))
    crcs.clear()
    loaded = load_run(grown)
    loaded.summaries()
    assert sum(crcs) == len(extra) and not _integrity_warnings(loaded)


def test_a_crash_cut_rank_is_reported_as_before(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "r", close=False)
    steps = run_dir / "rank1" / "steps.jsonl"
    data = steps.read_bytes()
    steps.write_bytes(data[: len(data) // 2 + 7])  # cut mid-record by the kill
    loaded = load_run(run_dir)
    loaded.summaries()
    assert loaded.summary_sources() == {0: "records", 1: "files"}
    said = [w for w in loaded.warnings if w.startswith("rank 1: ")]
    assert any("does not match the record files" in w for w in said)
    assert not _integrity_warnings(loaded)


def test_many_damaged_ranks_are_listed_past_the_first_few(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "r", ranks=11, steps=30)
    for rank in range(1, 11):
        _damage(run_dir / f"rank{rank}" / "steps.jsonl", line=2)
    loaded = load_run(run_dir)
    loaded.summaries()
    said = _integrity_warnings(loaded)
    assert [w.split(":")[0] for w in said] == [f"rank {r}" for r in range(1, 9)] + ["ranks 9-10"]
    assert len(loaded.summaries()) == 11  # every rank's facts kept


def test_damage_whose_mtime_was_put_back_is_found_on_a_warm_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edit that puts size and mtime back (touch -r, rsync -t) cannot put ctime back: the
    verdict kept for the file no longer matches, and the file is read again."""
    run_dir = _run(tmp_path / "r")
    monkeypatch.setattr(integrity, "CACHE_MIN_BYTES", 0)
    monkeypatch.setattr(integrity, "RACY_NS", 0)
    first = load_run(run_dir)
    first.summaries()  # verified, and kept
    assert not _integrity_warnings(first)
    steps = run_dir / "rank0" / "steps.jsonl"
    st = steps.stat()
    time.sleep(0.01)
    _damage(steps)
    os.utime(steps, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert steps.stat().st_mtime_ns == st.st_mtime_ns and steps.stat().st_size == st.st_size
    loaded = load_run(run_dir)
    loaded.summaries()
    assert [w[:25] for w in _integrity_warnings(loaded)] == ["rank 0: steps.jsonl diffe"]
