"""Rule AMP-S06: an AMP run measured against its FP32 baseline is not faster.

The comparison itself is :mod:`amprobe.analysis.compare`; this rule judges it and reads the
run's other speed findings (``after=SPEED_RULES``) to say which of them explain it.
:func:`compare_runs` is the comparison of two runs named by the user (``amprobe compare`` and
``amprobe baseline``), with AMP-S06 judged on it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

from amprobe.analysis.compare import (
    baseline_comparison,
    baseline_path,
    compute_comparison,
    load_baseline,
)
from amprobe.rules import data as _data  # noqa: F401  (registers amp_as_written, listed below)
from amprobe.rules.engine import (
    REGISTRY,
    Finding,
    RuleContext,
    diagnose,
    requirement,
    resolve_thresholds,
    rule,
)
from amprobe.rules.refs import AMP_DOCS, MATMUL_GUIDE, TUNING_GUIDE
from amprobe.store.loader import Run

__all__ = ["SPEED_RULES", "Comparison", "compare_runs", "no_speedup_findings"]

#: the speed rules whose findings can explain a missing speedup
SPEED_RULES = ("AMP-S01", "AMP-S02", "AMP-S03", "AMP-S04", "AMP-S05", "AMP-S07")


@requirement("baseline")
def _has_baseline(run: Run) -> str | None:
    if baseline_path(run) is None:
        return "no FP32 baseline was measured (use `amprobe baseline`)"
    if load_baseline(run) is None:
        return "the FP32 baseline run named in the manifest cannot be read"
    return None


@rule(
    "AMP-S06",
    "no-speedup",
    "warning",
    "speed",
    requires=("amp_as_written", "baseline"),
    thresholds={"min_speedup": 1.1},
    refs=(AMP_DOCS, TUNING_GUIDE, MATMUL_GUIDE),
    after=SPEED_RULES,
    explained_by=SPEED_RULES,
)
def check_no_speedup(ctx: RuleContext) -> Iterator[Finding]:
    """A measured FP32-vs-AMP comparison gives a speedup under ``min_speedup``.

    Algorithm: the speedup of :func:`amprobe.analysis.compare.compute_comparison` (median step
    time after warm-up, baseline over AMP run). The finding lists which other speed findings
    (S01-S05, S07) of the same diagnosis explain it.
    """
    comparison = baseline_comparison(ctx.run)
    assert comparison is not None  # guaranteed by the requirement
    yield from no_speedup_findings(ctx, comparison, ctx.prior)


def no_speedup_findings(
    ctx: RuleContext, comparison: Mapping[str, Any], explaining: Iterable[Finding] = ()
) -> Iterator[Finding]:
    """AMP-S06's finding for a comparison, naming the speed findings in ``explaining``."""
    speedup = comparison.get("speedup")
    if speedup is None or not math.isfinite(speedup) or speedup >= ctx.thresholds["min_speedup"]:
        return
    explained = sorted({f.id for f in explaining if f.id in SPEED_RULES})
    yield ctx.finding(
        title=f"AMP is {speedup:.2f}x the FP32 baseline's throughput (below {ctx.thresholds['min_speedup']:g}x)",
        evidence={
            "speedup": round(speedup, 3),
            "steps_per_s_fp32": round(comparison["steps_per_s_baseline"], 3),
            "steps_per_s_amp": round(comparison["steps_per_s_candidate"], 3),
            "min_speedup": ctx.thresholds["min_speedup"],
            "explained_by": explained,
            "baseline": comparison["baseline"],
        },
        fix=(
            ("Start with " + ", ".join(explained) + ". " if explained else "")
            + "AMP speeds up large, aligned matrix multiplies on Tensor Cores; input pipelines, "
            "host syncs, small or misaligned layers and code outside autocast eat the gain."
        ),
    )


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Two runs side by side: the metrics of
    :func:`~amprobe.analysis.compare.compute_comparison` and AMP-S06's finding on them."""

    metrics: Mapping[str, Any]
    findings: tuple[Finding, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**self.metrics, "findings": [f.to_dict() for f in self.findings]}


def compare_runs(
    baseline: Run,
    candidate: Run,
    thresholds: Mapping[str, Mapping[str, float]] | None = None,
) -> Comparison:
    """Compare ``candidate`` (AMP) with ``baseline`` (FP32) and judge AMP-S06 on the pair.

    What ``amprobe compare`` and ``amprobe baseline`` print. AMP-S06 names the candidate's
    speed findings that explain a missing speedup (the speed rules run on the candidate only).
    """
    metrics = compute_comparison(baseline, candidate)
    spec = REGISTRY["AMP-S06"]
    ctx = RuleContext(
        run=candidate,
        spec=spec,
        thresholds=MappingProxyType(resolve_thresholds(thresholds)[spec.id]),
    )
    explaining = diagnose(candidate, thresholds=thresholds, only=SPEED_RULES).findings
    return Comparison(metrics, tuple(no_speedup_findings(ctx, metrics, explaining)))
