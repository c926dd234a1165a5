"""Health metrics reported for every run (checklist section C)."""

from __future__ import annotations

from typing import Any

from amprobe.rules.data import scaler_steps
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
    """Compute the section-C metrics that the run's data supports."""
    from amprobe.rules.compare import compute_comparison, load_baseline

    health: dict[str, dict[str, Any]] = {}
    base = "no FP32 baseline recorded (see `amprobe baseline`)"
    health["speedup"] = _not_measured(base)
    health["memory_ratio"] = _not_measured(base)
    health["loss_diff"] = _not_measured(base)
    baseline = (
        load_baseline(run) if any(r.manifest.get("baseline_run") for r in run.ranks) else None
    )
    if baseline is not None:
        comparison = compute_comparison(baseline, run)
        for key in ("speedup", "memory_ratio", "loss_diff"):
            if comparison.get(key) is not None:
                health[key] = {"value": comparison[key], "baseline": str(baseline.path)}
            else:
                note = next(
                    (n for n in comparison["notes"] if n.startswith(key.split("_")[0][:4])),
                    "not recorded",
                )
                health[key] = _not_measured(note)
    steps = scaler_steps(run)
    if len(steps):
        skipped = int(steps["skipped"].fillna(False).astype(bool).sum())
        health["scaler_success_rate"] = {
            "value": 1.0 - skipped / len(steps),
            "steps": int(len(steps)),
            "skipped": skipped,
        }
    elif len(run.steps):
        health["scaler_success_rate"] = {
            "value": None,
            "note": "not applicable: no enabled GradScaler (every step applied its update)",
        }
    else:
        health["scaler_success_rate"] = _not_measured("no training step was recorded")
    if len(run.table("compute_steps")):
        from amprobe.rules.compute import compute_mfu

        health["mfu"] = compute_mfu(run)
    else:
        health["mfu"] = _not_measured(
            'FLOP counting is not recorded in this run (enable the "compute" collector)'
        )
    for key, (label, unit) in HEALTH_METRICS.items():
        health[key].update(label=label, unit=unit)
    return health
