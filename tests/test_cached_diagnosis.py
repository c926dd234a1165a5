"""The cached diagnosis (amprobe.rules.cache): what is read back is what was computed, field by
field and as every renderer draws it; it is read only while nothing it depends on changed."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

import amprobe
from amprobe.report import render_json, render_markdown, render_text
from amprobe.rules import cache
from amprobe.rules.engine import REGISTRY, Diagnosis, Finding, Severity, ThresholdError
from amprobe.store import artifacts
from amprobe.store.writer import RunWriter

SAMPLE_RUNS = Path(__file__).resolve().parent.parent / "sample_runs"
SAMPLES = ("overflow", "healthy", "misuse", "bf16", "fp8-whatif")


@pytest.fixture(autouse=True)
def _own_user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Artifacts that go to the user cache (a read-only run) go to this test's folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))


def copy_sample(name: str, dest: Path) -> Path:
    """A sample run copied without its derived files (its own cache, if any, left behind)."""
    return Path(
        shutil.copytree(SAMPLE_RUNS / name, dest / name, ignore=shutil.ignore_patterns("derived"))
    )


def write_two_ranks(run_dir: Path) -> Path:
    """``sample_runs/overflow``'s steps and numerics written by amprobe's writer as ranks 0 and
    1 of one run (each rank with its summary record)."""
    rows = {
        table: [
            json.loads(line)
            for line in (SAMPLE_RUNS / "overflow" / "rank0" / f"{table}.jsonl")
            .read_text()
            .splitlines()
            if line.strip()
        ]
        for table in ("steps", "numerics")
    }
    for rank in (0, 1):
        writer = RunWriter(run_dir, rank, 2, {"device": "cpu"}, max_buffered_rows=100_000)
        writer.append("steps", rows["steps"])
        writer.append("numerics", rows["numerics"])
        writer.close({"status": "finished", "steps": len(rows["steps"])})
    return run_dir


_PLOTLY_DIV = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def same_html(text: str) -> str:
    """A report with its figures' element ids (random UUIDs, new at each render) made equal."""
    return _PLOTLY_DIV.sub("<figure id>", text)


def artifact_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / artifacts.DERIVED_DIR).glob("diagnosis-*.json"))


def assert_same(cached: Diagnosis, computed: Diagnosis) -> None:
    """Field by field, with the types of every evidence value (``repr`` tells a tuple from a
    list and 1 from 1.0), then as each renderer draws it."""
    assert len(cached.findings) == len(computed.findings)
    for a, b in zip(cached.findings, computed.findings, strict=True):
        for field in ("id", "name", "severity", "category", "title", "fix", "refs"):
            assert getattr(a, field) == getattr(b, field), (a.id, field)
        assert a.explained_by == b.explained_by and a.explains == b.explains
        assert repr(a.evidence) == repr(b.evidence), a.id
        assert type(a.severity) is type(b.severity)
    assert cached.not_checked == computed.not_checked
    assert repr(cached.health) == repr(computed.health)
    assert repr(cached.thresholds) == repr(computed.thresholds)
    assert cached.run.warnings == computed.run.warnings
    assert render_json(cached) == render_json(computed)
    assert render_text(cached, verbose=True) == render_text(computed, verbose=True)
    assert render_markdown(cached) == render_markdown(computed)
    assert cached.worst() == computed.worst() and cached.ids() == computed.ids()


# -- read back as computed -------------------------------------------------------------------------


@pytest.mark.parametrize("name", SAMPLES)
def test_a_cached_diagnosis_is_the_computed_one_on_every_sample_run(
    name: str, tmp_path: Path
) -> None:
    run_dir = copy_sample(name, tmp_path)
    computed = cache.diagnose_cached(amprobe.load_run(run_dir))
    assert not computed.from_cache and len(artifact_files(run_dir)) == 1
    cached = cache.diagnose_cached(amprobe.load_run(run_dir))
    assert cached.from_cache
    assert_same(cached, computed)
    assert dict(cached.facts) == dict(computed.facts)
    # and what amprobe.diagnose gives, with no cache at all
    assert_same(cached, amprobe.diagnose(amprobe.load_run(run_dir)))


def test_a_multi_rank_run_reads_back_its_facts_and_warnings(tmp_path: Path) -> None:
    run_dir = write_two_ranks(tmp_path / "two")
    # a damaged line in rank 1's steps: a warning the diagnosis adds (the summaries read it)
    with open(run_dir / "rank1" / "steps.jsonl", "a") as fh:
        fh.write("{not a record}\n")
    run = amprobe.load_run(run_dir)
    loaded_warnings = list(run.warnings)
    computed = cache.diagnose_cached(run)
    assert len(run.warnings) > len(loaded_warnings)  # the diagnosis added one
    again = amprobe.load_run(run_dir)
    assert again.warnings == loaded_warnings
    cached = cache.diagnose_cached(again)
    assert cached.from_cache and again.warnings == run.warnings
    assert_same(cached, computed)
    assert cached.facts["steps"] == computed.facts["steps"] > 0
    assert cached.to_dict()["run"] == amprobe.diagnose(amprobe.load_run(run_dir)).to_dict()["run"]
    # read from the cache, the facts cost no rank summary
    assert "summaries" not in again._derived


def test_the_report_from_the_cache_is_the_computed_one(tmp_path: Path) -> None:
    from amprobe.report import render_html

    run_dir = copy_sample("overflow", tmp_path)
    run = amprobe.load_run(run_dir)
    computed = cache.diagnose_cached(run)
    html_computed = render_html(run, computed)
    again = amprobe.load_run(run_dir)
    cached = cache.diagnose_cached(again)
    assert cached.from_cache
    assert same_html(render_html(again, cached)) == same_html(html_computed)


# -- values with their types -------------------------------------------------------------------


def test_evidence_values_come_back_with_their_types() -> None:
    tag_key = next(iter(cache._TAGS))
    values: dict[str, Any] = {
        "tuple": (1, (2.5, "x"), [3, (4,)]),
        "int_keys": {0: "a", 17: {"b": (1, 2)}},
        "mixed_keys": {1: 1, "1": 2, (2, 3): 3, 1.5: 4, None: 5},
        "proxy": MappingProxyType({"k": [1, 2]}),
        "numpy": [np.int64(7), np.float32(0.1), np.float64(-2.5), np.bool_(True), np.uint8(3)],
        "floats": [math.inf, -math.inf, -0.0, 1e-310, 0.1],
        "a_tag_as_a_key": {tag_key: [1, 2]},
        "big": 2**70,
        "text": "\x00tuple<b>é",
    }
    back = cache._decode(json.loads(json.dumps(cache._encode(values))))
    assert repr(back) == repr(values)
    assert [type(v) for v in back["numpy"]] == [type(v) for v in values["numpy"]]
    assert math.copysign(1, back["floats"][2]) == -1
    nan = cache._decode(json.loads(json.dumps(cache._encode([math.nan]))))
    assert math.isnan(nan[0])


@pytest.mark.parametrize("value", [{1, 2}, object(), np.array([1, 2]), Path("x"), np.str_("s")])
def test_a_value_the_cache_cannot_give_back_is_never_stored(value: Any, tmp_path: Path) -> None:
    with pytest.raises(cache.UncacheableError):
        cache._encode({"v": value})
    run_dir = copy_sample("healthy", tmp_path)
    run = amprobe.load_run(run_dir)
    real = cache.diagnose(run)
    odd = Finding("AMP-N01", "scale-backoff", "info", "nan", "t", {"odd": value}, "fix")
    fake = Diagnosis(run, (odd,), real.not_checked, real.health, real.thresholds)
    result = cache.diagnose_cached(run, compute=lambda r: fake)
    assert result.findings == (odd,) and not artifact_files(run_dir)  # returned, not kept


# -- the key: read only while nothing it covers changed --------------------------------------------


def fresh(run_dir: Path, **options: Any) -> bool:
    """Whether a load of the run now reads its diagnosis from the cache (computed, and kept,
    otherwise)."""
    return cache.diagnose_cached(amprobe.load_run(run_dir), **options).from_cache


def test_a_changed_file_makes_the_cache_stale_and_it_is_replaced(tmp_path: Path) -> None:
    run_dir = write_two_ranks(tmp_path / "two")
    assert not fresh(run_dir) and fresh(run_dir)
    steps = run_dir / "rank1" / "steps.jsonl"
    st = steps.stat()
    os.utime(steps, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched: mtime
    assert not fresh(run_dir) and fresh(run_dir)
    with open(steps, "a") as fh:  # appended: size
        fh.write("\n")
    assert not fresh(run_dir) and fresh(run_dir)
    summary = run_dir / "rank0" / "summary.json"
    summary.write_bytes(summary.read_bytes())  # a summary record rewritten
    assert not fresh(run_dir) and fresh(run_dir)
    shutil.copytree(run_dir / "rank1", run_dir / "rank2")  # a new rank
    assert not fresh(run_dir) and fresh(run_dir)
    assert len(artifact_files(run_dir)) == 1  # replaced each time, one per set of options


def test_an_edit_that_puts_size_and_mtime_back_makes_the_cache_stale(tmp_path: Path) -> None:
    """touch -r, rsync -t, cp -p: a file edited in place whose size and mtime are put back
    (the kept diagnosis had then hidden AMP-N09: a reviewer's reproduction)."""
    run_dir = write_two_ranks(tmp_path / "two")
    assert not fresh(run_dir) and fresh(run_dir)
    steps = run_dir / "rank1" / "steps.jsonl"
    st = steps.stat()
    data = steps.read_bytes()
    steps.write_bytes(data[:-2] + (b"9" if data[-2:-1] != b"9" else b"8") + data[-1:])
    os.utime(steps, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert steps.stat().st_size == st.st_size and steps.stat().st_mtime_ns == st.st_mtime_ns
    assert not fresh(run_dir)


def test_a_rule_that_failed_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule that raised (a transient error: files, memory) is run again at the next read,
    not shown as 'rule failed' until the run changes."""
    run_dir = copy_sample("overflow", tmp_path)
    spec = REGISTRY["AMP-N05"]

    def boom(ctx: Any) -> Any:
        raise OSError(24, "Too many open files")

    monkeypatch.setitem(REGISTRY, "AMP-N05", dataclasses.replace(spec, fn=boom))
    failed = cache.diagnose_cached(amprobe.load_run(run_dir))
    assert any(n.reason.startswith("rule failed") for n in failed.not_checked)
    assert not artifact_files(run_dir)
    monkeypatch.undo()
    again = cache.diagnose_cached(amprobe.load_run(run_dir))
    assert not again.from_cache and "AMP-N05" in again.ids()


def test_options_rules_and_version_are_in_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = copy_sample("overflow", tmp_path)
    assert not fresh(run_dir) and fresh(run_dir)
    other = {"AMP-N02": {"warn_below": 0.5}}
    assert not fresh(run_dir, thresholds=other) and fresh(run_dir, thresholds=other)
    assert fresh(run_dir)  # kept beside the default one, not over it
    assert len(artifact_files(run_dir)) == 2
    assert not fresh(run_dir, only=["AMP-N01"]) and fresh(run_dir, only=["AMP-N01"])
    assert (
        cache.diagnose_cached(amprobe.load_run(run_dir), only=["AMP-N01"]).ids()
        == amprobe.diagnose(amprobe.load_run(run_dir), only=["AMP-N01"]).ids()
    )
    with pytest.raises(ThresholdError):
        cache.diagnose_cached(amprobe.load_run(run_dir), thresholds={"AMP-N02": {"nope": 1.0}})

    monkeypatch.setattr(cache, "__version__", "0.0.0-other")
    assert not fresh(run_dir) and fresh(run_dir)
    spec = REGISTRY["AMP-N01"]
    monkeypatch.setitem(REGISTRY, "AMP-N01", dataclasses.replace(spec, severity=Severity.ERROR))
    assert not fresh(run_dir) and fresh(run_dir)
    thresholds = {**spec.thresholds, "extra": 1.0}
    monkeypatch.setitem(REGISTRY, "AMP-N01", dataclasses.replace(spec, thresholds=thresholds))
    assert not fresh(run_dir)  # a default threshold changed


def test_the_baseline_run_a_run_names_is_in_the_key(tmp_path: Path) -> None:
    baseline = copy_sample("healthy", tmp_path / "fp32")
    run_dir = copy_sample("overflow", tmp_path / "amp")
    manifest = run_dir / "rank0" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["baseline_run"] = str(baseline)
    manifest.write_text(json.dumps(data))
    assert not fresh(run_dir) and fresh(run_dir)
    with open(baseline / "rank0" / "steps.jsonl", "a") as fh:
        fh.write("\n")
    assert not fresh(run_dir) and fresh(run_dir)


def test_the_dashboards_listing_gives_the_same_key_as_the_cli(tmp_path: Path) -> None:
    from dashboard.runs import inspect_run

    run_dir = write_two_ranks(tmp_path / "two")
    (run_dir / "control.json").write_text("{}")  # read by no reader of the findings
    (run_dir / "rank0" / "control_ack.json").write_text("{}")
    listing = artifacts.entries_of(inspect_run(tmp_path, run_dir))
    assert listing == artifacts.source_entries(run_dir)
    assert {"manifest.json", "rank0/summary.json", "rank1/end.json"} <= {e[0] for e in listing}
    assert "control.json" not in {e[0] for e in listing}


def test_a_live_run_is_never_read_from_nor_written_to_the_cache(tmp_path: Path) -> None:
    run_dir = copy_sample("overflow", tmp_path)
    live = amprobe.load_run(run_dir)
    live.status = "live"
    assert not cache.diagnose_cached(live).from_cache and not artifact_files(run_dir)
    assert not fresh(run_dir) and fresh(run_dir)  # finished: kept
    live = amprobe.load_run(run_dir)
    live.status = "live"
    assert not cache.diagnose_cached(live).from_cache  # a fresh one there: not read
    assert cache.load_diagnosis(live) is None


# -- where, and what cannot be read ------------------------------------------------------------


def test_a_read_only_run_keeps_its_diagnosis_in_the_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = copy_sample("overflow", tmp_path)
    real = artifacts.writable
    monkeypatch.setattr(artifacts, "writable", lambda f: f.parent != run_dir and real(f))
    assert not fresh(run_dir) and fresh(run_dir)
    assert not artifact_files(run_dir)
    kept = list((tmp_path / "user-cache" / "amprobe" / "derived").glob("*/diagnosis-*.json"))
    assert len(kept) == 1
    assert kept[0].parent.name == artifacts.cache_key(amprobe.load_run(run_dir))


@pytest.mark.parametrize(
    "damage",
    [
        "garbage",
        "empty",
        "other key",
        "wrong payload",
        "fifo",
        "wrong facts",
        "deep",
        "dtype",
        "overflow",
    ],
)
def test_a_damaged_cache_is_computed_again_and_replaced(damage: str, tmp_path: Path) -> None:
    run_dir = copy_sample("overflow", tmp_path)
    assert not fresh(run_dir)
    (path,) = artifact_files(run_dir)
    obj = json.loads(path.read_text())
    path.unlink()
    if damage == "garbage":
        path.write_text("{not json")
    elif damage == "empty":
        path.write_text("")
    elif damage == "other key":
        path.write_text(json.dumps({**obj, "key": "0" * 32}))
    elif damage == "wrong payload":
        bad = {**obj["payload"], "findings": [{"id": "AMP-N01"}]}
        path.write_text(json.dumps({**obj, "payload": bad}))
    elif damage == "wrong facts":  # JSON of the right layout, values of the wrong types
        bad = {**obj["payload"], "facts": {**obj["payload"]["facts"], "steps": "many"}}
        path.write_text(json.dumps({**obj, "payload": bad}))
    elif damage == "deep":  # deeper than a reader recurses: computed again, not raised
        bad = {**obj["payload"], "health": {"x": {"v": "DEEP"}}}
        deep = "[" * 100_000 + "1" + "]" * 100_000
        path.write_text(json.dumps({**obj, "payload": bad}).replace('"DEEP"', deep))
    elif damage == "overflow":
        evidence = {"\x00numpy": ["|u1", 99999]}  # out of its dtype's range (OverflowError)
        findings = [{**obj["payload"]["findings"][0], "evidence": evidence}]
        bad = {**obj["payload"], "findings": findings}
        path.write_text(json.dumps({**obj, "payload": bad}))
    elif damage == "dtype":
        evidence = {"\x00numpy": ["O", 1]}  # an object array's dtype: never made
        findings = [{**obj["payload"]["findings"][0], "evidence": evidence}]
        bad = {**obj["payload"], "findings": findings}
        path.write_text(json.dumps({**obj, "payload": bad}))
    else:
        os.mkfifo(path)  # never blocks the reader
    computed = cache.diagnose_cached(amprobe.load_run(run_dir))
    assert not computed.from_cache
    assert fresh(run_dir)  # replaced (a FIFO too: the rename replaces the name)
    assert computed.ids() == amprobe.diagnose(amprobe.load_run(run_dir)).ids()


# -- the CLI ---------------------------------------------------------------------------------------


def test_diagnose_computes_and_keeps_the_report_reads_what_it_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from amprobe.cli import main

    run_dir = copy_sample("overflow", tmp_path)
    calls: list[str] = []
    real = cache.diagnose

    def counting(run: Any, **kwargs: Any) -> Any:
        calls.append(run.path.name)
        return real(run, **kwargs)

    monkeypatch.setattr(cache, "diagnose", counting)
    assert main(["diagnose", str(run_dir), "--format", "json"]) == 0
    first = capsys.readouterr().out
    assert len(calls) == 1 and len(artifact_files(run_dir)) == 1
    assert main(["diagnose", str(run_dir), "--format", "json"]) == 0
    assert len(calls) == 2, "diagnose computes every time"
    assert capsys.readouterr().out == first

    def failing(run: Any, **kwargs: Any) -> Any:
        raise AssertionError("the report diagnosed again")

    monkeypatch.setattr(cache, "diagnose", failing)
    out = tmp_path / "report.md"
    assert main(["report", str(run_dir), "-o", str(out)]) == 0
    monkeypatch.setattr(cache, "diagnose", counting)
    (run_dir / "derived").rename(tmp_path / "moved-away")
    computed = tmp_path / "computed.md"
    assert main(["report", str(run_dir), "-o", str(computed)]) == 0
    assert len(calls) == 3  # no cache: diagnosed
    assert out.read_text() == computed.read_text()


def test_a_listing_keeps_only_what_the_readers_read() -> None:
    listing = [
        ("manifest.json", 10, 1, 1),
        ("control.json", 10, 1, 1),
        ("rank0", "/"),
        ("rank0/steps.jsonl", 5, 2, 2),
        ("rank0/summary.json", 7, 3, 3),
        ("rank0/control_ack.json", 1, 1, 1),
        ("rank\u00b2/steps.jsonl", 5, 2, 2),  # looks like a rank, is not one
        ("rank1/sub/steps.jsonl", 5, 2, 2),
        ("derived/diagnosis-x.json", 1, 1, 1),
    ]
    assert artifacts.entries_of(listing) == [
        ("manifest.json", 10, 1, 1),
        ("rank0/steps.jsonl", 5, 2, 2),
        ("rank0/summary.json", 7, 3, 3),
    ]
    assert [r[0] for r in listing if len(r) == 4 and artifacts.is_source(r[0])] == [
        "manifest.json",
        "rank0/steps.jsonl",
        "rank0/summary.json",
    ]
