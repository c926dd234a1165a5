"""Issue #32, items 2, 10 and 11: a live run page follows the diagnosis, a run page shows its
findings first and builds each tab when it is opened, and its tab and filters are in its URL.

The direct-call tests check the callbacks; the browser tests drive the app in headless
Chromium (a live run recorded with ``amprobe.attach`` in this process; the demo run with two
busy processes beside the browser) and print what they measured.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

pytest.importorskip("dash", reason="the dashboard needs dash (pip install 'amprobe[dashboard]')")

import dash  # noqa: E402
import torch  # noqa: E402

import amprobe  # noqa: E402
from dashboard import callbacks, ids, layout  # noqa: E402
from dashboard.browser import ServerThread, browser_missing, chromium_driver  # noqa: E402
from tests.test_dashboard import find, texts, write_two_ranks  # noqa: E402

SAMPLE_RUNS = Path(__file__).resolve().parents[1] / "sample_runs"
_MISSING = browser_missing()
#: How long one condition may take to hold in the browser on a loaded machine.
WAIT_S = 120


class LiveTraining:
    """A tiny fp16 CPU model recorded live with ``amprobe.attach`` (every step flushed)."""

    def __init__(self, run_dir: Path) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.scaler = torch.amp.GradScaler("cpu")
        self.probe: Any = amprobe.attach(
            self.model, self.opt, self.scaler, run_dir=run_dir, config={"flush_every": 1}
        )

    def train(self, steps: int, overflow: bool = False) -> None:
        """``steps`` steps; with ``overflow`` each loss is inf, so the scaler skips the step."""
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = self.model(torch.randn(2, 4)).float().mean()
            if overflow:
                loss = loss * float("inf")
            self.opt.zero_grad()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
            self.probe = None


@pytest.fixture()
def live(tmp_path: Path) -> Iterator[LiveTraining]:
    training = LiveTraining(tmp_path / "live")
    try:
        yield training
    finally:
        training.close()


def open_tab(ctx: callbacks.Context, name: str, tab: str, search: str = "") -> Any:
    focus = layout.RunQuery.parse(search).on_tab(tab).focus()
    return callbacks.render_tab(ctx, name, tab, focus, search, None)[0]


def health_texts(component: Any) -> list[str]:
    return texts(find(component, ids.HEALTH))


# -- 10: built once per run version, each tab when it is opened ----------------------------------


@pytest.mark.skipif(not SAMPLE_RUNS.is_dir(), reason="no sample_runs/ in this checkout")
def test_a_second_visit_builds_nothing_again_and_tabs_build_when_opened() -> None:
    ctx = callbacks.Context(root=SAMPLE_RUNS)
    page = callbacks.render_page(ctx, "/run/overflow")
    loaded = ctx.cache.get("overflow")
    first = dict(loaded.builds)
    # the first visit builds the header and the overview: no report section, no figure
    assert first == {"header": 1, "overview/error/warning/info/nan/speed/distributed": 1}
    assert all(f.id in texts(page) for f in loaded.diagnosis.findings)
    assert find(page, ids.RUN_TABS).value == "overview"
    callbacks.render_page(ctx, "/run/overflow")
    assert dict(loaded.builds) == first  # the second visit builds nothing
    body, shown = callbacks.render_tab(ctx, "overflow", "scale", {}, "", None)
    assert shown == {"tab": "scale", "version": loaded.version, "step": None}
    assert find(body, ids.LOSS_SCALE_GRAPH) is not None
    assert loaded.builds["section/scale"] == 1 and "section/numerics" not in loaded.builds
    # the tab already shown: nothing is sent; asked for again elsewhere: nothing is built
    assert callbacks.render_tab(ctx, "overflow", "scale", {}, "", shown) == (
        dash.no_update,
        dash.no_update,
    )
    again, _ = callbacks.render_tab(ctx, "overflow", "scale", {}, "", None)
    assert again is body and loaded.builds["section/scale"] == 1
    assert sum(loaded.builds.values()) == len(first) + 2


@pytest.mark.skipif(not SAMPLE_RUNS.is_dir(), reason="no sample_runs/ in this checkout")
def test_a_run_page_opens_on_a_placeholder_for_a_chart_tab() -> None:
    ctx = callbacks.Context(root=SAMPLE_RUNS)
    page = callbacks.render_page(ctx, "/run/overflow", "?tab=scale")
    assert find(page, ids.RUN_TABS).value == "scale"
    body = find(page, ids.RUN_TAB_BODY)
    assert body.children.className == ids.LOADING and "Loss scale" in body.children.children
    assert find(page, ids.RUN_TAB_SHOWN).data is None  # the tab callback builds it
    assert not ctx.cache.get("overflow").builds.get("section/scale")
    refused, shown = callbacks.render_tab(ctx, "../overflow", "scale", {}, "", None)
    assert "Cannot open this page" in texts(refused) and shown is None


# -- 11: the tab, the filters, the step and the layer are in the URL -------------------------------


def test_run_query_reads_and_writes_the_url() -> None:
    q = layout.RunQuery.parse("?tab=scale&step=120&sev=error,bogus&cat=nan")
    assert (q.tab, q.step, q.severities, q.categories) == ("scale", 120, ("error",), ("nan",))
    assert q.search() == "?tab=scale&sev=error&cat=nan&step=120"
    assert layout.RunQuery.parse(q.search()) == q
    assert layout.RunQuery.parse("?tab=nope&step=x").tab == "overview"
    assert layout.RunQuery.parse("?tab=nope&step=x").step is None
    assert layout.RunQuery.parse("").search() == ""
    assert layout.RunQuery.parse("?sev=").severities == ()  # none kept: said, not defaulted
    assert [k for k, _ in layout.run_tabs()] == [
        "overview",
        *(k for k, _ in __import__("amprobe.report.sections").report.sections.section_tabs()),
    ]
    # a tab click writes the URL (the step stays on its tab only); a URL sets the tab
    search, tab, focus = callbacks.sync_url("?tab=scale&step=120&sev=error", "numerics", "tab")
    assert (search, tab, focus) == ("?tab=numerics&sev=error", dash.no_update, {"layer": None})
    search, tab, focus = callbacks.sync_url("?tab=numerics&layer=booster", "overview", "url")
    assert (search, tab, focus) == (dash.no_update, "numerics", {"layer": "booster"})
    assert callbacks.sync_url("?tab=scale", "scale", "tab") == (dash.no_update,) * 3
    assert (
        callbacks.filters_search("?tab=scale", ["error"], ["nan"]) == "?tab=scale&sev=error&cat=nan"
    )
    assert callbacks.filters_search("", list(layout.SEVERITIES), None) == "?cat="


@pytest.mark.skipif(not SAMPLE_RUNS.is_dir(), reason="no sample_runs/ in this checkout")
def test_step_and_layer_from_the_url_are_marked(tmp_path: Path) -> None:
    ctx = callbacks.Context(root=SAMPLE_RUNS)
    body = open_tab(ctx, "overflow", "scale", "?tab=scale&step=90")
    fig = find(body, ids.LOSS_SCALE_GRAPH).figure
    marks = [s for s in fig.layout.shapes if s.x0 == s.x1]  # lines; the "loss NaN" band is a rect
    assert [s.x0 for s in marks] == [90, 90]  # the scale and the loss subplots
    lo, hi = fig.layout.xaxis.range
    assert lo < 90 < hi and hi - lo < 60
    assert "Step 90 is marked" in find(body, ids.STEP_NOTE).children
    outside = open_tab(ctx, "overflow", "scale", "?tab=scale&step=100000")
    assert "Step 100000 was not recorded" in find(outside, ids.STEP_NOTE).children
    assert not [s for s in find(outside, ids.LOSS_SCALE_GRAPH).figure.layout.shapes if s.x0 == s.x1]

    from amprobe.report.escape import escape_plotly_text

    # a plain name, and one the figures draw escaped ("&lt;input 0&gt;[0]")
    for layer in ("booster", "<input 0>[0]"):
        body = open_tab(ctx, "overflow", "numerics", "?" + urlencode({"layer": layer}))
        assert find(body, ids.LAYER_NOTE).children.startswith(f"Layer {layer}: outlined on")
        heatmaps = [
            g.figure for g in _graphs(body) if any(t.type == "heatmap" for t in g.figure.data)
        ]
        assert heatmaps
        for fig in heatmaps:
            heat = next(t for t in fig.data if t.type == "heatmap")
            label = escape_plotly_text(layer)
            rows = [i for i, y in enumerate(heat.y) if str(y).split(" \u00b7 ")[0] == label]
            marked = sorted(round(s.y0 + 0.5) for s in fig.layout.shapes if s.type == "rect")
            assert rows and marked == rows
    missing = open_tab(ctx, "overflow", "numerics", "?tab=numerics&layer=<b>nope</b>")
    note = find(missing, ids.LAYER_NOTE).children
    assert note.startswith("Layer <b>nope</b> is not drawn") and "hold no row of it" in note
    # a recorded layer that the exponent histogram (the worst layers only) leaves out
    head = find(open_tab(ctx, "overflow", "numerics", "?layer=head"), ids.LAYER_NOTE).children
    assert head.startswith("Layer head: outlined on 3 heatmap(s) below.")
    assert "this is not one of them" in head and "not recorded" not in head

    # a run of several ranks labels its heatmap rows "r0 · module · kind"
    write_two_ranks(tmp_path / "two-ranks")
    ranked = callbacks.Context(root=tmp_path)
    body = open_tab(ranked, "two-ranks", "numerics", "?layer=booster")
    note = find(body, ids.LAYER_NOTE).children
    assert note.startswith("Layer booster: outlined on 3 heatmap(s)"), note
    for fig in (g.figure for g in _graphs(body)):
        heat = [t for t in fig.data if t.type == "heatmap"]
        if not heat:
            continue
        rows = [i for i, y in enumerate(heat[-1].y) if str(y).split(" \u00b7 ")[1] == "booster"]
        assert {str(heat[-1].y[i])[:3] for i in rows} == {"r0 ", "r1 "}
        marked = sorted(round(s.y0 + 0.5) for s in fig.layout.shapes if s.type == "rect")
        assert rows and marked == rows


def _graphs(component: Any) -> list[Any]:
    if isinstance(component, (list, tuple)):
        return [g for c in component for g in _graphs(c)]
    found = [component] if getattr(component, "figure", None) is not None else []
    children = getattr(component, "children", None)
    if children is not None and not isinstance(children, str):
        found += _graphs(children)
    return found


# -- 2: a live page follows the diagnosis ------------------------------------------------------------


def test_a_live_tick_rediagnoses_and_the_open_tab_equals_a_reload(
    tmp_path: Path, live: LiveTraining, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dashboard.runs as runs_mod

    monkeypatch.setattr(runs_mod, "LIVE_COST_FACTOR", 0.0)
    live.train(10)
    ctx = callbacks.Context(root=tmp_path, refresh_ms=0)  # no wait between two diagnoses
    page = callbacks.render_page(ctx, "/run/live")
    version = find(page, ids.RUN_VERSION).data
    assert "AMP-N02" not in texts(page)
    _, _, same, disabled = callbacks.refresh_live(ctx, 1, "live", version)
    assert same is dash.no_update and disabled is False  # nothing new: nothing redrawn

    live.train(6, overflow=True)
    _, _, version, disabled = callbacks.refresh_live(ctx, 2, "live", version)
    assert isinstance(version, int) and disabled is False
    overview = open_tab(ctx, "live", "overview")
    assert "AMP-N02" in texts(overview)
    reload = callbacks.Context(root=tmp_path)
    fresh = callbacks.render_page(reload, "/run/live")
    assert health_texts(overview) == health_texts(fresh)
    assert texts(find(overview, ids.FINDINGS)) == texts(find(fresh, ids.FINDINGS))
    assert texts(find(overview, ids.NOT_CHECKED)) == texts(find(fresh, ids.NOT_CHECKED))
    scale_text = [t for t in texts(open_tab(ctx, "live", "scale")) if "scaled steps" in t]
    assert scale_text and scale_text == [
        t for t in texts(open_tab(reload, "live", "scale")) if "scaled steps" in t
    ]
    # the filters from the URL apply to the redrawn findings
    errors_only = open_tab(ctx, "live", "overview", "?sev=error")
    assert "AMP-N02" in texts(errors_only) and "AMP-S02" not in texts(errors_only)

    live.train(2)
    live.close()
    text, status, last, disabled = callbacks.refresh_live(ctx, 3, "live", version)
    assert disabled is True and "finished" in texts(status) and last != version
    assert ctx.cache.get("live").run.status == "finished"
    done = open_tab(ctx, "live", "overview")
    assert health_texts(done) == health_texts(callbacks.render_page(reload, "/run/live"))
    # while live, the findings said which step they were made from; once finished, no note
    assert find(overview, ids.FINDINGS_AS_OF).children.startswith("Findings as of step 15:")
    assert find(done, ids.FINDINGS_AS_OF) is None and "findings as of" not in text


def test_a_live_run_is_diagnosed_again_no_more_often_than_allowed(
    tmp_path: Path, live: LiveTraining, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dashboard.runs as runs_mod

    live.train(3)
    ctx = callbacks.Context(root=tmp_path, refresh_ms=60_000)  # a 45 s wait
    calls: list[int] = []
    real = amprobe.diagnose

    def counting(run: Any) -> Any:
        calls.append(1)
        return real(run)

    monkeypatch.setattr(amprobe, "diagnose", counting)
    page = callbacks.render_page(ctx, "/run/live")
    version = find(page, ids.RUN_VERSION).data
    assert find(page, ids.RUN_STEPS).children == "3 steps (last step 2); findings as of step 2"
    for i in range(5):
        live.train(1)
        text, _, same, _ = callbacks.refresh_live(ctx, i, "live", version)
        assert same is dash.no_update
    assert len(calls) == 1  # changed files, within the wait: not diagnosed again
    # the steps follow every tick; the findings shown are older, and the page says from when
    # (what the diagnosed run read: its summaries; its steps frame, never loaded by the
    # diagnosis, would be read now, with the steps trained since)
    diagnosed = ctx.cache.get("live").diagnosis.run.last_step
    assert diagnosed == 2
    assert text == f"8 steps (last step 7); findings as of step {diagnosed}"
    monkeypatch.setattr(runs_mod, "LIVE_COST_FACTOR", 0.0)
    ctx.cache.live_reload_s = 0.0
    text, _, new_version, _ = callbacks.refresh_live(ctx, 9, "live", version)
    assert isinstance(new_version, int) and len(calls) == 2
    assert text == "8 steps (last step 7); findings as of step 7"
    live.close()  # ended: diagnosed once more, at once, whatever the wait
    ctx.cache.live_reload_s = 60.0
    monkeypatch.setattr(runs_mod, "LIVE_COST_FACTOR", 3.0)
    assert callbacks.refresh_live(ctx, 10, "live", version)[3] is True
    assert len(calls) == 3 and ctx.cache.get("live").run.status == "finished"


def test_a_live_page_redraws_its_header_warnings_with_a_new_version(
    tmp_path: Path, live: LiveTraining, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header's device and warnings were drawn once, at page load: a warning that a later
    diagnosis of the live run gives must show too."""
    import dashboard.runs as runs_mod

    monkeypatch.setattr(runs_mod, "LIVE_COST_FACTOR", 0.0)
    live.train(3)
    ctx = callbacks.Context(root=tmp_path, refresh_ms=0)
    page = callbacks.render_page(ctx, "/run/live")
    version = find(page, ids.RUN_VERSION).data
    assert not find(page, ids.RUN_WARNINGS).children
    assert find(page, ids.RUN_DEVICE).children == "device: cpu"
    with open(tmp_path / "live" / "rank0" / "steps.jsonl", "a") as fh:
        fh.write("{not a record}\n")
    live.train(2)
    _, _, new_version, _ = callbacks.refresh_live(ctx, 1, "live", version)
    assert isinstance(new_version, int)
    device, warnings = callbacks.refresh_header(ctx, "live", new_version)
    shown = [w.children for w in warnings]
    assert shown == ctx.cache.get("live").run.warnings and device == "device: cpu"
    assert any("unreadable record" in w for w in shown), shown
    assert callbacks.refresh_header(ctx, "live", version) == (dash.no_update, dash.no_update)


def test_a_live_page_whose_new_steps_cannot_be_diagnosed_says_so(
    tmp_path: Path, live: LiveTraining, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dashboard.runs as runs_mod

    monkeypatch.setattr(runs_mod, "LIVE_COST_FACTOR", 0.0)
    live.train(3)
    ctx = callbacks.Context(root=tmp_path, refresh_ms=0)
    version = find(callbacks.render_page(ctx, "/run/live"), ids.RUN_VERSION).data

    def broken(run: Any) -> Any:
        raise KeyError("boom")

    monkeypatch.setattr(amprobe, "diagnose", broken)
    live.train(2)
    text, _, new_version, disabled = callbacks.refresh_live(ctx, 1, "live", version)
    assert text.startswith("5 steps") and "the findings shown are older" in text
    assert "KeyError" in text and new_version is dash.no_update and disabled is False
    live.close()  # ended, and still not diagnosable: polling stops after a few tries in a row
    results = [callbacks.refresh_live(ctx, 2 + i, "live", version)[3] for i in range(5)]
    tries = callbacks.LIVE_READ_ATTEMPTS - 1  # one failed already while the run was live
    assert results == [False] * (tries - 1) + [True] * (5 - tries + 1)


# -- in the browser ----------------------------------------------------------------------------------

#: Records, from the first byte of each page, when each selector first matched
#: (``performance.now()``: milliseconds since the navigation started).
_WATCH = """
window.__seen = {};
const sels = %s;
function check() {
  for (const [name, sel] of Object.entries(sels)) {
    if (!(name in window.__seen) && document.querySelector(sel)) {
      window.__seen[name] = performance.now();
    }
  }
}
new MutationObserver(check).observe(document, {subtree: true, childList: true});
"""


#: Records in ``window.__drawn`` when an element first holds a text (``Date.now()``).
_WATCH_TEXT = """
const [selector, text] = arguments;
window.__drawn = null;
const observer = new MutationObserver(() => {
  const el = document.querySelector(selector);
  if (window.__drawn === null && el && el.textContent.includes(text)) {
    window.__drawn = Date.now();
    observer.disconnect();
  }
});
observer.observe(document.body, {subtree: true, childList: true, characterData: true});
"""


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` CPU-bound processes beside the test (a loaded machine)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _tab(driver: Any, label: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(
        By.XPATH, f"//*[contains(@class,'tab') and normalize-space()='{label}']"
    )


@pytest.mark.browser
@pytest.mark.skipif(_MISSING is not None, reason=f"no headless browser: {_MISSING}")
def test_demo_page_shows_a_placeholder_then_findings_and_keeps_its_tab_in_the_url(
    tmp_path: Path,
) -> None:
    import json

    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from amprobe.demo import train
    from dashboard.app import create_app

    train(tmp_path / "demo", steps=300, device=torch.device("cpu"))
    app = create_app(tmp_path)
    driver = chromium_driver()
    wait = WebDriverWait(driver, WAIT_S, ignored_exceptions=(StaleElementReferenceException,))
    selectors = {
        "placeholder": f".{ids.LOADING}",
        "findings": f"#{ids.FINDINGS} .finding",
    }
    driver.execute_cdp_cmd(
        "Page.addScriptToEvaluateOnNewDocument", {"source": _WATCH % json.dumps(selectors)}
    )
    try:
        with ServerThread(app) as server:
            driver.get(server.url + "/run/demo")  # loads and diagnoses the run: a cold visit
            wait.until(lambda d: "findings" in d.execute_script("return window.__seen"))
            cold = driver.execute_script("return window.__seen")
            times = []
            with busy_processes(2):
                for _ in range(3):
                    driver.get(server.url + "/run/demo")
                    wait.until(lambda d: "findings" in d.execute_script("return window.__seen"))
                    times.append(driver.execute_script("return window.__seen"))
            print(
                "\nrun page, ms from navigation (placeholder, findings): cold "
                f"{cold.get('placeholder', -1):.0f}, {cold['findings']:.0f}; with 2 busy "
                "processes "
                + "; ".join(f"{t.get('placeholder', -1):.0f}, {t['findings']:.0f}" for t in times)
            )
            # a placeholder shows before the findings, and soon; the findings within 1.5 s (the
            # best of three visits: the machine's other work delays any one of them)
            assert all("placeholder" in t and t["placeholder"] < t["findings"] for t in times)
            assert min(t["placeholder"] for t in times) < 1000
            assert min(t["findings"] for t in times) < 1500

            # ?tab= opens that tab; clicking a tab writes the URL; the back button follows
            driver.get(server.url + "/run/demo?tab=scale&step=150")
            graph = f"#{ids.LOSS_SCALE_GRAPH} .scatterlayer .trace"
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, graph), "the loss-scale chart")
            selected = driver.find_element(By.CSS_SELECTOR, ".tab--selected").text
            assert selected == "Loss scale"
            assert "Step 150 is marked" in driver.find_element(By.ID, ids.STEP_NOTE).text
            assert driver.find_elements(
                By.CSS_SELECTOR, f"#{ids.LOSS_SCALE_GRAPH} .shapelayer path"
            )
            marker = driver.find_element(By.ID, ids.RUN_TITLE)  # survives only without a reload
            _tab(driver, "Numerics").click()
            wait.until(lambda d: d.current_url.endswith("/run/demo?tab=numerics"), "the URL")
            wait.until(lambda d: d.find_elements(By.ID, f"{ids.SECTION_PREFIX}numerics"))
            _tab(driver, "Overview").click()
            wait.until(lambda d: d.current_url.endswith("/run/demo"), "the URL without a tab")
            info = f"//*[@id='{ids.SEVERITY_FILTER}']//label[normalize-space()='info']"
            # the URL changes before the overview is drawn again (a loaded machine: seconds)
            wait.until(lambda d: d.find_elements(By.XPATH, info), "the overview's filters")
            driver.find_element(By.XPATH, info).click()
            wait.until(lambda d: d.current_url.endswith("?sev=error,warning"), "the filter")
            assert marker.text == "demo"
            driver.back()
            driver.back()
            wait.until(
                lambda d: d.find_element(By.CSS_SELECTOR, ".tab--selected").text == "Numerics",
                "the back button to reopen the numerics tab",
            )
            driver.get(server.url + "/run/demo?tab=numerics&layer=booster")
            wait.until(lambda d: d.find_elements(By.ID, ids.LAYER_NOTE), "the layer note")
            assert "Layer booster: outlined on" in driver.find_element(By.ID, ids.LAYER_NOTE).text
            errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors, "\n".join(e["message"][100:400] for e in errors)
    finally:
        driver.quit()


@pytest.mark.browser
@pytest.mark.skipif(_MISSING is not None, reason=f"no headless browser: {_MISSING}")
def test_live_page_raises_a_new_finding_within_two_refresh_intervals(
    tmp_path: Path, live: LiveTraining
) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from dashboard.app import create_app

    refresh_ms = 2000  # the default
    app = create_app(tmp_path, refresh_ms=refresh_ms)
    driver = chromium_driver()
    wait = WebDriverWait(
        driver, WAIT_S, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
    )

    def text_of(element_id: str) -> str:
        return driver.find_element(By.ID, element_id).text

    def shown() -> dict[str, str]:
        scale = [p.text for p in driver.find_elements(By.CSS_SELECTOR, f"#{ids.RUN_TAB_BODY} p")]
        return {
            "health": text_of(ids.HEALTH) if driver.find_elements(By.ID, ids.HEALTH) else "",
            "findings": text_of(ids.FINDINGS) if driver.find_elements(By.ID, ids.FINDINGS) else "",
            "scale": "\n".join(t for t in scale if "scaled steps" in t),
        }

    try:
        with ServerThread(app) as server:
            live.train(10)
            driver.get(server.url + "/run/live")
            wait.until(lambda d: "live" in text_of(ids.RUN_STATUS), "the status 'live'")
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#{ids.FINDINGS} .finding"))
            assert "AMP-N02" not in text_of(ids.FINDINGS)
            # the findings say which step they were made from, and follow each re-diagnosis
            assert text_of(ids.FINDINGS_AS_OF).startswith("Findings as of step 9:")
            marker = driver.find_element(By.ID, ids.RUN_TITLE)  # survives only without a reload
            # the browser notes when AMP-N02 is first drawn (ms since the epoch, as time.time())
            driver.execute_script(_WATCH_TEXT, f"#{ids.FINDINGS}", "AMP-N02")

            live.train(6, overflow=True)  # the scaler skips 6 steps: AMP-N02
            written = time.time()
            wait.until(lambda d: "AMP-N02" in text_of(ids.FINDINGS), "AMP-N02 on the open page")
            drawn = driver.execute_script("return window.__drawn") / 1000
            elapsed = drawn - written
            print(
                f"\nnew finding drawn on the open live page {elapsed:.2f} s after it was written "
                f"(refresh interval {refresh_ms / 1000:.0f} s)"
            )
            assert 0 < elapsed < 2 * refresh_ms / 1000
            assert marker.text == "live"
            wait.until(
                lambda d: text_of(ids.FINDINGS_AS_OF).startswith("Findings as of step 15:"),
                "the findings' step to follow the re-diagnosis",
            )
            time.sleep(3 * refresh_ms / 1000)  # the run is idle: the page settles
            live_view = shown()
            driver.refresh()
            wait.until(lambda d: "AMP-N02" in text_of(ids.FINDINGS), "the findings after a reload")
            assert shown() == live_view

            # the loss-scale tab's text follows too, and is what a reload of the tab shows
            _tab(driver, "Loss scale").click()
            wait.until(lambda d: "scaled steps" in shown()["scale"], "the loss-scale text")
            before = shown()["scale"]
            live.train(4, overflow=True)
            wait.until(lambda d: shown()["scale"] not in ("", before), "the scale text to follow")
            live.close()
            wait.until(lambda d: "finished" in text_of(ids.RUN_STATUS), "the status 'finished'")
            time.sleep(2 * refresh_ms / 1000)
            finished_scale = shown()["scale"]
            driver.refresh()
            wait.until(lambda d: "scaled steps" in shown()["scale"], "the reloaded scale tab")
            assert shown()["scale"] == finished_scale
            assert driver.current_url.endswith("/run/live?tab=scale")
            _tab(driver, "Overview").click()
            wait.until(lambda d: "AMP-N02" in text_of(ids.FINDINGS))
            finished_view = shown()
            reload = callbacks.Context(root=tmp_path)
            callbacks.render_page(reload, "/run/live")
            assert "Health" in finished_view["health"]
            for finding in reload.cache.get("live").diagnosis.findings:
                assert finding.id in finished_view["findings"]
    finally:
        driver.quit()
