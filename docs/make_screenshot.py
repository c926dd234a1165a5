"""Take the documentation's dashboard screenshots from the current code, so anyone can retake them.

Records the embedded demo (a real CPU run: fp16 autocast, GradScaler, a planted overflowing
layer and clipping before ``unscale_``), serves the dashboard over it and over
``sample_runs/healthy``, and saves with headless Chromium at 1440x900:

- ``docs/screens/<run>-<tab>.png`` for the runs ``demo`` and ``healthy`` and the tabs
  ``overview`` (health metrics and findings), ``scale`` (the loss-scale panel) and ``numerics``
  (per-layer numerics);
- ``docs/dashboard.png``: the demo's overview, the picture README shows;
- ``docs/report.png``: the top of the HTML report that ``amprobe report`` writes for the demo.

Each tab is opened by its URL, ``/run/<name>?tab=<key>``; where that URL does not select the
tab (a dashboard without URL tab state), the tab is clicked by its label. Needs the ``dev``
extra (dash, selenium) and Debian's ``chromium`` and ``chromium-driver``::

    python docs/make_screenshot.py
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SCREENS = HERE / "screens"
WIDTH, HEIGHT = 1440, 900
#: tab key in the URL -> the tab's label on the page
TABS = {"overview": "Overview", "scale": "Loss scale", "numerics": "Numerics"}
RUNS = ("demo", "healthy")
WAIT_S = 60  # generous: a loaded 2-core machine takes seconds to build a run page

if str(REPO) not in sys.path:  # run as a script from a fresh clone
    sys.path.insert(0, str(REPO))


def _selected_tab(driver: Any) -> str:
    from selenium.webdriver.common.by import By

    selected = driver.find_elements(By.CSS_SELECTOR, ".tab--selected")
    return selected[0].text.strip() if selected else ""


def _open_tab(driver: Any, url: str, key: str) -> str:
    """Open ``url`` on tab ``key``; returns how the tab was selected (``url`` or ``click``)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from dashboard import ids

    wait = WebDriverWait(driver, WAIT_S)
    driver.get(f"{url}?tab={key}")
    wait.until(ec.presence_of_element_located((By.ID, ids.RUN_TABS)))
    wait.until(lambda d: _selected_tab(d))
    label = TABS[key]
    if _selected_tab(driver) == label:
        return "url"
    driver.find_element(
        By.XPATH, f"//*[contains(@class,'tab') and normalize-space()='{label}']"
    ).click()
    wait.until(lambda d: _selected_tab(d) == label)
    return "click"


def _wait_for_content(driver: Any, key: str) -> None:
    """Wait until the tab shows what it is for: the findings list, or its figures drawn."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from dashboard import ids

    wait = WebDriverWait(driver, WAIT_S)
    try:
        if key == "overview":
            wait.until(lambda d: d.find_elements(By.ID, ids.FINDINGS))
        else:
            wait.until(
                lambda d: (
                    d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot .main-svg")
                    and not d.find_elements(By.CSS_SELECTOR, "._dash-loading, .dash-spinner")
                )
            )
    except TimeoutException:
        raise SystemExit(
            f"{key}: content not drawn after {WAIT_S} s; no screenshot taken"
        ) from None
    time.sleep(1.0)  # plotly's transitions and web fonts settle


def main() -> int:
    from dashboard.browser import ServerThread, browser_missing, chromium_driver

    missing = browser_missing()
    if missing:
        print(f"cannot take screenshots: {missing}", file=sys.stderr)
        return 1
    import torch

    import amprobe
    from amprobe.demo import DEMO_CONFIG, train
    from amprobe.report import write_report
    from dashboard.app import create_app

    SCREENS.mkdir(exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="amprobe-shot-") as tmp:
        root = Path(tmp)
        print("recording the demo (300 steps on the CPU) ...")
        # as `amprobe demo` records it: the default sampling periods exactly
        train(root / "demo", steps=300, device=torch.device("cpu"), config=dict(DEMO_CONFIG))
        shutil.copytree(REPO / "sample_runs" / "healthy", root / "healthy")
        run = amprobe.load_run(root / "demo")
        report = write_report(run, amprobe.diagnose(run), root / "report.html")
        app = create_app(root)
        driver = chromium_driver(WIDTH, HEIGHT)
        try:
            # the viewport itself at WIDTH x HEIGHT (a window of that size has a smaller one)
            driver.execute_cdp_cmd(
                "Emulation.setDeviceMetricsOverride",
                {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
            )
            with ServerThread(app) as server:
                for name in RUNS:
                    for key in TABS:
                        how = _open_tab(driver, f"{server.url}/run/{name}", key)
                        _wait_for_content(driver, key)
                        path = SCREENS / f"{name}-{key}.png"
                        driver.save_screenshot(str(path))
                        written.append(path)
                        print(f"  {path.relative_to(REPO)} (tab selected by {how})")
            shutil.copyfile(SCREENS / "demo-overview.png", HERE / "dashboard.png")
            written.append(HERE / "dashboard.png")
            driver.get(report.resolve().as_uri())
            from selenium.webdriver.common.by import By
            from selenium.webdriver.support.ui import WebDriverWait

            WebDriverWait(driver, WAIT_S).until(
                lambda d: d.find_elements(By.CSS_SELECTOR, ".plotly .scatterlayer .trace")
            )
            driver.save_screenshot(str(HERE / "report.png"))
            written.append(HERE / "report.png")
        finally:
            driver.quit()
    print("wrote " + ", ".join(str(p.relative_to(REPO)) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
