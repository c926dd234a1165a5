"""The control watcher: inside a dormant training process, turn control-file requests into probe requests.

``amprobe run --dormant`` (and live attach) start the job with a dormant probe. At its first step
each rank writes its manifest and starts a :class:`ControlWatcher` (:func:`start_control`), a
daemon thread that reads the run's control file ``RUN/control.json`` every
``Config.control_poll_s`` seconds, asks the probe to start or stop recording
(:meth:`amprobe.Probe.start_recording` / :meth:`~amprobe.Probe.stop_recording`, applied by the
training thread at the next step boundary) and acknowledges in ``RUN/rank{N}/control_ack.json``.
Every rank of the run reads the same file; :mod:`amprobe.control.sender` writes it.

The training thread never waits on any of this: it reads one attribute per step while nothing
is pending. Who may write the control file is decided by the operating system (the run
directory's file permissions).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amprobe.config import Config
from amprobe.store.layout import ACK_FILE, CONTROL_FILE, read_json_file
from amprobe.store.writer import write_json_atomic

if TYPE_CHECKING:
    from amprobe.capture.probe import Probe

__all__ = [
    "ControlWatcher",
    "MAX_CONTROL_BYTES",
    "SETTLE_S",
    "control_manifest",
    "start_control",
]

MAX_CONTROL_BYTES = 64 * 1024  # a control request is a few hundred bytes
# A control file changed less than this long ago that does not parse is read again at the next
# poll instead of being reported: a writer that is not atomic (``echo ... > control.json``, a big
# copy) may be half-way through it.
SETTLE_S = 1.0


def control_manifest(config: Config) -> dict[str, Any]:
    """What a dormant rank writes into its manifest so that ``amprobe attach`` can address it."""
    return {"file": CONTROL_FILE, "ack": ACK_FILE, "poll_s": config.control_poll_s}


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
