"""Per-rank summaries: the facts every rule needs from a rank, computed once (issue #33).

A rank's summary is made of **sections**, one per kind of fact (the scale trajectory, step
times, numerics aggregates, ...). A section is fed the rows of the tables it reads, one row at
a time, as plain dicts (the writer's rows before they are encoded, or the loader's rows when a
rank is summarized at read time), and turns them into a small JSON-safe dict. The dicts of two
consecutive runs of rows merge into the dict of their union (:meth:`Section.merge`), so:

- the writer keeps one accumulator for the whole run and, at each flush that wrote every
  pending row, replaces ``rankN/summary.json`` with one cumulative record (a killed job keeps
  the record of its last such flush): a reader reads one small file per rank;
- a reader summarizes from the record files only what the record does not cover (the rows
  after its ``offsets``, or the whole rank when it has no usable record) and merges that tail
  into the record's sections.

This module imports nothing above ``store`` and neither pandas nor torch: the writer runs it in
the training process. Sections register with :func:`section`; see docs/design/read-side.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

__all__ = [
    "SUMMARY_FILE",
    "SUMMARY_VERSION",
    "Section",
    "SECTIONS",
    "section",
    "Accumulator",
    "merge_sections",
    "summary_tables",
    "make_record",
    "parse_record",
    "write_record",
    "encode_record",
]

#: A rank's summary record, replaced whole at each flush (``rankN/summary.json``).
SUMMARY_FILE = "summary.json"
#: Version of the summary record's layout; a reader rebuilds a record of another version from
#: the record files instead of reading it.
SUMMARY_VERSION = 5


class Section:
    """One kind of fact of a rank, accumulated from rows and merged with other runs of rows.

    Subclasses set :attr:`name` (the key in a summary record) and :attr:`tables` (the tables
    whose rows they read), and implement :meth:`add`, :meth:`to_json` and :meth:`merge`.
    ``merge`` must be associative and agree with accumulation: the merge of the ``to_json`` of
    rows ``A`` and of rows ``B`` (``A`` before ``B`` in the file) equals the ``to_json`` of a
    section fed ``A`` then ``B``. Missing keys and ``None`` values of a row mean the same.

    ``to_json`` must not change the section: the writer calls it at every flush and goes on
    adding rows to the same section for the whole run. Its dict may share the section's own
    lists and dicts (the caller encodes or merges it before adding more rows), and ``merge``
    must not change its arguments.
    """

    name: ClassVar[str] = ""
    tables: ClassVar[tuple[str, ...]] = ()

    def add(self, table: str, row: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        """The facts of every row added so far (leaves the section as it is)."""
        raise NotImplementedError

    @classmethod
    def merge(cls, first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
        """The section of ``first``'s rows followed by ``second``'s."""
        raise NotImplementedError


#: The registered sections, in registration order.
SECTIONS: list[type[Section]] = []


def section(cls: type[Section]) -> type[Section]:
    """Register a :class:`Section` subclass (a class decorator)."""
    if not cls.name or any(s.name == cls.name for s in SECTIONS):
        raise ValueError(f"section name missing or registered twice: {cls.name!r}")
    SECTIONS.append(cls)
    return cls


class Accumulator:
    """Every registered section of one rank, fed rows.

    :meth:`snapshot` reads the sections of every row added so far (the writer's cumulative
    record); :meth:`take` reads them and starts afresh. :attr:`counts` counts the rows added
    per table (those of tables no section reads are not counted).
    """

    def __init__(self) -> None:
        self._fresh()

    def _fresh(self) -> None:
        self.sections = [cls() for cls in SECTIONS]
        self._by_table: dict[str, list[Section]] = {}
        for sec in self.sections:
            for table in sec.tables:
                self._by_table.setdefault(table, []).append(sec)
        self.counts: dict[str, int] = {}

    @property
    def rows(self) -> int:
        """Rows added in all (of the tables some section reads)."""
        return sum(self.counts.values())

    def reads(self, table: str) -> bool:
        """Whether some section reads ``table`` (the writer feeds only those rows)."""
        return table in self._by_table

    def add(self, table: str, rows: Iterable[Mapping[str, Any]]) -> None:
        readers = self._by_table.get(table)
        if not readers:
            return
        n = 0
        for row in rows:
            n += 1
            for sec in readers:
                sec.add(table, row)
        self.counts[table] = self.counts.get(table, 0) + n

    def snapshot(self) -> dict[str, Any]:
        """The sections' dicts of every row added so far; the sections are left as they are."""
        return {sec.name: sec.to_json() for sec in self.sections}

    def take(self) -> dict[str, Any]:
        """The sections' dicts of the rows added since the last ``take``; starts afresh."""
        out = self.snapshot()
        self._fresh()
        return out


def merge_sections(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The merge, in order, of several runs of rows' section dicts (as
    :meth:`Accumulator.snapshot` returns them). A section missing from a part is one with no
    rows there."""
    merged: dict[str, Any] = {}
    for part in parts:
        for cls in SECTIONS:
            if cls.name not in part:
                continue
            value = part[cls.name]
            merged[cls.name] = cls.merge(merged[cls.name], value) if cls.name in merged else value
    return merged


def summary_tables() -> set[str]:
    """The tables some registered section reads."""
    return {t for cls in SECTIONS for t in cls.tables}


def make_record(
    final: bool,
    offsets: Mapping[str, int],
    rows: Mapping[str, int],
    sections: Mapping[str, Any],
    checksums: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The content of ``summary.json``: the sections of every row of the rank up to ``offsets``.

    ``offsets`` maps each table file name to its size in bytes once the summarized rows were
    written (the rows a reader summarizes itself start there); ``rows`` counts the rows
    summarized per table; ``final`` marks the record ``close`` wrote (no row follows it).
    ``checksums`` maps table file names (of ``offsets``) to the CRC-32 (``zlib.crc32``) of the
    file's bytes ``[0, offset)`` as written, so that a reader can tell a file damaged or edited
    in place after it was summarized (``Run.summaries`` checks them); optional: a record
    without them (an older writer) is one whose files a reader cannot check.
    """
    record = {
        "summary_version": SUMMARY_VERSION,
        "final": final,
        "offsets": dict(offsets),
        "rows": dict(rows),
        "sections": dict(sections),
    }
    if checksums is not None:
        record["checksums"] = {k: v for k, v in checksums.items() if k in offsets}
    return record


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_record(obj: Any) -> dict[str, Any] | None:
    """``obj`` (the parsed ``summary.json``) if it is a well-formed record of any
    ``summary_version`` (the caller compares it), else None. Only the envelope is checked:
    the sections' dicts are their own classes' to read."""
    if not isinstance(obj, dict) or not _count(obj.get("summary_version")):
        return None
    if obj["summary_version"] != SUMMARY_VERSION:
        return obj  # another layout: the caller ignores it without reading further
    offsets, rows, sections = obj.get("offsets"), obj.get("rows"), obj.get("sections")
    if not (
        isinstance(obj.get("final"), bool)
        and isinstance(offsets, dict)
        and all(isinstance(k, str) and _count(v) for k, v in offsets.items())
        and isinstance(rows, dict)
        and all(isinstance(k, str) and _count(v) for k, v in rows.items())
        and isinstance(sections, dict)
        and all(isinstance(k, str) and isinstance(v, dict) for k, v in sections.items())
        and _checksums_ok(obj.get("checksums", {}), offsets)
    ):
        return None
    return obj


def _checksums_ok(checksums: Any, offsets: Mapping[str, int]) -> bool:
    """Whether a record's ``checksums`` (optional) are well formed: a CRC-32 per file of its
    ``offsets``."""
    return isinstance(checksums, dict) and all(
        k in offsets and _count(v) and v < 1 << 32 for k, v in checksums.items()
    )


def write_all(fh: Any, data: bytes, path: Path) -> None:
    """Write all of ``data`` to the unbuffered file ``fh`` (a short write is retried; a write
    of nothing is a full disk).

    Raises:
        OSError: it could not (``ENOSPC`` for a full disk), part of ``data`` may be written.
    """
    view = memoryview(data)
    done = 0
    while done < len(data):
        n = fh.write(view[done:])
        if not n:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        done += n


def write_record(rank_dir: Path, data: bytes, durable: bool) -> None:
    """Replace ``rank_dir/summary.json`` by ``data`` (one encoded record) atomically: a reader
    sees the old record or the new one, never a mix (a temporary file in the same folder,
    then ``os.replace``).

    ``durable`` asks for an ``fsync`` before the rename (``close`` and the compaction ask;
    each flush does not): a killed process loses nothing written, the page cache keeps it, so
    only a machine crash can leave an empty or cut ``summary.json``, and the reader then
    rebuilds the rank from its record files; an ``fsync`` at every flush would cost the
    training loop a disk round trip for no gain in what a reader can know.

    Raises:
        OSError: the record could not be written (the old one, if any, is left as it was).
    """
    path = rank_dir / SUMMARY_FILE
    # unique per writer (process, call): two writers never share a temporary file
    tmp = rank_dir / f".{SUMMARY_FILE}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        with open(tmp, "wb", buffering=0) as fh:
            write_all(fh, data, tmp)
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def encode_record(record: Mapping[str, Any]) -> bytes:
    """``record`` as the bytes of ``summary.json`` (compact JSON, one line; NaN and infinity
    written as JavaScript's, which Python's ``json`` reads back)."""
    return (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode("utf-8")


def summarize_tables(read: Any, tables: Iterable[str] | None = None) -> dict[str, Any]:
    """Summarize one rank from its record files: ``read(table)`` returns the table's rows as
    dicts in file order (an empty list when the file is missing). Reads only the tables some
    section reads (``tables`` narrows them further)."""
    wanted = summary_tables()
    if tables is not None:
        wanted &= set(tables)
    acc = Accumulator()
    for table in sorted(wanted):
        acc.add(table, read(table))
    return acc.snapshot()
