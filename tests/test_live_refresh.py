"""A live run read again reads only what was appended (issue #33): ``Run.summaries(refresh=True)``
and a later load that adopts them continue each rank from where the last read ended, and the
dashboard's live tick reads no table beyond that."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

import amprobe
import amprobe.store.run as store_run
from amprobe.store.run import write_rank_summary

pytest.importorskip("dash", reason="the dashboard needs dash (pip install 'amprobe[dashboard]')")

import dash  # noqa: E402

from dashboard.demo import SyntheticLiveRun, _step_rows, write_synthetic_run  # noqa: E402

RANKS = 3


def _live_run(path: Path, steps: int = 20) -> SyntheticLiveRun:
    """A live run of ``RANKS`` ranks (copies of one), each with a ``summary.json``."""
    live = SyntheticLiveRun(path, steps=steps)
    for rank in range(1, RANKS):
        shutil.copytree(path / "rank0", path / f"rank{rank}")
    for rank in range(RANKS):
        write_rank_summary(path / f"rank{rank}")
    return live


def _append(path: Path, rank: int, first: int, count: int) -> None:
    import numpy as np

    lines = _step_rows(first, count, np.random.default_rng(first))
    with open(path / f"rank{rank}" / "steps.jsonl", "a", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")


@pytest.fixture()
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every table read the summaries make: (rank folder/file, offset)."""
    got: list[tuple[str, int]] = []
    real = store_run._read_arrow

    def spy(path: Path, table: str, offset: int = 0) -> Any:
        got.append((f"{Path(path).parent.name}/{Path(path).name}", offset))
        return real(path, table, offset)

    monkeypatch.setattr(store_run, "_read_arrow", spy)
    return got


def _rows(run: amprobe.Run) -> dict[int, int]:
    return {r: s["steps"]["rows"] for r, s in run.summaries().items()}


def test_refresh_reads_only_the_bytes_appended_since_the_last_read(
    tmp_path: Path, reads: list[tuple[str, int]]
) -> None:
    path = tmp_path / "live"
    _live_run(path)
    reads.clear()  # writing the records read the files
    run = amprobe.load_run(path)
    assert run.status == "live" and _rows(run) == {0: 20, 1: 20, 2: 20}
    assert reads == []  # every rank's record covers its files
    steps = path / "rank1" / "steps.jsonl"
    size = steps.stat().st_size
    _append(path, 1, 20, 5)
    run.summaries(refresh=True)
    assert reads == [("rank1/steps.jsonl", size)]
    assert _rows(run) == {0: 20, 1: 25, 2: 20}
    # the record still ends where it did: the next refresh goes on from the last read's end,
    # not from the record's offset (which would read the first 5 rows again)
    reads.clear()
    grown = steps.stat().st_size
    _append(path, 1, 25, 3)
    run.summaries(refresh=True)
    assert reads == [("rank1/steps.jsonl", grown)]
    assert _rows(run) == {0: 20, 1: 28, 2: 20}
    # the same summary as a fresh read of the files
    reads.clear()
    fresh = amprobe.load_run(path).summaries()
    assert fresh[1] == run.summaries()[1]
    # a record not replaced since it was read is not read again (one stat a rank)
    opened: list[int] = []
    real_record = store_run._read_record

    def record_spy(rank: int, folder: str) -> Any:
        opened.append(rank)
        return real_record(rank, folder)

    mp = pytest.MonkeyPatch()
    mp.setattr(store_run, "_read_record", record_spy)
    try:
        run.summaries(refresh=True)
        assert opened == [] and _rows(run) == {0: 20, 1: 28, 2: 20}
        # a record that now covers more than was read is taken as it is: nothing else read
        write_rank_summary(path / "rank1")
        reads.clear()
        run.summaries(refresh=True)
        assert opened == [1] and reads == []
    finally:
        mp.undo()
    reads.clear()
    run.summaries(refresh=True)
    assert reads == [] and _rows(run) == {0: 20, 1: 28, 2: 20}


def test_a_run_loaded_again_adopts_the_summaries_read_before(
    tmp_path: Path, reads: list[tuple[str, int]]
) -> None:
    """No record at all (an older writer, or none flushed yet): the first read reads every
    file once; a later load of the run adopting those summaries reads only the new bytes."""
    path = tmp_path / "live"
    write_synthetic_run(path, 20, live=True)
    shutil.copytree(path / "rank0", path / "rank1")
    first = amprobe.load_run(path)
    first.summaries()
    assert {name for name, offset in reads if offset == 0} >= {
        "rank0/steps.jsonl",
        "rank1/steps.jsonl",
    }
    size = (path / "rank0" / "steps.jsonl").stat().st_size
    _append(path, 0, 20, 4)
    reads.clear()
    again = amprobe.load_run(path)
    again.adopt_summaries(first)
    assert {r: s["steps"]["rows"] for r, s in again.summaries().items()} == {0: 24, 1: 20}
    assert reads == [("rank0/steps.jsonl", size)]
    assert first.summaries()[0]["steps"]["rows"] == 20  # the earlier run is left as it was
    # a truncated file is not continued from past its end: the rank is read again in full
    (path / "rank1" / "steps.jsonl").write_text("")
    reads.clear()
    third = amprobe.load_run(path)
    third.adopt_summaries(again)
    assert third.summaries()[1]["steps"]["rows"] == 0
    assert ("rank1/steps.jsonl", 0) in reads


def test_a_live_tick_and_the_rediagnosis_read_only_the_appended_bytes(
    tmp_path: Path, reads: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dashboard's live tick polls the summaries (each rank's record, and the bytes past
    the last poll), and the run diagnosed again adopts what the tick read: appending rows to
    one rank of a live run reads that rank's new bytes once, and nothing else."""
    from dashboard import callbacks, runs

    monkeypatch.setattr(runs, "LIVE_COST_FACTOR", 0.0)  # diagnose again at every change
    path = tmp_path / "live"
    _live_run(path)
    ctx = callbacks.Context(root=tmp_path, refresh_ms=0)
    callbacks.render_page(ctx, "/run/live")
    version = ctx.cache.get("live").version
    reads.clear()
    text, *_ = callbacks.refresh_live(ctx, 1, "live", version)
    assert text.startswith("20 steps (last step 19)")
    assert reads == []  # the first tick goes on from the summaries the page's load read
    size = (path / "rank1" / "steps.jsonl").stat().st_size
    _append(path, 1, 20, 5)
    reads.clear()
    text, _, new_version, disabled = callbacks.refresh_live(ctx, 2, "live", version)
    assert text.startswith("25 steps (last step 24); findings as of step 24"), text
    assert new_version not in (version, dash.no_update) and disabled is False
    assert reads == [("rank1/steps.jsonl", size)]
    assert ctx.tail.offsets(path.resolve())[1] == (path / "rank1" / "steps.jsonl").stat().st_size
    # the record still ends where it did: the next tick goes on from where this one ended
    grown = (path / "rank1" / "steps.jsonl").stat().st_size
    _append(path, 1, 25, 3)
    reads.clear()
    text, *_ = callbacks.refresh_live(ctx, 3, "live", new_version)
    assert text.startswith("28 steps (last step 27); findings as of step 27"), text
    assert reads == [("rank1/steps.jsonl", grown)]
    # the tab and header callbacks that follow a tick take its status: no manifest re-read
    monkeypatch.setattr(amprobe, "load_run", lambda *_: pytest.fail("manifests read again"))
    assert ctx.cache.get("live").run.status == "live"


def test_a_rank_whose_record_does_not_match_goes_on_from_its_last_read(
    tmp_path: Path, reads: list[tuple[str, int]]
) -> None:
    """A rank whose summary.json claims more than its files hold (a truncated rank, a copied
    record) is summarized from its files once, and then continued like the others, not read
    in full again at every refresh."""
    path = tmp_path / "live"
    _live_run(path, steps=30)
    shutil.copyfile(path / "rank0" / "summary.json", path / "rank2" / "summary.json")
    with open(path / "rank2" / "steps.jsonl", "r+b") as fh:  # cut after 10 whole rows
        data = fh.read()
        fh.seek(0)
        fh.truncate()
        fh.write(b"".join(line + b"\n" for line in data.split(b"\n")[:10]))
    reads.clear()
    run = amprobe.load_run(path)
    assert _rows(run)[2] == 10 and run.summary_sources()[2] == "files"
    assert any("rank 2: summary.json does not match" in w for w in run.warnings)
    size = (path / "rank2" / "steps.jsonl").stat().st_size
    _append(path, 2, 10, 2)
    reads.clear()
    run.summaries(refresh=True)
    assert reads == [("rank2/steps.jsonl", size)] and _rows(run)[2] == 12
