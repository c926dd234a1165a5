"""The ``tables`` section of a rank's summary: the rows of its small tables, kept verbatim.

``events``, ``compute_ops``, ``compute_steps`` and ``gpu`` hold a few dozen rows a rank, yet
reading them from every rank's files cost a quarter of ``diagnose`` at 4,096 ranks (4 x 4,096
small files parsed). This section keeps their rows as the writer gives them (or as the loader
read them, when a rank is summarized from its files), so that :meth:`amprobe.store.run.Run.table`
can build those frames from the summaries the reader reads anyway.

The dict: ``{table: {"rows": [row, ...]}}`` for a table whose every row is kept, or
``{table: {"incomplete": true}}`` (no rows) once the table has more than :data:`MAX_ROWS`
rows, or a row the files could read differently than the row itself says (a value of another
type than its schema column's: see :func:`clean_row`). A table without rows is absent. Only
the schema's columns of a row are kept (the loader reads no others).

What the reader trusts: the rows a record holds are those the writer handed to the files, in
file order. A line damaged on disk after it was written (the loader drops or nulls it) is not
seen by a record written before the damage; the other sections trust the record the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import pyarrow as pa

from amprobe.store import schema
from amprobe.store.summary import Section, section

__all__ = ["MAX_ROWS", "SMALL_TABLES", "TablesSection", "clean_row", "table_rows"]

#: Rows kept per table and rank; a table with more is marked incomplete (read from its files).
MAX_ROWS = 512
#: The tables kept.
SMALL_TABLES = ("events", "compute_ops", "compute_steps", "gpu")


def _kind(arrow_type: pa.DataType) -> str:
    if pa.types.is_boolean(arrow_type):
        return "bool"
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_floating(arrow_type):
        return "float"
    if pa.types.is_string(arrow_type):
        return "str"
    return "other"


#: table -> column -> "int" | "float" | "str" | "bool" | "other"
_COLUMNS: dict[str, dict[str, str]] = {
    t: {c: _kind(ty) for c, ty in schema.TABLES[t].items()} for t in SMALL_TABLES
}
_INT64 = (-(1 << 63), (1 << 63) - 1)


def clean_row(table: str, row: Mapping[str, Any]) -> dict[str, Any] | None:
    """The schema's columns of ``row`` (None values left out), or None when a value is not of
    its column's JSON type (an int for an integer column, an int or float for a float column,
    a str, a bool): such a value the file parser reads in its own way (nulled, truncated), so
    the table is read from its files instead."""
    columns = _COLUMNS[table]
    out: dict[str, Any] = {}
    for key, value in row.items():
        kind = columns.get(key)
        if kind is None or value is None:
            continue
        vt = type(value)
        if kind == "int":
            if vt is not int or not _INT64[0] <= value <= _INT64[1]:
                return None
        elif kind == "float":
            if vt is not float and vt is not int:
                return None
            if vt is int and not _INT64[0] <= value <= _INT64[1]:
                return None
        elif kind == "str":
            if vt is not str:
                return None
        elif kind == "bool":
            if vt is not bool:
                return None
        else:
            return None
        out[key] = value
    return out


@section
class TablesSection(Section):
    name: ClassVar[str] = "tables"
    tables: ClassVar[tuple[str, ...]] = SMALL_TABLES

    def __init__(self) -> None:
        self._rows: dict[str, list[dict[str, Any]] | None] = {}

    def add(self, table: str, row: Mapping[str, Any]) -> None:
        rows = self._rows.get(table, [])
        if rows is None:
            return
        kept = clean_row(table, row) if len(rows) < MAX_ROWS else None
        if kept is None:
            self._rows[table] = None
        else:
            rows.append(kept)
            self._rows[table] = rows

    def to_json(self) -> dict[str, Any]:
        return {
            t: {"incomplete": True} if rows is None else {"rows": rows}
            for t, rows in self._rows.items()
        }

    @classmethod
    def merge(cls, first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = dict(first)
        for table, entry in second.items():
            if table not in out:
                out[table] = entry
                continue
            a, b = out[table].get("rows"), entry.get("rows")
            if a is None or b is None or len(a) + len(b) > MAX_ROWS:
                out[table] = {"incomplete": True}
            else:
                out[table] = {"rows": [*a, *b]}
        return out


def table_rows(summary: Mapping[str, Any], table: str) -> list[dict[str, Any]] | None:
    """A rank's rows of ``table`` from its summary: [] when it had none, None when the summary
    does not hold them all (incomplete, or a summary without this section)."""
    sec = summary.get(TablesSection.name)
    if not isinstance(sec, dict):
        return None
    entry = sec.get(table)
    if entry is None:
        return []
    rows = entry.get("rows") if isinstance(entry, dict) else None
    return rows if isinstance(rows, list) else None
