"""Hand-built step rows for rule tests: loss-scale trajectories with planted cuts and growth."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import amprobe
from amprobe.rules import Diagnosis, Finding
from amprobe.store.loader import Run

__all__ = ["scaled_steps", "plain_steps", "scaler_event", "findings_of", "not_checked_ids", "diag"]


def scaled_steps(
    n: int,
    cuts: Iterable[int] = (),
    growth: Iterable[int] = (),
    init: float = 65536.0,
    dtype: str = "float16",
    loss_dtype: str = "float32",
    rank: int = 0,
    **extra: Any,
) -> list[dict[str, Any]]:
    """``n`` iterations under an enabled GradScaler starting at ``init``.

    A step in ``cuts`` found inf (skipped, scale halved); a step in ``growth`` doubles the scale.
    ``extra`` adds the same fields to every row.
    """
    cuts, growth = set(cuts), set(growth)
    rows = []
    scale = init
    for step in range(n):
        after = scale / 2 if step in cuts else (scale * 2 if step in growth else scale)
        rows.append(
            {
                "rank": rank,
                "step": step,
                "scaler_enabled": True,
                "scale_before": scale,
                "scale_after": after,
                "skipped": step in cuts,
                "found_inf": 1.0 if step in cuts else 0.0,
                "autocast_dtype": dtype,
                "autocast_device": "cpu",
                "loss_dtype": loss_dtype,
                "opt_steps": 0 if step in cuts else 1,
                **extra,
            }
        )
        scale = after
    return rows


def plain_steps(
    n: int, dtype: str | None = "float16", loss_dtype: str | None = "float32", **extra: Any
) -> list[dict[str, Any]]:
    """``n`` iterations without a GradScaler."""
    return [
        {
            "step": s,
            "scaler_enabled": False,
            "autocast_dtype": dtype,
            "loss_dtype": loss_dtype,
            "opt_steps": 1,
            **extra,
        }
        for s in range(n)
    ]


def scaler_event(
    growth_interval: int = 2000,
    init_scale: float = 65536.0,
    site: str | None = "train.py:10",
    **extra: Any,
) -> dict[str, Any]:
    """A ``scaler_created`` event as the scaler collector records it."""
    return {
        "kind": "scaler_created",
        "growth_interval": growth_interval,
        "init_scale": init_scale,
        "enabled": True,
        "backoff_factor": 0.5,
        "growth_factor": 2.0,
        "site": site,
        **extra,
    }


def diag(run: Run, thresholds: Mapping[str, Mapping[str, float]] | None = None) -> Diagnosis:
    return amprobe.diagnose(run, thresholds=thresholds)


def findings_of(diagnosis: Diagnosis, rule_id: str) -> list[Finding]:
    return [f for f in diagnosis.findings if f.id == rule_id]


def not_checked_ids(diagnosis: Diagnosis) -> dict[str, str]:
    return {n.id: n.reason for n in diagnosis.not_checked}
