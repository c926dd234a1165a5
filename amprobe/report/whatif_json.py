"""The precision what-if as ``amprobe diagnose --format json`` writes it, bounded at any rank count.

A run of one rank keeps one record per (layer, kind, format, scaling), the rows of
:func:`~amprobe.analysis.whatif.compute_whatif` as :func:`~amprobe.analysis.whatif.whatif_records`
writes them. A run of several ranks has one record per (layer, kind, format, scaling) for all
its ranks, so the JSON grows with the diverging ranks, not with the rank count:

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

from amprobe.analysis.whatif import whatif_records
from amprobe.rules.engine import REGISTRY, format_ranks, name_ranks

__all__ = ["VERDICT_RULE", "VERDICT_THRESHOLD", "verdict_of", "whatif_json"]

#: the rule whose threshold a verdict compares each lost share with (``--threshold`` applies)
VERDICT_RULE, VERDICT_THRESHOLD = "AMP-P02", "max_lost_share"
#: the record's identity: one record per these, over every rank
_KEY = ["module", "kind", "format", "scaling"]
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


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def _number(values: list[Any]) -> bool:
    return all(
        v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in values
    )


def _spread(values: list[Any], ranks: list[int]) -> dict[str, Any]:
    """One differing column over the ranks: its range and median, or its distinct values."""
    if _number(values):
        pairs = [(float(v), r) for v, r in zip(values, ranks, strict=True) if v is not None]
        out: dict[str, Any] = (
            {"missing_rank_count": len(values) - len(pairs)} if (len(pairs) < len(values)) else {}
        )
        if not pairs:
            return out
        numbers = np.array([v for v, _ in pairs])
        lo, hi = float(numbers.min()), float(numbers.max())
        whole = all(isinstance(v, int) for v in values if v is not None)
        return {
            "min": int(lo) if whole else lo,
            "median": float(np.median(numbers)),
            "max": int(hi) if whole else hi,
            "min_ranks": name_ranks(r for v, r in pairs if v == lo),
            "max_ranks": name_ranks(r for v, r in pairs if v == hi),
            **out,
        }
    by_value: dict[str, tuple[Any, list[int]]] = {}
    for v, r in zip(values, ranks, strict=True):
        by_value.setdefault(repr(v), (v, []))[1].append(r)
    ordered = sorted(by_value.values(), key=lambda vr: (-len(vr[1]), vr[1][0]))
    listed = [
        {"value": v, "ranks": name_ranks(rs), "rank_count": len(rs)}
        for v, rs in ordered[:MAX_VALUES]
    ]
    left = sum(len(rs) for _, rs in ordered[MAX_VALUES:])
    return {"values": listed, **({"other_rank_count": left} if left else {})}


def _merged(records: list[dict[str, Any]], threshold: float) -> dict[str, Any]:
    """One record for the rows of one (layer, kind, format, scaling) over the ranks."""
    ranks = [int(r["rank"]) for r in records]
    columns = [c for c in records[0] if c != "rank"]
    same: dict[str, Any] = {}
    differ: list[str] = []
    for c in columns:
        first = records[0][c]
        if all(r[c] == first for r in records[1:]):
            same[c] = first
        else:
            differ.append(c)
    out: dict[str, Any] = {
        **same,
        "ranks": format_ranks(ranks),
        "rank_count": len(ranks),
    }
    if not differ:
        return out
    out["spread"] = {c: _spread([r[c] for r in records], ranks) for c in differ}
    verdicts = [verdict_of(r, threshold) for r in records]
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v] = counts.get(v, 0) + 1
    major = max(counts, key=lambda v: counts[v])  # the first most common
    out["verdict"] = major
    out["verdict_ranks"] = name_ranks(r for r, v in zip(ranks, verdicts, strict=True) if v == major)
    out["rows"] = [
        {**r, "verdict": v} for r, v in zip(records, verdicts, strict=True) if v != major
    ]
    return out


def whatif_json(
    frame: pd.DataFrame, thresholds: Mapping[str, Mapping[str, float]] | None = None
) -> list[dict[str, Any]]:
    """The what-if table's JSON records: per rank for a run of one rank, merged over the ranks
    otherwise (the module docstring gives the layout).

    Args:
        frame: :func:`~amprobe.analysis.whatif.compute_whatif`'s table.
        thresholds: the diagnosis's thresholds (``Diagnosis.thresholds``), for the verdicts;
            the registered defaults when absent.
    """
    if not len(frame) or frame["rank"].nunique() <= 1:
        return whatif_records(frame)
    registered = REGISTRY[VERDICT_RULE].thresholds if VERDICT_RULE in REGISTRY else {}
    merged = {**registered, **dict((thresholds or {}).get(VERDICT_RULE, {}))}
    threshold = float(merged.get(VERDICT_THRESHOLD, 0.0))
    keyed = frame.reset_index(drop=True)
    columns = [c for c in keyed.columns if c not in ("rank", *_KEY)]
    hashable = keyed[columns].copy()
    for c in columns:
        if hashable[c].dtype == object:  # lists (nonfinite_steps) compared as tuples
            hashable[c] = hashable[c].map(lambda v: tuple(v) if isinstance(v, list) else v)
    codes = keyed.groupby(_KEY, sort=False, dropna=False).ngroup().to_numpy()
    constant = (hashable.groupby(codes).nunique(dropna=False) <= 1).all(axis=1)
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    rank_of = keyed["rank"].to_numpy(dtype=np.int64)
    firsts = [int(rows[0]) for rows in np.split(order, bounds)]
    first_records = whatif_records(keyed.iloc[firsts])
    out: list[dict[str, Any]] = []
    for rows, record in zip(np.split(order, bounds), first_records, strict=True):
        code = int(codes[rows[0]])
        if constant.get(code, False):
            ranks = rank_of[rows].tolist()
            record.pop("rank", None)
            out.append(
                {
                    **record,
                    "ranks": format_ranks(ranks),
                    "rank_count": len(ranks),
                }
            )
        else:
            out.append(_merged(whatif_records(keyed.iloc[rows]), threshold))
    return out
