"""Dashboard callbacks, figures and run access, by direct call (no browser)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("dash", reason="the dashboard needs dash (pip install 'amprobe[dashboard]')")

import re  # noqa: E402

import dash  # noqa: E402
import plotly.graph_objects as go  # noqa: E402

import amprobe  # noqa: E402
from amprobe.report.downsample import minmax_indices, thin_figure  # noqa: E402
from amprobe.report.sections import section_tabs  # noqa: E402
from dashboard import callbacks, ids, layout  # noqa: E402
from dashboard.demo import SyntheticLiveRun, record_amp_run, write_synthetic_run  # noqa: E402
from dashboard.figures import (  # noqa: E402
    make_compare_figure,
    make_loss_scale_figure,
    make_step_time_figure,
    scale_events,
)
from dashboard.runs import LiveTail, RunAccessError, discover_runs, resolve_run  # noqa: E402
from tests.helpers import recorded_rows  # noqa: E402


def texts(component: Any) -> list[str]:
    """Every string in a component tree (children and string props), depth first."""
    out: list[str] = []
    if component is None:
        return out
    if isinstance(component, str):
        return [component]
    if isinstance(component, (list, tuple)):
        for c in component:
            out.extend(texts(c))
        return out
    for prop in ("children", "label", "data", "id"):
        value = getattr(component, prop, None)
        if isinstance(value, str):
            out.append(value)
        elif value is not None and prop in ("children", "label"):
            out.extend(texts(value))
        elif prop == "data" and isinstance(value, list):  # a DataTable's rows
            out.extend(v for row in value if isinstance(row, dict) for v in row.values())
    for prop in ("tabs",):
        out.extend(texts(getattr(component, prop, None)))
    return out


def find(component: Any, component_id: Any) -> Any:
    if isinstance(component, (list, tuple)):
        for c in component:
            hit = find(c, component_id)
            if hit is not None:
                return hit
        return None
    if getattr(component, "id", None) == component_id:
        return component
    children = getattr(component, "children", None)
    return (
        find(children, component_id)
        if children is not None and not isinstance(children, str)
        else None
    )


def open_tab(ctx: callbacks.Context, name: str, tab: str, search: str = "") -> Any:
    """The body of run ``name``'s tab ``tab``, as the tab callback builds it when opened."""
    focus = layout.RunQuery.parse(search).on_tab(tab).focus()
    body, shown = callbacks.render_tab(ctx, name, tab, focus, search, None)
    assert shown is None or shown["tab"] == tab
    return body


def write_two_ranks(run_dir: Path) -> Path:
    """``sample_runs/overflow``'s steps and numerics written by amprobe's writer as ranks 0
    and 1 of one 2-rank run (as ``tests/test_figures_truth.py`` builds it)."""

    from amprobe.store.writer import RunWriter

    steps = recorded_rows(SAMPLE_RUNS / "overflow", "steps")
    numerics = recorded_rows(SAMPLE_RUNS / "overflow", "numerics")
    for rank in (0, 1):
        writer = RunWriter(run_dir, rank, 2, {"device": "cpu"}, max_buffered_rows=100_000)
        writer.append("steps", steps)
        writer.append("numerics", numerics)
        writer.close({"status": "finished", "steps": len(steps)})
    return run_dir


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("runs")
    record_amp_run(base / "amp", steps=30)
    write_synthetic_run(base / "group" / "synthetic", steps=20_000)
    (base / ".hidden").mkdir()
    write_synthetic_run(base / ".hidden" / "secret", steps=5)
    (base / "not_a_run").mkdir()
    return base


@pytest.fixture()
def ctx(root: Path) -> callbacks.Context:
    return callbacks.Context(root=root)


# -- downsampling -------------------------------------------------------------------------


def test_minmax_keeps_short_series_whole() -> None:
    assert minmax_indices(np.arange(10.0), 2000).tolist() == list(range(10))


def test_minmax_thins_long_series_and_keeps_spikes_and_ends() -> None:
    y = np.zeros(100_000)
    y[54_321] = 1e9
    y[77_777] = -5.0
    y[1000] = np.nan
    keep = minmax_indices(y, 2000)
    assert len(keep) <= 2000
    assert {0, 54_321, 77_777, 99_999} <= set(keep.tolist())
    assert np.all(np.diff(keep) > 0)


def test_thin_figure_scatter_and_heatmap() -> None:
    y = np.ones(50_000)
    y[12_345] = 7.0
    z = np.zeros((3, 5000))
    z[1, 4321] = 3.0
    fig = go.Figure([go.Scatter(x=np.arange(50_000), y=y), go.Heatmap(z=z, x=np.arange(5000))])
    thin_figure(fig, max_points=1000, max_columns=500)
    assert (
        len(fig.data[0].y) <= 1000 and 7.0 in list(fig.data[0].y) and 12_345 in list(fig.data[0].x)
    )
    pooled = np.asarray(fig.data[1].z)
    assert pooled.shape == (3, 500) and pooled.max() == 3.0 and pooled[1].argmax() == 4321 // 10


# -- run access ---------------------------------------------------------------------------


def test_discover_runs_lists_nested_runs_and_skips_hidden(root: Path) -> None:
    assert discover_runs(root) == ["amp", "group/synthetic"]


@pytest.mark.parametrize(
    "name",
    [
        "../amp",
        "/etc",
        "amp/../../x",
        "group/../..",
        "",
        "not_a_run",
        "a\\..\\b",
        "missing",
        "amp\x00",
    ],
)
def test_resolve_run_refuses_names_outside_root_or_not_runs(root: Path, name: str) -> None:
    with pytest.raises(RunAccessError):
        resolve_run(root, name)


def test_resolve_run_refuses_symlink_leaving_root(root: Path, tmp_path: Path) -> None:
    outside = write_synthetic_run(tmp_path / "outside", steps=3)
    link = root / "link_out"
    link.symlink_to(outside, target_is_directory=True)
    try:
        with pytest.raises(RunAccessError):
            resolve_run(root, "link_out")
        assert "link_out" not in discover_runs(root)
    finally:
        link.unlink()


def test_resolve_run_accepts_nested_run(root: Path) -> None:
    assert resolve_run(root, "group/synthetic") == (root / "group" / "synthetic").resolve()


# -- figures ------------------------------------------------------------------------------


def test_loss_scale_figure_on_recorded_run(root: Path) -> None:
    steps = amprobe.load_run(root / "amp").steps
    fig = make_loss_scale_figure(steps)
    assert fig.layout.yaxis.type == "log"
    names = [t.name for t in fig.data]
    skipped = next(t for t in fig.data if t.name == "skipped step")
    assert sorted(skipped.x) == sorted(steps.loc[steps["skipped"].astype(bool), "step"].tolist())
    assert len(skipped.x) >= 2
    assert "backoff" in names and "growth" in names and "loss" in names


def test_scale_events_from_hand_built_frame() -> None:
    steps = pd.DataFrame(
        {
            "rank": [0, 0, 0, 0],
            "step": [0, 1, 2, 3],
            "scaler_enabled": [True] * 4,
            "scale_before": [8.0, 8.0, 4.0, 4.0],
            "scale_after": [8.0, 4.0, 4.0, 8.0],
            "skipped": [False, True, False, False],
        }
    )
    events = scale_events(steps)
    assert events[["step", "event"]].values.tolist() == [[1, "backoff"], [3, "growth"]]


def test_figures_say_not_recorded_on_empty_frame() -> None:
    empty = pd.DataFrame(columns=["rank", "step", "scale_before", "loss", "wall_s"])
    for fig in (make_loss_scale_figure(empty), make_step_time_figure(empty)):
        assert "not recorded" in fig.layout.annotations[0].text


def test_long_series_are_thinned_for_display(root: Path) -> None:
    steps = amprobe.load_run(root / "group" / "synthetic").steps
    fig = make_loss_scale_figure(steps, max_points=500)
    scale = fig.data[0]
    assert len(scale.x) <= 500 and len(steps) == 20_000
    assert max(scale.y) == steps["scale_before"].max()


def test_compare_figure_overlays_two_runs(root: Path) -> None:
    a = amprobe.load_run(root / "amp").steps
    b = amprobe.load_run(root / "group" / "synthetic").steps
    fig = make_compare_figure(a, b, ("amp", "syn"))
    assert {t.name for t in fig.data} == {"amp", "syn"}
    assert len([t for t in fig.data if t.name == "amp"]) == 3  # step time, loss, scale


# -- callbacks ----------------------------------------------------------------------------


def test_run_list_shows_every_run_with_status_and_worst_finding(ctx: callbacks.Context) -> None:
    callbacks.render_page(ctx, "/")  # lists the runs and queues their diagnoses
    assert ctx.cache.wait_idle(120)
    page = callbacks.render_page(ctx, "/")
    words = texts(page)
    assert "amp" in words and "group/synthetic" in words and "secret" not in " ".join(words)
    assert "finished" in words and "float16" in words
    diagnosis = amprobe.diagnose(amprobe.load_run(ctx.root / "amp"))
    first = min(diagnosis.findings, key=lambda f: layout.SEVERITIES.index(f.severity))
    assert any(w.startswith(f"{first.severity} {first.id} {first.name}") for w in words)


def test_run_page_shows_findings_health_and_panels(ctx: callbacks.Context) -> None:
    page = callbacks.render_page(ctx, "/run/amp")
    words = texts(page)
    diagnosis = amprobe.diagnose(amprobe.load_run(ctx.root / "amp"))
    for finding in diagnosis.findings:
        assert finding.id in words
        assert any(finding.fix in w for w in words)
    assert any("loss-scale success rate" in w for w in words)
    for key in ("numerics", "compute", "runtime"):
        panel = find(open_tab(ctx, "amp", key), f"{ids.SECTION_PREFIX}{key}")
        assert panel is not None
        if key not in {s.key for s in ctx.cache.get("amp").sections}:
            assert any(w.startswith("not recorded") for w in texts(panel))
    assert find(page, ids.LIVE_INTERVAL).disabled is True


def test_whatif_tab_shows_the_heatmap_and_switches_groups(ctx: callbacks.Context) -> None:
    page = open_tab(ctx, "amp", "whatif")
    panel = find(page, ids.WHATIF_PANEL)
    assert panel is not None
    radio = find(page, ids.WHATIF_GROUP)
    assert radio.options == ["activations", "gradients"] and radio.value == "activations"
    graph = find(page, ids.WHATIF_HEATMAP)
    heat = next(t for t in graph.figure.data if t.type == "heatmap")
    numerics = ctx.cache.get("amp").run.table("numerics")
    outputs = numerics[numerics["kind"] == "output"].sort_values("order")
    assert list(heat.y) == list(dict.fromkeys(outputs["module"]))
    assert "activations" in graph.figure.layout.title.text
    assert any("per-tensor scaling" in str(t.name) for t in graph.figure.data)
    assert any("share of nonzero values lost" in w for w in texts(panel))
    grads = callbacks.whatif_heatmap(ctx, "amp", "gradients")
    assert "gradients" in grads.layout.title.text
    heat = next(t for t in grads.data if t.type == "heatmap")
    assert any(str(y).endswith("· output grad") for y in heat.y)
    refused = callbacks.whatif_heatmap(ctx, "../amp", "activations")
    assert "not a run under the dashboard's root" in refused.layout.title.text
    # a run without per-layer numerics says why
    page = open_tab(ctx, "group/synthetic", "whatif")
    words = texts(find(page, ids.WHATIF_PANEL))
    assert any("no per-layer exponent histogram was recorded" in w for w in words)


def test_run_page_refuses_traversal_and_unknown_pages(ctx: callbacks.Context) -> None:
    for path in ("/run/../amp", "/run/%2e%2e/amp", "/run//etc", "/run/not_a_run"):
        words = texts(callbacks.render_page(ctx, path))
        assert "Cannot open this page" in words, path
    assert "Cannot open this page" in texts(callbacks.render_page(ctx, "/nowhere"))


def test_findings_filter_by_severity_and_category(ctx: callbacks.Context) -> None:
    findings = ctx.cache.get("amp").diagnosis.findings
    assert findings
    severity = findings[0].severity
    kept = texts(callbacks.filter_findings(ctx, "amp", [severity], ["nan", "speed", "distributed"]))
    assert {f.id for f in findings if f.severity == severity} <= set(kept)
    # an ID can appear at two severities (AMP-S04: warning for misaligned, info for tile waste)
    only_other = {f.id for f in findings if f.severity != severity} - {
        f.id for f in findings if f.severity == severity
    }
    # a kept finding names the findings it explains or is explained by (links), at any severity
    linked = {i for f in findings if f.severity == severity for i in f.explains + f.explained_by}
    assert not (only_other - linked) & set(kept)
    none = texts(callbacks.filter_findings(ctx, "amp", ["error", "warning", "info"], []))
    assert "No finding matches these filters." in none
    assert "Cannot open this page" in texts(
        callbacks.filter_findings(ctx, "../amp", ["error"], ["nan"])
    )


def test_section_panels_render_registered_sections_and_missing(
    monkeypatch: pytest.MonkeyPatch, ctx: callbacks.Context
) -> None:
    from amprobe.report import sections as sections_mod

    def numerics(run: Any, diagnosis: Any) -> Any:
        frame = pd.DataFrame({"layer": ["<script>alert(1)</script>"], "overflow": [3]})
        return sections_mod.Section(
            "numerics",
            "Numerics",
            figures=(go.Figure(go.Scatter(y=np.arange(5000.0))),),
            tables=(("offenders", frame),),
        )

    def compute(run: Any, diagnosis: Any) -> Any:
        return sections_mod.Section(
            "compute", "Tensor Cores", missing="no CUDA device: op shapes not traced"
        )

    monkeypatch.setitem(
        sections_mod.SECTIONS, "numerics", sections_mod.SectionSpec(50, numerics, "N")
    )
    monkeypatch.setitem(
        sections_mod.SECTIONS, "compute", sections_mod.SectionSpec(60, compute, "C")
    )
    fresh = callbacks.Context(root=ctx.root)
    page = open_tab(fresh, "amp", "numerics")
    graph = find(page, f"{ids.SECTION_PREFIX}numerics-fig0")
    assert len(graph.figure.data[0].y) <= 2000
    body = find(page, {"type": ids.TABLE_BODY, "key": "numerics/0"})
    assert [td.children for td in body.children[1].children[0].children] == [
        "<script>alert(1)</script>",
        "3",
    ]
    assert "not recorded: no CUDA device: op shapes not traced" in texts(
        find(open_tab(fresh, "amp", "compute"), f"{ids.SECTION_PREFIX}compute")
    )


def test_run_text_is_passed_as_text_never_as_html(tmp_path: Path) -> None:
    name = "<img src=x onerror=alert(1)>"
    write_synthetic_run(tmp_path / name, steps=5)
    ctx = callbacks.Context(root=tmp_path)
    page = callbacks.render_page(ctx, "/run/" + name)
    assert find(page, ids.RUN_TITLE).children == name
    assert name in texts(callbacks.render_page(ctx, "/"))
    source = "\n".join(p.read_text() for p in Path(layout.__file__).parent.glob("*.py"))
    assert "dangerously_allow_html=True" not in source


def test_live_refresh_reads_only_new_lines(tmp_path: Path) -> None:
    live = SyntheticLiveRun(tmp_path / "live", steps=10)
    ctx = callbacks.Context(root=tmp_path)
    page = callbacks.render_page(ctx, "/run/live")
    assert find(page, ids.LIVE_INTERVAL).disabled is False
    version = find(page, ids.RUN_VERSION).data
    text, status, new_version, disabled = callbacks.refresh_live(ctx, 1, "live", version)
    assert text.startswith("10 steps") and disabled is False and "live" in texts(status)
    assert new_version is dash.no_update  # nothing new: the open tab is not drawn again
    path = (tmp_path / "live").resolve()
    first = ctx.tail.offsets(path)[0]
    assert first == (tmp_path / "live" / "rank0" / "steps.jsonl").stat().st_size
    live.append(5)
    with open(tmp_path / "live" / "rank0" / "steps.jsonl", "a") as fh:
        fh.write('{"step": 15, "window": 0')  # a record still being written
    text, *_ = callbacks.refresh_live(ctx, 2, "live")
    assert text.startswith("15 steps")
    update = ctx.tail.poll(path)
    assert update.steps == 15 and update.last_step == 14
    assert ctx.tail.offsets(path)[0] > first
    with open(tmp_path / "live" / "rank0" / "steps.jsonl", "a") as fh:
        fh.write(
            ', "t": 1.0, "wall_s": 0.05, "scaler_enabled": true, "scale_before": 8.0, "scale_after": 8.0}\n'
        )
    live.close()
    text, status, new_version, disabled = callbacks.refresh_live(ctx, 3, "live", version)
    assert text.startswith("16 steps") and disabled is True and "finished" in texts(status)
    # the finished run is diagnosed once more: the open tab is drawn again from it
    assert new_version != version and ctx.cache.get("live").run.status == "finished"
    body = open_tab(ctx, "live", "scale")
    fig = find(body, ids.LOSS_SCALE_GRAPH).figure
    assert max(fig.data[0].x) == 15


def test_live_tail_reads_from_offsets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    live = SyntheticLiveRun(tmp_path / "live", steps=4)
    calls: list[int] = []
    import amprobe.store.run as store_run

    real = store_run._read_arrow

    def spy(path: Path, table: str, offset: int = 0) -> Any:
        if Path(path).name == "steps.jsonl":
            calls.append(offset)
        return real(path, table, offset)

    monkeypatch.setattr(store_run, "_read_arrow", spy)
    tail = LiveTail()
    tail.poll(tmp_path / "live")
    live.append(3)
    update = tail.poll(tmp_path / "live")
    assert len(calls) == 2 and calls[0] == 0 and calls[1] > 0 and update.steps == 7


def test_live_refresh_refuses_names_outside_root(ctx: callbacks.Context) -> None:
    text, *_, disabled = callbacks.refresh_live(ctx, 1, "../amp")
    assert "not a run" in text and disabled is True


def test_long_tables_are_paged(ctx: callbacks.Context) -> None:
    steps = ctx.cache.get("group/synthetic").run.steps
    events = scale_events(steps)
    assert len(events) > layout.TABLE_PAGE_ROWS
    page = open_tab(ctx, "group/synthetic", "scale")
    first = find(page, {"type": ids.TABLE_BODY, "key": layout.LOSS_SCALE_TABLE})
    assert len(first.children[1].children) == layout.TABLE_PAGE_ROWS
    assert find(page, {"type": ids.TABLE_PAGE, "key": layout.LOSS_SCALE_TABLE}) is not None
    second = callbacks.page_table(ctx, "group/synthetic", layout.LOSS_SCALE_TABLE, 2)
    shown = [int(tr.children[1].children) for tr in second[1].children]
    assert (
        shown == events["step"].iloc[layout.TABLE_PAGE_ROWS : 2 * layout.TABLE_PAGE_ROWS].tolist()
    )
    last = callbacks.page_table(ctx, "group/synthetic", layout.LOSS_SCALE_TABLE, 10_000)
    assert int(last[1].children[-1].children[1].children) == int(events["step"].iloc[-1])
    assert "Cannot open this page" in texts(
        callbacks.page_table(ctx, "group/synthetic", "nope/3", 1)
    )
    assert "Cannot open this page" in texts(
        callbacks.page_table(ctx, "../x", layout.LOSS_SCALE_TABLE, 1)
    )


def test_export_report_downloads_html(ctx: callbacks.Context) -> None:
    data, message = callbacks.export_report(ctx, None, "amp")
    assert message == ""
    data, message = callbacks.export_report(ctx, 1, "amp")
    assert message == "" and data["filename"] == "amp-report.html"
    assert "<html" in data["content"].lower()


def test_export_report_reuses_the_sections_the_tabs_built(ctx: callbacks.Context) -> None:
    """The download is the report of the run version the page shows: the sections its tabs
    built are not built a second time, and it is the report `amprobe report` writes."""
    from amprobe.report import render_html

    loaded = ctx.cache.get("amp")
    callbacks.render_tab(ctx, "amp", "numerics", None, "?tab=numerics", None)
    assert loaded.builds["section/numerics"] == 1
    data, _ = callbacks.export_report(ctx, 1, "amp")
    keys = [key for key, _ in section_tabs()]
    assert all(loaded.builds[f"section/{key}"] == 1 for key in keys), loaded.builds
    div_id = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
    fresh = render_html(loaded.run, loaded.diagnosis)  # each figure's div gets a new random id
    assert div_id.sub("ID", data["content"]) == div_id.sub("ID", fresh)


def test_export_refuses_names_outside_root(ctx: callbacks.Context) -> None:
    data, message = callbacks.export_report(ctx, 1, "../../etc")
    assert "not a run" in message


def test_compare_callback(ctx: callbacks.Context) -> None:
    fig, note = callbacks.compare_runs(ctx, "amp", "group/synthetic")
    assert note == "" and {t.name for t in fig.data} == {"amp", "group/synthetic"}
    _, note = callbacks.compare_runs(ctx, "amp", None)
    assert note == "choose two runs"
    _, note = callbacks.compare_runs(ctx, "amp", "../x")
    assert "not a run" in note
    page = callbacks.render_page(ctx, "/compare", "?a=amp&b=group/synthetic")
    assert (
        find(page, ids.COMPARE_A).value == "amp"
        and find(page, ids.COMPARE_B).value == "group/synthetic"
    )


def test_scale_section_text_joins_the_loss_scale_tab(
    monkeypatch: pytest.MonkeyPatch, ctx: callbacks.Context
) -> None:
    from amprobe.report import sections as sections_mod

    def scale(run: Any, diagnosis: Any) -> Any:
        return sections_mod.Section(
            "scale",
            "Loss scale and loss",
            figures=(go.Figure(),),
            text=("30 scaled steps: 2 skipped",),
        )

    monkeypatch.setitem(
        sections_mod.SECTIONS, "scale", sections_mod.SectionSpec(10, scale, "Loss scale")
    )
    fresh = callbacks.Context(root=ctx.root)
    page = callbacks.render_page(fresh, "/run/amp")
    tabs = find(page, ids.RUN_TABS).children
    assert [t.label for t in tabs][:2] == ["Overview", "Loss scale"]
    assert "Loss scale and loss" not in [t.label for t in tabs]
    assert "30 scaled steps: 2 skipped" in texts(open_tab(fresh, "amp", tabs[1].value))


def test_run_tabs_follow_the_report_section_registry(
    monkeypatch: pytest.MonkeyPatch, ctx: callbacks.Context
) -> None:
    """Issue #20: the dashboard listed its tabs by hand; a newly registered section had none."""
    from amprobe.report import sections as sections_mod

    def memory(run: Any, diagnosis: Any) -> Any:
        return sections_mod.Section("memory", "Device memory", text=("peak 1.5 GiB",))

    monkeypatch.setitem(
        sections_mod.SECTIONS, "memory", sections_mod.SectionSpec(20, memory, "Memory")
    )
    fresh = callbacks.Context(root=ctx.root)
    page = callbacks.render_page(fresh, "/run/amp")
    tabs = find(page, ids.RUN_TABS).children
    assert [(t.value, t.label) for t in tabs] == [
        ("overview", "Overview"),
        *sections_mod.section_tabs(),
    ]
    memory_tab = next(t for t in tabs if t.value == "memory")
    assert memory_tab.label == "Memory" and "peak 1.5 GiB" in texts(
        open_tab(fresh, "amp", "memory")
    )
    labels = dict(sections_mod.section_tabs())
    assert list(labels)[:2] == ["scale", "memory"] and labels["compute"] == "Tensor Cores"


SAMPLE_RUNS = Path(__file__).resolve().parents[1] / "sample_runs"


@pytest.mark.skipif(not SAMPLE_RUNS.is_dir(), reason="no sample_runs/ in this checkout")
def test_every_sample_run_renders() -> None:
    ctx = callbacks.Context(root=SAMPLE_RUNS)
    names = discover_runs(SAMPLE_RUNS)
    assert names
    callbacks.render_page(ctx, "/")
    assert ctx.cache.wait_idle(120)
    listing = texts(callbacks.render_page(ctx, "/"))
    for name in names:
        assert name in listing
        page = callbacks.render_page(ctx, "/run/" + name)
        assert find(page, ids.RUN_TITLE).children == name
        for finding in ctx.cache.get(name).diagnosis.findings:
            assert finding.id in texts(page)


def test_health_values_are_formatted_or_say_why() -> None:
    assert layout.format_health_value({"value": 0.875, "unit": "%"}) == "87.5 %"
    assert layout.format_health_value({"value": 1.234, "unit": "x"}) == "1.23x"
    assert (
        layout.format_health_value({"value": None, "note": "not measured: no baseline"})
        == "not measured: no baseline"
    )


def test_create_app_registers_callbacks_and_loads_nothing(root: Path, tmp_path: Path) -> None:
    from dashboard.app import create_app

    app = create_app(root)
    assert len(app.callback_map) == 13
    assert any(ids.WHATIF_HEATMAP in key for key in app.callback_map)
    assert any(ids.RUN_WARNINGS in key for key in app.callback_map)  # redrawn on a new version
    with pytest.raises(NotADirectoryError):
        create_app(tmp_path / "missing")


def test_serve_says_how_to_install_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    from dashboard import main

    monkeypatch.setitem(sys.modules, "dash", None)
    with pytest.raises(main.DashMissingError, match="pip install"):
        main.serve(os.getcwd())


def test_live_run_is_rediagnosed_at_most_every_live_reload_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dashboard.runs as runs_mod

    live = SyntheticLiveRun(tmp_path / "live", steps=5)
    cache = runs_mod.RunCache(tmp_path, live_reload_s=60.0)
    first = cache.get("live")
    assert cache.get("live") is first  # nothing changed
    live.append(5)
    assert cache.get("live") is first  # changed, within the wait
    cache.live_reload_s = 0.0
    monkeypatch.setattr(runs_mod, "LIVE_COST_FACTOR", 0.0)
    again = cache.get("live")
    assert again is not first and len(again.run.steps) == 10
    live.close()
    done = cache.get("live")
    assert done.run.status == "finished" and cache.get("live") is done


def test_finding_refs_render_as_links() -> None:
    refs = (
        "NaN checklist #9 (AMP-N09): unscale_ before clipping",
        "https://pytorch.org/docs/stable/notes/amp_examples.html#gradient-clipping",
        "NVIDIA guide: https://docs.nvidia.com/x.html",
    )
    small = layout.build_refs(refs)
    links = [c for c in small.children if getattr(c, "href", None)]
    assert [a.href for a in links] == [refs[1], "https://docs.nvidia.com/x.html"]
    assert [a.children for a in links] == [refs[1], "NVIDIA guide"]
    assert refs[0] in small.children  # the checklist item is plain text
    assert layout.SEVERITIES == ("error", "warning", "info")


def test_live_page_keeps_polling_through_a_failed_read(ctx: callbacks.Context, monkeypatch) -> None:
    """A live run can be caught between two writes: one failed read must not stop the page
    updating for good (it then never showed 'finished'); five in a row do."""
    real = ctx.tail.poll
    fail = {"left": 1}

    def flaky(path, **kwargs):
        if fail["left"]:
            fail["left"] -= 1
            raise amprobe.RunLoadError("manifest.json is not valid JSON")
        return real(path, **kwargs)

    monkeypatch.setattr(ctx.tail, "poll", flaky)
    text, *_, disabled = callbacks.refresh_live(ctx, 1, "group/synthetic")
    assert "cannot read this run" in text and disabled is False
    text, status, *_, disabled = callbacks.refresh_live(ctx, 2, "group/synthetic")
    assert "steps" in text and disabled is True  # read again: a finished run stops polling
    fail["left"] = callbacks.LIVE_READ_ATTEMPTS
    results = [callbacks.refresh_live(ctx, 3 + i, "group/synthetic")[-1] for i in range(5)]
    assert results == [False] * (callbacks.LIVE_READ_ATTEMPTS - 1) + [True]


@pytest.mark.skipif(not SAMPLE_RUNS.is_dir(), reason="no sample_runs/ in this checkout")
def test_two_rank_scale_events_are_counted_per_rank_as_the_section_says(tmp_path: Path) -> None:
    """Each rank updates its own scaler: the tab's event count is per rank, like the section
    text above it (it added the ranks' events up: "4 growth, 80 backoff")."""
    write_two_ranks(tmp_path / "two-ranks")
    one = callbacks.Context(root=SAMPLE_RUNS)
    single = texts(open_tab(one, "overflow", "scale"))
    section = next(t for t in single if "scaled steps" in t)
    cuts, grows = (int(section.split(f" {w}")[0].split()[-1]) for w in ("scale cuts", "growth"))
    assert f"{grows} growth, {cuts} backoff event(s)" in single
    ctx = callbacks.Context(root=tmp_path)
    words = texts(open_tab(ctx, "two-ranks", "scale"))
    assert any(t.startswith("200 scaled steps on each of 2 ranks") for t in words), words
    each = f"{grows} growth, {cuts} backoff event(s) on each of 2 ranks"
    assert any(t.startswith(each) for t in words), words
    assert not any(f"{2 * cuts} backoff" in t for t in words), words


def test_sections_are_built_by_amprobe_not_a_dashboard_copy() -> None:
    """One builder of a single section, in amprobe: the dashboard had its own copy of
    build_sections' error handling and escaping."""
    import dashboard.runs as runs_mod
    from amprobe.report import sections

    assert runs_mod.build_section is sections.build_section
    run = amprobe.load_run(SAMPLE_RUNS / "overflow")
    diagnosis = amprobe.diagnose(run)
    assert [s.key for s in sections.build_sections(run, diagnosis)] == [
        k for k, _ in sections.section_tabs() if sections.build_section(k, run, diagnosis)
    ]
    assert sections.build_section("no-such-section", run, diagnosis) is None
