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
import stat
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from amprobe.capture.discovery import find_live_training_objects
from amprobe.capture.probe import Probe, attach, current_probe
from amprobe.config import Config, ConfigError, make_config
from amprobe.store.layout import (
    ACK_FILE,
    CONTROL_FILE,
    CONTROL_LOCK,
    END_MARKER,
    RANK_MANIFEST,
    StoreError,
    is_run_dir,
    list_ranks,
    prepare_run_dir,
    rank_state,
    read_json_file,
)
from amprobe.store.writer import write_json_atomic

__all__ = [
    "ACK_FILE",
    "CONTROL_FILE",
    "ControlError",
    "ControlReply",
    "ControlWatcher",
    "MAX_CONTROL_BYTES",
    "attach_live",
    "attach_pid",
    "build_remote_script",
    "control_manifest",
    "remote_exec_disabled",
    "remote_exec_unsupported",
    "send_control",
]

MAX_CONTROL_BYTES = 64 * 1024  # a control request is a few hundred bytes
# A control file changed less than this long ago that does not parse is read again at the next
# poll instead of being reported: a writer that is not atomic (``echo ... > control.json``, a big
# copy) may be half-way through it.
SETTLE_S = 1.0
STATUS_FILE = "attach_status.json"  # written by attach_live for `amprobe attach --pid`
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the folder that holds amprobe/
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
    one ``lstat`` per poll interval, off the training thread. Commands issued before this process
    attached its probe are ignored (a late-starting rank does not replay old requests).

    The control file is read only when it is a regular file (not a symbolic link, a FIFO or a
    device), without blocking and at most :data:`MAX_CONTROL_BYTES`; anything else is ignored,
    recorded once per kind of problem as a ``control_file_ignored`` event and reported in the
    acknowledgement so that ``amprobe attach`` can say why. A file that does not parse yet was
    changed in the last :data:`SETTLE_S` seconds is read again at the next poll (it may be
    half-written) and reported only once it stays that way. Each request carries a random ``id``: a request is
    handled once, whatever its sequence number, so a deleted or rewritten control file cannot
    make the job skip a request.
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
        self._last_sig: tuple[int, ...] | None = None
        self._seen = 0  # highest sequence number read (the CLI numbers its next request above it)
        self._seen_id: str | None = None
        self._tokens: dict[int, tuple[str, int]] = {}  # probe seq token -> (request id, seq)
        self._next_token = 0
        self._error: str | None = None
        self._error_id: str | None = None
        self._ignored: str | None = None
        self._reported: set[str] = set()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        written: dict[str, Any] | None = None
        while True:
            probe = self._probe()
            if probe is None or probe.closed:
                return
            self._poll(probe)
            applied_id, applied = self._tokens.get(probe.control_state.get("seq", 0), (None, 0))
            state = {
                "pid": os.getpid(),
                "rank": self._rank,
                "seen": self._seen,
                "seen_id": self._seen_id,
                "applied": applied,
                "applied_id": applied_id,
                "result": probe.control_state.get("result"),
                "step": probe.control_state.get("step"),
                "window": probe.window,
                "recording": probe.recording,
                "error": self._error,
                "error_id": self._error_id,
                "ignored": self._ignored,
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

    def _refuse(self, probe: Any, reason: str, kind: str | None = None) -> None:
        """Ignore the control file as it is now: one event per kind of problem, and the ack says it.

        ``kind`` groups reasons that differ only in a detail (the size of a file that grows while
        it is written is one problem, not one per size seen); it defaults to the reason.
        """
        self._ignored = f"{CONTROL_FILE} ignored: {reason}"
        kind = kind or reason
        if kind not in self._reported and len(self._reported) < 16:
            self._reported.add(kind)
            with contextlib.suppress(Exception):
                probe.event("control_file_ignored", reason=reason)

    def _poll(self, probe: Any) -> None:
        try:
            st = os.lstat(self._path)
        except OSError:
            return
        sig = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode)
        if sig == self._last_sig:
            return
        self._last_sig = sig
        if not stat.S_ISREG(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            self._refuse(probe, f"it is {kind}")
            return
        if st.st_size > MAX_CONTROL_BYTES:
            self._refuse(
                probe, f"larger than {MAX_CONTROL_BYTES} bytes ({st.st_size})", kind="too large"
            )
            return
        try:
            command = read_json_file(self._path, max_bytes=MAX_CONTROL_BYTES, follow_symlinks=False)
        except FileNotFoundError:
            return
        except ValueError as exc:
            if 0 <= time.time_ns() - st.st_mtime_ns < SETTLE_S * 1e9:
                self._last_sig = None  # maybe half-written: read it again at the next poll
                return
            reason = str(exc)
            self._refuse(probe, reason, kind="too large" if reason.startswith("larger") else None)
            return
        except OSError as exc:
            self._refuse(probe, exc.strerror or str(exc))
            return
        self._ignored = None
        self._handle(probe, command)

    def _handle(self, probe: Any, command: dict[str, Any]) -> None:
        seq = command.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            self._refuse(probe, "no valid sequence number")
            return
        rid = command.get("id")
        if not isinstance(rid, str) or not 0 < len(rid) <= 64:
            # a request without an id (an older amprobe): handled once per new sequence number
            if seq <= self._seen:
                return
            rid = f"seq-{seq}"
        if rid == self._seen_id:
            return
        self._seen_id = rid
        self._seen = max(self._seen, seq)
        try:
            issued = command.get("issued_unix", 0)
            if not isinstance(issued, (int, float)) or issued < self._not_before:
                return
            ranks = command.get("ranks")
            if isinstance(ranks, list) and self._rank not in ranks:
                return
            self._next_token += 1
            token = self._next_token
            self._tokens[token] = (rid, seq)
            for old in [t for t in self._tokens if t < token - 8]:
                del self._tokens[old]
            action = command.get("command")
            if action == "attach":
                steps = command.get("steps")
                if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool)):
                    raise ValueError(f"steps must be a positive integer, got {steps!r}")
                probe.start_recording(steps, source="amprobe attach", seq=token)
            elif action == "detach":
                probe.stop_recording(source="amprobe detach", seq=token)
            else:
                raise ValueError(f"unknown command {action!r}")
        except Exception as exc:  # a bad file must never stop the watcher
            self._error = (
                f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)
            )
            self._error_id = rid


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
    for entry in list_ranks(root).ranks:
        try:
            manifest = read_json_file(entry.path / RANK_MANIFEST)
        except (OSError, ValueError):
            continue
        state = rank_state(manifest, ended=(entry.path / END_MARKER).exists())
        ranks.append(_Rank(entry.rank, entry.path, manifest, state))
    return ranks


@dataclasses.dataclass(frozen=True)
class ControlReply:
    """What :func:`send_control` saw: one line per rank, and whether every live rank read
    this very request (``acknowledged``); the CLI exits non-zero when it did not."""

    lines: list[str]
    acknowledged: bool
    request_id: str

    def __iter__(self) -> Iterator[str]:
        return iter(self.lines)


@contextlib.contextmanager
def _control_lock(root: Path, wait_s: float) -> Iterator[None]:
    """Hold ``RUN/.control.lock`` (one writer of the control file at a time, across processes).

    The lock is held until the request is acknowledged, so that a second ``attach``/``detach``
    cannot replace a request the job has not read yet.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock, the request id still protects
        yield
        return
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(root / CONTROL_LOCK, flags, 0o600)
    except OSError as exc:
        raise ControlError(
            f"cannot open the control lock {root / CONTROL_LOCK}: {exc.strerror or exc}"
        ) from None
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ControlError(
                        f"another `amprobe attach`/`detach` on {root} is still waiting for the "
                        f"job after {wait_s:g} s; try again when it has finished"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_seq(path: Path) -> int:
    """The sequence number in a control or ack file, 0 when unreadable (never blocks)."""
    try:
        value = read_json_file(path, max_bytes=MAX_CONTROL_BYTES, follow_symlinks=False).get(
            "seq" if path.name == CONTROL_FILE else "seen"
        )
    except (OSError, ValueError):
        return 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def send_control(
    run_dir: str | os.PathLike[str], command: str, steps: int | None = None, wait_s: float = 5.0
) -> ControlReply:
    """Ask every live rank of a dormant-capable run to start (``attach``) or stop (``detach``).

    Writes ``RUN/control.json`` atomically, under ``RUN/.control.lock``, with a sequence number
    above every one the job has seen and a random request id, then waits up to ``wait_s``
    seconds for the ranks to acknowledge that id.

    Returns:
        A :class:`ControlReply`: one line per rank saying what happened (recording from step N,
        stopped, pending, not read, ...) and whether every live rank read this request.

    Raises:
        ControlError: not a run, no rank started yet, not dormant-capable, not live, or
            another attach/detach holds the lock longer than ``wait_s``.
    """
    if command not in ("attach", "detach"):
        raise ValueError(f"command must be 'attach' or 'detach', got {command!r}")
    if steps is not None and steps < 1:
        raise ControlError("--steps must be a positive number of steps")
    root = Path(run_dir)
    if not root.is_dir():
        raise ControlError(f"no such run directory: {root}")
    if not is_run_dir(root):
        raise ControlError(f"not an amprobe run directory (no amprobe manifest.json): {root}")
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
    rid = uuid.uuid4().hex
    with _control_lock(root, wait_s):
        seq = 1 + max([_read_seq(path), *(_read_seq(r.path / ACK_FILE) for r in live)])
        write_json_atomic(
            path,
            {
                "seq": seq,
                "id": rid,
                "command": command,
                "steps": steps,
                "ranks": None,
                "issued_unix": time.time(),
                "issued_by_pid": os.getpid(),
            },
        )
        acks = _wait_for_acks(live, rid, wait_s)
    lines = [_describe(r, acks.get(r.rank), rid, steps, wait_s) for r in live]
    acknowledged = all(
        (acks.get(r.rank) or {}).get("seen_id") == rid
        and (acks.get(r.rank) or {}).get("error_id") != rid
        for r in live
    )
    return ControlReply(lines, acknowledged, rid)


def _read_ack(rank: _Rank) -> dict[str, Any] | None:
    try:
        return read_json_file(rank.path / ACK_FILE, follow_symlinks=False)
    except (OSError, ValueError):
        return None


def _wait_for_acks(ranks: list[_Rank], rid: str, wait_s: float) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + wait_s
    acks: dict[int, dict[str, Any]] = {}
    while True:
        for rank in ranks:
            ack = _read_ack(rank)
            if ack is not None:
                acks[rank.rank] = ack
        done = all(
            acks.get(r.rank, {}).get("applied_id") == rid
            or acks.get(r.rank, {}).get("error_id") == rid
            for r in ranks
        )
        if done or time.monotonic() >= deadline:
            return acks
        time.sleep(0.05)


def _describe(
    rank: _Rank, ack: dict[str, Any] | None, rid: str, steps: int | None, wait_s: float
) -> str:
    who = f"rank {rank.rank} (pid {rank.manifest.get('pid')})"
    if ack is None or ack.get("seen_id") != rid:
        poll = (rank.manifest.get("control") or {}).get("poll_s", "?")
        why = f"; the job reports: {ack['ignored']}" if ack and ack.get("ignored") else ""
        return (
            f"{who}: request NOT acknowledged: not read within {wait_s:g} s (the process checks "
            f"every {poll} s; it may be busy or stopped){why}"
        )
    if ack.get("error_id") == rid:
        return f"{who}: request refused: {ack.get('error')}"
    if ack.get("applied_id") != rid:
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
        from amprobe.control.channel import attach_live
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
    out_dir = Path(out).resolve()
    try:
        prepare_run_dir(out_dir, overwrite)
    except StoreError as exc:
        raise ControlError(str(exc)) from None
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

    Passed to :func:`amprobe.capture.probe.attach` as ``on_announce`` by the layers that create dormant
    probes (:func:`amprobe.attach`, ``amprobe run --dormant``, live attach).
    """
    probe.annotate_manifest(control=control_manifest(probe.config))
    if probe.writer is not None:
        probe.writer.prepare()
    watcher = ControlWatcher(probe)
    watcher.start()
    return watcher
