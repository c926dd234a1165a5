"""Per-rank summaries written as the run goes (issue #33): the writer's chunk records in
``rankN/summary.jsonl`` and the reader that merges them and summarizes only what no record
covers. Fed by a private test section (registered for each test, never left in SECTIONS)."""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from amprobe.store import writer as writer_mod
from amprobe.store.jsonl import _read_arrow
from amprobe.store.run import load_run, write_rank_summary
from amprobe.store.summary import (
    SECTIONS,
    SUMMARY_FILE,
    SUMMARY_VERSION,
    Section,
    summarize_tables,
)
from amprobe.store.writer import RunWriter

NAME = "_test_counts"


class _Counts(Section):
    """Counts and sums of the steps and events rows (and every step, in order)."""

    name: ClassVar[str] = NAME
    tables: ClassVar[tuple[str, ...]] = ("steps", "events")
    fed: ClassVar[int] = 0  # rows added, all instances (how much a reader summarized itself)
    explode_at: ClassVar[int | None] = None  # raise on this row (a section with a bug)

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.kinds: dict[str, int] = {}
        self.loss_max: float | None = None

    def add(self, table: str, row: Mapping[str, Any]) -> None:
        type(self).fed += 1
        if type(self).explode_at is not None and type(self).fed >= type(self).explode_at:
            raise ZeroDivisionError("a section's bug")
        if table == "steps":
            self.steps.append(row["step"])
            loss = row.get("loss")
            if loss is not None and (self.loss_max is None or loss > self.loss_max):
                self.loss_max = loss
        else:
            kind = row.get("kind")
            self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "kinds": self.kinds, "loss_max": self.loss_max}

    @classmethod
    def merge(cls, first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
        kinds = dict(first["kinds"])
        for k, n in second["kinds"].items():
            kinds[k] = kinds.get(k, 0) + n
        maxes = [m for m in (first["loss_max"], second["loss_max"]) if m is not None]
        return {
            "steps": first["steps"] + second["steps"],
            "kinds": kinds,
            "loss_max": max(maxes) if maxes else None,
        }


@pytest.fixture(autouse=True)
def counts() -> Iterator[type[_Counts]]:
    SECTIONS.append(_Counts)
    _Counts.fed = 0
    _Counts.explode_at = None
    try:
        yield _Counts
    finally:
        SECTIONS.remove(_Counts)


def _steps(a: int, b: int) -> list[dict[str, Any]]:
    return [{"step": i, "window": 0, "t": i * 0.1, "wall_s": 0.1, "loss": float(i % 7)} for i in range(a, b)]  # fmt: skip


def _events(a: int, b: int) -> list[dict[str, Any]]:
    return [{"step": i, "t": i * 0.1, "kind": f"k{i % 3}", "detail": "{}"} for i in range(a, b)]


def _writer(run: Path, rank: int = 0, **kw: Any) -> RunWriter:
    return RunWriter(run, rank, 1, {}, max_buffered_rows=kw.pop("max_rows", 10_000), **kw)


def _chunks(w: RunWriter, bounds: list[int]) -> None:
    """One flush per chunk [a, b): steps and events rows of those steps."""
    for a, b in zip(bounds, bounds[1:], strict=False):
        w.append("steps", _steps(a, b))
        w.append("events", _events(a, b))
        assert w.flush()


def _records(rank_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (rank_dir / SUMMARY_FILE).read_text().splitlines()]


def _from_files(rank_dir: Path) -> dict[str, Any]:
    """The test section of a rank summarized from its record files alone."""

    def read(table: str) -> list[dict[str, Any]]:
        got = _read_arrow(rank_dir / f"{table}.jsonl", table).table
        return got.to_pylist() if got is not None else []

    return summarize_tables(read)[NAME]


def _read(run: Path) -> tuple[dict[str, Any], str, list[str]]:
    _Counts.fed = 0  # load_run summarizes already (the last step of an unclosed run)
    loaded = load_run(run)
    summary = loaded.summaries()[0].get(NAME)
    return summary, loaded.summary_sources()[0], loaded.warnings


def test_a_record_per_flush_and_a_final_one_at_close(tmp_path: Path) -> None:
    w = _writer(tmp_path / "r")
    rank_dir = w.rank_dir
    sizes = []
    for a, b in [(0, 10), (10, 25), (25, 30)]:
        _chunks(w, [a, b])
        sizes.append((rank_dir / "steps.jsonl").stat().st_size)
    w.append("gpu", [{"t": 1.0}])  # a table no section reads: no record of its own
    assert w.flush()
    assert len(_records(rank_dir)) == 3
    w.close({"status": "finished"})
    records = _records(rank_dir)
    assert [r["chunk"] for r in records] == [0, 1, 2, 3]
    assert [r["final"] for r in records] == [False, False, False, True]
    assert all(r["summary_version"] == SUMMARY_VERSION for r in records)
    assert [r["offsets"]["steps.jsonl"] for r in records[:3]] == sizes
    assert records[3]["offsets"]["steps.jsonl"] == sizes[-1]
    assert records[3]["offsets"]["gpu.jsonl"] == (rank_dir / "gpu.jsonl").stat().st_size
    assert [r["rows"] for r in records] == [
        {"steps": 10, "events": 10},
        {"steps": 15, "events": 15},
        {"steps": 5, "events": 5},
        {},
    ]
    assert records[1]["sections"][NAME]["steps"] == list(range(10, 25))
    assert records[3]["sections"][NAME] == {"steps": [], "kinds": {}, "loss_max": None}
    assert json.loads((rank_dir / "end.json").read_text())["write_errors"] == []


def test_merged_records_equal_the_files_summary_read_from_records_alone(tmp_path: Path) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 7, 40, 41, 100])
    w.close({"status": "finished"})
    summary, source, warnings = _read(tmp_path / "r")
    assert source == "records"
    assert _Counts.fed == 0  # no row read back from the files
    assert summary == _from_files(w.rank_dir)
    assert summary["steps"] == list(range(100))
    assert not [x for x in warnings if "summary" in x]
    # the same run without its summary file (an older amprobe): summarized from the files
    (w.rank_dir / SUMMARY_FILE).unlink()
    assert _read(tmp_path / "r")[:2] == (summary, "files")


def test_a_crashed_rank_reads_every_flushed_chunk_and_rebuilds_only_the_tail(
    tmp_path: Path,
) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10, 20, 30])
    # the job is killed while writing the last chunk's record: rows in, record cut
    w.append("steps", _steps(30, 45))
    w.append("events", _events(30, 45))
    assert w.flush()
    path = w.rank_dir / SUMMARY_FILE
    data = path.read_bytes()
    path.write_bytes(data[: data.rstrip(b"\n").rfind(b"\n") + 1 + 25])  # no close either
    summary, source, warnings = _read(tmp_path / "r")
    assert source == "records+tail"
    assert _Counts.fed == 30  # the 15 steps and 15 events rows after the third record only
    assert summary == _from_files(w.rank_dir)
    assert summary["steps"] == list(range(45))
    assert not [x for x in warnings if SUMMARY_FILE in x]  # a cut last line of a crash: silent


def test_a_truncated_table_file_is_summarized_from_the_files_with_a_warning(
    tmp_path: Path,
) -> None:
    w = _writer(tmp_path / "r", rank=3)
    _chunks(w, [0, 20, 40])
    w.close({"status": "finished"})
    steps = w.rank_dir / "steps.jsonl"
    lines = steps.read_bytes().splitlines(keepends=True)
    steps.write_bytes(b"".join(lines[:25]))
    loaded = load_run(tmp_path / "r")
    summary = loaded.summaries()[3][NAME]
    assert loaded.summary_sources() == {3: "files"}
    assert summary == _from_files(w.rank_dir) and summary["steps"] == list(range(25))
    [line] = [x for x in loaded.warnings if SUMMARY_FILE in x]
    assert line.startswith("rank 3: ") and "steps.jsonl" in line
    # a file replaced by one as long, whose summarized offset falls inside a line
    _chunks(w := _writer(tmp_path / "s", overwrite=True), [0, 20])
    w.close({"status": "finished"})
    steps = w.rank_dir / "steps.jsonl"
    steps.write_bytes(b" " + steps.read_bytes()[:-1] + b"\n")
    assert _read(tmp_path / "s")[1] == "files"


def test_offsets_going_backwards_are_not_trusted(tmp_path: Path) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 5, 10])
    path = w.rank_dir / SUMMARY_FILE
    first, second = _records(w.rank_dir)
    second["offsets"]["steps.jsonl"] = first["offsets"]["steps.jsonl"] - 1
    path.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    summary, source, warnings = _read(tmp_path / "r")
    assert (source, summary["steps"]) == ("files", list(range(10)))
    assert any(x.startswith("rank 0: ") and "backwards" in x for x in warnings)


def test_a_corrupt_summary_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10, 20, 30, 40])
    w.close({"status": "finished"})
    path = w.rank_dir / SUMMARY_FILE
    lines = path.read_text().splitlines(keepends=True)
    lines[3] = "{not json\n"  # the last chunk with rows
    lines.append('["an array"]\n')
    path.write_text("".join(lines))
    _Counts.fed = 0
    summary, source, warnings = _read(tmp_path / "r")
    assert (source, _Counts.fed) == ("records+tail", 20)
    assert summary == _from_files(w.rank_dir) and summary["steps"] == list(range(40))
    assert "rank 0: 2 damaged record(s) skipped in summary.jsonl" in warnings
    # a middle record lost: the records after it are not merged (their chunk would be missing)
    lines[1] = "\0\0\0\n"
    path.write_text("".join(lines))
    summary, source, warnings = _read(tmp_path / "r")
    assert (source, _Counts.fed) == ("records+tail", 60)
    assert summary["steps"] == list(range(40))
    assert any("after a missing chunk" in x for x in warnings)


def test_records_of_another_summary_version_are_ignored(tmp_path: Path) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10, 20])
    path = w.rank_dir / SUMMARY_FILE
    future = {"summary_version": SUMMARY_VERSION + 1, "layout": ["something", "else"]}
    with path.open("a") as fh:
        fh.write(json.dumps(future) + "\n")
    summary, source, warnings = _read(tmp_path / "r")
    assert (source, summary["steps"]) == ("records", list(range(20)))
    assert any("another summary_version" in x for x in warnings)
    path.write_text(json.dumps(future) + "\n")  # only future records: from the files
    summary, source, _ = _read(tmp_path / "r")
    assert (source, summary["steps"]) == ("files", list(range(20)))


def test_a_section_that_raises_never_stops_the_rows(tmp_path: Path) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10])
    _Counts.explode_at = _Counts.fed + 5
    _chunks(w, [10, 20, 30])  # never raises
    w.close({"status": "finished"})
    _Counts.explode_at = None
    assert len(_records(w.rank_dir)) == 1  # summaries off after the error
    errors = json.loads((w.rank_dir / "end.json").read_text())["write_errors"]
    assert [e for e in errors if "summary" in e] == [
        "summary: ZeroDivisionError: a section's bug (summaries off for this rank)"
    ]
    summary, source, _ = _read(tmp_path / "r")
    assert (source, summary["steps"]) == ("records+tail", list(range(30)))


def _failing_for(monkeypatch: pytest.MonkeyPatch, name: str, times: int) -> list[int]:
    """``_append_lines`` fails (disk full) the next ``times`` writes of file ``name``."""
    real = writer_mod._append_lines
    left = [times]

    def append(path: Path, data: bytes) -> int:
        if path.name == name and left[0] > 0:
            left[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    monkeypatch.setattr(writer_mod, "_append_lines", append)
    return left


def test_rows_not_written_are_never_in_a_written_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = _writer(tmp_path / "r", max_rows=30)
    _chunks(w, [0, 10])
    # events cannot be written at the next flush: no record until a flush writes everything
    _failing_for(monkeypatch, "events.jsonl", 1)
    w.append("steps", _steps(10, 20))
    w.append("events", _events(10, 20))
    assert not w.flush()
    assert len(_records(w.rank_dir)) == 1
    _chunks(w, [20, 25])
    second = _records(w.rank_dir)[1]
    assert second["rows"] == {"steps": 15, "events": 15}
    assert second["sections"][NAME]["steps"] == list(range(10, 25))
    # the disk stays full for events: rows pushed out of the buffer are lost, and from then on
    # no record is written (the rows lost were already summarized)
    _failing_for(monkeypatch, "events.jsonl", 10**6)
    for a in range(25, 65, 10):
        w.append("steps", _steps(a, a + 10))
        w.append("events", _events(a, a + 10))
        assert not w.flush()
    assert w.lost_rows == {"events": 10}
    monkeypatch.undo()
    _chunks(w, [65, 70])
    w.close({"status": "finished"})
    assert len(_records(w.rank_dir)) == 2
    claimed = {t: sum(r["rows"].get(t, 0) for r in _records(w.rank_dir)) for t in ("steps", "events")}  # fmt: skip
    assert claimed == {"steps": 25, "events": 25}
    summary, source, _ = _read(tmp_path / "r")
    assert source == "records+tail"
    assert summary == _from_files(w.rank_dir)
    assert w.lost_rows == {"events": 15}  # 5 more pushed out by the last chunk's
    assert sum(summary["kinds"].values()) == 70 - 15  # the lost events are in no summary


def test_a_record_that_cannot_be_written_goes_into_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10])
    _failing_for(monkeypatch, SUMMARY_FILE, 1)
    _chunks(w, [10, 20])  # rows written, record not: flush still reports the rows written
    assert len(_records(w.rank_dir)) == 1
    _chunks(w, [20, 30])
    records = _records(w.rank_dir)
    assert [r["chunk"] for r in records] == [0, 1]
    assert records[1]["rows"] == {"steps": 20, "events": 20}
    assert records[1]["sections"][NAME]["steps"] == list(range(10, 30))
    assert _read(tmp_path / "r")[:2] == (_from_files(w.rank_dir), "records")
    assert any(SUMMARY_FILE in e for e in w.write_errors)


def test_write_rank_summary_compacts_a_rank_into_one_final_record(tmp_path: Path) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10, 20])
    steps = w.rank_dir / "steps.jsonl"
    with steps.open("ab") as fh:
        fh.write(b'{"step": 99, "wind')  # a cut last line: not summarized, not covered
    record = write_rank_summary(w.rank_dir)
    assert _records(w.rank_dir) == [record]
    assert record["final"] and record["chunk"] == 0
    assert record["rows"] == {"steps": 20, "events": 20}
    assert record["offsets"]["steps.jsonl"] == steps.stat().st_size - len(b'{"step": 99, "wind')
    assert not list(w.rank_dir.glob(".*.tmp"))
    summary, source, _ = _read(tmp_path / "r")
    assert (source, summary["steps"]) == ("records", list(range(20)))


def test_an_unreadable_rank_gets_an_empty_summary_and_hides_no_other(tmp_path: Path) -> None:
    for rank in (0, 1):
        w = RunWriter(tmp_path / "r", rank, 2, {}, max_buffered_rows=100)
        _chunks(w, [0, 10])
        w.close({"status": "finished"})
    bad = tmp_path / "r" / "rank1"
    (bad / "events.jsonl").unlink()
    (bad / "events.jsonl").mkdir()  # not a regular file
    (bad / SUMMARY_FILE).unlink()
    loaded = load_run(tmp_path / "r")
    summaries = loaded.summaries()
    assert summaries[1] == {} and summaries[0][NAME]["steps"] == list(range(10))
    assert loaded.summary_sources() == {0: "records", 1: "unreadable"}
    assert any(x.startswith("rank 1: summary not computed") for x in loaded.warnings)


def test_without_sections_the_writer_writes_no_summary(
    tmp_path: Path, counts: type[_Counts]
) -> None:
    SECTIONS.remove(counts)
    try:
        if SECTIONS:
            pytest.skip("sections are registered")
        w = _writer(tmp_path / "r")
        _chunks(w, [0, 10])
        w.close({"status": "finished"})
        assert not (w.rank_dir / SUMMARY_FILE).exists()
    finally:
        SECTIONS.append(counts)


def test_a_copied_rank_keeps_its_records(tmp_path: Path) -> None:
    """The records describe the files by offset, so a copy of the rank reads the same."""
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10, 15])
    shutil.copytree(tmp_path / "r", tmp_path / "copy")
    assert _read(tmp_path / "copy")[:2] == _read(tmp_path / "r")[:2]
