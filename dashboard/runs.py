"""Which runs the dashboard may open, and cached, incremental access to them.

Every run is read through amprobe's loading API: :func:`amprobe.load_run` and
:func:`amprobe.diagnose` for a run as a whole, :func:`amprobe.store.read_table` from a kept
byte offset for the new lines of a live run. Names given by a browser (URL paths, callback
values) are resolved by :func:`resolve_run`, which refuses anything outside ROOT.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path, PurePosixPath
from typing import Any

import pandas as pd

import amprobe
from amprobe.report.sections import build_sections
from amprobe.store import read_table

__all__ = [
    "RunAccessError",
    "LoadedRun",
    "RunSummary",
    "RunCache",
    "LiveTail",
    "TailUpdate",
    "resolve_run",
    "discover_runs",
    "is_run_dir",
]

#: How deep under ROOT run directories are looked for.
MAX_DEPTH = 3
#: A live run's load and diagnosis are reused for this long (its page follows the live tail).
LIVE_RELOAD_S = 10.0
_RUN_MANIFEST = "manifest.json"


class RunAccessError(Exception):
    """A run name that does not name a run directory under ROOT; the message is one line."""


def is_run_dir(path: Path) -> bool:
    """True when ``path`` looks like an amprobe run directory (a manifest or a rank folder)."""
    try:
        if (path / _RUN_MANIFEST).is_file():
            return True
        return any(
            p.name.startswith("rank") and p.name[4:].isdigit() and (p / _RUN_MANIFEST).is_file()
            for p in path.iterdir()
        )
    except OSError:
        return False


def resolve_run(root: Path, name: str) -> Path:
    """The directory of run ``name`` (a path relative to ``root``), refusing traversal.

    Raises:
        RunAccessError: the name is absolute, climbs out of ``root`` (``..`` or a symlink
            that resolves elsewhere), or does not name a run directory.
    """
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise RunAccessError("no run selected")
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise RunAccessError(f"not a run under the dashboard's root: {name!r}")
    base = root.resolve()
    path = (base / rel).resolve()
    if path != base and base not in path.parents:
        raise RunAccessError(f"not a run under the dashboard's root: {name!r}")
    if not path.is_dir() or not is_run_dir(path):
        raise RunAccessError(f"no run named {name!r} under the dashboard's root")
    return path


def discover_runs(root: Path, max_depth: int = MAX_DEPTH) -> list[str]:
    """Names (relative POSIX paths) of the run directories under ``root``, sorted.

    A run directory is not searched further; hidden folders and symlinks that leave
    ``root`` are skipped.
    """
    base = root.resolve()
    found: list[str] = []

    def walk(path: Path, depth: int) -> None:
        if is_run_dir(path):
            rel = path.relative_to(base).as_posix()
            found.append(rel if rel != "." else ".")
            return
        if depth >= max_depth:
            return
        try:
            children = sorted(
                p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")
            )
        except OSError:
            return
        for child in children:
            real = child.resolve()
            if real != base and base in real.parents:
                walk(child, depth + 1)

    walk(base, 0)
    return sorted(found)


def _signature(path: Path) -> tuple[Any, ...]:
    """Sizes and mtimes of a run's files: changes whenever the run is written."""
    sig: list[Any] = []
    try:
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            if entry.is_dir():
                for sub in sorted(os.scandir(entry.path), key=lambda e: e.name):
                    st = sub.stat()
                    sig.append((entry.name, sub.name, st.st_size, st.st_mtime_ns))
            else:
                st = entry.stat()
                sig.append((entry.name, st.st_size, st.st_mtime_ns))
    except OSError:
        pass
    return tuple(sig)


@dataclasses.dataclass
class LoadedRun:
    """A run as the dashboard shows it: the loaded run, its diagnosis, its report sections."""

    name: str
    run: amprobe.Run
    diagnosis: amprobe.Diagnosis
    _sections: list[Any] | None = None

    @property
    def sections(self) -> list[Any]:
        """The registered report sections, built once per load."""
        if self._sections is None:
            self._sections = build_sections(self.run, self.diagnosis)
        return self._sections


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """One row of the run list."""

    name: str
    status: str
    device: str
    dtype: str
    steps: int
    worst: str  # "error AMP-N03", "none", or "" when the run could not be read
    error: str | None = None


def _autocast_dtype(run: amprobe.Run) -> str:
    steps = run.steps
    if len(steps) and "autocast_dtype" in steps:
        values = steps["autocast_dtype"].dropna().unique()
        if len(values):
            return ", ".join(sorted(str(v) for v in values))
    for event in run.events_of("autocast_seen"):
        if event.get("enabled") and event.get("dtype"):
            return str(event["dtype"])
    return "not recorded"


def summarize(name: str, loaded: LoadedRun) -> RunSummary:
    run, diagnosis = loaded.run, loaded.diagnosis
    steps = run.steps
    device = run.rank_manifest.get("gpu_name") or run.rank_manifest.get("device") or "not recorded"
    if diagnosis.findings:
        first = diagnosis.findings[0]
        worst = f"{first.severity} {first.id}"
    else:
        worst = "none"
    return RunSummary(
        name=name,
        status=run.status,
        device=str(device),
        dtype=_autocast_dtype(run),
        steps=int(steps["step"].nunique()) if len(steps) else 0,
        worst=worst,
    )


class RunCache:
    """Loaded and diagnosed runs, kept until their files change (least recently used first out).

    A live run changes at every flush; it is loaded and diagnosed again at most every
    :data:`LIVE_RELOAD_S` seconds (its page's figures follow :class:`LiveTail` meanwhile).
    """

    def __init__(self, root: Path, max_entries: int = 8) -> None:
        self.root = Path(root)
        self.max_entries = max_entries
        self._entries: OrderedDict[Path, tuple[tuple[Any, ...], LoadedRun, float]] = OrderedDict()
        self._summaries: dict[Path, tuple[tuple[Any, ...], RunSummary]] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> LoadedRun:
        """Load (or reuse) run ``name``.

        Raises:
            RunAccessError: the name is not a run under ROOT.
            amprobe.RunLoadError: the run cannot be read.
        """
        path = resolve_run(self.root, name)
        sig = _signature(path)
        with self._lock:
            hit = self._entries.get(path)
            if hit is not None:
                live = hit[1].run.status == "live"
                fresh = time.monotonic() - hit[2] < LIVE_RELOAD_S
                if (hit[0] == sig and not live) or (live and fresh):
                    self._entries.move_to_end(path)
                    return hit[1]
        run = amprobe.load_run(path)
        loaded = LoadedRun(name=name, run=run, diagnosis=amprobe.diagnose(run))
        with self._lock:
            self._entries[path] = (sig, loaded, time.monotonic())
            self._entries.move_to_end(path)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return loaded

    def summaries(self) -> list[RunSummary]:
        """A summary of every run under ROOT; unreadable runs say why."""
        out = []
        for name in discover_runs(self.root):
            try:
                path = resolve_run(self.root, name)
            except RunAccessError as exc:
                out.append(RunSummary(name, "unreadable", "", "", 0, "", error=str(exc)))
                continue
            sig = _signature(path)
            hit = self._summaries.get(path)
            if hit is not None and hit[0] == sig and hit[1].status != "live":
                out.append(hit[1])
                continue
            try:
                summary = summarize(name, self.get(name))
            except (amprobe.RunLoadError, RunAccessError) as exc:
                summary = RunSummary(name, "unreadable", "", "", 0, "", error=str(exc))
            self._summaries[path] = (sig, summary)
            out.append(summary)
        return out


@dataclasses.dataclass(frozen=True)
class TailUpdate:
    """What one poll of a live run found."""

    steps: pd.DataFrame  # every step read so far, all ranks, with a ``rank`` column
    new_rows: int
    status: str


@dataclasses.dataclass
class _TailState:
    offsets: dict[int, int]
    frames: list[pd.DataFrame]


class LiveTail:
    """Reads only the new lines of each rank's ``steps.jsonl`` of the runs being watched.

    Per run it keeps a byte offset per rank; a poll reads from there with
    :func:`amprobe.store.read_table` (which leaves an unterminated last line for the next
    poll), so a run is read once in full, at its first poll, and then only by its growth.
    """

    TABLE = "steps"

    def __init__(self, max_runs: int = 16) -> None:
        self.max_runs = max_runs
        self._state: OrderedDict[Path, _TailState] = OrderedDict()
        self._lock = threading.Lock()

    def offsets(self, path: Path) -> dict[int, int]:
        """The byte offsets kept for run ``path`` (rank -> offset)."""
        state = self._state.get(Path(path))
        return dict(state.offsets) if state else {}

    def poll(self, path: Path) -> TailUpdate:
        """Read the steps appended to run ``path`` since the last poll.

        Raises:
            amprobe.RunLoadError: the run can no longer be read.
        """
        path = Path(path)
        run = amprobe.load_run(path)  # manifests and end markers only: tables load lazily
        with self._lock:
            state = self._state.setdefault(path, _TailState(offsets={}, frames=[]))
            self._state.move_to_end(path)
            while len(self._state) > self.max_runs:
                self._state.popitem(last=False)
            new_rows = 0
            for info in run.ranks:
                start = state.offsets.get(info.rank, 0)
                frame, nxt, _ = read_table(info.path / f"{self.TABLE}.jsonl", self.TABLE, start)
                state.offsets[info.rank] = nxt
                if len(frame):
                    frame.insert(0, "rank", info.rank)
                    state.frames.append(frame)
                    new_rows += len(frame)
            if len(state.frames) > 1:
                state.frames = [pd.concat(state.frames, ignore_index=True)]
            steps = state.frames[0] if state.frames else pd.DataFrame(columns=["rank", "step"])
        return TailUpdate(steps=steps, new_rows=new_rows, status=run.status)
