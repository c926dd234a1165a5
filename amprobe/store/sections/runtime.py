"""The ``steps`` and ``runtime`` sections of a rank's summary: which steps a rank recorded, and
its step times, data wait, syncs and loss facts, in a size bounded independent of the steps.

``steps`` (:class:`StepsSection`): ``rows`` (rows with a valid step), ``invalid`` (rows without
one), ``first``/``last`` (lowest and highest step) and ``windows`` (``{"<window>": {"first",
"last", "rows"}}``).

``runtime`` (:class:`RuntimeSection`):

- ``head``: the :data:`HEAD_ROWS` rows of lowest step as ``[step, wall_s, data_wait_s,
  syncs_sampled]``, kept verbatim and left out of the histograms, so a rule can leave out any
  warm-up of up to :data:`HEAD_ROWS` steps exactly (add back the head rows it keeps).
- ``times``: the step times and data waits of every other row, in log-bucket histograms
  (:func:`hist_add`; quantiles within :data:`QUANTILE_REL_ERROR` of the exact ones), split by
  which of the two the row measured: ``both`` (``plain`` / ``sampled`` for steps whose syncs
  were counted, ``{"wall": hist, "wait": hist}`` each), ``wall_only``, ``wait_only``.
- ``wall_steps`` / ``wait_steps``: the steps that measured ``wall_s`` / ``data_wait_s``, as
  capped run-length ranges (:class:`Ranges`).
- ``phases``: ``{"fwd_s" | "bwd_s" | "opt_s" | "probe_s": [count, sum]}``.
- ``syncs``: ``{"sampled": ranges of the sync-sampled steps, "total": syncs summed over them}``.
- ``loss_dtypes``: ``{dtype: ranges of the steps whose loss had it}``; ``loss_nonfinite``: ranges.
- ``clip``: ``{"observed": steps with clip_scaled recorded, "scaled": ranges of steps with
  clip_scaled > 0}``; ``input``: ``{"checked": count, "nonfinite": ranges}``.
- ``peak_mem_bytes`` / ``rss_bytes``: the largest value, or None.

A repeated row (the same rank, window and step twice: a copied file, a retried write) is
counted twice by a section; the "steps" section then says its window's steps were not
increasing, and the reader summarizes that rank again from its rows with the repeats dropped,
as the loader drops them. A missing key, None and a float NaN all mean "not
measured" (the loader reads an absent value as NaN in its frames).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from amprobe.store.summary import Section, section

__all__ = [
    "BUCKETS_PER_OCTAVE",
    "QUANTILE_REL_ERROR",
    "HEAD_ROWS",
    "RANGES_KEPT",
    "Ranges",
    "StepsSection",
    "RuntimeSection",
    "hist_add",
    "hist_merge",
    "hist_buckets",
    "hist_quantile",
    "hist_median",
    "hist_count_above",
    "new_hist",
]

#: Log-bucket resolution of the time histograms: a bucket spans 2**(1/128) (0.54 %).
BUCKETS_PER_OCTAVE = 128
#: Bound on the relative error of a quantile read from a histogram: the bucket's geometric
#: midpoint is within 2**(1/256) - 1 (0.271 %) of every value in the bucket.
QUANTILE_REL_ERROR = 2 ** (1 / (2 * BUCKETS_PER_OCTAVE)) - 1
#: Rows of lowest step kept verbatim (the warm-up a rule may leave out exactly).
HEAD_ROWS = 16
#: Run-length ranges kept at the start of a list (the last run is always kept).
RANGES_KEPT = 64

_PHASES = ("fwd_s", "bwd_s", "opt_s", "probe_s")


def _num(value: Any) -> float | None:
    """A measured number, or None (missing, None, NaN, a bool or a string)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if value != value else float(value)


# -- histograms ----------------------------------------------------------------------------------
def new_hist() -> dict[str, Any]:
    """An empty histogram: ``n``, ``sum``, ``min``, ``max``, ``zero`` (values <= 0) and ``b``
    (bucket index -> count; bucket ``i`` holds ``[2**(i/128), 2**((i+1)/128))``; in JSON
    ``[indexes ascending, counts]``)."""
    return {"n": 0, "sum": 0.0, "min": None, "max": None, "zero": 0, "b": {}}


def hist_add(hist: dict[str, Any], x: float) -> None:
    """Add one value (in place, to the in-memory form of :func:`new_hist`)."""
    hist["n"] += 1
    hist["sum"] += x
    if hist["min"] is None or x < hist["min"]:
        hist["min"] = x
    if hist["max"] is None or x > hist["max"]:
        hist["max"] = x
    if x <= 0 or math.isinf(x):
        hist["zero"] += x <= 0
        if x > 0:  # +inf: past every bucket; kept in max only
            hist["b"][1 << 30] = hist["b"].get(1 << 30, 0) + 1
        return
    i = math.floor(math.log2(x) * BUCKETS_PER_OCTAVE)
    b = hist["b"]
    b[i] = b.get(i, 0) + 1


def _hist_json(hist: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON form: ``b`` as ``[bucket indexes ascending, their counts]``."""
    items = sorted(hist_buckets(hist).items())
    return {**hist, "b": [[k for k, _ in items], [c for _, c in items]]}


def hist_buckets(hist: Mapping[str, Any]) -> dict[int, int]:
    """Bucket index -> count of a histogram in either form."""
    b = hist["b"]
    if isinstance(b, dict):
        return b
    return dict(zip(b[0], b[1], strict=True)) if b else {}


def _hist_load(hist: Mapping[str, Any] | None) -> dict[str, Any]:
    if not hist:
        return new_hist()
    return {**hist, "b": dict(hist_buckets(hist))}


def hist_merge(first: Mapping[str, Any] | None, second: Mapping[str, Any] | None) -> dict[str, Any]:
    """The histogram of both (either in JSON or in-memory form); returns the JSON form."""
    a, b = _hist_load(first), _hist_load(second)
    buckets = dict(a["b"])
    for k, v in b["b"].items():
        buckets[k] = buckets.get(k, 0) + v
    mins = [m for m in (a["min"], b["min"]) if m is not None]
    maxs = [m for m in (a["max"], b["max"]) if m is not None]
    return _hist_json(
        {
            "n": a["n"] + b["n"],
            "sum": a["sum"] + b["sum"],
            "min": min(mins) if mins else None,
            "max": max(maxs) if maxs else None,
            "zero": a["zero"] + b["zero"],
            "b": buckets,
        }
    )


def _ordered(hist: Mapping[str, Any]) -> list[tuple[int, int]]:
    return sorted((k, v) for k, v in hist_buckets(hist).items() if v)


def hist_quantile(hist: Mapping[str, Any], k: int) -> float:
    """The ``k``-th smallest value (0-based) as the histogram knows it: 0 for a value <= 0,
    else its bucket's geometric midpoint clipped to the exact min/max (within
    :data:`QUANTILE_REL_ERROR` of the value)."""
    if not 0 <= k < hist["n"]:
        raise IndexError(k)
    if k < hist["zero"]:  # a value <= 0 (a time of 0): 0, or the minimum when negative
        return min(0.0, float(hist["min"]))
    seen = hist["zero"]
    for i, count in _ordered(hist):
        seen += count
        if k < seen:
            if i == 1 << 30:
                return math.inf
            mid = 2 ** ((i + 0.5) / BUCKETS_PER_OCTAVE)
            return min(max(mid, float(hist["min"])), float(hist["max"]))
    return float(hist["max"])


def hist_median(hist: Mapping[str, Any]) -> float | None:
    """The median (the mean of the two middle values for an even count), or None when empty."""
    n = hist["n"]
    if not n:
        return None
    if n % 2:
        return hist_quantile(hist, n // 2)
    return (hist_quantile(hist, n // 2 - 1) + hist_quantile(hist, n // 2)) / 2


def hist_count_above(hist: Mapping[str, Any], x: float) -> int:
    """How many values exceed ``x``: exact but for the bucket holding ``x``, whose values are
    split by log-interpolation (an error of at most that bucket's count)."""
    if not hist["n"] or hist["max"] is None or hist["max"] <= x:
        return 0
    if hist["min"] is not None and hist["min"] > x:
        return int(hist["n"])
    if x <= 0:
        return int(hist["n"] - hist["zero"])
    at = math.log2(x) * BUCKETS_PER_OCTAVE
    j = math.floor(at)
    above = 0.0
    for i, count in _ordered(hist):
        if i > j:
            above += count
        elif i == j:
            above += count * (1 - (at - j))
    return int(round(above))


# -- run-length step ranges ----------------------------------------------------------------------
class Ranges:
    """Steps as run-length ranges in arrival order: the first :data:`RANGES_KEPT` runs, the
    last run, and how many runs between them were left out; ``n`` counts every step added.

    A step that does not extend the current run by one (a repeat, a new window restarting at
    a lower step) starts a new run.
    """

    __slots__ = ("n", "head", "left", "last")

    def __init__(self) -> None:
        self.n = 0
        self.head: list[list[int]] = []
        self.left = 0
        self.last: list[int] | None = None

    def add(self, step: int) -> None:
        self.n += 1
        last = self.last
        if last is not None and step == last[1] + 1:
            last[1] = step
            return
        if last is not None:
            if len(self.head) < RANGES_KEPT:
                self.head.append(last)
            else:
                self.left += 1
        self.last = [step, step]

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, "head": [list(r) for r in self.head], "left": self.left,
                "last": list(self.last) if self.last else None}  # fmt: skip

    @staticmethod
    def merge(first: Mapping[str, Any] | None, second: Mapping[str, Any] | None) -> dict[str, Any]:
        """The ranges of ``first``'s steps followed by ``second``'s."""
        if not first or not first.get("n"):
            return dict(second) if second else Ranges().to_json()
        if not second or not second.get("n"):
            return dict(first)
        # the whole sequence: runs known explicitly, and counts of runs left out between them
        items: list[Any] = [*first["head"], first["left"], list(first["last"])]
        b_runs: list[Any] = [*second["head"], second["left"], list(second["last"])]
        b_first = second["head"][0] if second["head"] else second["last"]
        joined = b_first[0] == first["last"][1] + 1
        if joined:  # first's last run goes on into second's first: one run
            items[-1] = [first["last"][0], b_first[1]]
            b_runs = b_runs[1:] if second["head"] else []  # a lone run has no left-out count
        return _ranges_from(items + b_runs, first["n"] + second["n"])

    @staticmethod
    def complete(ranges: Mapping[str, Any] | None) -> bool:
        return not ranges or not ranges.get("left")

    @staticmethod
    def runs(ranges: Mapping[str, Any] | None) -> list[list[int]]:
        """The runs known (every run when :meth:`complete`), in arrival order."""
        if not ranges or not ranges.get("n"):
            return []
        return [*ranges["head"], ranges["last"]]


def _ranges_from(items: list[Any], n: int) -> dict[str, Any]:
    """Normalize a sequence of runs and left-out counts (the last item a run)."""
    last = items[-1]
    head: list[list[int]] = []
    left = 0
    for item in items[:-1]:
        if isinstance(item, int):
            left += item
        elif left == 0 and len(head) < RANGES_KEPT:
            head.append(list(item))
        else:
            left += 1
    return {"n": n, "head": head, "left": left, "last": list(last)}


# -- sections ------------------------------------------------------------------------------------
@section
class StepsSection(Section):
    """Row count, lowest and highest step, and each recording window's first and last step,
    and whether its rows' steps only went up (``increasing``): a repeated or out-of-order row
    (a copied file, a retried write) makes it False, and the reader then summarizes that rank
    from its rows with the repeats dropped, as the loader drops them."""

    name: ClassVar[str] = "steps"
    tables: ClassVar[tuple[str, ...]] = ("steps",)

    def __init__(self) -> None:
        self.rows = 0
        self.invalid = 0
        self.windows: dict[int, list[int]] = {}

    def add(self, table: str, row: Mapping[str, Any]) -> None:
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            self.invalid += 1
            return
        self.rows += 1
        window = row.get("window")
        w = window if isinstance(window, int) and not isinstance(window, bool) else 0
        got = self.windows.get(w)
        if got is None:
            # lowest, highest, rows, the first row's step, the last row's, steps increasing
            self.windows[w] = [step, step, 1, step, step, True]
        else:
            got[0] = min(got[0], step)
            got[1] = max(got[1], step)
            got[2] += 1
            got[5] = got[5] and step > got[4]
            got[4] = step

    def to_json(self) -> dict[str, Any]:
        windows = {
            str(w): {"first": a, "last": b, "rows": n, "start": s, "end": e, "increasing": inc}
            for w, (a, b, n, s, e, inc) in sorted(self.windows.items())
        }
        firsts = [v[0] for v in self.windows.values()]
        lasts = [v[1] for v in self.windows.values()]
        return {
            "rows": self.rows,
            "invalid": self.invalid,
            "first": min(firsts) if firsts else None,
            "last": max(lasts) if lasts else None,
            "windows": windows,
        }

    @classmethod
    def merge(cls, first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
        windows = {k: dict(v) for k, v in first.get("windows", {}).items()}
        for k, v in second.get("windows", {}).items():
            got = windows.get(k)
            if got is None:
                windows[k] = dict(v)
            else:
                got.update(
                    first=min(got["first"], v["first"]),
                    last=max(got["last"], v["last"]),
                    rows=got["rows"] + v["rows"],
                    increasing=got["increasing"] and v["increasing"] and v["start"] > got["end"],
                    end=v["end"],
                )
        firsts = [v["first"] for v in windows.values()]
        lasts = [v["last"] for v in windows.values()]
        return {
            "rows": first.get("rows", 0) + second.get("rows", 0),
            "invalid": first.get("invalid", 0) + second.get("invalid", 0),
            "first": min(firsts) if firsts else None,
            "last": max(lasts) if lasts else None,
            "windows": {k: windows[k] for k in sorted(windows, key=int)},
        }


def _times_new() -> dict[str, Any]:
    return {
        "both": {
            "plain": {"wall": new_hist(), "wait": new_hist()},
            "sampled": {"wall": new_hist(), "wait": new_hist()},
        },
        "wall_only": new_hist(),
        "wait_only": new_hist(),
    }


def times_add(times: dict[str, Any], wall: float | None, wait: float | None, sampled: bool) -> None:
    """Add one row's step time and data wait to a ``times`` dict (in-memory form)."""
    if wall is not None and wait is not None:
        both = times["both"]["sampled" if sampled else "plain"]
        hist_add(both["wall"], wall)
        hist_add(both["wait"], wait)
    elif wall is not None:
        hist_add(times["wall_only"], wall)
    elif wait is not None:
        hist_add(times["wait_only"], wait)


def times_load(times: Mapping[str, Any] | None) -> dict[str, Any]:
    """A ``times`` dict in its in-memory form (a copy; add rows to it with :func:`times_add`)."""
    if not times:
        return _times_new()
    return {
        "both": {
            k: {m: _hist_load(times["both"][k][m]) for m in ("wall", "wait")}
            for k in ("plain", "sampled")
        },
        "wall_only": _hist_load(times["wall_only"]),
        "wait_only": _hist_load(times["wait_only"]),
    }


def _times_merge(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> dict[str, Any]:
    a = a or _times_new()
    b = b or _times_new()
    return {
        "both": {
            k: {m: hist_merge(a["both"][k][m], b["both"][k][m]) for m in ("wall", "wait")}
            for k in ("plain", "sampled")
        },
        "wall_only": hist_merge(a["wall_only"], b["wall_only"]),
        "wait_only": hist_merge(a["wait_only"], b["wait_only"]),
    }


def _times_json(times: Mapping[str, Any]) -> dict[str, Any]:
    return _times_merge(times, None)


@section
class RuntimeSection(Section):
    """Step time, data wait, phase sums, sampled syncs and the loss facts of one rank."""

    name: ClassVar[str] = "runtime"
    tables: ClassVar[tuple[str, ...]] = ("steps",)

    def __init__(self) -> None:
        self.head: list[list[Any]] = []
        self.head_max: int | None = None
        self.times = _times_new()
        self.wall_steps = Ranges()
        self.wait_steps = Ranges()
        self.phases = {p: [0, 0.0] for p in _PHASES}
        self.sync_steps = Ranges()
        self.sync_total = 0
        self.loss_dtypes: dict[str, Ranges] = {}
        self.loss_nonfinite = Ranges()
        self.clip_observed = 0
        self.clip_scaled = Ranges()
        self.input_checked = 0
        self.input_nonfinite = Ranges()
        self.peak_mem: float | None = None
        self.rss: float | None = None

    def add(self, table: str, row: Mapping[str, Any]) -> None:
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return
        get = row.get
        wall, wait = _num(get("wall_s")), _num(get("data_wait_s"))
        sampled = get("syncs_sampled") is True
        self._timed(step, wall, wait, sampled)
        if wall is not None:
            self.wall_steps.add(step)
        if wait is not None:
            self.wait_steps.add(step)
        for p in _PHASES:
            v = _num(get(p))
            if v is not None:
                acc = self.phases[p]
                acc[0] += 1
                acc[1] += v
        if sampled:
            self.sync_steps.add(step)
            syncs = _num(get("syncs"))
            if syncs is not None:
                self.sync_total += int(syncs)
        dtype = get("loss_dtype")
        if isinstance(dtype, str):
            got = self.loss_dtypes.get(dtype)
            if got is None:
                got = self.loss_dtypes[dtype] = Ranges()
            got.add(step)
        if get("loss_nonfinite") is True:
            self.loss_nonfinite.add(step)
        clip = _num(get("clip_scaled"))
        if clip is not None:
            self.clip_observed += 1
            if clip > 0:
                self.clip_scaled.add(step)
        bad = _num(get("input_nonfinite"))
        if bad is not None:
            self.input_checked += 1
            if bad > 0:
                self.input_nonfinite.add(step)
        mem = _num(get("peak_mem_bytes"))
        if mem is not None and (self.peak_mem is None or mem > self.peak_mem):
            self.peak_mem = mem
        rss = _num(get("rss_bytes"))
        if rss is not None and (self.rss is None or rss > self.rss):
            self.rss = rss

    def _timed(self, step: int, wall: float | None, wait: float | None, sampled: bool) -> None:
        """Keep the row in the head while it is among the lowest steps; else histogram it."""
        head = self.head
        if len(head) >= HEAD_ROWS and step >= self.head_max:  # type: ignore[operator]
            times_add(self.times, wall, wait, sampled)
            return
        head.append([step, wall, wait, sampled])
        if len(head) > HEAD_ROWS:
            # the highest step leaves the head (the last of equal steps: the head keeps the
            # earliest rows of a step, as a sorted, stable merge would)
            out = max(range(len(head)), key=lambda i: (head[i][0], i))
            _, w, d, s = head.pop(out)
            times_add(self.times, w, d, s)
        self.head_max = max(r[0] for r in head)

    def to_json(self) -> dict[str, Any]:
        return {
            "head": sorted(([*r] for r in self.head), key=lambda r: r[0]),
            "times": _times_json(self.times),
            "wall_steps": self.wall_steps.to_json(),
            "wait_steps": self.wait_steps.to_json(),
            "phases": {p: list(v) for p, v in self.phases.items()},
            "syncs": {"sampled": self.sync_steps.to_json(), "total": self.sync_total},
            "loss_dtypes": {k: v.to_json() for k, v in sorted(self.loss_dtypes.items())},
            "loss_nonfinite": self.loss_nonfinite.to_json(),
            "clip": {"observed": self.clip_observed, "scaled": self.clip_scaled.to_json()},
            "input": {"checked": self.input_checked, "nonfinite": self.input_nonfinite.to_json()},
            "peak_mem_bytes": self.peak_mem,
            "rss_bytes": self.rss,
        }

    @classmethod
    def merge(cls, first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
        # the head of both: the HEAD_ROWS lowest steps (first's rows before second's at equal
        # steps, as in the file); the rows that leave it go into the histograms
        rows = sorted(
            [(r[0], 0, i, r) for i, r in enumerate(first["head"])]
            + [(r[0], 1, i, r) for i, r in enumerate(second["head"])]
        )
        times = times_load(_times_merge(first["times"], second["times"]))
        for _, _, _, (_, w, d, s) in rows[HEAD_ROWS:]:
            times_add(times, w, d, s)
        dtypes = {
            k: Ranges.merge(first["loss_dtypes"].get(k), second["loss_dtypes"].get(k))
            for k in sorted(set(first["loss_dtypes"]) | set(second["loss_dtypes"]))
        }

        def bigger(key: str) -> float | None:
            vals = [v for v in (first[key], second[key]) if v is not None]
            return max(vals) if vals else None

        return {
            "head": [list(r[3]) for r in rows[:HEAD_ROWS]],
            "times": _times_json(times),
            "wall_steps": Ranges.merge(first["wall_steps"], second["wall_steps"]),
            "wait_steps": Ranges.merge(first["wait_steps"], second["wait_steps"]),
            "phases": {
                p: [
                    first["phases"][p][0] + second["phases"][p][0],
                    first["phases"][p][1] + second["phases"][p][1],
                ]
                for p in _PHASES
            },  # fmt: skip
            "syncs": {
                "sampled": Ranges.merge(first["syncs"]["sampled"], second["syncs"]["sampled"]),
                "total": first["syncs"]["total"] + second["syncs"]["total"],
            },
            "loss_dtypes": dtypes,
            "loss_nonfinite": Ranges.merge(first["loss_nonfinite"], second["loss_nonfinite"]),
            "clip": {
                "observed": first["clip"]["observed"] + second["clip"]["observed"],
                "scaled": Ranges.merge(first["clip"]["scaled"], second["clip"]["scaled"]),
            },
            "input": {
                "checked": first["input"]["checked"] + second["input"]["checked"],
                "nonfinite": Ranges.merge(
                    first["input"]["nonfinite"], second["input"]["nonfinite"]
                ),
            },
            "peak_mem_bytes": bigger("peak_mem_bytes"),
            "rss_bytes": bigger("rss_bytes"),
        }
