"""The command line's side of the control file: ``amprobe attach RUN`` / ``amprobe detach RUN``.

:func:`send_control` writes ``RUN/control.json`` (atomically, under ``RUN/.control.lock``) for
the :class:`~amprobe.control.watcher.ControlWatcher` of every live rank of a dormant-capable run,
and waits for their acknowledgements. Loads no torch: it only reads and writes files of the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from amprobe.control.watcher import MAX_CONTROL_BYTES
from amprobe.store.layout import (
    ACK_FILE,
    CONTROL_FILE,
    CONTROL_LOCK,
    END_MARKER,
    RANK_MANIFEST,
    is_run_dir,
    list_ranks,
    rank_state,
    read_json_file,
)
from amprobe.store.writer import write_json_atomic

__all__ = ["ControlError", "ControlReply", "send_control"]


class ControlError(Exception):
    """Attaching or detaching is not possible; the message is one line that says why and what to do."""


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
