"""Load a run directory: :func:`load_run` and the :class:`Run` it returns, whose tables are
typed pandas frames read on first use (:mod:`amprobe.store.jsonl` parses the files).

:func:`load_run` is the public loading API: the rules, the reports, the CLI and the dashboard
read runs only through it (and :func:`amprobe.store.jsonl.read_table` for incremental reads).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import json
import os
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd
import pyarrow as pa

import amprobe.store
from amprobe.store import integrity, jsonl, schema
from amprobe.store import sections as _sections  # noqa: F401  (registers the sections)
from amprobe.store.jsonl import (
    _read_arrow,
    _read_rank_table,
    _TableRead,
    _to_frame,
)
from amprobe.store.layout import (
    BASELINE_LEGS,
    STATUS_ORDER,
    RunLoadError,
    file_kind,
    is_run_dir,
    list_ranks,
    open_regular,
    read_json_file,
    status_of,
    table_filename,
)
from amprobe.store.places import derived_folder
from amprobe.store.sections.tables import SMALL_TABLES, table_rows
from amprobe.store.summary import (
    SECTIONS,
    SUMMARY_FILE,
    SUMMARY_VERSION,
    Accumulator,
    encode_record,
    make_record,
    merge_sections,
    parse_record,
    summarize_tables,
    summary_tables,
    write_record,
)

__all__ = [
    "Run",
    "RankInfo",
    "RunLoadError",
    "NewerSchemaError",
    "load_run",
    "write_rank_summary",
    "rank_last_rows",
]


class NewerSchemaError(RunLoadError):
    """The run was written by a newer amprobe (a schema version this one cannot read)."""


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """One rank's part of a run."""

    rank: int
    path: Path
    manifest: dict[str, Any]
    end: dict[str, Any] | None
    status: str  # one of amprobe.store.layout.STATUS_ORDER


@dataclasses.dataclass
class Run:
    """A loaded run: manifests, per-rank status and one frame per table (with a ``rank`` column).

    Attributes:
        path: the run directory.
        manifest: the run-level manifest.
        ranks: one :class:`RankInfo` per rank that could be read.
        status: ``live`` while a rank's process is still running on this host, ``failed`` when
            a rank's program ended with an uncaught exception, ``interrupted`` when it was
            stopped (Ctrl-C, SIGTERM) or ended without closing, else ``finished``;
            :attr:`end_reason` says why, when recorded.
        warnings: problems met while loading (partial records dropped, unreadable ranks, ...).
    """

    path: Path
    manifest: dict[str, Any]
    ranks: list[RankInfo]
    status: str
    warnings: list[str]
    _tables: dict[str, pd.DataFrame] = dataclasses.field(default_factory=dict, repr=False)
    _events_cache: dict[str, list[dict[str, Any]]] = dataclasses.field(
        default_factory=dict, repr=False
    )
    #: the events' columns as lists and each kind's row positions, read once by events_of
    _event_rows: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    #: derived frames computed once per run by the rules (e.g. scaler steps); see ``cached``
    _derived: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def steps(self) -> pd.DataFrame:
        return self.table("steps")

    @property
    def events(self) -> pd.DataFrame:
        return self.table("events")

    @property
    def rank_manifest(self) -> dict[str, Any]:
        """The manifest of the lowest rank (device, dtype facts), or an empty dict."""
        return self.ranks[0].manifest if self.ranks else {}

    @property
    def name(self) -> str:
        return self.path.name

    def table(self, name: str) -> pd.DataFrame:
        """All ranks' rows of table ``name`` (empty frame with the schema's columns if absent).

        The ranks' files are parsed in parallel threads (the JSON parser releases the GIL) and
        converted to pandas once, so a run of hundreds of ranks loads in seconds.
        """
        if name not in self._tables:
            # the summaries' rows are many small long-lived containers: a collection set off
            # while reading them would traverse every one (seconds at 4,096 ranks)
            with gc_paused():
                self._tables[name] = self._read_table(name)
        return self._tables[name]

    def _read_table(self, name: str) -> pd.DataFrame:
        """:meth:`table` read: the ranks' rows from their summaries or files, as one frame."""
        held = self._summary_rows(name, self.ranks)
        todo = [info for info in self.ranks if info.rank not in held]
        paths = [info.path / table_filename(name) for info in todo]
        if len(paths) > 1:
            workers = min(len(paths), os.cpu_count() or 1, 16)
            with ThreadPoolExecutor(max_workers=workers) as pool:
                parts = list(pool.map(lambda p: _read_rank_table(p, name), paths))
        else:
            parts = [_read_rank_table(p, name) for p in paths]
        reads = dict(zip((info.rank for info in todo), parts, strict=True))
        tables = []
        rows: list[dict[str, Any]] = []  # consecutive ranks' rows from their summaries
        row_ranks: list[int] = []
        for info in self.ranks:
            if info.rank in held:
                got = held[info.rank]
                rows.extend(got)
                row_ranks.extend([info.rank] * len(got))
                continue
            if rows:
                tables.append(_rows_table(name, rows, row_ranks))
                rows, row_ranks = [], []
            read = reads[info.rank]
            self._warn(_read_warnings(info, table_filename(name), read))
            part = read.table if isinstance(read, _TableRead) else None
            if part is not None and part.num_rows:
                ranks = pa.array(np.full(part.num_rows, info.rank, dtype=np.int64))
                tables.append(part.add_column(0, "rank", ranks))
        if rows:
            tables.append(_rows_table(name, rows, row_ranks))
        frame = _to_frame(tables, name)
        if name == "steps":
            frame = self._unique_steps(frame)
        return frame

    def _summary_rows(
        self, name: str, infos: list[RankInfo], read: bool = True
    ) -> dict[int, list[dict[str, Any]]]:
        """Rank -> its rows of the small table ``name`` (:mod:`amprobe.store.sections.tables`)
        from its summary, for the ranks of ``infos`` whose summary holds every row of the table
        and covers the table's whole file (the file ends where the summary's rows end: a tail
        written after the record was summarized too, and went through the section); the other
        ranks are read from their files (with the loader's warnings).

        What this trusts is what every summary section trusts: a record holds the rows the
        writer wrote, in file order. A line damaged on disk after the record was written is
        not seen here (the loader would drop it and warn); a rank summarized from its files
        holds the rows the loader read, its warnings given when the summaries were read.
        Used for the four small tables only, once the summaries were read (``table`` reads
        them: ``diagnose`` reads them anyway; ``rank_table`` uses them only when read)."""
        if name not in SMALL_TABLES or not infos:
            return {}
        if "summary_parts" not in self._derived:
            if not read:
                return {}
            if not any(info.path.is_dir() for info in infos):
                return {}  # a run held in memory (tests' fake runs): no files, no records
            self.summaries()
        parts: dict[int, _RankSummary] = self._derived.get("summary_parts") or {}
        filename = table_filename(name)
        out: dict[int, list[dict[str, Any]]] = {}
        for info in infos:
            part = parts.get(info.rank)
            if part is None or part.ends is None or part.source == "unreadable":
                continue
            rows = table_rows(part.summary, name)
            if rows is None:
                continue
            try:
                size = os.stat(f"{info.path}/{filename}").st_size
            except FileNotFoundError:
                size = 0
            except OSError:
                continue
            if size == part.ends.get(filename, 0):
                out[info.rank] = rows
        return out

    def _warn(self, lines: str | list[str]) -> None:
        """Add loading warnings once each (a rank's file may be read alone, then with all)."""
        for line in [lines] if isinstance(lines, str) else lines:
            if line not in self.warnings:
                self.warnings.append(line)

    def _unique_steps(self, frame: pd.DataFrame) -> pd.DataFrame:
        """One row per (rank, window, step): a row without a valid step, or repeated (a retried
        write, a copied file), is dropped and counted in a warning."""
        if frame.empty or "step" not in frame.columns:
            return frame
        invalid = frame["step"].isna()
        if invalid.any():
            self._warn(
                f"steps: {int(invalid.sum())} record(s) without a valid integer step dropped"
            )
            frame = frame[~invalid]
        keys = [c for c in ("rank", "window", "step") if c in frame.columns]
        repeated = frame.duplicated(subset=keys, keep="first")
        if repeated.any():
            self._warn(
                f"steps: {int(repeated.sum())} repeated record(s) of the same (rank, window, "
                "step) dropped; the first of each was kept"
            )
            frame = frame[~repeated]
        if invalid.any() or repeated.any():
            frame = frame.reset_index(drop=True)
        return frame

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        """The events of one kind as dicts (``detail`` merged in), in recording order.

        Parsed once per kind and cached; every call returns fresh dicts.
        """
        if kind not in self._events_cache:
            ev = self.events
            out: list[dict[str, Any]] = []
            if not ev.empty:
                if not self._event_rows:
                    # one pass over the table for every kind asked for (a mask and a frame
                    # per kind cost a millisecond each, and the rules ask for a dozen)
                    columns = {c: ev[c].tolist() for c in ("rank", "step", "t", "detail")}
                    positions: dict[Any, list[int]] = {}
                    for i, k in enumerate(ev["kind"].tolist()):
                        positions.setdefault(k, []).append(i)
                    self._event_rows.update(columns=columns, positions=positions)
                columns = self._event_rows["columns"]
                rows = self._event_rows["positions"].get(kind, ())
                for rank, step, t, raw in (
                    (columns["rank"][i], columns["step"][i], columns["t"][i], columns["detail"][i])
                    for i in rows
                ):
                    try:
                        detail = json.loads(raw) if isinstance(raw, str) else {}
                    except ValueError:
                        detail = {}
                    if not isinstance(detail, dict):
                        detail = {}
                    out.append({"rank": rank, "step": step, "t": t, **detail})
            self._events_cache[kind] = out
        return [dict(e) for e in self._events_cache[kind]]

    def rank_table(self, name: str, rank: int) -> pd.DataFrame:
        """One rank's rows of table ``name`` (with a ``rank`` column), read from that rank's
        file alone and kept: the detail of the few ranks a finding names, without reading the
        others. The merged frame is used instead when :meth:`table` read it already."""
        if name in self._tables:
            frame = self._tables[name]
            return frame[frame["rank"] == rank] if len(frame) else frame
        key = f"rank_table:{name}:{rank}"
        if key not in self._derived:
            info = next((i for i in self.ranks if i.rank == rank), None)
            tables = []
            held = self._summary_rows(name, [info], read=False) if info is not None else {}
            if info is not None and rank in held:
                if held[rank]:
                    tables.append(_rows_table(name, held[rank], [rank] * len(held[rank])))
            elif info is not None:
                read = _read_rank_table(info.path / table_filename(name), name)
                self._warn(_read_warnings(info, table_filename(name), read))
                part = read.table if isinstance(read, _TableRead) else None
                if part is not None and part.num_rows:
                    ranks = pa.array(np.full(part.num_rows, rank, dtype=np.int64))
                    tables.append(part.add_column(0, "rank", ranks))
            frame = _to_frame(tables, name)
            if name == "steps":
                frame = self._unique_steps(frame)
            self._derived[key] = frame
        return self._derived[key]

    def summaries(self, refresh: bool = False) -> dict[int, dict[str, Any]]:
        """Each rank's summary (:mod:`amprobe.store.summary`): rank -> section name -> facts,
        computed once per run.

        A rank's record (``summary.json``, replaced by the writer at each flush) is read,
        its offsets are checked against the table files' sizes, and only the rows after them
        are summarized from the record files and merged in; a rank without a usable record
        is summarized from its files. A rank whose files cannot be read gets an empty summary
        (a missing section: no rows) and a warning. :meth:`summary_sources` says which way
        each rank went.
        """
        if refresh:  # the files grew (a live run): read what was appended, for every reader
            self._derived.pop("summaries", None)
            # and forget what was derived from the summaries before (a rule's cached facts)
            for key in [k for k in self._derived if k not in _KEPT_ON_REFRESH]:
                del self._derived[key]
        return self.cached("summaries", _summaries)

    def adopt_summaries(self, earlier: Run) -> None:
        """Take the per-rank summaries ``earlier`` (a load of the same run folder before this
        one) read, with where in each file they end, so that this run's :meth:`summaries`
        reads only the rows appended since (a live run loaded again, issue #33). A rank whose
        files no longer match (truncated, replaced) is read again as :meth:`summaries` says."""
        parts = earlier._derived.get("summary_parts")
        if parts and "summaries" not in self._derived:
            paths = {info.rank: info.path for info in earlier.ranks}
            self._derived["summary_parts"] = {
                info.rank: parts[info.rank]
                for info in self.ranks
                if info.rank in parts and paths.get(info.rank) == info.path
            }

    def summary_offsets(self) -> dict[int, dict[str, int]]:
        """Per rank, the byte offset up to which its summary covers each table file it read
        (``{"steps.jsonl": 4559810, ...}``; a rank whose files could not be read is left out)."""
        self.summaries()
        parts = self._derived.get("summary_parts") or {}
        return {rank: dict(part.ends) for rank, part in parts.items() if part.ends is not None}

    def summary_sources(self) -> dict[int, str]:
        """Where each rank's summary came from: ``"records"`` (the writer's record alone),
        ``"records+tail"`` (the record, and the rows after it read from the files),
        ``"files"`` (the record files alone: no summary file, an older amprobe, or a record
        that was damaged or not trusted) or ``"unreadable"`` (an empty summary)."""
        self.summaries()
        return dict(self._derived["summary_sources"])

    def relation(self, name: str) -> Any:
        """A lazy DuckDB relation over table ``name`` (or ``"summaries"``) of the run's derived
        Parquet store (:mod:`amprobe.store.derived`), built or refreshed first when missing or
        stale. It reads nothing until a result is asked for (``.arrow()``, ``.df()``,
        ``.fetchall()``) and runs again at each such call: keep a shared result with
        :meth:`cached`. One connection per run (all cores, a memory limit, spilling to the
        user cache); ``duckdb`` is imported only here."""
        derived = amprobe.store.derived  # loaded on first use (with duckdb), not with the run
        if "duckdb" not in self._derived:
            self._derived["duckdb"] = derived.connect()
        return derived.relation(self, name, self._derived["duckdb"], self._read_warned)

    def _read_warned(self, info: RankInfo, filename: str, read: _TableRead | RunLoadError) -> None:
        self._warn(_read_warnings(info, filename, read))

    def cached(self, key: str, compute: Callable[[Run], Any]) -> Any:
        """``compute(self)``, computed once per run and key (for frames derived by several rules)."""
        if key not in self._derived:
            self._derived[key] = compute(self)
        return self._derived[key]

    @property
    def end_reason(self) -> str | None:
        """Why the run did not finish normally, as its end files say (``"RuntimeError: ..."``,
        ``"KeyboardInterrupt"``, ``"SIGTERM"``), rank-prefixed when several ranks ran."""
        for info in self.ranks:
            reason = (info.end or {}).get("reason") if info.status == self.status else None
            if isinstance(reason, str) and reason:
                return reason if len(self.ranks) == 1 else f"rank {info.rank}: {reason}"
        return None

    @property
    def last_step(self) -> int | None:
        """The highest step any rank recorded (from the ranks' ``steps`` summaries), or None."""
        lasts = [
            s["steps"]["last"]
            for s in self.summaries().values()
            if s.get("steps") and s["steps"].get("last") is not None
        ]
        return int(max(lasts)) if lasts else None


#: Largest summary.json read (a record is a few to a few hundred kilobytes); a larger one is
#: not trusted and the rank is summarized from its record files.
MAX_SUMMARY_BYTES = 64 << 20


@dataclasses.dataclass
class _RankSummary:
    summary: dict[str, Any]
    source: str  # records, records+tail, files, unreadable
    warnings: list[str]
    other_version: bool = False  # a record of another summary_version was ignored
    #: table file name -> the byte offset the summary covers it to (None: not known)
    ends: dict[str, int] | None = None
    #: ``summary.json``'s (size, mtime_ns, inode) when it was read (None: there was none)
    record_key: tuple[int, int, int] | None = None
    #: what the record this summary goes on from says of its files' bytes (None: no record)
    checks: _RecordChecks | None = None


@dataclasses.dataclass(frozen=True)
class _RecordChecks:
    """What a rank's summary record says its table files' summarized bytes are, for
    :func:`_verify_files`: each file's offset and the CRC-32 of its bytes before it
    (``checksums`` None: the record has none, an older writer's), and when it was written."""

    offsets: dict[str, int]
    checksums: dict[str, int] | None
    written: str  # "at close", "at step 1234" (its rows' last step), "before any step"

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> _RecordChecks:
        sums = record.get("checksums")
        if record.get("final"):
            written = "at close"
        else:
            last = (record["sections"].get("steps") or {}).get("last")
            written = f"at step {last}" if isinstance(last, int) else "before any step"
        return cls(dict(record["offsets"]), None if sums is None else dict(sums), written)


def _rows_table(name: str, rows: list[dict[str, Any]], ranks: list[int]) -> pa.Table:
    """Rows of a small table kept by the summaries as the arrow table the file parser gives
    (the schema's columns and types), with the ``rank`` column first."""
    arrow_schema = jsonl._arrow_schema(name)
    table = pa.Table.from_pylist(rows, schema=arrow_schema)
    return table.add_column(0, "rank", pa.array(np.asarray(ranks, dtype=np.int64)))


def _record_key(folder: str) -> tuple[int, int, int] | None:
    """``summary.json``'s (size, mtime_ns, inode), None when missing or not readable: the
    writer replaces the file at each flush, so an equal key means the same record."""
    try:
        st = os.stat(f"{folder}/{SUMMARY_FILE}")
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _summaries(run: Run) -> dict[int, dict[str, Any]]:
    """Every rank's summary, the ranks read in parallel threads (see :meth:`Run.summaries`).

    A rank read before (by this run, or by the run it adopted them from) continues from where
    that read ended, unless its record now covers more: refreshing a live run reads only what
    was appended."""
    if run._tables and not any(info.path.is_dir() for info in run.ranks):
        return _summaries_in_memory(run)
    infos = list(run.ranks)
    names = [cls.name for cls in SECTIONS]
    files = [(table, table_filename(table)) for table in sorted(summary_tables())]
    before: dict[int, _RankSummary] = run._derived.get("summary_parts") or {}

    def one(info: RankInfo) -> _RankSummary:
        return _summarize_rank(info, names, files, before.get(info.rank))

    with gc_paused():
        if len(infos) > 1:
            # threads overlap the file system's waits (a cold cache, a network file system)
            workers = min(len(infos), os.cpu_count() or 1, 16)
            with ThreadPoolExecutor(max_workers=workers) as pool:
                parts = list(pool.map(one, infos))
        else:
            parts = [one(info) for info in infos]
    out: dict[int, dict[str, Any]] = {}
    sources: dict[int, str] = {}
    other = 0
    for info, part in zip(infos, parts, strict=True):
        if part.warnings:
            run._warn(part.warnings)
        out[info.rank] = part.summary
        sources[info.rank] = part.source
        other += part.other_version
    if other:
        run._warn(
            f"summary records of another summary_version (this amprobe reads {SUMMARY_VERSION}) "
            f"ignored on {other} rank(s); those ranks were summarized from their record files"
        )
    run._derived["summary_sources"] = sources
    run._derived["summary_parts"] = dict(zip((i.rank for i in infos), parts, strict=True))
    with gc_paused():  # tens of thousands of small lists: see gc_paused
        _verify_files(run, infos, parts)
    return out


#: Ranks whose damaged files get a warning each; the others' are listed in one more.
_DAMAGED_SHOWN = 8


def _verify_files(run: Run, infos: list[RankInfo], parts: list[_RankSummary]) -> None:
    """Warn of each rank whose table files no longer hold the bytes its summary record
    describes (:mod:`amprobe.store.integrity`): damage in place inside the summarized bytes,
    which no row read sees since the rank's facts come from the record. The rank's summary is
    kept (its other facts still count); a rank whose record has no checksums is said to be not
    checked. Ranks summarized from their files alone have no record to check against (the
    loader read their rows, and warned of what it could not read)."""
    checks: list[integrity.Check] = []
    unchecked: list[int] = []
    written: dict[int, str] = {}
    for info, part in zip(infos, parts, strict=True):
        rc = part.checks
        if rc is None or part.source == "unreadable":
            continue
        if rc.checksums is None:
            unchecked.append(info.rank)
            continue
        written[info.rank] = rc.written
        folder = str(info.path)
        # the rank's folder in the run (the cache's keys): rank folders are the run's children
        where = info.path.name if info.path.parent == run.path else folder
        for name, crc in rc.checksums.items():
            offset = rc.offsets.get(name, 0)
            if offset:
                path = f"{folder}/{name}"
                checks.append(
                    integrity.Check(info.rank, name, f"{where}/{name}", path, offset, crc)
                )
    if checks:
        verdict = integrity.verify(checks, lambda: derived_folder(run.path, run.manifest))
        shown = sorted({c.rank for c in verdict.mismatched})[:_DAMAGED_SHOWN]
        for c in (c for c in verdict.mismatched if c.rank in shown):
            run._warn(
                f"rank {c.rank}: {c.name} differs from what its writer recorded in the "
                f"{c.offset:,} bytes it summarized (checksum mismatch): the file was changed or "
                "damaged in place after it was written; this rank's summary comes from the "
                f"record written {written[c.rank]}, and what reads the file's rows reads them "
                "as they are now"
            )
        more = sorted({c.rank for c in verdict.mismatched} - set(shown))
        if more:
            run._warn(
                f"ranks {integrity.rank_ranges(more)}: table files differ from what their "
                "writers recorded in the bytes they summarized (checksum mismatch), as above"
            )
        for c, why in verdict.unreadable:
            run._warn(f"rank {c.rank}: {c.name} not checked against its writer's checksum ({why})")
    if unchecked:
        run._warn(
            f"rank(s) {integrity.rank_ranges(unchecked)}: table files not checked for damage "
            "after they were summarized (their summary records carry no checksums: written "
            "by an older amprobe)"
        )


def _summaries_in_memory(run: Run) -> dict[int, dict[str, Any]]:
    """A run held in memory (the tests' ``fake_run``: frames, no rank folder): each rank
    summarized from its rows of the frames."""
    out: dict[int, dict[str, Any]] = {}
    held: dict[str, tuple[pd.DataFrame, dict[Any, Any]]] = {}
    for name, frame in run._tables.items():
        if "rank" in frame.columns:
            held[name] = (frame, frame.groupby("rank", sort=False).indices if len(frame) else {})
    for info in run.ranks:

        def read(table: str, info: RankInfo = info) -> list[dict[str, Any]]:
            held_table = held.get(table)
            if held_table is None:
                return []
            frame, where = held_table
            rows = where.get(info.rank)
            if rows is None:
                return []
            records = frame.iloc[rows].drop(columns=["rank"]).to_dict("records")
            # missing values as None (NaN stays NaN: a non-finite loss is a value)
            return [{k: (None if v is pd.NA else v) for k, v in r.items()} for r in records]

        out[info.rank] = summarize_tables(read)
    run._derived["summary_sources"] = {info.rank: "files" for info in run.ranks}
    return out


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused (and set back as it was after; safe to nest): reading thousands of records allocates hundreds
    of thousands of small acyclic containers, and the collections they set off traverse every
    record read before (a third of the CPU time at 4,096 ranks). Nothing read is cyclic."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            _age_young_objects()
            gc.enable()


def _age_young_objects() -> None:
    """Move every object the collector tracks into its oldest generation, with the young
    generations' counts set back to zero.

    A pause does not stop the allocation count: the first allocation after :func:`gc.enable`
    would start a collection of the youngest generation, which then holds every container
    allocated during the pause (the records of thousands of ranks: 0.8 s of CPU at 4,096
    ranks, and each later pause's exit again), and its survivors would be walked once more
    by the middle generation's collections. Kept objects are still collected by the next
    full collection, when the oldest generation's own rule starts one. ``gc.freeze`` followed
    by ``gc.unfreeze`` is that move (two list splices); not done when someone else froze
    objects (``unfreeze`` would thaw theirs too)."""
    if gc.get_freeze_count():
        return
    gc.freeze()
    gc.unfreeze()


def _summarize_rank(
    info: RankInfo,
    names: list[str],
    files: list[tuple[str, str]],
    before: _RankSummary | None = None,
) -> _RankSummary:
    """:func:`_summarize_rank_as_written`, unless the rank's steps rows repeat a (window,
    step): the sections count every row fed them, the loader keeps the first of each, so
    such a rank is summarized again from its rows with the repeats dropped (never raises)."""
    part = _summarize_rank_as_written(info, names, files, before)
    windows = (part.summary.get("steps") or {}).get("windows") or {}
    if all(w.get("increasing", True) for w in windows.values()):
        return part
    try:
        return _summarize_rank_unique(info, files, part)
    except Exception as exc:  # a section that fails on these rows: keep what was read
        part.warnings.append(f"rank {info.rank}: repeated steps not dropped ({exc})")
        return part


def _summarize_rank_unique(
    info: RankInfo, files: list[tuple[str, str]], part: _RankSummary
) -> _RankSummary:
    """The rank summarized from its files, each (window, step) of ``steps`` kept once (the
    first row, as :meth:`Run._unique_steps` keeps it)."""
    acc = Accumulator()
    warnings = [w for w in part.warnings if "does not match the record files" not in w]
    ends: dict[str, int] = {}
    for table, name in files:
        read = _read_arrow(info.path / name, table, 0)
        ends[name] = read.next_offset
        warnings.extend(_read_warnings(info, name, read))
        if read.table is None or not read.table.num_rows:
            continue
        rows = read.table.to_pylist()
        if table == "steps":
            seen: set[tuple[Any, Any]] = set()
            kept = []
            for row in rows:
                key = (row.get("window") or 0, row.get("step"))
                if key[1] is not None and key in seen:
                    continue
                seen.add(key)
                kept.append(row)
            if len(kept) < len(rows):
                warnings.append(
                    f"rank {info.rank}: {len(rows) - len(kept)} repeated record(s) of the same "
                    "(window, step) in steps.jsonl; the first of each was kept"
                )
            rows = kept
        acc.add(table, rows)
    return dataclasses.replace(part, summary=acc.snapshot(), source="files", warnings=warnings,
                               ends=ends, checks=None)  # fmt: skip


def _summarize_rank_as_written(
    info: RankInfo,
    names: list[str],
    files: list[tuple[str, str]],
    before: _RankSummary | None = None,
) -> _RankSummary:
    """One rank's summary: its record, and the rows it does not cover (never raises).
    ``names`` are the registered sections' names, ``files`` the (table, file name) pairs of
    the tables they read; ``before``: this rank's summary read earlier, which is continued
    from its ends when the record does not cover more of every file."""
    who = f"rank {info.rank}"
    folder = str(info.path)
    try:
        key = _record_key(folder)
        usable = before is not None and before.ends is not None and before.source != "unreadable"
        if usable and before is not None and key == before.record_key:
            # the record read before, unchanged: not read again; the files past what was read
            record, other = None, False
            warnings: list[str] = []
        else:
            record, warnings, other = _read_record(info.rank, folder)
        if record is not None and not all(name in record["sections"] for name in names):
            record = None  # written with fewer sections (an older amprobe): not a damage
        base: dict[str, Any] | None = None  # the sections the rows after ``offsets`` extend
        offsets: Mapping[str, int] = {}
        source = "files"
        starts: dict[str, int] | None = None  # where the rows no summary covers start
        # what to go on from: the record, and the summary read before (first when it covers
        # more of some file than the record); the first that still matches the files
        candidates: list[tuple[bool, str, dict[str, Any], Mapping[str, int]]] = []
        checks = None if record is None else _RecordChecks.of(record)
        if record is not None:
            candidates.append((True, "records", record["sections"], record["offsets"]))
        if usable and before is not None and before.ends is not None:
            ahead = record is not None and all(
                record["offsets"].get(name, 0) >= before.ends.get(name, 0) for _, name in files
            )
            earlier = (False, before.source, before.summary, before.ends)
            candidates.insert(1 if ahead else 0, earlier)
        continued = False  # going on from ``before``
        for is_record, kind, sections, covered in candidates:
            tail, why = _tail_starts(folder, covered, files)
            if not why:
                base, offsets, source, starts = sections, covered, kind, tail
                continued = not is_record
                if continued and before is not None:
                    warnings = [*before.warnings, *warnings]  # what its rows showed still holds
                    checks = before.checks
                break
            if is_record:
                warnings.append(
                    f"{who}: {SUMMARY_FILE} does not match the record files ({why}); "
                    "the rank was summarized from its record files"
                )
        if continued and before is not None and not starts:
            return dataclasses.replace(before, record_key=key)  # nothing appended since
        acc: Accumulator | None = None
        ends: dict[str, int] = {}
        for table, name in files:
            if starts is not None and name not in starts:
                ends[name] = offsets.get(name, 0)
                continue  # the summary covers the whole file: not opened
            read = _read_arrow(info.path / name, table, starts[name] if starts else 0)
            ends[name] = read.next_offset
            warnings.extend(_read_warnings(info, name, read))
            if read.table is not None and read.table.num_rows:
                acc = acc or Accumulator()
                acc.add(table, read.table.to_pylist())
        if base is None:
            summary = (acc or Accumulator()).snapshot()
            return _RankSummary(summary, "files", warnings, other, ends, key)
        if acc is None:
            summary = {n: base[n] for n in names}
            return _RankSummary(summary, source, warnings, other, ends, key, checks)
        merged = merge_sections([base, acc.snapshot()])
        if source == "records":
            source = "records+tail"
        return _RankSummary(merged, source, warnings, other, ends, key, checks)
    except RunLoadError as exc:
        return _RankSummary({}, "unreadable", [f"{who}: summary not computed: {exc}"])
    except Exception as exc:  # a section that fails on this rank's rows or record
        return _RankSummary(
            {}, "unreadable", [f"{who}: summary not computed ({type(exc).__name__}: {exc})"]
        )


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def _read_record(rank: int, folder: str) -> tuple[dict[str, Any] | None, list[str], bool]:
    """The rank's summary record if it has a usable one (None if not), the warnings, and
    whether a record of another ``summary_version`` was ignored.

    Read with bare descriptors (as :func:`~amprobe.store.layout.open_regular` checks: opened
    non-blocking, a regular file by ``fstat``), thousands of ranks being read in a row."""
    path = f"{folder}/{SUMMARY_FILE}"
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None, [], False
    except OSError as exc:
        why = f"not read ({exc.strerror or exc})"
    else:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"{file_kind(st.st_mode)}, not a regular file")
            chunks: list[bytes] = []
            got = 0
            while got <= MAX_SUMMARY_BYTES:  # usually one read and the end: the file is small
                want = min(MAX_SUMMARY_BYTES + 1 - got, max(st.st_size + 1 - got, 4096))
                more = os.read(fd, want)
                if not more:
                    break
                chunks.append(more)
                got += len(more)
            data = b"".join(chunks)
        except OSError as exc:
            why, data = f"not read ({exc.strerror or exc})", None
        finally:
            os.close(fd)
        if data is None:
            pass
        elif len(data) > MAX_SUMMARY_BYTES:
            why = f"larger than {MAX_SUMMARY_BYTES} bytes"
        else:
            try:
                record = parse_record(_decode_record(data))
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                why = "not valid JSON" if data.strip() else "empty"
            else:
                if record is None:
                    why = "not a summary record"
                elif record["summary_version"] != SUMMARY_VERSION:
                    return None, [], True
                else:
                    return record, [], False
    # a machine crash before the page cache reached the disk can leave an empty or cut file
    warning = f"rank {rank}: {SUMMARY_FILE} is {why}; the rank was summarized from its files"
    return None, [warning], False


def _decode_record(data: bytes) -> Any:
    """The value of a record's JSON text, as :func:`json.loads` gives it.

    Parsed by ``orjson`` (three times faster: a 4,096-rank run's records are 190 MB of JSON,
    most of the cost of reading them). :func:`json.loads`, whose reading is the record
    format's, parses the texts ``orjson`` refuses (the writer writes NaN and infinities as
    ``NaN`` / ``Infinity``; a byte-order mark, an encoded surrogate, a number past the float
    range) and those it would read otherwise: an integer outside 64 bits, which ``orjson``
    reads as a float, so any text with 19 digits in a row outside a fraction goes there.
    What ``orjson`` reads otherwise it reads as ``json.loads`` does (keys and their order,
    numbers, strings).

    Raises:
        ValueError: the text is not JSON (``RecursionError``: nested too deep).
    """
    digits = data.translate(_DIGITS)
    if _INTEGER_RUN in digits or digits.startswith(_INTEGER_RUN[1:]):
        return json.loads(data)
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


#: a text's bytes as digits ("0"), "." (a fraction's digits follow it) and " " (all else);
#: in it, a run of 19 digits after a byte that is not a "." is an integer part of 19 digits
#: or more (2**63 has 19). The longest integer part of a float Python writes has 16 digits
#: (past them it writes an exponent), so a record's floats never make one.
_DIGITS = bytes(48 if 48 <= b <= 57 else 46 if b == 46 else 32 for b in range(256))
_INTEGER_RUN = b" " + b"0" * 19


def _tail_starts(
    folder: str, offsets: Mapping[str, int], files: list[tuple[str, str]]
) -> tuple[dict[str, int], str]:
    """Where the rows a record does not cover start, per table file that has some (a file
    that ends at the record's offset is not listed), and why the record cannot describe the
    files as they are now ('' if it can): a file shorter than the offset, or not ending a line
    there, which happens when a file was truncated or replaced.

    One ``stat`` per table file; a file is opened only when it grew past its offset.

    Raises:
        RunLoadError: a table file is not a regular file or cannot be read.
    """
    starts: dict[str, int] = {}
    for _table, name in files:
        path = f"{folder}/{name}"
        offset = offsets.get(name, 0)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if offset:
                return {}, f"{name} is missing"
            continue
        except OSError as exc:
            raise RunLoadError(f"cannot read {path}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(st.st_mode):
            raise RunLoadError(
                f"cannot read {path}: is {file_kind(st.st_mode)}, not a regular file"
            )
        if st.st_size < offset:
            return {}, f"{name} has {st.st_size} bytes, fewer than the {offset} summarized"
        if st.st_size == offset:
            continue
        if offset:
            try:
                with open_regular(path) as fh:
                    last = os.pread(fh.fileno(), 1, offset - 1)
            except OSError as exc:
                raise RunLoadError(f"cannot read {path}: {exc.strerror or exc}") from None
            if last != b"\n":
                return {}, f"{name} has no line end at the summarized offset {offset}"
        starts[name] = offset
    return starts, ""


def write_rank_summary(rank_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """(Re)write a rank's ``summary.json`` from its record files as a final record (the
    compaction step, for a rank whose record is missing or stale): the file is replaced
    atomically (a reader sees the old or the new one) and synced. The record's offsets are
    where each table's complete lines end, so rows appended later are summarized by the
    reader as a tail. Returns the record written.

    Raises:
        RunLoadError: a table file cannot be read.
        OSError: the summary cannot be written.
    """
    folder = Path(rank_dir)
    acc = Accumulator()
    offsets: dict[str, int] = {}
    checksums: dict[str, int] = {}
    rows: dict[str, int] = {}
    for table in sorted(summary_tables()):
        name = table_filename(table)
        read = _read_arrow(folder / name, table)
        if read.next_offset or (folder / name).exists():  # as the writer: files it wrote
            offsets[name] = read.next_offset
            # the bytes summarized, read again (the writer's record has their checksum too)
            checksums[name] = integrity.crc_of(str(folder / name), read.next_offset)
        got = read.table
        rows[table] = got.num_rows if got is not None else 0
        if got is not None and got.num_rows:
            acc.add(table, got.to_pylist())
    record = make_record(True, offsets, rows, acc.snapshot(), checksums)
    write_record(folder, encode_record(record), durable=True)
    return record


def _read_warnings(info: RankInfo, filename: str, read: _TableRead | RunLoadError) -> list[str]:
    """What a user should know about one rank's read of one table, one line each."""
    who = f"rank {info.rank}"
    if isinstance(read, RunLoadError):
        return [f"{who}: {filename} not read: {read}"]
    out = []
    if read.dropped:
        out.append(f"{who}: {read.dropped} unreadable record(s) skipped in {filename}")
    if read.oversize:
        out.append(
            f"{who}: {read.oversize} record(s) longer than {jsonl.MAX_RECORD_BYTES} bytes skipped "
            f"in {filename}"
        )
    if read.nulled:
        out.append(f"{who}: {read.nulled} value(s) of the wrong type read as missing in {filename}")
    if read.tail and info.end is not None:
        out.append(
            f"{who}: {filename} ends in a cut record ({read.tail} bytes without a newline) "
            "although the rank closed cleanly; it was ignored"
        )
    return out


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return read_json_file(path)
    except FileNotFoundError:
        raise RunLoadError(f"{what} is missing: {path}") from None
    except OSError as exc:
        raise RunLoadError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise RunLoadError(f"{what} is corrupt ({exc}): {path}") from None


def _drop_damaged_fields(
    obj: dict[str, Any], fields: Mapping[str, Callable[[Any], bool]], what: str
) -> list[str]:
    """Remove fields of ``obj`` whose value has the wrong type; one warning line per field."""
    warnings = []
    for key, valid in fields.items():
        if key in obj and obj[key] is not None and not valid(obj[key]):
            warnings.append(
                f"{what}: field {key!r} is damaged (got {type(obj[key]).__name__} "
                f"{_short(obj[key])}); ignored"
            )
            del obj[key]
    return warnings


def _is_type(types: tuple[type, ...]) -> Callable[[Any], bool]:
    def valid(value: Any) -> bool:
        if isinstance(value, bool) and bool not in types:
            return False
        return isinstance(value, types)

    return valid


_MANIFEST_CHECKS = {key: _is_type(types) for key, types in schema.MANIFEST_FIELDS.items()}
_END_CHECKS = {key: _is_type(types) for key, types in schema.END_FIELDS.items()}
_END_CHECKS["lost_rows"] = lambda v: (
    isinstance(v, dict)
    and all(
        isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool) for k, n in v.items()
    )
)
_END_CHECKS["lost_steps"] = lambda v: (
    isinstance(v, list)
    and len(v) in (0, 2)
    and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
)
_END_CHECKS["write_errors"] = lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)


def _lost_rows_warning(rank: int, end: dict[str, Any]) -> list[str]:
    """The writer's own account of rows it could not write (disk full, directory gone)."""
    if not end.get("lost_rows"):
        return []
    lost = ", ".join(f"{n} {table} record(s)" for table, n in sorted(end["lost_rows"].items()))
    span = end.get("lost_steps") or []
    errors = end.get("write_errors") or []
    return [
        f"rank {rank}: {lost} could not be written"
        + (f" (steps {span[0]}..{span[1]})" if len(span) == 2 else "")
        + (f": {'; '.join(errors)}" if errors else "")
    ]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_version(manifest: dict[str, Any], where: Path) -> None:
    version = manifest.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise RunLoadError(f"manifest has no valid schema_version: {where}")
    if version > schema.SCHEMA_VERSION:
        raise NewerSchemaError(
            f"run was written with schema version {version}, newer than this amprobe reads "
            f"({schema.SCHEMA_VERSION}); upgrade amprobe to read it: {where}"
        )
    if version < 1:
        raise RunLoadError(f"manifest has an invalid schema_version {version}: {where}")


def _not_a_run(root: Path) -> str:
    """Why ``root`` (no manifest, no rank folder) is not a run, naming the runs of an
    ``amprobe baseline`` folder when it is one."""
    legs = [root / leg for leg in BASELINE_LEGS if is_run_dir(root / leg)]
    if len(legs) == len(BASELINE_LEGS):
        fp32, amp = legs
        return (
            f"{root} holds an amprobe baseline pair, not one run: diagnose {amp} (or {fp32}), "
            f"or compare them with `amprobe compare {fp32} {amp}`"
        )
    if legs:
        return f"{root} holds one run of `amprobe baseline`, not one run itself: diagnose {legs[0]}"
    return f"not an amprobe run directory (no manifest.json): {root}"


#: What :meth:`Run.summaries` keeps when it refreshes: how far it read (to continue from
#: there) and the DuckDB connection; every other cached fact may hang on the summaries.
_KEPT_ON_REFRESH = frozenset({"summaries", "summary_sources", "summary_parts", "duckdb"})

#: How much of the end of a steps file is read for its last step (a steps row is under 1 kB).
_LAST_STEP_BYTES = 8 << 10


def _last_row(path: Path) -> tuple[dict[str, Any] | None, bool]:
    """The last complete row of a table file, read from its last :data:`_LAST_STEP_BYTES`, and
    whether that read can be trusted: ``(None, True)`` for a missing or empty file,
    ``(None, False)`` when the bytes read hold no row that parses (a damaged last line, or a
    row longer than the bytes read) or the file cannot be read."""
    try:
        with open_regular(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            start = max(0, size - _LAST_STEP_BYTES)
            data = os.pread(fh.fileno(), size - start, start)
    except FileNotFoundError:
        return None, True
    except OSError:
        return None, False
    lines = data.split(b"\n")
    lines.pop()  # after the last line end: nothing, or a cut line the loader leaves
    if start:
        lines.pop(0)  # may begin inside a line
    for line in reversed(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            return None, False
        return (row, True) if isinstance(row, dict) else (None, False)
    return None, not start  # no row at all, or none whole in the bytes read


def rank_last_rows(
    run: Run, table: str = "steps", ranks: Iterable[int] | None = None
) -> dict[int, dict[str, Any] | None]:
    """Each rank's (of ``ranks``, default all) last complete row of ``table``, read from the
    end of its file (a few kB a rank, never the whole table): the row as a dict, or None when
    the rank has no row or its last line does not parse (the loader decides about that one)."""
    name = table_filename(table)
    wanted = None if ranks is None else set(ranks)
    return {
        info.rank: _last_row(info.path / name)[0]
        for info in run.ranks
        if wanted is None or info.rank in wanted
    }


def _rank_last_steps(run: Run) -> dict[int, int] | None:
    """Each rank's last step without reading every rank's steps: the step of its last complete
    row, read from the end of its file (the probe writes a rank's steps in increasing order).
    None when a rank's file end holds a line the loader would drop, or no valid row in the
    bytes read: that is not guessed at (the caller reads the summaries then)."""
    lasts: dict[int, int] = {}
    for info in run.ranks:
        row, ok = _last_row(info.path / table_filename("steps"))
        if row is None:
            if not ok:
                return None
            continue  # no row at all
        step = row.get("step")
        if type(step) is not int:
            return None  # a damaged or odd last row: the loader decides
        lasts[info.rank] = step
    return lasts


def _summary_last_steps(run: Run) -> dict[int, int]:
    """Each rank's last step from its ``steps`` summary (what :attr:`Run.last_step` reads)."""
    out = {}
    for rank, summary in run.summaries().items():
        last = (summary.get("steps") or {}).get("last")
        if isinstance(last, int):
            out[rank] = last
    return out


def load_run(path: str | os.PathLike[str]) -> Run:
    """Load a run directory.

    Damaged parts are skipped with a message in ``Run.warnings`` (a partial load); a directory
    that holds nothing readable raises.

    Raises:
        RunLoadError: the path is missing, is not a run directory, or was written by a newer
            amprobe; the message is one line.
    """
    root = Path(path)
    if not root.exists():
        raise RunLoadError(f"no such run directory: {root}")
    if not root.is_dir():
        raise RunLoadError(f"not a directory: {root}")
    warnings: list[str] = []
    top = root / schema.RUN_MANIFEST
    manifest: dict[str, Any] = {}
    if top.exists():
        try:
            manifest = _read_json(top, "run manifest")
            if manifest.get("format") != schema.FORMAT:
                raise RunLoadError(f"not an amprobe run manifest: {top}")
            _check_version(manifest, top)
        except NewerSchemaError:
            raise
        except RunLoadError as exc:
            warnings.append(f"{exc}; reading the ranks without it")
            manifest = {}
    listing = list_ranks(root)
    if not top.exists() and listing.ranks:
        warnings.append(f"run manifest is missing: {top}; reading the ranks without it")
    warnings.extend(_drop_damaged_fields(manifest, _MANIFEST_CHECKS, "run manifest"))
    warnings.extend(listing.warnings)
    rank_dirs = listing.ranks
    if not rank_dirs:
        if not top.exists():
            raise RunLoadError(_not_a_run(root))
        raise RunLoadError(f"run directory holds no rank data (no rank*/ folder): {root}")
    ranks: list[RankInfo] = []
    for entry in rank_dirs:
        rank, rank_dir = entry.rank, entry.path
        try:
            rank_manifest = _read_json(rank_dir / schema.RANK_MANIFEST, f"rank {rank} manifest")
            _check_version(rank_manifest, rank_dir / schema.RANK_MANIFEST)
        except NewerSchemaError:
            raise
        except RunLoadError as exc:
            warnings.append(f"rank {rank} skipped: {exc}")
            continue
        warnings.extend(
            _drop_damaged_fields(rank_manifest, _MANIFEST_CHECKS, f"rank {rank} manifest")
        )
        end: dict[str, Any] | None = None
        if (rank_dir / schema.END_MARKER).exists():
            try:
                end = _read_json(rank_dir / schema.END_MARKER, f"rank {rank} end marker")
            except RunLoadError as exc:
                warnings.append(str(exc))
        if end is not None:
            warnings.extend(_drop_damaged_fields(end, _END_CHECKS, f"rank {rank} end.json"))
            warnings.extend(_lost_rows_warning(rank, end))
        status = status_of(rank_manifest, end)
        ranks.append(
            RankInfo(rank=rank, path=rank_dir, manifest=rank_manifest, end=end, status=status)
        )
    if not ranks:
        raise RunLoadError(f"no readable rank in run directory: {root} ({warnings[-1]})")
    world = manifest.get("world_size")
    if isinstance(world, int) and world > 0:
        have = {r.rank for r in ranks}
        missing = [r for r in range(world) if r not in have]
        beyond = sorted(r for r in have if r >= world)
        if missing:
            shown = ", ".join(str(r) for r in missing[:8]) + (", ..." if len(missing) > 8 else "")
            warnings.append(
                f"the run has world_size {world} but no readable data for rank(s) {shown}"
            )
        if beyond:
            warnings.append(
                f"rank folder(s) {', '.join(str(r) for r in beyond)} are beyond world_size {world}"
            )
    statuses = {r.status for r in ranks}
    status = next((s for s in STATUS_ORDER if s in statuses), "finished")
    run = Run(path=root, manifest=manifest, ranks=ranks, status=status, warnings=warnings)
    if any(r.end is None and r.status != "live" for r in ranks):
        lasts = _rank_last_steps(run)
        if lasts is None:
            lasts = _summary_last_steps(run)
        last = max(lasts.values()) if lasts else None
        where = f" at step {last}" if last is not None else " before its first flushed step"
        run.warnings.append(f"run ended abruptly{where} (no clean close recorded)")
        run.warnings.extend(_lagging_ranks(run, lasts))
    return run


#: A rank killed with the others may have flushed up to one chunk less (``flush_every``'s
#: default is 100 steps): only a rank further behind than this is said to have stopped early.
LAGGING_STEPS = 100


def _lagging_ranks(run: Run, known: dict[int, int]) -> list[str]:
    """One warning per unclosed rank whose records end well before the other ranks' (a rank
    that stopped early, or whose files were cut): otherwise only its own findings, if any,
    would show that a truncated rank among thousands is not like the others. ``known``: each
    rank's last step."""
    if len(known) < 2:
        return []
    top = max(known.values())
    unclosed = {i.rank for i in run.ranks if i.end is None and i.status != "live"}
    behind = sorted(
        (r for r, v in known.items() if top - v > LAGGING_STEPS and r in unclosed),
        key=lambda r: (known[r], r),
    )
    lines = [
        f"rank {r}: records end at step {known[r]}, {top - known[r]} steps before the last "
        f"step of the run ({top}), with no clean close: the rank stopped early or its files "
        "were cut"
        for r in behind[:8]
    ]
    if len(behind) > 8:
        lines.append(f"{len(behind) - 8} more rank(s) end more than {LAGGING_STEPS} steps early")
    return lines
