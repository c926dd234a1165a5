"""Load a run directory: :func:`load_run` and the :class:`Run` it returns, whose tables are
typed pandas frames read on first use (:mod:`amprobe.store.jsonl` parses the files).

:func:`load_run` is the public loading API: the rules, the reports, the CLI and the dashboard
read runs only through it (and :func:`amprobe.store.jsonl.read_table` for incremental reads).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from amprobe.store import jsonl, schema
from amprobe.store import sections as _sections  # noqa: F401  (registers the sections)
from amprobe.store.jsonl import (
    _read_rank_table,
    _TableRead,
    _to_frame,
)
from amprobe.store.layout import (
    BASELINE_LEGS,
    STATUS_ORDER,
    RunLoadError,
    is_run_dir,
    list_ranks,
    read_json_file,
    status_of,
    table_filename,
)
from amprobe.store.summary import summarize_tables

__all__ = ["Run", "RankInfo", "RunLoadError", "NewerSchemaError", "load_run"]


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
            paths = [info.path / table_filename(name) for info in self.ranks]
            if len(paths) > 1:
                workers = min(len(paths), os.cpu_count() or 1, 16)
                with ThreadPoolExecutor(max_workers=workers) as pool:
                    parts = list(pool.map(lambda p: _read_rank_table(p, name), paths))
            else:
                parts = [_read_rank_table(p, name) for p in paths]
            tables = []
            for info, read in zip(self.ranks, parts, strict=True):
                self._warn(_read_warnings(info, table_filename(name), read))
                part = read.table if isinstance(read, _TableRead) else None
                if part is not None and part.num_rows:
                    ranks = pa.array(np.full(part.num_rows, info.rank, dtype=np.int64))
                    tables.append(part.add_column(0, "rank", ranks))
            frame = _to_frame(tables, name)
            if name == "steps":
                frame = self._unique_steps(frame)
            self._tables[name] = frame
        return self._tables[name]

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
            if info is not None:
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

    def summaries(self) -> dict[int, dict[str, Any]]:
        """Each rank's summary (:mod:`amprobe.store.summary`): rank -> section name -> facts,
        computed once per run."""
        return self.cached("summaries", _summaries)

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


def _summaries(run: Run) -> dict[int, dict[str, Any]]:
    """Every rank summarized from its record files (no ``summary.jsonl`` is read yet).

    A table the run already holds in memory (a run built by hand in a test, or a table read
    before) is summarized from that frame's rows of the rank instead (missing values as None).
    """
    out: dict[int, dict[str, Any]] = {}
    held: dict[str, tuple[pd.DataFrame, dict[Any, Any]]] = {}
    for name, frame in run._tables.items():
        if "rank" in frame.columns:
            held[name] = (frame, frame.groupby("rank", sort=False).indices if len(frame) else {})
    for info in run.ranks:

        def read(table: str, info: RankInfo = info) -> list[dict[str, Any]]:
            if table in held:
                frame, where = held[table]
                rows = where.get(info.rank)
                if rows is None:
                    return []
                part = frame.iloc[rows].drop(columns="rank")
                return pa.Table.from_pandas(part, preserve_index=False).to_pylist()
            got = _read_rank_table(info.path / table_filename(table), table)
            if isinstance(got, RunLoadError) or got.table is None:
                return []
            return got.table.to_pylist()

        out[info.rank] = summarize_tables(read)
    return out


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
        last = run.last_step
        where = f" at step {last}" if last is not None else " before its first flushed step"
        run.warnings.append(f"run ended abruptly{where} (no clean close recorded)")
    return run
