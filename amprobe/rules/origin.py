"""AMP-D04 rank-nonfinite-origin: the rank where a multi-rank job's non-finite value was produced.

Every rank records on its own; :func:`~amprobe.analysis.origin.nonfinite_origin` merges them at
read time (as AMP-D01 merges the ranks' loss scales). This rule only words what it found.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from amprobe.analysis.origin import (
    WHAT_ORDER,
    nonfinite_origin,
    place_text,
    rank_place,
    told,
    what_words,
)
from amprobe.rules import distributed as _distributed  # noqa: F401  (the multi_rank requirement)
from amprobe.rules.engine import Finding, RuleContext, name_ranks, requirement, rule
from amprobe.rules.refs import MULTI_GPU_EXAMPLE
from amprobe.store.loader import Run

__all__: list[str] = []

#: episodes with an origin that get a finding of their own (the first ones)
MAX_FINDINGS = 4
#: rows of the per-rank table
MAX_ROWS = 16
#: the keys of ``evidence["origin"]`` (the per-rank view reads them)
ORIGIN_KEYS = ("rank", "hostname", "local_rank", "device", "step", "what", "layer")


def _untold_reason(e: Mapping[str, Any]) -> str:
    """Why an episode's origin cannot be told."""
    if e["too_few"]:
        return (
            f"fewer than two ranks recorded step {e['step']} (the others recorded other steps: "
            "a dormant or live-attached probe's windows): their own values there are not known"
        )
    whats = [w for w in WHAT_ORDER if w in {o["what"] for o in e["origins"]}]
    why = (
        f"every rank's own values were non-finite at step {e['step']} "
        f"({', '.join(what_words(w) for w in whats)}), the first step of that run of "
        "non-finite steps: either every rank produced them (the same bad data, a scale too "
        "high everywhere), or they were produced where no rank-local check looked (a gradient "
        "before the reduction, on a step not replayed) and the update spread them to every rank"
    )
    if e.get("replay_reason"):
        why += f"; the step was not replayed: {e['replay_reason']}"
    return why


@requirement("nonfinite_origin")
def _origin_known(run: Run) -> str | None:
    """Met when some episode of non-finite values has an origin rank, or when nothing was
    non-finite; else why the origin cannot be told."""
    found = nonfinite_origin(run)
    episodes = found["episodes"]
    if any(told(e) for e in episodes):
        return None
    if episodes:
        return "the origin cannot be told: " + _untold_reason(episodes[0])
    unexplained = found["unexplained"]
    if unexplained is not None:
        steps = unexplained["steps"]
        return (
            f"{unexplained['count']:,} step(s) were skipped for inf/NaN gradients (first: step "
            f"{steps[0]}) with no rank's input, loss or sampled layer non-finite: some rank's "
            "gradient overflowed before the reduction (or every rank's: a loss scale too "
            "high), and only a replay of the step compares the ranks' own gradients; "
            f"{unexplained['reason']}"
        )
    return None


def _how(run_ep: Mapping[str, Any], rank: int) -> str:
    if rank in run_ep["received"]:
        return "received it through the all-reduce"
    if rank in run_ep["unaffected"]:
        return "finite, no sign it received it"
    return "no record of the step (not checked)"


@rule(
    "AMP-D04",
    "rank-nonfinite-origin",
    "error",
    "distributed",
    requires=("multi_rank", "nonfinite_origin"),
    refs=(MULTI_GPU_EXAMPLE,),
)
def check_rank_nonfinite_origin(ctx: RuleContext) -> Iterator[Finding]:
    """The first non-finite value of a multi-rank job was produced on one rank and reached the
    others through a collective.

    Algorithm (:func:`~amprobe.analysis.origin.nonfinite_origin`): per rank and step, the
    rank-local non-finite facts: its input (``input_nonfinite``, every step), a sampled
    layer's activation (AMP-N05's forward offender), its loss (``loss_nonfinite``, every
    step), a sampled layer's output gradient (a backward offender), and the replay's own step
    (``local_finite`` false: its first non-finite layer, or its gradients before the reduction
    with a finite forward). Steps with such a fact on some rank form episodes (runs of
    consecutive steps); at an episode's first step the ranks with a fact of their own are its
    origin (the first of their facts in the order a step produces them: input, activation,
    loss, gradient), and the ranks finite there that skipped the step, replayed it finite or
    went non-finite later in the episode received it. A finding per episode with an origin
    (the first :data:`MAX_FINDINGS`). When every rank was non-finite on its own at the first
    step, or gradients overflowed on every rank with no local fact and no replay, the origin
    cannot be told and the rule says why under "not checked"; it never picks the lowest rank.
    An episode ends at a step every rank skipped (the weights stayed finite: a rank's value at
    the next step is its own), and an input is never received. A loss-scale overflow is not an
    origin: a gradient fact on a step the GradScaler skipped counts only where that rank's
    replay of the step measured a cause other than the loss scale; skips that are the scaler's
    own job (its start-up calibration, the step right after a growth of the scale) never make
    it "not checked". A step between two recording windows of a rank is not recorded there.
    """
    run = ctx.run
    found = nonfinite_origin(ctx.run)
    nan_check = found["nccl_nan_check"]
    earlier: list[str] = []
    if found["unexplained"] is not None:
        u = found["unexplained"]
        earlier.append(
            f"{u['count']:,} earlier step(s) (first: step {u['first']}) were skipped for "
            f"inf/NaN gradients with no rank-local non-finite value: not placed on a rank "
            f"({u['reason']})"
        )
    made = 0
    for i, e in enumerate(found["episodes"]):
        if not told(e):
            earlier.append(f"step {e['step']}: the origin cannot be told ({_untold_reason(e)})")
            continue
        if made >= MAX_FINDINGS:
            break
        made += 1
        origins = e["origins"]
        first = i == 0 and found["unexplained"] is None
        for o in origins:
            yield _finding(ctx, e, o, origins, list(earlier), nan_check, run, first)
        earlier = []


def _finding(
    ctx: RuleContext,
    e: Mapping[str, Any],
    o: Mapping[str, Any],
    origins: list[Mapping[str, Any]],
    notes: list[str],
    nan_check: Any,
    run: Run,
    first: bool,
) -> Finding:
    step, what, layer = int(e["step"]), str(o["what"]), o.get("layer")
    received = list(e["received"])
    others = [p["rank"] for p in origins if p["rank"] != o["rank"]]
    thing = what_words(what) + (f", `{layer}`" if layer else "")
    title = (
        f"{place_text(o)} produced the "
        + ("first non-finite value" if first else "non-finite value")
        + f" at step {step}: {thing}"
    )
    if others:
        title += (
            f" (ranks {name_ranks(others)} produced their own at the same step)"
            if len(others) > 1
            else f" (rank {others[0]} produced its own at the same step)"
        )
    if received:
        title += (
            f"; {'rank' if len(received) == 1 else 'ranks'} {name_ranks(received)} received "
            "it through the all-reduce"
        )
    if what == "activation" and layer:
        if o.get("source") == "sampled numerics":
            notes.append(f"`{layer}` is AMP-N05's first non-finite layer on rank {o['rank']}")
        else:
            notes.append(f"`{layer}` is the replay's first non-finite layer on rank {o['rank']}")
    elif what in ("loss", "activation", "gradient") and not layer:
        notes.append(
            f"no layer was measured on rank {o['rank']} at step {step} (the step was neither "
            "sampled nor replayed there): the layer that produced it is not named"
        )
    if e["unaffected"]:
        notes.append(
            f"{'rank' if len(e['unaffected']) == 1 else 'ranks'} {name_ranks(e['unaffected'])} "
            "stayed finite and show no sign of receiving it (no skipped update, no later "
            "non-finite value)"
        )
    if e["unrecorded"]:
        notes.append(
            f"{'rank' if len(e['unrecorded']) == 1 else 'ranks'} {name_ranks(e['unrecorded'])} "
            f"recorded no step {step}: not checked"
        )
    if nan_check:
        notes.append(
            f"TORCH_NCCL_NAN_CHECK was set ({nan_check}): with the NCCL backend each collective's "
            "input is checked for NaN and the job stops naming the rank whose input held it; "
            "an NCCL error naming another rank would contradict this finding"
        )
    rows = []
    by_rank = {p["rank"]: p for p in origins}
    others = sorted(set(received) | set(e["unaffected"]))
    # the origin ranks first, then the others (the first of them)
    listed = sorted(by_rank) + others[: max(0, MAX_ROWS - len(by_rank))]
    for r in listed:
        place = by_rank.get(r) or rank_place(run, r)
        own = by_rank.get(r)
        rows.append(
            {
                "rank": r,
                "hostname": place.get("hostname") or None,
                "local_rank": place.get("local_rank") if place.get("local_rank", -1) >= 0 else None,
                "device": place.get("device"),
                f"own values at step {step}": (
                    "non-finite: "
                    + what_words(own["what"])
                    + (f" (`{own['layer']}`)" if own.get("layer") else "")
                    if own
                    else "finite"
                ),
                "how": "produced it" if own else _how(e, r),
            }
        )
    evidence: dict[str, Any] = {
        "origin": {k: o.get(k) for k in ORIGIN_KEYS},
        "received": received,
        "ranks": [int(o["rank"])],
        "step": step,
        "what": what,
        "layer": layer,
        "origin_source": o.get("source"),
        "episode_last_step": int(e["last_step"]) if e["last_step"] != step else None,
        "ranks_at_step": rows,
        "ranks_not_listed_count": (len(by_rank) + len(others) - len(listed)) or None,
        "nccl_nan_check": (
            None if nan_check is False else ("set: " + str(nan_check) if nan_check else "not set")
        ),
        "notes": notes or None,
    }
    fix = {
        "input": (
            f"The batch rank {o['rank']} read at step {step} already held NaN/inf: check that "
            "rank's data shard and loader at this step (assert torch.isfinite(x).all() in the "
            "dataset), not AMP and not the other ranks."
        ),
        "activation": (
            f"Look at rank {o['rank']}'s forward at step {step}"
            + (f" (`{layer}`; see AMP-N05/AMP-N17 for its cause)" if layer else "")
            + ": the other ranks' forwards were finite, so its batch or its device made the "
            "difference. Rerun the step on another device to tell the data from the hardware."
        ),
        "loss": (
            f"Look at rank {o['rank']}'s loss at step {step}: its model output or its loss "
            "computation went non-finite while the other ranks' stayed finite (its batch, or "
            "its device). Sample every step (--set numerics_every=1) to name the layer."
        ),
        "gradient": (
            f"Rank {o['rank']}'s own gradients went non-finite before the reduction at step "
            f"{step} while its forward was finite: a backward-only overflow on that rank (a "
            "custom backward, an op that overflows in half precision on its batch) or its "
            "device."
        ),
    }[what]
    if received:
        fix += (
            f" {'Rank' if len(received) == 1 else 'Ranks'} {name_ranks(received)} received it "
            "through the gradient reduction (DDP's all-reduce, FSDP2's reduce-scatter): "
            f"{'its' if len(received) == 1 else 'their'} own values at step {step} were finite."
        )
    if others_own := [p["rank"] for p in origins if p["rank"] != o["rank"]]:
        fix += (
            f" {'Rank' if len(others_own) == 1 else 'Ranks'} {name_ranks(others_own)} produced "
            f"{'its' if len(others_own) == 1 else 'their'} own non-finite value at the same step "
            "(see "
            + ("its" if len(others_own) == 1 else "their")
            + " AMP-D04 finding): look there too."
        )
    if nan_check is None:
        fix += (
            " With NCCL, TORCH_NCCL_NAN_CHECK=1 makes every collective check its input for NaN "
            "and name the rank whose input held one (a cost on every collective)."
        )
    return ctx.finding(title=title, evidence=evidence, fix=fix)
