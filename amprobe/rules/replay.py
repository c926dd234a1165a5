"""The measured cause of the first bad step: AMP-N17, from the ``replay`` events.

The capture side (:mod:`amprobe.capture.collectors.replay`) re-runs a bad step in the training
process, in variants, and records one ``replay`` event per bad step it considered (on every
rank): whether it replayed, the variants' results (``experiments``), the ``cause`` they
measured and, for a precision cause, the ``verified_fix`` (the layers whose fp32 pin made the
step finite). This rule only reads and words them; it never guesses a cause the replay did not
measure.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from amprobe.analysis.scaler import calibration_steps, rank_scaler, scaler_ranks
from amprobe.rules.engine import (
    Finding,
    RuleContext,
    name_ranks,
    rank_fields,
    requirement,
    rule,
)
from amprobe.rules.refs import AUTOCAST_OPS, GRADIENT_SCALING
from amprobe.store.loader import Run

__all__ = ["CAUSE_SEVERITY", "NOT_PRECISION_CAUSES", "replay_steps_of", "measured_causes"]

#: a measured cause -> the severity of its finding (loss-scale is benign: the scaler's job)
CAUSE_SEVERITY: Mapping[str, str] = {
    "precision": "error",
    "data-or-model": "error",
    "compiler": "error",
    "loss-computation": "error",
    "not-reproduced": "error",
    "loss-scale": "warning",
    "instrumentation": "warning",
}
#: causes for which a change of precision (bf16, fp32 pins) is no fix: other findings' advice
#: to change precision is left out at these steps (AMP-N11, AMP-N02)
NOT_PRECISION_CAUSES = frozenset({"data-or-model", "loss-computation", "instrumentation"})
#: replayed steps the finding lists (the first, then the others)
MAX_LISTED_REPLAYS = 4
#: notes of the capture side a finding keeps
MAX_NOTES = 6

_DTYPE_WORDS = {"float16": "fp16", "bfloat16": "bf16"}


def _config(run: Run) -> Mapping[str, Any]:
    return run.rank_manifest.get("config") or {}


def _bad_steps_outside_calibration(run: Run) -> int | None:
    """How many steps the scaler skipped outside its start-up calibration, on the rank with the
    most; None when no scaler step was recorded."""
    ranks = scaler_ranks(run)
    if not ranks:
        return None
    most = 0
    for rank in ranks:
        facts = rank_scaler(run, rank)
        calibration = set(calibration_steps(run, rank))
        skipped = sum(
            1
            for first, last in facts["skipped_runs"]
            for step in range(int(first), int(last) + 1)
            if step not in calibration
        )
        most = max(most, skipped)
    return most


@requirement("replay")
def _has_replay(run: Run) -> str | None:
    """Met when a bad step was replayed and its cause measured; else the true reason none was."""
    events = run.events_of("replay")
    if not events:
        config = _config(run)
        if "replay" not in config:
            return "the run was recorded by an amprobe that did not replay bad steps"
        if config.get("replay") == "off" or config.get("replay_max") == 0:
            return 'replay was off (replay="off" or replay_max=0): no bad step was replayed'
        if "replay" not in (config.get("collectors") or ["replay"]):
            return "the replay collector was not among the run's collectors"
        bad = _bad_steps_outside_calibration(run)
        if bad:
            return (
                f"{bad:,} step(s) were skipped for inf/NaN gradients outside the start-up "
                "calibration, but no replay was recorded (the replay collector did not see them; "
                "see the run's warnings)"
            )
        return (
            "no bad step to replay: no step was skipped for inf/NaN gradients outside the "
            "scaler's start-up calibration, and no non-finite loss was seen before its update"
        )
    measured = [e for e in events if e.get("replayed") and e.get("cause")]
    if measured:
        return None
    first = min(events, key=lambda e: (int(e.get("step") or 0), int(e.get("rank") or 0)))
    incomplete = [e for e in events if e.get("replayed") and e.get("incomplete")]
    if incomplete:
        # replayed, but no cause measured: no finding (it would claim to explain AMP-N02 and
        # AMP-N05), the variants it ran said here
        e = incomplete[0]
        ran = "; ".join(_variant_text(x) for x in e.get("experiments") or []) or "none"
        return (
            f"the bad step {e.get('step')} was replayed, but no cause was measured: "
            f"{e.get('incomplete')} (variants run: {ran})"
        )
    reason = first.get("reason") or "no reason recorded"
    return f"the bad step {first.get('step')} was not replayed: {reason}"


def _variant_text(x: Mapping[str, Any]) -> str:
    """One experiment in words: ``autocast off: finite`` / ``as it ran: non-finite in `booster```."""
    if x.get("error"):
        return f"{x.get('variant')}: failed ({x.get('error')})"
    if x.get("finite"):
        return f"{x.get('variant')}: finite"
    where = f" in `{x['first_nonfinite']}`" if x.get("first_nonfinite") else ""
    return f"{x.get('variant')}: non-finite{where}"


def _dtype_word(e: Mapping[str, Any]) -> str:
    return _DTYPE_WORDS.get(str(e.get("autocast_dtype")), "half-precision")


def _code(names: Sequence[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _experiment_rows(e: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The variants as the evidence's table rows (the record's keys, seconds as ``wall_s``)."""
    rows = []
    step_scale = e.get("scale")
    for x in e.get("experiments") or []:
        row: dict[str, Any] = {
            "variant": x.get("variant"),
            "finite": x.get("finite"),
            "forward_finite": x.get("forward_finite"),
            "grads_finite": x.get("grads_finite"),
            "first_nonfinite": x.get("first_nonfinite"),
            "max_abs": x.get("max_abs"),
            "wall_s": x.get("seconds"),
        }
        scale = x.get("scale")
        row["scale"] = float(scale) if scale is not None and scale != step_scale else None
        row["error"] = x.get("error")
        rows.append(row)
    return rows


def replay_steps_of(run: Run) -> dict[int, list[dict[str, Any]]]:
    """The ``replay`` events by step (ascending), each step's events by rank."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for e in run.events_of("replay"):
        by_step.setdefault(int(e.get("step") or 0), []).append(e)
    return {s: sorted(by_step[s], key=lambda e: int(e.get("rank") or 0)) for s in sorted(by_step)}


def _step_cause(events: Sequence[Mapping[str, Any]]) -> tuple[str | None, list[int], list[int]]:
    """A step's cause merged over its ranks: the cause of the lowest rank whose replay
    reproduced it, the ranks that reproduced it (where it came from), and the ranks whose
    replay did not reproduce it while another rank's did (they received it through the
    gradient all-reduce). ``not-reproduced`` only when no rank reproduced it."""
    measured = [e for e in events if e.get("replayed") and e.get("cause")]
    reproduced = [e for e in measured if e.get("cause") != "not-reproduced"]
    if reproduced:
        received = [int(e["rank"]) for e in measured if e.get("cause") == "not-reproduced"]
        return str(reproduced[0]["cause"]), [int(e["rank"]) for e in reproduced], received
    if measured:
        return "not-reproduced", [int(e["rank"]) for e in measured], []
    return None, [], []


def measured_causes(findings: Iterable[Finding]) -> dict[int, str]:
    """Step -> measured cause, from AMP-N17's findings (for the rules that read them)."""
    out: dict[int, str] = {}
    for f in findings:
        if f.id != "AMP-N17":
            continue
        for row in f.evidence.get("replays") or []:
            if row.get("cause"):
                out.setdefault(int(row["step"]), str(row["cause"]))
    return out


def _replay_row(step: int, events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    cause, ranks, _ = _step_cause(events)
    row: dict[str, Any] = {"step": step, "cause": cause}
    if cause is None:
        incomplete = next((e.get("incomplete") for e in events if e.get("incomplete")), None)
        reason = next((e.get("reason") for e in events if e.get("reason")), None)
        row["outcome"] = (
            f"incomplete: {incomplete}" if incomplete else f"not replayed: {reason or 'unknown'}"
        )
        ranks = [int(e["rank"]) for e in events]
    row["ranks"] = ranks
    scale = next((e.get("scale") for e in events if e.get("scale") is not None), None)
    row["scale"] = float(scale) if scale is not None else None
    return row


_FP32_HELPER = """\
import torch


def _fp32(module):
    \"\"\"Run `module` in fp32: autocast off for its forward, floating inputs cast to float32.\"\"\"
    forward = module.forward

    def cast(v):
        return v.float() if torch.is_tensor(v) and v.is_floating_point() else v

    def run(*args, **kwargs):
        with torch.autocast("{device}", enabled=False):
            return forward(*map(cast, args), **{{k: cast(v) for k, v in kwargs.items()}})

    module.forward = run
    return module
"""


def _fix_code(e: Mapping[str, Any], step: int) -> str:
    names = list(e.get("verified_fix") or [])
    device = str(e.get("device_type") or "cuda")
    quoted = ", ".join(f"`{n}`" for n in names)
    lines = [_FP32_HELPER.format(device=device), ""]
    lines.append(f"# pin {quoted} to fp32 (verified by amprobe's replay of step {step})")
    lines += [f'_fp32(model.get_submodule("{n}"))' for n in names]
    return "\n".join(lines)


def _words(
    cause: str, e: Mapping[str, Any], step: int
) -> tuple[str, str]:  # (title, fix) of one measured cause
    dtype = _dtype_word(e)
    first = e.get("first_nonfinite")
    fix_layers = list(e.get("verified_fix") or [])
    if cause == "precision":
        if fix_layers:
            pinned = _code(fix_layers)
            if first and [first] != fix_layers:
                title = (
                    f"{dtype} overflow at step {step}: non-finite first in `{first}`, and pinning "
                    f"{pinned} to fp32 made the step finite"
                )
            else:
                title = f"{dtype} overflow in {pinned}: pinning it to fp32 made step {step} finite"
            fix = (
                f"Pin {pinned} to fp32; the replay verified that this makes step {step} finite. "
                f"`model` is the module amprobe was attached to (under torch.compile, its "
                f"`_orig_mod`):\n\n```python\n{_fix_code(e, step)}\n```"
            )
        else:
            where = f" (non-finite first in `{first}`)" if first else ""
            title = (
                f"{dtype} overflow at step {step}{where}: fp32 end to end made it finite, no "
                "single fp32 pin tried did"
            )
            fix = (
                "The step is finite without autocast, so precision is the cause, but no layer "
                "pinned to fp32 alone fixed it: pin the layers of the experiments together, or "
                "run this part of the model outside autocast."
            )
        return title, fix
    if cause == "data-or-model":
        where = f", first in `{first}`" if first else ""
        return (
            f"step {step} is non-finite in fp32 too{where}: not AMP, the data or the model",
            "Not AMP: fp32 breaks too — check the batch of this step (e.g. assert "
            "torch.isfinite(x).all() in the dataset) and the model (a division by zero, a log "
            "of zero, weights already non-finite). A change of precision will not help.",
        )
    if cause == "compiler":
        where = f" (first non-finite compiled layer `{first}`)" if first else ""
        title = f"step {step} went non-finite only compiled: the eager replay is finite{where}"
        fix = (
            "The compiled graph produced values eager execution does not: try another backend "
            '(torch.compile(backend="aot_eager") to rule out inductor), compile the layer named '
            "out (torch.compiler.disable), and report it to PyTorch with the step's inputs."
        )
        if e.get("confirmed") is False:
            title += " (not confirmed: the model uses dropout)"
            fix += (
                " Not confirmed: inductor draws dropout randomness differently from eager, so "
                "the two runs may differ for that reason alone; rerun with dropout off to confirm."
            )
        return title, fix
    if cause == "loss-scale":
        scale = e.get("scale")
        at = e.get("finite_at_scale")
        divisor = e.get("finite_at_scale_divisor")
        if scale is not None and at is not None:
            title = (
                f"the loss scale {float(scale):g} was too high at step {step}: the step is finite "
                f"at {float(at):g} (scale/{float(divisor or 0):g})"
            )
        else:
            where = f" ({float(scale):g})" if scale is not None else ""
            title = (
                f"the loss scale{where} was too high at step {step}: the forward is finite and "
                "only the scaled gradient overflowed"
            )
        return title, (
            "Benign: the scale was too high, and the GradScaler skipped the step and lowered it, "
            "as it is meant to. If such skips are frequent, lower init_scale or raise "
            "growth_interval; no layer needs fp32."
        )
    if cause == "loss-computation":
        return (
            f"the loss computation made step {step} non-finite: the model's output was finite",
            "Compute the loss in fp32 outside autocast: `with torch.autocast(device_type, "
            "enabled=False): loss = loss_fn(output.float(), target)`; then check the loss "
            "itself (a division by zero, a log of zero). A change of the model's precision will "
            "not help.",
        )
    if (
        cause == "not-reproduced"
        and e.get("output_grad_finite") is False
        and e.get("output_finite") is None
    ):
        # the capture could not hold the step's output: the loss computation is not ruled out
        return (
            f"step {step}'s non-finite values did not recur in the replayed forward; the gradient "
            "that reached the model's output was non-finite (the loss computation or a fault "
            "that did not recur: the step's output was not held to tell them apart)",
            "Check the loss computation of this step first (compute it in fp32 outside autocast; "
            "a division by zero, a log of zero, a multiplication by inf); if it is finite, the "
            "fault did not recur: rerun the step on another device.",
        )
    if cause == "not-reproduced":
        fix = (
            "The replay on the same weights and inputs is finite: nondeterminism or a hardware "
            "fault. Rerun the step on another device; if it recurs there, the inputs or the "
            "weights are at fault, else the device."
        )
        if e.get("micro_batches"):
            fix += (
                f" Only the last micro-batch (of {e.get('micro_batches')}) was replayed: an "
                "earlier one may hold the non-finite value."
            )
        return (
            f"step {step}'s non-finite values did not recur on replay: nondeterminism or hardware",
            fix,
        )
    if cause == "instrumentation":
        return (
            f"amprobe's own instrumentation made step {step} non-finite",
            "Not your model: report it to amprobe; rerun with the numerics collector off.",
        )
    return f"step {step}'s replay measured cause {cause!r}", "See the experiments."


@rule(
    "AMP-N17",
    "nonfinite-cause",
    "error",
    "nan",
    requires=("replay",),
    refs=(AUTOCAST_OPS, GRADIENT_SCALING),
)
def check_nonfinite_cause(ctx: RuleContext) -> Iterator[Finding]:
    """The measured cause of the first bad step amprobe replayed (G§5.1 steps 1-3).

    Algorithm: the ``replay`` events are grouped by step over the ranks. A step's cause is that
    of the lowest rank whose replay reproduced the non-finite values; ranks whose replay did not
    reproduce it while another's did received it through the gradient all-reduce (named, not a
    cause of their own); ``not-reproduced`` only when no rank reproduced it. The finding is
    about the first step with a measured cause (severity by cause: warning for ``loss-scale``,
    error otherwise), the other replayed or considered steps listed after it (at most
    :data:`MAX_LISTED_REPLAYS` in all). When no step has a measured cause (not replayed, or its
    time budget ran out first), the rule is "not checked" with the recorded reason and the
    variants that ran (the requirement): a finding would claim to explain AMP-N02 and AMP-N05.
    """
    run = ctx.run
    steps = replay_steps_of(run)
    causes = {s: _step_cause(evs) for s, evs in steps.items()}
    measured = [s for s, (cause, _, _) in causes.items() if cause]
    several_ranks = len(run.ranks) > 1
    if not measured:  # the requirement says why (not replayed, or no cause measured)
        return
    step = measured[0]
    cause, ranks, received = causes[step]
    assert cause is not None
    events = steps[step]
    e = next(x for x in events if int(x["rank"]) == ranks[0])
    title, fix = _words(cause, e, step)
    severity = CAUSE_SEVERITY.get(cause, "error")
    if several_ranks:
        title += f" on {'rank' if len(ranks) == 1 else 'ranks'} {name_ranks(ranks)}"
        if received:
            title += (
                f" (received by {'rank' if len(received) == 1 else 'ranks'} "
                f"{name_ranks(received)} through the gradient all-reduce)"
            )
    listed = list(steps)[:MAX_LISTED_REPLAYS]
    if step not in listed:
        listed = [step, *listed[: MAX_LISTED_REPLAYS - 1]]
    replays = [_replay_row(s, steps[s]) for s in sorted(listed)]
    notes = [str(n) for n in (e.get("notes") or [])][:MAX_NOTES]
    if received:
        notes.append(
            f"{'rank' if len(received) == 1 else 'ranks'} {name_ranks(received)} replayed the "
            "step finite: the non-finite gradient came to them through the all-reduce"
        )
    distinct = {c for s in measured for c in [causes[s][0]] if c}
    evidence: dict[str, Any] = {
        "cause": cause,
        "step": step,
        "trigger": e.get("trigger"),
        "first_nonfinite": e.get("first_nonfinite"),
        "verified_fix": list(e.get("verified_fix") or []),
        "experiments": _experiment_rows(e),
        "scale": e.get("scale"),
        "finite_at_scale": e.get("finite_at_scale"),
        "compiled": e.get("compiled"),
        "confirmed": e.get("confirmed"),
        "device_type": e.get("device_type"),
        "autocast_dtype": e.get("autocast_dtype"),
        "micro_batch": e.get("micro_batch"),
        "micro_batches": e.get("micro_batches"),
        "received_ranks": received or None,
        "replays": replays,
        "replayed_step_count": sum(
            1 for evs in steps.values() if any(x.get("replayed") for x in evs)
        ),
        "distinct_causes": sorted(distinct) if len(distinct) > 1 else None,
        "notes": notes or None,
        "replay_wall_s": e.get("seconds"),
        **(rank_fields(ranks) if several_ranks else {"rank": ranks[0] if ranks else 0}),
    }
    yield ctx.finding(title=title, evidence=evidence, fix=fix, severity=severity)
