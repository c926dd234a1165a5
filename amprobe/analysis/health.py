"""Health metrics reported for every run (checklist section C)."""

from __future__ import annotations

from typing import Any

from amprobe.analysis.compare import COMPARED_METRICS, baseline_comparison, baseline_path
from amprobe.analysis.compute import compute_mfu
from amprobe.analysis.frames import FORCED_FP32, forced_fp32
from amprobe.analysis.scaler import success_rate_metric
from amprobe.store.loader import Run

__all__ = ["compute_health", "HEALTH_METRICS"]

#: metric -> (label, unit). Values not measured carry a ``note`` saying why.
HEALTH_METRICS: dict[str, tuple[str, str]] = {
    "speedup": ("throughput speedup vs FP32 baseline", "x"),
    "memory_ratio": ("peak memory AMP / FP32", "x"),
    "loss_diff": ("final-loss difference vs baseline", ""),
    "scaler_success_rate": ("loss-scale success rate (steps applied / all steps)", "%"),
    "mfu": ("model FLOPs utilization", "%"),
}


def _not_measured(why: str) -> dict[str, Any]:
    return {"value": None, "note": f"not measured: {why}"}


def compute_health(run: Run) -> dict[str, dict[str, Any]]:
    """The section-C metrics that the run's data supports (computed once per run).

    Each metric is ``{"value", "label", "unit", ...}``; a metric that was not measured has
    ``value`` None and a ``note`` that says why.
    """
    cached: dict[str, dict[str, Any]] = run.cached("health", _compute_health)
    return {key: dict(metric) for key, metric in cached.items()}


def _compute_health(run: Run) -> dict[str, dict[str, Any]]:
    health: dict[str, dict[str, Any]] = {}
    comparison = baseline_comparison(run)
    for key in COMPARED_METRICS:
        if comparison is None:
            if baseline_path(run) is not None:
                why = f"the FP32 baseline run {baseline_path(run)} cannot be read"
            elif forced_fp32(run):
                why = f"this run is the baseline itself, {FORCED_FP32}"
            else:
                why = "no FP32 baseline recorded (see `amprobe baseline`)"
            health[key] = _not_measured(why)
        elif comparison.get(key) is not None:
            health[key] = {"value": comparison[key], "baseline": comparison["baseline"]}
        else:
            health[key] = _not_measured(comparison["notes"].get(key, "not recorded"))
    health["scaler_success_rate"] = success_rate_metric(run)
    if len(run.table("compute_steps")):
        health["mfu"] = compute_mfu(run)
    else:
        health["mfu"] = _not_measured(
            'FLOP counting is not recorded in this run (enable the "compute" collector)'
        )
    for key, (label, unit) in HEALTH_METRICS.items():
        health[key].update(label=label, unit=unit)
    return health
