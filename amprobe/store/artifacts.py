"""Derived artifacts of a run: small files computed from a run's records, kept where the derived
store is and keyed by a fingerprint of everything they were computed from.

A reader asks for an artifact with the key it would compute it under now; the artifact is used
only when the key it was written with is the same, so a stale one is never read as fresh, only
replaced. What an artifact holds and what its key covers is the writer's business (the cached
diagnosis, :mod:`amprobe.rules.cache`, is one); this module gives the parts every artifact
shares, and imports nothing above the store (no pandas, no pyarrow, no duckdb):

- **Where** (:func:`artifact_folders`): ``RUN/derived/``, as the Parquet store
  (:mod:`amprobe.store.derived`, which takes these helpers from here); when the run folder
  cannot be written, ``$XDG_CACHE_HOME/amprobe/derived/<key>`` (``~/.cache`` by default), the
  key a hash of the run's resolved path and its run manifest's ``created_unix``.
- **What a run is made of** (:func:`source_entries`): per file the run's readers read (the run
  manifest; per rank folder its manifest, end marker, summary record and ``*.jsonl`` tables)
  its path relative to the run, size and ``mtime_ns``: one ``stat`` a file, nothing opened, so
  an appended row, a rewritten summary or a new rank changes it.
- **Writes** are a temporary file in the same folder moved into place with ``os.replace`` (a
  reader sees the old file or the new one, never a part); a folder that cannot be written is
  skipped, and an artifact that cannot be written anywhere is not an error (it is computed
  again next time).
- **Reads** open regular files only (a FIFO planted in a run folder cannot block), up to
  :data:`MAX_ARTIFACT_BYTES`; a missing, damaged or foreign file reads as absent.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amprobe.store.layout import (
    END_MARKER,
    RANK_MANIFEST,
    RUN_MANIFEST,
    TABLE_SUFFIX,
    open_regular,
    parse_rank_dirname,
)
from amprobe.store.places import DERIVED_DIR, cache_dir, writable
from amprobe.store.places import cache_key as _places_cache_key
from amprobe.store.summary import SUMMARY_FILE

if TYPE_CHECKING:
    from amprobe.store.run import Run

__all__ = [
    "DERIVED_DIR",
    "ARTIFACT_FORMAT",
    "MAX_ARTIFACT_BYTES",
    "cache_dir",
    "cache_key",
    "writable",
    "artifact_folders",
    "source_entries",
    "is_source",
    "fingerprint",
    "code_fingerprint",
    "read_artifact",
    "write_artifact",
    "entries_of",
]

#: The ``format`` of an artifact file.
ARTIFACT_FORMAT = "amprobe-artifact"
#: The largest artifact file read; a larger one is not amprobe's and reads as absent.
MAX_ARTIFACT_BYTES = 64 << 20
#: the files of a rank folder that the run's readers read, besides its ``*.jsonl`` tables
_RANK_FILES = frozenset({RANK_MANIFEST, END_MARKER, SUMMARY_FILE})


# -- where (the helpers of amprobe.store.places, which the loader and the Parquet store share) --
def cache_key(run: Run) -> str:
    """The name of the run's folder in the user cache (:func:`amprobe.store.places.cache_key`:
    a hash of the run's resolved path and its run manifest's ``created_unix``)."""
    return _places_cache_key(run.path, run.manifest)


def artifact_folders(run: Run) -> list[Path]:
    """Where the run's derived files may be, in the order they are looked for: ``RUN/derived``,
    then the run's folder in the user cache (used when the run folder is read-only)."""
    return [run.path / DERIVED_DIR, cache_dir() / DERIVED_DIR / cache_key(run)]


# -- what a run is made of -------------------------------------------------------------------
def is_source(rel: str) -> bool:
    """Whether ``rel`` (a path relative to the run, ``/``-separated) is a file that
    :func:`source_entries` lists: the run manifest, or a rank folder's manifest, end marker,
    summary record or table."""
    if "/" not in rel:
        return rel == RUN_MANIFEST
    folder, _, name = rel.partition("/")
    if "/" in name or parse_rank_dirname(folder) is None:
        return False
    return name.endswith(TABLE_SUFFIX) or name in _RANK_FILES


def source_entries(run_dir: str | os.PathLike[str]) -> list[tuple[str, int, int, int]]:
    """Per file of the run that its readers read (:func:`is_source`): ``(path relative to the
    run, size, mtime_ns, ctime_ns)``, sorted by path (the change time too: an edit that puts
    the size and modification time back, as ``touch -r`` or ``rsync -t`` do, cannot put it
    back; a hard-linked copy made of the run changes it, and is read again once). One ``stat`` a file (symbolic links followed, as
    the loader follows them), nothing opened; a file that vanishes while listed is left out,
    an unlistable rank folder lists as ``(folder, -1, -1)``."""
    root = Path(run_dir)
    out: list[tuple[str, int, int, int]] = []
    with contextlib.suppress(OSError):
        st = os.stat(root / RUN_MANIFEST)
        out.append((RUN_MANIFEST, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    try:
        folders = [e.name for e in os.scandir(root) if parse_rank_dirname(e.name) is not None]
    except OSError:
        folders = []
    for folder in folders:
        try:
            entries = list(os.scandir(root / folder))
        except NotADirectoryError:
            continue
        except OSError:
            out.append((folder, -1, -1, -1))
            continue
        for entry in entries:
            name = entry.name
            if not (name.endswith(TABLE_SUFFIX) or name in _RANK_FILES):
                continue
            try:
                st = entry.stat()
            except OSError:
                continue
            out.append((f"{folder}/{name}", st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    out.sort()
    return out


def fingerprint(value: Any) -> str:
    """A short hash of ``value`` (JSON-encodable: lists, dicts, strings, numbers), the same for
    equal values (keys sorted)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()


@functools.cache
def code_fingerprint() -> str:
    """amprobe's modules as this process imported them: each ``.py`` file's path in the package,
    size and ``mtime_ns`` (the version alone does not change in a development tree), for the
    keys of what is computed from a run by amprobe's code (the kept diagnosis, the figures'
    kept results)."""
    root = Path(__file__).resolve().parents[1]  # the amprobe package
    entries = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        for name in sorted(files):
            if name.endswith(".py"):
                path = Path(folder) / name
                try:
                    st = path.stat()
                except OSError:
                    continue
                entries.append((path.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns))
    return fingerprint(entries)


# -- reading and writing ---------------------------------------------------------------------
def _filename(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"not an artifact name: {name!r}")
    return f"{name}.json"


def read_artifact(run: Run, name: str, key: str) -> Any:
    """The payload of the run's artifact ``name`` written under ``key``, or None when there is
    none (missing, written under another key, damaged, not a regular file, too large)."""
    filename = _filename(name)
    for folder in artifact_folders(run):
        try:
            with open_regular(folder / filename) as fh:
                if os.fstat(fh.fileno()).st_size > MAX_ARTIFACT_BYTES:
                    continue
                data = fh.read(MAX_ARTIFACT_BYTES + 1)
            obj = json.loads(data)
        except (OSError, ValueError, RecursionError):
            continue
        if (
            isinstance(obj, dict)
            and obj.get("format") == ARTIFACT_FORMAT
            and obj.get("name") == name
            and obj.get("key") == key
            and "payload" in obj
        ):
            return obj["payload"]
    return None


def write_artifact(run: Run, name: str, key: str, payload: Any) -> Path | None:
    """Write the run's artifact ``name`` (``payload``: JSON-encodable, NaN and infinities kept)
    under ``key``, replacing the one there: in ``RUN/derived/``, else (the run folder cannot be
    written) in the run's folder of the user cache. Returns the file, or None when no folder
    could be written (nothing raised: the artifact is computed again next time).

    Raises:
        TypeError, ValueError: ``payload`` cannot be encoded as JSON (nothing is written).
    """
    filename = _filename(name)
    text = json.dumps(
        {
            "format": ARTIFACT_FORMAT,
            "name": name,
            "key": key,
            "written_unix": time.time(),
            "payload": payload,
        },
        separators=(",", ":"),
    )
    for i, folder in enumerate(artifact_folders(run)):
        if i and not _parents_made(folder):
            continue
        if not writable(folder):
            continue
        tmp = folder / f".{filename}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as fh:
                fh.write(text)
            os.replace(tmp, folder / filename)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            continue
        return folder / filename
    return None


def _parents_made(folder: Path) -> bool:
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return True


def entries_of(listing: Iterable[tuple[Any, ...]]) -> list[tuple[str, int, int, int]]:
    """The :func:`source_entries` of a run from a listing of its files already made (``(path
    relative to the run, size, mtime_ns, ctime_ns)`` rows; other rows, such as folders, are skipped):
    the dashboard's check of a run lists them before any read."""
    ranks: dict[str, bool] = {}  # folder -> is a rank folder (45,000 rows at 4,096 ranks)
    out: list[tuple[str, int, int, int]] = []
    for row in listing:
        if len(row) != 4 or not isinstance(row[0], str):
            continue
        rel = row[0]
        folder, slash, name = rel.partition("/")
        if not slash:
            keep = rel == RUN_MANIFEST
        elif "/" in name or not (name.endswith(TABLE_SUFFIX) or name in _RANK_FILES):
            keep = False
        else:
            if folder not in ranks:
                ranks[folder] = parse_rank_dirname(folder) is not None
            keep = ranks[folder]
        if keep:
            out.append((rel, int(row[1]), int(row[2]), int(row[3])))
    out.sort()
    return out
