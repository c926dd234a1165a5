"""A device that computed a known answer wrong: AMP-D06, from the ``device_check`` events.

The capture side (:mod:`amprobe.capture.collectors.devicecheck`) runs a fixed GEMM whose exact
answer is known, in the job's precision, on each rank's device every ``device_check_minutes``,
and records per check the number of elements that differ from the stored answer, and once per
rank the device's identity (NVML's UUID and PCI bus id). This module only reads and words them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from amprobe.rules.engine import Finding, RuleContext, name_ranks, rank_fields, requirement, rule
from amprobe.store.loader import Run

__all__ = [
    "HEALTHY_NOTE",
    "MAX_NAMED_FAULTS",
    "device_check_note",
    "device_checks_by_rank",
    "device_faults",
]

#: faulty ranks a title names one by one (the ``faults`` table lists every one)
MAX_NAMED_FAULTS = 3
#: what a known answer computed right does not say (the finding's ``checked`` note, the docs)
HEALTHY_NOTE = (
    "a passing known answer does not prove a device healthy (one GEMM kernel at one moment, "
    "not every unit or condition the job meets)"
)
_DTYPE_WORDS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def _config(run: Run) -> Mapping[str, Any]:
    return run.rank_manifest.get("config") or {}


def device_checks_by_rank(run: Run) -> dict[int, list[dict[str, Any]]]:
    """The ``device_check`` events by rank (ascending), each rank's in step order."""
    out: dict[int, list[dict[str, Any]]] = {}
    for e in run.events_of("device_check"):
        out.setdefault(int(e.get("rank") or 0), []).append(e)
    return {r: sorted(out[r], key=lambda e: int(e.get("step") or 0)) for r in sorted(out)}


def _identities(run: Run) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for e in run.events_of("device_identity"):
        out.setdefault(int(e.get("rank") or 0), e)
    return out


def _hostnames(run: Run) -> dict[int, str]:
    return {r.rank: str(r.manifest.get("hostname") or "unknown host") for r in run.ranks}


def device_faults(run: Run) -> list[dict[str, Any]]:
    """Each rank whose device answered a check wrong, with its first failing check:
    ``{"rank", "hostname", "device", "uuid", "pci_bus_id", "step", "mismatches"}`` (the
    evidence contract of AMP-D06), ranks ascending."""
    identities = _identities(run)
    hosts = _hostnames(run)
    faults = []
    for rank, checks in device_checks_by_rank(run).items():
        bad = next((e for e in checks if int(e.get("mismatches") or 0) > 0), None)
        if bad is None:
            continue
        who = identities.get(rank, {})
        faults.append(
            {
                "rank": rank,
                "hostname": hosts.get(rank, "unknown host"),
                "device": str(who.get("device") or bad.get("device") or "unknown device"),
                "uuid": who.get("uuid"),
                "pci_bus_id": who.get("pci_bus_id"),
                "step": int(bad.get("step") or 0),
                "mismatches": int(bad.get("mismatches") or 0),
            }
        )
    return faults


def _rank_reasons(run: Run, kind: str, key: str, only: set[int] | None) -> dict[str, list[int]]:
    """reason -> ranks, from the events of ``kind`` (the first per rank; ranks in ``only``)."""
    seen: dict[int, str] = {}
    for e in run.events_of(kind):
        rank = int(e.get("rank") or 0)
        if only is None or rank in only:
            seen.setdefault(rank, str(e.get(key) or "no reason recorded"))
    out: dict[str, list[int]] = {}
    for rank, reason in sorted(seen.items()):
        out.setdefault(reason, []).append(rank)
    return out


def _on_ranks(ranks: Sequence[int], several: bool) -> str:
    if not several:
        return ""
    return f" on {'rank' if len(ranks) == 1 else 'ranks'} {name_ranks(ranks)}"


def _why_unchecked(run: Run, only: set[int] | None) -> str:
    """Why the ranks in ``only`` (every rank: None) ran no check, from what they recorded."""
    several = len(run.ranks) > 1
    parts = []
    for reason, ranks in _rank_reasons(run, "device_check_error", "error", only).items():
        parts.append(f"the check failed{_on_ranks(ranks, several)}: {reason}")
    failed: dict[int, str] = {}
    for e in run.events_of("collector_error"):
        rank = int(e.get("rank") or 0)
        if e.get("collector") == "devicecheck" and (only is None or rank in only):
            failed.setdefault(rank, str(e.get("error")))
    for rank, error in sorted(failed.items()):
        parts.append(f"the devicecheck collector failed{_on_ranks([rank], several)}: {error}")
    for reason, ranks in _rank_reasons(run, "device_check_off", "reason", only).items():
        parts.append(f"the check was off{_on_ranks(ranks, several)}: {reason}")
    if parts:
        return "; ".join(parts)
    return (
        "the check never ran: no step ended on a known training device while amprobe recorded "
        "(it runs at the first step boundary, then every device_check_minutes)"
    )


@requirement("device_check")
def _has_device_check(run: Run) -> str | None:
    """Met when a rank's device answered wrong, or every rank ran the known-answer check; else
    the true reason some did not (ranks whose check answered right are named: a rank that was
    not checked is never counted as fine)."""
    checks = device_checks_by_rank(run)
    if checks:
        missing = {r.rank for r in run.ranks} - set(checks)
        if not missing or device_faults(run):
            return None
        checked = sorted(checks)
        return (
            f"checked and answered right on {'rank' if len(checked) == 1 else 'ranks'} "
            f"{name_ranks(checked)} only; not on "
            f"{'rank' if len(missing) == 1 else 'ranks'} {name_ranks(missing)}: "
            + _why_unchecked(run, missing)
        )
    config = _config(run)
    if "device_check_minutes" not in config:
        return "the run was recorded by an amprobe without the known-answer device check"
    if "devicecheck" not in (config.get("collectors") or []):
        return "the devicecheck collector was not among the run's collectors"
    return _why_unchecked(run, None)


def _dtype_word(name: Any) -> str:
    return _DTYPE_WORDS.get(str(name), str(name))


def _who(fault: Mapping[str, Any]) -> str:
    """``rank 1 (host node-3, cuda:1, UUID GPU-…, PCI bus 00000000:3B:00.0)``."""
    uuid = fault.get("uuid") or "UUID not recorded"
    pci = fault.get("pci_bus_id")
    parts = [
        f"host {fault['hostname']}",
        str(fault["device"]),
        f"UUID {uuid}" if fault.get("uuid") else uuid,
    ]
    parts.append(f"PCI bus {pci}" if pci else "PCI bus id not recorded")
    return f"rank {fault['rank']} ({', '.join(parts)})"


def _shape_text(shape: Any) -> str | None:
    """``[2048, 256, 2048]`` as ``2048 x 256 x 2048`` (M x K x N)."""
    if not isinstance(shape, list) or not shape:
        return None
    return " x ".join(str(d) for d in shape)


def _checked_note(run: Run, checks: Mapping[int, list[dict[str, Any]]]) -> str:
    count = sum(len(c) for c in checks.values())
    first = next(iter(checks.values()))[0]
    size = _shape_text(first.get("shape")) or "shape not recorded"
    minutes = _config(run).get("device_check_minutes")
    every = (
        f"every {minutes:g} min" if isinstance(minutes, int | float) and minutes else "every 30 min"
    )
    unchecked = sorted({r.rank for r in run.ranks} - set(checks))
    word = "rank" if len(unchecked) == 1 else "ranks"
    not_on = f"; not checked on {word} {name_ranks(unchecked)}" if unchecked else ""
    return (
        f"{count:,} known-answer {_dtype_word(first.get('dtype'))} GEMM(s) ({size}, {every}) on "
        f"{len(checks):,} rank(s){not_on}; {HEALTHY_NOTE}"
    )


def device_check_note(run: Run) -> str | None:
    """What the known-answer checks covered, whether or not one failed (the finding's
    ``checked`` evidence; a view may show it for a run without AMP-D06 too), with
    :data:`HEALTHY_NOTE`; None when no check ran."""
    checks = device_checks_by_rank(run)
    return _checked_note(run, checks) if checks else None


@rule(
    "AMP-D06",
    "device-fault",
    "error",
    "distributed",
    requires=("device_check",),
)
def check_device_fault(ctx: RuleContext) -> Iterator[Finding]:
    """A rank's device computed a known-answer GEMM wrong.

    Algorithm: every ``device_check`` event holds the number of elements of a fixed GEMM (values
    in {-1, 0, 1}, K = 256, so every partial sum is an integer the job's dtype holds exactly,
    in any summation order) that differed from the stored answer on one rank's device. A rank
    with any check above 0 is faulty; the finding names each such rank, its host, device, NVML
    UUID and PCI bus id, and the step and mismatch count of its first failing check (evidence
    ``faults``), ranks ascending. The check is rank-local: nothing is compared across ranks, so
    a fault names its own rank, never rank 0 by default. Assumptions: a rank without a failing
    check is not known to be healthy (a passing known answer does not prove a device healthy:
    it exercises one kernel at one moment); a check that never ran is "not checked", with the
    reason recorded (off on the CPU unless asked, ``device_check_minutes=0``, an error).
    """
    run = ctx.run
    checks = device_checks_by_rank(run)
    faults = device_faults(run)
    if not faults:
        return
    first = faults[0]
    bad_check = next(e for e in checks[first["rank"]] if int(e.get("mismatches") or 0) > 0)
    dtype = _dtype_word(bad_check.get("dtype"))
    elements = int(bad_check.get("elements") or 0)
    if len(faults) == 1:
        title = (
            f"{_who(first)} computed a known-answer {dtype} GEMM wrong at step {first['step']}: "
            f"{first['mismatches']:,} of {elements:,} elements differ"
        )
    else:
        named = "; ".join(
            f"{_who(f)} at step {f['step']} ({f['mismatches']:,} elements)"
            for f in faults[:MAX_NAMED_FAULTS]
        )
        more = len(faults) - MAX_NAMED_FAULTS
        title = (
            f"{len(faults):,} ranks' devices computed a known-answer {dtype} GEMM wrong: {named}"
            + (f"; and {more:,} more" if more > 0 else "")
        )
    drain = ", ".join(
        f"{f.get('uuid') or f['device']} on {f['hostname']}" for f in faults[:MAX_NAMED_FAULTS]
    )
    one = len(faults) == 1
    fix = (
        f"Drain the {'device' if one else 'devices'} ({drain}): take "
        f"{'it' if one else 'them'} out of the job's pool, restart the job without "
        f"{'it' if one else 'them'} from a checkpoint saved before the first failing check, "
        f"and have {'it' if one else 'each'} tested (NVIDIA DCGM: `dcgmi diag -r 3`) before it "
        "returns. What a device computed since its last passing check is suspect."
    )
    failed = sum(1 for c in checks.values() for e in c if int(e.get("mismatches") or 0) > 0)
    evidence: dict[str, Any] = {
        "faults": faults,
        **rank_fields(f["rank"] for f in faults),
        "dtype": bad_check.get("dtype"),
        "shape": _shape_text(bad_check.get("shape")),
        "result_element_count": elements,
        "failed_check_count": failed,
        "check_count": sum(len(c) for c in checks.values()),
        "checked": _checked_note(run, checks),
    }
    yield ctx.finding(title=title, evidence=evidence, fix=fix)
