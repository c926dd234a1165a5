"""Append-only, crash-safe writer for one rank of a run directory.

Besides the rows, the writer keeps the rank's summary (:mod:`amprobe.store.summary`): the rows
it is given feed one accumulator for the whole run, and each flush that writes every pending
row replaces ``rankN/summary.json`` with the summary of every row so far (see
:meth:`RunWriter.flush`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import socket
import sys
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from amprobe.store import schema
from amprobe.store import sections as _sections  # noqa: F401  (registers the sections)
from amprobe.store.layout import StoreError, has_format_marker, table_filename
from amprobe.store.summary import (
    SECTIONS,
    SUMMARY_FILE,
    Accumulator,
    encode_record,
    make_record,
    write_all,
    write_record,
)
from amprobe.version import __version__

#: Space set aside in each rank's folder at start and released at close, so that the clean
#: close (``end.json``) and the newest events can be written even when the disk is full.
RESERVE_BYTES = 64 * 1024
RESERVE_FILE = ".amprobe-reserve"
#: The summary record (``summary.json``) is replaced at a flush no sooner than this many seconds
#: after the last one (the first flush and the close always write it): a reader summarizes the
#: rows written since from the files' tails, so a killed job costs the reader at most this much
#: of its rows, and the training thread pays for a record at most this often.
SUMMARY_INTERVAL_S = 10.0
#: ... and no sooner than this many times what the last record cost to build and write (so
#: records take at most about 1 % of the training thread's time, whatever the model's size).
SUMMARY_COST_FACTOR = 100.0

__all__ = ["RunWriter", "write_json_atomic", "run_environment"]

_ENCODER = json.JSONEncoder(default=str, check_circular=False)


def _row_encoder() -> Any:
    """One encoder for every row: ``JSONEncoder.encode`` builds the C encoder anew at each
    call (two Python frames and a constructor, about 0.6 us of a row's 4 us); this builds it
    once, with the arguments ``JSONEncoder.iterencode`` gives it. Used only where it writes
    the same text as ``JSONEncoder.encode`` (checked here on a sample; else that is used)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return _ENCODER.encode
    try:
        e = _ENCODER
        c_encode = make(
            None, e.default, json.encoder.encode_basestring_ascii, e.indent,
            e.key_separator, e.item_separator, e.sort_keys, e.skipkeys, e.allow_nan,
        )  # fmt: skip
        join = "".join

        def encode(row: Any) -> str:
            return join(c_encode(row, 0))

        sample = {"s": 'é"\n', "f": 0.1, "n": float("nan"), "i": -1, "b": True, "z": None}
        sample["l"] = [1.5, {"k": float("-inf")}, Path("p")]
        if encode(sample) == e.encode(sample):
            return encode
    except Exception:
        pass
    return _ENCODER.encode


_ENCODE = _row_encoder()


def write_json_atomic(path: Path, obj: Mapping[str, Any]) -> None:
    """Write ``obj`` as JSON so that a reader sees either the old file or the whole new one."""
    # unique per writer (process, thread, call): two writers never share a temporary file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=2, sort_keys=True, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def run_environment() -> dict[str, Any]:
    """Versions and host facts that go into every manifest. Costs no device work."""
    torch = sys.modules.get("torch")  # the writer runs in a job that imported it
    try:
        torch_version = str(torch.__version__) if torch else importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {
        "amprobe_version": __version__,
        "torch_version": torch_version,
        "python_version": sys.version.split()[0],
        "hostname": socket.gethostname(),
    }


class RunWriter:
    """Writes one rank's part of a run directory.

    Rows are appended as whole JSON lines with one ``write`` call per table and flush, so a
    process killed at any point leaves every earlier flush readable. When the directory cannot
    be written (removed, disk full, read-only), rows stay in a bounded in-memory buffer and are
    retried at the next flush; rows pushed out of that buffer are counted as lost, with the
    first and last step they covered, and the count is written to ``end.json``.

    The summary (``summary.json``) never claims a row that is not in the files: it is
    replaced, after the rows, only by a flush that wrote every pending row, and it covers every
    row given so far (a flush that left rows queued writes no record; the next full flush's
    covers those rows too; a record that could not be written leaves the last one in place).
    Once a row is counted as lost, a table file is not as this writer left it (its folder was
    removed, it was truncated or written by someone else), or a section raises (recorded once
    in ``write_errors``), the rank writes no more records: the reader summarizes the rows after
    the last record from the files.
    """

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world_size: int,
        rank_manifest: Mapping[str, Any],
        max_buffered_rows: int,
        overwrite: bool = False,
        lazy: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.rank_dir = self.run_dir / schema.rank_dirname(rank)
        self._pending: dict[str, deque[str]] = {}
        self._max_rows = max_buffered_rows
        self.lost_rows: dict[str, int] = {}
        self.lost_steps: list[int] = []
        self.write_errors: list[str] = []
        # the summary of every row given so far (None: summaries off)
        self._summary: Accumulator | None = Accumulator() if SECTIONS else None
        self._summary_dirty = False  # rows fed since the last record written
        self.summary_interval_s = SUMMARY_INTERVAL_S  # the least time between two records
        self._summary_due = 0.0  # time.monotonic() from which the next record may be written
        self._sizes: dict[str, int] = {}  # table file name -> its size after our last write
        #: table file name -> CRC-32 of its bytes [0, size) as written (the record's checksums)
        self._crcs: dict[str, int] = {}
        self._setup = (world_size, dict(rank_manifest), overwrite)
        # the manifest may be annotated from another thread (live attach) while the training
        # thread prepares the directory: one lock, so no fact is written over by an older copy
        self._manifest_lock = threading.RLock()
        self.ready = False
        self._check(overwrite)
        if not lazy:
            self._prepare(*self._setup)

    # -- set-up (raises: called at attach time) ---------------------------------------------
    def _check(self, overwrite: bool) -> None:
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise StoreError(f"run_dir {str(self.run_dir)!r} exists and is not a directory")
        top = self.run_dir / schema.RUN_MANIFEST
        if top.exists() and not has_format_marker(top):
            raise StoreError(
                f"run_dir {str(self.run_dir)!r} holds a manifest.json that is not an amprobe "
                "run's; choose another run_dir (it is never overwritten)"
            )
        mine = self.rank_dir / schema.RANK_MANIFEST
        if mine.exists():
            if not has_format_marker(mine):
                raise StoreError(
                    f"{str(self.rank_dir)!r} holds a manifest.json that is not an amprobe "
                    "run's; choose another run_dir (it is never overwritten)"
                )
            if not overwrite:
                raise StoreError(
                    f"run_dir {str(self.run_dir)!r} already holds a recording for rank "
                    f"{self.rank}; choose a new run_dir or pass config={{'overwrite': True}}"
                )

    def update_manifest(self, rank_manifest: Mapping[str, Any]) -> None:
        """Replace this rank's manifest (atomically) once more facts are known. Thread-safe."""
        with self._manifest_lock:
            self._setup = (self._setup[0], dict(rank_manifest), self._setup[2])
            if self.ready:
                write_json_atomic(
                    self.rank_dir / schema.RANK_MANIFEST,
                    {
                        "format": schema.FORMAT,
                        "schema_version": schema.SCHEMA_VERSION,
                        **self._setup[1],
                    },
                )

    def prepare(self) -> None:
        """Create this rank's directory and manifests now (a lazy writer otherwise waits for steps).

        Raises:
            StoreError: the directory cannot be written or already holds this rank's data.
        """
        with self._manifest_lock:
            if not self.ready:
                self._prepare(*self._setup)

    def _prepare(self, world_size: int, rank_manifest: Mapping[str, Any], overwrite: bool) -> None:
        self._check(overwrite)
        try:
            self.rank_dir.mkdir(parents=True, exist_ok=True)
            if overwrite and has_format_marker(self.rank_dir / schema.RANK_MANIFEST):
                for old in self.rank_dir.iterdir():
                    if old.is_file():
                        old.unlink()
            top = self.run_dir / schema.RUN_MANIFEST
            if not top.exists():
                manifest = {
                    "format": schema.FORMAT,
                    "schema_version": schema.SCHEMA_VERSION,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "created_unix": time.time(),
                    "argv": list(sys.argv),
                    "world_size": world_size,
                    **run_environment(),
                }
                write_json_atomic(top, manifest)
            write_json_atomic(
                self.rank_dir / schema.RANK_MANIFEST,
                {"format": schema.FORMAT, "schema_version": schema.SCHEMA_VERSION, **rank_manifest},
            )
            self._reserve_space()
        except OSError as exc:
            raise StoreError(
                f"cannot write run_dir {str(self.run_dir)!r}: {exc.strerror or exc}"
            ) from None
        self.ready = True

    # -- hot-ish path (never raises) ---------------------------------------------------------
    def append(self, table: str, rows: Iterable[Mapping[str, Any]]) -> None:
        """Queue rows for ``table``; they reach disk at the next :meth:`flush`."""
        summary = self._summary
        if summary is not None and summary.reads(table):
            if not isinstance(rows, (list, tuple)):
                rows = list(rows)
            try:
                summary.add(table, [_as_written(row) for row in rows])
            except Exception as exc:
                self._summary_failed(exc)
            else:
                self._summary_dirty = True
        queue = self._pending.setdefault(table, deque())
        for row in rows:
            # NaN / Infinity are written as such: pyarrow's JSON reader reads them back
            queue.append(_ENCODE(row))
        overflow = len(queue) - self._max_rows
        if overflow > 0:
            for _ in range(overflow):
                dropped = queue.popleft()
                self._count_lost(table, dropped)

    def _count_lost(self, table: str, line: str) -> None:
        # the accumulator holds this row, which never reaches the files: no record may claim it
        self._summary_off()
        self.lost_rows[table] = self.lost_rows.get(table, 0) + 1
        try:
            step = json.loads(line).get("step")
        except ValueError:
            step = None
        if isinstance(step, int):
            if not self.lost_steps:
                self.lost_steps = [step, step]
            else:
                self.lost_steps = [min(self.lost_steps[0], step), max(self.lost_steps[1], step)]

    # -- disk full: a reserve for the clean close -------------------------------------------
    def _reserve_space(self) -> None:
        """Set aside :data:`RESERVE_BYTES` on the run's file system, released at close so that
        the end marker and the latest events can still be written when the disk is full."""
        path = self.rank_dir / RESERVE_FILE
        try:
            with open(path, "wb") as fh:
                fh.write(b"\0" * RESERVE_BYTES)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink()

    def _release_reserve(self) -> None:
        with contextlib.suppress(OSError):
            (self.rank_dir / RESERVE_FILE).unlink()

    def _write_tail(self, table: str, budget: int) -> None:
        """Write the newest rows of ``table`` that fit in ``budget`` bytes; the older ones are
        counted as lost (the newest events say how the run ended)."""
        queue = self._pending.get(table)
        if not queue:
            return
        size, keep = 0, 0
        for line in reversed(queue):
            size += len(line.encode("utf-8")) + 1
            if size > budget:
                break
            keep += 1
        while len(queue) > keep:
            self._count_lost(table, queue.popleft())
        lines = list(queue)
        if not lines:
            return
        try:
            self._append(table_filename(table), _encode(lines))
        except OSError:
            return
        queue.clear()

    def _append(self, name: str, data: bytes) -> None:
        """Append ``data`` (whole lines) to table file ``name`` and note the file's size.

        Raises:
            OSError: see :func:`_append_lines`.
        """
        end = _append_lines(self.rank_dir / name, data)
        if end != self._sizes.get(name, 0) + len(data):
            # the file is not as this writer left it (removed, truncated, appended to by
            # another process, or ending in a cut line): rows the accumulator holds may not be
            # in it, and the last record may describe a file that is gone
            self._summary_off(drop_record=True)
        else:
            # the bytes written, as they are on disk: one call per file and flush (about
            # 0.05 us per 100 bytes of rows, see docs/design/read-side.md)
            self._crcs[name] = zlib.crc32(data, self._crcs.get(name, 0))
        self._sizes[name] = end

    # -- the summary ------------------------------------------------------------------------
    def _summary_off(self, drop_record: bool = False) -> None:
        """Write no more summary records (the reader summarizes the rest from the files).

        The last record written stays (it claims only rows that are in the files) unless
        ``drop_record``: then it is removed, best effort (a file it describes was changed by
        someone else; the reader would catch most such changes by size, not all)."""
        if drop_record and self._summary is not None:
            with contextlib.suppress(OSError):
                (self.rank_dir / SUMMARY_FILE).unlink()
        self._summary = None
        self._summary_dirty = False

    def _summary_failed(self, exc: BaseException) -> None:
        message = f"summary: {type(exc).__name__}: {exc} (summaries off for this rank)"
        if message not in self.write_errors:
            self.write_errors.append(message)
        self._summary_off()

    def _write_summary(self, final: bool) -> None:
        """Replace ``summary.json`` by the summary of every row given so far (all of them are
        in the files now). A record that cannot be written leaves the last one in place; the
        next flush tries again."""
        summary = self._summary
        if summary is None or not (final or self._summary_dirty):
            return
        start = time.monotonic()
        if not final and start < self._summary_due:
            return  # rows since the last record are read from the files' tails meanwhile
        try:
            record = make_record(final, self._sizes, summary.counts, summary.snapshot(), self._crcs)
            data = encode_record(record)
        except Exception as exc:
            self._summary_failed(exc)
            return
        try:
            # fsync only at close: see write_record
            write_record(self.rank_dir, data, durable=final)
        except OSError as exc:
            message = f"{SUMMARY_FILE}: {exc.strerror or exc}"
            if message not in self.write_errors:
                self.write_errors.append(message)
            return
        self._summary_dirty = False
        # the next record no sooner than SUMMARY_INTERVAL_S, nor than SUMMARY_COST_FACTOR times
        # what this one cost: a large model's record (hundreds of layers) costs tens to
        # hundreds of milliseconds of the training thread, which a flush every half second
        # would pay each time
        spent = time.monotonic() - start
        self._summary_due = start + max(self.summary_interval_s, SUMMARY_COST_FACTOR * spent)

    def flush(self) -> bool:
        """Append all queued rows to their files. Returns False if some rows stay queued.

        When every queued row was written, ``summary.json`` is replaced (after the rows,
        atomically) by the summary of every row given so far (it is left as it is when no row
        of a table a section reads was given since); when some rows stay queued, it is left as
        it is and the next full flush's record covers them too.

        A lazy writer creates its files only once a training step has been queued, so a
        process that never trains (a launcher, a helper script) leaves nothing behind.
        """
        return self._flush(final=False)

    def _flush(self, final: bool) -> bool:
        if not self.ready:
            if not self._pending.get("steps"):
                return True
            try:
                self.prepare()
            except Exception as exc:
                message = f"cannot create the run directory: {exc}"
                if message not in self.write_errors:
                    self.write_errors.append(message)
                return False
        ok = True
        for table, queue in self._pending.items():
            if not queue:
                continue
            lines = list(queue)
            name = table_filename(table)
            try:
                try:
                    self._append(name, _encode(lines))
                except FileNotFoundError:  # the run directory was removed: made again
                    self._summary_off()  # the rows written before went with it (and the record)
                    self.rank_dir.mkdir(parents=True, exist_ok=True)
                    self._append(name, _encode(lines))
            except OSError as exc:
                ok = False
                message = f"{table}: {exc.strerror or exc}"
                if message not in self.write_errors:
                    self.write_errors.append(message)
                continue
            for _ in lines:
                queue.popleft()
        if ok:
            self._write_summary(final)
        return ok

    def close(self, end: Mapping[str, Any]) -> None:
        """Flush what is left and write ``end.json`` (the clean-close marker).

        When the disk is full, the space reserved at start is released first so that the
        newest events and ``end.json`` (with the count of rows lost and why) still reach disk.
        """
        ok = self._flush(final=True)  # the summary's last record is marked final (and synced)
        if not self.ready:
            return  # a lazy writer of a process that never trained writes nothing
        if not ok:
            self._release_reserve()
            self._write_tail("events", RESERVE_BYTES // 2)
        for table, queue in self._pending.items():
            for line in queue:
                self._count_lost(table, line)
            queue.clear()
        payload = dict(end)
        payload["lost_rows"] = dict(self.lost_rows)
        payload["lost_steps"] = list(self.lost_steps)
        payload["write_errors"] = list(self.write_errors)
        try:
            write_json_atomic(self.rank_dir / schema.END_MARKER, payload)
        except OSError:
            pass
        self._release_reserve()


#: The value types the encoder writes as themselves; any other (a numpy scalar, a tensor) is
#: written as its ``str`` (``default=str``), which the loader reads as missing in a number column.
_NATIVE = frozenset({type(None), bool, int, float, str, list, dict, tuple})


def _as_written(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """``row`` as the file will hold it, for the summary: a value of another type than the
    encoder writes natively becomes its text, as in the file (so a numpy float the file holds
    as ``"65536.0"`` is no number to the summary either). ``row`` itself when all are native."""
    if all(type(v) in _NATIVE for v in row.values()):
        return row
    return {k: (v if type(v) in _NATIVE else str(v)) for k, v in row.items()}


def _encode(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode("utf-8")


def _append_lines(path: Path, data: bytes) -> int:
    """Append whole lines to ``path``, all or nothing; returns the file's size after them.

    A write cut short (disk full) is truncated back to where it started, so that retrying the
    same rows later cannot duplicate the ones that made it. A file that does not end in a
    newline (a writer killed mid-line) gets one first, so the cut record stays a separate,
    damaged line instead of spoiling the first new one.

    Raises:
        OSError: the rows could not be written (the file is as it was).
    """
    with open(path, "ab+", buffering=0) as fh:
        start = fh.seek(0, os.SEEK_END)
        if start > 0 and os.pread(fh.fileno(), 1, start - 1) != b"\n":
            data = b"\n" + data
        try:
            write_all(fh, data, path)
        except OSError:
            with contextlib.suppress(OSError):
                fh.truncate(start)
            raise
        return start + len(data)
