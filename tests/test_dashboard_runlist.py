"""The run list (dates, durations, sort, search, worst finding, garbage runs), the compare page's
numbers and URL state, and the Ranks legend (issue 32, items 9 and 11), over the sample runs."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("dash", reason="the dashboard needs dash (pip install 'amprobe[dashboard]')")

import amprobe  # noqa: E402
from amprobe.analysis.compare import compute_comparison  # noqa: E402
from amprobe.report.compare import render_comparison_text  # noqa: E402
from amprobe.report.ranks import build_ranks_section  # noqa: E402
from amprobe.rules.compare import compare_runs  # noqa: E402
from amprobe.rules.engine import Severity  # noqa: E402
from dashboard import callbacks, ids, layout  # noqa: E402
from dashboard.browser import ServerThread, browser_missing, chromium_driver  # noqa: E402
from dashboard.runs import PENDING  # noqa: E402
from tests.helpers import component_texts as texts  # noqa: E402

SAMPLE_RUNS = Path(__file__).resolve().parents[1] / "sample_runs"
SAMPLES = ("healthy", "overflow", "misuse", "bf16", "fp8-whatif")
#: how long one condition may take to hold in the browser (the machine is loaded)
WAIT_S = 120


def find(component: Any, component_id: str) -> Any:
    if isinstance(component, (list, tuple)):
        return next((h for c in component if (h := find(c, component_id)) is not None), None)
    if getattr(component, "id", None) == component_id:
        return component
    children = getattr(component, "children", None)
    return None if children is None or isinstance(children, str) else find(children, component_id)


def _rank_files(run: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    return (
        json.loads((run / "rank0" / "manifest.json").read_text()),
        json.loads((run / "rank0" / "end.json").read_text()),
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The five sample runs, an interrupted copy of ``overflow`` and two garbage runs."""
    base = tmp_path_factory.mktemp("runlist")
    for name in SAMPLES:
        shutil.copytree(SAMPLE_RUNS / name, base / name)
    shutil.copytree(SAMPLE_RUNS / "overflow", base / "cut-short")
    (base / "cut-short" / "rank0" / "end.json").unlink()  # ended without closing
    # records that cannot be read: random bytes where the steps were
    shutil.copytree(SAMPLE_RUNS / "healthy", base / "garbage-records")
    data = bytes((i * 7919 + 13) % 256 for i in range(4000))
    (base / "garbage-records" / "rank0" / "steps.jsonl").write_bytes(data)
    # the steps file gone, while the end marker counts 150 steps
    shutil.copytree(SAMPLE_RUNS / "healthy", base / "garbage-missing")
    (base / "garbage-missing" / "rank0" / "steps.jsonl").unlink()
    return base


@pytest.fixture(scope="module")
def ctx(root: Path) -> callbacks.Context:
    ctx = callbacks.Context(root=root)
    callbacks.render_page(ctx, "/")  # lists the runs and queues their diagnoses
    assert ctx.cache.wait_idle(300)
    return ctx


def _rows(ctx: callbacks.Context, sort_by: Any = None, search: str | None = None) -> list[dict]:
    extra = {k: v for k, v in (("sort_by", sort_by), ("search", search)) if v}
    data, _, _ = callbacks.refresh_run_list(ctx, 1, 0, **extra)
    return data


# -- run list -------------------------------------------------------------------------------------
def test_garbage_run_is_unreadable_with_the_reason(ctx: callbacks.Context) -> None:
    rows = {r["name"]: r for r in _rows(ctx)}
    for name in ("garbage-records", "garbage-missing"):
        assert rows[name]["status"] == "unreadable", rows[name]
        assert rows[name]["steps"] == "", rows[name]  # not "0 steps"
    assert "steps.jsonl holds 4,000 bytes but no step record" in rows["garbage-records"]["worst"]
    assert rows["garbage-missing"]["worst"].startswith("unreadable: no readable step record")
    assert "end marker counts 150 steps" in rows["garbage-missing"]["worst"]
    for name in SAMPLES:  # the sample runs stay readable
        assert rows[name]["status"] == "finished" and int(rows[name]["steps"]) > 0, rows[name]


def test_worst_finding_names_severity_id_and_rule(ctx: callbacks.Context) -> None:
    rows = {r["name"]: r for r in _rows(ctx)}
    for name in SAMPLES:
        diagnosis = amprobe.diagnose(amprobe.load_run(ctx.root / name))
        worst = diagnosis.worst()
        assert worst is not None
        named = [
            f"{worst.value} {f.id} {f.name}" for f in diagnosis.findings if f.severity == worst
        ]
        more = f" (+{len(diagnosis.findings) - 1} more)" if len(diagnosis.findings) > 1 else ""
        assert rows[name]["worst"] == named[0] + more
    assert rows["overflow"]["worst"] == "error AMP-N05 forward-overflow (+7 more)"
    assert rows["healthy"]["worst"] == "info AMP-P01 fp8-candidates (+2 more)"


def test_worst_finding_is_the_most_severe_not_the_first_cause() -> None:
    """Findings are listed cause first, and a root cause can be less severe than its symptom:
    the run list's worst finding is the error, not the first finding (a warning)."""
    from amprobe.rules.engine import Diagnosis
    from dashboard.runs import LoadedRun, summarize

    run = amprobe.load_run(SAMPLE_RUNS / "overflow")
    real = {f.id: f for f in amprobe.diagnose(run).findings}
    cause = dataclasses.replace(real["AMP-N01"], explains=("AMP-N02",), explained_by=())
    symptom = dataclasses.replace(real["AMP-N02"], explained_by=("AMP-N01",), explains=())
    assert (cause.severity, symptom.severity) == ("warning", "error")
    diagnosis = Diagnosis(run=run, findings=(cause, symptom), not_checked=(), health={})
    row = summarize("hand-built", LoadedRun("hand-built", run, diagnosis))
    assert row.worst == f"error AMP-N02 {symptom.name} (+1 more)"
    assert row.worst_rank == Severity.ERROR.rank


def test_sorting_by_worst_finding_queues_every_run_and_says_how_many_wait(
    tmp_path: Path,
) -> None:
    """Sorting needs every run's diagnosis: the runs off the page were never queued, so they
    stayed last ("diagnosing…") for good, an error run among them."""
    from dashboard.runs import RunCache

    for name in SAMPLES:
        shutil.copytree(SAMPLE_RUNS / name, tmp_path / name)
    cache = RunCache(tmp_path, first_wait_s=0)
    first = cache.page(1, page_size=2, sort="worst")
    assert first.undiagnosed == len(SAMPLES)
    assert layout.pages_text(first).endswith(
        f"; {len(SAMPLES)} run(s) not yet diagnosed, sorted last until they are"
    )
    assert cache.wait_idle(300)
    done = cache.page(1, page_size=2, sort="worst")
    assert done.undiagnosed == 0 and "not yet diagnosed" not in layout.pages_text(done)
    assert [r.worst.split()[0] for r in done.rows] == ["error", "error"]
    assert {r.name for r in done.rows} == {"overflow", "misuse"}


def test_started_and_duration_come_from_the_manifests_and_steps(
    ctx: callbacks.Context, root: Path
) -> None:
    rows = {r["name"]: r for r in _rows(ctx)}
    for name in SAMPLES:
        manifest, end = _rank_files(root / name)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(manifest["start_unix"]))
        assert rows[name]["started"] == started
        expected = layout.format_duration(end["end_unix"] - manifest["start_unix"])
        assert rows[name]["duration"] == expected
    # no end marker: the duration runs to the last recorded step, and says so
    last_t = float(amprobe.load_run(root / "cut-short").steps["t"].max())
    assert rows["cut-short"]["status"] == "interrupted"
    assert rows["cut-short"]["duration"] == f"{layout.format_duration(last_t)} to the last step"
    assert layout.format_duration(42.14) == "42.1 s"
    assert layout.format_duration(185) == "3 min 05 s"
    assert layout.format_duration(7620) == "2 h 07 min"


def test_run_list_row_reads_summaries_not_the_steps_tables(tmp_path: Path) -> None:
    """A row's step count, dtype and duration come from the per-rank summaries, the manifests
    and the end of an open rank's steps file: no table file is parsed (issue #33: at 4,096
    ranks every rank's steps.jsonl is gigabytes)."""
    from unittest import mock

    from amprobe.store import jsonl
    from amprobe.store.run import write_rank_summary
    from dashboard.runs import LoadedRun, summarize

    run_dir = tmp_path / "two"
    shutil.copytree(SAMPLE_RUNS / "overflow", run_dir)
    shutil.copytree(run_dir / "rank0", run_dir / "rank1")
    (run_dir / "rank1" / "end.json").unlink()  # rank 1 stopped without closing
    for rank in ("rank0", "rank1"):
        write_rank_summary(run_dir / rank)
    run = amprobe.load_run(run_dir)
    run.summaries()
    diagnosis = amprobe.diagnose(amprobe.load_run(SAMPLE_RUNS / "overflow"))
    with mock.patch.object(jsonl, "_read_arrow", side_effect=AssertionError("a table read")):
        row = summarize("two", LoadedRun("two", run, diagnosis))
    steps = amprobe.load_run(run_dir).steps
    assert row.steps == steps["step"].nunique() == 200
    assert row.dtype == "float16" and row.status == "interrupted" and row.duration_open
    start = run.ranks[1].manifest["start_unix"] - row.started  # type: ignore[operator]
    assert row.duration_s == pytest.approx(start + steps["t"].max())


def test_run_list_sorts_on_the_server(ctx: callbacks.Context, root: Path) -> None:
    def seconds(name: str) -> float:
        manifest, end = _rank_files(root / name)
        return end["end_unix"] - manifest["start_unix"]

    longest_first = sorted(SAMPLES, key=seconds, reverse=True)
    names = [r["name"] for r in _rows(ctx, [{"column_id": "duration", "direction": "desc"}])]
    ended = [n for n in names if n in SAMPLES]
    assert ended == longest_first
    # the garbage runs have no duration: last, whichever way round
    assert set(names[-2:]) == {"garbage-records", "garbage-missing"}
    names = [r["name"] for r in _rows(ctx, [{"column_id": "duration", "direction": "asc"}])]
    assert [n for n in names if n in SAMPLES] == longest_first[::-1]
    assert set(names[-2:]) == {"garbage-records", "garbage-missing"}

    # most severe first; the unreadable runs (no finding known) last
    rows = _rows(ctx, [{"column_id": "worst", "direction": "asc"}])
    ranks = [Severity(r["worst"].split()[0]).rank for r in rows[:-2]]
    assert ranks == sorted(ranks) and ranks[0] == 0 and ranks[-1] == 2, rows
    assert all(r["status"] == "unreadable" for r in rows[-2:])
    names = [r["name"] for r in _rows(ctx, [{"column_id": "run", "direction": "desc"}])]
    assert names == sorted(names, reverse=True)


def test_run_list_search_keeps_matching_names(ctx: callbacks.Context) -> None:
    data, pages, text = callbacks.refresh_run_list(ctx, 1, 0, None, "GARBAGE")
    assert [r["name"] for r in data] == ["garbage-missing", "garbage-records"]
    assert pages == 1 and text == "2 of 8 runs match 'garbage', 50 a page"
    data, _, text = callbacks.refresh_run_list(ctx, 1, 0, None, "no such run")
    assert data == [] and "No run name holds 'no such run'" in text
    assert callbacks.first_page("x", None) == 0


# -- compare --------------------------------------------------------------------------------------
def test_compare_page_shows_the_numbers_of_amprobe_compare(
    ctx: callbacks.Context, root: Path
) -> None:
    numbers, style, search = callbacks.compare_numbers(ctx, "healthy", "overflow")
    assert style == {} and search == "?a=healthy&b=overflow"
    shown = texts(numbers)
    a, b = amprobe.load_run(root / "healthy"), amprobe.load_run(root / "overflow")
    c = compute_comparison(a, b)
    speedup = f"speedup {c['speedup']:.2f}x"
    assert speedup in shown and speedup in render_comparison_text(compare_runs(a, b))
    assert f"{1e3 / c['steps_per_s_baseline']:.1f} ms" in shown
    assert f"ratio {c['memory_ratio']:.2f}" in shown
    assert f"difference {c['loss_diff']:+.4g}" in shown
    first, last = c["timed_step_ranges"][1]
    assert any(f"candidate steps {first}–{last}" in t for t in shown)
    first, last = c["final_loss_step_range"]
    assert f"steps {first}–{last}" in shown
    assert "A (baseline): healthy" in shown and "B (candidate): overflow" in shown


def test_compare_page_hides_the_graph_until_two_runs_are_chosen(ctx: callbacks.Context) -> None:
    page = callbacks.render_page(ctx, "/compare")
    assert find(page, ids.COMPARE_GRAPH).style == layout.HIDDEN
    assert find(page, ids.COMPARE_NOTE).children == "choose two runs"
    assert callbacks.compare_numbers(ctx, None, None) == (None, layout.HIDDEN, "")
    assert callbacks.compare_numbers(ctx, "healthy", None) == (None, layout.HIDDEN, "?a=healthy")
    assert callbacks.compare_numbers(ctx, "healthy", "../x")[1] == layout.HIDDEN
    page = callbacks.render_page(ctx, "/compare", "?a=healthy&b=bf16")
    assert find(page, ids.COMPARE_GRAPH).style == {}


def test_compare_choices_and_url_follow_each_other(ctx: callbacks.Context) -> None:
    from dash import no_update

    # a dropdown changed: the URL follows
    out = callbacks.compare_state(ctx, "healthy", "bf16", "?a=healthy", from_url=False)
    assert out[:2] == (no_update, no_update) and out[3:] == ({}, "?a=healthy&b=bf16")
    # the URL changed (back, forward): the dropdowns follow, the URL is left alone
    out = callbacks.compare_state(ctx, "healthy", "bf16", "?a=healthy", from_url=True)
    assert out[:2] == ("healthy", None) and out[3:] == (layout.HIDDEN, no_update)
    # the page's own URL read as it mounts: the numbers, nothing else changes
    out = callbacks.compare_state(ctx, "healthy", "bf16", "?a=healthy&b=bf16", from_url=True)
    assert out[:2] == (no_update, no_update) and out[3:] == ({}, no_update)
    assert "A (baseline): healthy" in texts(out[2])


# -- ranks ----------------------------------------------------------------------------------------
def test_ranks_legend_is_in_words_one_colour_per_rank(tmp_path: Path) -> None:
    run_dir = tmp_path / "two-ranks"
    shutil.copytree(SAMPLE_RUNS / "healthy", run_dir)
    shutil.copytree(run_dir / "rank0", run_dir / "rank1")
    for path, changes in (
        (run_dir / "rank1" / "manifest.json", {"rank": 1, "world_size": 2}),
        (run_dir / "rank0" / "manifest.json", {"world_size": 2}),
        (run_dir / "manifest.json", {"world_size": 2}),
    ):
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    run = amprobe.load_run(run_dir)
    section = build_ranks_section(run, amprobe.diagnose(run))
    traces = section.figures[0].data
    names = {t.name for t in traces}
    assert {"rank 0 step time (ms)", "rank 1 loss scale", "step time (ms) median of ranks"} <= names
    assert not [n for n in names if "wall_s" in n or "scale_after" in n or n.startswith("r0")]
    colours = {t.name: t.line.color for t in traces if t.name.startswith("rank ")}
    assert colours["rank 0 loss scale"] == colours["rank 0 step time (ms)"]
    assert colours["rank 0 loss scale"] != colours["rank 1 loss scale"]


# -- in a browser ---------------------------------------------------------------------------------
@pytest.mark.browser
@pytest.mark.skipif(
    browser_missing() is not None, reason=f"no headless browser: {browser_missing()}"
)
def test_compare_url_state_and_run_list_sort_search_in_chromium(root: Path) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from dashboard.app import create_app

    app = create_app(root, refresh_ms=1000)
    driver = chromium_driver(1440, 900)
    wait = WebDriverWait(driver, WAIT_S, ignored_exceptions=(StaleElementReferenceException,))
    links = f'#{ids.RUN_LIST_TABLE} td[data-dash-column="run"] a'

    def names(d: Any) -> list[str]:  # read in one script: the table re-renders as rows refresh
        return d.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0])).map(a => a.textContent)",
            links,
        )

    def text(element_id: str) -> str:
        return driver.find_element(By.ID, element_id).text

    try:
        with ServerThread(app) as server:
            # the compare page: nothing chosen, a message and no graph
            driver.get(server.url + "/compare?a=healthy")
            wait.until(lambda d: "choose two runs" in text(ids.COMPARE_NOTE))
            assert not driver.find_element(By.ID, ids.COMPARE_GRAPH).is_displayed()
            driver.execute_script("window.__not_reloaded = true")
            driver.find_element(By.ID, ids.COMPARE_B).click()
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "[role=option]"))
            option = [
                o
                for o in driver.find_elements(By.CSS_SELECTOR, "[role=option]")
                if o.text == "bf16"
            ]
            option[0].click()
            # the choice is in the URL, without a reload; the numbers and the graph show
            wait.until(
                lambda d: d.execute_script("return window.location.search") == "?a=healthy&b=bf16"
            )
            assert driver.execute_script("return window.__not_reloaded === true")
            wait.until(lambda d: "speedup" in text(ids.COMPARE_NUMBERS))
            wait.until(lambda d: d.find_element(By.ID, ids.COMPARE_GRAPH).is_displayed())
            speedup = compute_comparison(
                amprobe.load_run(root / "healthy"), amprobe.load_run(root / "bf16")
            )["speedup"]
            assert f"speedup {speedup:.2f}x" in text(ids.COMPARE_NUMBERS)
            # back and forward follow the URL
            driver.back()
            wait.until(lambda d: d.execute_script("return window.location.search") == "?a=healthy")
            wait.until(lambda d: "bf16" not in text(ids.COMPARE_B))
            wait.until(lambda d: not d.find_element(By.ID, ids.COMPARE_GRAPH).is_displayed())
            assert "speedup" not in text(ids.COMPARE_NUMBERS)
            driver.forward()
            wait.until(lambda d: "bf16" in text(ids.COMPARE_B))
            wait.until(lambda d: f"speedup {speedup:.2f}x" in text(ids.COMPARE_NUMBERS))
            # the URL brings the same choice back
            driver.get(driver.current_url)
            wait.until(lambda d: f"speedup {speedup:.2f}x" in text(ids.COMPARE_NUMBERS))
            assert "bf16" in text(ids.COMPARE_B) and "healthy" in text(ids.COMPARE_A)

            # the run list: every column readable at 1440x900, no cell cut off
            driver.get(server.url + "/")
            wait.until(lambda d: len(names(d)) == 8)
            wait.until(lambda d: PENDING not in text(ids.RUN_LIST_TABLE))
            clipped = driver.execute_script(
                "return Array.from(document.querySelectorAll(arguments[0]))"
                ".filter(c => c.scrollWidth > c.clientWidth + 1).map(c => c.textContent)",
                f"#{ids.RUN_LIST_TABLE} td, #{ids.RUN_LIST_TABLE} td > div, "
                f"#{ids.RUN_LIST_TABLE} th",
            )
            assert clipped == []
            # sort by a heading's arrows, search by name
            assert names(driver) == sorted(names(driver))
            sort = f'#{ids.RUN_LIST_TABLE} th[data-dash-column="duration"] .column-header--sort'
            driver.find_element(By.CSS_SELECTOR, sort).click()  # ascending
            wait.until(lambda d: names(d)[:1] == ["healthy"])  # 2.7 s, the shortest sample
            search = driver.find_element(By.ID, ids.RUN_LIST_SEARCH)
            search.send_keys("garbage")
            wait.until(lambda d: sorted(names(d)) == ["garbage-missing", "garbage-records"])
            wait.until(lambda d: "2 of 8 runs match" in text(ids.RUN_LIST_PAGES))
    finally:
        driver.quit()
