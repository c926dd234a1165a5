"""Start a user's command with amprobe active in every Python process it spawns.

Used by ``amprobe run`` and ``amprobe baseline``. The child's output passes through unchanged
and its exit status too (a child killed by signal N gives ``128 + N``, as in a shell: SIGTERM
143, an uncaught KeyboardInterrupt 130); amprobe's own failures after the child ends never
change it. SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 reach the child exactly once:
the child leads a process group of its own, which is the terminal's foreground group when
``amprobe run`` was, so a terminal's Ctrl-C reaches the child alone, and a signal sent to
amprobe's group (``timeout -s INT``, CI runners) or to amprobe alone reaches amprobe alone,
which passes it on once (a sender that signals each process by itself, ``pkill -f``, still
reaches the child twice). Ctrl-Z stops the child and amprobe's job with it. The child gets
SIGTERM if ``amprobe run`` itself dies (Linux), so it never trains on as an orphan.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
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
PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the folder that holds amprobe/


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


#: Signals ``amprobe run`` passes on to the child. The child runs in a process group of its own,
#: so a signal sent to amprobe's group (``timeout``, CI runners) reaches only amprobe, which
#: passes it on once; a terminal's signals go to the child's group directly (it is the
#: terminal's foreground group) and never through amprobe. A sender that signals every process
#: by itself (``pkill -f``) still reaches the child twice. SIGUSR1 and SIGUSR2 (a job
#: scheduler's "time is nearly up") would otherwise end amprobe instead of reaching the job.
_FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
#: The same signal received again within this many seconds of the one passed on is the same event
#: sent twice and is not passed on again: ``timeout`` signals amprobe and then amprobe's group,
#: microseconds apart, and a process receiving both before its handler runs sees one (as the
#: training process alone would).
_SAME_SIGNAL_S = 0.2


def _controlling_terminal() -> int | None:
    """A descriptor on this process's controlling terminal, or ``None`` without one."""
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        os.tcgetpgrp(fd)
    except OSError:
        os.close(fd)
        return None
    return fd


def _set_foreground(tty: int, group: int) -> None:
    """Make ``group`` the terminal's foreground process group. SIGTTOU is blocked meanwhile: a
    process outside the foreground group may hand the terminal over (as shells do)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        os.tcsetpgrp(tty, group)
    except OSError:
        pass
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _child_setup(tty: int | None) -> Callable[[], None]:
    """The ``preexec_fn``: the child leads a process group of its own, made the terminal's
    foreground group when ``tty`` is given (amprobe run was in the foreground), so that a
    terminal's Ctrl-C reaches the child alone and a group signal reaches amprobe alone; and, on
    Linux, the child receives SIGTERM when ``amprobe run`` dies (``PR_SET_PDEATHSIG``), so a
    killed wrapper never leaves the job training as an orphan."""
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            prctl = None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def setup() -> None:  # runs in the child between fork and exec: system calls only
        os.setpgid(0, 0)
        if tty is not None:  # before exec, so the job never reads the terminal from behind
            _set_foreground(tty, os.getpgrp())
        if prctl is not None:
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
    tty = _controlling_terminal()
    try:
        # hand the terminal to the child only if it is ours now (not a background job)
        foreground = tty is not None and os.tcgetpgrp(tty) == os.getpgrp()
        try:
            child = subprocess.Popen(
                list(command), env=env, preexec_fn=_child_setup(tty if foreground else None)
            )
        except OSError as exc:
            if foreground and tty is not None:  # the child took the terminal, then failed exec
                _set_foreground(tty, os.getpgrp())
            _remove_if_empty(created)
            if isinstance(exc, FileNotFoundError):
                raise LaunchError(f"command not found: {command[0]}") from None
            if isinstance(exc, PermissionError):
                raise LaunchError(f"command is not executable: {command[0]}") from None
            raise LaunchError(f"cannot start {command[0]}: {exc.strerror or exc}") from None
        code = exit_status(_supervise(child, tty))
    finally:
        if tty is not None:
            os.close(tty)
    if summarize is not None:
        summarize(run_dir)
    return code


def _supervise(child: subprocess.Popen[bytes], tty: int | None) -> int:
    """Wait for the child, passing on each signal amprobe receives once; its return code.

    With a controlling terminal ``tty``, a stopped child (Ctrl-Z, a background read) stops
    amprobe's job too, with the terminal given back, so the shell regains control; ``fg`` or
    ``bg`` continues amprobe, which continues the child (handing it the terminal again when
    amprobe is in the foreground).
    """

    forwarded: dict[int, float] = {}

    def forward(signum: int, frame: Any) -> None:
        now = time.monotonic()
        if now - forwarded.get(signum, -math.inf) < _SAME_SIGNAL_S:
            return  # one event sent twice (timeout: to amprobe, then to its group)
        forwarded[signum] = now
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
                _, status = os.waitpid(child.pid, os.WUNTRACED if tty is not None else 0)
            except KeyboardInterrupt:  # a handler we did not replace: keep waiting
                continue
            except ChildProcessError:  # reaped elsewhere (not expected): as Popen would say
                return child.wait()
            if tty is not None and os.WIFSTOPPED(status):
                _stop_with_child(child.pid, tty, os.WSTOPSIG(status))
                continue
            child.returncode = os.waitstatus_to_exitcode(status)
            return child.returncode
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if tty is not None and _foreground(tty) == child.pid:
            _set_foreground(tty, os.getpgrp())  # the terminal back before the summary


def _foreground(tty: int) -> int | None:
    try:
        return os.tcgetpgrp(tty)
    except OSError:
        return None


def _stop_with_child(group: int, tty: int, stopped_by: int) -> None:
    """The child's group stopped: stop amprobe's job the same way (the terminal given back to
    it first), and when amprobe is continued, continue the child's group."""
    if _foreground(tty) == group:
        _set_foreground(tty, os.getpgrp())
    stops = (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
    try:  # the shell sees its job stop; this returns once amprobe is continued
        os.killpg(os.getpgrp(), stopped_by if stopped_by in stops else signal.SIGSTOP)
    except OSError:
        pass
    if _foreground(tty) == os.getpgrp():  # `fg`: the terminal goes back to the child
        _set_foreground(tty, group)
    try:
        os.killpg(group, signal.SIGCONT)
    except OSError:
        pass
