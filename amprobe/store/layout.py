"""The run directory's vocabulary, defined once: file names, the format marker, rank folders,
liveness, and how a file of a run is opened safely.

Every part of amprobe that looks at a run directory (the writer, the loader, the CLI, the
launcher, the control channel, the dashboard) goes through these names and functions instead of
its own copy, so that "is this a run", "which folders are ranks" and "is it still being
written" have one answer.

Layout::

    RUN/
      manifest.json      {"format": "amprobe-run", "schema_version": N, ...}  (the format marker)
      control.json       attach/detach requests (``amprobe run --dormant`` runs only)
      rank0/
        manifest.json    this rank's manifest (pid, hostname, device, ...), same marker
        steps.jsonl ...  append-only tables
        end.json         written at a clean close

A rank folder is named ``rank<N>`` with ``N`` in ASCII digits ``0-9``. Names such as ``rank²``
or ``rank١`` are not ranks (they are reported); ``rank00`` and ``rank0`` both present is
reported and only the canonical ``rank0`` is read.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "ACK_FILE",
    "BASELINE_LEGS",
    "CONTROL_FILE",
    "CONTROL_LOCK",
    "END_MARKER",
    "FORMAT",
    "MAX_JSON_BYTES",
    "RANK_MANIFEST",
    "RUN_MANIFEST",
    "NotRegularFileError",
    "RankDir",
    "RunLoadError",
    "RankListing",
    "StoreError",
    "file_kind",
    "prepare_run_dir",
    "check_writable",
    "has_format_marker",
    "is_live",
    "is_run_dir",
    "list_ranks",
    "list_runs",
    "open_regular",
    "parse_rank_dirname",
    "pid_alive",
    "rank_dirname",
    "rank_state",
    "read_json_file",
    "STATUS_ORDER",
    "status_of",
    "TABLE_SUFFIX",
    "table_filename",
    "looks_like_rank_dirname",
]

FORMAT = "amprobe-run"  #: the ``format`` field of every manifest: the format marker
RUN_MANIFEST = "manifest.json"
RANK_MANIFEST = "manifest.json"
END_MARKER = "end.json"
TABLE_SUFFIX = ".jsonl"  #: a rank's tables are JSON Lines files: ``steps.jsonl``, ``events.jsonl``
CONTROL_FILE = "control.json"  #: in the run directory, read by every rank of a dormant run
CONTROL_LOCK = ".control.lock"  #: serialises writers of the control file
ACK_FILE = "control_ack.json"  #: in each rank's directory, written by that rank's watcher
#: the run directories ``amprobe baseline`` writes in its folder: the FP32 leg, then the AMP leg
BASELINE_LEGS = ("fp32", "amp")
#: manifests, end markers and control files are small; anything larger is not one of ours
MAX_JSON_BYTES = 1 << 20

_RANK_PREFIX = "rank"
_ASCII_DIGITS = frozenset("0123456789")


class StoreError(ValueError):
    """A run directory that cannot be written (or must not be touched); one line that says why.

    A subclass of :class:`ValueError`, so code that catches ``ValueError`` (or amprobe's
    ``ConfigError``, once the probe translates it) keeps working.
    """


class RunLoadError(Exception):
    """A run directory that cannot be read; the message is one line that says why.

    Raised by the loader (:func:`amprobe.store.loader.load_run`); defined here, with the
    layout, so that code which only catches it (the CLI) does not load the loader and pandas.
    """


class NotRegularFileError(OSError):
    """A path that should hold a run's file is a FIFO, a device, a socket or a directory."""


# -- rank folders --------------------------------------------------------------------------------
def rank_dirname(rank: int) -> str:
    """The folder name of ``rank``: ``rank0``, ``rank1``, ..."""
    return f"{_RANK_PREFIX}{int(rank)}"


def table_filename(table: str) -> str:
    """The file of ``table`` in a rank folder: ``steps`` is ``steps.jsonl``."""
    return f"{table}{TABLE_SUFFIX}"


def parse_rank_dirname(name: str) -> int | None:
    """The rank a folder name stands for, or ``None`` when it is not a rank folder.

    Only ``rank`` followed by ASCII digits is a rank: ``rank7`` is 7, ``rank07`` is 7 too (a
    non-canonical spelling, see :func:`list_ranks`), ``rank²``, ``rank١``, ``rank-1`` and
    ``ranking`` are not ranks.
    """
    if not name.startswith(_RANK_PREFIX):
        return None
    digits = name[len(_RANK_PREFIX) :]
    if not digits or not set(digits) <= _ASCII_DIGITS:
        return None
    return int(digits)


def looks_like_rank_dirname(name: str) -> bool:
    """Whether a user would read ``name`` as a rank folder: ``rank`` and any Unicode digits.

    Wider than :func:`parse_rank_dirname`: ``rank²`` and ``rank١`` look like ranks but are
    not (they are reported). A reader that checks a run's files before loading it checks
    every such folder.
    """
    digits = name[len(_RANK_PREFIX) :]
    return name.startswith(_RANK_PREFIX) and bool(digits) and digits.isnumeric()


@dataclasses.dataclass(frozen=True)
class RankDir:
    """One rank folder of a run: its rank number and path."""

    rank: int
    path: Path


@dataclasses.dataclass(frozen=True)
class RankListing:
    """The rank folders of a run, sorted by rank, and what was odd about the folder names."""

    ranks: list[RankDir]
    warnings: list[str]

    def __iter__(self) -> Iterator[RankDir]:
        return iter(self.ranks)

    def __len__(self) -> int:
        return len(self.ranks)


def list_ranks(run_dir: str | os.PathLike[str]) -> RankListing:
    """The rank folders of ``run_dir`` (directories named ``rank<N>``), sorted by rank.

    Never raises: an unreadable directory lists no ranks, with a warning. Warnings name folders
    that look like ranks but are not (non-ASCII digits, not a directory) and a rank spelt twice
    (``rank0`` and ``rank00``: the canonical ``rank0`` is kept).
    """
    root = Path(run_dir)
    warnings: list[str] = []
    by_rank: dict[int, list[Path]] = {}
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as exc:
        return RankListing([], [f"cannot list {root}: {exc.strerror or exc}"])
    for entry in entries:
        rank = parse_rank_dirname(entry.name)
        if rank is None:
            if looks_like_rank_dirname(entry.name):
                warnings.append(
                    f"folder {entry.name!r} is not read as a rank: rank numbers use the "
                    "ASCII digits 0-9"
                )
            continue
        try:
            is_dir = entry.is_dir()
        except OSError:
            is_dir = False
        if not is_dir:
            warnings.append(f"{entry.name!r} is not a folder; not read as rank {rank}")
            continue
        by_rank.setdefault(rank, []).append(Path(entry.path))
    ranks: list[RankDir] = []
    for rank in sorted(by_rank):
        paths = by_rank[rank]
        canonical = [p for p in paths if p.name == rank_dirname(rank)]
        chosen = canonical[0] if canonical else paths[0]
        if len(paths) > 1:
            others = ", ".join(repr(p.name) for p in paths if p != chosen)
            warnings.append(
                f"rank {rank} is spelt more than once ({others} besides {chosen.name!r}); "
                f"only {chosen.name!r} is read"
            )
        ranks.append(RankDir(rank, chosen))
    return RankListing(ranks, warnings)


# -- safe reads ----------------------------------------------------------------------------------
def open_regular(
    path: str | os.PathLike[str], *, follow_symlinks: bool = True, offset: int = 0
) -> BinaryIO:
    """Open a run's file for reading only if it is a regular file; never blocks.

    The file is opened non-blocking (a FIFO cannot hang the caller) and checked with ``fstat``
    on the open descriptor (no race between check and open).

    Raises:
        FileNotFoundError: the file is missing.
        NotRegularFileError: a FIFO, a device, a socket, a directory, or (with
            ``follow_symlinks=False``) a symbolic link.
        OSError: any other reason it cannot be opened.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            raise NotRegularFileError(
                errno.ELOOP, "is a symbolic link, not a regular file", str(path)
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = file_kind(st.st_mode)
            raise NotRegularFileError(errno.EINVAL, f"is {kind}, not a regular file", str(path))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)  # regular files never block; reads behave as usual
        fh = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    if offset:
        fh.seek(offset)
    return fh


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages: "a FIFO", "a device", "a socket", ..."""
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def read_json_file(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = MAX_JSON_BYTES,
    follow_symlinks: bool = True,
) -> dict[str, Any]:
    """A small JSON object file (manifest, end marker, control file), read with limits.

    Raises:
        FileNotFoundError: missing.
        NotRegularFileError: not a regular file (see :func:`open_regular`).
        ValueError: larger than ``max_bytes``, not UTF-8, not JSON, or not a JSON object.
        OSError: unreadable.
    """
    with open_regular(path, follow_symlinks=follow_symlinks) as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise ValueError("not valid JSON") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


def has_format_marker(manifest_path: str | os.PathLike[str]) -> bool:
    """Whether a file is an amprobe manifest (a JSON object whose ``format`` is ours)."""
    try:
        return read_json_file(manifest_path).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def _marked_or_odd(manifest: Path) -> bool:
    """A manifest with the format marker, or something not a regular file in its place (a
    symbolic link, a FIFO, a device), looked at with ``lstat`` and never opened."""
    try:
        st = os.lstat(manifest)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return True
    return has_format_marker(manifest)


def is_run_dir(path: str | os.PathLike[str], *, untrusted: bool = False) -> bool:
    """Whether ``path`` is an amprobe run directory, judged by the format marker.

    True when its ``manifest.json`` carries the marker, or (a run whose top manifest was lost)
    when one of its rank folders' manifests does. An unrelated folder that happens to hold a
    ``manifest.json`` (a browser extension, a web app) is not a run. Reads only small regular
    files, non-blocking.

    Args:
        untrusted: for a reader of runs written by programs it does not trust (the
            dashboard): a manifest that is not a regular file (a symbolic link, a FIFO, a
            device) is not opened and counts as a marker, so that the run is listed and the
            reader's own checks refuse it with the reason instead of hiding it.
    """
    root = Path(path)
    try:
        if not root.is_dir():
            return False
    except OSError:
        return False
    marked = _marked_or_odd if untrusted else has_format_marker
    if marked(root / RUN_MANIFEST):
        return True
    return any(marked(r.path / RANK_MANIFEST) for r in list_ranks(root).ranks)


def list_runs(root: str | os.PathLike[str], max_depth: int = 3) -> list[Path]:
    """The run directories under ``root`` (``root`` itself included), sorted by path.

    A run directory is not searched further; hidden folders are skipped, and so is any folder
    (a symlink) that resolves outside ``root``. Never raises.
    """
    try:
        base = Path(root).resolve()
    except OSError:
        return []
    found: list[Path] = []

    def walk(path: Path, depth: int) -> None:
        if is_run_dir(path):
            found.append(path)
            return
        if depth >= max_depth:
            return
        try:
            children = sorted(
                Path(e.path) for e in os.scandir(path) if not e.name.startswith(".") and e.is_dir()
            )
        except OSError:
            return
        for child in children:
            try:
                real = child.resolve()
            except OSError:
                continue
            if real != base and base in real.parents:
                walk(child, depth + 1)

    walk(base, 0)
    return sorted(found)


# -- liveness ------------------------------------------------------------------------------------
def pid_alive(pid: Any) -> bool:
    """Whether process ``pid`` exists on this host (signal 0; a foreign user's process counts)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, OverflowError):
        return False
    return True


#: Run statuses, the one that wins first: a run is ``live`` while any rank is, else ``failed``
#: if a rank's program ended with an uncaught exception, else ``interrupted`` (Ctrl-C, SIGTERM,
#: or a process that ended without closing), else ``finished``.
STATUS_ORDER = ("live", "failed", "interrupted", "finished")


def status_of(manifest: dict[str, Any], end: Any) -> str:
    """A rank's status (one of :data:`STATUS_ORDER`) from its manifest and ``end.json`` object
    (``None`` when it has none): the end file says how the program ended, when it knows."""
    if end is None:
        state = rank_state(manifest, ended=False)
        return "live" if state == "live" else "interrupted"
    said = end.get("status") if isinstance(end, dict) else None
    return said if said in ("failed", "interrupted") else "finished"


def rank_state(manifest: dict[str, Any], ended: bool) -> str:
    """How a rank stands: ``finished`` (closed cleanly), ``live`` (its process runs on this
    host), ``remote`` (written from another host, not closed: cannot be checked from here)
    or ``gone`` (its process ended without closing)."""
    if ended:
        return "finished"
    if manifest.get("hostname") != socket.gethostname():
        return "remote"
    return "live" if pid_alive(manifest.get("pid")) else "gone"


def is_live(run_dir: str | os.PathLike[str]) -> bool:
    """Whether some rank of ``run_dir`` is still being written by a process on this host."""
    for rank in list_ranks(run_dir).ranks:
        if (rank.path / END_MARKER).exists():
            continue
        try:
            manifest = read_json_file(rank.path / RANK_MANIFEST)
        except (OSError, ValueError):
            continue
        if rank_state(manifest, ended=False) == "live":
            return True
    return False


# -- writability ---------------------------------------------------------------------------------
def check_writable(path: str | os.PathLike[str]) -> None:
    """Check, before anything starts, that a run can be written at ``path``; leaves no trace.

    Creates the missing folders and a probe file, then removes what it created. Costs a few
    file system calls; call it at attach / launch time, not per step.

    Raises:
        StoreError: one line naming the path and the reason (read-only file system, no
            permission, a file in the way, ...).
    """
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise StoreError(f"{str(target)!r} exists and is not a directory")
    created: list[Path] = []
    probe_file = target / f".amprobe-write-check-{os.getpid()}"
    try:
        missing = []
        p = target
        while not p.exists():
            missing.append(p)
            if p.parent == p:
                break
            p = p.parent
        for folder in reversed(missing):
            folder.mkdir()
            created.append(folder)
        fd = os.open(probe_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
        os.unlink(probe_file)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        where = exc.filename if exc.filename else str(target)
        raise StoreError(
            f"cannot write the run directory {str(target)!r}: {reason} ({where})"
        ) from None
    finally:
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:
                pass


def prepare_run_dir(run_dir: Path, overwrite: bool) -> list[Path]:
    """Make ``run_dir`` ready for a new run; return the folders this call created.

    Refuses (before anything starts) a path that is a file, a non-empty folder that is not an
    amprobe run (judged by the format marker, never by a file name alone), an existing run
    without ``overwrite``, and a place that cannot be written. ``--overwrite`` only ever
    deletes a folder that holds an amprobe run.

    Raises:
        StoreError: one line that says why and what to do.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise StoreError(f"--out {str(run_dir)!r} exists and is not a directory")
    if run_dir.exists() and any(run_dir.iterdir()):
        if not is_run_dir(run_dir):
            raise StoreError(
                f"--out {str(run_dir)!r} is a non-empty directory that is not an amprobe run "
                "(no amprobe manifest.json); it is never overwritten: choose another"
            )
        if not overwrite:
            raise StoreError(
                f"--out {str(run_dir)!r} already holds a run; choose another or pass --overwrite"
            )
        if is_live(run_dir):
            raise StoreError(
                f"--out {str(run_dir)!r} holds a run that is still being written; "
                "it is not overwritten"
            )
        shutil.rmtree(run_dir)
    created = []
    p = run_dir
    while not p.exists() and p.parent != p:
        created.append(p)
        p = p.parent
    try:
        check_writable(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    except StoreError as exc:
        raise StoreError(f"--out: {exc}") from None
    except OSError as exc:
        raise StoreError(f"--out: {exc.strerror or exc}") from None
    return created
