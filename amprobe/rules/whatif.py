"""Rules on the precision what-if (checklist section E): fp8 candidates, fp8-hostile layers, fp16 range.

All three read :func:`amprobe.analysis.whatif.compute_whatif`, derived from the per-layer
exponent histograms of the ``numerics`` collector. What is measured per layer: its forward
output (``activation``), the gradient of that output (``output gradient``, the input of the
layer's backward GEMMs) and its parameters' gradient. A layer's forward input and its weights
are not recorded, so the rules say "activations" for the layer's output only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pandas as pd

from amprobe.analysis.numerics import has_numerics, numerics_section
from amprobe.analysis.whatif import (
    FORMATS,
    KINDS,
    compute_fp16_gradient_fit,
    compute_whatif,
    not_judged_text,
    value_codes,
)
from amprobe.rules.data import autocast_dtypes, per_rank
from amprobe.rules.engine import Finding, RuleContext, requirement, rule
from amprobe.rules.refs import AMP_DOCS, FP8_PRIMER, GRADIENT_SCALING
from amprobe.store.loader import Run

__all__ = ["FP8_FORMAT_BY_KIND", "matmul_flops", "fp8_layer_table", "exp_range"]

#: numerics kind -> the fp8 format it would use (the "hybrid" recipe: e4m3 forward, e5m2 backward)
FP8_FORMAT_BY_KIND: Mapping[str, str] = {"output": "e4m3", "grad_output": "e5m2"}
#: module types taken as matmul layers when the compute collector captured no step
_MATMUL_TYPES = re.compile(r"Linear|Conv|Bilinear|MultiheadAttention")
_MEASURED = (
    "activation = the layer's forward output (the next layer's input); gradient = the gradient "
    "of that output (the input of this layer's backward GEMMs); the layer's input and weights "
    "are not recorded"
)


def exp_range(low: Any, high: Any) -> str:
    """``2^-14 … 2^3`` from binade exponents (values lie in ``[2**low, 2**(high+1))``)."""
    if low is None or high is None or pd.isna(low) or pd.isna(high):
        return "no nonzero values"
    return f"2^{int(low)} … 2^{int(high)}"


def matmul_flops(run: Run, rank: int) -> tuple[dict[str, float] | None, str]:
    """Each module's share of the matmul FLOPs of ``rank``'s last captured step.

    Returns ``(module -> share, source)``; ``None`` when the compute collector captured no
    step, with the source saying so. The ``compute_ops`` table (a few rows per rank) is read
    once for every rank (:func:`_matmul_flops_by_rank`).
    """
    by_rank = run.cached("matmul_flops", _matmul_flops_by_rank)
    if by_rank is None:
        return None, "not recorded (the compute collector captured no step)"
    if rank not in by_rank:
        return None, f"not recorded on rank {rank}"
    return by_rank[rank]  # type: ignore[no-any-return]


def _matmul_flops_by_rank(
    run: Run,
) -> dict[int, tuple[dict[str, float] | None, str]] | None:
    """:func:`matmul_flops` of every rank with ``compute_ops`` rows, grouped once (None when
    the table is empty)."""
    ops = run.table("compute_ops")
    if ops.empty:
        return None
    last = ops.groupby("rank")["step"].transform("max")
    at = ops[ops["step"] == last]
    out: dict[int, tuple[dict[str, float] | None, str]] = {}
    steps = {int(r): int(s) for r, s in ops.groupby("rank")["step"].max().items()}
    sums = at.groupby(["rank", "module"])["flops"].sum()
    per: dict[int, dict[str, float]] = {}
    for (rank, module), value in sums.items():
        per.setdefault(int(rank), {})[str(module)] = float(value)
    for rank, step in steps.items():
        flops = per.get(rank, {})
        # numpy's sum, in the groupby's module order: the total pandas gave per rank
        total = float(np.sum(np.array(list(flops.values()), dtype=float)))
        if total <= 0:
            out[rank] = (None, f"compute_ops step {step} holds no FLOPs")
        else:
            out[rank] = (
                {m: v / total for m, v in flops.items()},
                f"compute_ops, step {step}",
            )
    return out


def fp8_layer_table(run: Run, rank: int) -> tuple[pd.DataFrame, str]:
    """Per matmul layer of ``rank``: its fp8 lost shares with per-tensor scaling and FLOPs share.

    Matmul layers are the modules with matmul FLOPs in ``compute_ops``; without it, modules
    whose type looks like a matmul (Linear, Conv, ...). Columns: ``module``, ``module_type``,
    ``order``, ``flops_share`` (None when not recorded) and per kind of
    :data:`FP8_FORMAT_BY_KIND`: ``<kind>_lost`` (overflow + flush share of the finite nonzero
    values), ``<kind>_flush``, ``<kind>_range`` (None where the kind was not recorded or held
    inf/NaN: not judged), ``<kind>_nonfinite`` (NaN + inf values recorded) and
    ``<kind>_nonfinite_steps`` (the sampled steps at which it held them). Computed once per run and rank (AMP-P01
    and AMP-P02 both read it).
    """
    return _fp8_class(run, rank)[1]


def _fp8_class(run: Run, rank: int) -> tuple[Any, tuple[pd.DataFrame, str]]:
    """``rank``'s class number and :func:`fp8_layer_table`: ranks of one class (the same
    what-if rows of the table's columns, FLOPs shares and source) have the same table, computed
    once for all of them: the class is the data the table is made of, never where it came from.
    Computed once per run and rank (AMP-P01 and AMP-P02 both read it)."""

    def compute(run: Run) -> tuple[Any, tuple[pd.DataFrame, str]]:
        columns = _per_tensor_columns(run)
        start, end = columns["ranks"].get(rank, (0, 0))
        # the rows as their values' codes: equal bytes are equal rows
        rows_key = columns["keys"][start:end].tobytes()
        flops, source = matmul_flops(run, rank)
        key = (rows_key, None if flops is None else tuple(flops.items()), source)
        # each class's number and table (the number is the key the findings are kept under:
        # the rows' key hashed and compared once per rank, not once per rule)
        tables: dict[Any, tuple[int, tuple[pd.DataFrame, str]]] = run.cached(
            "fp8_layer_tables", lambda r: {}
        )
        if key not in tables:
            if len(tables) < _SLICED:  # few classes so far: the rank's rows alone
                frame = columns["frame"]
                values = [frame[c].iloc[start:end].tolist() for c in _FP8_COLUMNS]
            else:
                values = [v[start:end] for v in _per_tensor_values(run)]
            records = [
                dict(zip(_FP8_COLUMNS, row, strict=True)) for row in zip(*values, strict=True)
            ]
            tables[key] = (len(tables), _fp8_layer_table(records, flops, source))
        return tables[key]

    return run.cached(f"fp8_class:{rank}", compute)  # type: ignore[no-any-return]


def _per_tensor_columns(run: Run) -> dict[str, Any]:
    """The per-tensor what-if rows of every rank (``frame``, each rank's rows together), as
    codes of their values (``keys``: rows x columns, equal codes for equal values) and each
    rank's ``(start, end)`` rows (read once: a frame lookup per rank would cost the whole
    table per rank). :func:`_per_tensor_values` gives the columns as lists."""

    def compute(run: Run) -> dict[str, Any]:
        whatif = compute_whatif(run)
        wf = whatif[whatif["scaling"] == "per-tensor"]
        ranks = wf["rank"].to_numpy()
        if len(ranks) and (np.diff(ranks) < 0).any():
            wf = wf.iloc[np.argsort(ranks, kind="stable")]  # each rank's rows together
            ranks = wf["rank"].to_numpy()
        starts: Any = np.flatnonzero(np.r_[True, np.diff(ranks) != 0]) if len(ranks) else []
        bounds = [*starts, len(ranks)]
        keys = np.zeros((len(ranks), len(_FP8_COLUMNS)), dtype=np.int64)
        for j, c in enumerate(_FP8_COLUMNS):
            keys[:, j] = value_codes(wf[c])
        return {
            "frame": wf,
            "keys": keys,
            "ranks": {
                int(ranks[a]): (int(a), int(b)) for a, b in zip(bounds, bounds[1:], strict=False)
            },
        }

    return run.cached("whatif_per_tensor_columns", compute)  # type: ignore[no-any-return]


#: classes whose fp8 tables read their rows from the frame; past them, every column is read
#: as a list once (a frame slice per class would cost more at thousands of classes)
_SLICED = 32


def _per_tensor_values(run: Run) -> list[list[Any]]:
    """The columns of :func:`_per_tensor_columns`' rows as lists, read once per run when a
    class's table is first made."""
    return run.cached(  # type: ignore[no-any-return]
        "whatif_per_tensor_values",
        lambda r: [_per_tensor_columns(r)["frame"][c].tolist() for c in _FP8_COLUMNS],
    )


def _per_class(ctx: RuleContext, rank: int, make: Any) -> Finding | None:
    """The finding of ``rank`` from ``make(table, source)`` (``(title, evidence, fix)`` or
    None), computed once per class of ranks with the same :func:`fp8_layer_table` inputs
    (:func:`_fp8_class`) and rule thresholds; ``evidence`` gets ``rank`` first."""
    key, (table, source) = _fp8_class(ctx.run, rank)
    made: dict[Any, Any] = ctx.run.cached(f"fp8_findings:{ctx.spec.id}", lambda r: {})
    full = (key, tuple(sorted(ctx.thresholds.items())))
    if full not in made:
        made[full] = None if table.empty else make(table, source)
    if made[full] is None:
        return None
    title, evidence, fix = made[full]
    return ctx.finding(title=title, evidence={"rank": rank, **evidence}, fix=fix)


#: the what-if columns the fp8 layer table reads
_FP8_COLUMNS = (
    "module",
    "module_type",
    "kind",
    "format",
    "order",
    "nonzero",
    "nonfinite",
    "nonfinite_steps",
    "lost_share",
    "flush_share",
    "min_exp",
    "max_exp",
)


def _fp8_layer_table(
    records: list[dict[str, Any]], flops: dict[str, float] | None, source: str
) -> tuple[pd.DataFrame, str]:
    """:func:`fp8_layer_table` of a rank's per-tensor what-if records and FLOPs shares."""
    recorded = [r for r in records if r["kind"] == "output"]
    if flops is not None:
        modules = [
            m for m in dict.fromkeys(r["module"] for r in recorded) if flops.get(str(m), 0.0) > 0
        ]
    else:
        modules = [
            r["module"] for r in recorded if _MATMUL_TYPES.search(str(r["module_type"] or ""))
        ]
    # each module's first row, and its first row of each kind in that kind's fp8 format
    first: dict[Any, dict[str, Any]] = {}
    picked: dict[str, dict[Any, dict[str, Any]]] = {kind: {} for kind in FP8_FORMAT_BY_KIND}
    for r in records:
        first.setdefault(r["module"], r)
        if FP8_FORMAT_BY_KIND.get(r["kind"]) == r["format"]:
            picked[r["kind"]].setdefault(r["module"], r)
    rows = []
    for module in dict.fromkeys(modules):
        row: dict[str, Any] = {
            "module": module,
            "module_type": first[module]["module_type"],
            "order": int(first[module]["order"]),
            "flops_share": flops.get(str(module)) if flops is not None else None,
        }
        for kind in FP8_FORMAT_BY_KIND:
            sel = picked[kind].get(module)
            row[f"{kind}_nonfinite"] = 0 if sel is None else int(sel["nonfinite"])
            row[f"{kind}_nonfinite_steps"] = [] if sel is None else list(sel["nonfinite_steps"])
            if sel is None or int(sel["nonzero"]) == 0 or int(sel["nonfinite"]) > 0:
                # not recorded, nothing nonzero, or held inf/NaN: not judged
                row[f"{kind}_lost"] = row[f"{kind}_flush"] = row[f"{kind}_range"] = None
                continue
            row[f"{kind}_lost"] = float(sel["lost_share"])
            row[f"{kind}_flush"] = float(sel["flush_share"])
            row[f"{kind}_range"] = exp_range(sel["min_exp"], sel["max_exp"])
        rows.append(row)
    cols = ["module", "module_type", "order", "flops_share"] + [
        f"{k}_{c}"
        for k in FP8_FORMAT_BY_KIND
        for c in ("lost", "flush", "range", "nonfinite", "nonfinite_steps")
    ]
    table = pd.DataFrame(rows, columns=cols).sort_values("order", kind="stable")
    if flops is None:
        source += "; matmul layers taken from module types (Linear, Conv, ...)"
    return table.reset_index(drop=True), source


def _ranks(run: Run) -> list[int]:
    whatif = compute_whatif(run)
    return sorted(int(r) for r in whatif["rank"].unique()) if len(whatif) else []


def _pct(share: float) -> str:
    return f"{share * 100:.3g} %"


def _not_judged(table: pd.DataFrame, per_kind: bool = False) -> list[str]:
    """``proj: not judged, held inf/NaN at steps 17–23`` for each layer of an fp8 layer table
    whose activations or output gradients held inf/NaN (the steps of both kinds); with
    ``per_kind``, one entry per kind (``proj output gradients: not judged, ...``)."""
    out = []
    for r in table.to_dict("records"):
        held = [kind for kind in FP8_FORMAT_BY_KIND if r[f"{kind}_nonfinite"]]
        if per_kind:
            out += [
                not_judged_text(f"{r['module']} {KINDS[k]}s", r[f"{k}_nonfinite_steps"])
                for k in held
            ]
        elif held:
            steps = {s for kind in held for s in r[f"{kind}_nonfinite_steps"]}
            out.append(not_judged_text(r["module"], steps))
    return out


# -- requirement --------------------------------------------------------------------------------
@requirement("numerics_ranges")
def _has_ranges(run: Run) -> str | None:
    if not has_numerics(run):
        return "no per-layer exponent histogram was recorded (the numerics table is empty)"
    layers = [x for r in run.ranks for x in numerics_section(run, r.rank)["layers"]]
    if not any(x["kind"] in KINDS for x in layers):
        return "the numerics table holds only model inputs: no activation or gradient histogram"
    return None


# -- rules --------------------------------------------------------------------------------------
@rule(
    "AMP-P01",
    "fp8-candidates",
    "info",
    "speed",
    requires=("numerics_ranges",),
    thresholds={"min_representable_share": 0.999, "max_layers": 12},
    refs=(FP8_PRIMER, AMP_DOCS),
)
def check_fp8_candidates(ctx: RuleContext) -> Iterator[Finding]:
    """Matmul layers whose values fit fp8 with per-tensor scaling, with their share of FLOPs.

    Per matmul layer (see :func:`fp8_layer_table`), summed over sampled steps: the share of
    nonzero activations representable (neither flushed nor saturated) in e4m3 and of nonzero
    output gradients in e5m2, each with the amax-based power-of-two per-tensor scale of its
    step. A layer is a candidate when both are at least ``min_representable_share``; a layer
    without a recorded output gradient is not a candidate (not measured), nor is one whose
    recorded activations or output gradients held NaN/inf (its range cannot be judged; listed
    in ``not_judged_nonfinite``, and in the title and ``not_judged`` with the sampled steps at
    which it held them). FLOPs shares come from ``compute_ops`` (last captured step)
    when recorded.
    """
    th = ctx.thresholds

    def make(table: pd.DataFrame, source: str) -> tuple[str, dict[str, Any], str] | None:
        limit = 1.0 - th["min_representable_share"]
        nonfinite = (table["output_nonfinite"] + table["grad_output_nonfinite"]) > 0
        ok = (
            ~nonfinite
            & table["output_lost"].notna()
            & table["grad_output_lost"].notna()
            & (table["output_lost"].fillna(1.0) <= limit + 1e-12)
            & (table["grad_output_lost"].fillna(1.0) <= limit + 1e-12)
        )
        good = table[ok]
        if good.empty:
            return None
        not_judged = _not_judged(table)
        flops_known = table["flops_share"].notna().any()
        share = float(good["flops_share"].fillna(0).sum()) if flops_known else None
        names = [str(m) for m in good["module"]]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        flops_text = (
            f"; {_pct(share)} of matmul FLOPs"
            if share is not None
            else "; their matmul FLOPs were not recorded"
        )
        judged = len(table) - int(nonfinite.sum())
        of = f"{judged} judged" if not_judged else f"{len(table)}"
        return (
            (
                f"{len(good)} of {of} matmul layer(s) keep ≥ "
                f"{_pct(th['min_representable_share'])} of their values in fp8 with per-tensor "
                f"scaling (e4m3 activations, e5m2 gradients): {shown}{flops_text}"
                + "".join(f"; {text}" for text in not_judged)
            ),
            {
                "layers": [
                    {
                        "module": r.module,
                        "module_type": r.module_type,
                        "flops_share": None if pd.isna(r.flops_share) else round(r.flops_share, 4),
                        "activation_range": r.output_range,
                        "activation_lost_e4m3": round(float(r.output_lost), 6),
                        "gradient_range": r.grad_output_range,
                        "gradient_lost_e5m2": round(float(r.grad_output_lost), 6),
                    }
                    for r in good.head(int(th["max_layers"])).itertuples()
                ],
                "candidate_flops_share": None if share is None else round(share, 4),
                "matmul_layers": len(table),
                "not_judged_nonfinite": [str(m) for m in table.loc[nonfinite, "module"]],
                "not_judged": not_judged,
                "flops_source": source,
                "min_representable_share": th["min_representable_share"],
                "scaling": "per-tensor power of two from each step's amax",
                "measured": _MEASURED,
            },
            (
                "Move these layers to fp8 first (e.g. Transformer Engine te.Linear under "
                "te.fp8_autocast with the HYBRID recipe: e4m3 forward, e5m2 backward) and keep "
                "the other layers in bf16; compare the loss curve against the bf16 run."
            ),
        )

    for rank in _ranks(ctx.run):
        finding = _per_class(ctx, rank, make)
        if finding is not None:
            yield finding


@rule(
    "AMP-P02",
    "fp8-hostile",
    "info",
    "speed",
    requires=("numerics_ranges",),
    thresholds={"max_lost_share": 0.001, "max_layers": 12},
    refs=(FP8_PRIMER,),
)
def check_fp8_hostile(ctx: RuleContext) -> Iterator[Finding]:
    """Matmul layers whose value range is too wide for fp8 even with per-tensor scaling.

    Same measure as AMP-P01: a layer is hostile when more than ``max_lost_share`` of its
    nonzero activations (e4m3) or output gradients (e5m2) would flush to zero or saturate with
    the amax-based per-tensor scale (with that scale nothing saturates, so what is lost is the
    small values: the range below ``amax`` is wider than the format's). The title names the
    worst layer and its measured range in powers of two. A layer's activations or output
    gradients that held inf/NaN are not judged; the title and ``not_judged`` name them with the
    sampled steps at which they held them.
    """
    th = ctx.thresholds

    def make(table: pd.DataFrame, source: str) -> tuple[str, dict[str, Any], str] | None:
        found = []
        for r in table.itertuples():
            for kind, fmt in FP8_FORMAT_BY_KIND.items():
                lost = getattr(r, f"{kind}_lost")
                if lost is not None and not pd.isna(lost) and lost > th["max_lost_share"]:
                    found.append(
                        {
                            "module": r.module,
                            "module_type": r.module_type,
                            "tensor": KINDS[kind],
                            "format": FORMATS[fmt].label,
                            "range": getattr(r, f"{kind}_range"),
                            "lost_share": round(float(lost), 6),
                            "flush_share": round(float(getattr(r, f"{kind}_flush")), 6),
                            "flops_share": None
                            if pd.isna(r.flops_share)
                            else round(float(r.flops_share), 4),
                        }
                    )
        if not found:
            return None
        not_judged = _not_judged(table, per_kind=True)
        found.sort(key=lambda x: -x["lost_share"])
        worst = found[0]
        what = (
            "flush to zero" if worst["flush_share"] >= worst["lost_share"] else "flush or saturate"
        )
        layers = sorted({x["module"] for x in found})
        more = f" ({len(layers)} layers in all)" if len(layers) > 1 else ""
        return (
            (
                f"{worst['module']} {worst['tensor']}s span {worst['range']}: "
                f"{_pct(worst['lost_share'])} would {what} in {worst['format']} even with "
                f"per-tensor scaling{more}" + "".join(f"; {text}" for text in not_judged)
            ),
            {
                "layers": found[: int(th["max_layers"])],
                "layers_affected": len(layers),
                "not_judged": not_judged,
                "max_lost_share": th["max_lost_share"],
                "flops_source": source,
                "scaling": "per-tensor power of two from each step's amax",
                "measured": _MEASURED,
            },
            (
                "Keep these layers in bf16 when moving to fp8. A range this wide usually means "
                "outliers: look for un-normalized activations (a missing norm before the layer, "
                "outlier channels) or per-channel/block scaling instead of per-tensor."
            ),
        )

    for rank in _ranks(ctx.run):
        finding = _per_class(ctx, rank, make)
        if finding is not None:
            yield finding


def _is_bf16_run(run: Run) -> bool:
    dtypes = autocast_dtypes(run)
    if "float16" in dtypes:
        return False
    if "bfloat16" in dtypes:
        return True
    numerics = run.table("numerics")
    outs = set(numerics.loc[numerics["kind"] == "output", "dtype"].dropna().unique())
    return "bfloat16" in outs and "float16" not in outs


@rule(
    "AMP-P03",
    "fp16-range",
    "warning",
    "nan",
    requires=("numerics_ranges",),
    thresholds={"max_overflow_share": 0.0, "max_underflow_share": 0.001, "max_layers": 10},
    refs=(AMP_DOCS, GRADIENT_SCALING),
)
def check_fp16_range(ctx: RuleContext) -> Iterator[Finding]:
    """A bf16 run whose recorded values would not fit fp16.

    Only for bf16 runs (bf16 autocast, or bf16 layer outputs without fp16). Two checks, per rank
    over the sampled steps:

    * activations: nonzero values at or above 65520, 65504 plus half its step (they overflow
      when cast as-is; values in between round down to 65504; activations are not loss-scaled),
      share over all activations > ``max_overflow_share``;
    * gradients: fp16 training multiplies every gradient by one loss scale. At the best one per
      step (the largest power of two keeping the step's largest gradient under 65504, see
      :func:`amprobe.analysis.whatif.compute_fp16_gradient_fit`) the share of nonzero gradients
      that would still flush to zero > ``max_underflow_share``: no loss scale keeps both ends.

    A layer's tensor kind that held inf/NaN at a sampled step is not judged: left out of both
    checks and named, with those steps, in the title and ``not_judged``.
    """
    run = ctx.run
    if not _is_bf16_run(run):
        return
    th = ctx.thresholds
    whatif = compute_whatif(run)
    numerics = run.table("numerics")
    for rank, frame in per_rank(numerics):
        wf = whatif[(whatif["rank"] == rank) & (whatif["format"] == "fp16")]
        # layers and kinds that held inf/NaN are not judged: left out of both checks
        held = wf[(wf["scaling"] == "none") & ~wf["judged"].astype(bool)]
        not_judged = [
            not_judged_text(f"{m} {KINDS.get(str(k), str(k))}s", steps)
            for m, k, steps in zip(
                held["module"], held["kind"], held["nonfinite_steps"], strict=True
            )
        ]
        skip = set(zip(held["module"], held["kind"], strict=True))
        if skip:
            keys = pd.Series(
                list(zip(frame["module"], frame["kind"], strict=True)), index=frame.index
            )
            frame = frame[~keys.isin(skip)]
        wf = wf[wf["judged"].astype(bool)]
        acts = wf[(wf["kind"] == "output") & (wf["scaling"] == "none")]
        act_total = int(acts["nonzero"].sum())
        act_over = int(acts["overflow"].sum())
        over_share = act_over / act_total if act_total else 0.0
        hot = acts[acts["overflow"] > 0].sort_values("overflow_share", ascending=False)
        fit = compute_fp16_gradient_fit(frame)
        grad_share = 0.0
        per_layer: list[dict[str, Any]] = []
        scale_exp = None
        grad_range = None
        if len(fit):
            by_step = fit.groupby("step")[["flush", "nonzero"]].sum()
            shares = by_step["flush"] / by_step["nonzero"].where(by_step["nonzero"] > 0)
            grad_share = float(by_step["flush"].sum() / max(int(by_step["nonzero"].sum()), 1))
            worst_step = int(shares.fillna(0).idxmax())
            scale_exp = int(fit.loc[fit["step"] == worst_step, "loss_scale_exp"].iloc[0])
            nz = fit[fit["nonzero"] > 0]
            if len(nz):
                grad_range = exp_range(nz["low_exp"].min(), nz["top_exp"].max())
            layers = fit.groupby(["module", "kind"], sort=False)[["flush", "nonzero"]].sum()
            layers = layers[layers["flush"] > 0]
            layers["share"] = layers["flush"] / layers["nonzero"]
            for (module, kind), r in layers.sort_values("share", ascending=False).iterrows():
                per_layer.append(
                    {
                        "module": module,
                        "tensor": KINDS.get(str(kind), str(kind)),
                        "flush_share": round(float(r["share"]), 6),
                    }
                )
        overflow = act_over > 0 and over_share > th["max_overflow_share"]
        underflow = grad_share > th["max_underflow_share"]
        if not (overflow or underflow):
            continue
        parts = []
        if overflow:
            top = hot.iloc[0]
            parts.append(
                f"{top['module']} activations reach 2^{int(top['max_exp'])} (amax "
                f"{float(top['amax']):.3g} > 65504): {_pct(over_share)} of the activations "
                f"would overflow fp16"
            )
        if underflow:
            parts.append(
                f"gradients span {grad_range}: at the largest loss scale that keeps them under "
                f"65504 (2^{scale_exp}) {_pct(grad_share)} would still flush to zero in fp16"
            )
        yield ctx.finding(
            title="this bf16 run would not fit fp16: " + "; ".join(parts + not_judged),
            evidence={
                "rank": rank,
                "not_judged": not_judged,
                "activation_overflow_share": round(over_share, 6),
                "overflowing_layers": [
                    {
                        "module": r.module,
                        "range": exp_range(r.min_exp, r.max_exp),
                        "amax": None if r.amax is None or math.isnan(r.amax) else float(r.amax),
                        "overflow_share": round(float(r.overflow_share), 6),
                    }
                    for r in hot.head(int(th["max_layers"])).itertuples()
                ],
                "gradient_range": grad_range,
                "gradient_flush_share_at_best_scale": round(grad_share, 6),
                "best_loss_scale": None if scale_exp is None else 2.0**scale_exp,
                "underflowing_layers": per_layer[: int(th["max_layers"])],
                "max_overflow_share": th["max_overflow_share"],
                "max_underflow_share": th["max_underflow_share"],
            },
            fix=(
                "Do not move this run to fp16 without fixing these layers (normalize or keep "
                "them in fp32); bf16, with fp32's exponent range, is the right choice here."
            ),
        )
