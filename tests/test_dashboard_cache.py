"""The run page drawn from a cached diagnosis: what a computed one draws, without reading every
rank's summary first; the other tabs read the run after the findings are drawn."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("dash", reason="the dashboard needs dash (pip install 'amprobe[dashboard]')")

import dash  # noqa: E402

import amprobe  # noqa: E402
from amprobe.rules import cache  # noqa: E402
from amprobe.store import artifacts  # noqa: E402
from dashboard import callbacks, ids, layout  # noqa: E402
from dashboard.runs import LoadedRun, summarize  # noqa: E402
from tests.test_dashboard import find  # noqa: E402

SAMPLE_RUNS = Path(__file__).resolve().parent.parent / "sample_runs"


@pytest.fixture(autouse=True)
def _own_user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    base = tmp_path / "runs"
    for name in ("overflow", "misuse"):
        shutil.copytree(SAMPLE_RUNS / name, base / name, ignore=shutil.ignore_patterns("derived"))
    return base


def plain(component: Any, version: int) -> str:
    """A component tree as the JSON Dash sends, its run version (new at each load) left out."""
    text = json.dumps(component, cls=_Encoder, sort_keys=True)
    for key in ("data", "version"):
        text = text.replace(f'"{key}": {version}', f'"{key}": "<version>"')
    return text


class _Encoder(json.JSONEncoder):
    def default(self, o: Any) -> Any:
        if hasattr(o, "to_plotly_json"):
            return o.to_plotly_json()
        return super().default(o)


def open_page(root: Path, name: str, search: str = "") -> tuple[Any, LoadedRun]:
    """A fresh dashboard's run page, as first drawn, and the run version it drew."""
    ctx = callbacks.Context(root=root)
    page = callbacks.render_page(ctx, f"/run/{name}", search)
    return page, ctx.cache.get(name)


@pytest.mark.parametrize("name", ["overflow", "misuse"])
def test_the_page_from_the_cache_is_the_page_computed(root: Path, name: str) -> None:
    computed_page, computed = open_page(root, name)
    assert not computed.diagnosis.from_cache
    cached_page, cached = open_page(root, name)
    assert cached.diagnosis.from_cache, "the first load kept its diagnosis"
    assert plain(cached_page, cached.version) == plain(computed_page, computed.version)
    assert summarize(name, cached) == summarize(name, computed)  # the run list's row
    for tab in ("scale", "compute", "runtime"):  # a tab reads the run: the same from either
        query = layout.RunQuery(tab=tab)
        assert plain(layout.build_tab_body(cached, query), cached.version) == plain(
            layout.build_tab_body(computed, query), computed.version
        ), tab
    # and as the run's diagnosis had been made with no cache at all
    fresh = amprobe.diagnose(amprobe.load_run(root / name))
    assert [f.to_dict() for f in cached.diagnosis.findings] == [f.to_dict() for f in fresh.findings]


def test_the_first_paint_from_the_cache_reads_no_rank_summary(root: Path) -> None:
    open_page(root, "overflow")  # diagnosed, and kept
    ctx = callbacks.Context(root=root)
    page = callbacks.render_page(ctx, "/run/overflow", "")
    loaded = ctx.cache.get("overflow")
    assert loaded.diagnosis.from_cache
    assert "summaries" not in loaded.run._derived and not loaded.run._tables
    assert all(f.id in str(page) for f in loaded.diagnosis.findings)  # findings first
    steps = layout.step_count_text(
        loaded.diagnosis.facts["steps"], loaded.diagnosis.facts["last_step"]
    )
    assert find_text(page, ids.RUN_STEPS) == steps
    # the tab callback fired as the page mounts starts reading the run for the other tabs
    shown = {"tab": "overview", "version": loaded.version}
    assert callbacks.render_tab(ctx, "overflow", "overview", {}, "", shown) == (
        dash.no_update,
        dash.no_update,
    )
    assert loaded._prepare_started
    assert loaded.prepared() is loaded and "summaries" in loaded.run._derived
    body, _ = callbacks.render_tab(ctx, "overflow", "scale", {"step": None}, "", None)
    assert find(body, ids.LOSS_SCALE_GRAPH) is not None


def test_a_run_page_opened_on_a_tab_reads_the_run_for_it(root: Path) -> None:
    open_page(root, "overflow")
    ctx = callbacks.Context(root=root)
    callbacks.render_page(ctx, "/run/overflow", "?tab=numerics")
    body, shown = callbacks.render_tab(ctx, "overflow", "numerics", {"layer": None}, "", None)
    assert shown is not None and "amprobe failed" not in str(body)


def test_a_changed_run_is_diagnosed_again_on_its_page(root: Path) -> None:
    open_page(root, "overflow")
    with open(root / "overflow" / "rank0" / "steps.jsonl", "a") as fh:
        fh.write("{not a record}\n")
    page, loaded = open_page(root, "overflow")
    assert not loaded.diagnosis.from_cache
    assert any("unreadable record" in w for w in loaded.run.warnings)
    again_page, again = open_page(root, "overflow")
    assert again.diagnosis.from_cache and again.run.warnings == loaded.run.warnings
    assert plain(again_page, again.version) == plain(page, loaded.version)


def test_a_live_run_page_is_diagnosed_and_nothing_kept(root: Path) -> None:
    rank = root / "overflow" / "rank0"
    (rank / "end.json").unlink()
    manifest = json.loads((rank / "manifest.json").read_text())
    manifest.update(pid=os.getpid(), hostname=socket.gethostname())  # this process writes it
    (rank / "manifest.json").write_text(json.dumps(manifest))
    for _ in range(2):
        _, loaded = open_page(root, "overflow")
        assert loaded.run.status == "live" and not loaded.diagnosis.from_cache
    assert not list((root / "overflow").glob(f"{artifacts.DERIVED_DIR}/diagnosis-*.json"))
    assert cache.load_diagnosis(amprobe.load_run(root / "overflow")) is None


def test_the_run_list_keeps_and_reads_its_rows_diagnoses(root: Path) -> None:
    ctx = callbacks.Context(root=root)
    first = ctx.cache.page(1)
    assert ctx.cache.wait_idle(60)
    rows = {r.name: r for r in ctx.cache.page(1).rows}
    assert len(list((root / "misuse").glob("derived/diagnosis-*.json"))) == 1
    other = callbacks.Context(root=root)
    other.cache.page(1)
    assert other.cache.wait_idle(60)
    assert {r.name: r for r in other.cache.page(1).rows} == rows
    assert first.total == 2


def find_text(component: Any, component_id: Any) -> Any:
    hit = find(component, component_id)
    return None if hit is None else hit.children


def test_a_diagnosis_kept_by_the_cli_shows_the_warnings_the_page_computes(root: Path) -> None:
    """The CLI reads every rank's events before it diagnoses (collectors switched off): a
    damaged events line warned about then is the diagnosis's warning all the same, and the
    page drawn from what the CLI kept shows it, as the page that diagnoses does."""
    from amprobe.cli import main

    with open(root / "overflow" / "rank0" / "events.jsonl", "a") as fh:
        fh.write("{not a record}\n")
    assert main(["diagnose", str(root / "overflow")]) == 0
    page, kept = open_page(root, "overflow")
    assert kept.diagnosis.from_cache
    for path in (root / "overflow" / artifacts.DERIVED_DIR).glob("diagnosis-*.json"):
        path.unlink()
    computed_page, computed = open_page(root, "overflow")
    assert not computed.diagnosis.from_cache
    assert any("events.jsonl" in w for w in computed.run.warnings), computed.run.warnings
    assert kept.run.warnings == computed.run.warnings
    assert plain(page, kept.version) == plain(computed_page, computed.version)
