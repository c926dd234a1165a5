"""Start a user's command with amprobe active in every Python process it spawns.

Used by ``amprobe run`` and ``amprobe baseline``. The child's output passes through unchanged
and its exit status too (a child killed by signal N gives ``128 + N``, as in a shell: SIGTERM
143, an uncaught KeyboardInterrupt 130); amprobe's own failures after the child ends never
change it. SIGTERM, SIGHUP, SIGINT and SIGQUIT reach the child exactly once: the terminal
already sends Ctrl-C to the child (same process group), so that one is not sent again. The child
gets SIGTERM if ``amprobe run`` itself dies (Linux), so it never trains on as an orphan.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from amprobe.config import (
    ENV_BASELINE,
    ENV_CONFIG,
    ENV_FORCE_FP32,
    ENV_RUN_DIR,
    ConfigError,
    make_config,
)
from amprobe.store import layout
from amprobe.store.layout import StoreError

__all__ = [
    "LaunchError",
    "bootstrap_env",
    "check_port",
    "exit_status",
    "launch",
    "prepare_run_dir",
]

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "_bootstrap"
PACKAGE_PARENT = Path(__file__).resolve().parent.parent


class LaunchError(Exception):
    """The command could not be started (not found, not executable)."""


def bootstrap_env(
    run_dir: Path,
    config: Mapping[str, Any] | None = None,
    force_fp32: bool = False,
    baseline: Path | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment that activates amprobe in the child processes."""
    env = dict(os.environ if base is None else base)
    parts = [str(BOOTSTRAP_DIR)]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    parts.append(str(PACKAGE_PARENT))  # amprobe itself, after the user's own entries
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env[ENV_RUN_DIR] = str(run_dir.resolve())
    env[ENV_CONFIG] = json.dumps(dict(config or {}))
    if force_fp32:
        env[ENV_FORCE_FP32] = "1"
    else:
        env.pop(ENV_FORCE_FP32, None)
    if baseline is not None:
        env[ENV_BASELINE] = str(baseline.resolve())
    else:
        env.pop(ENV_BASELINE, None)
    return env


def prepare_run_dir(run_dir: Path, overwrite: bool) -> list[Path]:
    """:func:`amprobe.store.layout.prepare_run_dir`, its refusal said as a ConfigError."""
    try:
        return layout.prepare_run_dir(run_dir, overwrite)
    except StoreError as exc:
        raise ConfigError(str(exc)) from None


def _remove_if_empty(created: list[Path]) -> None:
    """Remove the folders :func:`prepare_run_dir` created, as long as nothing was written."""
    for folder in created:  # innermost first
        try:
            folder.rmdir()
        except OSError:
            return


def check_port(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be served (busy, not permitted), or ``None`` if it can now."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def exit_status(returncode: int) -> int:
    """The shell's exit status for a child's return code: ``128 + N`` when killed by signal N
    (SIGTERM: 143, SIGINT, e.g. an uncaught KeyboardInterrupt: 130), else the code itself."""
    return 128 - returncode if returncode < 0 else returncode


#: Signals forwarded to the child. The terminal sends SIGINT, SIGQUIT and (on hang-up) SIGHUP
#: to the whole foreground process group, child included: those are forwarded only when the
#: child would not get them that way (see :func:`_child_gets_terminal_signals`).
_FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
_TERMINAL = ("SIGINT", "SIGQUIT", "SIGHUP")


def _foreground_group() -> int | None:
    """The foreground process group of this process's controlling terminal, if any."""
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        try:
            return os.tcgetpgrp(stream.fileno())
        except (OSError, AttributeError, ValueError):
            continue
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.tcgetpgrp(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def _child_gets_terminal_signals(child_pid: int) -> bool:
    """Whether a signal the terminal sends reaches the child by itself (the child is in the
    terminal's foreground process group, as ``amprobe run`` started it)."""
    try:
        group = os.getpgid(child_pid)
    except OSError:
        return False
    return group == os.getpgrp() and _foreground_group() == group


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive SIGTERM when ``amprobe run`` dies
    (``PR_SET_PDEATHSIG``, Linux), so a killed wrapper never leaves the job training as an
    orphan. ``None`` where the OS has no such call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def setup() -> None:  # runs in the child between fork and exec: system calls only
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the wrapper died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return setup


def launch(
    command: Sequence[str],
    run_dir: Path,
    config: Mapping[str, Any] | None = None,
    force_fp32: bool = False,
    baseline: Path | None = None,
    overwrite: bool = False,
    summarize: Callable[[Path], None] | None = None,
) -> int:
    """Run ``command`` recorded into ``run_dir``; return the child's exit code.

    ``summarize(run_dir)`` runs after the child exits (the CLI passes the one-screen summary).

    Raises:
        ConfigError: bad config or run directory (before anything is started).
        LaunchError: the command cannot be started.
    """
    if not command:
        raise ConfigError("no command given: use `amprobe run --out DIR -- python train.py`")
    cfg = make_config(config)  # validate now, loudly, before starting anything
    created = prepare_run_dir(run_dir, overwrite)
    if cfg.prometheus_port:
        busy = check_port(cfg.prometheus_host, cfg.prometheus_port)
        if busy:
            print(
                f"amprobe: warning: cannot serve Prometheus metrics on "
                f"{cfg.prometheus_host}:{cfg.prometheus_port} ({busy}); the job runs without "
                "them (choose another --prometheus-port)",
                file=sys.stderr,
            )
    env = bootstrap_env(run_dir, config, force_fp32=force_fp32, baseline=baseline)
    try:
        child = subprocess.Popen(list(command), env=env, preexec_fn=_die_with_parent())
    except FileNotFoundError:
        _remove_if_empty(created)
        raise LaunchError(f"command not found: {command[0]}") from None
    except PermissionError:
        _remove_if_empty(created)
        raise LaunchError(f"command is not executable: {command[0]}") from None
    except OSError as exc:
        _remove_if_empty(created)
        raise LaunchError(f"cannot start {command[0]}: {exc.strerror or exc}") from None
    code = exit_status(_supervise(child))
    if summarize is not None:
        summarize(run_dir)
    return code


def _supervise(child: subprocess.Popen[bytes]) -> int:
    """Wait for the child, passing on each signal it would not get otherwise; its return code.

    SIGTERM always reaches the child through ``amprobe run``; SIGINT, SIGQUIT and SIGHUP only
    when the terminal did not already deliver them to it (so Ctrl-C arrives once).
    """

    def forward(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if name in _TERMINAL and _child_gets_terminal_signals(child.pid):
            return
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {}
    for name in _FORWARDED:
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        try:
            previous[sig] = signal.signal(sig, forward)
        except (ValueError, OSError):  # not the main thread, or not settable here
            continue
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:  # a handler we did not replace: keep waiting
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
