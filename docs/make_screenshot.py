"""Take the README's dashboard screenshots with the same setup as the browser test.

Records a small real AMP run (CPU, fp16 autocast, GradScaler, three injected overflows) and a
synthetic 20,000-step run, serves the dashboard over them and saves, with headless Chromium:

- ``docs/dashboard.png``: a run's overview (health metrics, findings most severe first);
- ``docs/dashboard-loss-scale.png``: the loss-scale panel of the long run.

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

    from dashboard import ids
    from dashboard.app import create_app
    from dashboard.browser import ServerThread, browser_missing, chromium_driver
    from dashboard.demo import record_amp_run, write_synthetic_run

    missing = browser_missing()
    if missing:
        raise SystemExit(f"cannot take screenshots: {missing}")
    with tempfile.TemporaryDirectory(prefix="amprobe-shot-") as tmp:
        root = Path(tmp)
        record_amp_run(root / "tiny-mlp-fp16", steps=40, inf_steps=(12, 13, 21))
        write_synthetic_run(root / "gpt-fp16-20k", steps=20_000)
        app = create_app(root)
        driver = chromium_driver(1300, 1150)
        wait = WebDriverWait(driver, 30)
        try:
            with ServerThread(app) as server:
                driver.get(server.url + "/run/tiny-mlp-fp16")
                wait.until(ec.presence_of_element_located((By.CLASS_NAME, "finding")))
                driver.save_screenshot(str(HERE / "dashboard.png"))
                driver.get(server.url + "/run/gpt-fp16-20k")
                wait.until(ec.presence_of_element_located((By.ID, ids.RUN_TABS)))
                driver.find_element(By.XPATH, "//*[contains(@class,'tab') and normalize-space()='Loss scale']").click()
                wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#{ids.LOSS_SCALE_GRAPH} .scatterlayer .trace"))
                driver.save_screenshot(str(HERE / "dashboard-loss-scale.png"))
        finally:
            driver.quit()
    print(f"wrote {HERE / 'dashboard.png'} and {HERE / 'dashboard-loss-scale.png'}")


if __name__ == "__main__":
    main()
