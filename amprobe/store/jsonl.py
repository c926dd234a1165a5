"""Read one JSON Lines table of a rank: the crash-safe write format, parsed with arrow.

:func:`read_table` reads a table from a byte offset (the live dashboard's incremental reads);
:class:`amprobe.store.run.Run` reads every rank's file of a table through the helpers here.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.json as pa_json

from amprobe.store import schema
from amprobe.store.layout import RunLoadError, open_regular

__all__ = ["read_table", "empty_frame", "MAX_RECORD_BYTES", "READ_CHUNK_BYTES"]


def empty_frame(table: str) -> pd.DataFrame:
    columns = schema.TABLES.get(table, {})
    return pa.schema(list(columns.items())).empty_table().to_pandas() if columns else pd.DataFrame()


def _arrow_schema(table: str) -> pa.Schema | None:
    columns = schema.TABLES.get(table)
    return pa.schema(list(columns.items())) if columns else None


#: Longest record (one JSON line) the loader accepts; longer lines are skipped and counted, so
#: a damaged or hostile file cannot make a reader hold it in memory. amprobe's own records are
#: well under a kilobyte (a numerics row with long module names stays far below this).
MAX_RECORD_BYTES = 4 << 20
#: Bytes read per call: memory while reading a table stays near a few times this plus the
#: parsed rows. No larger than the record cap, so that a line longer than the cap, whatever its
#: length, costs no more memory than the cap (it is read and dropped one chunk at a time; the
#: 64 MiB this was before cost 200 MB of peak RSS for a single oversize line). Reading
#: amprobe's own files is no slower with it (arrow parses 4 MiB blocks as fast).
READ_CHUNK_BYTES = MAX_RECORD_BYTES
_BLOCK_BYTES = 16 << 20  # a block holds whole lines
# Arrow parses the blocks of one buffer in parallel threads, but a buffer handed to the parser
# here is at most two read chunks, one block: its thread pool only adds the hand-off (half the
# parse time of amprobe's small tables, 18 ms -> 8 ms for a sample run's seven). Ranks are
# parsed in parallel by Run.table instead.


@dataclasses.dataclass
class _TableRead:
    """What one pass over a table file found."""

    table: pa.Table | None
    next_offset: int
    dropped: int = 0  # lines that are not a JSON object
    oversize: int = 0  # lines longer than MAX_RECORD_BYTES (skipped unparsed)
    nulled: int = 0  # values of the wrong type for their column, read as null
    tail: int = 0  # bytes of an unterminated last line (left for the next read)


def read_table(path: Path, table: str, offset: int = 0) -> tuple[pd.DataFrame, int, int]:
    """Read the complete records of a JSON Lines table from byte ``offset``.

    Returns ``(frame, next_offset, dropped)``: an unterminated last line (a record still being
    written, or cut by a crash) is left for the next read; lines that do not parse, or are
    longer than :data:`MAX_RECORD_BYTES`, are dropped and counted. Memory stays bounded: the
    file is read in chunks, an oversize line is skipped without being held, and an unterminated
    oversize tail is not read again (``next_offset`` moves past it). A missing file reads as an
    empty frame.

    Raises:
        RunLoadError: the path is not a regular file (a FIFO, a device) or cannot be read.
    """
    read = _read_arrow(path, table, offset)
    dropped = read.dropped + read.oversize
    if read.table is None:
        return empty_frame(table), read.next_offset, dropped
    return read.table.to_pandas(), read.next_offset, dropped


def _read_arrow(path: Path, table: str, offset: int = 0) -> _TableRead:
    """:func:`read_table` as an arrow table with every schema column (None: nothing to read)."""
    try:
        fh = open_regular(path)
    except FileNotFoundError:
        return _TableRead(None, offset)
    except OSError as exc:
        raise RunLoadError(f"cannot read {path}: {exc.strerror or exc}") from None
    arrow_schema = _arrow_schema(table)
    result = _TableRead(None, offset)
    parts: list[pa.Table] = []
    with fh:
        # resuming inside a line means the line was an oversize record already counted
        skipping = False
        if offset > 0:
            fh.seek(offset - 1)
            skipping = fh.read(1) != b"\n"
        pos = offset  # file offset of pending[0]
        pending = b""
        while True:
            chunk = fh.read(READ_CHUNK_BYTES)
            if not chunk:
                break
            if skipping:
                nl = chunk.find(b"\n")
                if nl < 0:
                    pos += len(chunk)
                    continue
                pos += nl + 1
                chunk = chunk[nl + 1 :]
                skipping = False
            data = pending + chunk if pending else chunk
            del chunk  # hold one copy of the chunk, not two
            last = data.rfind(b"\n")
            if last >= 0:
                _parse_block(data[: last + 1], arrow_schema, parts, result)
                pos += last + 1
            if len(data) - (last + 1) > MAX_RECORD_BYTES:  # dropped without copying it
                result.oversize += 1
                pos += len(data) - (last + 1)
                pending = b""
                skipping = True
            else:
                pending = data[last + 1 :] if last >= 0 else data
            del data
        result.tail = len(pending)
        result.next_offset = pos
    if parts:
        result.table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    elif result.next_offset > offset or result.dropped or result.oversize:
        result.table = arrow_schema.empty_table() if arrow_schema is not None else pa.table({})
    return result


def _parse_block(
    data: bytes, arrow_schema: pa.Schema | None, parts: list[pa.Table], result: _TableRead
) -> None:
    """Parse whole lines ``data`` into ``parts``; oversize and damaged lines are counted."""
    ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
    lengths = np.diff(ends, prepend=-1)
    if len(lengths) and int(lengths.max()) > MAX_RECORD_BYTES + 1:
        keep = lengths <= MAX_RECORD_BYTES + 1
        result.oversize += int((~keep).sum())
        starts = ends - lengths + 1
        data = b"".join(
            data[int(a) : int(b) + 1] for a, b, k in zip(starts, ends, keep, strict=True) if k
        )
        if not data:
            return
    try:
        data.decode("utf-8")  # arrow's reader lets invalid UTF-8 into strings: drop such lines
        options = (
            pa_json.ParseOptions(explicit_schema=arrow_schema, unexpected_field_behavior="ignore")
            if arrow_schema is not None
            else pa_json.ParseOptions()
        )
        parsed = pa_json.read_json(
            io.BytesIO(data),
            parse_options=options,
            read_options=pa_json.ReadOptions(block_size=_BLOCK_BYTES, use_threads=False),
        )
    except (
        pa.ArrowInvalid,
        pa.ArrowTypeError,
        pa.ArrowNotImplementedError,
        OverflowError,
        UnicodeDecodeError,
    ):
        parsed = _read_lines_slowly(data, arrow_schema, result)
    if arrow_schema is not None:
        for field in arrow_schema:
            if field.name not in parsed.column_names:
                parsed = parsed.append_column(field, pa.nulls(parsed.num_rows, type=field.type))
        parsed = parsed.select(arrow_schema.names)
    if parsed.num_rows:
        parts.append(parsed)


def _read_rank_table(path: Path, table: str) -> _TableRead | RunLoadError:
    """One rank's table; a file that cannot be read is returned as its error (not raised)."""
    try:
        return _read_arrow(path, table)
    except RunLoadError as exc:
        return exc


def _to_frame(tables: list[pa.Table], name: str) -> pd.DataFrame:
    """One pandas frame from the ranks' arrow tables (converted once, not per rank)."""
    if not tables:
        result = empty_frame(name)
        result.insert(0, "rank", pd.Series([], dtype="int64"))
        return result
    try:
        return pa.concat_tables(tables, promote_options="permissive").to_pandas()
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        # tables without a schema whose inferred types differ between ranks
        return pd.concat([t.to_pandas() for t in tables], ignore_index=True)


def _fits(value: Any, arrow_type: pa.DataType) -> bool:
    """Whether a JSON value belongs in a column of ``arrow_type`` as the fast parser would read
    it (arrow's own conversion truncates ``1.5`` to an integer ``1``, and reads ``true`` as 1.0)."""
    if isinstance(value, bool) and not pa.types.is_boolean(arrow_type):
        return False
    if pa.types.is_integer(arrow_type) and not isinstance(value, int):
        return False
    try:
        pa.array([value], type=arrow_type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        return False
    return True


def _read_lines_slowly(data: bytes, arrow_schema: pa.Schema | None, result: _TableRead) -> pa.Table:
    """Line-by-line fallback that keeps every parseable record of a damaged file."""
    rows: list[dict[str, Any]] = []
    dropped = 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, UnicodeDecodeError, RecursionError):
            dropped += 1
            continue
        if not isinstance(row, dict):
            dropped += 1
            continue
        if arrow_schema is not None:
            clean: dict[str, Any] = {}
            for field in arrow_schema:
                value = row.get(field.name)
                if value is not None and not _fits(value, field.type):
                    value = None
                    result.nulled += 1
                clean[field.name] = value
            row = clean
        rows.append(row)
    result.dropped += dropped
    if arrow_schema is not None:
        return pa.Table.from_pylist(rows, schema=arrow_schema)
    return pa.Table.from_pylist(rows)
