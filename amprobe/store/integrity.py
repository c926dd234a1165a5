"""Whether a rank's table files still hold the bytes its writer summarized (issue #33).

The writer records in each ``summary.json``, beside each table file's ``offsets``, the CRC-32
(``zlib.crc32``) of the file's bytes ``[0, offset)`` as it wrote them (``checksums``). A reader
that takes a rank's facts from that record instead of from the rows reads none of those
bytes, so damage inside them (a disk or a hand that overwrote records in place, the file
keeping its size and line ends) would go unseen: :func:`verify` reads them once and compares.

Reading every summarized byte is the price of a cold read (about 0.5 ms of CPU per MB); a
warm read does not pay it: each verified file is remembered in a small cache file
(:data:`CACHE_FILE`, in the folder :func:`amprobe.store.places.derived_folder` names) keyed
by the file's path in the run, inode, size, the later of ``mtime_ns`` and ``ctime_ns`` (an
edit that puts the modification time back, as ``touch -r`` or ``rsync -t`` do, cannot put the
change time back) and the recorded offset and CRC, and trusted only when that time was at
least :data:`RACY_NS` older than the check (a
file changed within the file system's timestamp granularity of its check could keep its
mtime: such an entry is read again, then kept with the new time). A file that only grew
since (the same inode, larger: a live run's appends) is read from where its last check
ended, the CRC continued from there (damage in place to bytes checked before, made while the
file grew, is then seen only by a read without the cache). A copied run (new inodes and
mtimes) is verified again. Damage that changes no time at all (the medium itself) is seen by
a cold read only: delete ``verified.json`` to read every file again. Runs with fewer than :data:`CACHE_MIN_BYTES` to check keep no
cache (reading them costs less than the cache would).

The standard library only; raises nothing but what its callers are told.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import time
import uuid
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

__all__ = ["Check", "Verdict", "CACHE_FILE", "CACHE_MIN_BYTES", "crc_of", "verify", "rank_ranges"]

#: The cache of files found as their writer recorded them (in the derived folder).
CACHE_FILE = "verified.json"
_CACHE_VERSION = 1
#: Below this many bytes to check in all, a run keeps no cache: they are read each time.
CACHE_MIN_BYTES = 64 << 20
#: Bytes read at a time (a reused buffer: reading costs no memory per rank).
_CHUNK = 1 << 20
#: A cached check is trusted only when the file's mtime was at least this much older than the
#: check (the coarsest common timestamp granularity: 2 s on FAT; 1 s on some network mounts).
RACY_NS = 2_000_000_000
#: Largest cache file read (about 80 bytes per checked file).
_MAX_CACHE_BYTES = 256 << 20


class Check(NamedTuple):
    """One table file of one rank whose summarized bytes a record's checksum describes (a
    tuple: tens of thousands are made at each load of a large run)."""

    rank: int
    name: str  # the table file's name (``steps.jsonl``)
    rel: str  # its path relative to the run (the cache's key)
    path: str
    offset: int  # the bytes [0, offset) were summarized ...
    crc: int  # ... and their CRC-32 as the writer wrote them


@dataclasses.dataclass
class Verdict:
    """What :func:`verify` found: the checks whose bytes differ from the recorded CRC, those
    that could not be read (with why), and how many bytes it read."""

    mismatched: list[Check] = dataclasses.field(default_factory=list)
    unreadable: list[tuple[Check, str]] = dataclasses.field(default_factory=list)
    read_bytes: int = 0


def crc_of(path: str, end: int, start: int = 0, crc: int = 0) -> int:
    """The CRC-32 of ``path``'s bytes ``[0, end)``, ``crc`` being that of ``[0, start)``.

    Raises:
        OSError: the file cannot be read, or holds fewer than ``end`` bytes (``EIO``).
    """
    buf = bytearray(min(_CHUNK, max(end - start, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        fh.seek(start)
        at = start
        while at < end:
            n = fh.readinto(view[: min(len(buf), end - at)])
            if not n:
                raise OSError(errno.EIO, f"ends at {at} bytes, before the {end} summarized")
            crc = zlib.crc32(view[:n], crc)
            at += n
    return crc


def _load_cache(path: Path | None) -> dict[str, list[int]]:
    if path is None:
        return {}
    try:
        with open(path, "rb") as fh:
            data = fh.read(_MAX_CACHE_BYTES + 1)
        obj = json.loads(data) if len(data) <= _MAX_CACHE_BYTES else None
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(obj, dict) or obj.get("version") != _CACHE_VERSION:
        return {}
    files = obj.get("files")
    return files if isinstance(files, dict) else {}


def _save_cache(path: Path, files: dict[str, list[int]]) -> None:
    """Replace the cache file atomically (a temporary file, then ``os.replace``); best effort:
    a cache that cannot be written is read again next time."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps({"version": _CACHE_VERSION, "files": files}, separators=(",", ":"))
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def verify(
    checks: list[Check],
    cache_folder: Callable[[], Path] | None = None,
    read: Callable[[str, int, int, int], int] = crc_of,
) -> Verdict:
    """Compare each check's file bytes ``[0, offset)`` with its recorded CRC.

    ``cache_folder`` (called only when the checks cover at least :data:`CACHE_MIN_BYTES`)
    names the folder of the cache file; a file found there as it was when it matched (same
    inode, size, mtime, offset and CRC) is not read. ``read`` is :func:`crc_of` (a test
    counts its calls)."""
    verdict = Verdict()
    use_cache = cache_folder is not None and sum(c.offset for c in checks) >= CACHE_MIN_BYTES
    cache_path = cache_folder() / CACHE_FILE if use_cache and cache_folder else None
    cached = _load_cache(cache_path)
    fresh: dict[str, list[int]] = {}
    changed = False
    now = time.time_ns()
    stat, get = os.stat, cached.get
    todo: list[tuple[Check, list[int], int, int]] = []  # to read: from where, the CRC so far
    for check in checks:
        try:
            st = stat(check.path)
        except OSError as exc:
            verdict.unreadable.append((check, exc.strerror or str(exc)))
            continue
        # the later of mtime and ctime: an edit that puts the mtime back cannot put ctime back
        touched = max(st.st_mtime_ns, st.st_ctime_ns)
        key = [st.st_ino, st.st_size, touched, check.offset, check.crc]
        old = get(check.rel)
        if type(old) is not list or len(old) != 6 or type(old[5]) is not int:
            old = None
        elif old[:5] == key and key[2] + RACY_NS <= old[5]:
            fresh[check.rel] = old  # as it was when it matched: not read
            continue
        elif not all(type(v) is int for v in old):
            old = None
        start, crc = 0, 0
        if (
            old is not None
            and old[0] == st.st_ino
            and old[1] < st.st_size
            and old[3] <= check.offset
            and (old[3] < check.offset or old[4] == check.crc)
        ):
            start, crc = old[3], old[4]  # the file only grew since its bytes to there matched
        todo.append((check, key, start, crc))

    def one(item: tuple[Check, list[int], int, int]) -> int | OSError:
        check, _key, start, crc = item
        try:
            return read(check.path, check.offset, start, crc)
        except OSError as exc:
            return exc

    # threads: reading and zlib.crc32 release the GIL (a cold read of a large run, all cores)
    if len(todo) > 1 and sum(c.offset - s for c, _k, s, _c in todo) >= _CHUNK * 8:
        workers = min(len(todo), os.cpu_count() or 1, 8)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(one, todo))
    else:
        results = [one(item) for item in todo]
    for (check, key, start, _crc), got in zip(todo, results, strict=True):
        if isinstance(got, OSError):
            verdict.unreadable.append((check, got.strerror or str(got)))
            continue
        verdict.read_bytes += check.offset - start
        if got == check.crc:
            fresh[check.rel] = [*key, now]
            changed = True
        else:
            verdict.mismatched.append(check)
    if cache_path is not None and (changed or len(fresh) != len(cached)):
        _save_cache(cache_path, fresh)
    return verdict


def rank_ranges(ranks: Iterable[int]) -> str:
    """Ranks as ranges: ``0-3, 7, 9-12``."""
    out: list[str] = []
    ordered = sorted(set(ranks))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(out)
