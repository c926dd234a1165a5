"""Take the README's dashboard screenshots with the same setup as the browser test.

Records the embedded demo (a real CPU run: fp16 autocast, GradScaler, a planted overflowing
layer and clipping before unscale_), serves the dashboard over it and saves, with headless
Chromium:

- ``docs/dashboard.png``: the run's overview (health metrics, findings most severe first);
- ``docs/dashboard-loss-scale.png``: the loss-scale panel;
- ``docs/report.png``: the top of the HTML report that ``amprobe report`` writes.

    python docs/make_screenshot.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    import amprobe
    from amprobe.demo import train
    from amprobe.report import write_report
    from dashboard import ids
    from dashboard.app import create_app
    from dashboard.browser import ServerThread, browser_missing, chromium_driver

    missing = browser_missing()
    if missing:
        raise SystemExit(f"cannot take screenshots: {missing}")
    with tempfile.TemporaryDirectory(prefix="amprobe-shot-") as tmp:
        root = Path(tmp)
        import torch

        train(root / "demo", steps=300, device=torch.device("cpu"))
        run = amprobe.load_run(root / "demo")
        report = write_report(run, amprobe.diagnose(run), root / "report.html")
        app = create_app(root)
        driver = chromium_driver(1300, 1150)
        wait = WebDriverWait(driver, 30)
        try:
            with ServerThread(app) as server:
                driver.get(server.url + "/run/demo")
                wait.until(ec.presence_of_element_located((By.CLASS_NAME, "finding")))
                driver.save_screenshot(str(HERE / "dashboard.png"))
                driver.get(server.url + "/run/demo")
                wait.until(ec.presence_of_element_located((By.ID, ids.RUN_TABS)))
                driver.find_element(
                    By.XPATH, "//*[contains(@class,'tab') and normalize-space()='Loss scale']"
                ).click()
                wait.until(
                    lambda d: d.find_elements(
                        By.CSS_SELECTOR, f"#{ids.LOSS_SCALE_GRAPH} .scatterlayer .trace"
                    )
                )
                driver.save_screenshot(str(HERE / "dashboard-loss-scale.png"))
            driver.get(report.resolve().as_uri())
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".plotly .scatterlayer .trace"))
            driver.save_screenshot(str(HERE / "report.png"))
        finally:
            driver.quit()
    print(
        f"wrote {HERE / 'dashboard.png'}, {HERE / 'dashboard-loss-scale.png'} and {HERE / 'report.png'}"
    )


if __name__ == "__main__":
    main()
