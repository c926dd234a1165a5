"""Serve the dashboard: the entry point behind ``amprobe dashboard [ROOT] [--host] [--port]``."""

from __future__ import annotations

import ipaddress
import os
import sys

__all__ = ["serve", "DashMissingError", "is_loopback", "exposure_warning"]


class DashMissingError(ImportError):
    """Dash is not installed; the message is one line that says how to install it."""


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def exposure_warning(host: str, port: int, root: str | os.PathLike[str]) -> str | None:
    """The warning printed when ``host`` is not loopback, or None when it is."""
    if is_loopback(host):
        return None
    return (
        f"amprobe dashboard: WARNING: listening on {host}:{port}, beyond this machine. "
        "The dashboard has no authentication: anyone who can reach this port can read every "
        f"run under {os.path.abspath(root)} (paths, host names, command lines, layer names). "
        "To view it from another machine, keep the default --host 127.0.0.1 and use an SSH "
        f"tunnel instead: ssh -L {port}:127.0.0.1:{port} <this host>, then open "
        f"http://127.0.0.1:{port}/"
    )


def serve(
    root: str | os.PathLike[str] = ".",
    host: str = "127.0.0.1",
    port: int = 8050,
    debug: bool = False,
) -> None:
    """Serve the dashboard over the runs under ``root`` until interrupted.

    Binds to 127.0.0.1 unless ``host`` says otherwise: runs may hold paths and source lines,
    so the dashboard is not exposed to the network by default. Any other ``host`` prints
    :func:`exposure_warning` on stderr: the dashboard has no authentication.

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
    warning = exposure_warning(host, port, root)
    if warning:
        print(warning, file=sys.stderr)
    print(
        f"amprobe dashboard: http://{host}:{port}/ (runs under {os.path.abspath(root)})",
        file=sys.stderr,
    )
    app.run(host=host, port=port, debug=debug)
