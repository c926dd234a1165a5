"""Where the first non-finite value of a multi-rank job was produced (AMP-D04), merged at read
time from what every rank recorded on its own.

A rank's input, its loss and its layers' activations are its own: no collective mixes them
(DDP's and FSDP2's reductions act on the gradients, after each parameter's local gradient
exists). A rank whose input, loss or sampled layer went non-finite at a step while another
rank's stayed finite produced it there; the others received it through the gradient
reduction (their GradScaler skipped the same step, or their weights went non-finite with the
update). A local gradient before the reduction is seen only by the replay of the bad step
(:mod:`amprobe.capture.collectors.replay`): it runs each rank's own step without the
reduction and records ``local_finite``; in a DDP replay (through ``.module``, gradients by
``torch.autograd.grad``) and in an FSDP2 collective replay (the gathered parameters
differentiated, nothing reduce-scattered) a rank whose own step is finite received it.

Per rank and step the evidence, in the order a step produces values: ``input`` (the model's
input, checked on every step: ``input_nonfinite``), ``activation`` (a forward offender on a
sampled step, AMP-N05's layer; or the replay's first non-finite layer), ``loss`` (the loss,
checked on every step: ``loss_nonfinite``), ``gradient`` (a backward offender on a sampled
step: a layer's gradient with respect to its output, which is local; or the replay's own
gradients non-finite with a finite forward). A loss-scale overflow is the GradScaler's job,
not an origin: a gradient fact on a step the scaler skipped is kept only where that rank's
replay of the step measured another cause, and none on a step whose replays all measured the
loss scale; skips that are the scaler's own job (its start-up calibration, the step right after
a growth) are not "unexplained" either. An episode ends at a step every rank skipped (the
weights stayed finite); an input is never received; a rank recorded a step only inside one of
its recording windows.

This module reads summaries and events only (no torch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from amprobe.analysis.numerics import offenders_section
from amprobe.analysis.scaler import calibration_steps, rank_scaler
from amprobe.store.loader import Run

__all__ = [
    "WHAT_ORDER",
    "MAX_EPISODES",
    "nonfinite_origin",
    "rank_place",
    "received_episode",
    "told",
    "place_text",
    "what_words",
]

#: the order in which a step produces values: the first of a rank's evidence at its step wins
WHAT_ORDER = ("input", "activation", "loss", "gradient")
#: episodes (runs of consecutive steps with a rank-local non-finite value) kept
MAX_EPISODES = 8
#: unexplained skipped steps listed
MAX_LISTED = 20

_WORDS = {
    "input": "its input batch",
    "activation": "a layer's activation",
    "loss": "its local loss",
    "gradient": "its local gradient before the reduction",
}


def _runs(runs: Mapping[str, Any] | None) -> list[tuple[int, int]]:
    """The ``[first, last]`` runs of a summary section's step runs (``{"runs": [...]}``)."""
    if not runs:
        return []
    return [(int(a), int(b)) for a, b in runs.get("runs") or []]


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Runs merged where they overlap or touch, ascending."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(runs):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _holds_step(runs: list[tuple[int, int]], step: int) -> bool:
    return any(a <= step <= b for a, b in runs)


def _meets(runs: list[tuple[int, int]], first: int, last: int) -> bool:
    """Whether some run holds a step in ``[first, last]``."""
    return any(a <= last and b >= first for a, b in runs)


def rank_place(run: Run, rank: int) -> dict[str, Any]:
    """Where ``rank`` ran: hostname, local rank and device from its manifest (None when not
    recorded)."""
    info = next((i for i in run.ranks if i.rank == rank), None)
    manifest = info.manifest if info is not None else {}
    local = manifest.get("local_rank")
    return {
        "rank": int(rank),
        "hostname": manifest.get("hostname") if isinstance(manifest.get("hostname"), str) else "",
        "local_rank": int(local) if isinstance(local, int) and not isinstance(local, bool) else -1,
        "device": manifest.get("device") if isinstance(manifest.get("device"), str) else None,
    }


def _recorded(run: Run, rank: int) -> list[tuple[int, int]]:
    """The ``[first, last]`` step ranges ``rank`` recorded: one per recording window (a
    dormant or live-attached probe's windows; a step between two windows was not recorded),
    or the lowest and highest step when the summary keeps no windows."""
    steps = run.summaries().get(rank, {}).get("steps") or {}
    spans = []
    for w in (steps.get("windows") or {}).values():
        first, last = w.get("first"), w.get("last")
        if isinstance(first, int) and isinstance(last, int):
            spans.append((first, last))
    if spans:
        return _merge(spans)
    first, last = steps.get("first"), steps.get("last")
    if isinstance(first, int) and isinstance(last, int):
        return [(first, last)]
    return []


def _replays(run: Run) -> dict[tuple[int, int], dict[str, Any]]:
    """The ``replay`` events by (rank, step)."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for e in run.events_of("replay"):
        out[int(e.get("rank") or 0), int(e.get("step") or 0)] = e
    return out


def _as_ran(event: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next(
        (x for x in event.get("experiments") or [] if x.get("variant") == "as it ran"), None
    )


def _replay_fact(event: Mapping[str, Any]) -> tuple[str, str | None] | None:
    """What a replay says this rank's own step produced, or None when its own step is finite
    or was not replayed with a per-rank answer."""
    if not event.get("replayed") or event.get("local_finite") is not False:
        return None
    x = _as_ran(event) or {}
    first = x.get("first_nonfinite") or event.get("first_nonfinite")
    if x.get("forward_finite") is False or first:
        return "activation", str(first) if first else None
    if x.get("grads_finite") is False:
        return "gradient", None
    return "activation", None


#: a rank-local fact: its steps (first, last), what, the layer, where it was seen
Fact = tuple[int, int, str, str | None, str]


def _rank_facts(run: Run, rank: int) -> list[Fact]:
    """``rank``'s local non-finite facts, as step runs."""
    section = offenders_section(run, rank)
    found: list[Fact] = []
    for a, b in _runs((section.get("inputs") or {}).get("runs")):
        found.append((a, b, "input", None, "the step's input check"))
    for a, b in _runs(section.get("loss_nonfinite")):
        found.append((a, b, "loss", None, "the step's loss check"))
    kinds = section.get("kinds") or {}
    for kind, what in (("forward", "activation"), ("backward", "gradient")):
        part = kinds.get(kind) or {}
        first = part.get("first") or {}
        module = first.get("module")
        if kind == "backward" and module == "<loss>":
            module = None  # the gradient reaching the model's output
        at = first.get("step")
        for a, b in _runs(part.get("runs")):
            if isinstance(at, int) and a <= at <= b and module:
                # the first offender's step names its module; the others are read from the
                # rank's file when one is an origin (see _layer_from_file)
                if a < at:
                    found.append((a, at - 1, what, None, "sampled numerics"))
                found.append((at, at, what, str(module), "sampled numerics"))
                if at < b:
                    found.append((at + 1, b, what, None, "sampled numerics"))
            else:
                found.append((a, b, what, None, "sampled numerics"))
    return found


def _layer_from_file(run: Run, rank: int, step: int, kind: str) -> str | None:
    """The offender ``kind``'s module of ``rank`` at ``step`` from its own offenders file."""
    try:
        frame = run.rank_table("offenders", rank)
    except Exception:
        return None
    if frame is None or frame.empty or "kind" not in frame:
        return None
    part = frame[(frame["kind"] == kind) & (frame["step"] == step)]
    if part.empty:
        return None
    module = part["module"].iloc[0]
    return None if module in (None, "<loss>") or module != module else str(module)


def _benign_steps(replays: Mapping[tuple[int, int], Mapping[str, Any]]) -> set[int]:
    """Replayed steps whose measured cause is the loss scale on every rank that measured one
    (the GradScaler skipped and lowered the scale, as it is meant to)."""
    causes: dict[int, set[str]] = {}
    for (_, step), e in replays.items():
        if e.get("replayed") and e.get("cause") and e.get("cause") != "not-reproduced":
            causes.setdefault(step, set()).add(str(e["cause"]))
    return {s for s, c in causes.items() if c == {"loss-scale"}}


def _skipped(run: Run, rank: int) -> list[tuple[int, int]]:
    scaling = offenders_section(run, rank).get("scaling") or {}
    return _runs(scaling.get("skipped"))


def _first_of(facts: list[Fact]) -> Fact:
    """The earliest fact of a step in the order it produces values; a named layer preferred
    among facts of the same kind."""
    return min(facts, key=lambda f: (WHAT_ORDER.index(f[2]), f[3] is None))


def received_episode(run: Run, rank: int, step: int) -> dict[str, Any] | None:
    """The episode (of :func:`nonfinite_origin`) whose non-finite values ``rank`` received
    through the collective and still held at ``step``; None when ``rank`` is an origin there,
    or received nothing then."""
    for e in nonfinite_origin(run)["episodes"]:
        if not told(e):
            continue
        if rank in e["received"] and e["step"] <= step <= e["last_step"]:
            return e
    return None


def told(episode: Mapping[str, Any]) -> bool:
    """Whether an episode's origin can be told: some ranks produced it, not every rank, and
    at least two ranks recorded its first step."""
    return bool(episode["origins"]) and not episode["every_rank"] and not episode["too_few"]


def place_text(o: Mapping[str, Any]) -> str:
    """``rank 1 (host-a, local rank 1, cuda:1)``: the parts recorded."""
    parts = [o.get("hostname") or None]
    if isinstance(o.get("local_rank"), int) and o["local_rank"] >= 0:
        parts.append(f"local rank {o['local_rank']}")
    parts.append(o.get("device"))
    inner = ", ".join(str(p) for p in parts if p)
    return f"rank {o['rank']}" + (f" ({inner})" if inner else "")


def nonfinite_origin(run: Run) -> dict[str, Any]:
    """The origin of each episode of rank-local non-finite values (cached per run).

    Returns ``{"episodes": [...], "unexplained": {...} | None, "nccl_nan_check": ...}``. Each
    episode: ``step`` (its first step), ``origins`` (one dict per rank whose own value was
    non-finite there: :func:`rank_place` with ``step``, ``what``, ``layer``, ``source``),
    ``received`` (ranks whose own values were finite at that step and that got it: their
    GradScaler skipped the step, their replay found their own step finite, or an activation,
    loss or gradient of theirs went non-finite later in the episode), ``unaffected`` (ranks finite there that show no sign of
    receiving it), ``unrecorded`` (ranks with no record of that step), ``every_rank`` (every
    recorded rank was non-finite on its own there: the origin cannot be told), ``last_step``.
    ``unexplained``: steps skipped for inf/NaN gradients outside the scaler's own job with
    no rank-local non-finite value and no replay that compared the ranks (``steps``,
    ``reason``): where a local gradient overflowed, unchecked.
    """
    return run.cached("nonfinite_origin", _compute)  # type: ignore[no-any-return]


def _nan_check(run: Run) -> str | None | bool:
    """``TORCH_NCCL_NAN_CHECK`` as the ranks recorded it: its value, None when not set, False
    when the manifests predate the field."""
    values = [i.manifest.get("nccl_nan_check") for i in run.ranks if "nccl_nan_check" in i.manifest]
    if not values:
        return False
    set_ = [v for v in values if isinstance(v, str) and v]
    return set_[0] if set_ else None


def _not_loss_scale(event: Mapping[str, Any] | None) -> bool:
    """Whether a replay measured a cause other than the loss scale for its rank's own step."""
    return bool(
        event is not None
        and event.get("replayed")
        and event.get("cause") not in (None, "loss-scale", "not-reproduced")
    )


def _without_scaler_overflows(
    facts: list[Fact],
    skipped: list[tuple[int, int]],
    replays: Mapping[tuple[int, int], Mapping[str, Any]],
    rank: int,
    benign: set[int],
) -> list[Fact]:
    """``facts`` without the gradient facts the GradScaler accounts for: a backward-only
    overflow on a step the scaler skipped is its job (the start-up calibration, the step after
    a growth, a scale too high for a batch) unless this rank's replay of the step measured a
    cause other than the loss scale; and none on a step whose replays all measured the loss
    scale. An input, an activation or a loss stays: the scale does not reach them."""
    kept: list[Fact] = []
    for f in facts:
        if f[2] != "gradient":
            kept.append(f)
            continue
        pieces = _cut(f[0], f[1], benign)
        for a0, b0 in skipped:
            pieces = [p for a, b in pieces for p in _cut_span(a, b, a0, b0)]
        vouched = [
            s
            for (r, s), e in replays.items()
            if r == rank
            and f[0] <= s <= f[1]
            and s not in benign
            and _holds_step(skipped, s)
            and _not_loss_scale(e)
        ]
        kept += [(a, b, *f[2:]) for a, b in pieces] + [(s, s, *f[2:]) for s in vouched]
    return kept


def _split_at_skips(
    spans: list[tuple[int, int]],
    ranks: list[int],
    recorded: Mapping[int, list[tuple[int, int]]],
    skipped: Mapping[int, list[tuple[int, int]]],
) -> list[tuple[int, int]]:
    """``spans`` cut after each step (not a span's last) that every rank recording it
    skipped. Once :data:`MAX_EPISODES` pieces are out, the rest stays uncut (only the first
    episodes are read; the pieces still cover the same steps)."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        start = a
        if len(out) < MAX_EPISODES:
            clipped = [
                (max(a, a0), min(b - 1, b0))
                for r in ranks
                for a0, b0 in skipped[r]
                if a0 <= b - 1 and b0 >= a
            ]
            for a1, b1 in _merge(clipped):
                for s in range(a1, b1 + 1):
                    if len(out) >= MAX_EPISODES:
                        break
                    at = [r for r in ranks if _holds_step(recorded[r], s)]
                    if at and all(_holds_step(skipped[r], s) for r in at):
                        out.append((start, s))
                        start = s + 1
        out.append((start, b))
    return out


def _scaler_steps(run: Run, rank: int) -> set[int]:
    """``rank``'s skips that are the GradScaler's own job, read from its host scale facts: its
    start-up calibration, and the step right after each growth of the scale (the grown scale
    probed and found too high)."""
    steps = set(calibration_steps(run, rank))
    for u in rank_scaler(run, rank).get("updates") or []:
        step, before, after = u[0], u[1], u[2]
        if isinstance(step, int) and after == after and before == before and after > before:
            steps.add(step + 1)
    return steps


def _compute(run: Run) -> dict[str, Any]:
    ranks = sorted(i.rank for i in run.ranks)
    replays = _replays(run)
    benign = _benign_steps(replays)
    facts = {r: _rank_facts(run, r) for r in ranks}
    for (r, s), e in replays.items():
        fact = _replay_fact(e)
        if fact is not None and r in facts:
            facts[r].append((s, s, *fact, "the replay of the step"))
    skipped = {r: _skipped(run, r) for r in ranks}
    for r in ranks:
        facts[r] = _without_scaler_overflows(facts[r], skipped[r], replays, r, benign)
    recorded = {r: _recorded(run, r) for r in ranks}
    # episodes: runs of consecutive steps with a rank-local non-finite value on some rank, cut
    # after a step every rank skipped (the update skipped, the weights stayed finite: a value
    # of a rank's own at the next step is its own, not received)
    spans = _split_at_skips(
        _merge([(f[0], f[1]) for r in ranks for f in facts[r]]), ranks, recorded, skipped
    )
    episodes: list[dict[str, Any]] = []
    for step, last in spans[:MAX_EPISODES]:
        at = [r for r in ranks if _holds_step(recorded[r], step)]
        unrecorded = [r for r in ranks if r not in at]
        origins: list[dict[str, Any]] = []
        for r in at:
            here = [f for f in facts[r] if f[0] <= step <= f[1]]
            if not here:
                continue
            _, _, what, layer, source = _first_of(here)
            if (
                what in ("activation", "gradient")
                and layer is None
                and source == "sampled numerics"
            ):
                layer = _layer_from_file(
                    run, r, step, "forward" if what == "activation" else "backward"
                )
            origins.append(
                {**rank_place(run, r), "step": step, "what": what, "layer": layer, "source": source}
            )
        own = {o["rank"] for o in origins}
        received: list[int] = []
        unaffected: list[int] = []
        for r in at:
            if r in own:
                continue
            event = replays.get((r, step))
            got = (
                _holds_step(skipped[r], step)
                or (
                    event is not None
                    and event.get("replayed")
                    and event.get("local_finite") is True
                )
                # a later value of its own in the episode (an input is never received)
                or (
                    last > step
                    and _meets([(f[0], f[1]) for f in facts[r] if f[2] != "input"], step + 1, last)
                )
            )
            (received if got else unaffected).append(r)
        replay_notes = [replays[r, step] for r in at if (r, step) in replays]
        episodes.append(
            {
                "step": step,
                "last_step": last,
                "origins": origins,
                "received": received,
                "unaffected": unaffected,
                "unrecorded": unrecorded,
                "every_rank": len(at) >= 2 and len(own) == len(at),
                # fewer than two ranks recorded the step: the others' own values are unknown
                "too_few": len(at) < 2,
                "replayed": any(e.get("replayed") for e in replay_notes),
                "replay_reason": next(
                    (str(e["reason"]) for e in replay_notes if e.get("reason")), None
                ),
            }
        )
    first_bad = int(episodes[0]["step"]) if episodes else None
    return {
        "ranks": ranks,
        "episodes": episodes,
        "episode_count": len(spans),
        "unexplained": _unexplained(run, ranks, skipped, spans, replays, benign, first_bad),
        "nccl_nan_check": _nan_check(run),
    }


def _unexplained(
    run: Run,
    ranks: list[int],
    skipped: Mapping[int, list[tuple[int, int]]],
    spans: list[tuple[int, int]],
    replays: Mapping[tuple[int, int], Mapping[str, Any]],
    benign: set[int],
    before: int | None,
) -> dict[str, Any] | None:
    """Skipped steps (outside the scaler's own job, :func:`_scaler_steps`, and the loss-scale
    replays) before the first episode, with no rank-local non-finite value: the origin of their
    inf/NaN gradients was not checked unless a replay compared the ranks' own steps. ``steps``: the first
    :data:`MAX_LISTED` of them, ``count``: how many."""
    out: list[tuple[int, int]] = []
    for r in ranks:
        if not skipped[r]:
            continue
        ours = _scaler_steps(run, r)
        for a, b in skipped[r]:
            out += _cut(a, b, ours)
    out = _merge(out)
    out = [p for a, b in out for p in _cut(a, b, benign)]
    for a0, b0 in spans:  # steps with a rank-local fact are episodes, not unexplained
        out = [p for a, b in out for p in _cut_span(a, b, a0, b0)]
    if before is not None:
        out = [(a, min(b, before - 1)) for a, b in out if a < before]
    if not out:
        return None
    count = sum(b - a + 1 for a, b in out)
    listed: list[int] = []
    for a, b in out:
        listed += range(a, min(b, a + MAX_LISTED) + 1)
        if len(listed) >= MAX_LISTED:
            break
    steps = listed[:MAX_LISTED]
    first = steps[0]
    events = [replays[r, first] for r in ranks if (r, first) in replays]
    if any(e.get("replayed") and e.get("local_finite") is True for e in events):
        reason = (
            f"the replay of step {first} found every rank's own step finite: the non-finite "
            "gradients did not recur (nondeterminism or a hardware fault), so no rank produced "
            "them on replay"
        )
    elif any(e.get("replayed") for e in events):
        reason = f"the replay of step {first} did not record each rank's own result (local_finite)"
    elif events:
        reason = f"step {first} was not replayed: {events[0].get('reason') or 'no reason recorded'}"
    else:
        config = run.rank_manifest.get("config") or {}
        if config.get("replay") == "off" or config.get("replay_max") == 0:
            reason = 'replay was off (replay="off" or replay_max=0): no step was replayed'
        else:
            reason = f"step {first} was not replayed (no replay event)"
    return {"steps": steps, "count": count, "first": first, "reason": reason}


def _cut(a: int, b: int, points: set[int]) -> list[tuple[int, int]]:
    """``[a, b]`` without ``points``."""
    out = []
    for s in sorted(x for x in points if a <= x <= b):
        if a < s:
            out.append((a, s - 1))
        a = s + 1
    if a <= b:
        out.append((a, b))
    return out


def _cut_span(a: int, b: int, a0: int, b0: int) -> list[tuple[int, int]]:
    """``[a, b]`` without ``[a0, b0]``."""
    if b0 < a or a0 > b:
        return [(a, b)]
    return [p for p in ((a, a0 - 1), (b0 + 1, b)) if p[0] <= p[1]]


def what_words(what: str) -> str:
    """An origin's ``what`` in words."""
    return _WORDS.get(what, what)
