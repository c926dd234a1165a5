"""End to end: the dashboard in a real headless Chromium over recorded runs, one of them live."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

pytest.importorskip("dash", reason="the dashboard needs dash (pip install 'amprobe[dashboard]')")

from dashboard import ids  # noqa: E402
from dashboard.browser import ServerThread, browser_missing, chromium_driver  # noqa: E402
from dashboard.demo import record_amp_run, write_synthetic_run  # noqa: E402

pytestmark = pytest.mark.browser

_MISSING = browser_missing()
SAMPLE_RUNS = Path(__file__).resolve().parents[1] / "sample_runs"
RUN_LINKS = f'#{ids.RUN_LIST_TABLE} td[data-dash-column="run"] a'
#: How long one condition may take to hold in the browser: generous, as a loaded machine (load
#: 7-10 on 2 cores) delays the server, the callbacks and Chromium's rendering alike.
WAIT_S = 120


def _steps(text: str) -> int:
    match = re.match(r"(\d+) steps", text)
    return int(match.group(1)) if match else -1


@pytest.mark.skipif(_MISSING is not None, reason=f"no headless browser: {_MISSING}")
def test_dashboard_in_headless_chromium(tmp_path: Path) -> None:
    import shutil

    import torch
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    import amprobe
    from dashboard.app import create_app

    if SAMPLE_RUNS.is_dir():  # the recorded sample runs, when this checkout has them
        shutil.copytree(SAMPLE_RUNS, tmp_path / "samples", ignore=shutil.ignore_patterns("*.py"))
    record_amp_run(tmp_path / "amp", steps=30)
    write_synthetic_run(tmp_path / "baseline", steps=400)
    amp_ids = amprobe.diagnose(amprobe.load_run(tmp_path / "amp")).ids()
    assert amp_ids

    app = create_app(tmp_path, refresh_ms=500)
    driver = chromium_driver()
    # a component re-rendered between finding it and reading it is read again
    wait = WebDriverWait(driver, WAIT_S, ignored_exceptions=(StaleElementReferenceException,))

    def text_of(element_id: str) -> str:
        return driver.find_element(By.ID, element_id).text

    probe = None
    try:
        with ServerThread(app) as server:
            # run list
            driver.get(server.url + "/")
            wait.until(ec.presence_of_element_located((By.ID, ids.RUN_LIST_TABLE)))
            # the rows fill in as the runs are diagnosed: wait for all that is checked
            expected = ["baseline", "finished", amp_ids[0]]
            if SAMPLE_RUNS.is_dir():
                expected.append("samples/")
            wait.until(
                lambda d: all(t in text_of(ids.RUN_LIST_TABLE) for t in expected),
                f"the run list to show {expected}",
            )

            # open a run by clicking its link: findings show their IDs
            def click_run_link(d: Any) -> bool:  # the table re-renders as its rows refresh
                link = [a for a in d.find_elements(By.CSS_SELECTOR, RUN_LINKS) if a.text == "amp"]
                if link:
                    link[0].click()
                return bool(link)

            wait.until(click_run_link, "a link to run 'amp'")
            # the title exactly: "samples/..." holds "amp" too
            wait.until(lambda d: text_of(ids.RUN_TITLE) == "amp", "the page of run 'amp'")
            wait.until(
                lambda d: all(rid in text_of(ids.FINDINGS) for rid in amp_ids),
                f"the findings {amp_ids}",
            )

            # the loss-scale figure renders (plotly drew its traces)
            driver.find_element(
                By.XPATH, "//*[contains(@class,'tab') and normalize-space()='Loss scale']"
            ).click()
            wait.until(
                lambda d: (
                    len(
                        d.find_elements(
                            By.CSS_SELECTOR, f"#{ids.LOSS_SCALE_GRAPH} .scatterlayer .trace"
                        )
                    )
                    >= 3
                )
            )
            assert driver.find_elements(By.CSS_SELECTOR, f"#{ids.LOSS_SCALE_GRAPH} .main-svg")

            # the precision what-if heatmap renders, with the format windows drawn over it,
            # and switches to the gradients
            driver.find_element(
                By.XPATH, "//*[contains(@class,'tab') and normalize-space()='Precision what-if']"
            ).click()
            heatmap = f"#{ids.WHATIF_HEATMAP}"
            wait.until(
                lambda d: (
                    d.find_elements(By.CSS_SELECTOR, f"{heatmap} .heatmaplayer image")
                    or d.find_elements(By.CSS_SELECTOR, f"{heatmap} .heatmaplayer .hm")
                )
            )
            wait.until(
                lambda d: (
                    "activations" in d.find_element(By.CSS_SELECTOR, f"{heatmap} .gtitle").text
                ),
                "the activations heatmap's title",
            )
            wait.until(
                lambda d: len(d.find_elements(By.CSS_SELECTOR, f"{heatmap} .shapelayer path")) >= 4,
                "the format windows drawn over the heatmap",
            )
            wait.until(
                lambda d: all(
                    t in d.find_element(By.CSS_SELECTOR, f"{heatmap} .legend").text
                    for t in ("fp8-e4m3 as-is", "fp16 as-is")
                ),
                "the heatmap's legend",
            )
            driver.find_element(
                By.XPATH, f"//*[@id='{ids.WHATIF_GROUP}']//label[normalize-space()='gradients']"
            ).click()
            wait.until(
                lambda d: "gradients" in d.find_element(By.CSS_SELECTOR, f"{heatmap} .gtitle").text
            )

            # a live run gains steps while its page is open
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            scaler = torch.amp.GradScaler("cpu")
            probe = amprobe.attach(
                model, opt, scaler, run_dir=tmp_path / "live", config={"flush_every": 1}
            )

            def train(n: int) -> None:
                for _ in range(n):
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = model(torch.randn(2, 4)).float().mean()
                    opt.zero_grad()
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()

            train(3)
            driver.get(server.url + "/run/live")
            wait.until(lambda d: _steps(text_of(ids.RUN_STEPS)) >= 1, "the live run's steps")
            wait.until(lambda d: "live" in text_of(ids.RUN_STATUS), "the status 'live'")
            marker = driver.find_element(By.ID, ids.RUN_TITLE)  # survives only without a reload
            train(7)
            wait.until(lambda d: _steps(text_of(ids.RUN_STEPS)) >= 10, "the live run's 10 steps")
            assert marker.text == "live"
            probe.close()
            probe = None
            wait.until(lambda d: "finished" in text_of(ids.RUN_STATUS), "the status 'finished'")
    finally:
        if probe is not None:
            probe.close()
        driver.quit()


@pytest.mark.skipif(_MISSING is not None, reason=f"no headless browser: {_MISSING}")
def test_run_list_pages_many_runs_and_shows_hostile_ones_as_text(tmp_path: Path) -> None:
    """120 runs, one a FIFO trap and one named like HTML: paged, filled in, nothing injected."""
    import os

    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from dashboard.app import create_app
    from dashboard.runs import PENDING

    for i in range(118):
        write_synthetic_run(tmp_path / f"run{i:03d}", steps=3, seed=i)
    write_synthetic_run(tmp_path / "<b>bold</b>", steps=3)
    write_synthetic_run(tmp_path / "aaa_fifo", steps=3)
    (tmp_path / "aaa_fifo" / "rank0" / "steps.jsonl").unlink()
    os.mkfifo(tmp_path / "aaa_fifo" / "rank0" / "steps.jsonl")

    app = create_app(tmp_path, refresh_ms=500)
    driver = chromium_driver()
    wait = WebDriverWait(driver, 60, ignored_exceptions=(StaleElementReferenceException,))

    def links(d: Any) -> list[str]:  # read in one script: the table re-renders as rows fill in
        return d.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0])).map(a => a.textContent)",
            RUN_LINKS,
        )

    try:
        with ServerThread(app) as server:
            driver.get(server.url + "/")
            wait.until(lambda d: len(links(d)) == 50)
            names = links(driver)
            assert names[:3] == ["<b>bold</b>", "aaa_fifo", "run000"]  # the name is text
            table = driver.find_element(By.ID, ids.RUN_LIST_TABLE)
            assert not table.find_elements(By.TAG_NAME, "b")
            assert "120 runs" in driver.find_element(By.ID, ids.RUN_LIST_PAGES).text
            wait.until(lambda d: PENDING not in d.find_element(By.ID, ids.RUN_LIST_TABLE).text)
            text = driver.find_element(By.ID, ids.RUN_LIST_TABLE).text
            assert "unreadable: rank0/steps.jsonl is a FIFO, not a regular file" in text
            assert "finished" in text

            driver.find_element(By.CSS_SELECTOR, f"#{ids.RUN_LIST_TABLE} button.next-page").click()
            wait.until(lambda d: links(d)[:1] == ["run048"])
            driver.find_element(By.CSS_SELECTOR, f"#{ids.RUN_LIST_TABLE} button.last-page").click()
            wait.until(lambda d: len(links(d)) == 20)
            wait.until(lambda d: PENDING not in d.find_element(By.ID, ids.RUN_LIST_TABLE).text)

            assert links(driver)[-1] == "run117"
            driver.find_elements(By.CSS_SELECTOR, RUN_LINKS)[-1].click()
            wait.until(lambda d: d.find_elements(By.ID, ids.RUN_TITLE))
            assert driver.find_element(By.ID, ids.RUN_TITLE).text == "run117"

            # plotly draws a run named like HTML as text: no bold tspan in the legend
            driver.get(server.url + "/compare?a=" + quote("<b>bold</b>") + "&b=run000")
            legend = f"#{ids.COMPARE_GRAPH} .legendtext"
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, legend)) == 2)
            shown = [e.text for e in driver.find_elements(By.CSS_SELECTOR, legend)]
            assert "<b>bold</b>" in shown
            assert not driver.find_elements(By.CSS_SELECTOR, f"{legend} tspan[style*=bold]")
    finally:
        driver.quit()
