"""The precision what-if as ``amprobe diagnose --format json`` writes it, bounded at any rank count.

A run of up to :data:`PER_RANK_UP_TO` ranks (one node) keeps one record per (rank, layer,
kind, format, scaling), the rows of :func:`~amprobe.analysis.whatif.compute_whatif` as
:func:`~amprobe.analysis.whatif.whatif_records` writes them: there, a few ranks' records are
smaller than their summary would be. A run of more ranks has one record per (layer, kind,
format, scaling) for all its ranks, so the JSON grows with the diverging ranks, not with the
rank count:

- the columns every rank agrees on, as in a one-rank record, without ``rank``; the ranks as
  ``ranks`` (ranges text, as finding titles write them: ``"0-21, 23-63"``) and
  ``rank_count``;
- ``spread``, only where the ranks differ: per differing column, ``min``, ``median`` and
  ``max`` over the ranks with the ranks holding each extreme (``min_ranks``, ``max_ranks``)
  for numbers, or the distinct ``values`` with their ranks (most ranks first) otherwise;
- ``verdict``, the verdict of most of those ranks (:func:`verdict_of`) and ``verdict_ranks``
  theirs, and ``rows``: the full per-rank records (with ``rank``) of only the ranks whose
  verdict differs from it.

The layout is documented on the what-if page (``docs/whatif.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from amprobe.analysis.whatif import value_codes, whatif_records
from amprobe.rules.engine import REGISTRY, format_ranks, name_ranks

__all__ = ["PER_RANK_UP_TO", "VERDICT_RULE", "VERDICT_THRESHOLD", "verdict_of", "whatif_json"]

#: the rule whose threshold a verdict compares each lost share with (``--threshold`` applies)
VERDICT_RULE, VERDICT_THRESHOLD = "AMP-P02", "max_lost_share"
#: the record's identity: one record per these, over every rank
_KEY = ["module", "kind", "format", "scaling"]
#: runs of at most this many ranks keep one record per rank (a 2-rank run's per-rank records
#: are 157 KB where the merged ones, every record differing a little, were 232 KB)
PER_RANK_UP_TO = 8
#: distinct values of a non-numeric column listed in ``spread`` (the rest counted)
MAX_VALUES = 8


def verdict_of(record: Mapping[str, Any], threshold: float) -> str:
    """What a what-if row says about its layer, format and scaling: ``not judged`` (it held
    inf/NaN), ``overflows`` / ``flushes`` / ``overflows, flushes`` (that share over
    ``threshold``), ``loses`` (overflow and flush together over it), else ``keeps``."""
    if not record.get("judged"):
        return "not judged"
    over = (record.get("overflow_share") or 0.0) > threshold
    flush = (record.get("flush_share") or 0.0) > threshold
    if over or flush:
        return ", ".join(w for w, on in (("overflows", over), ("flushes", flush)) if on)
    return "loses" if (record.get("lost_share") or 0.0) > threshold else "keeps"


def _verdicts(part: pd.DataFrame, threshold: float) -> np.ndarray:
    """:func:`verdict_of` of every row of ``part``, in numpy."""

    def share(name: str) -> np.ndarray:
        values = part[name].to_numpy(dtype=float, na_value=np.nan)
        return np.nan_to_num(values, nan=0.0) > threshold

    judged = part["judged"].fillna(False).to_numpy(dtype=bool)
    over, flush, lost = share("overflow_share"), share("flush_share"), share("lost_share")
    out = np.where(lost, "loses", "keeps").astype(object)
    out[over & ~flush] = "overflows"
    out[flush & ~over] = "flushes"
    out[over & flush] = "overflows, flushes"
    out[~judged] = "not judged"
    return out


def _numbers(column: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column)


def _spread(column: pd.Series, ranks: np.ndarray) -> dict[str, Any]:
    """One differing column over the ranks: its range and median, or its distinct values."""
    if _numbers(column):
        values = column.to_numpy(dtype=float, na_value=np.nan)
        known = ~np.isnan(values)
        missing = int((~known).sum())
        out: dict[str, Any] = {"missing_rank_count": missing} if missing else {}
        if not known.any():
            return out
        lo, hi = float(values[known].min()), float(values[known].max())
        whole = pd.api.types.is_integer_dtype(column)
        return {
            "min": int(lo) if whole else lo,
            "median": float(np.median(values[known])),
            "max": int(hi) if whole else hi,
            "min_ranks": name_ranks(ranks[known & (values == lo)].tolist()),
            "max_ranks": name_ranks(ranks[known & (values == hi)].tolist()),
            **out,
        }
    by_value: dict[str, tuple[Any, list[int]]] = {}
    for v, r in zip(column.tolist(), ranks.tolist(), strict=True):
        plain = list(v) if isinstance(v, list | tuple | np.ndarray) else v
        if plain is not None and not isinstance(plain, list) and pd.isna(plain):
            plain = None
        by_value.setdefault(repr(plain), (plain, []))[1].append(r)
    ordered = sorted(by_value.values(), key=lambda vr: (-len(vr[1]), vr[1][0]))
    listed = [
        {"value": v, "ranks": name_ranks(rs), "rank_count": len(rs)}
        for v, rs in ordered[:MAX_VALUES]
    ]
    left = sum(len(rs) for _, rs in ordered[MAX_VALUES:])
    return {"values": listed, **({"other_rank_count": left} if left else {})}


def _merged(
    part: pd.DataFrame, first: dict[str, Any], differ: list[str], threshold: float
) -> dict[str, Any]:
    """One record for the rows ``part`` of one (layer, kind, format, scaling) over the ranks:
    ``first`` (a row's record) gives the columns in ``differ`` the ranks do not agree on."""
    ranks = part["rank"].to_numpy(dtype=np.int64)
    out: dict[str, Any] = {k: v for k, v in first.items() if k != "rank" and k not in differ}
    out["ranks"] = format_ranks(ranks.tolist())
    out["rank_count"] = len(ranks)
    if not differ:
        return out
    out["spread"] = {c: _spread(part[c], ranks) for c in differ}
    verdicts = _verdicts(part, threshold)
    names, counts = np.unique(verdicts.astype(str), return_counts=True)
    # the most common verdict; a tie goes to the one the lowest rank has
    best = counts.max()
    tied = {str(n) for n, c in zip(names, counts, strict=True) if c == best}
    major = next(str(v) for v in verdicts if v in tied)
    agree = verdicts == major
    out["verdict"] = major
    out["verdict_ranks"] = name_ranks(ranks[agree].tolist())
    rows = whatif_records(part.iloc[np.flatnonzero(~agree)])
    out["rows"] = [{**r, "verdict": str(v)} for r, v in zip(rows, verdicts[~agree], strict=True)]
    return out


def _varies(codes: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per run of ``codes`` beginning at ``starts``: does it hold more than one code."""
    return np.minimum.reduceat(codes, starts) != np.maximum.reduceat(codes, starts)


def whatif_json(
    frame: pd.DataFrame, thresholds: Mapping[str, Mapping[str, float]] | None = None
) -> list[dict[str, Any]]:
    """The what-if table's JSON records: per rank for a run of up to :data:`PER_RANK_UP_TO`
    ranks, merged over the ranks otherwise (the module docstring gives the layout).

    Args:
        frame: :func:`~amprobe.analysis.whatif.compute_whatif`'s table.
        thresholds: the diagnosis's thresholds (``Diagnosis.thresholds``), for the verdicts;
            the registered defaults when absent.
    """
    if not len(frame) or frame["rank"].nunique() <= PER_RANK_UP_TO:
        return whatif_records(frame)
    registered = REGISTRY[VERDICT_RULE].thresholds if VERDICT_RULE in REGISTRY else {}
    merged = {**registered, **dict((thresholds or {}).get(VERDICT_RULE, {}))}
    threshold = float(merged.get(VERDICT_THRESHOLD, 0.0))
    keyed = frame.reset_index(drop=True)
    columns = [c for c in keyed.columns if c not in ("rank", *_KEY)]
    codes = keyed.groupby(_KEY, sort=False, dropna=False).ngroup().to_numpy()
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    starts = np.concatenate([[0], bounds]).astype(np.int64)
    # per group (in code order) and column: do its rows hold more than one value (missing
    # values one value among them, as nunique(dropna=False) counts them)
    varies = np.zeros((len(starts), len(columns)), dtype=bool)
    for j, c in enumerate(columns):
        varies[:, j] = _varies(value_codes(keyed[c])[order], starts)
    rank_of = keyed["rank"].to_numpy(dtype=np.int64)
    groups = np.split(order, bounds)
    first_records = whatif_records(keyed.iloc[[int(rows[0]) for rows in groups]])
    out: list[dict[str, Any]] = []
    for g, (rows, record) in enumerate(zip(groups, first_records, strict=True)):
        differ = [c for c, v in zip(columns, varies[g].tolist(), strict=True) if v]
        if differ:
            out.append(_merged(keyed.iloc[rows], record, differ, threshold))
            continue
        record.pop("rank", None)
        ranks = rank_of[rows].tolist()
        out.append({**record, "ranks": format_ranks(ranks), "rank_count": len(ranks)})
    return out
