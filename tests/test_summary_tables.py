"""The ``tables`` summary section: the small tables' rows kept in the summaries, and
``Run.table`` building those frames from them (no table file opened) exactly as from the files."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

from amprobe.store import jsonl, load_run
from amprobe.store.run import write_rank_summary
from amprobe.store.sections import tables as tables_mod
from amprobe.store.sections.tables import MAX_ROWS, SMALL_TABLES, TablesSection
from amprobe.store.writer import RunWriter


def _step_row(step: int) -> dict:
    return {"step": step, "window": 0, "t": step * 0.5, "wall_s": 0.01, "scaler_enabled": False}


def _op_row(step: int, i: int) -> dict:
    return {"step": step, "module": f"fc{i}", "op": "addmm", "phase": "forward", "m": 8,
            "n": 4 + i, "k": 16, "in_dtype": "float16", "count": 1, "flops": 1024.0 * i}  # fmt: skip


def _write(root: Path, rank: int, world: int) -> None:
    w = RunWriter(root, rank, world, {"device": "cpu"}, max_buffered_rows=10_000)
    w.append("steps", [_step_row(s) for s in range(4)])
    w.append(
        "events", [{"step": 0, "t": 0.0, "kind": "run_start", "detail": json.dumps({"r": rank})}]
    )
    w.append("compute_ops", [_op_row(1, i) for i in range(3 + rank)])
    w.append("compute_steps", [{"step": 1, "matmul_flops": 3e6, "matmul_ops": 3, "tf32": False}])
    w.flush()
    w.append("steps", [_step_row(s) for s in range(4, 8)])
    w.append("events", [{"step": 5, "t": 2, "kind": "overflow", "detail": "{}"}])  # t: an int
    w.flush()
    w.close({"status": "finished", "steps": 8})


def _parsed(root: Path, table: str, ranks: int) -> pd.DataFrame:
    """The frame of ``table`` parsed from every rank's file, as ``Run.table`` did before."""
    parts = []
    for rank in range(ranks):
        got = jsonl._read_arrow(root / f"rank{rank}" / f"{table}.jsonl", table).table
        if got is not None and got.num_rows:
            parts.append(got.add_column(0, "rank", pa.array([rank] * got.num_rows, pa.int64())))
    return jsonl._to_frame(parts, table)


def test_small_tables_come_from_the_summaries_as_from_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run"
    for rank in range(3):
        _write(root, rank, 3)
    parsed = {t: _parsed(root, t, 3) for t in SMALL_TABLES}

    opened: list[str] = []
    real = jsonl._read_arrow

    def spy(path: Path, table: str, offset: int = 0):  # type: ignore[no-untyped-def]
        opened.append(Path(path).name)
        return real(path, table, offset)

    monkeypatch.setattr(jsonl, "_read_arrow", spy)
    monkeypatch.setattr("amprobe.store.run._read_arrow", spy)
    run = load_run(root)
    assert set(run.summary_sources().values()) == {"records"}
    fast = {t: run.table(t) for t in SMALL_TABLES}
    assert not any(
        n in opened for n in ("events.jsonl", "compute_ops.jsonl", "compute_steps.jsonl")
    )
    assert len(fast["compute_ops"]) == 3 + 4 + 5 and len(fast["events"]) == 6
    for t in SMALL_TABLES:
        pd.testing.assert_frame_equal(fast[t], parsed[t], check_dtype=True)
    for rank in range(3):  # one rank's rows alike, once the summaries were read
        pd.testing.assert_frame_equal(
            load_run(root).rank_table("compute_ops", rank),
            parsed["compute_ops"][parsed["compute_ops"]["rank"] == rank].reset_index(drop=True),
        )
        fresh = load_run(root)
        fresh.summaries()
        got = fresh.rank_table("events", rank)
        want = parsed["events"][parsed["events"]["rank"] == rank].reset_index(drop=True)
        pd.testing.assert_frame_equal(got.reset_index(drop=True), want, check_dtype=True)

    # rank 1 without a summary (rebuilt from its files) and rank 2 with a tail after its
    # record: both go through the section too, and the frames stay the same
    (root / "rank1" / "summary.json").unlink()
    with open(root / "rank2" / "events.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 9, "t": 4.5, "kind": "late", "detail": "{}"}) + "\n")
    with open(root / "rank0" / "events.jsonl", "a") as fh:
        fh.write('{"step": 9, "t": 4.5, "kind": "cut')  # a cut last line: rank 0 read from file
    opened.clear()
    run = load_run(root)
    assert run.summary_sources() == {0: "records", 1: "files", 2: "records+tail"}
    opened.clear()
    events = run.table("events")
    assert opened.count("events.jsonl") == 1  # rank 0 only: its file ends after its summary
    monkeypatch.setattr(jsonl, "_read_arrow", real)
    monkeypatch.setattr("amprobe.store.run._read_arrow", real)
    pd.testing.assert_frame_equal(events, _parsed(root, "events", 3), check_dtype=True)
    assert events["kind"].tolist()[-1] == "late"


def test_rewritten_summary_keeps_the_rows(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _write(root, 0, 1)
    record = write_rank_summary(root / "rank0")
    rows = record["sections"]["tables"]["compute_ops"]["rows"]
    assert [r["module"] for r in rows] == ["fc0", "fc1", "fc2"]


def _section(data: list[tuple[str, dict]]) -> dict:
    sec = TablesSection()
    for table, row in data:
        sec.add(table, row)
    return sec.to_json()


@pytest.mark.parametrize("cap", [MAX_ROWS, 5])
def test_chunks_merge_to_the_whole(cap: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tables_mod, "MAX_ROWS", cap)
    data = [("events", {"step": s, "t": s / 2, "kind": "k", "detail": "{}"}) for s in range(7)]
    data += [("compute_ops", _op_row(1, i)) for i in range(4)]
    data += [("gpu", {"t": 1.0, "gpu": 0, "gpu_util": 50.0})]
    data.insert(3, ("compute_steps", {"step": 1, "tf32": 1}))  # not a bool: read from files
    whole = _section(data)
    assert whole["compute_steps"] == {"incomplete": True}
    assert ("rows" in whole["events"]) == (cap > 7)
    n = len(data)
    for cuts in ([n // 3, 2 * n // 3], [1, n - 1], [n // 2 + 1], list(range(1, n))):
        bounds = [0, *cuts, n]
        parts = [_section(data[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
        merged = parts[0]
        for part in parts[1:]:
            merged = TablesSection.merge(merged, part)
        assert json.dumps(merged, sort_keys=True) == json.dumps(whole, sort_keys=True)
