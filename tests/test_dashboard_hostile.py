"""The dashboard and the reports under hostile input: broken runs, FIFOs, devices, links out
of ROOT, 120 runs, a public ``--host``, HTML in module names (issue 16, items 12-16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("dash", reason="the dashboard needs dash (pip install 'amprobe[dashboard]')")

import dash  # noqa: E402

import amprobe  # noqa: E402
import dashboard.runs as runs_mod  # noqa: E402
from dashboard import callbacks, ids, layout  # noqa: E402
from dashboard.demo import write_synthetic_run  # noqa: E402
from dashboard.runs import PENDING, RunAccessError, RunCache  # noqa: E402
from tests.helpers import component_texts as texts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLE_RUNS = REPO / "sample_runs"
HOSTILE_NAMES = ("<b>bold</b>", "<img src=x onerror=alert(1)>", "<script>alert(1)</script>")


def _find(component: Any, component_id: str) -> Any:
    if isinstance(component, (list, tuple)):
        return next((h for c in component if (h := _find(c, component_id)) is not None), None)
    if getattr(component, "id", None) == component_id:
        return component
    children = getattr(component, "children", None)
    return None if children is None or isinstance(children, str) else _find(children, component_id)


def rows_by_name(rows: list[runs_mod.RunSummary]) -> dict[str, runs_mod.RunSummary]:
    return {r.name: r for r in rows}


def _edit_json(path: Path, **changes: Any) -> None:
    obj = json.loads(path.read_text())
    obj.update(changes)
    path.write_text(json.dumps(obj))


# -- hostile run directories ----------------------------------------------------------------


def make_rank_superscript(run: Path) -> None:
    """A run whose only rank folder is ``rank²`` (not a rank: ASCII digits only)."""
    write_synthetic_run(run, steps=5)
    (run / "rank0").rename(run / "rank\u00b2")


def make_bad_end(run: Path) -> None:
    write_synthetic_run(run, steps=5)
    (run / "rank0" / "end.json").write_text(
        json.dumps({"steps": 5, "lost_rows": [1, 2], "lost_steps": 3, "write_errors": "disk"})
    )


def make_dict_gpu_name(run: Path) -> None:
    write_synthetic_run(run, steps=5)
    _edit_json(run / "rank0" / "manifest.json", gpu_name={"name": "H100"})


def make_fifo_steps(run: Path) -> None:
    write_synthetic_run(run, steps=5)
    (run / "rank0" / "steps.jsonl").unlink()
    os.mkfifo(run / "rank0" / "steps.jsonl")


def make_dev_zero_steps(run: Path) -> None:
    write_synthetic_run(run, steps=5)
    (run / "rank0" / "steps.jsonl").unlink()
    (run / "rank0" / "steps.jsonl").symlink_to("/dev/zero")


HOSTILE = {
    "rank_superscript": make_rank_superscript,
    "bad_end": make_bad_end,
    "dict_gpu_name": make_dict_gpu_name,
    "fifo": make_fifo_steps,
    "dev_zero": make_dev_zero_steps,
}

# -- 12: one bad run never takes down the run list ------------------------------------------

_LIST_IN_A_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # /dev/zero read: MemoryError
    from dashboard import callbacks
    ctx = callbacks.Context(root=sys.argv[1])
    callbacks.render_page(ctx, "/")
    assert ctx.cache.wait_idle(60), "diagnoses still running after 60 s"
    rows = [r.__dict__ for r in ctx.cache.page(1).rows]
    pages = {}
    for name in [r["name"] for r in rows]:
        pages[name] = str(callbacks.render_page(ctx, "/run/" + name))[:2000]
        callbacks.refresh_live(ctx, 1, name)
    print(json.dumps({"rows": rows, "pages": pages}))
    """
)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_hostile_runs_each_become_one_row_and_never_hang_or_crash_the_list(
    tmp_path: Path,
) -> None:
    """FIFO, /dev/zero, rank², bad end.json, dict gpu_name: the list still renders, in a child
    process with a time and memory limit (the FIFO hung the server, /dev/zero ate its memory)."""
    write_synthetic_run(tmp_path / "good", steps=5)
    for name, make in HOSTILE.items():
        make(tmp_path / name)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _LIST_IN_A_CHILD, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the run list hung on a hostile run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {r["name"]: r for r in out["rows"]}
    assert set(rows) == {"good", *HOSTILE}
    assert rows["good"]["status"] == "finished" and rows["good"]["worst"] != PENDING
    for name in ("rank_superscript", "fifo", "dev_zero"):
        assert rows[name]["status"] == "unreadable", rows[name]
    assert "FIFO" in rows["fifo"]["error"]
    assert "leaves the dashboard's root" in rows["dev_zero"]["error"]
    assert "rank" in rows["rank_superscript"]["error"]
    for name in ("bad_end", "dict_gpu_name"):  # damaged fields: read with a warning, or refused
        row = rows[name]
        assert row["worst"] != PENDING
        assert row["status"] != "unreadable" or row["error"], row
    assert "Cannot open this page" in out["pages"]["fifo"]


@pytest.mark.parametrize("case", ["rank_superscript", "bad_end", "dict_gpu_name"])
def test_a_damaged_run_is_one_row_and_its_page_says_why(tmp_path: Path, case: str) -> None:
    write_synthetic_run(tmp_path / "good", steps=5)
    HOSTILE[case](tmp_path / "bad")
    ctx = callbacks.Context(root=tmp_path)
    page = callbacks.render_page(ctx, "/")  # raised before: HTTP 500 on the home page
    assert "good" in texts(page)
    assert ctx.cache.wait_idle(60)
    rows = rows_by_name(ctx.cache.page(1).rows)
    assert rows["good"].status == "finished" and rows["good"].worst not in ("", PENDING)
    bad = rows["bad"]
    assert not bad.pending
    if bad.status == "unreadable":
        assert bad.error and f"unreadable: {bad.error}" in texts(callbacks.render_page(ctx, "/"))
    else:  # a loader that reports the damaged field as a warning and reads the rest
        assert bad.device in ("synthetic GPU", "not recorded", "cuda:0")
    words = " ".join(texts(callbacks.render_page(ctx, "/run/bad")))
    assert "Cannot open this page" in words or "bad" in words


def test_a_run_amprobe_fails_on_is_refused_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any exception inside amprobe while reading one run becomes that run's reason."""
    write_synthetic_run(tmp_path / "good", steps=5)
    write_synthetic_run(tmp_path / "bad", steps=5)
    real_diagnose = amprobe.diagnose

    def diagnose(run: amprobe.Run) -> Any:
        if run.path.name == "bad":
            raise KeyError("boom")
        return real_diagnose(run)

    monkeypatch.setattr(amprobe, "diagnose", diagnose)
    ctx = callbacks.Context(root=tmp_path)
    callbacks.render_page(ctx, "/")
    assert ctx.cache.wait_idle(60)
    rows = rows_by_name(ctx.cache.page(1).rows)
    assert rows["good"].status == "finished"
    assert rows["bad"].status == "unreadable" and "KeyError" in (rows["bad"].error or "")
    with pytest.raises(RunAccessError, match="KeyError"):
        ctx.cache.get("bad")
    assert "Cannot open this page" in texts(callbacks.render_page(ctx, "/run/bad"))


def test_a_folder_with_an_unrelated_manifest_is_not_a_run(tmp_path: Path) -> None:
    write_synthetic_run(tmp_path / "run", steps=3)
    (tmp_path / "extension").mkdir()
    (tmp_path / "extension" / "manifest.json").write_text('{"manifest_version": 3}')
    assert runs_mod.discover_runs(tmp_path) == ["run"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_the_dashboard_and_the_store_agree_on_what_a_run_is(tmp_path: Path) -> None:
    """Issue #20: dashboard/runs.py kept its own file names and ``is_run_dir``; they differed.

    A run whose top manifest was lost and whose only rank folder is ``rank²`` (not a rank) was
    a run to the dashboard (``str.isdigit``) and not to the store. The dashboard now asks the
    store, in its ``untrusted`` mode: a FIFO in a manifest's place is listed (and refused
    later, with the reason), never opened.
    """
    from amprobe.store import layout

    write_synthetic_run(tmp_path / "run", steps=3)
    write_synthetic_run(tmp_path / "superscript", steps=3)
    (tmp_path / "superscript" / "manifest.json").unlink()
    (tmp_path / "superscript" / "rank0").rename(tmp_path / "superscript" / "rank\u00b2")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "manifest.json")
    assert not layout.is_run_dir(tmp_path / "superscript", untrusted=True)
    assert not layout.is_run_dir(tmp_path / "fifo")
    assert layout.is_run_dir(tmp_path / "fifo", untrusted=True)
    # (a rank folder's own manifest carries the marker: rank² alone reads as a run, for both)
    stored = [p.relative_to(tmp_path.resolve()).as_posix() for p in layout.list_runs(tmp_path)]
    assert stored == ["run", "superscript/rank\u00b2"]  # the store, trusting, skips the FIFO
    assert runs_mod.discover_runs(tmp_path) == ["fifo", *stored]
    ctx = callbacks.Context(root=tmp_path)
    callbacks.render_page(ctx, "/")
    assert ctx.cache.wait_idle(60)
    rows = rows_by_name(ctx.cache.page(1).rows)
    assert rows["fifo"].status == "unreadable" and "FIFO" in (rows["fifo"].error or "")


def test_oversized_table_is_refused_before_it_is_read(tmp_path: Path) -> None:
    write_synthetic_run(tmp_path / "big", steps=50)
    cache = RunCache(tmp_path, max_table_bytes=1000)
    with pytest.raises(RunAccessError, match=r"rank0/steps.jsonl holds .* more than the dashboard"):
        cache.get("big")
    assert cache.page(1).rows[0].status == "unreadable"


# -- 13: 1,000 runs open fast: manifests first, lazy diagnosis, cache, paging ----------------


@pytest.fixture(scope="module")
def many_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("many")
    for i in range(120):
        write_synthetic_run(root / f"run{i:03d}", steps=3, seed=i)
    return root


def test_run_list_is_paged_and_listed_from_manifests_without_loading_runs(
    many_runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_load(path: Any) -> Any:
        raise AssertionError("the run list loaded a run before painting")

    monkeypatch.setattr(amprobe, "load_run", no_load)
    cache = RunCache(many_runs, workers=0, first_wait_s=0)  # nothing diagnoses: manifests only
    first = cache.page(1)
    assert (first.page, first.pages, first.total, len(first.rows)) == (1, 3, 120, 50)
    row = first.rows[0]
    assert (row.name, row.status, row.device, row.dtype) == (
        "run000",
        "finished",
        "synthetic GPU",
        "float16",
    )
    assert row.pending and row.steps is None
    last = cache.page(99)  # clamped to the last page
    assert (last.page, len(last.rows), last.rows[0].name) == (3, 20, "run100")
    ctx = callbacks.Context(root=many_runs)
    ctx.cache = cache
    page = callbacks.render_page(ctx, "/")
    assert len([w for w in texts(page) if w.startswith("run0")]) == 50
    assert "120 runs, 50 a page" in texts(page)
    table = _find(page, ids.RUN_LIST_TABLE)
    assert (table.page_action, table.page_current, table.page_count) == ("custom", 0, 3)
    assert table.data[0]["run"] == "[run000](/run/run000)"
    data, pages, text = callbacks.refresh_run_list(ctx, 1, 2)  # the table's 0-based page
    assert pages == 3 and text.startswith("120 runs")
    assert [row["name"] for row in data] == [f"run{i}" for i in range(100, 120)]


def test_only_shown_rows_are_diagnosed_and_results_are_cached_by_size_and_mtime(
    many_runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[str] = []
    real_load = amprobe.load_run

    def counting_load(path: Any) -> Any:
        loads.append(Path(path).name)
        return real_load(path)

    monkeypatch.setattr(amprobe, "load_run", counting_load)
    cache = RunCache(many_runs, first_wait_s=0)
    cache.page(2)
    assert cache.wait_idle(120)
    assert sorted(loads) == [f"run{i:03d}" for i in range(50, 100)]
    rows = cache.page(2).rows
    assert all(not r.pending and r.worst for r in rows) and rows[0].steps == 3
    assert len(loads) == 50  # unchanged files: the cached rows, no new load
    with open(many_runs / "run060" / "rank0" / "steps.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 3, "window": 0, "wall_s": 0.05}) + "\n")
    cache.page(2)
    assert cache.wait_idle(120)
    assert loads[50:] == ["run060"]
    assert rows_by_name(cache.page(2).rows)["run060"].steps == 4


def test_rows_of_pages_paged_away_from_are_not_diagnosed(
    many_runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[str] = []
    real_load = amprobe.load_run

    def counting_load(path: Any) -> Any:
        loads.append(Path(path).name)
        return real_load(path)

    monkeypatch.setattr(amprobe, "load_run", counting_load)
    cache = RunCache(many_runs, workers=0, first_wait_s=0)
    cache.page(1)  # queued, no worker yet
    cache.page(2)
    cache.workers = 1
    cache.page(3)  # the page shown now: only its rows are diagnosed
    assert cache.wait_idle(120)
    assert sorted(loads) == [f"run{i}" for i in range(100, 120)]
    assert sum(r.pending for r in cache.page(1).rows) == 50  # queued again when shown again
    assert cache.wait_idle(120)
    assert len(loads) == 70


# -- 14: links inside a run are not followed out of ROOT --------------------------------------


def test_links_inside_a_run_that_leave_root_are_refused_and_said(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    write_synthetic_run(elsewhere / "secret", steps=5)
    (root / "inner").mkdir(parents=True)
    (root / "inner" / "manifest.json").write_text(
        (elsewhere / "secret" / "manifest.json").read_text()
    )
    (root / "inner" / "rank0").symlink_to(elsewhere / "secret" / "rank0")
    write_synthetic_run(root / "file_link", steps=5)
    table = root / "file_link" / "rank0" / "steps.jsonl"
    table.unlink()
    table.symlink_to(elsewhere / "secret" / "rank0" / "steps.jsonl")
    write_synthetic_run(root / "store" / "real", steps=5)  # a link that stays inside is fine
    (root / "inside").mkdir()
    (root / "inside" / "manifest.json").write_text(
        (root / "store" / "real" / "manifest.json").read_text()
    )
    (root / "inside" / "rank0").symlink_to(root / "store" / "real" / "rank0")

    ctx = callbacks.Context(root=root)
    callbacks.render_page(ctx, "/")
    assert ctx.cache.wait_idle(60)
    rows = rows_by_name(ctx.cache.page(1).rows)
    for name, what in (("inner", "rank0"), ("file_link", "rank0/steps.jsonl")):
        assert rows[name].status == "unreadable", rows[name]
        assert rows[name].error == (
            f"{what} is a symbolic link that leaves the dashboard's root; not followed"
        )
        with pytest.raises(RunAccessError, match="leaves the dashboard's root"):
            ctx.cache.get(name)
        assert "Cannot open this page" in texts(callbacks.render_page(ctx, "/run/" + name))
        steps_text, *_, disabled = callbacks.refresh_live(ctx, 1, name)
        assert "leaves the dashboard's root" in steps_text and disabled is True
    assert rows["inside"].status == "finished" and rows["inside"].steps == 5


# -- 15: a public --host warns --------------------------------------------------------------


class _FakeApp:
    def run(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@pytest.mark.parametrize(
    ("host", "warns"),
    [
        ("0.0.0.0", True),
        ("::", True),
        ("192.168.1.20", True),
        ("myhost.example.org", True),
        ("127.0.0.1", False),
        ("127.0.0.2", False),
        ("localhost", False),
        ("::1", False),
    ],
)
def test_serving_beyond_loopback_warns_that_anyone_can_read_every_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    host: str,
    warns: bool,
) -> None:
    import dashboard.app
    from dashboard import main

    monkeypatch.setattr(dashboard.app, "create_app", lambda root: _FakeApp())
    main.serve(tmp_path, host=host, port=8050)
    err = capsys.readouterr().err
    said = "no authentication" in err and "anyone who can reach" in err
    assert said is warns, err
    if warns:
        assert str(tmp_path) in err and "ssh -L 8050:127.0.0.1:8050" in err


def test_docs_say_the_dashboard_has_no_authentication_and_shows_a_tunnel() -> None:
    readme = (REPO / "docs" / "dashboard.md").read_text()
    assert "no authentication" in readme
    assert "ssh -L 8050:127.0.0.1:8050" in readme


# -- 16: Markdown and plotly figures escape HTML from module names ---------------------------


#: hostile-named layer -> the step at which its output is made inf (HOSTILE_NAMES[2]: never)
_PLANTED = {HOSTILE_NAMES[1]: 2, HOSTILE_NAMES[0]: 4}


@pytest.fixture(scope="module")
def hostile_names_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real recording whose layers are named like HTML, two of them overflowing.

    The same on every CPU: fp32 with a GradScaler (no fp16/bf16 kernel whose rounding or speed
    depends on the CPU, and no finding that depends on the CPU's bf16 support, as AMP-N11 does),
    every step sampled, and the overflows planted as an inf factor on a layer's output, so
    AMP-N05 names the layers."""
    import torch

    class Planted(torch.nn.Linear):
        def __init__(self, d_in: int, d_out: int) -> None:
            super().__init__(d_in, d_out)
            self.register_buffer("factor", torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * self.factor

    run_dir = tmp_path_factory.mktemp("evil") / "run"
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module(HOSTILE_NAMES[0], Planted(4, 4))
    model.add_module(HOSTILE_NAMES[1], Planted(4, 4))
    model.add_module(HOSTILE_NAMES[2], torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    probe = amprobe.attach(
        model,
        opt,
        scaler,
        run_dir=run_dir,
        config={"collectors": ["scaler", "numerics"], "flush_every": 1, "numerics_every": 1},
    )
    try:
        for i in range(6):
            for name, step in _PLANTED.items():
                getattr(model, name).factor.fill_(float("inf") if i == step else 1.0)
            loss = model(torch.randn(2, 4)).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    finally:
        probe.close()
    return run_dir


def _assert_no_raw_html(text: str) -> None:
    for raw in ("<script", "<img", "<b>"):
        assert raw not in text, text[max(0, text.find(raw) - 200) : text.find(raw) + 200]


def test_markdown_report_and_diagnose_escape_html_from_module_names(
    hostile_names_run: Path, tmp_path: Path
) -> None:
    from amprobe.cli import main as cli_main

    diagnosis = amprobe.diagnose(amprobe.load_run(hostile_names_run))
    (n05,) = [f for f in diagnosis.findings if f.id == "AMP-N05"]
    assert n05.evidence["module"] == HOSTILE_NAMES[1], "the planted overflow is named"
    assert n05.evidence["offending_modules"] == sorted(_PLANTED)
    out = tmp_path / "report.md"
    assert cli_main(["report", str(hostile_names_run), "-o", str(out)]) == 0
    text = out.read_text()
    _assert_no_raw_html(text)
    assert "&lt;img src=x onerror=alert(1)&gt;" in text  # still readable, as text
    assert "&lt;b&gt;bold&lt;/b&gt;" in text
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "amprobe",
            "diagnose",
            str(hostile_names_run),
            "--format",
            "markdown",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    assert "&lt;img src=x onerror=alert(1)&gt;" in proc.stdout, proc.stdout + proc.stderr
    assert "&lt;b&gt;bold&lt;/b&gt;" in proc.stdout, proc.stdout
    _assert_no_raw_html(proc.stdout)


def test_markdown_escapes_html_and_markdown_in_every_run_text() -> None:
    from amprobe.report.escape import escape_markdown as md_escape

    assert md_escape("<script>alert(1)</script>") == "&lt;script&gt;alert(1)&lt;/script&gt;"
    assert md_escape("a|b\nc & d_e") == "a\\|b c &amp; d\\_e"
    assert md_escape("![x](http://t/p.png) `code` *em* [l]") == (
        "\\!\\[x\\](http://t/p.png) \\`code\\` \\*em\\* \\[l\\]"
    )


def _figure_strings(fig: Any) -> list[str]:
    """Every string plotly would draw as text: trace names, labels, annotations, titles."""
    out: list[str] = []
    for trace in fig.data:
        for key in ("name", "text", "hovertext", "x", "y", "labels"):
            value = getattr(trace, key, None) if key in trace else None
            if isinstance(value, str):
                out.append(value)
            elif value is not None and not hasattr(value, "dtype"):
                out.extend(v for v in value if isinstance(v, str))
            elif value is not None and value.dtype == object:
                out.extend(v for v in value if isinstance(v, str))
    out.extend(a.text for a in fig.layout.annotations or () if a.text)
    return out


def test_figures_show_html_in_layer_and_run_names_as_text(hostile_names_run: Path) -> None:
    from amprobe.report.sections import build_sections
    from dashboard.figures import make_compare_figure

    run = amprobe.load_run(hostile_names_run)
    sections = {s.key: s for s in build_sections(run, amprobe.diagnose(run))}
    figures = sections["numerics"].figures
    assert figures
    strings = [s for fig in figures for s in _figure_strings(fig)]
    assert any("&lt;b&gt;bold&lt;/b&gt;" in s for s in strings), strings
    for s in strings:
        assert "<b>" not in s and "<img" not in s and "<script" not in s, s
    fig = make_compare_figure(run.steps, run.steps, ("<b>A</b>", "B & <i>C</i>"))
    names = {t.name for t in fig.data}
    assert names == {"&lt;b&gt;A&lt;/b&gt;", "B &amp; &lt;i&gt;C&lt;/i&gt;"}


def _graphs(component: Any) -> list[Any]:
    if isinstance(component, (list, tuple)):
        return [g for c in component for g in _graphs(c)]
    found = [component.figure] if getattr(component, "figure", None) is not None else []
    children = getattr(component, "children", None)
    if children is not None and not isinstance(children, str):
        found += _graphs(children)
    return found


def test_dashboard_run_page_figures_escape_layer_names(hostile_names_run: Path) -> None:
    ctx = callbacks.Context(root=hostile_names_run.parent)
    callbacks.render_page(ctx, "/run/run")
    from dashboard.layout import run_tabs

    # each tab is built when it is opened
    tabs = [key for key, _ in run_tabs()]
    figures = [
        fig for tab in tabs for fig in _graphs(callbacks.render_tab(ctx, "run", tab, {}, "")[0])
    ]
    assert len(figures) >= 3
    strings = [s for fig in figures for s in _figure_strings(fig)]
    assert any("&lt;b&gt;bold&lt;/b&gt;" in s for s in strings)
    for s in strings:
        assert "<b>" not in s and "<img" not in s and "<script" not in s, s
    assert ids.RUN_TITLE


@pytest.mark.parametrize(
    "value", ["\u00b2", "-1", "1e9", "99999999999999999999999", "%00", "\x00", " 5", "\u0665"]
)
def test_a_hostile_step_in_the_url_is_ignored_never_raised(value: str) -> None:
    """``?step=²`` passed ``str.isdigit`` and raised ValueError in int() inside the callbacks."""
    from urllib.parse import quote

    from dashboard import layout

    for search in (f"?tab=scale&step={quote(value)}", f"?tab=scale&step={value}"):
        assert layout.RunQuery.parse(search).step is None
        _, tab, focus = callbacks.sync_url(search, "overview", "url")
        assert (tab, focus) == ("scale", {"step": None})
    assert layout.RunQuery.parse("?step=120").step == 120


@pytest.mark.skipif(not (SAMPLE_RUNS / "overflow").is_dir(), reason="no sample_runs/")
def test_a_failing_callback_says_so_in_the_page_never_raises_into_dash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The what-if heatmap, the report download and the compare page had no catch-all: an
    unexpected failure went into Dash as an exception (a blank or stuck part of the page)."""
    import dashboard.callbacks as callbacks_mod

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise ZeroDivisionError("odd data")

    ctx = callbacks.Context(root=SAMPLE_RUNS)
    monkeypatch.setattr(callbacks_mod, "compute_whatif", broken)
    fig = callbacks.whatif_heatmap(ctx, "overflow", "activations")
    assert "ZeroDivisionError: odd data" in fig.layout.title.text
    monkeypatch.setattr(callbacks_mod, "render_html", broken)
    download, note = callbacks.export_report(ctx, 1, "overflow")
    assert download is dash.no_update and "ZeroDivisionError: odd data" in note
    monkeypatch.setattr(callbacks_mod, "compare_pair", broken)
    numbers, style, search = callbacks.compare_numbers(ctx, "healthy", "overflow")
    assert "ZeroDivisionError: odd data" in " ".join(texts(numbers)) and style == {
        "display": "none"
    }
    assert search == "?a=healthy&b=overflow"
    monkeypatch.setattr(callbacks_mod, "make_compare_figure", _fails_once(broken))
    _, note = callbacks.compare_runs(ctx, "healthy", "overflow")
    assert "ZeroDivisionError: odd data" in note
    monkeypatch.setattr(layout, "scale_change_rows", broken)
    rows = callbacks.page_table(ctx, "overflow", layout.LOSS_SCALE_TABLE, 1)
    assert "ZeroDivisionError: odd data" in " ".join(texts(rows))
    for key in ("numerics/\u00b2", "numerics/99999999", "nosuch/0"):  # a client sends any id
        assert "no table" in " ".join(texts(callbacks.page_table(ctx, "overflow", key, 1)))


def _fails_once(broken: Any) -> Any:
    """``broken`` the first call, then the real :func:`make_compare_figure` (the empty figure
    drawn with the note)."""
    from dashboard.figures import make_compare_figure

    calls: list[int] = []

    def once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return broken(*args) if len(calls) == 1 else make_compare_figure(*args, **kwargs)

    return once
