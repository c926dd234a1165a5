"""What makes `diagnose` of thousands of ranks cheap reads the same as before (issue #33):
the summary records parsed by orjson where it reads as json does, the collector's pause,
AMP-S05's per-rank shares from whole columns and the alignment of repeated op shapes."""

from __future__ import annotations

import gc
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

import amprobe
from amprobe.analysis.compute import alignment_frame
from amprobe.store import run as run_mod
from amprobe.store import writer as writer_mod
from amprobe.store.run import _decode_record, gc_paused, load_run
from amprobe.store.summary import SECTIONS, Section
from amprobe.store.writer import RunWriter
from tests.helpers import fake_run
from tests.test_compute_rules import AMP_EVENTS, cstep, op

ODD = "_test_odd_numbers"


class _OddNumbers(Section):
    """A section whose record holds what orjson does not read as json does."""

    name: ClassVar[str] = ODD
    tables: ClassVar[tuple[str, ...]] = ("steps",)

    def __init__(self) -> None:
        self.rows = 0

    def add(self, table: str, row: Mapping[str, Any]) -> None:
        self.rows += 1

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "nan": math.nan,
            "inf": -math.inf,
            "big": 2**70,
            "low": -(2**63) - 1,
            "text": "é\U0001f600",
        }

    @classmethod
    def merge(cls, first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
        return {**first, "rows": first["rows"] + second["rows"]}


@pytest.fixture
def odd_section(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(writer_mod, "SUMMARY_INTERVAL_S", 0.0)
    monkeypatch.setattr(writer_mod, "SUMMARY_COST_FACTOR", 0.0)
    SECTIONS.append(_OddNumbers)
    try:
        yield
    finally:
        SECTIONS.remove(_OddNumbers)


def test_a_record_orjson_cannot_read_alike_is_read_as_the_record(
    tmp_path: Path, odd_section: None
) -> None:
    """NaN, infinities and integers past 64 bits in a record: the rank is read from its record
    (not rebuilt from its files with a warning), with json's values (2**70 an int)."""
    w = RunWriter(tmp_path / "r", 0, 1, {}, max_buffered_rows=10_000)
    w.append("steps", [{"step": i, "window": 0, "t": 0.1 * i, "wall_s": 0.1} for i in range(5)])
    assert w.flush()
    w.close({"status": "finished"})
    text = (w.rank_dir / "summary.json").read_bytes()
    assert b"NaN" in text and str(2**70).encode() in text
    loaded = load_run(tmp_path / "r")
    got = loaded.summaries()[0][ODD]
    assert loaded.summary_sources() == {0: "records"}
    assert not [x for x in loaded.warnings if "summary" in x]
    assert math.isnan(got["nan"]) and got["inf"] == -math.inf
    assert got["big"] == 2**70 and isinstance(got["big"], int)
    assert got["low"] == -(2**63) - 1 and isinstance(got["low"], int)
    assert got["text"] == "é\U0001f600" and got["rows"] == 5


@pytest.mark.parametrize(
    "text",
    [
        b'{"a":1,"b":[2.5,-0.0,1e-7,0.0022144317626953125],"a":3,"c":{"d":null,"e":true}}',
        b'{"n":9223372036854775807,"m":-9223372036854775808,"x":1.7976931348623157e308}',
        b'{"big":18446744073709551616,"neg":-9223372036854775809}',  # floats to orjson
        b'{"v":[NaN,Infinity,-Infinity]}',
        b'{"s":"\\ud800","t":"\\u00e9\\ud83d\\ude00"}',
        b'\xef\xbb\xbf{"bom":1}',
        b"12345678901234567890123",
        b'{"over":1e400}',
        b'{"layer_12345678901234567890":"12345678901234567890"}',
    ],
)
def test_decode_record_reads_what_json_reads(text: bytes) -> None:
    want, got = json.loads(text), _decode_record(text)
    assert repr(got) == repr(want)
    assert json.dumps(got) == json.dumps(want)  # types and key order too


@pytest.mark.parametrize("text", [b"", b"{", b'{"a":}', b"\xff\xfe"])
def test_decode_record_refuses_what_json_refuses(text: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        _decode_record(text)


def test_the_pause_leaves_no_young_collection_behind_and_frees_cycles_later() -> None:
    """After a pause, what it allocated is in the oldest generation (no collection of it all
    at the next allocation); a cycle made in it is still freed by a full collection."""
    if not gc.isenabled():
        pytest.skip("the collector is off in this process")

    class Node:
        pass

    collections: list[tuple[str, int]] = []

    def seen(phase: str, info: dict[str, Any]) -> None:
        collections.append((phase, info["generation"]))

    gc.collect()
    gc.callbacks.append(seen)
    try:
        with gc_paused():
            held = [[i] for i in range(50_000)]
            cycle = Node()
            cycle.me = cycle  # type: ignore[attr-defined]
            assert not gc.isenabled()
            with gc_paused():  # nested: the outer pause ends it
                pass
            assert not gc.isenabled()
            assert gc.get_count()[0] > 50_000
        after = [[i] for i in range(100)]  # allocations that would start the collection
    finally:
        gc.callbacks.remove(seen)
    assert gc.isenabled()
    assert collections == []  # none: not the 50,000 lists walked at the first allocation
    assert gc.get_count()[0] <= len(after) + 10
    assert any(x is held[0] for x in gc.get_objects(generation=2))
    assert len(held) == 50_000
    del cycle
    assert gc.collect() > 0  # the cycle was collectable: nothing was left frozen
    assert gc.get_freeze_count() == 0


def test_the_pause_thaws_no_objects_someone_else_froze(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(run_mod.gc, "get_freeze_count", lambda: 7)
    monkeypatch.setattr(run_mod.gc, "unfreeze", lambda: calls.append("unfreeze"))
    monkeypatch.setattr(run_mod.gc, "freeze", lambda: calls.append("freeze"))
    with gc_paused():
        pass
    assert calls == []


def _ranks_run(ops_by_rank: dict[int, list[dict[str, Any]]]) -> Any:
    ops, steps = [], []
    for rank, rows in ops_by_rank.items():
        ops += [{**row, "rank": rank} for row in rows]
        steps.append({**cstep(sum(o["flops"] for o in rows), 1e6), "rank": rank})
    return fake_run(
        steps=[{"step": s, "wall_s": 0.1, "rank": r} for r in ops_by_rank for s in range(4)],
        events=[
            {"kind": "model_params", "trainable_params": 5_000_000, "params": 5_000_000},
            *AMP_EVENTS,
        ],
        manifest={"config": {"collectors": ["scaler", "compute"]}},
        ranks=list(ops_by_rank),
        tables={"compute_ops": ops, "compute_steps": steps},
    )


def test_s05_judges_each_rank_by_its_own_half_share() -> None:
    """Ranks given in no order, of other shares and dtype mixes: each rank's finding holds
    its own share (rank 2, all half, has none), as the frame per rank gave it."""
    fp32 = {"dtype": "float32", "autocast": "outside"}
    run = _ranks_run(
        {
            3: [op("a", 8, 8, 8, flops=10.0), op("b", 8, 8, 8, flops=90.0, **fp32)],
            0: [op("a", 8, 8, 8, flops=10.0), op("b", 8, 8, 8, flops=90.0, **fp32)],
            2: [op("a", 8, 8, 8, flops=100.0)],
            1: [
                op("a", 8, 8, 8, flops=20.0, dtype="float16"),
                op("c", 8, 8, 8, flops=10.0, dtype="float8_e4m3fn"),
                op("b", 8, 8, 8, flops=70.0, **fp32),
            ],
        }
    )
    (f,) = amprobe.diagnose(run, only=["AMP-S05"]).findings
    assert f.evidence["ranks"] == [0, 1, 3]
    assert f.evidence["by_rank"]["0, 3"]["half_flop_share"] == 0.1
    assert f.evidence["by_rank"]["1"]["half_flop_share"] == 0.3
    assert "only 10% to 30% of matmul FLOPs" in f.title and f.title.endswith("on ranks 0-1, 3")


def test_alignment_frame_judges_repeated_shapes_alike_each_row_its_own_dicts() -> None:
    ops = fake_run(
        tables={
            "compute_ops": [
                op("a", 64, 100, 64, flops=25.0),
                op("b", 64, 100, 64, flops=25.0),
                op("c", 64, 96, 64, flops=25.0),
                op("d", 64, 100, 64, flops=25.0, dtype="float32"),
            ]
        }
    ).table("compute_ops")
    frame = alignment_frame(ops)
    assert frame["misaligned"].tolist() == [{"N": 100}, {"N": 100}, {}, {}]
    assert frame["suggested"].tolist() == [{"N": 104}, {"N": 104}, {}, {}]
    assert frame["aligned"].tolist() == [False, False, True, None]
    assert frame["multiple"].tolist()[:3] == [8, 8, 8] and math.isnan(frame["multiple"].iloc[3])
    assert frame["tile_waste"].tolist() == [{}, {}, {96: 128}, {}]
    frame["misaligned"].iloc[0]["N"] = 0  # a reader that edits one row's dict edits no other
    assert frame["misaligned"].iloc[1] == {"N": 100}


class _Summaries:
    """A run as section_keys reads it: its summaries, and derived values kept once."""

    def __init__(self, summaries: dict[int, dict[str, Any]]) -> None:
        self._summaries = summaries
        self.computed: list[str] = []
        self._derived: dict[str, Any] = {}

    def summaries(self) -> dict[int, dict[str, Any]]:
        return self._summaries

    def cached(self, key: str, compute: Any) -> Any:
        if key not in self._derived:
            self.computed.append(key)
            self._derived[key] = compute(self)
        return self._derived[key]


def test_section_keys_are_equal_only_for_equal_sections_and_made_once() -> None:
    from amprobe.analysis.frames import section_keys

    def numerics(amax: float) -> dict[str, Any]:
        return {"rows": 3, "layers": [{"module": "fc", "amax": amax, "hist": {"b": "1,2"}}]}

    run = _Summaries(
        {
            0: {"numerics": numerics(2.5)},
            1: {"numerics": numerics(2.5)},  # equal, another object
            2: {"numerics": numerics(2.5000000000000004)},
            3: {},
            4: {"numerics": {}},
            5: {"numerics": {"rows": 3, "layers": [{"hist": {"b": "1,2"}, "module": "fc"}]}},
        }
    )
    keys = section_keys(run, "numerics")  # type: ignore[arg-type]
    assert keys[0] == keys[1]
    assert len({keys[0], keys[2], keys[3], keys[4], keys[5]}) == 5
    assert section_keys(run, "numerics") is keys  # type: ignore[arg-type]
    assert run.computed == ["section_keys:numerics"]
