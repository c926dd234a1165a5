"""Which runs the dashboard may open, and cached, isolated, incremental access to them.

Every run is read through amprobe's loading API: :func:`amprobe.load_run` and
:func:`amprobe.diagnose` for a run as a whole (its diagnosis kept in the run's derived files
and read back while the run is unchanged: :func:`amprobe.rules.cache.diagnose_cached`),
:func:`amprobe.store.read_table` from a kept byte offset for the new lines of a live run. Names given by a browser (URL paths, callback
values) are resolved by :func:`resolve_run`, which refuses anything outside ROOT.

A run directory is written by a training job, which the dashboard does not trust: before any
of a run's files is read, :func:`inspect_run` checks every file the loader could open (regular
files only, within size limits, no symbolic link that leaves ROOT). One bad run becomes one
"unreadable" row that says why; it never takes the run list down.

The run list is built for large roots: :meth:`RunCache.page` lists one page of runs from their
manifests and end markers only (a few small reads per run), and the full load and diagnosis of
the rows shown runs in background threads, cached by the files' sizes and mtimes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import json
import os
import queue
import stat
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import amprobe
from amprobe.analysis.overview import distinct_step_count, run_period, run_times
from amprobe.report.scale import many_ranks, many_relations
from amprobe.report.sections import Section, build_section, section_tabs
from amprobe.rules.cache import diagnose_cached, run_facts
from amprobe.rules.engine import Severity
from amprobe.store.artifacts import entries_of
from amprobe.store.layout import (
    END_MARKER,
    RANK_MANIFEST,
    RUN_MANIFEST,
    STATUS_ORDER,
    TABLE_SUFFIX,
    file_kind,
    is_run_dir,
    looks_like_rank_dirname,
    open_regular,
    parse_rank_dirname,
    read_json_file,
    status_of,
    table_filename,
)

__all__ = [
    "RunAccessError",
    "LoadedRun",
    "RunSummary",
    "RunPage",
    "RunCache",
    "LiveTail",
    "TailUpdate",
    "resolve_run",
    "inspect_run",
    "discover_runs",
    "PENDING",
    "SORT_KEYS",
]

#: How deep under ROOT run directories are looked for.
MAX_DEPTH = 3
#: A live run's run list row is diagnosed again at most this often.
LIVE_RELOAD_S = 10.0
#: A live run's page: its run is loaded and diagnosed again, when its files changed, at most
#: this often by default (:class:`dashboard.callbacks.Context` ties it to the refresh interval) ...
LIVE_REDIAGNOSE_S = 2.0
#: ... and no sooner than this many times the last load, diagnosis and page build took, so that
#: one live run's page keeps at most about a third of a core busy however large the run grows.
LIVE_COST_FACTOR = 3.0
#: A run of this many ranks or more, once its summaries are read for its tabs, is frozen out of
#: the garbage collector (:meth:`LoadedRun.prepared`); below it a full collection costs little.
FREEZE_MIN_RANKS = 512
#: Manifests and end markers are small; a larger one is not amprobe's and is not read.
MAX_JSON_BYTES = 1 << 20
#: The largest table file (``*.jsonl``) the dashboard loads; ``amprobe diagnose`` reads any size.
MAX_TABLE_BYTES = 512 << 20
#: Runs per page of the run list.
PAGE_ROWS = 50
#: Threads that load and diagnose the run list's rows in the background.
DIAGNOSE_WORKERS = 1
#: How long a run list request waits for its rows' diagnoses before showing them as pending.
FIRST_WAIT_S = 0.3
#: ... and only when at most this many rows wait (more would not be done in time anyway).
_FIRST_WAIT_ROWS = 8
#: The run list's text for a row whose diagnosis has not finished yet.
PENDING = "diagnosing\u2026"
#: The longest reason shown in an unreadable row.
_MAX_REASON_CHARS = 300
#: the files the loader reads: manifests and end markers, and the tables
_READ_SUFFIXES = (".json", TABLE_SUFFIX)


class RunAccessError(Exception):
    """A run the dashboard will not or cannot open; the message is one line that says why."""


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
    if not path.is_dir() or not is_run_dir(path, untrusted=True):
        raise RunAccessError(f"no run named {name!r} under the dashboard's root")
    return path


def discover_runs(root: Path, max_depth: int = MAX_DEPTH) -> list[str]:
    """Names (relative POSIX paths) of the run directories under ``root``, sorted.

    A run directory is not searched further; hidden folders and symlinks that leave
    ``root`` are skipped. Costs a few ``stat`` calls per folder and one small read per run.
    """
    base = root.resolve()
    found: list[str] = []

    def walk(path: Path, depth: int) -> None:
        if is_run_dir(path, untrusted=True):
            rel = path.relative_to(base).as_posix()
            found.append(rel if rel != "." else ".")
            return
        if depth >= max_depth:
            return
        try:
            children = sorted(
                (Path(e.path), e.is_symlink())
                for e in os.scandir(path)
                if not e.name.startswith(".") and e.is_dir()
            )
        except OSError:
            return
        for child, link in children:
            if link:  # only a link can lead out of ROOT: its parent is inside
                try:
                    real = child.resolve()
                except (OSError, RuntimeError):
                    continue
                if real == base or base not in real.parents:
                    continue
            walk(child, depth + 1)

    walk(base, 0)
    return sorted(found)


def _within(base: Path, real: Path) -> bool:
    return real == base or base in real.parents


def _stat_inside(base: Path, path: str | Path, rel: str) -> os.stat_result:
    """``stat`` of ``path``, following a symbolic link only when it stays under ``base``."""
    try:
        st = os.lstat(path)  # a string: no Path built for each of a large run's files
    except OSError as exc:
        raise RunAccessError(f"cannot read {rel}: {exc.strerror or exc}") from None
    if not stat.S_ISLNK(st.st_mode):
        return st
    try:
        real = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):
        raise RunAccessError(f"{rel} is a broken or looping symbolic link") from None
    if not _within(base, real):
        raise RunAccessError(
            f"{rel} is a symbolic link that leaves the dashboard's root; not followed"
        )
    try:
        return os.stat(real)
    except OSError as exc:
        raise RunAccessError(f"cannot read {rel}: {exc.strerror or exc}") from None


def _check_file(st: os.stat_result, rel: str, max_table_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise RunAccessError(f"{rel} is {file_kind(st.st_mode)}, not a regular file")
    limit = MAX_JSON_BYTES if rel.endswith(".json") else max_table_bytes
    if st.st_size > limit:
        raise RunAccessError(
            f"{rel} holds {st.st_size / 1e6:.0f} MB, more than the dashboard reads "
            f"({limit / 1e6:.0f} MB); `amprobe diagnose` reads it"
        )


def inspect_run(root: Path, path: Path, max_table_bytes: int = MAX_TABLE_BYTES) -> tuple[Any, ...]:
    """Check every file of run ``path`` the loader could open, before anything is read.

    Looks at the run folder, its rank folders and the ``*.json``/``*.jsonl`` files in them
    (``lstat``/``stat`` only: nothing is opened, so a FIFO cannot block and ``/dev/zero``
    cannot be read). Returns the run's signature (names, sizes, mtimes and ctimes), which changes
    whenever the run is written.

    Raises:
        RunAccessError: a symbolic link that leaves ``root``, a file that is not a regular
            file (FIFO, device, socket, folder), a file above the size limits, or a folder
            that cannot be listed; the message names the file.
    """
    base = Path(root).resolve()
    sig: list[Any] = []

    def scan(folder: str | Path, prefix: str) -> list[os.DirEntry[str]]:
        try:
            return sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            raise RunAccessError(f"cannot list {prefix or '.'}: {exc.strerror or exc}") from None

    # paths as strings: 4,096 ranks are some 45,000 files, checked at every callback of a page
    for entry in scan(path, ""):
        name = entry.name
        if looks_like_rank_dirname(name):  # all a loader might take for a rank are checked
            st = _stat_inside(base, entry.path, name)
            if not stat.S_ISDIR(st.st_mode):
                continue  # the loader reads rank folders only
            sig.append((name, "/"))
            for sub in scan(entry.path, name):
                if not sub.name.endswith(_READ_SUFFIXES):
                    continue
                rel = f"{name}/{sub.name}"
                st = _stat_inside(base, sub.path, rel)
                _check_file(st, rel, max_table_bytes)
                sig.append((rel, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        elif name.endswith(_READ_SUFFIXES):
            st = _stat_inside(base, entry.path, name)
            _check_file(st, name, max_table_bytes)
            sig.append((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(sig)


def _read_small_json(path: Path) -> dict[str, Any] | None:
    """A manifest or end marker, read non-blocking as a small regular file, or None if unusable."""
    try:
        return read_json_file(path, max_bytes=MAX_JSON_BYTES)
    except (OSError, ValueError):
        return None


def _first_record(path: Path, limit: int = 1 << 16) -> dict[str, Any] | None:
    """The first record of a JSON Lines file, reading at most ``limit`` bytes."""
    try:
        with open_regular(path) as fh:
            head = fh.read(limit)
        line, newline, _ = head.partition(b"\n")
        obj = json.loads(line) if newline else None
    except (OSError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _text_field(obj: dict[str, Any] | None, *keys: str) -> str | None:
    """The first of ``keys`` holding a non-empty string (a damaged field of another type is skipped)."""
    for key in keys:
        value = (obj or {}).get(key)
        if isinstance(value, str) and value:
            return value
    return None


_T = TypeVar("_T")
#: LoadedRun versions: a run loaded again gets a new one (a live page re-renders on a change)
_VERSIONS = itertools.count(1)


def _part_name(key: Hashable) -> str:
    if isinstance(key, tuple):
        return "/".join(_part_name(k) for k in key)
    return str(key)


@dataclasses.dataclass
class LoadedRun:
    """A run as the dashboard shows it: the loaded run, its diagnosis, its report sections.

    One LoadedRun is one version of a run (``version`` is new at every load), so what is built
    from it is kept on it: :meth:`section` builds a report section when first asked for, and
    :meth:`part` keeps any built piece of the page. ``builds`` counts what was built, by key.
    """

    name: str
    run: amprobe.Run
    diagnosis: amprobe.Diagnosis
    version: int = dataclasses.field(default_factory=lambda: next(_VERSIONS))
    builds: Counter[str] = dataclasses.field(default_factory=Counter)
    #: seconds spent building pieces of this version (a live run's next load waits for it too)
    build_s: float = 0.0
    _sections: dict[str, Section | None] = dataclasses.field(default_factory=dict, repr=False)
    _parts: dict[Hashable, Any] = dataclasses.field(default_factory=dict, repr=False)
    _locks: dict[Hashable, threading.Lock] = dataclasses.field(default_factory=dict, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    _prepare_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    _prepared: bool = dataclasses.field(default=False, repr=False)
    _prepare_started: bool = dataclasses.field(default=False, repr=False)

    def part(self, key: Hashable, build: Callable[[], _T]) -> _T:
        """The piece ``key`` of this run version, built by ``build()`` the first time only.

        Pieces are built one at a time per key (two requests for one piece build it once);
        different pieces build side by side.
        """
        with self._lock:
            if key in self._parts:
                return self._parts[key]  # type: ignore[no-any-return]
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            with self._lock:
                if key in self._parts:
                    return self._parts[key]  # type: ignore[no-any-return]
            start = time.monotonic()
            value = build()
            with self._lock:
                self._parts[key] = value
                self.builds[_part_name(key)] += 1
                self.build_s += time.monotonic() - start
        return value

    def prepared(self) -> LoadedRun:
        """This run version, once what every tab reads is read: each rank's summary (the
        diagnosis read them already, unless it came from the cache: then the run page's
        findings were drawn without them) and, for a finished run of many ranks, its derived store
        opened (:func:`amprobe.report.scale.many_relations`). Done once, and not counted in :attr:`builds`; a
        second caller waits for the first (the page starts it in the background:
        :meth:`prepare_in_background`).

        A run of :data:`FREEZE_MIN_RANKS` ranks or more that is not live has its objects
        frozen out of the garbage collector then (``gc.freeze``): the first full collection
        after thousands of ranks' summaries were read walked millions of objects (3.2 s of
        CPU at 4,096 ranks, on whichever callback came next). Summaries hold no reference
        cycles, so they are freed by reference counting when the run is dropped, frozen or
        not. A live run, loaded again every few seconds, is not frozen."""
        if self._prepared:
            return self
        with self._prepare_lock:
            if not self._prepared:
                self.run.summaries()
                settled = self.run.status != "live"
                if settled and many_ranks([info.rank for info in self.run.ranks]):
                    # the derived store's freshness check and engine (2-3 s at 4,096 ranks),
                    # which the first tab drawn from the store would pay; a failure is met
                    # again, and shown, by that tab
                    with contextlib.suppress(Exception):
                        many_relations(self.run)
                if settled and len(self.run.ranks) >= FREEZE_MIN_RANKS:
                    gc.freeze()
                self._prepared = True
        return self

    def prepare_in_background(self) -> None:
        """Start :meth:`prepared` in a daemon thread, once (a failure is met again, and shown,
        by the tab that needs the run)."""
        with self._lock:
            if self._prepared or self._prepare_started:
                return
            self._prepare_started = True

        def work() -> None:
            with contextlib.suppress(Exception):
                self.prepared()

        threading.Thread(target=work, name="amprobe-prepare", daemon=True).start()

    def section(self, key: str) -> Section | None:
        """Report section ``key`` (None: it builds nothing for this run), built once."""
        return self.part(("section", key), lambda: build_section(key, self.run, self.diagnosis))

    @property
    def sections(self) -> list[Section]:
        """Every registered report section that has something for this run, in report order."""
        return [s for key, _ in section_tabs() if (s := self.section(key)) is not None]


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """One row of the run list.

    ``steps`` is None and ``worst`` is :data:`PENDING` while the row's diagnosis runs;
    ``error`` says why a run is unreadable (``status`` is then ``"unreadable"``).
    ``started`` is the Unix time its first rank started (the rank manifests' ``start_unix``, else
    the run manifest's ``created_unix``); ``duration_s`` runs from there to the last rank's end
    (``end_unix`` of the end markers), or, while a rank has not ended (``duration_open``), to the
    last step recorded so far; None when not recorded.
    """

    name: str
    status: str
    device: str
    dtype: str
    steps: int | None
    worst: str  # "error AMP-N05 forward-overflow (+2 more)", "none", PENDING, or "" if unreadable
    error: str | None = None
    started: float | None = None
    duration_s: float | None = None
    duration_open: bool = False
    #: the worst finding's severity rank (0 the most severe, one past the last for "none"),
    #: None while pending or unreadable: the run list sorts by it
    worst_rank: int | None = None

    @property
    def pending(self) -> bool:
        return self.worst == PENDING


def _unreadable(
    name: str, why: str, started: float | None = None, duration_s: float | None = None
) -> RunSummary:
    why = " ".join(str(why).split())
    if len(why) > _MAX_REASON_CHARS:
        why = why[: _MAX_REASON_CHARS - 1] + "\u2026"
    return RunSummary(
        name, "unreadable", "", "", 0, "", error=why, started=started, duration_s=duration_s
    )


def _internal_error(exc: BaseException) -> str:
    return (
        f"amprobe failed while reading this run ({type(exc).__name__}: {exc}); "
        "`amprobe diagnose` on it says more"
    )


@dataclasses.dataclass(frozen=True)
class RunPage:
    """One page of the run list."""

    rows: list[RunSummary]
    page: int  # 1-based, clamped to 1..pages
    pages: int
    total: int  # runs under ROOT
    matched: int | None = None  # runs whose name holds ``search`` (None: every run)
    search: str = ""  # the search text, as matched (casefolded)
    #: matching runs not diagnosed yet when a sort needs their diagnosis (they sort last until
    #: their diagnosis, queued, comes)
    undiagnosed: int = 0


def _text_key(value: str) -> str | None:
    return None if not value or value in (PENDING, "not recorded") else value.casefold()


#: How the run list can be sorted: column -> the row's sort value (None: not known, sorts last).
SORT_KEYS: dict[str, Callable[[RunSummary], Any]] = {
    "run": lambda r: r.name,
    "status": lambda r: STATUS_ORDER.index(r.status) if r.status in STATUS_ORDER else None,
    "started": lambda r: r.started,
    "duration": lambda r: r.duration_s,
    "steps": lambda r: None if r.error else r.steps,
    "device": lambda r: _text_key(r.device),
    "dtype": lambda r: _text_key(r.dtype),
    "worst": lambda r: None if r.worst_rank is None else (r.worst_rank, r.worst),
}


def summarize(name: str, loaded: LoadedRun) -> RunSummary:
    """The run list's row of a loaded, diagnosed run.

    Read from the facts kept with the run's diagnosis (:func:`amprobe.rules.cache.run_facts`:
    from the cached diagnosis, or the per-rank summaries), the manifests and the end of each
    open rank's steps file (:mod:`amprobe.analysis.overview`), never every rank's steps table.
    A run that
    recorded no readable step although it wrote step records (or its end marker counts steps)
    is unreadable, with the reason, not "finished, 0 steps".
    """
    run, diagnosis = loaded.run, loaded.diagnosis
    facts = run_facts(diagnosis)  # kept with a cached diagnosis: no summary read
    started, duration, still_open = run_period(run)
    steps = facts["steps"]
    if not steps:
        lost = facts["lost_steps"]
        if lost:
            return _unreadable(name, "no readable step record: " + "; ".join(lost), started)
    device = _text_field(run.rank_manifest, "gpu_name", "device") or "not recorded"
    severity = diagnosis.worst()
    if severity is not None:
        # the most severe finding, the first of them in the diagnosis's (cause-first) order
        first = next(f for f in diagnosis.findings if f.severity == severity)
        more = len(diagnosis.findings) - 1
        worst = f"{first.severity} {first.id} {first.name}" + (f" (+{more} more)" if more else "")
        worst_rank = Severity(severity).rank
    else:
        worst = "none"
        worst_rank = len(Severity)
    return RunSummary(
        name=name,
        status=run.status,
        device=device,
        dtype=facts["dtype"],
        steps=steps,
        worst=worst,
        started=started,
        duration_s=duration,
        duration_open=still_open,
        worst_rank=worst_rank,
    )


def peek_run(name: str, path: Path) -> RunSummary:
    """A run list row from manifests, end markers and one line of steps: no full load.

    The run must have passed :func:`inspect_run`. Status, device, autocast dtype, start time and
    (for an ended run) duration come from small reads; the step count (when no end marker gives it) and the worst finding wait for
    the background diagnosis (:data:`PENDING`).

    Raises:
        RunAccessError: the run has no rank folder.
    """
    ranks: list[tuple[int, Path]] = []
    odd: list[str] = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        rank = parse_rank_dirname(entry.name)
        if rank is not None and entry.is_dir():
            ranks.append((rank, Path(entry.path)))
        elif looks_like_rank_dirname(entry.name):
            odd.append(entry.name)
    if not ranks:
        why = "no rank folder (rank0, rank1, ...)"
        if odd:
            why += f"; {', '.join(repr(n) for n in odd)} is not one: rank numbers use ASCII digits"
        raise RunAccessError(why)
    ranks.sort()
    statuses = set()
    device = dtype = None
    steps: int | None = None
    times: list[tuple[Any, Any, float | None]] = []
    for i, (_, folder) in enumerate(ranks):
        ended = (folder / END_MARKER).exists()
        manifest = _read_small_json(folder / RANK_MANIFEST)
        end = (_read_small_json(folder / END_MARKER) or {}) if ended else None
        times.append((manifest, end, None))
        if i == 0:
            device = _text_field(manifest, "gpu_name", "device")
            dtype = _text_field(_first_record(folder / table_filename("steps")), "autocast_dtype")
            value = (end or {}).get("steps")
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                steps = value
        # as the loader does: a rank of another host or a gone process reads as interrupted
        statuses.add(status_of(manifest or {}, end))
    status = next(s for s in STATUS_ORDER if s in statuses)
    started, duration, still_open = run_times(_read_small_json(path / RUN_MANIFEST), times)
    return RunSummary(
        name=name,
        status=status,
        device=device or "not recorded",
        dtype=dtype or PENDING,
        steps=None if status == "live" else steps,
        worst=PENDING,
        started=started,
        duration_s=duration,
        duration_open=still_open,
    )


def _diagnosis(run: amprobe.Run, signature: tuple[Any, ...]) -> amprobe.Diagnosis:
    """The run's diagnosis: the one kept in its derived files when the run has not changed
    since it was made (:func:`amprobe.rules.cache.diagnose_cached`; ``signature``, its files as
    :func:`inspect_run` listed them before the run was loaded, gives the key), else diagnosed
    and kept. A live run is diagnosed, never kept."""
    return diagnose_cached(
        run,
        sources=entries_of(signature),
        compute=lambda r: amprobe.diagnose(r),  # looked up at the call: tests replace it
    )


@dataclasses.dataclass(frozen=True)
class _Entry:
    """A kept load: the files' signature it read, the run, when it was loaded, what it cost."""

    signature: tuple[Any, ...]
    loaded: LoadedRun
    loaded_at: float
    cost_s: float


class RunCache:
    """Runs under ROOT: the paged run list and loaded, diagnosed runs, kept until they change.

    Loaded runs are kept least recently used first out (``max_entries``). A finished run is
    loaded again only when its files change. A live run changes at every flush: its page loads
    and diagnoses it again when its files changed, at most every ``live_reload_s`` seconds and
    no sooner than :data:`LIVE_COST_FACTOR` times what its last version cost (load, diagnosis,
    the pieces of its page built); at once when it is no
    longer live (it finished, or its process is gone). Run list rows are diagnosed by
    ``workers`` daemon threads, the rows of the page asked for last first; rows of pages paged
    away from are not diagnosed.
    """

    def __init__(
        self,
        root: Path,
        max_entries: int = 8,
        workers: int = DIAGNOSE_WORKERS,
        max_table_bytes: int = MAX_TABLE_BYTES,
        first_wait_s: float = FIRST_WAIT_S,
        live_reload_s: float = LIVE_REDIAGNOSE_S,
        tail: LiveTail | None = None,
    ) -> None:
        self.root = Path(root)
        #: the live runs' polls: a live run loaded again takes its summaries from there
        self.tail = tail
        self.max_entries = max_entries
        self.workers = workers
        self.max_table_bytes = max_table_bytes
        self.first_wait_s = first_wait_s
        self.live_reload_s = live_reload_s
        self._entries: OrderedDict[Path, _Entry] = OrderedDict()
        #: name -> (signature, row, when): rows of diagnosed runs
        self._rows: dict[str, tuple[tuple[Any, ...], RunSummary, float]] = {}
        #: name -> (signature, row): rows read from manifests only
        self._peeks: dict[str, tuple[tuple[Any, ...], RunSummary]] = {}
        self._pending: dict[str, tuple[Any, ...]] = {}
        #: the rows of the page asked for last: queued jobs for other rows are dropped
        self._wanted: frozenset[str] = frozenset()
        self._jobs: queue.LifoQueue[tuple[str, Path, tuple[Any, ...]]] = queue.LifoQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    def check(self, name: str) -> tuple[Path, tuple[Any, ...]]:
        """Run ``name``'s folder and signature, once :func:`inspect_run` has passed it.

        Raises:
            RunAccessError: the name is not a run under ROOT, or the run is refused.
        """
        path = resolve_run(self.root, name)
        return path, inspect_run(self.root, path, self.max_table_bytes)

    def _reusable(
        self, path: Path, sig: tuple[Any, ...], hit: _Entry, status: str | None = None
    ) -> bool:
        """Whether the kept load of ``path`` still shows what the run holds, or may for now.
        ``status``: the run's status as just polled (None: read from its manifests)."""
        if hit.loaded.run.status != "live":
            return hit.signature == sig
        # a live run: unchanged files, or changed within the wait, while it is still live
        if hit.signature != sig:
            cost = hit.cost_s + hit.loaded.build_s  # the load, the diagnosis, the page built
            wait = max(self.live_reload_s, LIVE_COST_FACTOR * cost)
            if time.monotonic() - hit.loaded_at >= wait:
                return False
        if status is None and self.tail is not None:  # the live tick's poll, when recent
            status = self.tail.status(path, max(self.live_reload_s, 1.0))
        if status is not None:
            return status == "live"
        try:  # manifests and end markers only: has the run ended (or its process gone)?
            return amprobe.load_run(path).status == "live"
        except Exception:
            return False  # the full load says why

    def loaded(self, path: Path) -> amprobe.Run | None:
        """The run kept for folder ``path`` (resolved), as last loaded, unchecked; or None."""
        with self._lock:
            hit = self._entries.get(Path(path))
        return hit.loaded.run if hit is not None else None

    def get(self, name: str, status: str | None = None) -> LoadedRun:
        """Load (or reuse) run ``name``. ``status``: its status as a live tick just polled it.

        A live run loaded again reads only what was appended since the last read of it (the
        live tick's, else the kept load's): :meth:`amprobe.Run.adopt_summaries`.

        Raises:
            RunAccessError: the name is not a run under ROOT, the run is refused, or amprobe
                failed on it.
            amprobe.RunLoadError: the run cannot be read.
        """
        path, sig = self.check(name)
        with self._lock:
            hit = self._entries.get(path)
        if hit is not None and self._reusable(path, sig, hit, status):
            with self._lock:
                if path in self._entries:
                    self._entries.move_to_end(path)
            return hit.loaded
        start = time.monotonic()
        try:
            run = amprobe.load_run(path)
            if hit is not None and hit.loaded.run.status == "live":
                polled = self.tail.run_of(path) if self.tail is not None else None
                run.adopt_summaries(polled or hit.loaded.run)
            loaded = LoadedRun(name=name, run=run, diagnosis=_diagnosis(run, sig))
            if run.status != "live" and not getattr(loaded.diagnosis, "from_cache", False):
                loaded.prepared()  # diagnosed: the summaries are read; frozen (large runs)
            row = summarize(name, loaded)
        except (amprobe.RunLoadError, RunAccessError):
            raise
        except Exception as exc:
            raise RunAccessError(_internal_error(exc)) from None
        now = time.monotonic()
        with self._lock:
            self._entries[path] = _Entry(sig, loaded, now, now - start)
            self._entries.move_to_end(path)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            self._rows[name] = (sig, row, now)
        return loaded

    # -- the run list ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every run under ROOT (see :func:`discover_runs`)."""
        return discover_runs(self.root)

    def page(
        self,
        page: int | None = 1,
        page_size: int = PAGE_ROWS,
        sort: str | None = None,
        descending: bool = False,
        search: str | None = None,
    ) -> RunPage:
        """One page of the run list, from manifests; its rows' diagnoses are queued.

        Args:
            page: 1-based, clamped to the pages there are.
            page_size: runs per page.
            sort: a key of :data:`SORT_KEYS` (None: by name). Sorting by another column reads
                every matching run's manifests (cached by signature); a row whose value is not
                known yet (pending, unreadable, not recorded) sorts last either way.
            descending: sort the other way round.
            search: keep the runs whose name holds this text (case-insensitive).

        When only a few rows wait, waits up to ``first_wait_s`` for their diagnoses, so a small
        root shows finished rows at once; a large one shows :data:`PENDING` rows at once, which
        the next refresh fills in.
        """
        every = self.names()
        needle = (search or "").strip().casefold()
        names = [n for n in every if needle in n.casefold()] if needle else every
        undiagnosed: list[str] = []  # pending rows the sort needs the diagnosis of
        if descending and sort in (None, "run"):
            names = names[::-1]
        elif sort in SORT_KEYS and sort != "run":
            key = SORT_KEYS[sort]
            known: list[tuple[Any, str]] = []
            unknown: list[str] = []
            for name in names:
                row = self._row(name, queue_job=False)
                value = key(row)
                if value is None:
                    unknown.append(name)
                    if row.pending:
                        undiagnosed.append(name)
                else:
                    known.append((value, name))
            known.sort(key=lambda pair: pair[0], reverse=descending)
            names = [name for _, name in known] + unknown
        pages = max(1, -(-len(names) // page_size))
        number = min(max(int(page or 1), 1), pages)
        shown = names[(number - 1) * page_size : number * page_size]
        # the sort is not complete until every row is diagnosed: queue the rows it lacks (the
        # one background queue, after the page's own rows: it serves the last queued first)
        on_page = set(shown)
        self._wanted = frozenset(shown) | frozenset(undiagnosed)
        for name in undiagnosed:
            if name not in on_page:
                self._row(name)
        rows = [self._row(name) for name in shown]
        pending = sum(r.pending for r in rows)
        if self.first_wait_s > 0 and 0 < pending <= _FIRST_WAIT_ROWS:
            self.wait_idle(self.first_wait_s)
            rows = [
                self._row(name, queue_job=False) if r.pending else r
                for name, r in zip(shown, rows, strict=True)
            ]
        return RunPage(
            rows=rows,
            page=number,
            pages=pages,
            total=len(every),
            matched=len(names),
            search=needle,
            undiagnosed=sum(n not in on_page for n in undiagnosed)
            + sum(r.pending for r in rows if r.name in set(undiagnosed)),
        )

    def _row(self, name: str, queue_job: bool = True) -> RunSummary:
        try:
            path, sig = self.check(name)
        except RunAccessError as exc:
            return _unreadable(name, str(exc))
        now = time.monotonic()
        with self._lock:
            done = self._rows.get(name)
            peek = self._peeks.get(name)
        if done is not None:
            live = done[1].status == "live"
            if done[0] == sig and not live:
                return done[1]
            if live and now - done[2] < LIVE_RELOAD_S:
                return done[1]
        if peek is not None and peek[0] == sig:
            row = peek[1]
        else:
            try:
                row = peek_run(name, path)
            except RunAccessError as exc:
                row = _unreadable(name, str(exc))
            except Exception as exc:
                row = _unreadable(name, _internal_error(exc))
            with self._lock:
                self._peeks[name] = (sig, row)
        if row.error:
            return row  # refused from its manifests already: nothing to diagnose
        if queue_job:
            self._submit(name, path, sig)
        return done[1] if done is not None else row  # the last diagnosis until the new one

    def _submit(self, name: str, path: Path, sig: tuple[Any, ...]) -> None:
        with self._lock:
            if self._pending.get(name) == sig:
                return
            self._pending[name] = sig
            while len(self._threads) < self.workers:
                thread = threading.Thread(
                    target=self._work, name=f"amprobe-dashboard-{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        self._jobs.put((name, path, sig))

    def _work(self) -> None:
        while True:
            name, path, sig = self._jobs.get()
            with self._lock:
                if self._pending.get(name) != sig:
                    continue  # superseded by a newer job for the same run
                if name not in self._wanted:  # paged away: queued again when shown again
                    del self._pending[name]
                    self._idle.notify_all()
                    continue
            try:
                checked = inspect_run(self.root, path, self.max_table_bytes)
                run = amprobe.load_run(path)
                row = summarize(name, LoadedRun(name, run, _diagnosis(run, checked)))
            except (RunAccessError, amprobe.RunLoadError) as exc:
                row = _unreadable(name, str(exc))
            except Exception as exc:  # one run's failure must not stop the others
                row = _unreadable(name, _internal_error(exc))
            with self._lock:
                self._rows[name] = (sig, row, time.monotonic())
                if self._pending.get(name) == sig:
                    del self._pending[name]
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no run list diagnosis is queued or running; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True


@dataclasses.dataclass(frozen=True)
class TailUpdate:
    """What one poll of a live run found."""

    steps: int  # distinct steps recorded so far, all ranks
    last_step: int | None  # the highest step any rank recorded, None before the first
    status: str
    run: amprobe.Run  # the run as polled (its summaries read to the files' ends)


class LiveTail:
    """Follows the runs being watched through their per-rank summaries, reading only what was
    appended.

    Per run it keeps the :class:`amprobe.Run` of its last poll. A poll reads each rank's
    ``summary.json`` (one small record a rank) and only the bytes of the table files past what
    the last poll read (:meth:`amprobe.Run.adopt_summaries`; an unterminated last line waits
    for the next poll), so a run is read once, at its first poll, and then only by its growth.
    Manifests are read again only when a rank ended or a rank folder came or went; otherwise
    an open rank's status is its process's (``status_of``).
    """

    def __init__(self, max_runs: int = 16) -> None:
        self.max_runs = max_runs
        self._runs: OrderedDict[Path, amprobe.Run] = OrderedDict()
        self._polled: dict[Path, float] = {}  # when each run was last polled (monotonic)
        self._lock = threading.Lock()

    def run_of(self, path: Path) -> amprobe.Run | None:
        """The run as the last poll of ``path`` read it, or None."""
        with self._lock:
            return self._runs.get(Path(path))

    def status(self, path: Path, max_age_s: float) -> str | None:
        """Run ``path``'s status as a poll at most ``max_age_s`` seconds ago found it, or None."""
        with self._lock:
            run, when = self._runs.get(Path(path)), self._polled.get(Path(path))
        if run is None or when is None or time.monotonic() - when > max_age_s:
            return None
        return run.status

    def offsets(self, path: Path, table: str = "steps") -> dict[int, int]:
        """Per rank, the byte offset up to which the last poll of run ``path`` read ``table``."""
        run = self.run_of(path)
        if run is None:
            return {}
        name = table_filename(table)
        return {rank: ends[name] for rank, ends in run.summary_offsets().items() if name in ends}

    def poll(self, path: Path, earlier: amprobe.Run | None = None) -> TailUpdate:
        """Read what was appended to run ``path`` since the last poll (at the first poll: since
        ``earlier``, a load of the run whose summaries were read, when given).

        Raises:
            amprobe.RunLoadError: the run can no longer be read.
        """
        path = Path(path)
        before = self.run_of(path)
        if before is None or _ranks_changed(path, before):
            run = amprobe.load_run(path)  # manifests and end markers only: tables load lazily
        else:  # a new Run over the same ranks: no derived value of the last poll carries over
            statuses = {
                info.status if info.end is not None else status_of(info.manifest, None)
                for info in before.ranks
            }
            run = amprobe.Run(
                path=before.path,
                manifest=before.manifest,
                ranks=before.ranks,
                status=next((s for s in STATUS_ORDER if s in statuses), "finished"),
                warnings=list(before.warnings),
            )
        read_before = before if before is not None else earlier
        if read_before is not None:
            run.adopt_summaries(read_before)
        run.summaries()
        update = TailUpdate(
            steps=distinct_step_count(run), last_step=run.last_step, status=run.status, run=run
        )
        with self._lock:
            self._runs[path] = run
            self._polled[path] = time.monotonic()
            self._runs.move_to_end(path)
            while len(self._runs) > self.max_runs:
                gone, _ = self._runs.popitem(last=False)
                self._polled.pop(gone, None)
        return update


def _ranks_changed(path: Path, run: amprobe.Run) -> bool:
    """Whether run ``path`` has other rank folders than ``run`` read, or an open rank of it
    wrote its end marker since (one listing and a ``stat`` per open rank)."""
    try:
        names = {e.name for e in os.scandir(path) if parse_rank_dirname(e.name) is not None}
    except OSError:
        return True
    if names != {info.path.name for info in run.ranks}:
        return True
    return any(info.end is None and (info.path / END_MARKER).exists() for info in run.ranks)
