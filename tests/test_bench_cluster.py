"""benchmarks/bench_cluster_read.py builds its runs as it says (issue #33): replicas share the
source's inodes and the source is never written, the planted and damaged ranks are real copies
edited as documented, the diverging copies' summaries are made consistent while the damaged ones
keep the recorded record, the crashed variant closes no rank, the summary sources are read, and
its checks tell a named rank from one the majority group merely includes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # its `from machine import cpu_model`
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_cluster_read", BENCH / "bench_cluster_read.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def _lines(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _source(root: Path, summary: bool = False) -> Path:
    """A 1-rank source whose every record file is non-empty (40 steps, an offender at 20)."""
    rank = root / "source" / "rank0"
    rank.mkdir(parents=True)
    top = {"format": "amprobe-run", "schema_version": 1, "world_size": 1}
    (root / "source" / "manifest.json").write_text(json.dumps(top))
    (rank / "manifest.json").write_text(
        json.dumps({"schema_version": 1, "rank": 0, "hostname": "h"})
    )
    steps = [
        {"step": i, "t": 1.0 + 0.01 * (i + 1), "wall_s": 0.01, "scale_before": 2.0**16}
        | {"scale_after": 2.0**16, "growth_tracker": i, "pad": "x" * 40}
        for i in range(40)
    ]
    (rank / "steps.jsonl").write_text(_lines(steps))
    events = [
        {"kind": "scaler_created", "step": 0, "detail": json.dumps({"init_scale": 65536.0})},
        {"kind": "numerics_offender", "step": 20, "detail": "{}"},
    ]
    (rank / "events.jsonl").write_text(_lines(events))
    (rank / "numerics.jsonl").write_text(_lines([{"step": i, "amax": 1.0} for i in range(8)]))
    (rank / "offenders.jsonl").write_text(_lines([{"step": 20, "module": "fc"}]))
    for name in ("compute_ops", "compute_steps", "syncs"):
        (rank / f"{name}.jsonl").write_text(_lines([{"step": 0}]))
    (rank / "end.json").write_text(json.dumps({"status": "finished"}))
    if summary:
        from amprobe.store.run import write_rank_summary

        write_rank_summary(rank)  # the writer's final record, as close leaves it
    return root / "source"


def _snapshot(source: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(source.rglob("*")) if p.is_file()}


def test_build_links_replicas_and_edits_real_copies(bench: ModuleType, tmp_path: Path) -> None:
    source = _source(tmp_path)
    before = _snapshot(source)
    divergent, broken, how = bench.build(source, 12, tmp_path / "run")
    assert sorted(divergent.values()) == ["overflow", "scale", "slow"]
    assert broken == {11: "truncated", 10: "corrupt"}
    assert "no summary.json:" in how
    base = source / "rank0" / "steps.jsonl"
    for r in range(12):
        steps = tmp_path / "run" / f"rank{r}" / "steps.jsonl"
        assert steps.samefile(base) == (r not in divergent and r not in broken)
    truncated = tmp_path / "run" / "rank11"
    data = (truncated / "steps.jsonl").read_bytes()
    assert not data.endswith(b"\n") and 0.4 < len(data) / base.stat().st_size < 0.6
    assert not (truncated / "end.json").exists()
    for name in ("steps.jsonl", "numerics.jsonl"):  # overwritten in place: same line ends
        got = (tmp_path / "run" / "rank10" / name).read_bytes().split(b"\n")
        was = (source / "rank0" / name).read_bytes().split(b"\n")
        assert [len(x) for x in got] == [len(x) for x in was]
        changed = [g for g, w in zip(got, was, strict=True) if g != w]
        assert len(changed) == bench.GARBAGE_LINES
        assert all(g == (bench.GARBAGE * 2)[: len(g)] for g in changed)
    assert _snapshot(source) == before  # the source recording is never written


def test_edited_summaries_and_the_crashed_variant(bench: ModuleType, tmp_path: Path) -> None:
    source = _source(tmp_path, summary=True)
    recorded = json.loads((source / "rank0" / "summary.json").read_text())
    before = _snapshot(source)
    divergent, broken, how = bench.build(source, 12, tmp_path / "a")
    assert "3 diverging copies rewritten by amprobe.store.run.write_rank_summary" in how
    run = tmp_path / "a"
    template = source / "rank0" / "summary.json"
    for r in range(12):
        path = run / f"rank{r}" / "summary.json"
        record = json.loads(path.read_text())
        assert path.samefile(template) == (r not in divergent and r not in broken)
        if r in divergent:  # consistent with the edited files: every offset is a file's size
            assert record["final"] is True
            for name, offset in record["offsets"].items():
                assert (run / f"rank{r}" / name).stat().st_size == offset
        else:  # the recorded record, the damaged ranks included
            assert record == recorded
    cut = (run / "rank11" / "steps.jsonl").stat().st_size
    assert cut < recorded["offsets"]["steps.jsonl"]  # the truncated rank's offsets point past

    said = bench.summary_sources(run, {11: "truncated", 10: "corrupt"})
    assert said == "records 11, files 1; 10 (corrupt): records; 11 (truncated): files"
    # the corrupt rank's record still describes its files by offset, not by checksum
    from amprobe.store.run import load_run

    loaded = load_run(run)
    loaded.summaries()
    damaged = sorted(w.split(" differs ")[0] for w in loaded.warnings if "checksum mismatch" in w)
    assert damaged == ["rank 10: numerics.jsonl", "rank 10: steps.jsonl"]

    said = bench.crash(run)
    assert said == "11 end.json removed, 12 summary.json rewritten with final: false"
    assert not list(run.glob("rank*/end.json"))
    finals = [json.loads((run / f"rank{r}" / "summary.json").read_text()) for r in range(12)]
    assert [f["final"] for f in finals] == [False] * 12
    assert all({**f, "final": True} == recorded for r, f in enumerate(finals) if r not in divergent)
    linked = [run / f"rank{r}" / "summary.json" for r in range(12) if r not in {*divergent, 10, 11}]
    assert all(p.samefile(linked[0]) for p in linked)  # one new file for the replicas
    assert not linked[0].samefile(template)
    assert _snapshot(source) == before  # the recorded inodes were never written


def test_checks_name_apart_from_the_majority(bench: ModuleType) -> None:
    def finding(rule: str, title: str, **evidence: Any) -> dict[str, Any]:
        return {"id": rule, "title": title, "evidence": evidence}

    group = finding("AMP-N16", "a layer on ranks 0-15", rank=0, ranks=list(range(16)))
    doc = {
        "run": {"warnings": ["rank 14: 3 unreadable record(s) skipped in steps.jsonl"]},
        "findings": [
            group,
            finding("AMP-D01", "ranks 1, 6 disagree", ranks=[1, 6]),
            finding("AMP-D02", "rank 11 is slow", ranks=[11]),
        ],
    }
    planted = {1: "scale", 6: "overflow", 11: "slow"}
    lines = bench.check(doc, "", 16, planted, {15: "truncated", 14: "corrupt"})
    assert lines[1:4] == [
        "scale [1]: named: yes (by AMP-D01)",
        "overflow [6]: named: yes (by AMP-D01)",
        "slow [11]: named: yes (by AMP-D02)",
    ]
    # the corrupt rank only by its checksum: a warning of lines the loader dropped is not it
    assert lines[4] == "corrupt rank 14: reported: no"
    assert lines[5] == "truncated rank 15: reported: no"  # in the group of 16, not reported
    doc["run"]["warnings"].append(
        "rank 14: steps.jsonl differs from what its writer recorded in the 9,120 bytes it "
        "summarized (checksum mismatch): ..."
    )
    lines = bench.check(doc, "", 16, planted, {15: "truncated", 14: "corrupt"})
    assert lines[4].startswith("corrupt rank 14: reported: yes (run.warnings: rank 14: steps.")

    doc["findings"] = [group]  # the planted ranks only inside the agreeing group: not named
    lines = bench.check(doc, "", 16, planted, {})
    assert [line.split(": named: ")[1] for line in lines[1:]] == ["no", "no", "no"]
