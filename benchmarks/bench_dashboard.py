"""Dashboard first paint on a large run (100,000 steps, a 200-layer x 100,000-step heatmap) or
on a large root (``--runs 1000``: the run list over a thousand run directories).

Synthesizes the run directories (JSON Lines written directly), then times what the server does
before the browser can paint a run's page: load + diagnose + report sections + layout with
all figures thinned, serialised to the JSON Dash sends. Also times thinning a 200-layer heatmap
(what a numerics section's layer x step figure costs to display). With ``--runs N`` it times
the run list instead: the server's first page, and (with ``--browser``) headless Chromium from
navigation until the table's rows are painted, then until the first page's rows are diagnosed.
Prints seconds and the CPU; asserts nothing.

    python benchmarks/bench_dashboard.py [--steps 100000] [--layers 200] [--browser]
    python benchmarks/bench_dashboard.py --runs 1000 [--run-steps 200] [--browser [--repeat 3]]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def browser_first_paint(root: Path) -> None:
    """Seconds from navigating to a fresh server's run page until its findings and figure show."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from dashboard import ids
    from dashboard.app import create_app
    from dashboard.browser import ServerThread, browser_missing, chromium_driver

    missing = browser_missing()
    if missing:
        print(f"browser first paint: skipped ({missing})")
        return
    driver = chromium_driver()
    try:
        with ServerThread(create_app(root)) as server:
            driver.get(server.url + "/_dash-layout")  # warm the browser process, not the run
            t0 = time.perf_counter()
            driver.get(server.url + "/run/big")
            wait = WebDriverWait(driver, 60)
            wait.until(
                lambda d: (
                    d.find_elements(By.CLASS_NAME, "finding")
                    or "finding" in d.find_element(By.ID, ids.FINDINGS).text
                )
            )
            t1 = time.perf_counter()
            driver.find_element(
                By.XPATH, "//*[contains(@class,'tab') and normalize-space()='Loss scale']"
            ).click()
            wait.until(
                lambda d: d.find_elements(
                    By.CSS_SELECTOR, f"#{ids.LOSS_SCALE_GRAPH} .scatterlayer .trace"
                )
            )
            t2 = time.perf_counter()
    finally:
        driver.quit()
    print(
        f"browser first paint (cold server, {root.name}/big): findings shown {t1 - t0:.2f} s; "
        f"loss-scale figure drawn {t2 - t1:.2f} s after the tab click"
    )


def browser_run_list(root: Path, runs: int) -> None:
    """Seconds from navigating to a fresh server's run list until its rows are painted."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from dashboard import ids
    from dashboard.app import create_app
    from dashboard.browser import ServerThread, browser_missing, chromium_driver
    from dashboard.runs import PAGE_ROWS, PENDING

    missing = browser_missing()
    if missing:
        print(f"browser run list: skipped ({missing})")
        return
    driver = chromium_driver()
    try:
        with ServerThread(create_app(root, refresh_ms=500)) as server:
            driver.get(server.url + "/_dash-layout")  # warm the browser process, not the server
            t0 = time.perf_counter()
            driver.get(server.url + "/")
            wait = WebDriverWait(driver, 300, poll_frequency=0.05)
            shown = min(runs, PAGE_ROWS)
            links = f'#{ids.RUN_LIST_TABLE} td[data-dash-column="run"] a'
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, links)) == shown)
            t1 = time.perf_counter()
            wait.until(lambda d: PENDING not in d.find_element(By.ID, ids.RUN_LIST_TABLE).text)
            t2 = time.perf_counter()
            pages = driver.find_element(By.ID, ids.RUN_LIST_PAGES).text
    finally:
        driver.quit()
    print(
        f"browser first paint of the run list ({runs} runs, cold server): {shown} rows shown "
        f"{t1 - t0:.2f} s after navigation; all {shown} diagnosed {t2 - t0:.2f} s after it "
        f"({pages})"
    )


def bench_many_runs(runs: int, run_steps: int, browser: bool, repeat: int = 1) -> None:
    """The run list over ``runs`` finished synthetic runs of ``run_steps`` steps each."""
    from dashboard import callbacks
    from dashboard.demo import write_synthetic_run

    with tempfile.TemporaryDirectory(prefix="amprobe-bench-dash-runs-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        for i in range(runs):
            write_synthetic_run(root / f"run{i:04d}", run_steps, seed=i)
        print(f"synthesized {runs} runs of {run_steps} steps in {time.perf_counter() - t0:.2f} s")
        ctx = callbacks.Context(root=root)
        ctx.cache.first_wait_s = 0.0
        t0 = time.perf_counter()
        callbacks.render_page(ctx, "/")
        t1 = time.perf_counter()
        ctx.cache.wait_idle(600)
        t2 = time.perf_counter()
        callbacks.render_page(ctx, "/")
        t3 = time.perf_counter()
        print(
            f"run list (server side): first page {t1 - t0:.2f} s; its rows diagnosed in the "
            f"background {t2 - t0:.2f} s; first page again (cached) {t3 - t2:.3f} s"
        )
        if browser:
            for _ in range(repeat):
                browser_run_list(root, runs)
            if repeat > 1:
                print(
                    f"load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument(
        "--browser",
        action="store_true",
        help="also time the first paint in headless Chromium (needs chromium, selenium)",
    )
    parser.add_argument(
        "--runs", type=int, default=0, help="time the run list over this many runs instead"
    )
    parser.add_argument("--run-steps", type=int, default=200, help="steps per run with --runs")
    parser.add_argument(
        "--repeat", type=int, default=1, help="browser measurements with --runs (fresh server each)"
    )
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}")
    if args.runs:
        bench_many_runs(args.runs, args.run_steps, args.browser, args.repeat)
        return

    import numpy as np
    import plotly.graph_objects as go
    from plotly.utils import PlotlyJSONEncoder

    from amprobe.report.downsample import thin_figure
    from dashboard import callbacks
    from dashboard.demo import write_synthetic_run

    with tempfile.TemporaryDirectory(prefix="amprobe-bench-dash-") as tmp:
        t0 = time.perf_counter()
        write_synthetic_run(Path(tmp) / "big", args.steps)
        print(f"synthesized {args.steps} steps in {time.perf_counter() - t0:.2f} s")
        ctx = callbacks.Context(root=Path(tmp))
        t0 = time.perf_counter()
        page = callbacks.render_page(ctx, "/run/big")
        t1 = time.perf_counter()
        payload = json.dumps(page, cls=PlotlyJSONEncoder)
        t2 = time.perf_counter()
        print(
            f"first paint (server side): build page {t1 - t0:.2f} s + serialise {t2 - t1:.2f} s "
            f"= {t2 - t0:.2f} s, payload {len(payload) / 1e6:.2f} MB"
        )
        # the page is a frame; its tabs are built when opened (the overview first: the findings)
        for tab in ("overview", "scale"):
            t0 = time.perf_counter()
            body, _ = callbacks.render_tab(ctx, "big", tab, None, f"?tab={tab}", None)
            t1 = time.perf_counter()
            size = len(json.dumps(body, cls=PlotlyJSONEncoder))
            print(f"{tab} tab (server side): built {t1 - t0:.2f} s, payload {size / 1e6:.2f} MB")
        t0 = time.perf_counter()
        callbacks.render_page(ctx, "/run/big")
        callbacks.render_tab(ctx, "big", "overview", None, "?tab=overview", None)
        print(f"page and overview again (cached run): {time.perf_counter() - t0:.3f} s")
        t0 = time.perf_counter()
        callbacks.render_page(ctx, "/")
        print(f"run list: {time.perf_counter() - t0:.2f} s")
        t0 = time.perf_counter()
        callbacks.refresh_live(ctx, 1, "big")
        t1 = time.perf_counter()
        callbacks.refresh_live(ctx, 2, "big")
        print(
            f"live poll: first (full read) {t1 - t0:.2f} s, next (no new lines) {time.perf_counter() - t1:.3f} s"
        )

        if args.browser:
            browser_first_paint(Path(tmp))

        z = np.random.default_rng(0).poisson(0.01, size=(args.layers, args.steps)).astype("float32")
        fig = go.Figure(
            go.Heatmap(z=z, x=np.arange(args.steps), y=[f"layer{i}" for i in range(args.layers)])
        )
        t0 = time.perf_counter()
        thin_figure(fig)
        shown = fig.data[0].z
        print(
            f"thin {args.layers}x{args.steps} heatmap -> {np.asarray(shown).shape}: {time.perf_counter() - t0:.2f} s"
        )


if __name__ == "__main__":
    main()
