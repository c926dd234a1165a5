"""The ``scaler`` summary section: one rank's loss-scale trajectory, GradScaler events and the
autocast dtypes seen (issue #33, docs/design/read-side.md).

Read from ``steps`` and ``events``. A *scaler step* is a steps row with ``scaler_enabled``
true and a known ``scale_before`` (not None, not NaN), as ``analysis.frames.scaler_steps``
selects them. The trajectory is kept as change points, not per step:

- ``updates``: the scaler steps whose ``scale_after`` differs from their ``scale_before``
  (cuts, growth, a NaN ``scale_after``), as ``[step, scale_before, scale_after]``;
- ``jumps``: the scaler steps (not the first) whose ``scale_before`` differs from the previous
  scaler step's ``scale_after`` (a new or reset scaler), as ``[step, prev_after, scale_before]``;
- ``step_runs`` / ``skipped_runs`` / ``found_inf_runs``: the scaler steps, the skipped ones and
  the ones with ``found_inf > 0`` as ``[first, last]`` runs of consecutive step numbers.

With ``first_before`` these give every scaler step's scale before and after. Each list holds at
most :data:`CAP` entries; past that ``complete`` turns false and a reader must take the rank's
rows (``Run.rank_table``) for what the lists would have told. ``ordered`` is false when a
scaler step's number is not above the previous one's (a rank whose windows restart the step
count, or a repeated row): the run-length lists then do not say which row came last, and
readers take that rank's rows too. The loader drops repeated ``(rank, window, step)`` rows; so
does the reader of the summaries (see the "steps" section), which summarizes a rank whose steps
repeat again from its rows without the repeats.

Exact aggregates beside them: scaler step and skipped counts, min/max ``scale_after``, the
length of the leading run of cuts (the calibration), the last growth's row index, the first
:data:`HEAD` scaler steps (step, skipped), every steps row's step as runs (capped like the rest)
and the row count. Events kept: per ``scaler_created`` the last ``init_scale`` and
``growth_interval``, the count, the disabled count and the count per call site; the counts of
``optimizer_state_loaded`` and ``scaler_state_loaded`` (and of non-empty scaler loads); the
dtypes of enabled ``autocast_seen`` regions and of the steps' ``autocast_dtype``.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from typing import Any, ClassVar

from amprobe.store.summary import Section, section

__all__ = ["ScalerSection", "CAP", "HEAD"]

#: Most entries of each change-point or run list kept per rank.
CAP = 256
#: Scaler steps kept from the start of a rank (calibration is shorter than 16; AMP-N10 reads 20).
HEAD = 20
#: Most call sites of ``scaler_created`` counted one by one.
MAX_SITES = 64


def _number(value: Any) -> float | None:
    """A float, or None for a missing, non-numeric or NaN value."""
    if type(value) is float:  # the common case, without the ABC check
        return None if value != value else value
    if value is None or isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return None if math.isnan(value) else value


def _step(value: Any) -> int | None:
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, float)):
        return None
    if isinstance(value, float) and (math.isnan(value) or not value.is_integer()):
        return None
    return int(value)


def _flag(value: Any) -> bool:
    """A boolean column's value: None and NaN (a frame's missing value) are false."""
    return bool(value) and value == value


def _extend_runs(runs: list[list[int]], step: int, cap: int | None = CAP) -> bool:
    """Add ``step`` to ``[first, last]`` runs; False when a new run would pass ``cap``. A step
    inside the last run is already there (steps fed in ascending order give unique runs)."""
    if runs and runs[-1][0] <= step <= runs[-1][1] + 1:
        runs[-1][1] = max(runs[-1][1], step)
        return True
    if cap is not None and len(runs) >= cap:
        return False
    runs.append([step, step])
    return True


def _merge_runs(a: list[list[int]], b: list[list[int]]) -> tuple[list[list[int]], bool]:
    out = [list(r) for r in a]
    for run in b:  # as _extend_runs adds its steps one by one: a run that joins the last grows it
        if out and out[-1][0] <= run[0] <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], run[1])
        elif len(out) >= CAP:
            return out, False
        else:
            out.append(list(run))
    return out, True


def _detail(row: Mapping[str, Any]) -> dict[str, Any]:
    raw = row.get("detail")
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        return {}
    try:
        detail = json.loads(raw)
    except ValueError:
        return {}
    return detail if isinstance(detail, dict) else {}


_EVENT_KINDS = frozenset(
    ("scaler_created", "autocast_seen", "optimizer_state_loaded", "scaler_state_loaded")
)


@section
class ScalerSection(Section):
    """See the module docstring."""

    name: ClassVar[str] = "scaler"
    tables: ClassVar[tuple[str, ...]] = ("steps", "events")

    def __init__(self, uncapped: bool = False) -> None:
        #: None: keep every change point (a reader's section of one rank's rows)
        self.cap: int | None = None if uncapped else CAP
        self.rows = 0  # steps rows with a valid step
        self.all_runs: list[list[int]] = []
        self.n = 0
        self.skipped = 0
        self.first_before: float | None = None
        self.last_step: int | None = None
        self.last_after: float | None = None  # None: NaN or missing
        self.last_after_nan = False
        self.min_after: float | None = None
        self.max_after: float | None = None
        self.leading_cuts = 0
        self.last_growth = -1  # row index among the scaler steps
        self.head: list[list[Any]] = []
        self.updates: list[list[Any]] = []
        self.jumps: list[list[Any]] = []
        self.step_runs: list[list[int]] = []
        self.skipped_runs: list[list[int]] = []
        self.found_inf_runs: list[list[int]] = []
        self.complete = True
        self.ordered = True
        self.dtypes: set[str] = set()
        self.created = 0
        self.disabled = 0
        self.sites: dict[str, int] = {}
        self.sites_complete = True
        self.init_scale: float | None = None
        self.growth_interval: int | None = None
        self.optimizer_loads = 0
        self.scaler_loads = 0
        self.scaler_loads_nonempty = 0

    # -- feeding ---------------------------------------------------------------------------
    def add(self, table: str, row: Mapping[str, Any]) -> None:
        if table == "steps":
            self._add_step(row)
        elif table == "events" and row.get("kind") in _EVENT_KINDS:
            self._add_event(row)

    def _add_step(self, row: Mapping[str, Any]) -> None:
        step = _step(row.get("step"))
        if step is None:
            return
        self.rows += 1
        if self.complete and not _extend_runs(self.all_runs, step, self.cap):
            self._drop_lists()
        dtype = row.get("autocast_dtype")
        if dtype and dtype == dtype:  # not None, "" or NaN (a pandas frame's missing value)
            self.dtypes.add(str(dtype))
        if not _flag(row.get("scaler_enabled")):
            return
        before = _number(row.get("scale_before"))
        if before is None:
            return
        raw_after = row.get("scale_after")
        after = _number(raw_after)
        skipped = _flag(row.get("skipped"))
        index = self.n
        if index == 0:
            self.first_before = before
        else:
            if self.last_step is not None and step <= self.last_step:
                self.ordered = False
            if after_differs(self.last_after, before):
                self._keep(self.jumps, [step, self.last_after, before])
        if after is not None:
            self.min_after = after if self.min_after is None else min(self.min_after, after)
            self.max_after = after if self.max_after is None else max(self.max_after, after)
        cut = after is not None and after < before
        if cut and self.leading_cuts == index:
            self.leading_cuts += 1
        if after is not None and after > before:
            self.last_growth = index
        if after_differs(after, before):
            self._keep(self.updates, [step, before, after])
        if index < HEAD:
            self.head.append([step, skipped])
        if self.complete:
            ok = _extend_runs(self.step_runs, step, self.cap)
            if skipped:
                ok = _extend_runs(self.skipped_runs, step, self.cap) and ok
            found = _number(row.get("found_inf"))
            if found is not None and found > 0:
                ok = _extend_runs(self.found_inf_runs, step, self.cap) and ok
            if not ok:
                self._drop_lists()
        self.n += 1
        self.skipped += skipped
        self.last_step = step
        self.last_after = after

    def _keep(self, points: list[list[Any]], point: list[Any]) -> None:
        if not self.complete:
            return
        if self.cap is not None and len(points) >= self.cap:
            self._drop_lists()
        else:
            points.append(point)

    def _drop_lists(self) -> None:
        self.complete = False
        for key in _LISTS:
            getattr(self, key).clear()

    def _add_event(self, row: Mapping[str, Any]) -> None:
        kind = row.get("kind")
        detail = _detail(row)
        if kind == "autocast_seen":
            if detail.get("enabled") and detail.get("dtype"):
                self.dtypes.add(str(detail["dtype"]))
        elif kind == "scaler_created":
            self.created += 1
            if not detail.get("enabled", True):
                self.disabled += 1
            site = detail.get("site")
            if site not in (None, "?"):
                site = str(site)
                if site in self.sites or len(self.sites) < MAX_SITES:
                    self.sites[site] = self.sites.get(site, 0) + 1
                else:
                    self.sites_complete = False
            init = detail.get("init_scale")
            if isinstance(init, (int, float)):
                self.init_scale = float(init)
            interval = detail.get("growth_interval")
            if isinstance(interval, (int, float)) and 0 < interval < math.inf:
                self.growth_interval = int(interval)
        elif kind == "optimizer_state_loaded":
            self.optimizer_loads += 1
        elif kind == "scaler_state_loaded":
            self.scaler_loads += 1
            if not detail.get("empty"):
                self.scaler_loads_nonempty += 1

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "all_runs": self.all_runs,
            "n": self.n,
            "skipped": self.skipped,
            "first_before": self.first_before,
            "last_step": self.last_step,
            "last_after": self.last_after,
            "min_after": self.min_after,
            "max_after": self.max_after,
            "leading_cuts": self.leading_cuts,
            "last_growth": self.last_growth,
            "head": self.head,
            "updates": self.updates,
            "jumps": self.jumps,
            "step_runs": self.step_runs,
            "skipped_runs": self.skipped_runs,
            "found_inf_runs": self.found_inf_runs,
            "complete": self.complete,
            "ordered": self.ordered,
            "autocast_dtypes": sorted(self.dtypes),
            "created": self.created,
            "disabled": self.disabled,
            "sites": self.sites,
            "sites_complete": self.sites_complete,
            "init_scale": self.init_scale,
            "growth_interval": self.growth_interval,
            "optimizer_loads": self.optimizer_loads,
            "scaler_loads": self.scaler_loads,
            "scaler_loads_nonempty": self.scaler_loads_nonempty,
        }

    @classmethod
    def merge(cls, first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
        a, b = first, second
        if not b["n"] and not b["rows"]:
            out = dict(a)
        elif not a["n"] and not a["rows"]:
            out = dict(b)
        else:
            out = _merge_steps(a, b)
        sites = dict(a["sites"])
        sites_complete = a["sites_complete"] and b["sites_complete"]
        for site, count in b["sites"].items():
            if site in sites or len(sites) < MAX_SITES:
                sites[site] = sites.get(site, 0) + count
            else:
                sites_complete = False
        out.update(
            autocast_dtypes=sorted(set(a["autocast_dtypes"]) | set(b["autocast_dtypes"])),
            created=a["created"] + b["created"],
            disabled=a["disabled"] + b["disabled"],
            sites=sites,
            sites_complete=sites_complete,
            init_scale=b["init_scale"] if b["init_scale"] is not None else a["init_scale"],
            growth_interval=(
                b["growth_interval"] if b["growth_interval"] is not None else a["growth_interval"]
            ),
            optimizer_loads=a["optimizer_loads"] + b["optimizer_loads"],
            scaler_loads=a["scaler_loads"] + b["scaler_loads"],
            scaler_loads_nonempty=a["scaler_loads_nonempty"] + b["scaler_loads_nonempty"],
        )
        return out


def after_differs(after: float | None, before: float) -> bool:
    """Whether a scale after an update (None: NaN or missing) differs from a scale before."""
    return after is None or after != before


#: the lists an incomplete section empties (merge and accumulation then agree)
_LISTS = ("all_runs", "updates", "jumps", "step_runs", "skipped_runs", "found_inf_runs")


def _merge_steps(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    complete = a["complete"] and b["complete"]
    all_runs, ok = _merge_runs(a["all_runs"], b["all_runs"])
    complete = complete and ok
    out: dict[str, Any] = {"rows": a["rows"] + b["rows"], "all_runs": all_runs}
    if not complete:
        out.update({k: [] for k in _LISTS})
    if not a["n"]:
        keep = ("n", "skipped", "first_before", "last_step", "last_after", "min_after")
        out.update({k: b[k] for k in (*keep, "max_after", "leading_cuts", "last_growth")})
        out.update({k: b[k] for k in ("head", "updates", "jumps", "step_runs", "skipped_runs")})
        out.update(found_inf_runs=b["found_inf_runs"], ordered=b["ordered"])
        out["complete"] = complete
        if not complete:
            out.update({k: [] for k in _LISTS})
        return out
    if not b["n"]:
        out.update({k: v for k, v in a.items() if k not in ("rows", "all_runs", "complete")})
        out["complete"] = complete
        if not complete:
            out.update({k: [] for k in _LISTS})
        return out
    n = a["n"]
    first_step_b = b["head"][0][0]
    ordered = a["ordered"] and b["ordered"] and first_step_b > a["last_step"]
    jumps = [list(j) for j in a["jumps"]]
    if after_differs(a["last_after"], b["first_before"]):
        jumps.append([first_step_b, a["last_after"], b["first_before"]])
    jumps.extend(list(j) for j in b["jumps"])
    updates = [list(u) for u in a["updates"]] + [list(u) for u in b["updates"]]
    lists: dict[str, Any] = {}
    for key in ("step_runs", "skipped_runs", "found_inf_runs"):
        lists[key], ok = _merge_runs(a[key], b[key])
        complete = complete and ok
    if len(jumps) > CAP or len(updates) > CAP:
        complete = False
    out.update(
        n=n + b["n"],
        skipped=a["skipped"] + b["skipped"],
        first_before=a["first_before"],
        last_step=b["last_step"],
        last_after=b["last_after"],
        min_after=_pick(min, a["min_after"], b["min_after"]),
        max_after=_pick(max, a["max_after"], b["max_after"]),
        leading_cuts=a["leading_cuts"] + (b["leading_cuts"] if a["leading_cuts"] == n else 0),
        last_growth=b["last_growth"] + n if b["last_growth"] >= 0 else a["last_growth"],
        head=[list(h) for h in (a["head"] + b["head"])[:HEAD]],
        updates=updates,
        jumps=jumps,
        complete=complete,
        ordered=ordered,
        **lists,
    )
    if not complete:
        out.update({k: [] for k in _LISTS})
    return out


def _pick(fn: Any, x: float | None, y: float | None) -> float | None:
    if x is None:
        return y
    if y is None:
        return x
    return fn(x, y)
