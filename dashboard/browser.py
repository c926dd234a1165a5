"""Serve the app in a background thread and drive it with headless Chromium (tests, screenshots).

Uses Debian's ``chromium`` and ``chromium-driver`` packages through Selenium.
"""

from __future__ import annotations

import logging
import shutil
import threading
from typing import Any

__all__ = ["CHROMIUM", "CHROMEDRIVER", "browser_missing", "ServerThread", "chromium_driver"]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def browser_missing() -> str | None:
    """Why a headless browser cannot be driven here, or None when it can."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not shutil.which(path):
            return f"{path} not found (apt-get install {package})"
    return None


class ServerThread:
    """The app's Flask server on a free localhost port, in a daemon thread."""

    def __init__(self, app: Any) -> None:
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self._server = make_server("127.0.0.1", 0, app.server, threaded=True)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)


def chromium_driver(width: int = 1400, height: int = 1000) -> Any:
    """A headless Chromium WebDriver of the given window size."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
