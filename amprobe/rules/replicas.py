"""AMP-D05 replica-divergence: data-parallel replicas that no longer hold the same parameters.

Reads the comparison of :mod:`amprobe.analysis.replicas` (the ranks' fingerprints, per replica
group and sampled step); what could not be compared is "not checked" with its reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from amprobe.analysis.replicas import GroupDivergence, compute_replica_check
from amprobe.rules.data import steps_list
from amprobe.rules.engine import Finding, RuleContext, format_ranks, requirement, rule
from amprobe.store.loader import Run

__all__: list[str] = []

#: replica groups given a finding each; beyond, one finding lists them under ``groups``
MAX_GROUP_FINDINGS = 8
#: groups listed under ``groups``
MAX_LISTED_GROUPS = 16
#: parameter names a title names
_TITLE_PARAMS = 3


@requirement("replica_fingerprints")
def _has_replica_fingerprints(run: Run) -> str | None:
    return compute_replica_check(run).reason


def _divergent(d: GroupDivergence) -> dict[str, Any]:
    """The ``divergent`` evidence of one group (docs/evidence.md; read by the per-rank view)."""
    return {
        "step": d.step,
        "ranks": list(d.ranks),
        "majority": d.majority,
        "params": list(d.params),
        "group": list(d.group),
    }


def _ranks_text(ranks: tuple[int, ...] | list[int]) -> str:
    """``0 and 2`` for two ranks, else :func:`format_ranks` (``0-3, 7``)."""
    if len(ranks) == 2:
        return f"{ranks[0]} and {ranks[1]}"
    return format_ranks(ranks)


def _params_text(d: GroupDivergence) -> str:
    shown = ", ".join(d.params[:_TITLE_PARAMS])
    more = d.param_count - min(d.param_count, _TITLE_PARAMS)
    return shown + (f" and {more} more parameter(s)" if more else "")


def _title(d: GroupDivergence) -> str:
    params = _params_text(d)
    if d.majority:
        others = [r for r in d.group if r not in d.ranks]
        who = "rank" if len(d.ranks) == 1 else "ranks"
        return (
            f"replicas differ from step {d.step}: {who} {_ranks_text(d.ranks)} "
            f"{'holds' if len(d.ranks) == 1 else 'hold'} other values of {params} than "
            f"ranks {_ranks_text(others)}"
        )
    if len(d.group) == 2:
        return (
            f"replicas differ from step {d.step}: ranks {_ranks_text(d.ranks)} hold different "
            f"values of {params}; with two replicas the copy at fault cannot be told"
        )
    return (
        f"replicas differ from step {d.step}: ranks {_ranks_text(d.ranks)} of replica group "
        f"{format_ranks(d.group)} hold different values of {params} and no majority agrees; "
        "the copy at fault cannot be told"
    )


@rule(
    "AMP-D05",
    "replica-divergence",
    "error",
    "distributed",
    requires=("replica_fingerprints",),
)
def check_replica_divergence(ctx: RuleContext) -> Iterator[Finding]:
    """Data-parallel replicas that must hold bit-identical parameters differ.

    Algorithm: each rank fingerprints its replicated parameters on sampled steps, after the
    optimizer update (an exact integer sum of the bit patterns; one flipped bit changes it), and
    records each parameter's replica group (DDP: its process group; a DTensor: the ranks of its
    mesh sharing its coordinates on the dimensions not ``Replicate``, so HSDP's ranks with the
    same shard index). Per group and step recorded by every rank of the group, a parameter
    diverges when its fingerprints are not all equal. The finding names the first such step,
    the parameters that differ there and the ranks that differ from a strict majority of the
    group; with two replicas, or no majority, every rank of the group is named and the copy at
    fault cannot be told. Steps some ranks of a group sampled and others did not are counted,
    never compared. Assumes the update is deterministic across replicas (it is for DDP and
    FSDP2: the same reduced gradient, the same optimizer): a nondeterministic update that
    differs per rank is reported too, and is a bug of its own.
    """
    check = compute_replica_check(ctx.run)
    if not check.divergent:
        return
    fix = (
        "Replicas that must be bit-identical are not: silent data corruption on a device (a "
        "flipped bit in memory or a wrong computation) or an update that is not the same on "
        "every rank (a rank-dependent optimizer step, a parameter changed outside the "
        "optimizer on one rank). Check the named rank's device (run a known-answer test, "
        "look at its ECC/Xid errors), drain it if it is faulty, and resume from a checkpoint "
        "saved before the first divergent step: the replicas never re-synchronize by "
        "themselves (DDP broadcasts parameters only at construction)."
    )
    common: dict[str, Any] = {
        "compared_group_count": check.groups,
        "compared_step_count": check.compared_step_count,
        "unmatched_step_count": len(check.unmatched_steps),
    }
    if check.unmatched_steps:
        common["unmatched_steps"] = steps_list(check.unmatched_steps)
    if len(check.divergent) <= MAX_GROUP_FINDINGS:
        for d in check.divergent:
            yield ctx.finding(
                title=_title(d),
                evidence={
                    "divergent": _divergent(d),
                    "ranks": list(d.ranks),
                    "params": [{"param": p} for p in d.params],
                    "param_count": d.param_count,
                    "last_agreed_step": d.last_agreed_step,
                    "divergent_step_count": len(d.divergent_steps),
                    "divergent_steps": steps_list(d.divergent_steps),
                    **common,
                },
                fix=fix,
            )
        return
    first = check.divergent[0]
    named = sorted({r for d in check.divergent for r in d.ranks})
    yield ctx.finding(
        title=(
            f"replicas differ in {len(check.divergent)} replica groups, the first from step "
            f"{first.step}: {_title(first).split(': ', 1)[1]}"
        ),
        evidence={
            "groups": [_divergent(d) for d in check.divergent[:MAX_LISTED_GROUPS]],
            "divergent_group_count": len(check.divergent),
            "ranks": named,
            **common,
        },
        fix=fix,
    )
