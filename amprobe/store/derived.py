"""The derived columnar store: a run's tables as Parquet files, queried with DuckDB (issue #33).

JSON Lines stay the crash-safe write format; this module derives from them one Parquet file per
table (``steps.parquet``, ``numerics.parquet``, ...) plus ``summaries.parquet`` (one row per
rank), and rebuilds them when they are missing or stale. See docs/derived.md for the schema and
docs/design/read-side.md for why.

- **Layout.** One file per table, compacted across ranks, sorted by ``(rank, step)``, with one
  row group per rank (ranks with fewer than :data:`BLOCK_ROWS` rows share a row group with the
  next ranks), so a query for some ranks skips the others' row groups by their statistics.
  Every row carries the job columns ``run_id``, ``job_name``, ``start_time``, ``world_size``
  and the ``rank``.
- **Where.** ``RUN/derived/``; when the run folder cannot be written, the user cache
  ``$XDG_CACHE_HOME/amprobe/derived/<key>`` (``~/.cache`` by default), the key a hash of the
  run's resolved path and its run manifest's ``created_unix``.
- **Writes.** Every file is written under a temporary name in the same folder, all of them
  before any is moved into place with ``os.replace``; ``manifest.json`` is moved last. A
  failure while building leaves the old store as it was (or none).
- **Stale** when the manifest is missing or unreadable, of another :data:`DERIVED_VERSION`, or
  when a source file (the run manifest, the rank manifests and end markers, every ``*.jsonl``
  of a rank) changed size or mtime, appeared or disappeared. A stale store is rebuilt, but
  not from scratch: a rank file that only grew since the last build (a live run's appends) is
  parsed from the offset that build stopped at (recorded in the manifest with the bytes before
  it, which an append keeps and a file written anew does not), and its
  earlier rows are copied from the earlier Parquet file; a table none of whose files changed
  keeps its Parquet file. No delta files: a table that grew is rewritten whole (cheap next to
  parsing JSON).
- **Results.** ``results/steps-<inode>-<size>-<mtime>-<amprobe version>-<RESULTS_VERSION>/``
  keeps what the figures of many ranks computed from ``steps.parquet`` (rank x bin matrices,
  small frames: ``amprobe.analysis.rankbands.ResultStore``), so that the next report reads
  them instead of the rows; named after the file they came from, so a rebuilt store is never
  read from an earlier one's results (those folders are removed when a new one is named).

This module (and with it ``duckdb``, 0.13 s to import) is loaded only when a relation is asked
for (:meth:`Run.relation` reaches it through the store package's lazy attributes): loading a
run and the rules that read frames never import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import stat
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from amprobe.store import schema
from amprobe.store.artifacts import code_fingerprint, is_source
from amprobe.store.jsonl import _read_arrow, _read_rank_table, _TableRead
from amprobe.store.layout import (
    RunLoadError,
    open_regular,
    read_json_file,
    table_filename,
)
from amprobe.store.places import DERIVED_DIR, cache_dir, cache_key
from amprobe.store.places import writable as _writable
from amprobe.version import __version__

if TYPE_CHECKING:
    from amprobe.store.run import RankInfo, Run

#: Called with each rank's read of a table file (the loader turns it into warnings)
OnRead = Callable[["RankInfo", str, "_TableRead | RunLoadError"], None]

__all__ = [
    "DERIVED_VERSION",
    "DERIVED_DIR",
    "DERIVED_FORMAT",
    "SUMMARIES",
    "JOB_COLUMNS",
    "BLOCK_ROWS",
    "Store",
    "ensure",
    "build",
    "is_fresh",
    "source_files",
    "cache_dir",
    "run_id_of",
    "connect",
    "relation",
    "results_dir",
    "relations",
    "RESULTS_DIR",
]

#: Version of the derived files' layout and columns; a store of another version is rebuilt.
DERIVED_VERSION = 1
#: The ``format`` of ``derived/manifest.json``: not the run's marker, so that a derived folder
#: is never taken for a run.
DERIVED_FORMAT = "amprobe-derived"
MANIFEST = "manifest.json"
#: the derived manifest lists every source file (a few hundred bytes per rank)
_MANIFEST_MAX_BYTES = 256 << 20
#: The per-rank table of summaries (``summaries.parquet``), next to the record tables.
SUMMARIES = "summaries"
#: Ranks with fewer rows than this share a row group with the ranks after them (a table of a
#: few rows per rank, such as ``compute_steps``, is one row group per block of ranks).
BLOCK_ROWS = 8192
#: DuckDB's memory limit for amprobe's connection (``AMPROBE_DUCKDB_MEMORY`` overrides it);
#: past it DuckDB spills to its temporary directory in the user cache.
MEMORY_LIMIT = "1GB"
_COMPRESSION = "zstd"

#: The job-level columns on every row of every derived file, first, in this order.
JOB_COLUMNS: dict[str, pa.DataType] = {
    "run_id": pa.string(),
    "job_name": pa.string(),
    "start_time": pa.timestamp("us", tz="UTC"),
    "world_size": pa.int64(),
}
#: The columns of ``summaries.parquet`` after the job columns.
SUMMARY_COLUMNS: dict[str, pa.DataType] = {
    "rank": pa.int64(),
    "steps": pa.int64(),  # distinct recorded steps (the rows of steps.parquet for the rank)
    "skipped_steps": pa.int64(),  # steps whose ``skipped`` is true (optimizer step skipped)
    "first_step": pa.int64(),
    "last_step": pa.int64(),
    "summary": pa.string(),  # the rank's summary (Run.summaries()) as a JSON object
}


# -- where (amprobe.store.places: shared with the loader's small caches) ---------------------
def _cache_key(run: Run) -> str:
    return cache_key(run.path, run.manifest)


# -- sources and freshness -------------------------------------------------------------------
def source_files(run: Run) -> dict[str, tuple[int, int]]:
    """The files the derived store is built from, relative to the run: ``(size, mtime_ns)``:
    the run manifest and, per rank, its manifest, end marker, tables and summary record (the
    ``summaries`` table holds the record's sections: a record written again, by a live
    writer or ``write_rank_summary``, makes the store stale; its tables are kept when their
    files did not change)."""
    out: dict[str, tuple[int, int]] = {}

    def add(path: Path, name: str) -> None:
        try:
            st = path.stat()
        except OSError:
            return
        out[name] = (st.st_size, st.st_mtime_ns)

    add(run.path / schema.RUN_MANIFEST, schema.RUN_MANIFEST)
    for info in run.ranks:
        folder = info.path.name
        try:
            names = sorted(os.listdir(info.path))
        except OSError:
            continue
        for name in names:
            if is_source(f"{folder}/{name}"):  # the files the run's readers read
                add(info.path / name, f"{folder}/{name}")
    return out


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    """The derived manifest, or None when missing or unreadable (never blocks on a FIFO)."""
    try:
        return read_json_file(folder / MANIFEST, max_bytes=_MANIFEST_MAX_BYTES)
    except (OSError, ValueError):
        return None


def is_fresh(folder: Path, sources: dict[str, tuple[int, int]]) -> bool:
    """Whether ``folder`` holds a store of this version built from exactly ``sources``."""
    return _fresh_manifest(folder, sources) is not None


#: folder -> (its manifest file's identity, the manifest's sources and tables) of the last
#: fresh manifest read in this process: a manifest is replaced by rename, never rewritten in
#: place, so a file of the same inode, size and times is the same manifest
_FRESH: dict[str, tuple[tuple[int, ...], dict[str, tuple[int, int]], dict[str, Any]]] = {}


def _fresh_manifest(folder: Path, sources: dict[str, tuple[int, int]]) -> dict[str, Any] | None:
    """:func:`is_fresh`'s manifest when fresh, else None. Parsed once per manifest file in a
    process (:data:`_FRESH`: at 4,096 ranks the manifest is 4.4 MB of JSON, 0.4 to 1 s to
    parse, and every ``Run.relation`` call checked it); only ``tables`` is returned from the
    memo."""
    try:
        info = (folder / MANIFEST).stat()
        ident = (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns, DERIVED_VERSION)
    except OSError:
        return None
    memo = _FRESH.get(str(folder))
    if memo is not None and memo[0] == ident and memo[1] == sources:
        files = [(folder / str(entry["file"]), entry.get("bytes")) for entry in memo[2].values()]
        if all(_file_of_size(path, size) for path, size in files):
            return {"tables": memo[2]}
    manifest = _checked_manifest(folder, sources)
    if manifest is not None:
        _FRESH[str(folder)] = (ident, sources, dict(manifest.get("tables") or {}))
    return manifest


def _checked_manifest(folder: Path, sources: dict[str, tuple[int, int]]) -> dict[str, Any] | None:
    manifest = _read_manifest(folder)
    if manifest is None or manifest.get("format") != DERIVED_FORMAT:
        return None
    if manifest.get("derived_version") != DERIVED_VERSION:
        return None
    try:
        built = {k: tuple(v) for k, v in manifest["sources"].items()}
        files = [
            (folder / str(entry["file"]), entry.get("bytes"))
            for entry in manifest["tables"].values()
        ]
    except (KeyError, TypeError, AttributeError):  # a damaged manifest
        return None
    fresh = built == sources and all(_file_of_size(path, size) for path, size in files)
    return manifest if fresh else None


def _file_of_size(path: Path, size: Any) -> bool:
    """``path`` is a regular file of ``size`` bytes (any size when the manifest has none)."""
    try:
        st = path.stat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and (not isinstance(size, int) or st.st_size == size)


# -- job columns -----------------------------------------------------------------------------
def run_id_of(run: Run) -> str:
    """The run's id: the run manifest's ``run_id`` when it has one (amprobe writes none yet),
    else the first 16 hex digits of the SHA-256 of the run manifest's canonical JSON (sorted
    keys): written once when the run starts (creation time to the microsecond, host, argv,
    versions), so the id is the same for every copy of the run, wherever it is moved. A run
    without a readable manifest hashes its lowest rank's manifest instead."""
    given = run.manifest.get("run_id")
    if isinstance(given, str) and given:
        return given
    basis = run.manifest or run.rank_manifest
    text = json.dumps(basis, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _job_values(run: Run) -> dict[str, Any]:
    """The job-level values: run id, job name (the manifest's ``job_name`` when present, else
    the run folder's name), start time (the run manifest's ``created_unix``, else the earliest
    rank ``start_unix``) and world size (the manifest's, else the highest rank + 1)."""
    name = run.manifest.get("job_name")
    start = run.manifest.get("created_unix")
    if not isinstance(start, (int, float)) or isinstance(start, bool):
        starts: list[float] = [
            float(info.manifest["start_unix"])
            for info in run.ranks
            if isinstance(info.manifest.get("start_unix"), (int, float))
        ]
        start = min(starts) if starts else None
    world = run.manifest.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world <= 0:
        world = max(info.rank for info in run.ranks) + 1 if run.ranks else None
    return {
        "run_id": run_id_of(run),
        "job_name": name if isinstance(name, str) and name else run.path.resolve().name,
        "start_time": int(round(start * 1e6)) if start is not None else None,
        "world_size": world,
    }


def _job_arrays(job: dict[str, Any], n: int) -> list[pa.Array]:
    out = []
    for name, kind in JOB_COLUMNS.items():
        value = job[name]
        if value is None:
            out.append(pa.nulls(n, type=kind))
        elif name == "start_time":
            out.append(pa.array(np.full(n, value, dtype=np.int64)).cast(kind))
        elif kind == pa.int64():
            out.append(pa.array(np.full(n, value, dtype=np.int64)))
        else:  # dictionary-encoded in the file: a few bytes per row group
            out.append(pa.repeat(pa.scalar(value, type=kind), n))
    return out


def _file_schema(table: str) -> pa.Schema:
    fields = [pa.field(k, v) for k, v in JOB_COLUMNS.items()] + [pa.field("rank", pa.int64())]
    return pa.schema(fields + [pa.field(k, v) for k, v in schema.TABLES[table].items()])


def _summaries_schema() -> pa.Schema:
    return pa.schema(
        [pa.field(k, v) for k, v in JOB_COLUMNS.items()]
        + [pa.field(k, v) for k, v in SUMMARY_COLUMNS.items()]
    )


# -- building --------------------------------------------------------------------------------
@dataclasses.dataclass
class _RankStats:
    steps: int = 0
    skipped: int = 0
    first: int | None = None
    last: int | None = None


def _unique_steps(part: pa.Table) -> pa.Table:
    """A rank's steps as :meth:`Run.table` keeps them: rows without a step dropped, the first
    of each repeated ``(window, step)`` kept."""
    if part.column("step").null_count:
        part = part.filter(pc.is_valid(part.column("step")))
    keys = [k for k in ("window", "step") if k in part.column_names]
    n = part.num_rows
    if n < 2:
        return part
    indexed = part.select(keys).append_column("__i", pa.array(np.arange(n, dtype=np.int64)))
    first = indexed.group_by(keys, use_threads=False).aggregate([("__i", "min")])["__i_min"]
    if len(first) == n:
        return part
    return part.take(pa.array(np.sort(first.to_numpy()), type=pa.int64()))


def _sorted_by_step(part: pa.Table) -> pa.Table:
    steps = part.column("step")
    if part.num_rows < 2:
        return part
    values = steps.to_numpy(zero_copy_only=False)
    if steps.null_count == 0 and bool(np.all(values[1:] >= values[:-1])):
        return part
    # a stable sort: rows of one step stay in recording order; rows without a step go last
    return part.take(pc.sort_indices(part, sort_keys=[("step", "ascending")]))


_FINGERPRINT_BYTES = 256


def _fingerprint(path: Path, offset: int) -> str:
    """A hash of the bytes just before ``offset`` in ``path``: an append keeps them, a file
    written anew in its place (``overwrite``) almost surely does not."""
    if offset <= 0:
        return ""
    try:
        with open_regular(path) as fh:
            fh.seek(max(0, offset - _FINGERPRINT_BYTES))
            data = fh.read(min(offset, _FINGERPRINT_BYTES))
    except OSError:
        return "unreadable"
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _read_from(path: Path, table: str, offset: int) -> _TableRead | RunLoadError:
    """One rank's file of ``table`` from byte ``offset`` (0: the whole file)."""
    if offset == 0:
        return _read_rank_table(path, table)
    try:
        return _read_arrow(path, table, offset)
    except RunLoadError as exc:
        return exc


def _read_ranks(
    jobs: list[tuple[int, Path, int]], table: str
) -> Iterator[tuple[int, _TableRead | RunLoadError]]:
    """Each ``(rank, path, offset)``'s read of ``table``, in order, a few ranks ahead in
    parallel threads (the JSON parser releases the GIL), never more than a window of ranks in
    memory."""
    workers = max(1, min(len(jobs), _cores(), 16))
    if workers == 1:
        for rank, path, offset in jobs:
            yield rank, _read_from(path, table, offset)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque[tuple[int, Future[_TableRead | RunLoadError]]] = deque()
        todo = iter(jobs)
        for rank, path, offset in todo:
            pending.append((rank, pool.submit(_read_from, path, table, offset)))
            if len(pending) >= 2 * workers:
                break
        while pending:
            rank, future = pending.popleft()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append((nxt[0], pool.submit(_read_from, nxt[1], table, nxt[2])))
            yield rank, future.result()


class _OldRows:
    """The rows of an earlier build's file of a table, rank by rank (ranks asked in order):
    row groups are found by their ``rank`` statistics and the last one read is kept."""

    def __init__(self, path: Path) -> None:
        self.file = pq.ParquetFile(path)
        meta = self.file.metadata
        index = meta.schema.to_arrow_schema().get_field_index("rank")
        self.groups: list[tuple[int, int]] = []
        for i in range(meta.num_row_groups):
            stats = meta.row_group(i).column(index).statistics
            if stats is None or not stats.has_min_max:
                raise ValueError(f"{path}: row group {i} has no rank statistics")
            self.groups.append((int(stats.min), int(stats.max)))
        self._last: tuple[int, pa.Table] | None = None

    def rows_of(self, rank: int) -> pa.Table:
        parts = []
        for i, (lo, hi) in enumerate(self.groups):
            if lo <= rank <= hi:
                if self._last is None or self._last[0] != i:
                    self._last = (i, self.file.read_row_group(i))
                group = self._last[1]
                parts.append(group.filter(pc.equal(group.column("rank"), rank)))
        if not parts:
            return self.file.schema_arrow.empty_table()
        return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


def _write_table(
    run: Run,
    table: str,
    job: dict[str, Any],
    out: Path,
    stats: dict[int, _RankStats],
    previous: _Previous | None,
    parsed: dict[str, tuple[int, str]],
    on_read: OnRead | None,
) -> dict[str, Any]:
    """Write ``table`` of every rank to ``out``; fill ``stats`` from the steps table and
    ``parsed`` with how far each rank file was parsed.

    With ``previous`` (an earlier build of the same job and version), a rank whose file only
    grew since is not parsed again: its earlier rows are taken from the earlier file and only
    the bytes appended since are parsed."""
    file_schema = _file_schema(table)
    infos = {info.rank: info for info in run.ranks}
    old = previous.rows(table) if previous is not None else None
    jobs: list[tuple[int, Path, int]] = []
    for info in run.ranks:
        path = info.path / table_filename(table)
        name = f"{info.path.name}/{table_filename(table)}"
        offset = previous.offset(name, path) if previous is not None and old is not None else 0
        jobs.append((info.rank, path, offset))
    rows = groups = appended = 0
    block: list[pa.Table] = []
    with pq.ParquetWriter(out, file_schema, compression=_COMPRESSION) as writer:

        def flush() -> None:
            nonlocal groups
            if block:
                group = pa.concat_tables(block) if len(block) > 1 else block[0]
                writer.write_table(group, row_group_size=max(group.num_rows, 1))
                groups += 1
                block.clear()

        for (rank, read), (_, path, offset) in zip(_read_ranks(jobs, table), jobs, strict=True):
            if on_read is not None:
                on_read(infos[rank], table_filename(table), read)
            if isinstance(read, _TableRead):
                name = f"{infos[rank].path.name}/{table_filename(table)}"
                parsed[name] = (read.next_offset, _fingerprint(path, read.next_offset))
            part = read.table if isinstance(read, _TableRead) else None
            if offset and old is not None and isinstance(read, _TableRead):
                appended += 1
                earlier = old.rows_of(rank).drop_columns([*JOB_COLUMNS, "rank"])
                part = pa.concat_tables([earlier, part]) if part is not None else earlier
            if part is None or not part.num_rows:
                continue
            if table == "steps":
                part = _unique_steps(part)
                skipped = part.column("skipped")
                steps = part.column("step")
                stats[rank] = _RankStats(
                    steps=part.num_rows,
                    skipped=int(pc.sum(pc.fill_null(skipped, False)).as_py() or 0),
                    first=pc.min(steps).as_py(),
                    last=pc.max(steps).as_py(),
                )
            part = _sorted_by_step(part)
            n = part.num_rows
            columns = _job_arrays(job, n) + [pa.array(np.full(n, rank, dtype=np.int64))]
            part = pa.Table.from_arrays(columns + part.columns, schema=file_schema)
            if part.num_rows >= BLOCK_ROWS:
                flush()
                block.append(part)
                flush()
            else:
                block.append(part)
                if sum(t.num_rows for t in block) >= BLOCK_ROWS:
                    flush()
            rows += n
        flush()
    return {"rows": rows, "row_groups": groups, "ranks_appended": appended}


class _Previous:
    """An earlier build in the folder being rebuilt, usable for an incremental rebuild: the
    same derived version and job values, and its record of how far each file was parsed."""

    def __init__(self, folder: Path, manifest: dict[str, Any]) -> None:
        self.folder = folder
        self.tables = manifest.get("tables") or {}
        self.parsed: dict[str, Any] = manifest.get("parsed") or {}
        self.sources: dict[str, Any] = manifest.get("sources") or {}

    @classmethod
    def of(cls, folder: Path, job: dict[str, Any]) -> _Previous | None:
        manifest = _read_manifest(folder)
        if (
            manifest is None
            or manifest.get("format") != DERIVED_FORMAT
            or manifest.get("derived_version") != DERIVED_VERSION
            or manifest.get("job") != job
            or not isinstance(manifest.get("parsed"), dict)
            or not isinstance(manifest.get("tables"), dict)
        ):
            return None
        return cls(folder, manifest)

    def unchanged(
        self, table: str, run: Run, sources: dict[str, tuple[int, int]]
    ) -> dict[str, tuple[int, str]] | None:
        """How far the files of ``table`` were parsed, when no rank's file of it changed since
        this build (the same files, each as long as parsed and still holding those bytes), so
        its Parquet file is kept as it is; else None."""
        entry = self.tables.get(table)
        if not isinstance(entry, dict) or not _file_of_size(
            self.folder / str(entry.get("file")), entry.get("bytes")
        ):
            return None  # gone, or not the file that was written (a crash left it short)
        suffix = "/" + table_filename(table)
        now = {n: run.path / n for n in sources if n.endswith(suffix)}
        before = {n for n in self.parsed if n.endswith(suffix) and n in self.sources}
        if set(now) != before:
            return None
        kept: dict[str, tuple[int, str]] = {}
        for name, path in now.items():
            got = self.parsed[name]
            if not isinstance(got, list) or len(got) != 2 or got[0] != sources[name][0]:
                return None
            if got[0] and self.offset(name, path) != got[0]:
                return None
            kept[name] = (got[0], str(got[1]))
        return kept

    def steps_stats(self, stats: dict[int, _RankStats]) -> bool:
        """Fill ``stats`` from this build's summaries (for a steps table kept as it is)."""
        entry = self.tables.get(SUMMARIES)
        if not isinstance(entry, dict):
            return False
        columns = ["rank", "steps", "skipped_steps", "first_step", "last_step"]
        try:
            rows = pq.read_table(self.folder / str(entry.get("file")), columns=columns)
        except (OSError, pa.ArrowException):
            return False
        for rank, steps, skipped, first, last in zip(
            *(rows.column(c).to_pylist() for c in columns), strict=True
        ):
            if steps:
                stats[rank] = _RankStats(steps=steps, skipped=skipped, first=first, last=last)
        return True

    def rows(self, table: str) -> _OldRows | None:
        entry = self.tables.get(table)
        if not isinstance(entry, dict):
            return None
        try:
            return _OldRows(self.folder / str(entry.get("file")))
        except (OSError, ValueError, pa.ArrowException):
            return None

    def offset(self, name: str, path: Path) -> int:
        """Where to resume reading ``path``: the offset parsed before when the file still
        holds those bytes (it only grew), else 0 (parse it whole)."""
        got = self.parsed.get(name)
        if not isinstance(got, list) or len(got) != 2 or not isinstance(got[0], int):
            return 0
        offset, fingerprint = got
        try:
            if path.stat().st_size < offset:
                return 0
        except OSError:
            return 0
        return offset if offset > 0 and _fingerprint(path, offset) == fingerprint else 0


def _json_safe(value: Any) -> Any:
    """``value`` as standard JSON (which Spark, Dask and DuckDB's JSON functions read): a
    non-finite float (an infinite amax, a NaN loss) as the string ``"Infinity"``,
    ``"-Infinity"`` or ``"NaN"``, not as null, which would read as "not recorded"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _write_summaries(
    run: Run, job: dict[str, Any], out: Path, stats: dict[int, _RankStats]
) -> dict[str, Any]:
    # the summaries of the files as they are now, read on a copy of the run: the run's own
    # facts stay those every reader of it has seen (a report or a diagnosis under way must
    # not change under its feet), only what it read before is reused
    fresh = dataclasses.replace(
        run, warnings=[], _tables={}, _events_cache={}, _event_rows={},
        _derived={k: v for k, v in run._derived.items() if k == "summary_parts"},
    )  # fmt: skip
    summaries = fresh.summaries(refresh=True)
    ranks = [info.rank for info in run.ranks]
    n = len(ranks)
    got = [stats.get(r, _RankStats()) for r in ranks]
    columns = _job_arrays(job, n) + [
        pa.array(ranks, type=pa.int64()),
        pa.array([s.steps for s in got], type=pa.int64()),
        pa.array([s.skipped for s in got], type=pa.int64()),
        pa.array([s.first for s in got], type=pa.int64()),
        pa.array([s.last for s in got], type=pa.int64()),
        pa.array(
            [json.dumps(_json_safe(summaries.get(r, {})), sort_keys=True) for r in ranks],
            type=pa.string(),
        ),
    ]
    table = pa.Table.from_arrays(columns, schema=_summaries_schema())
    # one row per rank: row groups of BLOCK_ROWS ranks
    pq.write_table(table, out, row_group_size=BLOCK_ROWS, compression=_COMPRESSION)
    return {"rows": n, "row_groups": max(1, math.ceil(n / BLOCK_ROWS)) if n else 0}


def _tables_present(run: Run, sources: dict[str, tuple[int, int]]) -> list[str]:
    """The tables of :data:`schema.TABLES` that at least one rank has a file of."""
    names = {name.rsplit("/", 1)[-1] for name in sources}
    return [t for t in schema.TABLES if table_filename(t) in names]


def build(
    run: Run,
    folder: Path,
    sources: dict[str, tuple[int, int]] | None = None,
    incremental: bool = True,
    on_read: OnRead | None = None,
) -> Path:
    """Build the derived store of ``run`` in ``folder`` (created if missing), replacing what is
    there only once every file is written. Returns ``folder``.

    With ``incremental``, an earlier build in ``folder`` of the same job and version is reused:
    a rank file that only grew since is parsed from where that build stopped, its earlier rows
    read from the earlier Parquet file (a live run's refresh parses only what was appended).

    Raises:
        OSError: the folder or a file cannot be written (nothing of the old store is replaced).
    """
    if sources is None:
        sources = source_files(run)
    folder.mkdir(parents=True, exist_ok=True)
    job = _job_values(run)
    job_entry = {**job, "start_unix": run.manifest.get("created_unix")}
    previous = _Previous.of(folder, job_entry) if incremental else None
    parsed: dict[str, tuple[int, str]] = {}
    tag = f".{os.getpid()}.{time.monotonic_ns()}.tmp"
    written: dict[str, Path] = {}
    entries: dict[str, dict[str, Any]] = {}
    try:
        stats: dict[int, _RankStats] = {}
        for table in _tables_present(run, sources):
            if previous is not None:
                # no rank file of the table changed: its Parquet file is kept as it is
                kept = previous.unchanged(table, run, sources)
                if kept is not None and (table != "steps" or previous.steps_stats(stats)):
                    entries[table] = {**previous.tables[table], "kept": True}
                    parsed.update(kept)
                    continue
            tmp = folder / f".{table}.parquet{tag}"
            written[table] = tmp
            entries[table] = {
                "file": f"{table}.parquet",
                **_write_table(run, table, job, tmp, stats, previous, parsed, on_read),
            }
        tmp = folder / f".{SUMMARIES}.parquet{tag}"
        written[SUMMARIES] = tmp
        entries[SUMMARIES] = {
            "file": f"{SUMMARIES}.parquet",
            **_write_summaries(run, job, tmp, stats),
        }
        # each file on disk before the manifest names it, with its size, so that a file a
        # machine crash left short reads as stale (rebuilt), not as a store that cannot be read
        for name, tmp in written.items():
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            entries[name]["bytes"] = tmp.stat().st_size
        manifest = {
            "format": DERIVED_FORMAT,
            "derived_version": DERIVED_VERSION,
            "amprobe_version": __version__,
            "run": str(run.path.resolve()),
            "built_unix": time.time(),
            "job": job_entry,
            "tables": entries,
            # per rank file: the offset parsed up to and the bytes before it (an append since
            # is parsed from there at the next build)
            "parsed": {k: list(v) for k, v in sorted(parsed.items())},
            "sources": {k: list(v) for k, v in sorted(sources.items())},
        }
        tmp_manifest = folder / f".{MANIFEST}{tag}"
        written[MANIFEST] = tmp_manifest
        with open(tmp_manifest, "w", encoding="utf-8") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        # every file is written: move them into place, the manifest last
        for name, tmp in written.items():
            if name != MANIFEST:
                os.replace(tmp, folder / entries[name]["file"])
        os.replace(tmp_manifest, folder / MANIFEST)
    finally:
        for tmp in written.values():
            with contextlib.suppress(OSError):
                tmp.unlink()
    return folder


@dataclasses.dataclass(frozen=True)
class Store:
    """A fresh derived store: its folder and the manifest's table entries."""

    folder: Path
    tables: dict[str, dict[str, Any]]

    def path(self, table: str) -> Path | None:
        entry = self.tables.get(table)
        return self.folder / entry["file"] if entry else None


def ensure(run: Run, on_read: OnRead | None = None) -> Store:
    """The run's derived store, built or rebuilt first when missing or stale.

    Raises:
        OSError: neither the run folder nor the user cache can be written.
    """
    sources = source_files(run)
    folder = run.path / DERIVED_DIR
    manifest = _fresh_manifest(folder, sources)
    if manifest is None:
        if not _writable(folder):
            folder = cache_dir() / DERIVED_DIR / _cache_key(run)
            manifest = _fresh_manifest(folder, sources)
        if manifest is None:
            build(run, folder, sources, on_read=on_read)
            manifest = _read_manifest(folder) or {}
    return Store(folder=folder, tables=dict(manifest.get("tables") or {}))


# -- the engine ------------------------------------------------------------------------------
def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def connect() -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with amprobe's settings: ``threads`` = the cores this
    process may use, ``memory_limit`` = :data:`MEMORY_LIMIT` (or ``AMPROBE_DUCKDB_MEMORY``),
    ``temp_directory`` (where it spills) in the user cache."""
    spill = cache_dir() / "duckdb-tmp"
    try:
        spill.mkdir(parents=True, exist_ok=True)
    except OSError:  # no writable home: the system's temporary folder
        spill = Path(tempfile.gettempdir()) / f"amprobe-duckdb-{os.getuid()}"
    con = duckdb.connect(
        ":memory:",
        config={
            "threads": _cores(),
            "memory_limit": os.environ.get("AMPROBE_DUCKDB_MEMORY") or MEMORY_LIMIT,
            "temp_directory": str(spill),
        },
    )
    # keep each Parquet file's footer between queries: a many-rank steps.parquet has one row
    # group per rank, and parsing its footer again cost 0.35 s a query at 1,024 ranks (a
    # report's figures run some twenty queries on it). Set after connecting: as a connect
    # option the parquet extension is not loaded yet to accept it.
    con.execute("SET parquet_metadata_cache = true")
    return con


#: The folder (in the derived store's) of results computed from its ``steps.parquet``
#: (``amprobe.analysis.rankbands.ResultStore``: a figure's rank x bin matrices, small frames)
RESULTS_DIR = "results"
#: Version of what is kept under :data:`RESULTS_DIR`; a folder of another version is not read
RESULTS_VERSION = 1


def relations(run: Run, tables: tuple[str, ...]) -> tuple[Store, dict[str, Any]]:
    """The run's derived store and a relation over each of ``tables`` (as
    ``Run.relation``, on the run's connection), after one freshness check: at 4,096 ranks a
    check stats 184,000 files and parses a 4.4 MB manifest (1 to 2 s), which a section that
    reads four tables paid four times."""
    con = run.cached("duckdb", lambda r: connect())
    store = ensure(run, getattr(run, "_read_warned", None))
    out = {}
    for table in tables:
        if table != SUMMARIES and table not in schema.TABLES:
            raise KeyError(f"no such table: {table!r}")
        path = store.path(table)
        out[table] = (
            con.from_arrow(_file_schema(table).empty_table())
            if path is None
            else con.read_parquet(str(path))
        )
    return store, out


def results_dir(store: Store, table: str = "steps") -> Path | None:
    """The folder for results computed from ``table``'s derived file in ``store`` (fresh:
    :func:`ensure`'s), named after that file's inode, size and modification time, this
    amprobe's version and code (:func:`~amprobe.store.artifacts.code_fingerprint`) and
    :data:`RESULTS_VERSION`: a rebuilt store (a file replaced) has a
    new folder, and the folders of earlier files are removed when a new one is named. None
    when the run has no such file.
    """
    path = store.path(table)
    if path is None:
        return None
    info = path.stat()
    code = code_fingerprint()[:16]  # the code that computed them (a development tree changes)
    name = (
        f"{table}-{info.st_ino}-{info.st_size}-{info.st_mtime_ns}-{__version__}-{code}-"
        f"{RESULTS_VERSION}"
    )
    base = store.folder / RESULTS_DIR
    with contextlib.suppress(OSError):
        for old in base.iterdir():
            if old.name.startswith(f"{table}-") and old.name != name and old.is_dir():
                for child in old.iterdir():
                    child.unlink()
                old.rmdir()
    return base / name


def relation(
    run: Run, table: str, con: duckdb.DuckDBPyConnection, on_read: OnRead | None = None
) -> duckdb.DuckDBPyRelation:
    """A lazy relation over ``table`` of the run's derived store (built or refreshed first);
    an empty relation with the table's columns when no rank recorded it.

    Raises:
        KeyError: ``table`` is neither a table of :data:`schema.TABLES` nor ``summaries``.
    """
    if table != SUMMARIES and table not in schema.TABLES:
        raise KeyError(f"no such table: {table!r} (known: {', '.join(schema.TABLES)}, summaries)")
    store = ensure(run, on_read)
    path = store.path(table)
    if path is None:
        return con.from_arrow(_file_schema(table).empty_table())
    return con.read_parquet(str(path))
