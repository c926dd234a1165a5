"""Per-rank summaries written as the run goes (issue #33): the writer's cumulative record in
``rankN/summary.json``, replaced at each flush, and the reader that reads it and summarizes
only the rows it does not cover. Fed by a private test section (registered for each test, never
left in SECTIONS)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from amprobe.store import run as run_mod
from amprobe.store import writer as writer_mod
from amprobe.store.jsonl import _read_arrow
from amprobe.store.run import load_run, write_rank_summary
from amprobe.store.summary import (
    SECTIONS,
    SUMMARY_FILE,
    SUMMARY_VERSION,
    Accumulator,
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
        # shares its own list and dict, as Section allows: the caller encodes it at once
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


@pytest.fixture(autouse=True)
def _a_record_at_every_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writers of these tests replace their record at every flush (the tests look at
    each); the interval between records has a test of its own."""
    monkeypatch.setattr(writer_mod, "SUMMARY_INTERVAL_S", 0.0)
    monkeypatch.setattr(writer_mod, "SUMMARY_COST_FACTOR", 0.0)


def _writer(run: Path, rank: int = 0, **kw: Any) -> RunWriter:
    return RunWriter(run, rank, 1, {}, max_buffered_rows=kw.pop("max_rows", 10_000), **kw)


def _chunks(w: RunWriter, bounds: list[int]) -> None:
    """One flush per chunk [a, b): steps and events rows of those steps."""
    for a, b in zip(bounds, bounds[1:], strict=False):
        w.append("steps", _steps(a, b))
        w.append("events", _events(a, b))
        assert w.flush()


def _record(rank_dir: Path) -> dict[str, Any]:
    return json.loads((rank_dir / SUMMARY_FILE).read_bytes())


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


def test_a_snapshot_leaves_the_sections_as_they_are() -> None:
    acc = Accumulator()
    acc.add("steps", _steps(0, 3))
    acc.add("syncs", [{"step": 1}])  # no section reads it: not counted
    first = json.dumps(acc.snapshot())
    assert json.dumps(acc.snapshot()) == first
    acc.add("steps", _steps(3, 5))
    assert acc.snapshot()[NAME]["steps"] == [0, 1, 2, 3, 4]
    assert (acc.counts, acc.rows) == ({"steps": 5}, 5)
    assert acc.take()[NAME]["steps"] == [0, 1, 2, 3, 4]
    assert acc.snapshot()[NAME]["steps"] == [] and acc.rows == 0


def test_each_flush_replaces_one_cumulative_record_and_close_marks_it_final(
    tmp_path: Path,
) -> None:
    w = _writer(tmp_path / "r")
    rank_dir = w.rank_dir
    for a, b in [(0, 10), (10, 25), (25, 30)]:
        _chunks(w, [a, b])
        record = _record(rank_dir)
        assert record["summary_version"] == SUMMARY_VERSION and record["final"] is False
        assert record["offsets"]["steps.jsonl"] == (rank_dir / "steps.jsonl").stat().st_size
        assert record["offsets"]["events.jsonl"] == (rank_dir / "events.jsonl").stat().st_size
        assert record["rows"] == {"steps": b, "events": b}
        assert record["sections"][NAME]["steps"] == list(range(b))
    assert "chunk" not in record
    inode = (rank_dir / SUMMARY_FILE).stat().st_ino
    w.append("syncs", [{"step": 1}])  # a table no section reads: the record is not rewritten
    assert w.flush()
    assert (rank_dir / SUMMARY_FILE).stat().st_ino == inode
    w.close({"status": "finished"})
    record = _record(rank_dir)
    assert record["final"] is True
    assert record["offsets"]["syncs.jsonl"] == (rank_dir / "syncs.jsonl").stat().st_size
    assert record["rows"] == {"steps": 30, "events": 30}
    assert record["sections"][NAME] == _from_files(rank_dir)
    assert sorted(p.name for p in rank_dir.iterdir() if "summary" in p.name) == [SUMMARY_FILE]
    assert json.loads((rank_dir / "end.json").read_text())["write_errors"] == []


def test_a_closed_rank_is_read_from_its_record_alone(tmp_path: Path) -> None:
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


def test_a_crashed_rank_keeps_its_last_record_and_rebuilds_only_the_tail(tmp_path: Path) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10, 20, 30])
    path = w.rank_dir / SUMMARY_FILE
    last = path.read_bytes()
    # the job is killed after the next flush's rows were written, before its record replaced
    # the last one (and it never closes)
    w.append("steps", _steps(30, 45))
    w.append("events", _events(30, 45))
    assert w.flush()
    path.write_bytes(last)
    assert _record(w.rank_dir)["rows"] == {"steps": 30, "events": 30}
    summary, source, warnings = _read(tmp_path / "r")
    assert source == "records+tail"
    assert _Counts.fed == 30  # the 15 steps and 15 events rows after the record only
    assert summary == _from_files(w.rank_dir)
    assert summary["steps"] == list(range(45))
    assert not [x for x in warnings if SUMMARY_FILE in x]  # an expected state after a crash


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
    assert line.startswith("rank 3: ") and "steps.jsonl has" in line
    # a file replaced by a longer one, whose summarized offset falls inside a line
    _chunks(w := _writer(tmp_path / "s", overwrite=True), [0, 20])
    w.close({"status": "finished"})
    steps = w.rank_dir / "steps.jsonl"
    steps.write_bytes(b" " + steps.read_bytes()[:-1] + b"\n\n")
    summary, source, warnings = _read(tmp_path / "s")
    assert (source, summary) == ("files", _from_files(w.rank_dir))
    assert any("no line end at the summarized offset" in x for x in warnings)


def test_a_table_file_the_record_counts_that_is_missing_is_not_trusted(tmp_path: Path) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 5, 10])
    w.close({"status": "finished"})
    (w.rank_dir / "events.jsonl").unlink()
    summary, source, warnings = _read(tmp_path / "r")
    assert (source, summary["steps"], summary["kinds"]) == ("files", list(range(10)), {})
    assert any(x.startswith("rank 0: ") and "events.jsonl is missing" in x for x in warnings)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "empty"),  # a machine crash before the page cache reached the disk
        (b'{"summary_version": %d, "final": tr' % SUMMARY_VERSION, "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b'["an array"]', "not a summary record"),
        (
            b'{"summary_version": %d, "final": true, "offsets": [], "rows": {}, "sections": {}}'
            % SUMMARY_VERSION,
            "not a summary record",
        ),
    ],
)  # fmt: skip
def test_a_damaged_record_is_rebuilt_from_the_files_with_a_warning(
    tmp_path: Path, content: bytes, why: str
) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10, 20])
    w.close({"status": "finished"})
    (w.rank_dir / SUMMARY_FILE).write_bytes(content)
    summary, source, warnings = _read(tmp_path / "r")
    assert (source, summary) == ("files", _from_files(w.rank_dir))
    assert f"rank 0: {SUMMARY_FILE} is {why}; the rank was summarized from its files" in warnings


def test_a_record_that_is_not_a_regular_file_is_not_read(tmp_path: Path) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10])
    w.close({"status": "finished"})
    (w.rank_dir / SUMMARY_FILE).unlink()
    (w.rank_dir / SUMMARY_FILE).mkdir()
    summary, source, warnings = _read(tmp_path / "r")
    assert (source, summary) == ("files", _from_files(w.rank_dir))
    assert any(x.startswith(f"rank 0: {SUMMARY_FILE} is not read (") for x in warnings)


def test_a_record_over_the_size_limit_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10])
    w.close({"status": "finished"})
    size = (w.rank_dir / SUMMARY_FILE).stat().st_size
    monkeypatch.setattr(run_mod, "MAX_SUMMARY_BYTES", size)
    assert _read(tmp_path / "r")[1] == "records"  # at the limit: read
    monkeypatch.setattr(run_mod, "MAX_SUMMARY_BYTES", size - 1)
    summary, source, warnings = _read(tmp_path / "r")
    assert (source, summary) == ("files", _from_files(w.rank_dir))
    assert any(f"is larger than {size - 1} bytes" in x for x in warnings)


def test_a_record_of_another_summary_version_is_ignored(tmp_path: Path) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10, 20])
    future = {"summary_version": SUMMARY_VERSION + 1, "layout": ["something", "else"]}
    (w.rank_dir / SUMMARY_FILE).write_text(json.dumps(future))
    summary, source, warnings = _read(tmp_path / "r")
    assert (source, summary["steps"]) == ("files", list(range(20)))
    assert [x for x in warnings if "summary" in x] == [
        f"summary records of another summary_version (this amprobe reads {SUMMARY_VERSION}) "
        "ignored on 1 rank(s); those ranks were summarized from their record files"
    ]


def test_a_section_that_raises_never_stops_the_rows(tmp_path: Path) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10])
    _Counts.explode_at = _Counts.fed + 5
    _chunks(w, [10, 20, 30])  # never raises
    w.close({"status": "finished"})
    _Counts.explode_at = None
    record = _record(w.rank_dir)  # summaries off after the error: the first flush's record
    assert (record["final"], record["rows"]) == (False, {"steps": 10, "events": 10})
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
    assert _record(w.rank_dir)["rows"] == {"steps": 10, "events": 10}
    _chunks(w, [20, 25])
    record = _record(w.rank_dir)
    assert record["rows"] == {"steps": 25, "events": 25}
    assert record["sections"][NAME]["steps"] == list(range(25))
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
    assert _record(w.rank_dir) == record
    summary, source, _ = _read(tmp_path / "r")
    assert source == "records+tail"
    assert summary == _from_files(w.rank_dir)
    assert w.lost_rows == {"events": 15}  # 5 more pushed out by the last chunk's
    assert sum(summary["kinds"].values()) == 70 - 15  # the lost events are in no summary


def test_a_record_that_cannot_be_written_leaves_the_last_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10])
    real = writer_mod.write_record
    calls: list[bool] = []

    def full(rank_dir: Path, data: bytes, durable: bool) -> None:
        calls.append(durable)
        if len(calls) == 1:
            tmp = rank_dir / f".{SUMMARY_FILE}.partial.tmp"
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
        real(rank_dir, data, durable)

    monkeypatch.setattr(writer_mod, "write_record", full)
    _chunks(w, [10, 20])  # rows written, record not: flush still reports the rows written
    assert _record(w.rank_dir)["rows"] == {"steps": 10, "events": 10}
    w.append("syncs", [{"step": 1}])  # no new row a section reads, but a record to write
    assert w.flush()
    assert _record(w.rank_dir)["rows"] == {"steps": 20, "events": 20}
    _chunks(w, [20, 30])
    w.close({"status": "finished"})
    assert calls == [False, False, False, True]  # synced at close only
    assert _record(w.rank_dir)["rows"] == {"steps": 30, "events": 30}
    assert _read(tmp_path / "r")[:2] == (_from_files(w.rank_dir), "records")
    assert any(e.startswith(f"{SUMMARY_FILE}: ") for e in w.write_errors)


def test_a_disk_full_while_writing_the_record_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10])
    before = (w.rank_dir / SUMMARY_FILE).read_bytes()

    def replace(src: Any, dst: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", replace)
    _chunks(w, [10, 20])
    monkeypatch.undo()
    assert (w.rank_dir / SUMMARY_FILE).read_bytes() == before
    assert f"{SUMMARY_FILE}: No space left on device" in w.write_errors
    assert [p.name for p in w.rank_dir.iterdir() if p.name.endswith(".tmp")] == []


def test_a_table_file_changed_under_the_writer_stops_the_records(tmp_path: Path) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10])
    manifest = (w.rank_dir / "manifest.json").read_bytes()
    shutil.rmtree(w.rank_dir)  # removed mid-run: the writer makes the folder again
    _chunks(w, [10, 20])
    (w.rank_dir / "manifest.json").write_bytes(manifest)
    w.close({"status": "finished"})
    assert not (w.rank_dir / SUMMARY_FILE).exists()  # a record would claim steps 0-9
    summary, source, _ = _read(tmp_path / "r")
    assert (source, summary["steps"]) == ("files", list(range(10, 20)))
    # a table file emptied and written again as long as before: the record goes with it
    w = _writer(tmp_path / "s")
    _chunks(w, [0, 10])
    events = w.rank_dir / "events.jsonl"
    old = events.read_bytes()
    events.write_bytes(b"")
    w.append("events", _events(0, 10))
    assert w.flush() and events.read_bytes() == old  # the record's offsets would match it
    _chunks(w, [10, 20])
    w.close({"status": "finished"})
    assert not (w.rank_dir / SUMMARY_FILE).exists()
    summary, source, _ = _read(tmp_path / "s")
    assert (source, summary) == ("files", _from_files(w.rank_dir))


def test_write_rank_summary_compacts_a_rank_into_one_final_record(tmp_path: Path) -> None:
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10, 20])
    steps = w.rank_dir / "steps.jsonl"
    with steps.open("ab") as fh:
        fh.write(b'{"step": 99, "wind')  # a cut last line: not summarized, not covered
    (w.rank_dir / SUMMARY_FILE).write_bytes(b"")  # a record lost to a machine crash
    record = write_rank_summary(w.rank_dir)
    assert _record(w.rank_dir) == record
    # tables no row was read from (other sections' tables) count 0
    assert record["final"] and {k: n for k, n in record["rows"].items() if n} == {
        "steps": 20,
        "events": 20,
    }
    assert record["offsets"]["steps.jsonl"] == steps.stat().st_size - len(b'{"step": 99, "wind')
    assert not list(w.rank_dir.glob(".*.tmp"))
    summary, source, _ = _read(tmp_path / "r")
    assert (source, summary["steps"]) == ("records", list(range(20)))


def test_an_unreadable_rank_gets_an_empty_summary_and_hides_no_other(tmp_path: Path) -> None:
    for rank in (0, 1, 2):
        w = RunWriter(tmp_path / "r", rank, 3, {}, max_buffered_rows=100)
        _chunks(w, [0, 10])
        w.close({"status": "finished"})
    for rank in (1, 2):  # without its record, and with it
        bad = tmp_path / "r" / f"rank{rank}"
        (bad / "events.jsonl").unlink()
        (bad / "events.jsonl").mkdir()  # not a regular file
    (tmp_path / "r" / "rank1" / SUMMARY_FILE).unlink()
    loaded = load_run(tmp_path / "r")
    summaries = loaded.summaries()
    assert summaries[1] == summaries[2] == {} and summaries[0][NAME]["steps"] == list(range(10))
    assert loaded.summary_sources() == {0: "records", 1: "unreadable", 2: "unreadable"}
    for rank in (1, 2):
        assert any(x.startswith(f"rank {rank}: summary not computed") for x in loaded.warnings)


def test_without_sections_the_writer_writes_no_summary(
    tmp_path: Path, counts: type[_Counts]
) -> None:
    registered = list(SECTIONS)
    SECTIONS.clear()  # every section off (the list is the registry the writer reads)
    try:
        w = _writer(tmp_path / "r")
        _chunks(w, [0, 10])
        w.close({"status": "finished"})
        assert not (w.rank_dir / SUMMARY_FILE).exists()
        assert (w.rank_dir / "steps.jsonl").exists()
    finally:
        SECTIONS[:] = registered


def test_a_copied_rank_keeps_its_record(tmp_path: Path) -> None:
    """The record describes the files by offset, so a copy of the rank reads the same."""
    w = _writer(tmp_path / "r")
    _chunks(w, [0, 10, 15])
    shutil.copytree(tmp_path / "r", tmp_path / "copy")
    assert _read(tmp_path / "copy")[:2] == _read(tmp_path / "r")[:2]


def test_a_crashed_run_is_loaded_without_reading_every_steps_row(tmp_path: Path) -> None:
    """load_run's "ended abruptly at step N" takes N from the end of each steps file: a
    crashed 4,096-rank run is not read whole before its summaries are."""
    for rank, end in ((0, 30), (1, 25)):
        w = RunWriter(tmp_path / "r", rank, 2, {}, max_buffered_rows=100)
        _chunks(w, [0, 10, end])  # never closed
    steps = tmp_path / "r" / "rank1" / "steps.jsonl"
    with steps.open("ab") as fh:
        fh.write(b'{"step": 40, "wi')  # cut by the kill: the loader leaves it
    loaded = load_run(tmp_path / "r")
    assert "run ended abruptly at step 29 (no clean close recorded)" in loaded.warnings
    assert "steps" not in loaded._tables
    assert "summaries" not in loaded._derived
    # a damaged last row: not guessed at, the ranks' summaries say (as Run.last_step does)
    with steps.open("ab") as fh:
        fh.write(b'\n{"step": 41, "window": 0, "t": 1.0}\n{"step": "x"}\n')
    loaded = load_run(tmp_path / "r")
    assert "run ended abruptly at step 41 (no clean close recorded)" in loaded.warnings
    assert "summaries" in loaded._derived and "steps" not in loaded._tables


def test_records_are_replaced_no_more_often_than_their_interval_and_cost_allow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The training thread pays for a summary record at most every SUMMARY_INTERVAL_S, and at
    most about 1 % of its time (a large model's record costs up to hundreds of milliseconds);
    the first flush and the close always write one, and the rows between are read from the
    files' tails."""
    clock = [100.0]
    monkeypatch.setattr(writer_mod.time, "monotonic", lambda: clock[0])
    w = RunWriter(tmp_path / "r", 0, 1, {}, max_buffered_rows=1000)
    w.summary_interval_s = 10.0
    path = w.rank_dir / SUMMARY_FILE
    _chunks(w, [0, 10])
    first = path.read_bytes()
    clock[0] += 9
    _chunks(w, [10, 20])
    assert path.read_bytes() == first  # not due yet
    summary, source, _ = _read(tmp_path / "r")
    assert source == "records+tail" and summary["steps"] == list(range(20))
    clock[0] += 1
    _chunks(w, [20, 30])
    assert path.read_bytes() != first
    w.close({"status": "finished"})
    assert _record(w.rank_dir)["final"] is True


def test_a_value_the_file_holds_as_text_is_no_number_to_the_summary(tmp_path: Path) -> None:
    """Review of #33: numpy scalars given to RunWriter.append are written as text (the
    encoder's ``default=str``), which the loader reads as missing; the summary counted them."""
    np = pytest.importorskip("numpy")
    w = _writer(tmp_path / "r")
    rows = [
        {"step": s, "window": 0, "scaler_enabled": True, "skipped": np.bool_(s == 3),
         "scale_before": np.float32(65536.0), "scale_after": np.float32(65536.0)}
        for s in range(10)
    ]  # fmt: skip
    w.append("steps", rows)
    w.flush()
    from_record = load_run(tmp_path / "r").summaries()[0]["scaler"]
    (w.rank_dir / SUMMARY_FILE).unlink()
    from_files = load_run(tmp_path / "r").summaries()[0]["scaler"]
    assert from_record == from_files
    assert from_record["n"] == 0  # no scale the loader can read
