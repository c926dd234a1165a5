"""Rules on per-layer numerics: non-finite inputs, forward overflow, gradient underflow.

Data comes from the ``numerics`` collector: the ``numerics`` and ``offenders`` tables and the
``input_nonfinite`` / ``loss_nonfinite`` step fields; the analysis is in
:mod:`amprobe.analysis.numerics`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd

from amprobe.analysis.frames import MAX_LISTED_STEPS, section_keys
from amprobe.analysis.numerics import (
    ROLE_LABELS,
    fact_steps,
    first_nonfinite_weights,
    first_overflow_since,
    gradient_underflow_classes,
    has_numerics,
    last_linear_half,
    last_linears,
    loss_nonfinite_before,
    module_role,
    nonfinite_input_runs,
    nonfinite_input_steps,
    numerics_section,
    offenders_section,
    root_missing_reason,
)
from amprobe.analysis.origin import place_text, received_episode, what_words
from amprobe.analysis.scaler import calibration_steps
from amprobe.rules.data import (
    HALF_DTYPES,
    autocast_dtypes,
    scaler_steps,
    step_ranges,
    steps_list,
)
from amprobe.rules.engine import Finding, RuleContext, name_ranks, requirement, rule
from amprobe.rules.refs import AUTOCAST_OPS, GRADIENT_SCALING
from amprobe.store.loader import Run
from amprobe.store.sections.numerics import step_facts

__all__: list[str] = []


#: half dtype -> (name, smallest magnitude its round-to-nearest cast makes inf)
_CAST_RANGE = {
    "float16": ("fp16", 65520.0),
    "bfloat16": ("bf16", float.fromhex("0x1.ffp127")),
}


def _run_steps(runs: dict[str, Any]) -> set[int]:
    """The steps of a summary section's step runs (the kept runs)."""
    return {s for a, b in runs["runs"] for s in range(int(a), int(b) + 1)}


def _cast_dtype(half: list[str], offender_dtype: Any) -> str | None:
    """The half dtype the offender's values were cast to: its own output dtype when that is
    half; when it is not recorded, the run's one autocast half dtype (``half``: the run's
    autocast dtypes that are half); else None (an offender with a wider output produced its
    non-finite values itself)."""
    if offender_dtype in _CAST_RANGE:
        return str(offender_dtype)
    if isinstance(offender_dtype, str) and offender_dtype:
        return None
    return half[0] if len(half) == 1 else None


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _out_of_range_origin(
    rows: pd.DataFrame, offender: str, cast_dtype: str | None
) -> pd.Series | None:
    """The first module, before ``offender`` in execution order, whose finite output a cast
    to ``cast_dtype`` makes inf (fp16: ``over_fp16``, values >= 65520; bf16: an ``amax`` at or
    above bf16's bound 0x1.ffp127).

    ``rows`` are one rank's numerics rows of one step; None when no such module ran, or when
    the cast dtype is unknown or not half: then the offender produced its non-finite values
    itself.
    """
    if cast_dtype not in _CAST_RANGE:
        return None
    outputs = np.flatnonzero(rows["kind"].to_numpy() == "output")
    order = pd.to_numeric(rows["order"], errors="coerce").to_numpy(dtype=float)[outputs]
    at = order[rows["module"].to_numpy()[outputs] == offender]
    if not len(at) or np.isnan(at).all():
        return None
    if cast_dtype == "float16":
        beyond = rows["over_fp16"].to_numpy()[outputs] > 0
    else:
        amax = pd.to_numeric(rows["amax"], errors="coerce").to_numpy(dtype=float)[outputs]
        beyond = amax >= _CAST_RANGE[cast_dtype][1]
    earlier = np.flatnonzero((order < np.nanmin(at)) & beyond)
    if not len(earlier):
        return None
    # the first in execution order (the first of equal positions)
    return rows.iloc[int(outputs[earlier[np.argmin(order[earlier])]])]


#: a forward offender's detail: (the offender row, its steps and modules, its step's facts)
_Offender = tuple[dict[str, Any], dict[str, Any], dict[str, Any]]


def _offender_from_summaries(run: Run, rank: int) -> _Offender | None:
    """AMP-N05's detail of ``rank`` from its summary sections, or None where they cannot give
    what the rank's files give (see :func:`check_forward_overflow`)."""
    forward = offenders_section(run, rank)["kinds"]["forward"]
    runs = [[int(a), int(b)] for a, b in forward["runs"]["runs"]]
    first = forward["first"]
    if (
        forward["runs"]["left_out"]
        or forward.get("modules_more")
        or first is None
        or first["module"] is None
        or any(m is None for m in forward["modules"])
        # in step order, one offender per step: the file's first is the section's first
        or sum(b - a + 1 for a, b in runs) != forward["count"]
        or any(runs[i][0] <= runs[i - 1][1] for i in range(1, len(runs)))
    ):
        return None
    excluded = nonfinite_input_steps(run, rank)
    if any(a <= s <= b for s in excluded for a, b in runs):
        return None
    step, module = int(first["step"]), str(first["module"])
    facts = step_facts(numerics_section(run, rank), step)
    if facts is None:
        return None
    entry = facts["out"].get(module)
    if entry is None and facts["trimmed"]:
        return None  # not kept: the module may have had a finite output there
    if entry is not None and entry[1] is None:
        return None  # a missing dtype: the file gives NaN or None
    at = entry[0] if entry is not None else None
    origins: dict[str, Any] = {}
    for dtype, key in (("float16", "fp16"), ("bfloat16", "bf16")):
        cand = facts[key]
        if at is None or cand is None or not cand["order"] < at:
            origins[dtype] = None
            continue
        if any(cand[c] is None for c in ("elements", "dtype", "module_type")) or (
            key == "fp16" and cand["over_fp16"] is None
        ):
            return None
        origins[dtype] = cand
    listed: list[int] = []
    for a, b in runs:
        listed += range(a, min(b, a + MAX_LISTED_STEPS) + 1)
        if len(listed) >= MAX_LISTED_STEPS:
            break
    steps = {
        "list": listed[:MAX_LISTED_STEPS],
        "ranges": runs[:MAX_LISTED_STEPS],
        "modules": sorted(set(forward["modules"])),
    }
    linear = facts["linear"]
    return (
        dict(first),
        steps,
        {
            "is_last": linear is not None and str(linear[2]) == module,
            "output_dtype": entry[1] if entry is not None else None,
            "origin": origins,
            "since": facts["prev"],
        },
    )


def _offender_from_files(
    ctx: RuleContext, rank: int, weights: dict[str, Any] | None
) -> _Offender | Finding | None:
    """AMP-N05's detail of ``rank`` from its own ``offenders`` and ``numerics`` files; the
    finding itself when the weights were non-finite before any offender; None when no
    forward offender is left once the steps with a non-finite input are set aside."""
    run = ctx.run
    offenders = run.rank_table("offenders", rank)
    part = offenders[offenders["kind"] == "forward"]
    excluded = nonfinite_input_steps(run, rank)
    part = part[~part["step"].isin(excluded)]
    if part.empty:
        return None
    if weights is not None:
        # from that step on a module's NaN output comes from its weights, not from an op
        # that overflowed: only offenders seen before it can be named
        before = part[part["step"] < weights["at_step"]]
        if before.empty:
            return _nonfinite_weights_finding(ctx, rank, weights, part.iloc[0])
        part = before
    first = part.iloc[0]
    step, module = int(first["step"]), str(first["module"])
    numerics = run.rank_table("numerics", rank)
    mine = numerics[numerics["rank"] == rank]
    rows = mine[mine["step"] == step]
    out = rows[(rows["module"] == module) & (rows["kind"] == "output")]
    earlier = mine["step"].to_numpy()
    earlier = earlier[earlier < step]
    return (
        {c: first[c] for c in ("step", "module", "module_type", "detail")},
        {
            "list": steps_list(part["step"]),
            "ranges": step_ranges(part["step"]),
            "modules": sorted(set(part["module"])),
        },
        {
            "is_last": (step, module) in last_linears(rows),
            "output_dtype": out["dtype"].iloc[0] if len(out) else None,
            "origin": {d: _out_of_range_origin(rows, module, d) for d in ("float16", "bfloat16")},
            "since": int(earlier.max()) if len(earlier) else None,
        },
    )


# -- requirements ------------------------------------------------------------------------------
@requirement("activations")
def _has_activations(run: Run) -> str | None:
    """Met when per-layer outputs were measured; a compiled job says why they were not."""
    layers = [x for r in run.ranks for x in numerics_section(run, r.rank)["layers"]]
    if any(x["kind"] == "output" for x in layers):
        return None
    skipped = [e for e in run.events_of("numerics_not_checked") if e.get("what") == "activations"]
    if skipped:
        return str(skipped[0].get("reason"))
    return None if not has_numerics(run) else "no per-layer output was measured"


@requirement("input_check")
def _has_input_check(run: Run) -> str | None:
    if any(offenders_section(run, r.rank)["inputs"]["checked"] for r in run.ranks):
        return None
    root = root_missing_reason(run)
    if root is not None:
        return f"model inputs were not checked: no root model was known ({root})"
    return "model inputs were not checked (the 'numerics' collector was off)"


# -- rules --------------------------------------------------------------------------------------
@rule("AMP-N04", "nonfinite-input", "error", "nan", requires=("input_check",))
def check_nonfinite_input(ctx: RuleContext) -> Iterator[Finding]:
    """A batch fed to the model already holds NaN/inf.

    The always-on check counts non-finite elements in the root models' floating inputs on
    every step. Input rows of the ``numerics`` table (sampled steps) name the argument.
    Read from the ``offenders`` summary section: the steps as runs (the first
    :data:`~amprobe.store.sections.numerics.MAX_RUNS`), their count, the first 20 counts.
    """
    run = ctx.run
    for rank in sorted(run.summaries()):
        inputs = offenders_section(run, rank)["inputs"]
        if not inputs["count"]:
            continue
        runs = nonfinite_input_runs(run, rank)
        steps = [s for a, b in runs for s in range(a, b + 1)]
        part = offenders_section(run, rank)["kinds"].get("input")
        yield ctx.finding(
            title=f"non-finite values in the model input at {inputs['count']} step(s), first at step {runs[0][0]}",
            evidence={
                "rank": rank,
                "nonfinite_steps": steps_list(steps),
                "nonfinite_step_ranges": step_ranges(steps),
                "affected_step_count": inputs["count"],
                "nonfinite_elements": list(inputs["first_counts"]),
                "inputs": sorted(set(part["modules"])) if part else [],
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
    requires=("numerics", "activations"),
    refs=(AUTOCAST_OPS,),
    # the replay measured which layer's fp32 pin makes the step finite (or another cause)
    explained_by=("AMP-N17",),
)
def check_forward_overflow(ctx: RuleContext) -> Iterator[Finding]:
    """A module's forward output holds inf/NaN while its inputs were finite.

    Uses the collector's forward offenders (first module in execution order, per sampled
    step, whose output was non-finite and whose floating inputs were finite). Steps whose
    model input was already non-finite are AMP-N04's and are left out. The range is judged
    against the half dtype the offender's values were cast to (its output dtype when half;
    the run's one autocast dtype when that is not recorded): when an earlier module of that step (execution order
    of outputs) produced finite values that this cast makes inf (fp16: ``over_fp16``, values
    >= 65520; bf16: ``amax`` >= 0x1.ffp127), the first such module is the origin and is named
    as the finding's ``module``; the offender, where the cast overflowed, is the
    ``overflow_module``. Otherwise (an fp32 offender, a bf16 run whose values fit bf16) the
    offender produced the non-finite values itself and is the one named. The module's role (normalization, softmax, loss, embedding, output
    projection = last Linear executed) is named. ``step`` is the sampled step whose capture
    names the module; the first step that overflowed since the previous sampled step
    (:func:`~amprobe.analysis.numerics.first_overflow_step`, usually the step before: an
    overflow arms the capture) is ``first_overflow_step``, and the title gives both.

    Read from the ``offenders`` summary section (the first forward offender, its steps as
    runs, the modules) and the ``numerics`` one (the facts of the offender's step: each
    output's execution order and dtype, the last Linear, the first output beyond fp16's and
    bf16's range, the previous sampled step; :func:`~amprobe.store.sections.numerics.step_facts`).
    A rank's own ``offenders`` and ``numerics`` files (:meth:`Run.rank_table`) are read only
    where the summaries cannot give the same evidence: a forward offender on a step whose model
    input was non-finite or once the weights were, offender rows out of step order or at a
    repeated step, capped lists, or an offender step whose facts were not kept (the first
    :data:`~amprobe.store.sections.numerics.MAX_FACT_STEPS` steps with a non-finite output
    between a chunk's first and last step, and those two).

    In a job of several ranks, a rank that received non-finite values through the gradient
    all-reduce from another rank (:func:`~amprobe.analysis.origin.received_episode`, the
    ranks AMP-D04 lists as ``received``) has no layer of its own to blame: its finding says
    so, names the rank that produced them, and keeps the layer only as where they showed.
    """
    for f in _forward_overflow(ctx):
        yield _as_received(ctx, f)


def _as_received(ctx: RuleContext, f: Finding) -> Finding:
    """AMP-N05's finding on a rank that received its non-finite values through the
    all-reduce: reworded so that it does not name a layer of its own as the origin."""
    rank, step = f.evidence.get("rank"), f.evidence.get("step")
    if len(ctx.run.ranks) < 2 or not isinstance(rank, int) or not isinstance(step, int):
        return f
    episode = received_episode(ctx.run, rank, step)
    if episode is None:
        return f
    origins = episode["origins"]
    module = f.evidence.get("module")
    where = f" (first seen in {module})" if module else ""
    if len(origins) == 1:
        o = origins[0]
        who = (
            f"{place_text(o)} produced them at step {episode['step']} ({what_words(o['what'])}"
            + (f", `{o['layer']}`" if o.get("layer") else "")
            + ")"
        )
    else:
        who = f"ranks {name_ranks(o['rank'] for o in origins)} produced them at step {episode['step']}"
    title = (
        f"non-finite values at step {step}{where} received through the all-reduce, not "
        f"produced by a layer of this rank: {who} (AMP-D04)"
    )
    named = [int(o["rank"]) for o in origins]
    evidence = {**f.evidence, "received_from": {"ranks": named, "step": int(episode["step"])}}
    fix = (
        f"Not this rank's layer: the value came from rank(s) {name_ranks(named)} through the "
        f"gradient reduction. Look at them at step {episode['step']} (AMP-D04)."
    )
    return dataclasses.replace(f, title=title, evidence=evidence, fix=fix)


def _forward_overflow(ctx: RuleContext) -> Iterator[Finding]:
    """AMP-N05's findings, one per rank, as each rank's own records give them."""
    run = ctx.run
    half = [d for d in autocast_dtypes(run) if d in _CAST_RANGE]
    for rank in sorted(run.summaries()):
        if not (offenders_section(run, rank)["kinds"].get("forward") or {}).get("count"):
            continue
        weights = first_nonfinite_weights(run, rank)
        found = _offender_from_summaries(run, rank) if weights is None else None
        if found is None:
            from_files = _offender_from_files(ctx, rank, weights)
            if from_files is None:
                continue
            if isinstance(from_files, Finding):
                yield from_files
                continue
            found = from_files
        first, steps, facts = found
        step, module = int(first["step"]), str(first["module"])
        role = module_role(first["module_type"], facts["is_last"])
        detail = json.loads(first["detail"]) if isinstance(first["detail"], str) else {}
        what = f" ({ROLE_LABELS[role]})" if role else ""
        evidence: dict[str, Any] = {
            "rank": rank,
            "module": module,
            "module_type": first["module_type"],
            "role": role,
            "step": step,
            "offender_steps": steps["list"],
            "offender_step_ranges": steps["ranges"],
            "offending_modules": steps["modules"],
            "nan_count": detail.get("nan"),
            "inf_count": detail.get("inf"),
            "element_count": detail.get("elements"),
            "output_dtype": facts["output_dtype"],
        }
        first_overflow = first_overflow_since(run, rank, step, facts["since"])
        evidence["first_overflow_step"] = first_overflow
        if first_overflow is None or first_overflow == step:
            when = f", at step {step}"
        else:
            when = (
                f"; first overflow at step {first_overflow}, layer named from the capture of "
                f"step {step}"
            )
        cast_dtype = _cast_dtype(half, evidence["output_dtype"])
        origin = facts["origin"].get(cast_dtype) if cast_dtype in _CAST_RANGE else None
        own = bool(detail.get("own_code"))
        evidence["own_code"] = own
        if origin is None:
            where = (
                " (its own code between its child modules, not a child, produced it)" if own else ""
            )
            yield ctx.finding(
                title=(
                    f"{module} ({first['module_type']}){what} is the first module whose output "
                    f"is non-finite{where}{when}"
                ),
                evidence=evidence,
                fix=(
                    f"Run {module} in fp32: wrap it in torch.autocast(device_type, enabled=False) "
                    "and call .float() on its inputs. "
                    + (
                        "The tensor ops written in its forward() itself are the suspects: "
                        "attention scores before softmax (use "
                        "torch.nn.functional.scaled_dot_product_attention), exp/pow, sums of "
                        "squares. "
                        if own
                        else ""
                    )
                    + "Un-normalized logits, custom normalizations and cosine-similarity losses "
                    "are the classic cases."
                ),
            )
            continue
        name, module_type = str(origin["module"]), str(origin["module_type"])
        fmt = _CAST_RANGE[str(cast_dtype)][0]
        fp16 = cast_dtype == "float16"
        evidence.update(
            module=name,
            module_type=module_type,
            overflow_module=module,
            overflow_module_type=first["module_type"],
            overflow_role=role,
            role=None,
            origin_amax=None if _missing(origin["amax"]) else float(origin["amax"]),
            origin_over_fp16_count=int(origin["over_fp16"]) if fp16 else None,
            origin_element_count=int(origin["elements"]),
            origin_dtype=str(origin["dtype"]),
            cast_dtype=cast_dtype,
        )
        amax = evidence["origin_amax"]
        count = (
            f"{evidence['origin_over_fp16_count']} of {evidence['origin_element_count']}"
            if fp16
            else None
        )
        details = ", ".join(
            x for x in (count, f"max {amax:.3g}" if amax is not None else None) if x
        )
        yield ctx.finding(
            title=(
                f"{name} ({module_type}) outputs values beyond {fmt}'s range"
                + (f" ({details})" if details else "")
                + f" that overflow to inf in {module} ({first['module_type']}){what}{when}"
            ),
            evidence=evidence,
            fix=(
                f"Keep {name}'s output within {fmt}'s range"
                + (" (+-65504)" if fp16 else "")
                + ": normalize or scale it down "
                f"where it is produced, or run {module} in fp32 as well (torch.autocast("
                "device_type, enabled=False) around it and .float() on its inputs)."
            ),
        )


def _nonfinite_weights_finding(
    ctx: RuleContext, rank: int, weights: dict[str, Any], first: pd.Series
) -> Finding:
    """AMP-N05 when the weights were already non-finite: name the update, not a layer."""
    at = int(weights["at_step"])
    applied = loss_nonfinite_before(ctx.run, rank, at)
    scaled_steps = scaler_steps(ctx.run)
    scaled = not scaled_steps.empty and bool(
        ((scaled_steps["rank"] == rank) & (scaled_steps["step"] < at)).any()
    )
    params = [str(p) for p in weights.get("params") or []]
    count = int(weights.get("count") or len(params))
    update = f"the update of step {applied}" if applied is not None else "an earlier update"
    module, module_type = str(first["module"]), str(first["module_type"])
    fix = (
        "With fp16 use torch.amp.GradScaler: it skips a step whose gradients hold inf/NaN "
        "instead of applying them. "
        if not scaled
        else ""
    )
    fix += (
        "If the loss diverges in fp32 too, this is not AMP: lower the learning rate or clip "
        "gradients (after scaler.unscale_). To name the layer that overflowed first, sample "
        "every step (--set numerics_every=1)."
    )
    return ctx.finding(
        title=(
            f"the weights hold inf/NaN from step {at} ({count} parameter(s), first "
            f"{params[0] if params else '?'}): {update} applied non-finite values, so "
            f"{module} ({module_type}) outputs NaN from finite inputs; no layer was seen "
            "overflowing before"
        ),
        evidence={
            "rank": rank,
            "module": module,
            "module_type": module_type,
            "step": at,
            "cause": "nonfinite_weights",
            "nonfinite_param_count": count,
            "nonfinite_params": params,
            "applied_update_step": applied,
            "scaler_enabled": scaled,
        },
        fix=fix,
    )


@rule(
    "AMP-N06",
    "grad-underflow",
    "warning",
    "nan",
    requires=("amp_as_written", "numerics", "autocast"),
    thresholds={"max_lost_share": 0.01, "scale_margin": 8.0, "max_layers": 10},
    refs=(GRADIENT_SCALING,),
    # gradients underflow when no scaler scales them, or when the scale collapsed
    explained_by=("AMP-N12", "AMP-N03"),
)
def check_grad_underflow(ctx: RuleContext) -> Iterator[Finding]:
    """In fp16, a layer's gradients lose more than ``max_lost_share`` of nonzero values.

    Per (module, gradient kind) over sampled steps, see
    :func:`~amprobe.analysis.numerics.compute_underflow`. Gradients
    held wider than fp16 are judged as the checklist defines the loss: nonzero values that a
    real fp16 cast at the recorded loss scale flushes to zero (scaled magnitude at most
    2**-25, half fp16's smallest subnormal; values in ``(2**-25, 2**-24)`` round up to
    2**-24 and survive). Gradients held in
    fp16 have lost theirs already (flushed to zero, indistinguishable from true zeros), so
    there the share of surviving values in the subnormal range stands in for it: a layer
    with more than ``max_lost_share`` of its values there reaches the flush boundary. The
    title says which of the two it measured for the worst layer, at the recorded loss scale
    and, by the same measure, at the hint of
    :func:`~amprobe.analysis.numerics.compute_scale_hint`.

    Read from each rank's ``numerics`` summary section
    (:func:`~amprobe.analysis.numerics.gradient_underflow_layers`): the same counts as the
    rows give, the listed sampled steps included (the section keeps the first 20 runs).
    """
    run = ctx.run
    if "float16" not in autocast_dtypes(run):
        return
    th = ctx.thresholds
    # computed once per class of ranks whose sections are equal (the key is the section's data:
    # equal bytes load back to equal values, and data-parallel ranks mostly record the same)
    # (every class's histograms summed at once, from one decode per run)
    by_class = gradient_underflow_classes(run, th["scale_margin"])
    keys = section_keys(run, "numerics")
    for rank in sorted(run.summaries()):
        done = by_class[keys[rank]]  # the recorded section's class (an absent one apart from
        if isinstance(done, Exception):  # an empty one)
            raise done
        rows, hint, facts = done
        hint = dict(hint) if hint is not None else None  # each finding holds its own
        # (key, share, share at the hint) of the layers over the threshold, worst first (a
        # stable sort: ties keep the order of first appearance); a layer with nothing nonzero
        # has no share
        bad = sorted(
            (
                (key, lost / nonzero, at_hint / nonzero)
                for key, lost, at_hint, nonzero in rows
                if nonzero > 0 and lost / nonzero > th["max_lost_share"]
            ),
            key=lambda x: -x[1],
        )
        if not bad:
            continue
        listed = []
        for (m, k, meas), share, at_hint in bad[: int(th["max_layers"])]:
            fact = fact_steps(facts[(m, k, meas)])
            listed.append(
                {
                    "module": m,
                    "kind": k,
                    "measure": meas,
                    "dtype": fact["dtype"],
                    "share": round(float(share), 4),
                    "share_at_hint": round(float(at_hint), 4) if hint else None,
                    "loss_scales": [float(x) for x in sorted(fact["scales"])],
                    "sampled_steps": steps_list(sorted(fact["steps"])),
                    "sampled_step_ranges": step_ranges(fact["steps"]),
                }
            )
        worst = listed[0]
        scales = worst["loss_scales"]
        at = (
            f"loss scale {scales[0]:g}"
            if len(scales) == 1
            else f"loss scales {scales[0]:g} to {scales[-1]:g}"
        )
        if worst["measure"] == "subnormal":
            what = (
                f"{worst['share']:.1%} of its nonzero values are fp16 subnormals at {at} "
                "(values already flushed to zero cannot be counted)"
            )
        else:
            what = f"{worst['share']:.1%} of its nonzero values flush to zero in fp16 at {at}"
        scale_text = ""
        if hint is not None:
            scale_text = (
                f"; {worst['share_at_hint']:.1%} at {hint['hint_scale']:g}, the largest scale "
                f"keeping amax under 65504/{th['scale_margin']:g}"
            )
        yield ctx.finding(
            title=(
                f"gradients underflow in fp16 in {len(bad)} layer(s); worst {worst['module']} "
                f"({worst['kind']}, {worst['dtype']}): {what}{scale_text}"
            ),
            evidence={
                "rank": rank,
                "layers": listed,
                "affected_layer_count": len(bad),
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
    refs=(AUTOCAST_OPS,),
    # the instability it points at is explained once an overflowing layer or bad batch is named
    explained_by=("AMP-N05", "AMP-N04"),
)
def check_sensitive_layers_half(ctx: RuleContext) -> Iterator[Finding]:
    """Embedding / output-projection / normalization layers run in half and the run is unstable.

    Half = the module's forward output dtype is fp16/bf16. Unstable = at least
    ``min_scale_cuts`` loss-scale cuts (or skipped steps) after the initial calibration
    (:func:`~amprobe.analysis.scaler.compute_calibration`), or a non-finite loss or non-finite values
    in a recorded layer on a step the GradScaler did not skip. An overflow the scaler absorbed
    now and then is dynamic loss scaling working, not instability.

    Read from the ``numerics`` and ``offenders`` summary sections (the skipped steps and a
    layer's non-finite steps as runs, exact up to
    :data:`~amprobe.store.sections.numerics.MAX_RUNS` runs each).
    """
    run = ctx.run
    min_cuts = ctx.thresholds["min_scale_cuts"]
    for rank in sorted(run.summaries()):
        section = numerics_section(run, rank)
        if not section["rows"]:
            continue
        scaling = offenders_section(run, rank).get("scaling")
        signals: dict[str, Any] = {}
        absorbed: set[int] = set()  # steps whose update the scaler skipped
        if scaling is not None:
            calibration = set(calibration_steps(run, rank))
            cut_steps = _run_steps(scaling["cuts"])
            cuts = scaling["cut_count"] - len(cut_steps & calibration)
            if cuts >= min_cuts:
                signals["scale_cut_count"] = cuts
            absorbed = _run_steps(scaling["skipped"])
            if scaling["skipped_count"] - len(absorbed & calibration) >= min_cuts:
                signals["skipped_count"] = scaling["skipped_count"]
            if scaling["loss_nonfinite_kept"]:
                signals["nonfinite_loss_count"] = scaling["loss_nonfinite_kept"]
        nonfinite = [
            str(layer["module"])
            for layer in section["layers"]
            if _run_steps(layer["nonfinite_runs"]) - absorbed
        ]
        if nonfinite:
            signals["nonfinite_layers"] = sorted(set(nonfinite))[:10]
        if not signals:
            continue
        last = last_linear_half(section["last_linear"])
        # the half-precision forward outputs per (module, type), in order of first appearance
        layers = []
        for layer in section["layers"]:
            half = [d for d in layer["dtypes"] if d in HALF_DTYPES]
            name, mtype = layer["module"], layer["module_type"]
            if layer["kind"] != "output" or not half or name is None or mtype is None:
                continue
            role = module_role(mtype, str(name) in last)
            if role in ("embedding", "output projection", "normalization"):
                layers.append(
                    {"module": name, "module_type": mtype, "role": role, "dtype": str(half[0])}
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
