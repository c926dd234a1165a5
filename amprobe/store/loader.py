"""Load a run directory into typed pandas frames.

:func:`load_run` is the public loading API: the rules, the reports, the CLI and the dashboard
read runs only through it (and :func:`read_table` for incremental reads).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.json as pa_json

from amprobe.store import schema

__all__ = [
    "Run",
    "RankInfo",
    "RunLoadError",
    "NewerSchemaError",
    "load_run",
    "read_table",
    "empty_frame",
]


class RunLoadError(Exception):
    """A run directory that cannot be read; the message is one line that says why."""


class NewerSchemaError(RunLoadError):
    """The run was written by a newer amprobe (a schema version this one cannot read)."""


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """One rank's part of a run."""

    rank: int
    path: Path
    manifest: dict[str, Any]
    end: dict[str, Any] | None
    status: str  # "finished" | "live" | "interrupted"


@dataclasses.dataclass
class Run:
    """A loaded run: manifests, per-rank status and one frame per table (with a ``rank`` column).

    Attributes:
        path: the run directory.
        manifest: the run-level manifest.
        ranks: one :class:`RankInfo` per rank that could be read.
        status: ``finished`` when every rank closed cleanly, ``live`` while a rank's process is
            still running on this host, else ``interrupted`` (the process ended without closing).
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
            paths = [info.path / f"{name}.jsonl" for info in self.ranks]
            if len(paths) > 1:
                workers = min(len(paths), os.cpu_count() or 1, 16)
                with ThreadPoolExecutor(max_workers=workers) as pool:
                    parts = list(pool.map(lambda p: _read_arrow(p, name), paths))
            else:
                parts = [_read_arrow(p, name) for p in paths]
            tables = []
            for info, (part, _, dropped) in zip(self.ranks, parts, strict=True):
                if dropped:
                    self.warnings.append(
                        f"rank {info.rank}: {dropped} unreadable record(s) skipped in {name}.jsonl"
                    )
                if part is not None and part.num_rows:
                    ranks = pa.array(np.full(part.num_rows, info.rank, dtype=np.int64))
                    tables.append(part.add_column(0, "rank", ranks))
            self._tables[name] = _to_frame(tables, name)
        return self._tables[name]

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        """The events of one kind as dicts (``detail`` merged in), in recording order.

        Parsed once per kind and cached; every call returns fresh dicts.
        """
        if kind not in self._events_cache:
            ev = self.events
            out: list[dict[str, Any]] = []
            if not ev.empty:
                mask = (ev["kind"] == kind).to_numpy(dtype=bool, na_value=False)
                sel = ev[mask]
                for rank, step, t, raw in zip(
                    sel["rank"].tolist(),
                    sel["step"].tolist(),
                    sel["t"].tolist(),
                    sel["detail"].tolist(),
                    strict=True,
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

    def cached(self, key: str, compute: Callable[[Run], Any]) -> Any:
        """``compute(self)``, computed once per run and key (for frames derived by several rules)."""
        if key not in self._derived:
            self._derived[key] = compute(self)
        return self._derived[key]

    @property
    def last_step(self) -> int | None:
        steps = self.steps
        return int(steps["step"].max()) if len(steps) else None


def empty_frame(table: str) -> pd.DataFrame:
    columns = schema.TABLES.get(table, {})
    return pa.schema(list(columns.items())).empty_table().to_pandas() if columns else pd.DataFrame()


def _arrow_schema(table: str) -> pa.Schema | None:
    columns = schema.TABLES.get(table)
    return pa.schema(list(columns.items())) if columns else None


def read_table(path: Path, table: str, offset: int = 0) -> tuple[pd.DataFrame, int, int]:
    """Read the complete records of a JSON Lines table from byte ``offset``.

    Returns ``(frame, next_offset, dropped)``: an unterminated last line (a record still being
    written, or cut by a crash) is left for the next read; lines that do not parse are dropped
    and counted. A missing file reads as an empty frame.
    """
    parsed, next_offset, dropped = _read_arrow(path, table, offset)
    if parsed is None:
        return empty_frame(table), next_offset, dropped
    return parsed.to_pandas(), next_offset, dropped


def _read_arrow(path: Path, table: str, offset: int = 0) -> tuple[pa.Table | None, int, int]:
    """:func:`read_table` as an arrow table with every schema column (None: nothing to read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return None, offset, 0
    except OSError as exc:
        raise RunLoadError(f"cannot read {path}: {exc.strerror or exc}") from None
    end = data.rfind(b"\n")
    if end < 0:
        return None, offset, 0
    data = data[: end + 1]
    arrow_schema = _arrow_schema(table)
    dropped = 0
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
            read_options=pa_json.ReadOptions(block_size=1 << 24),
        )
    except (
        pa.ArrowInvalid,
        pa.ArrowTypeError,
        pa.ArrowNotImplementedError,
        OverflowError,
        UnicodeDecodeError,
    ):
        parsed, dropped = _read_lines_slowly(data, arrow_schema)
    if arrow_schema is not None:
        for field in arrow_schema:
            if field.name not in parsed.column_names:
                parsed = parsed.append_column(field, pa.nulls(parsed.num_rows, type=field.type))
    return parsed, offset + end + 1, dropped


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


def _read_lines_slowly(data: bytes, arrow_schema: pa.Schema | None) -> tuple[pa.Table, int]:
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
                try:
                    pa.array([value], type=field.type)
                except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
                    value = None
                clean[field.name] = value
            row = clean
        rows.append(row)
    if arrow_schema is not None:
        return pa.Table.from_pylist(rows, schema=arrow_schema), dropped
    return pa.Table.from_pylist(rows), dropped


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunLoadError(f"{what} is missing: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunLoadError(f"cannot read {what} {path}: {exc}") from None
    try:
        obj = json.loads(text)
    except ValueError:
        raise RunLoadError(f"{what} is corrupt (not valid JSON): {path}") from None
    if not isinstance(obj, dict):
        raise RunLoadError(f"{what} is corrupt (not a JSON object): {path}")
    return obj


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


def pid_alive(pid: Any) -> bool:
    """Whether process ``pid`` exists on this host (signal 0; a foreign user's process counts)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _rank_status(manifest: dict[str, Any], end: dict[str, Any] | None) -> str:
    if end is not None:
        return "finished"
    if manifest.get("hostname") == socket.gethostname() and pid_alive(manifest.get("pid")):
        return "live"
    return "interrupted"


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
    elif any(p.is_dir() and p.name.startswith("rank") for p in root.iterdir()):
        warnings.append(f"run manifest is missing: {top}; reading the ranks without it")
    rank_dirs = sorted(
        (
            p
            for p in root.iterdir()
            if p.is_dir() and p.name.startswith("rank") and p.name[4:].isdigit()
        ),
        key=lambda p: int(p.name[4:]),
    )
    if not rank_dirs:
        if not top.exists():
            raise RunLoadError(f"not an amprobe run directory (no manifest.json): {root}")
        raise RunLoadError(f"run directory holds no rank data (no rank*/ folder): {root}")
    ranks: list[RankInfo] = []
    for rank_dir in rank_dirs:
        rank = int(rank_dir.name[4:])
        try:
            rank_manifest = _read_json(rank_dir / schema.RANK_MANIFEST, f"rank {rank} manifest")
            _check_version(rank_manifest, rank_dir / schema.RANK_MANIFEST)
        except NewerSchemaError:
            raise
        except RunLoadError as exc:
            warnings.append(f"rank {rank} skipped: {exc}")
            continue
        end: dict[str, Any] | None = None
        if (rank_dir / schema.END_MARKER).exists():
            try:
                end = _read_json(rank_dir / schema.END_MARKER, f"rank {rank} end marker")
            except RunLoadError as exc:
                warnings.append(str(exc))
        status = _rank_status(rank_manifest, end)
        if end and end.get("lost_rows"):
            lost = ", ".join(
                f"{n} {table} record(s)" for table, n in sorted(end["lost_rows"].items())
            )
            span = end.get("lost_steps") or []
            warnings.append(
                f"rank {rank}: {lost} could not be written"
                + (f" (steps {span[0]}..{span[1]})" if len(span) == 2 else "")
                + (f": {'; '.join(end.get('write_errors', []))}" if end.get("write_errors") else "")
            )
        ranks.append(
            RankInfo(rank=rank, path=rank_dir, manifest=rank_manifest, end=end, status=status)
        )
    if not ranks:
        raise RunLoadError(f"no readable rank in run directory: {root} ({warnings[-1]})")
    statuses = {r.status for r in ranks}
    status = (
        "live"
        if "live" in statuses
        else ("interrupted" if "interrupted" in statuses else "finished")
    )
    run = Run(path=root, manifest=manifest, ranks=ranks, status=status, warnings=warnings)
    if status == "interrupted":
        last = run.last_step
        where = f" at step {last}" if last is not None else " before its first flushed step"
        run.warnings.append(f"run ended abruptly{where} (no clean close recorded)")
    return run
