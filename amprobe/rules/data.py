"""Named data requirements (a rule's skip conditions) that several rule modules list.

A rule module imports this one (for its helpers or for these registrations) before its rules
are registered: :func:`~amprobe.rules.engine.rule` refuses a requirement not registered yet.
A requirement only one module lists lives in that module, above its rules.

The frame helpers rules share live in :mod:`amprobe.analysis.frames`; they are re-exported
here for rule modules.
"""

from __future__ import annotations

from amprobe.analysis.frames import (
    FORCED_FP32,
    HALF_DTYPES,
    autocast_dtypes,
    forced_fp32,
    per_rank,
    scaler_configs,
    scaler_steps,
    step_ranges,
    steps_list,
)
from amprobe.analysis.numerics import has_numerics, numerics_missing_reason
from amprobe.analysis.runtime import rank_runtime, rank_step_counts
from amprobe.analysis.scaler import scaler_summaries
from amprobe.rules.engine import requirement
from amprobe.store.loader import Run

__all__ = [
    "HALF_DTYPES",
    "per_rank",
    "scaler_steps",
    "scaler_configs",
    "autocast_dtypes",
    "steps_list",
    "step_ranges",
]


@requirement("steps")
def _has_steps(run: Run) -> str | None:
    return None if rank_step_counts(run) else "no training step was recorded"


@requirement("scaler")
def _has_scaler(run: Run) -> str | None:
    facts = scaler_summaries(run).values()
    if not any(f["rows"] for f in facts):
        return "no training step was recorded"
    if any(f["n"] for f in facts):
        return None
    return "no enabled GradScaler was used (bf16/fp32 run, scaler disabled or absent)"


@requirement("amp_as_written")
def _amp_as_written(run: Run) -> str | None:
    """Met unless amprobe forced the run to fp32 (the FP32 leg of ``amprobe baseline``).

    Rules that judge the script's own AMP setup (its autocast regions, its GradScaler) list it
    first: on the forced leg the missing autocast and the disabled scaler are amprobe's doing.
    """
    return FORCED_FP32 if forced_fp32(run) else None


@requirement("autocast")
def _has_autocast(run: Run) -> str | None:
    return None if autocast_dtypes(run) else "no enabled autocast region was seen"


@requirement("optimizer")
def _has_optimizer(run: Run) -> str | None:
    return None if run.events_of("optimizer_seen") else "no optimizer step was seen"


@requirement("loss")
def _has_loss(run: Run) -> str | None:
    if any(runtime["loss_dtypes"] for runtime in rank_runtime(run).values()):
        return None
    return "no loss tensor was seen (no backward() or scaler.scale() call recorded)"


@requirement("device_facts")
def _has_device_facts(run: Run) -> str | None:
    if any("bf16_supported" in r.manifest for r in run.ranks):
        return None
    return "the training device was not recorded"


@requirement("numerics")
def _has_numerics(run: Run) -> str | None:
    if has_numerics(run):
        return None
    return numerics_missing_reason(run)
