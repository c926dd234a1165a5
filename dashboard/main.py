"""Serve the dashboard: the entry point behind ``amprobe dashboard [ROOT] [--host] [--port]``."""

from __future__ import annotations

import os
import sys

__all__ = ["serve", "DashMissingError"]


class DashMissingError(ImportError):
    """Dash is not installed; the message is one line that says how to install it."""


def serve(
    root: str | os.PathLike[str] = ".",
    host: str = "127.0.0.1",
    port: int = 8050,
    debug: bool = False,
) -> None:
    """Serve the dashboard over the runs under ``root`` until interrupted.

    Binds to 127.0.0.1 unless ``host`` says otherwise: runs may hold paths and source lines,
    so the dashboard is not exposed to the network by default.

    Raises:
        DashMissingError: dash is not installed.
        NotADirectoryError: ``root`` is not a directory.
    """
    try:
        import dash  # noqa: F401
    except ImportError:
        raise DashMissingError(
            "the dashboard needs dash: pip install 'amprobe[dashboard]' (or pip install dash)"
        ) from None
    from dashboard.app import create_app

    app = create_app(root)
    print(
        f"amprobe dashboard: http://{host}:{port}/ (runs under {os.path.abspath(root)})",
        file=sys.stderr,
    )
    app.run(host=host, port=port, debug=debug)
