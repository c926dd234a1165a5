"""Replica fingerprints compared across ranks (AMP-D05): which replicas stopped agreeing, when.

Each rank records, on its sampled steps, an exact integer fingerprint of every replicated
parameter and the ranks of its replica group (``fingerprints`` table, written by
``amprobe.capture.collectors.replicas``), and once per root model how its parameters are
replicated (``replicas_layout`` events). Here the ranks of each replica group are compared step
by step: a step is compared in a group only when every rank of the group recorded it (a step
some ranks sampled and others did not is counted, never taken as agreeing), and a parameter
diverges there when its fingerprints are not all equal.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np
import pandas as pd

from amprobe.store import Run

__all__ = [
    "GroupDivergence",
    "ReplicaCheck",
    "compute_replica_check",
    "ZERO_REASON",
]

#: why ZeRO-1/2 replicas are not compared (AMP-D05's "not checked"); the engine records its
#: stage in the rank manifest (``engine_zero_stage``), the read side names no engine
ZERO_REASON = (
    "ZeRO-{stage} rewrites every rank's parameters from the owner of each partition "
    "at every step (an all-gather after the owner's update): the replicas agree by "
    "construction, and a corrupted update on an owner reaches every rank alike. What could be "
    "compared, the parameters right after that all-gather, would only catch a fault in the "
    "gather itself, so they are not fingerprinted"
)
#: parameter names kept per divergent group
MAX_PARAMS = 20


@dataclasses.dataclass(frozen=True)
class GroupDivergence:
    """One replica group whose ranks stopped holding the same parameters.

    Attributes:
        group: the group's ranks.
        step: the first compared step where they differ.
        ranks: the ranks that differ from the majority; every rank of the group when there is
            no majority (two replicas, or a tie).
        majority: a strict majority of the group agreed on every differing parameter.
        params: the parameters that differ at ``step`` (at most :data:`MAX_PARAMS`).
        param_count: how many differ at ``step``.
        last_agreed_step: the last compared step before ``step`` where the group agreed.
        divergent_steps: every compared step where they differ.
        compared_step_count: steps compared in this group.
    """

    group: tuple[int, ...]
    step: int
    ranks: tuple[int, ...]
    majority: bool
    params: tuple[str, ...]
    param_count: int
    last_agreed_step: int | None
    divergent_steps: tuple[int, ...]
    compared_step_count: int


@dataclasses.dataclass(frozen=True)
class ReplicaCheck:
    """What the comparison found, or why it could not be made.

    Attributes:
        reason: why nothing could be compared (AMP-D05 "not checked"), else None.
        groups: replica groups compared.
        compared_step_count: distinct steps compared in at least one group.
        unmatched_steps: steps that some ranks of a group fingerprinted and others did not.
        divergent: the groups whose replicas differ, earliest first.
    """

    reason: str | None
    groups: int = 0
    compared_step_count: int = 0
    unmatched_steps: tuple[int, ...] = ()
    divergent: tuple[GroupDivergence, ...] = ()


def _zero_stage(run: Run) -> int | None:
    for info in run.ranks:
        stage = info.manifest.get("engine_zero_stage")
        if stage in (1, 2) and not isinstance(stage, bool):
            return int(stage)
    return None


def _group_of(text: Any) -> tuple[int, ...] | None:
    try:
        return tuple(sorted(int(part) for part in str(text).split(",")))
    except ValueError:
        return None


def compute_replica_check(run: Run) -> ReplicaCheck:
    """Compare the fingerprints of every replica group (computed once per run)."""
    return run.cached("replica_check", _compute)  # type: ignore[no-any-return]


def _compute(run: Run) -> ReplicaCheck:
    ranks = {info.rank for info in run.ranks}
    if len(ranks) < 2:
        return ReplicaCheck("single-rank run: there are no replicas to compare")
    stage = _zero_stage(run)
    if stage is not None:
        return ReplicaCheck(ZERO_REASON.format(stage=stage))
    layouts = run.events_of("replicas_layout")
    frame = run.table("fingerprints")
    if frame.empty:
        if not layouts:
            return ReplicaCheck(
                "no fingerprints recorded: the replicas collector was not on "
                "(fingerprint_every=0, a collectors list without it, or a run recorded before it)"
            )
        if not any(int(e.get("replicated_count") or 0) for e in layouts):
            reasons = sorted({str(e["reason"]) for e in layouts if e.get("reason")})
            return ReplicaCheck("no replicas: " + ("; ".join(reasons) or "no parameter has one"))
        return ReplicaCheck(
            "no fingerprints recorded: no sampled step reached its end with the replicas "
            "collector on"
        )
    return _compare(frame)


def _compare(frame: pd.DataFrame) -> ReplicaCheck:
    rows = frame[["rank", "step", "param", "fingerprint", "group"]].dropna()
    members = {g: _group_of(g) for g in rows["group"].unique()}
    # a row counts for the group it names, when its rank is in it
    valid = [int(r) in (members[g] or ()) for r, g in zip(rows["rank"], rows["group"], strict=True)]
    rows = rows[np.array(valid, dtype=bool)]
    present = rows.groupby(["group", "step"])["rank"].nunique()
    sizes = pd.Series(
        [len(members[g] or ()) for g in present.index.get_level_values(0)], index=present.index
    )
    complete = present[present == sizes].index
    unmatched = sorted({int(s) for _, s in present[present != sizes].index})
    if not len(complete):
        return ReplicaCheck(
            f"the ranks' fingerprint samples share no step: {len(unmatched)} step(s) were "
            "fingerprinted by only some ranks of a replica group",
            unmatched_steps=tuple(unmatched),
        )
    keyed = rows.set_index(["group", "step"])
    compared = keyed[keyed.index.isin(complete)].reset_index()
    per_param = compared.groupby(["group", "step", "param"])
    counts = per_param["fingerprint"].nunique()
    differ = counts[counts > 1]
    divergent: list[GroupDivergence] = []
    for group, steps in differ.groupby(level=0):
        group_steps = sorted({int(s) for g, s in complete if g == group})
        bad_steps = sorted({int(s) for s in steps.index.get_level_values(1)})
        first = bad_steps[0]
        params = sorted(str(p) for p in steps.xs(first, level=1).index.get_level_values(-1))
        at_first = compared[
            (compared["group"] == group)
            & (compared["step"] == first)
            & compared["param"].isin(params)
        ]
        named: set[int] = set()
        majority = True
        for _, param_rows in at_first.groupby("param"):
            votes = Counter(int(v) for v in param_rows["fingerprint"])
            value, top = votes.most_common(1)[0]
            if top * 2 > len(param_rows):
                named.update(
                    int(r)
                    for r, v in zip(param_rows["rank"], param_rows["fingerprint"], strict=True)
                    if int(v) != value
                )
            else:
                majority = False
                named.update(int(r) for r in param_rows["rank"])
        agreed = [s for s in group_steps if s < first and s not in bad_steps]
        divergent.append(
            GroupDivergence(
                group=members[group] or (),
                step=first,
                ranks=tuple(sorted(named)),
                majority=majority,
                params=tuple(params[:MAX_PARAMS]),
                param_count=len(params),
                last_agreed_step=agreed[-1] if agreed else None,
                divergent_steps=tuple(bad_steps),
                compared_step_count=len(group_steps),
            )
        )
    divergent.sort(key=lambda d: (d.step, d.group))
    return ReplicaCheck(
        None,
        groups=len({g for g, _ in complete}),
        compared_step_count=len({int(s) for _, s in complete}),
        unmatched_steps=tuple(unmatched),
        divergent=tuple(divergent),
    )
