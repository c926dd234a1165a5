"""Rules on per-layer numerics: non-finite inputs, forward overflow, gradient underflow.

Data comes from the ``numerics`` collector: the ``numerics`` and ``offenders`` tables and the
``input_nonfinite`` / ``loss_nonfinite`` step fields. Analysis helpers are pure functions of
frames (``compute_*``) so the report can reuse them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd

from amprobe.rules.data import HALF_DTYPES, autocast_dtypes, per_rank, steps_list
from amprobe.rules.engine import Finding, RuleContext, requirement, rule
from amprobe.store.loader import Run

__all__ = [
    "FP16_MAX",
    "module_role",
    "compute_layer_summary",
    "compute_scale_hint",
    "compute_underflow",
    "offender_evidence",
    "layer_overflow_evidence",
    "nonfinite_input_steps",
]

FP16_MAX = 65504.0
GRAD_KINDS = ("grad_output", "grad_param")
ROLE_LABELS = {
    "normalization": "a normalization layer",
    "softmax": "a softmax / attention",
    "loss": "a loss",
    "embedding": "an embedding",
    "output projection": "the output projection",
}


# -- pure helpers ---------------------------------------------------------------------------------
def module_role(module_type: str | None, is_last_linear: bool = False) -> str | None:
    """Classify a module: normalization, softmax, loss, embedding, output projection or None."""
    t = module_type or ""
    if "Norm" in t:
        return "normalization"
    if t in ("Softmax", "LogSoftmax", "Softmin", "Softmax2d", "MultiheadAttention"):
        return "softmax"
    if t.endswith("Loss") or t == "loss":
        return "loss"
    if t.startswith("Embedding"):
        return "embedding"
    if is_last_linear and t in ("Linear", "NonDynamicallyQuantizableLinear", "LazyLinear"):
        return "output projection"
    return None


def last_linears(frame: pd.DataFrame) -> set[tuple[int, str]]:
    """(step, module) of the last Linear executed in each step's forward pass."""
    out = frame[(frame["kind"] == "output") & frame["module_type"].str.contains("Linear", na=False)]
    if out.empty:
        return set()
    last = out.sort_values("order").groupby("step").tail(1)
    return {(int(s), str(m)) for s, m in zip(last["step"], last["module"], strict=True)}


def _hist(text: Any) -> dict[int, int]:
    if not isinstance(text, str) or not text:
        return {}
    return {int(k): int(v) for k, v in json.loads(text).items()}


def _nonzero(frame: pd.DataFrame) -> pd.Series:
    return frame["elements"] - frame["zeros"] - frame["nan"] - frame["inf"]


def compute_underflow(frame: pd.DataFrame) -> pd.DataFrame:
    """Per gradient row: the share of nonzero values that fp16 with the row's loss scale loses.

    For gradients held wider than fp16 (fp32/bf16) the loss is exact: nonzero values whose
    scaled magnitude stays below 2**-24 (``underflow_at_scale``). For gradients already held in
    fp16 the lost values are zeros by now and cannot be told from true zeros, so the measure is
    the share of surviving values in fp16's subnormal range (scaled magnitude < 2**-14), which
    is where precision is already lost and the neighbouring values were flushed.

    Returns:
        The gradient rows with ``nonzero``, ``lost_share`` and ``measure`` (``flushed`` or
        ``subnormal``) columns added.
    """
    grads = frame[frame["kind"].isin(GRAD_KINDS)].copy()
    if grads.empty:
        return grads.assign(nonzero=[], lost_share=[], measure=[])
    grads["nonzero"] = _nonzero(grads)
    lost: list[float] = []
    measure: list[str] = []
    for row in grads.itertuples():
        nz = int(row.nonzero)
        if row.dtype == "float16":
            scale = float(row.loss_scale) if row.loss_scale and row.loss_scale > 0 else 1.0
            limit = -14 - math.log2(scale)
            sub = sum(n for e, n in _hist(row.exp_hist).items() if -127 < e < limit)
            lost.append(sub / nz if nz else 0.0)
            measure.append("subnormal")
        else:
            lost.append(int(row.underflow_at_scale) / nz if nz else 0.0)
            measure.append("flushed")
    grads["lost_share"] = lost
    grads["measure"] = measure
    return grads


def compute_scale_hint(frame: pd.DataFrame, margin: float = 8.0) -> dict[str, Any] | None:
    """The largest power-of-two loss scale that keeps gradients under the fp16 max.

    Algorithm: ``amax`` is the largest unscaled gradient magnitude over every gradient row;
    the hint is ``2**floor(log2(65504 / margin / amax))``. Underflow shares come from the
    exponent histograms: nonzero gradients whose magnitude times the scale stays below
    2**-24, over all nonzero measured gradients, at the current scale (the last recorded one)
    and at the hint. Values already flushed to zero in fp16 tensors are not counted (they
    are indistinguishable from true zeros).

    Returns:
        ``None`` when no finite nonzero gradient was recorded.
    """
    grads = frame[frame["kind"].isin(GRAD_KINDS)]
    amax = grads["amax"].dropna()
    amax = amax[(amax > 0) & amax.map(math.isfinite)]
    if amax.empty:
        return None
    peak = float(amax.max())
    hint = 2.0 ** math.floor(math.log2(FP16_MAX / margin / peak))
    scales = grads["loss_scale"].dropna()
    current = (
        float(grads.sort_values("step")["loss_scale"].dropna().iloc[-1]) if len(scales) else 1.0
    )
    merged: dict[int, int] = {}
    for text in grads["exp_hist"]:
        for e, n in _hist(text).items():
            merged[e] = merged.get(e, 0) + n
    nonzero = sum(n for e, n in merged.items() if -127 < e < 128)

    def share(scale: float) -> float:
        limit = -24 - math.log2(scale)
        lost = sum(n for e, n in merged.items() if -127 < e < limit)
        return lost / nonzero if nonzero else 0.0

    return {
        "grad_amax": peak,
        "margin": margin,
        "hint_scale": hint,
        "current_scale": current,
        "underflow_share_at_current": round(share(current), 6),
        "underflow_share_at_hint": round(share(hint), 6),
    }


def compute_layer_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (module, kind): totals over sampled steps and shares."""
    if frame.empty:
        return pd.DataFrame()
    sums = [
        "elements",
        "zeros",
        "nan",
        "inf",
        "over_fp16",
        "below_normal",
        "below_subnormal",
        "underflow_at_scale",
    ]
    g = frame.groupby(["module", "kind"], sort=False)
    out = g[sums].sum()
    out["module_type"] = g["module_type"].first()
    out["dtype"] = g["dtype"].agg(lambda s: ",".join(sorted(set(s.dropna()))))
    out["amax"] = g["amax"].max()
    out["steps"] = g["step"].nunique()
    out["zero_share"] = out["zeros"] / out["elements"].where(out["elements"] > 0)
    out["nonfinite"] = out["nan"] + out["inf"]
    return out.reset_index()


def nonfinite_input_steps(run: Run, rank: int) -> set[int]:
    """Steps of ``rank`` whose root-model inputs held non-finite values."""
    steps = run.steps
    if steps.empty or "input_nonfinite" not in steps:
        return set()
    part = steps[(steps["rank"] == rank) & (steps["input_nonfinite"].fillna(0) > 0)]
    return {int(s) for s in part["step"]}


def offender_evidence(run: Run, rank: int) -> dict[str, Any]:
    """First forward / backward offenders of ``rank`` as evidence fields (empty if not recorded)."""
    offenders = run.table("offenders")
    if offenders.empty:
        return {}
    part = offenders[offenders["rank"] == rank].sort_values("step")
    out: dict[str, Any] = {}
    for kind in ("forward", "backward", "input"):
        rows = part[part["kind"] == kind]
        if len(rows):
            first = rows.iloc[0]
            out[f"first_{kind}_offender"] = {
                "module": first["module"],
                "module_type": first["module_type"],
                "step": int(first["step"]),
            }
    return out


def layer_overflow_evidence(run: Run, rank: int, limit: int = 5) -> dict[str, Any]:
    """Per-layer overflow evidence for ``rank``: layers with non-finite or >65504 values.

    Returns an empty dict when per-layer numerics were not recorded.
    """
    numerics = run.table("numerics")
    if numerics.empty:
        return {}
    frame = numerics[numerics["rank"] == rank]
    summary = compute_layer_summary(frame)
    if summary.empty:
        return {}
    hot = summary[(summary["nonfinite"] + summary["over_fp16"]) > 0]
    hot = hot.sort_values(["nonfinite", "over_fp16"], ascending=False).head(limit)
    return {
        "overflowing_layers": [
            {
                "module": r.module,
                "kind": r.kind,
                "dtype": r.dtype,
                "nonfinite": int(r.nonfinite),
                "over_fp16": int(r.over_fp16),
            }
            for r in hot.itertuples()
        ],
        **offender_evidence(run, rank),
    }


def _out_of_range_origin(rows: pd.DataFrame, offender: str) -> pd.Series | None:
    """The first module, before ``offender`` in execution order, whose output exceeded fp16's range.

    ``rows`` are one rank's numerics rows of one step; None when no such module ran.
    """
    outputs = rows[rows["kind"] == "output"]
    at = outputs.loc[outputs["module"] == offender, "order"]
    if at.empty:
        return None
    earlier = outputs[(outputs["order"] < at.min()) & (outputs["over_fp16"] > 0)]
    if earlier.empty:
        return None
    return earlier.sort_values("order", kind="stable").iloc[0]


# -- requirements ------------------------------------------------------------------------------
@requirement("numerics")
def _has_numerics(run: Run) -> str | None:
    if not run.table("numerics").empty:
        return None
    return "per-layer numerics were not recorded (add 'numerics' to Config.collectors)"


@requirement("input_check")
def _has_input_check(run: Run) -> str | None:
    steps = run.steps
    if len(steps) and "input_nonfinite" in steps and steps["input_nonfinite"].notna().any():
        return None
    return "model inputs were not checked (the 'numerics' collector with a model passed to attach)"


# -- rules --------------------------------------------------------------------------------------
@rule("AMP-N04", "nonfinite-input", "error", "nan", requires=("input_check",), refs=("G§5.1",))
def check_nonfinite_input(ctx: RuleContext) -> Iterator[Finding]:
    """A batch fed to the model already holds NaN/inf.

    The always-on check counts non-finite elements in the root models' floating inputs on
    every step. Input rows of the ``numerics`` table (sampled steps) name the argument.
    """
    run = ctx.run
    offenders = run.table("offenders")
    for rank, frame in per_rank(run.steps):
        bad = frame[frame["input_nonfinite"].fillna(0) > 0]
        if bad.empty:
            continue
        inputs: list[str] = []
        if not offenders.empty:
            part = offenders[(offenders["rank"] == rank) & (offenders["kind"] == "input")]
            inputs = sorted(set(part["module"]))
        yield ctx.finding(
            title=f"non-finite values in the model input at {len(bad)} step(s), first at step {int(bad['step'].iloc[0])}",
            evidence={
                "rank": rank,
                "steps": steps_list(bad["step"]),
                "steps_affected": len(bad),
                "nonfinite_elements": [int(v) for v in bad["input_nonfinite"].iloc[:20]],
                "inputs": inputs,
            },
            fix=(
                "This is a data problem, not AMP: the batch already holds NaN/inf and would break "
                "fp32 training too. Check the data pipeline at these steps (e.g. assert "
                "torch.isfinite(x).all() in the dataset) and drop or repair the samples."
            ),
        )


@rule(
    "AMP-N05",
    "forward-overflow",
    "error",
    "nan",
    requires=("numerics",),
    refs=("G§5.1",),
)
def check_forward_overflow(ctx: RuleContext) -> Iterator[Finding]:
    """A module's forward output holds inf/NaN while its inputs were finite.

    Uses the collector's forward offenders (first module in execution order, per sampled
    step, whose output was non-finite and whose floating inputs were finite). Steps whose
    model input was already non-finite are AMP-N04's and are left out. When an earlier module
    of that step (execution order of outputs) produced finite values beyond fp16's range
    (``over_fp16``, an fp32 output), the first such module is the origin and is named as the
    finding's ``module``; the offender, where the cast to half overflowed, is the
    ``overflow_module``. The module's role (normalization, softmax, loss, embedding, output
    projection = last Linear executed) is named.
    """
    run = ctx.run
    offenders = run.table("offenders")
    numerics = run.table("numerics")
    if offenders.empty:
        return
    for rank, part in per_rank(offenders[offenders["kind"] == "forward"]):
        excluded = nonfinite_input_steps(run, rank)
        part = part[~part["step"].isin(excluded)]
        if part.empty:
            continue
        first = part.iloc[0]
        step, module = int(first["step"]), str(first["module"])
        rows = numerics[(numerics["rank"] == rank) & (numerics["step"] == step)]
        is_last = (step, module) in last_linears(rows)
        role = module_role(first["module_type"], is_last)
        out = rows[(rows["module"] == module) & (rows["kind"] == "output")]
        detail = json.loads(first["detail"]) if isinstance(first["detail"], str) else {}
        what = f" ({ROLE_LABELS[role]})" if role else ""
        evidence: dict[str, Any] = {
            "rank": rank,
            "module": module,
            "module_type": first["module_type"],
            "role": role,
            "step": step,
            "steps": steps_list(part["step"]),
            "offending_modules": sorted(set(part["module"])),
            "nan": detail.get("nan"),
            "inf": detail.get("inf"),
            "elements": detail.get("elements"),
            "output_dtype": out["dtype"].iloc[0] if len(out) else None,
        }
        origin = _out_of_range_origin(rows, module)
        if origin is None:
            yield ctx.finding(
                title=f"{module} ({first['module_type']}){what} is the first module whose output is non-finite, at step {step}",
                evidence=evidence,
                fix=(
                    f"Run {module} in fp32: wrap it in torch.autocast(device_type, enabled=False) "
                    "and call .float() on its inputs. Un-normalized logits, custom normalizations "
                    "and cosine-similarity losses are the classic cases."
                ),
            )
            continue
        name, module_type = str(origin["module"]), str(origin["module_type"])
        evidence.update(
            module=name,
            module_type=module_type,
            overflow_module=module,
            overflow_module_type=first["module_type"],
            overflow_role=role,
            role=None,
            origin_amax=None if pd.isna(origin["amax"]) else float(origin["amax"]),
            origin_over_fp16=int(origin["over_fp16"]),
            origin_elements=int(origin["elements"]),
            origin_dtype=str(origin["dtype"]),
        )
        amax = evidence["origin_amax"]
        yield ctx.finding(
            title=(
                f"{name} ({module_type}) outputs values beyond fp16's range "
                f"({evidence['origin_over_fp16']} of {evidence['origin_elements']}"
                + (f", max {amax:.3g}" if amax is not None else "")
                + f") that overflow to inf in {module} ({first['module_type']}){what}, at step {step}"
            ),
            evidence=evidence,
            fix=(
                f"Keep {name}'s output within fp16's range (+-65504): normalize or scale it down "
                f"where it is produced, or run {module} in fp32 as well (torch.autocast("
                "device_type, enabled=False) around it and .float() on its inputs)."
            ),
        )


@rule(
    "AMP-N06",
    "grad-underflow",
    "warning",
    "nan",
    requires=("numerics", "autocast"),
    thresholds={"max_lost_share": 0.01, "scale_margin": 8.0, "max_layers": 10},
    refs=("S§7", "S§10"),
)
def check_grad_underflow(ctx: RuleContext) -> Iterator[Finding]:
    """In fp16, a layer's gradients lose more than ``max_lost_share`` of nonzero values.

    Per (module, gradient kind) over sampled steps, see :func:`compute_underflow`: gradients
    held in fp32 count nonzero values that the current loss scale leaves below 2**-24;
    gradients held in fp16 count surviving values in the subnormal range. Evidence includes
    the loss-scale hint of :func:`compute_scale_hint`.
    """
    run = ctx.run
    if "float16" not in autocast_dtypes(run):
        return
    th = ctx.thresholds
    numerics = run.table("numerics")
    for rank, frame in per_rank(numerics):
        grads = compute_underflow(frame)
        if grads.empty:
            continue
        grads = grads.assign(lost=grads["lost_share"] * grads["nonzero"])
        g = grads.groupby(["module", "kind", "measure"], sort=False)
        layers = g[["lost", "nonzero"]].sum()
        layers["share"] = layers["lost"] / layers["nonzero"].where(layers["nonzero"] > 0)
        layers["dtype"] = g["dtype"].first()
        layers["steps"] = g["step"].agg(lambda s: steps_list(sorted(set(s))))
        bad = layers[layers["share"] > th["max_lost_share"]].sort_values("share", ascending=False)
        if bad.empty:
            continue
        hint = compute_scale_hint(frame, th["scale_margin"])
        listed = [
            {
                "module": m,
                "kind": k,
                "measure": meas,
                "dtype": row["dtype"],
                "share": round(float(row["share"]), 4),
                "steps": row["steps"],
            }
            for (m, k, meas), row in bad.head(int(th["max_layers"])).iterrows()
        ]
        worst = listed[0]
        scale_text = ""
        if hint is not None:
            scale_text = (
                f"; loss scale {hint['current_scale']:g} lets {hint['underflow_share_at_current']:.1%} "
                f"underflow, {hint['hint_scale']:g} would keep amax under 65504/{th['scale_margin']:g}"
            )
        yield ctx.finding(
            title=(
                f"gradients underflow in fp16 in {len(bad)} layer(s); worst {worst['module']} "
                f"({worst['kind']}) loses {worst['share']:.1%}{scale_text}"
            ),
            evidence={
                "rank": rank,
                "layers": listed,
                "layers_affected": len(bad),
                "max_lost_share": th["max_lost_share"],
                "scale_hint": hint,
            },
            fix=(
                "Use dynamic loss scaling (torch.amp.GradScaler) or raise its init_scale"
                + (
                    f" (about {hint['hint_scale']:g} keeps the largest gradient in range)"
                    if hint
                    else ""
                )
                + "; or train in bf16, whose range does not underflow here."
            ),
        )


@rule(
    "AMP-N16",
    "sensitive-layers-half",
    "info",
    "nan",
    requires=("numerics",),
    thresholds={"min_scale_cuts": 2},
    refs=("G§2.3",),
)
def check_sensitive_layers_half(ctx: RuleContext) -> Iterator[Finding]:
    """Embedding / output-projection / normalization layers run in half and the run is unstable.

    Half = the module's forward output dtype is fp16/bf16. Unstable = at least
    ``min_scale_cuts`` loss-scale cuts (or skipped steps) after the initial calibration (the
    leading run of cuts down from ``init_scale``), or a non-finite loss or non-finite values
    in a recorded layer on a step the GradScaler did not skip. An overflow the scaler absorbed
    now and then is dynamic loss scaling working, not instability.
    """
    run = ctx.run
    numerics = run.table("numerics")
    steps = run.steps
    min_cuts = ctx.thresholds["min_scale_cuts"]
    for rank, frame in per_rank(numerics):
        srows = steps[steps["rank"] == rank] if len(steps) else steps
        signals: dict[str, Any] = {}
        absorbed: set[int] = set()  # steps whose update the scaler skipped
        if len(srows):
            cuts = (srows["scale_after"] < srows["scale_before"]).fillna(False).to_numpy(bool)
            calibration = int(np.argmin(cuts)) if not cuts.all() else len(cuts)
            if int(cuts.sum()) - calibration >= min_cuts:
                signals["scale_cuts"] = int(cuts.sum()) - calibration
            skipped = srows["skipped"].fillna(False).astype(bool)
            absorbed = {int(s) for s in srows.loc[skipped, "step"]}
            if int(skipped.sum()) - calibration >= min_cuts:
                signals["skipped_steps"] = int(skipped.sum())
            if "loss_nonfinite" in srows:
                bad = srows["loss_nonfinite"].fillna(False).astype(bool) & ~skipped
                if bad.any():
                    signals["nonfinite_loss_steps"] = int(bad.sum())
        nonfinite = frame[((frame["nan"] + frame["inf"]) > 0) & ~frame["step"].isin(absorbed)]
        if len(nonfinite):
            signals["nonfinite_layers"] = sorted(set(nonfinite["module"]))[:10]
        if not signals:
            continue
        last = last_linears(frame)
        outs = frame[(frame["kind"] == "output") & frame["dtype"].isin(HALF_DTYPES)]
        layers = []
        for (module, mtype), part in outs.groupby(["module", "module_type"], sort=False):
            is_last = any((int(s), str(module)) in last for s in part["step"])
            role = module_role(mtype, is_last)
            if role in ("embedding", "output projection", "normalization"):
                layers.append(
                    {
                        "module": module,
                        "module_type": mtype,
                        "role": role,
                        "dtype": str(part["dtype"].iloc[0]),
                    }
                )
        if not layers:
            continue
        yield ctx.finding(
            title=f"{len(layers)} precision-sensitive layer(s) run in half precision in an unstable run: "
            + ", ".join(f"{x['module']} ({x['role']})" for x in layers[:5]),
            evidence={"rank": rank, "layers": layers, "instability": signals},
            fix=(
                "Keep embedding, output projection and normalization layers in fp32 (run them "
                "outside autocast or with autocast(enabled=False) and .float() inputs): a small "
                "speed cost for a smoother loss."
            ),
        )
