"""Block-scaled what-if: which of a run's matmul layers fit MXFP8, MXFP4, NVFP4 or blockwise fp8.

A pure analysis of a loaded run's ``blockstats`` table (written by the numerics collector on its
sampled steps: one row per step, matmul layer, GEMM operand, orientation and format, with the
counts and sums of :data:`~amprobe.store.blockformats.STAT_FIELDS`). Pandas and numpy only.

Per (rank, layer, operand, orientation, format), pooled over the sampled steps (counts and sums
added first, then divided), :func:`compute_block_stats` gives:

* ``flushed_share``, ``clipped_share``, ``lost_share``: of the operand's nonzero finite values,
  the share the cast would flush to zero, saturate (clip), and both together;
* ``scale_under_share``, ``scale_sat_share``: of its blocks, the share whose own scale
  underflows (e8m0 below 2^-127, an fp32 or e4m3 scale that rounds to 0) or saturates;
* ``sqnr_db``: ``10 log10(sum x^2 / sum (x - deq)^2)`` over every finite element (all-zero
  blocks add no error); ``inf`` when nothing was lost, NaN when every value was zero
  (``status`` ``all zero``: nothing to cast, never counted as failing);
* ``nonfinite``: inf/NaN elements, left out of every statistic; ``approx``: why the row is
  approximate (a DTensor's local shard, conv blocks along input channels), ``""`` when exact.

:func:`compute_block_fit` then judges each row against :data:`FIT_THRESHOLDS` (per element
type: a minimum SQNR and the largest flushed and clipped shares) and, per (rank, layer, format),
names the limiting operand and orientation and says whether the layer fits the format: every
measured operand row within the thresholds. The limiting row is the one furthest over (or
closest to) its thresholds, measured as the largest of ``flushed / max_flushed``,
``clipped / max_clipped`` and ``10**((min_sqnr - sqnr) / 10)`` (its noise over the noise
the threshold allows): a value above 1 fails.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from amprobe.analysis.numerics import has_numerics, numerics_missing_reason
from amprobe.store.blockformats import FORMATS, NARROWEST, STAT_FIELDS

__all__ = [
    "TABLE",
    "OPERAND_LABELS",
    "FitThresholds",
    "FIT_THRESHOLDS",
    "FIT_THRESHOLD_NAMES",
    "NO_FINITE",
    "UNJUDGED",
    "flat_thresholds",
    "thresholds_by_element",
    "block_fit_missing_reason",
    "block_unmeasured",
    "UNMEASURED_EVENT",
    "compute_block_stats",
    "compute_block_fit",
    "block_stats",
    "block_fit",
    "format_order",
    "narrowest_fit",
    "row_label",
]

#: the store table this module reads
TABLE = "blockstats"
#: the capture side's event for what it did not measure: a module whose GEMMs it cannot hook
#: (``nn.MultiheadAttention``), steps a CPU without the block kernel skipped (``reason``, and
#: ``modules`` where it names layers)
UNMEASURED_EVENT = "blockstats_not_measured"
#: layer names a line lists before it counts the rest
_NAMES_SHOWN = 6
#: how users read an operand
OPERAND_LABELS: Mapping[str, str] = {"x": "X", "w": "W", "dy": "dY"}
_OPERAND_ORDER = {"x": 0, "w": 1, "dy": 2}
_COUNTS = [f for f in STAT_FIELDS if f not in ("signal", "noise")]
_KEY = ["rank", "layer", "operand", "orientation", "format"]


@dataclass(frozen=True)
class FitThresholds:
    """What an operand row must keep to fit a format of one element type.

    Attributes:
        min_sqnr_db: the lowest SQNR (dB) that fits.
        max_flushed_share: the largest share of nonzero values flushed to zero that fits.
        max_clipped_share: the largest share of nonzero values clipped (saturated) that fits.
    """

    min_sqnr_db: float
    max_flushed_share: float
    max_clipped_share: float


#: Per element type, the thresholds an operand row must meet (rules AMP-P04/P05 register them
#: flattened, :func:`flat_thresholds`, so ``--threshold AMP-P04.e2m1_min_sqnr_db=10`` moves one).
#: a row (or cell) whose operands held no finite value at all: every value inf/NaN
NO_FINITE = "no finite value"
#: statuses with nothing to judge: never fail, never fit
UNJUDGED = ("all zero", NO_FINITE)

#: Calibrated on measured runs (a Gaussian 1024x512 tensor; the CPU test model of
#: tests/test_block_fit_e2e.py; docs/whatif.md gives the numbers): benign operands keep 26-33 dB
#: in the 8-bit formats and 16.6-20.6 dB in the 4-bit ones, flushing 0 % and 3-9 %. 8-bit
#: elements must keep 22 dB and flush at most 1 %; e2m1 13 dB and 20 % (a Student-t(2) tensor,
#: 26 % under MXFP4, fails). Clipping is bounded by the scale rule: OCP's floor scale leaves the
#: top of the amax's binade above the element's max, so MXFP8 clips 9-11 % and MXFP4 12-14 % of
#: a freshly initialised (uniform) weight by design, each value by at most 1/8 (1/4); its harm
#: shows in the SQNR, and the clipped share only fails a row where a quarter of the values
#: saturate.
FIT_THRESHOLDS: Mapping[str, FitThresholds] = {
    "e4m3": FitThresholds(min_sqnr_db=22.0, max_flushed_share=0.01, max_clipped_share=0.25),
    "e5m2": FitThresholds(min_sqnr_db=22.0, max_flushed_share=0.01, max_clipped_share=0.25),
    "e2m1": FitThresholds(min_sqnr_db=13.0, max_flushed_share=0.20, max_clipped_share=0.25),
}
FIT_THRESHOLD_NAMES = ("min_sqnr_db", "max_flushed_share", "max_clipped_share")


def flat_thresholds(table: Mapping[str, FitThresholds] = FIT_THRESHOLDS) -> dict[str, float]:
    """``{"e4m3_min_sqnr_db": 25.0, ...}``: the table as a rule's flat thresholds."""
    return {
        f"{element}_{name}": float(getattr(th, name))
        for element, th in table.items()
        for name in FIT_THRESHOLD_NAMES
    }


def thresholds_by_element(flat: Mapping[str, float] | None = None) -> dict[str, FitThresholds]:
    """:data:`FIT_THRESHOLDS` with a rule's flat thresholds (overrides included) applied."""
    out = {}
    for element, th in FIT_THRESHOLDS.items():
        values = {
            name: float((flat or {}).get(f"{element}_{name}", getattr(th, name)))
            for name in FIT_THRESHOLD_NAMES
        }
        out[element] = FitThresholds(**values)
    return out


def block_unmeasured(run: Any) -> list[str]:
    """What the capture side said it left unmeasured, one line per distinct reason and layer
    list over the ranks (``"<reason>: a, b and 3 more"``), in recording order."""
    lines: dict[str, None] = {}
    for event in run.events_of(UNMEASURED_EVENT):
        reason = str(event.get("reason") or "").strip()
        if not reason:
            continue
        names = [str(m) for m in (event.get("modules") or [])]
        if names:
            shown = ", ".join(f"`{n}`" for n in names[:_NAMES_SHOWN])
            more = len(names) - _NAMES_SHOWN
            reason += f": {shown}" + (f" and {more} more" if more > 0 else "")
        lines[reason] = None
    return list(lines)


def block_fit_missing_reason(run: Any) -> str | None:
    """Why a run has no block statistics (None when it has some): the recording amprobe
    predates them or they were off (``block_formats=[]``), the numerics collector recorded
    nothing, or no matmul layer was sampled."""
    frame = run.table(TABLE)
    if len(frame) and {"layer", "operand", "format"} <= set(frame.columns):
        return None
    configs = [c for r in run.ranks if isinstance(c := r.manifest.get("config"), dict)]
    if configs and not any("block_formats" in c for c in configs):
        return (
            "no blockstats table: the run was recorded by an amprobe without block statistics "
            "(its configuration has no block_formats)"
        )
    if configs and all(not c.get("block_formats") for c in configs):
        return "no blockstats table: block statistics were off (block_formats=[])"
    unmeasured = block_unmeasured(run)
    if unmeasured:  # what the capture side said it skipped, and why
        return "no blockstats rows: " + "; ".join(unmeasured)
    if not has_numerics(run):
        if not configs:
            return "no blockstats table was recorded (amprobe without block statistics, or off)"
        return "no blockstats table: " + numerics_missing_reason(run)
    return "no matmul layer was sampled (the blockstats table holds no rows)"


def row_label(operand: Any, orientation: Any) -> str:
    """``dY wgrad``: an operand row as users read it."""
    return f"{OPERAND_LABELS.get(str(operand), str(operand))} {orientation}"


def format_order(formats: Iterable[str]) -> list[str]:
    """``formats`` ordered by bits per element with scales, narrowest first (per-tensor fp8
    with its 8 bits before the 8.25-bit block formats), unknown ones last."""
    known = list(FORMATS)
    return sorted(
        dict.fromkeys(formats),
        key=lambda f: (
            FORMATS[f].bits if f in FORMATS else float("inf"),
            known.index(f) if f in FORMATS else len(known),
            f,
        ),
    )


def compute_block_stats(blockstats: pd.DataFrame) -> pd.DataFrame:
    """Pooled statistics per (rank, layer, operand, orientation, format) of a ``blockstats``
    frame (the module docstring gives the columns). Rows come in the layers' order of first
    appearance, operands X, W, dY, formats by bits."""
    cols = [
        *_KEY,
        "layer_type",
        "element",
        "bits",
        "steps",
        *STAT_FIELDS,
        "flushed_share",
        "clipped_share",
        "lost_share",
        "scale_under_share",
        "scale_sat_share",
        "sqnr_db",
        "status",
        "approx",
        "order",
    ]
    if blockstats.empty or not {"layer", "operand", "format"} <= set(blockstats.columns):
        return pd.DataFrame(columns=cols)
    frame = blockstats.copy()
    if "rank" not in frame:
        frame["rank"] = 0
    for c in STAT_FIELDS:
        if c not in frame:
            frame[c] = 0
    for c in ("layer_type", "approx", "orientation"):
        if c not in frame:
            frame[c] = ""
    if "step" not in frame:
        frame["step"] = 0
    frame["approx"] = frame["approx"].fillna("").astype(str)
    frame["layer_type"] = frame["layer_type"].fillna("").astype(str)
    frame[_COUNTS] = frame[_COUNTS].fillna(0).astype(np.int64)
    frame[["signal", "noise"]] = frame[["signal", "noise"]].astype(float).fillna(0.0)
    order = {layer: i for i, layer in enumerate(dict.fromkeys(frame["layer"].astype(str)))}
    grouped = frame.groupby(_KEY, sort=False, dropna=False)
    out = grouped[list(STAT_FIELDS)].sum()
    out["steps"] = grouped["step"].nunique()
    out["layer_type"] = grouped["layer_type"].first()
    out = out.reset_index()
    # the reasons of the approximate rows only (a lambda per group costs a second at 64 ranks)
    reasons = frame.loc[frame["approx"] != "", [*_KEY, "approx"]].drop_duplicates()
    joined = reasons.sort_values("approx").groupby(_KEY, sort=False, dropna=False)["approx"]
    out = out.merge(joined.agg("; ".join).rename("approx"), on=_KEY, how="left")
    out["approx"] = out["approx"].fillna("")
    out["layer"] = out["layer"].astype(str)
    out["element"] = [FORMATS[f].element if f in FORMATS else "" for f in out["format"]]
    out["bits"] = [FORMATS[f].bits if f in FORMATS else np.nan for f in out["format"]]
    nonzero = out["nonzero"].to_numpy(dtype=float)
    blocks = out["blocks"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        for name, count, denom in (
            ("flushed_share", "flushed", nonzero),
            ("clipped_share", "clipped", nonzero),
            ("scale_under_share", "scale_under", blocks),
            ("scale_sat_share", "scale_sat", blocks),
        ):
            out[name] = np.where(denom > 0, out[count].to_numpy(dtype=float) / denom, np.nan)
        out["lost_share"] = out["flushed_share"] + out["clipped_share"]
        signal = out["signal"].to_numpy(dtype=float)
        noise = out["noise"].to_numpy(dtype=float)
        sqnr = np.where(noise > 0, 10 * np.log10(signal / noise), np.inf)
    zero = (signal <= 0) | (nonzero <= 0)
    out["sqnr_db"] = np.where(zero, np.nan, sqnr)
    # nothing to judge: every finite value 0, or no finite value at all (all inf/NaN)
    bad = out["nonfinite"].to_numpy(dtype=float)
    no_finite = (bad > 0) & (bad >= out["elements"].to_numpy(dtype=float))
    out["status"] = np.where(zero, np.where(no_finite, NO_FINITE, "all zero"), "measured")
    out["order"] = out["layer"].map(order)
    fmt_rank = {f: i for i, f in enumerate(format_order(out["format"].astype(str)))}
    out = out.assign(
        _op=out["operand"].map(_OPERAND_ORDER).fillna(9),
        _fmt=out["format"].map(fmt_rank),
    )
    out = out.sort_values(["rank", "order", "_fmt", "_op"], kind="stable")
    return out[cols].reset_index(drop=True)


def _scores(stats: pd.DataFrame, table: Mapping[str, FitThresholds]) -> pd.Series:
    """Per row: how far over its thresholds (> 1 fails), NaN for an all-zero row."""
    default = FitThresholds(float("inf"), 0.0, 0.0)
    th = [table.get(str(e), default) for e in stats["element"]]
    min_sqnr = np.array([t.min_sqnr_db for t in th], dtype=float)
    max_flush = np.array([t.max_flushed_share for t in th], dtype=float)
    max_clip = np.array([t.max_clipped_share for t in th], dtype=float)

    def ratio(share: np.ndarray, limit: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(limit > 0, share / limit, np.where(share > 0, np.inf, 0.0))

    flushed = stats["flushed_share"].to_numpy(dtype=float)
    clipped = stats["clipped_share"].to_numpy(dtype=float)
    sqnr = stats["sqnr_db"].to_numpy(dtype=float)
    with np.errstate(over="ignore", invalid="ignore"):
        nsr = np.where(np.isposinf(sqnr), 0.0, 10.0 ** ((min_sqnr - sqnr) / 10.0))
    score = np.maximum.reduce([ratio(flushed, max_flush), ratio(clipped, max_clip), nsr])
    score = np.where(np.isin(stats["status"].to_numpy(), UNJUDGED), np.nan, score)
    return pd.Series(score, index=stats.index)


def compute_block_fit(
    stats: pd.DataFrame, thresholds: Mapping[str, FitThresholds] | None = None
) -> pd.DataFrame:
    """Per (rank, layer, format) of :func:`compute_block_stats`' rows: does the layer fit.

    Columns: ``rank``, ``layer``, ``layer_type``, ``order``, ``format``, ``label``, ``bits``,
    ``element``, ``fits`` (True / False; None when every operand row was all zero),
    ``status`` (``fits``, ``fails`` or ``all zero``), ``operands`` (measured rows), ``failing``
    (the labels of the rows over their thresholds, e.g. ``["dY wgrad"]``), the limiting row's
    ``limit_operand``, ``limit_orientation``, ``limit`` (``dY wgrad``), ``sqnr_db``,
    ``flushed_share``, ``clipped_share``, ``lost_share``, ``scale_under_share`` and ``score``
    (see the module docstring), ``approx`` (the reasons any row is approximate) and
    ``nonfinite`` (inf/NaN elements left out). Thresholds: :data:`FIT_THRESHOLDS` when not
    given.
    """
    table = dict(FIT_THRESHOLDS if thresholds is None else thresholds)
    cols = [
        "rank",
        "layer",
        "layer_type",
        "order",
        "format",
        "label",
        "bits",
        "element",
        "fits",
        "status",
        "operands",
        "failing",
        "limit_operand",
        "limit_orientation",
        "limit",
        "sqnr_db",
        "flushed_share",
        "clipped_share",
        "lost_share",
        "scale_under_share",
        "score",
        "approx",
        "nonfinite",
    ]
    if stats.empty:
        return pd.DataFrame(columns=cols)
    # one pass in numpy: a groupby with a Python body costs 5 ms a group (a second per 200
    # (rank, layer, format) groups), too slow at hundreds of ranks
    s = stats.reset_index(drop=True)
    score = _scores(s, table).to_numpy(dtype=float)
    gid = s.groupby(["rank", "layer", "format"], sort=False).ngroup().to_numpy()
    n = int(gid.max()) + 1
    measured = ~np.isin(s["status"].to_numpy(), UNJUDGED)
    fail = measured & (score > 1.0)
    # per group, its measured row with the highest score (the first of equals), else its first
    key = np.where(measured, score, -np.inf)
    order = np.lexsort((-key, gid))
    starts = np.r_[0, np.flatnonzero(np.diff(gid[order])) + 1]
    worst = order[starts]  # group g's row, g = 0 .. n-1
    any_measured = np.bincount(gid, weights=measured, minlength=n) > 0
    any_fail = np.bincount(gid, weights=fail, minlength=n) > 0
    labels = np.array(
        [row_label(o, d) for o, d in zip(s["operand"], s["orientation"], strict=True)],
        dtype=object,
    )
    failing: list[list[str]] = [[] for _ in range(n)]
    for g, label in zip(gid[fail].tolist(), labels[fail].tolist(), strict=True):
        failing[g].append(label)
    approx: list[set[str]] = [set() for _ in range(n)]
    reasons = s["approx"].to_numpy(dtype=object)
    has = reasons != ""
    for g, reason in zip(gid[has].tolist(), reasons[has].tolist(), strict=True):
        approx[g].add(str(reason))
    w = s.iloc[worst].reset_index(drop=True)
    out = pd.DataFrame(
        {
            "rank": w["rank"].astype(np.int64),
            "layer": w["layer"].astype(str),
            "layer_type": w["layer_type"].astype(str),
            "order": w["order"].astype(np.int64),
            "format": w["format"].astype(str),
        }
    )
    out["label"] = [FORMATS[f].label if f in FORMATS else f for f in out["format"]]
    out["bits"] = w["bits"].astype(float)
    out["element"] = w["element"].astype(str)
    out["fits"] = [bool(~f) if m else None for m, f in zip(any_measured, any_fail, strict=True)]
    # a cell with nothing to judge: "all zero", or "no finite value" where every row had none
    finite_rows = np.bincount(gid, weights=s["status"].to_numpy() != NO_FINITE, minlength=n)
    unjudged = np.where(finite_rows > 0, "all zero", NO_FINITE)
    out["status"] = np.where(~any_measured, unjudged, np.where(any_fail, "fails", "fits"))
    out["operands"] = np.bincount(gid, minlength=n)
    out["failing"] = failing
    lim = np.full(n, None, dtype=object)
    out["limit_operand"] = np.where(any_measured, w["operand"].astype(str), lim)
    out["limit_orientation"] = np.where(any_measured, w["orientation"].astype(str), lim)
    out["limit"] = np.where(any_measured, labels[worst], lim)
    for c in ("sqnr_db", "flushed_share", "clipped_share", "lost_share", "scale_under_share"):
        out[c] = np.where(any_measured, w[c].to_numpy(dtype=float), np.nan)
    out["score"] = np.where(any_measured, score[worst], np.nan)
    out["approx"] = ["; ".join(sorted(a)) for a in approx]
    out["nonfinite"] = np.bincount(gid, weights=s["nonfinite"].to_numpy(dtype=float), minlength=n)
    out["nonfinite"] = out["nonfinite"].astype(np.int64)
    out = out[cols]
    return out.sort_values(["rank", "order"], kind="stable").reset_index(drop=True)


def narrowest_fit(fit: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, layer) of :func:`compute_block_fit`'s rows: the narrowest format of
    :data:`~amprobe.store.blockformats.NARROWEST` that the layer fits (``narrowest``, its
    ``narrowest_label`` and ``narrowest_bits``; None where it fits none), that format's
    limiting row (``limit``, ``sqnr_db``, ``lost_share``), ``approx`` and ``judged`` (False
    when every candidate format's rows were all zero). Per-tensor fp8 is not a candidate."""
    cols = [
        "rank",
        "layer",
        "layer_type",
        "order",
        "judged",
        "narrowest",
        "narrowest_label",
        "narrowest_bits",
        "limit",
        "sqnr_db",
        "lost_share",
        "approx",
    ]
    cand = fit[fit["format"].isin(NARROWEST)] if len(fit) else fit
    if cand.empty:
        return pd.DataFrame(columns=cols)
    cand = cand.assign(_n=cand["format"].map({f: i for i, f in enumerate(NARROWEST)}))
    keys = ["rank", "layer"]
    base = cand.drop_duplicates(keys)[[*keys, "layer_type", "order"]].reset_index(drop=True)
    judged = cand.assign(judged=cand["fits"].notna()).groupby(keys, sort=False)["judged"].any()
    ok = cand[cand["fits"].notna()]
    ok = ok[ok["fits"].astype(bool)].sort_values("_n", kind="stable").drop_duplicates(keys)
    best = base.merge(judged.reset_index(), on=keys, how="left")
    best = best.merge(ok.drop(columns=["layer_type", "order"]), on=keys, how="left")
    reasons = cand.loc[cand["approx"] != "", [*keys, "approx"]].drop_duplicates()
    joined = reasons.sort_values("approx").groupby(keys, sort=False)["approx"].agg("; ".join)
    best = best.drop(columns="approx").merge(joined.reset_index(), on=keys, how="left")
    has = best["format"].notna().to_numpy()
    out = pd.DataFrame(
        {
            "rank": best["rank"].astype(np.int64),
            "layer": best["layer"].astype(str),
            "layer_type": best["layer_type"].astype(str),
            "order": best["order"].astype(np.int64),
            "judged": best["judged"].fillna(False).astype(bool),
            "narrowest": pd.Series(np.where(has, best["format"], None), dtype=object),
            "narrowest_label": pd.Series(np.where(has, best["label"], None), dtype=object),
            "narrowest_bits": pd.Series(np.where(has, best["bits"], None), dtype=object),
            "limit": pd.Series(np.where(has, best["limit"], None), dtype=object),
            "sqnr_db": best["sqnr_db"].astype(float),
            "lost_share": best["lost_share"].astype(float),
            "approx": best["approx"].fillna("").astype(str),
        }
    )
    return out[cols].sort_values(["rank", "order"], kind="stable").reset_index(drop=True)


def block_stats(run: Any) -> pd.DataFrame:
    """:func:`compute_block_stats` of a loaded run's ``blockstats`` table, once per run."""
    return run.cached("block_stats", lambda r: compute_block_stats(r.table(TABLE)))


def block_fit(run: Any, thresholds: Mapping[str, FitThresholds] | None = None) -> pd.DataFrame:
    """:func:`compute_block_fit` of a loaded run, once per run and thresholds."""
    table = dict(FIT_THRESHOLDS if thresholds is None else thresholds)
    key = "block_fit:" + repr(sorted((k, tuple(vars(v).values())) for k, v in table.items()))
    return run.cached(key, lambda r: compute_block_fit(block_stats(r), table))  # type: ignore[no-any-return]
