"""Per-rank summaries: the facts every rule needs from a rank, computed once (issue #33).

A rank's summary is made of **sections**, one per kind of fact (the scale trajectory, step
times, numerics aggregates, ...). A section is fed the rows of the tables it reads, one row at
a time, as plain dicts (the writer's rows before they are encoded, or the loader's rows when a
rank is summarized at read time), and turns them into a small JSON-safe dict. The dicts of two
consecutive chunks of rows merge into the dict of their union (:meth:`Section.merge`), so:

- the writer appends one record per flushed chunk to ``rankN/summary.jsonl`` (a killed job
  keeps the summaries of every chunk it flushed), and a last one marked ``final`` at close;
- a reader merges a rank's chunk records in one pass, and summarizes from the record files
  only what no record covers (the rows after the last record's ``offsets``, a rank without a
  summary file).

This module imports nothing above ``store`` and neither pandas nor torch: the writer runs it in
the training process. Sections register with :func:`section`; see docs/design/read-side.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
]

SUMMARY_FILE = "summary.jsonl"
#: Version of the summary record's layout; a reader rebuilds records of another version from
#: the record files instead of merging them.
SUMMARY_VERSION = 1


class Section:
    """One kind of fact of a rank, accumulated from rows and merged across chunks.

    Subclasses set :attr:`name` (the key in a summary record) and :attr:`tables` (the tables
    whose rows they read), and implement :meth:`add`, :meth:`to_json` and :meth:`merge`.
    ``merge`` must be associative and agree with accumulation: the merge of the ``to_json`` of
    rows ``A`` and of rows ``B`` (``A`` before ``B`` in the file) equals the ``to_json`` of a
    section fed ``A`` then ``B``. Missing keys and ``None`` values of a row mean the same.
    """

    name: ClassVar[str] = ""
    tables: ClassVar[tuple[str, ...]] = ()

    def add(self, table: str, row: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
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
    """Every registered section of one rank, fed rows; :meth:`take` empties it into a dict."""

    def __init__(self) -> None:
        self._fresh()

    def _fresh(self) -> None:
        self.sections = [cls() for cls in SECTIONS]
        self._by_table: dict[str, list[Section]] = {}
        for sec in self.sections:
            for table in sec.tables:
                self._by_table.setdefault(table, []).append(sec)
        self.rows = 0

    def reads(self, table: str) -> bool:
        """Whether some section reads ``table`` (the writer feeds only those rows)."""
        return table in self._by_table

    def add(self, table: str, rows: Iterable[Mapping[str, Any]]) -> None:
        readers = self._by_table.get(table)
        if not readers:
            return
        for row in rows:
            self.rows += 1
            for sec in readers:
                sec.add(table, row)

    def take(self) -> dict[str, Any]:
        """The sections' dicts of the rows added since the last ``take``; starts afresh."""
        out = {sec.name: sec.to_json() for sec in self.sections}
        self._fresh()
        return out


def merge_sections(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The merge, in order, of several chunks' section dicts (as :meth:`Accumulator.take`
    returns them). A section missing from a part is one with no rows there."""
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
    chunk: int,
    final: bool,
    offsets: Mapping[str, int],
    rows: Mapping[str, int],
    sections: Mapping[str, Any],
) -> dict[str, Any]:
    """One line of ``summary.jsonl``: the sections of the rows of one flushed chunk.

    ``offsets`` maps each table file name to its size in bytes once the chunk's rows were
    written (the rows a reader summarizes itself start there); ``rows`` counts the chunk's rows
    per table summarized; ``final`` marks the record ``close`` wrote (nothing follows it).
    """
    return {
        "summary_version": SUMMARY_VERSION,
        "chunk": chunk,
        "final": final,
        "offsets": dict(offsets),
        "rows": dict(rows),
        "sections": dict(sections),
    }


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_record(obj: Any) -> dict[str, Any] | None:
    """``obj`` (one parsed line of ``summary.jsonl``) if it is a well-formed record of any
    ``summary_version`` (the caller compares it), else None. Only the envelope is checked:
    the sections' dicts are their own classes' to read."""
    if not isinstance(obj, dict) or not _count(obj.get("summary_version")):
        return None
    if obj["summary_version"] != SUMMARY_VERSION:
        return obj  # another layout: the caller ignores it without reading further
    offsets, rows, sections = obj.get("offsets"), obj.get("rows"), obj.get("sections")
    if not (
        _count(obj.get("chunk"))
        and isinstance(obj.get("final"), bool)
        and isinstance(offsets, dict)
        and all(isinstance(k, str) and _count(v) for k, v in offsets.items())
        and isinstance(rows, dict)
        and all(isinstance(k, str) and _count(v) for k, v in rows.items())
        and isinstance(sections, dict)
        and all(isinstance(k, str) and isinstance(v, dict) for k, v in sections.items())
    ):
        return None
    return obj


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
    return acc.take()
