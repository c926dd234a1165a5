"""Rules on the block-scaled what-if: the narrowest block format per matmul layer, hostile layers.

Both read :func:`amprobe.analysis.blockfit.block_fit`, derived from the ``blockstats`` table
(the three GEMM operands of each matmul layer, X, W and dY, each in the orientations the
training recipes quantize, measured on the numerics collector's sampled steps against each
block format of :mod:`amprobe.store.blockformats`). The thresholds are one table per element
type (:data:`~amprobe.analysis.blockfit.FIT_THRESHOLDS`), registered flattened on both rules
(``e2m1_min_sqnr_db``, ...): override both to keep them judging alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import pandas as pd

from amprobe.analysis.blockfit import (
    OPERAND_LABELS,
    UNJUDGED,
    block_fit,
    block_fit_missing_reason,
    block_stats,
    block_unmeasured,
    flat_thresholds,
    narrowest_fit,
    row_label,
    thresholds_by_element,
)
from amprobe.rules.engine import Finding, RuleContext, requirement, rule
from amprobe.rules.refs import BLOCK_SCALING, MX_SPEC
from amprobe.store.blockformats import FORMATS, NARROWEST
from amprobe.store.loader import Run

__all__ = ["check_block_format_fit", "check_block_format_hostile", "db_text"]

#: the format shown beside the candidates (never one: one scale per tensor)
PER_TENSOR = "fp8_tensor"
_HARDWARE = (
    "MX and NVFP4 GEMMs run on Blackwell's tensor cores (sm_100); on Hopper, fp8 tensor cores "
    "take one scale per tensor, and the 1x128 / 128x128 blockwise fp8 recipe is a software "
    "recipe that applies the tile scales around them."
)


def db_text(value: Any) -> str:
    """An SQNR as evidence and titles write it: ``31.2 dB``, ``lossless`` (no error),
    ``all zero`` (nothing to cast)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "all zero"
    if math.isinf(float(value)):
        return "lossless"
    return f"{float(value):.1f} dB"


def _db(value: Any) -> float | str:
    """An SQNR as an evidence value: a number rounded to 0.1 dB, else :func:`db_text`'s words
    (JSON has no inf or NaN)."""
    if value is None or not math.isfinite(float(value)):
        return db_text(value)
    return round(float(value), 1)


def _share(value: Any) -> float | None:
    return None if value is None or pd.isna(value) else round(float(value), 6)


def _pct(share: float) -> str:
    return f"{share * 100:.3g} %"


def _bits(bits: float) -> str:
    return f"{bits:g} bits per element"


# -- requirement --------------------------------------------------------------------------------
@requirement("block_stats")
def _has_block_stats(run: Run) -> str | None:
    missing = block_fit_missing_reason(run)
    if missing is not None:
        return missing
    measured = set(block_stats(run)["format"].astype(str))
    if not measured & set(NARROWEST):
        names = ", ".join(sorted(measured))
        return (
            f"no block-scaled format was measured (block_formats held only {names}; the "
            f"candidates are {', '.join(NARROWEST)})"
        )
    return None


def _fit(ctx: RuleContext) -> pd.DataFrame:
    return block_fit(ctx.run, thresholds_by_element(ctx.thresholds))


# -- AMP-P04 ------------------------------------------------------------------------------------
@rule(
    "AMP-P04",
    "block-format-fit",
    "info",
    "speed",
    requires=("block_stats",),
    thresholds={**flat_thresholds(), "max_layers": 24},
    refs=(MX_SPEC, BLOCK_SCALING),
)
def check_block_format_fit(ctx: RuleContext) -> Iterator[Finding]:
    """Per matmul layer, the narrowest block-scaled format whose three GEMM operands all fit.

    Per rank, for each matmul layer with block statistics, the formats of
    :data:`~amprobe.store.blockformats.NARROWEST` are tried narrowest first (MXFP4 4.25 bits per
    element with its scales, NVFP4 4.5, MXFP8 and blockwise fp8 8.25); the layer fits a format
    when every measured row of it (X fwd and wgrad, W fwd and dgrad or its 2-D tiles, dY dgrad
    and wgrad) keeps at least ``<element>_min_sqnr_db`` and flushes and clips at most
    ``<element>_max_flushed_share`` and ``<element>_max_clipped_share`` of its nonzero values,
    pooled over the sampled steps. Rows whose values were all zero never fail. One finding per
    rank, when some layer fits a format: the title counts the layers per narrowest format, the
    table gives each layer's format, bits, limiting operand and its SQNR and lost share, and
    per-tensor fp8's verdict beside it (not a candidate). Approximate rows (a DTensor's local
    shard, conv blocks along input channels) are named in ``approx``.
    """
    th = ctx.thresholds
    fit = _fit(ctx)
    if fit.empty:
        return
    # plain records grouped by rank: a few dict reads per layer, not a frame slice per rank
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for rec in narrowest_fit(fit).to_dict("records"):
        by_rank.setdefault(int(rec["rank"]), []).append(rec)
    per_tensor = {
        (int(r["rank"]), str(r["layer"])): r
        for r in fit[fit["format"] == PER_TENSOR].to_dict("records")
    }
    unmeasured = block_unmeasured(ctx.run)
    for rank in sorted(by_rank):
        layers = by_rank[rank]
        judged = [r for r in layers if r["judged"]]
        fitting = [r for r in judged if r["narrowest"] is not None]
        if not fitting:
            continue
        counts: dict[str, int] = {}
        for r in judged:
            key = str(r["narrowest"]) if r["narrowest"] is not None else ""
            counts[key] = counts.get(key, 0) + 1
        ordered = [f for f in NARROWEST if f in counts]
        first = ordered[0]
        parts = [
            f"{counts[first]} of {len(judged)} matmul layer(s) fit {FORMATS[first].label} "
            f"({_bits(FORMATS[first].bits)})"
        ]
        parts += [f"{counts[f]} need {FORMATS[f].label}" for f in ordered[1:]]
        if counts.get(""):
            parts.append(f"{counts['']} fit none of the block formats measured")
        tensor_fits = None
        rows = []
        for r in judged:
            pt = per_tensor.get((rank, str(r["layer"])))
            pt_text = "not measured"
            if pt is not None and pt["fits"] is not None and not pd.isna(pt["fits"]):
                ok = bool(pt["fits"])
                tensor_fits = (tensor_fits or 0) + int(ok)
                pt_text = ("fits" if ok else "fails") + f" ({pt['limit']} {db_text(pt['sqnr_db'])})"
            fits = r["narrowest"] is not None
            rows.append(
                {
                    "module": r["layer"],
                    "module_type": r["layer_type"],
                    "narrowest": r["narrowest_label"] if fits else "none",
                    "bits": r["narrowest_bits"],
                    "limiting": r["limit"] if fits else "",
                    "sqnr_db": _db(r["sqnr_db"]) if fits else "",
                    "lost_share": _share(r["lost_share"]) if fits else None,
                    "fp8_per_tensor": pt_text,
                    "approx": r["approx"] or "exact",
                }
            )
        if tensor_fits is not None:
            parts.append(f"per-tensor fp8 (shown beside, not a candidate): {tensor_fits} fit")
        if unmeasured:
            parts.append("some matmul layers not measured (not_measured says which and why)")
        unjudged = [str(r["layer"]) for r in layers if not r["judged"]]
        approx = sorted({r["module"] for r in rows if r["approx"] != "exact"})
        yield ctx.finding(
            title="; ".join(parts),
            evidence={
                "rank": rank,
                "layers": rows[: int(th["max_layers"])],
                "layer_count": len(judged),
                "fitting_count": len(fitting),
                "all_zero_modules": unjudged,
                "approx_modules": approx,
                "not_measured": unmeasured,
                "order": [f"{FORMATS[f].label} ({FORMATS[f].bits:g})" for f in NARROWEST],
                **{k: v for k, v in th.items() if k != "max_layers"},
            },
            fix=(
                "These layers can move to the format named first, narrowest first; keep the "
                "others in bf16 (or the wider format named) and compare the loss curve against "
                "this run. " + _HARDWARE
            ),
        )


# -- AMP-P05 ------------------------------------------------------------------------------------
def _what_fails(row: Mapping[str, Any], th: Mapping[str, Any], subject: str) -> str:
    """``flushes 12 % of SUBJECT`` / ``clips 0.5 % of SUBJECT`` / ``leaves SUBJECT at 9.1 dB
    SQNR (min 13 dB)``: the measure furthest over its threshold, of one operand row."""
    limits = th[str(row["element"])]
    ratios = {
        "flush": (row["flushed_share"] or 0.0) / max(limits.max_flushed_share, 1e-300),
        "clip": (row["clipped_share"] or 0.0) / max(limits.max_clipped_share, 1e-300),
        "sqnr": 10.0 ** ((limits.min_sqnr_db - row["sqnr_db"]) / 10.0)
        if math.isfinite(row["sqnr_db"])
        else 0.0,
    }
    worst = max(ratios, key=lambda k: ratios[k])
    if worst == "flush":
        return f"flushes {_pct(row['flushed_share'])} of {subject}"
    if worst == "clip":
        return f"clips {_pct(row['clipped_share'])} of {subject}"
    return f"leaves {subject} at {db_text(row['sqnr_db'])} SQNR (min {limits.min_sqnr_db:g} dB)"


def _cause(rows: pd.DataFrame) -> str:
    """What to look at, from the failing rows: tiny values (block scales underflow), outlier
    channels (a large block amax flushes or clips the rest), or spread within blocks."""
    if (rows["scale_under"] > 0).any():
        share = float(rows["scale_under_share"].max())
        return (
            f"Tiny values: {_pct(share)} of the blocks' own scales underflow their format "
            "(e8m0 stops at 2^-127, an e4m3 scale at 2^-9 of the tensor scale), so whole blocks "
            "flush; look at vanishing gradients or scale them before the cast."
        )
    if (rows["clipped"] > 0).any() or (rows["flushed"] > 0).any():
        return (
            "Look at outlier channels: one large value sets its block's scale, and the small "
            "values beside it flush (or the rounded scale clips the block's largest values)."
        )
    return "The values spread too widely within blocks for the element's few mantissa bits."


@rule(
    "AMP-P05",
    "block-format-hostile",
    "info",
    "speed",
    requires=("block_stats",),
    thresholds={**flat_thresholds(), "min_fitting_share": 0.5, "max_layers": 12},
    refs=(MX_SPEC, BLOCK_SCALING),
)
def check_block_format_hostile(ctx: RuleContext) -> Iterator[Finding]:
    """Matmul layers that even block scaling loses, one finding per layer.

    Per rank, a block format of :data:`~amprobe.store.blockformats.NARROWEST` is common when at
    least ``min_fitting_share`` of the matmul layers judged for it fit it (thresholds as in
    AMP-P04). A layer is hostile when it fails a common format, or fits no block format at
    all; the title names the operand, orientation and format that fail, with the measure
    furthest over its threshold (the flushed or clipped share of nonzero values, or the SQNR),
    for the common format most layers fit (or, fitting none, the format it comes closest to).
    Evidence: per failing format, every operand row with its flushed, clipped and scale
    underflow shares, SQNR and the thresholds; approximate rows say why. Rows whose values were
    all zero never fail. At most ``max_layers`` findings per rank, worst first.
    """
    th = ctx.thresholds
    limits = thresholds_by_element(th)
    fit = _fit(ctx)
    if fit.empty:
        return
    stats = block_stats(ctx.run)
    rows_of = stats.groupby(["rank", "layer"], sort=False).indices
    cand = fit[fit["format"].isin(NARROWEST) & fit["fits"].notna()]
    # per rank, per layer, per format: its fit record (plain dicts: read a few times each)
    layers_of: dict[int, dict[str, dict[str, dict[str, Any]]]] = {}
    for rec in cand.to_dict("records"):
        per = layers_of.setdefault(int(rec["rank"]), {})
        per.setdefault(str(rec["layer"]), {})[str(rec["format"])] = rec
    for rank in sorted(layers_of):
        layers = layers_of[rank]
        share: dict[str, float] = {}
        for f in NARROWEST:
            judged = [by[f]["fits"] for by in layers.values() if f in by]
            if judged:
                share[f] = sum(bool(x) for x in judged) / len(judged)
        common = [f for f in NARROWEST if share.get(f, 0.0) >= th["min_fitting_share"]]
        found = []
        for layer, by_fmt in layers.items():
            fails = [f for f in common if f in by_fmt and not by_fmt[f]["fits"]]
            fits_none = not any(bool(r["fits"]) for r in by_fmt.values())
            if not fails and not fits_none:
                continue
            if fails:  # the common format most layers fit (then the narrowest)
                named = max(fails, key=lambda f: (share[f], -NARROWEST.index(f)))
            else:  # the format it comes closest to
                named = min(by_fmt, key=lambda f: float(by_fmt[f]["score"]))
            failing = [f for f in NARROWEST if f in by_fmt and not by_fmt[f]["fits"]]
            found.append((float(by_fmt[named]["score"]), layer, named, failing, fits_none))

        found.sort(key=lambda x: -x[0])
        for _score, layer, named, failing, _fits_none in found[: int(th["max_layers"])]:
            lim = layers[layer][named]
            rows = stats.iloc[rows_of[(rank, layer)]]
            worst = rows[
                (rows["format"] == named)
                & (rows["operand"] == lim["limit_operand"])
                & (rows["orientation"] == lim["limit_orientation"])
            ].iloc[0]
            label = FORMATS[named].label
            op = OPERAND_LABELS.get(str(worst["operand"]), str(worst["operand"]))
            subject = f"`{layer}`'s {op} ({worst['orientation']})"
            # the formats measured for the layer that it fits (judged, not all zero), narrowest
            # first: what it can move to instead, as AMP-P04 names it
            fitting = [f for f in NARROWEST if f in layers[layer] and layers[layer][f]["fits"]]
            what = _what_fails(worst, limits, subject)
            if fitting:
                other = FORMATS[fitting[0]].label
                title = f"{label} {what}: keep it out of {label} (it fits {other}, or bf16)"
                advice = (
                    f"Keep `{layer}` out of {label} when moving the other layers to it: it fits "
                    f"{other} (AMP-P04), or keep it in bf16. "
                )
            else:
                title = (
                    f"{label} {what}: keep it in bf16; it fits none of the block formats measured"
                )
                advice = f"Keep `{layer}` in bf16 when moving the other layers to {label}. "
            table = []
            failing_rows = rows[rows["format"].isin(failing)]
            for r in failing_rows.itertuples():
                lt = limits.get(str(r.element))
                over = layers[layer][str(r.format)]["failing"]
                table.append(
                    {
                        "format": FORMATS[r.format].label if r.format in FORMATS else r.format,
                        "operand": OPERAND_LABELS.get(str(r.operand), str(r.operand)),
                        "orientation": r.orientation,
                        "flushed_share": _share(r.flushed_share),
                        "clipped_share": _share(r.clipped_share),
                        "scale_under_share": _share(r.scale_under_share),
                        "sqnr_db": _db(r.sqnr_db),
                        "min_sqnr_db": None if lt is None else lt.min_sqnr_db,
                        "max_flushed_share": None if lt is None else lt.max_flushed_share,
                        "max_clipped_share": None if lt is None else lt.max_clipped_share,
                        "verdict": (
                            str(r.status)
                            if r.status in UNJUDGED
                            else "fails"
                            if row_label(r.operand, r.orientation) in over
                            else "fits"
                        ),
                        "approx": r.approx or "exact",
                    }
                )
            failed_rows = failing_rows[~failing_rows["status"].isin(UNJUDGED)]
            yield ctx.finding(
                title=title,
                evidence={
                    "rank": rank,
                    "module": layer,
                    "module_type": str(lim["layer_type"]),
                    "format": label,
                    "operand": op,
                    "orientation": str(worst["orientation"]),
                    "flushed_share": _share(worst["flushed_share"]),
                    "clipped_share": _share(worst["clipped_share"]),
                    "sqnr_db": _db(worst["sqnr_db"]),
                    "failing_formats": [FORMATS[f].label for f in failing],
                    "common_formats": [FORMATS[f].label for f in common],
                    "rows": table,
                    "approx": lim["approx"] or "exact",
                    "layers_affected": len(found),
                    **{k: v for k, v in th.items() if k != "max_layers"},
                },
                fix=advice + _cause(failed_rows),
            )
