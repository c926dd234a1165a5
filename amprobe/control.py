"""Start and stop recording in a job that is already running.

Three ways in, one mechanism inside the process (:meth:`amprobe.Probe.start_recording` /
:meth:`~amprobe.Probe.stop_recording`, applied by the training thread at the next step boundary):

* ``amprobe run --dormant`` starts the job with a dormant probe. At its first step each rank
  writes its manifest and starts a :class:`ControlWatcher`, a daemon thread that reads the run's
  control file ``RUN/control.json`` every ``Config.control_poll_s`` seconds and acknowledges in
  ``RUN/rank{N}/control_ack.json``. ``amprobe attach RUN`` / ``amprobe detach RUN``
  (:func:`send_control`) write the control file; every rank of the run reads the same file.
* ``amprobe attach --pid PID --out DIR`` (:func:`attach_pid`): on CPython 3.14+ the script built
  by :func:`build_remote_script` is run inside the target by ``sys.remote_exec`` (PEP 768); it
  calls :func:`attach_live`.
* :func:`attach_live` in the process itself: find the live model, optimizers and GradScalers
  through the garbage collector and start recording at the next step.

The training thread never waits on any of this: it reads one attribute per step while nothing
is pending. Who may attach is decided by the operating system: the control file is written
with the caller's file permissions, and ``sys.remote_exec`` needs the same rights as a debugger
(ptrace) over the target process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from amprobe.collectors.discovery import find_live_training_objects
from amprobe.config import Config, ConfigError, make_config
from amprobe.probe import Probe, attach, current_probe
from amprobe.store import schema
from amprobe.store.loader import pid_alive
from amprobe.store.writer import write_json_atomic

__all__ = [
    "ACK_FILE",
    "CONTROL_FILE",
    "ControlError",
    "ControlWatcher",
    "attach_live",
    "attach_pid",
    "build_remote_script",
    "control_manifest",
    "remote_exec_disabled",
    "remote_exec_unsupported",
    "send_control",
]

CONTROL_FILE = "control.json"  # in the run directory, read by every rank
ACK_FILE = "control_ack.json"  # in each rank's directory, written by that rank's watcher
STATUS_FILE = "attach_status.json"  # written by attach_live for `amprobe attach --pid`
_PACKAGE_PARENT = Path(__file__).resolve().parent.parent
_NEXT_TIME = "start the job with `amprobe run --dormant --out DIR -- ...` next time, then `amprobe attach DIR`"


class ControlError(Exception):
    """Attaching or detaching is not possible; the message is one line that says why and what to do."""


def control_manifest(config: Config) -> dict[str, Any]:
    """What a dormant rank writes into its manifest so that ``amprobe attach`` can address it."""
    return {"file": CONTROL_FILE, "ack": ACK_FILE, "poll_s": config.control_poll_s}


# -- inside the training process ---------------------------------------------------------------
class ControlWatcher(threading.Thread):
    """Daemon thread that turns control-file commands into probe requests.

    It only sets a request on the probe (the training thread applies it at the next step
    boundary) and writes this rank's acknowledgement file when the probe's state changes. Cost:
    one ``stat`` per poll interval, off the training thread. Commands issued before this process
    attached its probe are ignored (a late-starting rank does not replay old requests).
    """

    def __init__(self, probe: Any) -> None:
        super().__init__(name="amprobe-control", daemon=True)
        self._probe = weakref.ref(probe)
        self._stop_event = threading.Event()
        self._path = Path(probe.run_dir) / CONTROL_FILE
        self._ack = probe.writer.rank_dir / ACK_FILE
        self._poll_s = float(probe.config.control_poll_s)
        self._rank = probe.rank
        self._not_before = probe.created_unix - 1.0
        self._last_mtime: int | None = None
        self._seen = 0
        self._error: str | None = None

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        written: dict[str, Any] | None = None
        while True:
            probe = self._probe()
            if probe is None or probe.closed:
                return
            self._poll(probe)
            state = {
                "pid": os.getpid(),
                "rank": self._rank,
                "seen": self._seen,
                "applied": probe.control_state.get("seq", 0),
                "result": probe.control_state.get("result"),
                "step": probe.control_state.get("step"),
                "window": probe.window,
                "recording": probe.recording,
                "error": self._error,
            }
            del probe
            if state != written:
                try:
                    write_json_atomic(self._ack, {**state, "time_unix": time.time()})
                    written = state
                except OSError:
                    pass
            if self._stop_event.wait(self._poll_s):
                return

    def _poll(self, probe: Any) -> None:
        try:
            mtime = os.stat(self._path).st_mtime_ns
        except OSError:
            return
        if mtime == self._last_mtime:
            return
        self._last_mtime = mtime
        try:
            command = json.loads(self._path.read_text(encoding="utf-8"))
            seq = int(command.get("seq", 0))
            if seq <= self._seen:
                return
            self._seen = seq
            ranks = command.get("ranks")
            if float(command.get("issued_unix", 0)) < self._not_before:
                return
            if ranks is not None and self._rank not in ranks:
                return
            action = command.get("command")
            if action == "attach":
                steps = command.get("steps")
                probe.start_recording(
                    int(steps) if steps is not None else None, source="amprobe attach", seq=seq
                )
            elif action == "detach":
                probe.stop_recording(source="amprobe detach", seq=seq)
            else:
                self._error = f"unknown command {action!r} (seq {seq})"
        except Exception as exc:  # a bad file must never stop the watcher
            self._error = f"{type(exc).__name__}: {exc}"


def attach_live(
    run_dir: str | os.PathLike[str],
    steps: int | None = None,
    config: Config | Mapping[str, Any] | None = None,
    status_file: str | os.PathLike[str] | None = None,
) -> Any:
    """Start recording this (already running) training process from its next step.

    The live optimizers, GradScalers and root model are found through the garbage collector
    (the root model is the module holding parameters an optimizer updates, not contained in
    another such module). Callable from any thread while the training loop runs in another;
    the training thread is never blocked. If this process already has a probe (``amprobe run
    --dormant``), that probe is asked to record instead and ``run_dir`` is not used.

    Args:
        run_dir: where to write the run (must be new or empty).
        steps: stop recording after this many steps (the probe stays attached, dormant, and
            can be restarted with ``amprobe attach RUN``); ``None`` records until detached.
        config: :class:`amprobe.Config` fields; ``dormant`` is forced on.
        status_file: if given, a JSON file written with the outcome (used by ``attach --pid``).

    Returns:
        The :class:`amprobe.Probe`.

    Raises:
        ConfigError: nothing is being trained here, or a bad config or run directory.
    """
    try:
        probe, facts = _attach_live(Path(run_dir), steps, config)
    except Exception as exc:
        if status_file is not None:
            with contextlib.suppress(Exception):
                write_json_atomic(
                    Path(status_file), {"ok": False, "pid": os.getpid(), "error": f"{exc}"}
                )
        raise
    if status_file is not None:
        with contextlib.suppress(Exception):
            write_json_atomic(Path(status_file), {"ok": True, "pid": os.getpid(), **facts})
    return probe


def _attach_live(
    run_dir: Path, steps: int | None, config: Config | Mapping[str, Any] | None
) -> tuple[Any, dict[str, Any]]:
    existing = current_probe()
    if existing is not None and not existing.closed:
        if existing.recording and existing.window == 0:
            raise ConfigError(
                f"this process is already recorded by amprobe into {existing.run_dir}"
            )
        existing.start_recording(steps, source="attach_live")
        return existing, {"run_dir": str(existing.run_dir), "joined_existing": True}
    cfg = make_config(config)
    collectors = cfg.collectors if "discovery" in cfg.collectors else (*cfg.collectors, "discovery")
    cfg = dataclasses.replace(cfg, dormant=True, collectors=collectors)
    live = find_live_training_objects()
    if not live.optimizers:
        raise ConfigError(
            "no torch.optim.Optimizer holding parameters was found in this process: "
            "nothing to record (is it training yet?)"
        )
    probe = attach(
        live.models[0] if live.models else None,
        live.optimizers[0],
        live.scalers[0] if live.scalers else None,
        run_dir=run_dir,
        config=cfg,
        adoptable=True,
        lazy=True,
        on_announce=start_control,
    )
    for obj in (*live.optimizers[1:], *live.scalers[1:]):
        probe.add_object(obj)
    for model in live.models[1:]:
        probe.add_model(model)
    probe.annotate_manifest(
        launched_by="amprobe attach (live)",
        attached_live=True,
        steps_counted_from="attach",  # the job's earlier iterations are unknown
    )
    probe.start_recording(steps, source="attach_live")
    facts = {
        "run_dir": str(run_dir),
        "joined_existing": False,
        "models": [
            f"{type(m).__name__} ({sum(p.numel() for p in m.parameters())} parameters)"
            for m in live.models
        ],
        "optimizers": [type(o).__name__ for o in live.optimizers],
        "scalers": len(live.scalers),
    }
    return probe, facts


# -- the command line side ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Rank:
    rank: int
    path: Path
    manifest: dict[str, Any]
    state: str  # "live" | "remote" (another host: assumed live) | "finished" | "gone"


def _ranks(root: Path) -> list[_Rank]:
    ranks = []
    for path in sorted(root.glob("rank*")):
        if not (path.is_dir() and path.name[4:].isdigit()):
            continue
        try:
            manifest = json.loads((path / schema.RANK_MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if (path / schema.END_MARKER).exists():
            state = "finished"
        elif manifest.get("hostname") != socket.gethostname():
            state = "remote"
        else:
            state = "live" if pid_alive(manifest.get("pid")) else "gone"
        ranks.append(_Rank(int(path.name[4:]), path, manifest, state))
    return sorted(ranks, key=lambda r: r.rank)


def send_control(
    run_dir: str | os.PathLike[str], command: str, steps: int | None = None, wait_s: float = 5.0
) -> list[str]:
    """Ask every live rank of a dormant-capable run to start (``attach``) or stop (``detach``).

    Writes ``RUN/control.json`` and waits up to ``wait_s`` seconds for the ranks to acknowledge.

    Returns:
        One line per rank saying what happened (recording from step N, stopped, pending, ...).

    Raises:
        ControlError: not a run, no rank started yet, not dormant-capable, or not live.
    """
    if command not in ("attach", "detach"):
        raise ValueError(f"command must be 'attach' or 'detach', got {command!r}")
    if steps is not None and steps < 1:
        raise ControlError("--steps must be a positive number of steps")
    root = Path(run_dir)
    if not root.is_dir():
        raise ControlError(f"no such run directory: {root}")
    if not (root / schema.RUN_MANIFEST).exists():
        raise ControlError(f"not an amprobe run directory (no manifest.json): {root}")
    ranks = _ranks(root)
    if not ranks:
        raise ControlError(
            f"{root} holds no rank yet: the job has not finished its first training step "
            "(try again in a moment)"
        )
    capable = [r for r in ranks if isinstance(r.manifest.get("control"), dict)]
    if not capable:
        raise ControlError(
            f"{root} was not started with --dormant: it records every step already "
            "(use `amprobe run --dormant` to attach and detach later)"
        )
    live = [r for r in capable if r.state in ("live", "remote")]
    if not live:
        how = (
            "finished"
            if all(r.state == "finished" for r in capable)
            else "ended without closing its run"
        )
        raise ControlError(f"{root} is not live: its process {how}")
    path = root / CONTROL_FILE
    previous = 0
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        previous = int(json.loads(path.read_text(encoding="utf-8")).get("seq", 0))
    seq = previous + 1
    write_json_atomic(
        path,
        {
            "seq": seq,
            "command": command,
            "steps": steps,
            "ranks": None,
            "issued_unix": time.time(),
            "issued_by_pid": os.getpid(),
        },
    )
    acks = _wait_for_acks(live, seq, wait_s)
    return [_describe(r, acks.get(r.rank), seq, command, steps, wait_s) for r in live]


def _read_ack(rank: _Rank) -> dict[str, Any] | None:
    try:
        ack = json.loads((rank.path / ACK_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return ack if isinstance(ack, dict) else None


def _wait_for_acks(ranks: list[_Rank], seq: int, wait_s: float) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + wait_s
    acks: dict[int, dict[str, Any]] = {}
    while True:
        for rank in ranks:
            ack = _read_ack(rank)
            if ack is not None:
                acks[rank.rank] = ack
        done = all(int(acks.get(r.rank, {}).get("applied") or 0) >= seq for r in ranks)
        if done or time.monotonic() >= deadline:
            return acks
        time.sleep(0.1)


def _describe(
    rank: _Rank,
    ack: dict[str, Any] | None,
    seq: int,
    command: str,
    steps: int | None,
    wait_s: float,
) -> str:
    who = f"rank {rank.rank} (pid {rank.manifest.get('pid')})"
    if ack is None or int(ack.get("seen") or 0) < seq:
        poll = (rank.manifest.get("control") or {}).get("poll_s", "?")
        return (
            f"{who}: request written, not read within {wait_s:g} s (the process checks every {poll} s; "
            "it may be busy or stopped)"
        )
    if int(ack.get("applied") or 0) < seq:
        return f"{who}: request received; it takes effect when the step in progress ends"
    result, step, window = ack.get("result"), ack.get("step"), ack.get("window")
    if result == "recording":
        span = f"for {steps} steps" if steps else "until `amprobe detach`"
        if not ack.get("recording"):
            span = f"for {steps} steps (already done)"
        return f"{who}: recording from step {step}, window {window}, {span}"
    if result == "already recording":
        return f"{who}: already recording (window {window})" + (
            f"; now stops after {steps} more steps" if steps else ""
        )
    if result == "stopped":
        return f"{who}: stopped recording at step {step}; window {window} flushed"
    if result == "not recording":
        return f"{who}: was not recording"
    return f"{who}: {result}"


def remote_exec_unsupported() -> str | None:
    """Why this interpreter cannot inject code into another process, or ``None`` if it can."""
    if not hasattr(sys, "remote_exec"):
        version = ".".join(str(v) for v in sys.version_info[:3])
        return (
            f"attaching to a process started without amprobe needs CPython 3.14 or newer "
            f"(sys.remote_exec, PEP 768), on both sides; this is Python {version}: {_NEXT_TIME}"
        )
    return None


def remote_exec_disabled(pid: int) -> str | None:
    """Why process ``pid`` refuses remote execution (as far as /proc shows), or ``None``.

    Checks ``PYTHON_DISABLE_REMOTE_DEBUG`` in its environment and ``-X disable-remote-debug``
    on its command line. Where /proc is unreadable, returns ``None`` (``sys.remote_exec`` then
    reports the refusal itself).
    """
    proc = Path("/proc") / str(pid)
    with contextlib.suppress(OSError):
        for entry in (proc / "environ").read_bytes().split(b"\0"):
            name, _, value = entry.partition(b"=")
            if name == b"PYTHON_DISABLE_REMOTE_DEBUG" and value:
                return (
                    f"process {pid} disabled remote execution (PYTHON_DISABLE_REMOTE_DEBUG is set): "
                    f"{_NEXT_TIME}"
                )
    with contextlib.suppress(OSError):
        args = [a.decode("utf-8", "replace") for a in (proc / "cmdline").read_bytes().split(b"\0")]
        for i, arg in enumerate(args):
            option = (
                arg[2:]
                if arg.startswith("-X") and len(arg) > 2
                else (args[i + 1] if arg == "-X" and i + 1 < len(args) else "")
            )
            if option.replace("_", "-") == "disable-remote-debug":
                return f"process {pid} disabled remote execution (-X disable-remote-debug): {_NEXT_TIME}"
    return None


def build_remote_script(
    run_dir: Path, steps: int | None, status_file: Path, config: Mapping[str, Any] | None = None
) -> str:
    """The Python source that ``sys.remote_exec`` runs inside the target: attach, never raise."""
    return f"""# amprobe: live attach, run inside this process by `amprobe attach --pid`
def _amprobe_attach():
    import sys
    try:
        parent = {str(_PACKAGE_PARENT)!r}
        if parent not in sys.path:
            sys.path.append(parent)
        from amprobe.control import attach_live
        attach_live({str(run_dir)!r}, steps={steps!r}, config={dict(config or {})!r},
                    status_file={str(status_file)!r})
    except Exception as exc:
        try:
            import json, os
            with open({str(status_file)!r}, "w") as fh:
                json.dump({{"ok": False, "pid": os.getpid(), "error": f"{{type(exc).__name__}}: {{exc}}"}}, fh)
        except Exception:
            pass


_amprobe_attach()
del _amprobe_attach
"""


def attach_pid(
    pid: int,
    out: str | os.PathLike[str],
    steps: int | None = None,
    wait_s: float = 30.0,
    overwrite: bool = False,
    config: Mapping[str, Any] | None = None,
) -> list[str]:
    """Attach to process ``pid`` (started without amprobe) with ``sys.remote_exec``; record into ``out``.

    Returns:
        Lines describing the outcome.

    Raises:
        ControlError: the interpreter, the process or the OS does not allow it, or the attach
            failed inside the target (which keeps running unchanged).
    """
    reason = remote_exec_unsupported()
    if reason:
        raise ControlError(reason)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise ControlError(f"no process with pid {pid}") from None
    except PermissionError:
        raise ControlError(
            f"process {pid} belongs to another user: only its owner (or root) can attach"
        ) from None
    reason = remote_exec_disabled(pid)
    if reason:
        raise ControlError(reason)
    from amprobe.launcher import _prepare_run_dir

    out_dir = Path(out).resolve()
    _prepare_run_dir(out_dir, overwrite)
    make_config(config)
    status = out_dir / STATUS_FILE
    script = out_dir / f".amprobe_attach_{pid}.py"
    script.write_text(build_remote_script(out_dir, steps, status, config), encoding="utf-8")
    try:
        sys.remote_exec(pid, str(script))  # type: ignore[attr-defined]
    except PermissionError as exc:
        raise ControlError(
            f"not permitted to attach to process {pid} ({exc}): the OS allows it only to the "
            "process owner with debugger (ptrace) rights; see Yama ptrace_scope"
        ) from None
    except Exception as exc:
        raise ControlError(f"cannot run code in process {pid}: {exc}; {_NEXT_TIME}") from None
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if status.exists():
            break
        time.sleep(0.1)
    else:
        return [
            f"amprobe: request delivered to process {pid}; it has not run it within {wait_s:g} s "
            f"(it runs when the process next executes Python code); outcome will be in {status}"
        ]
    with contextlib.suppress(OSError):
        script.unlink()
    try:
        result = json.loads(status.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ControlError(f"cannot read the attach outcome {status}: {exc}") from None
    if not result.get("ok"):
        raise ControlError(
            f"attach failed inside process {pid} (it keeps running unchanged): {result.get('error')}"
        )
    if result.get("joined_existing"):
        return [
            f"amprobe: process {pid} already had a dormant probe; recording into {result.get('run_dir')}"
        ]
    models = ", ".join(result.get("models") or []) or "no model found (layer data needs one)"
    return [
        f"amprobe: attached to process {pid}: {models}; optimizers: {', '.join(result.get('optimizers') or [])}; "
        f"{result.get('scalers', 0)} GradScaler(s); recording into {out_dir} from its next step"
    ]


def start_control(probe: Probe) -> ControlWatcher:
    """A dormant probe's first step: write the control facts and start the watcher thread.

    Passed to :func:`amprobe.probe.attach` as ``on_announce`` by the layers that create dormant
    probes (:func:`amprobe.attach`, ``amprobe run --dormant``, live attach).
    """
    probe.annotate_manifest(control=control_manifest(probe.config))
    if probe.writer is not None:
        probe.writer.prepare()
    watcher = ControlWatcher(probe)
    watcher.start()
    return watcher
