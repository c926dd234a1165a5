"""What the overhead budget chose: the sampled steps of each kind, from the ranks' end files.

The probe spaces the sampled steps of its default schedules (per-layer numerics, shape capture,
sync counting) so that they add at most ``Config.overhead_budget`` of the training time (see
``amprobe.capture.budget``); each rank's ``end.json`` says what it chose. A run that ended
without closing has no such record.
"""

from __future__ import annotations

from typing import Any

from amprobe.store import Run

__all__ = ["sampling_summary", "sampling_text"]


def sampling_summary(run: Run) -> dict[str, Any] | None:
    """The first rank's recorded sampling (``budget``, ``kinds`` ...), or None if none was."""
    for info in run.ranks:
        sampling = (info.end or {}).get("sampling")
        if isinstance(sampling, dict) and isinstance(sampling.get("kinds"), dict):
            return sampling
    return None


def sampling_text(sampling: dict[str, Any]) -> str:
    """``numerics 8 (budget: 1 every >= 3101 steps), shapes 1, syncs 1 (fixed: every 50)``."""
    parts = []
    for name, kind in sampling.get("kinds", {}).items():
        if not isinstance(kind, dict):
            continue
        text = f"{name} {kind.get('samples', 0)}"
        period = kind.get("period")
        if kind.get("mode") == "fixed":
            text += f" (fixed: every {kind.get('min_period')})"
        elif isinstance(period, int):
            text += f" (1 every >= {period} steps)"
        elif kind.get("samples") and isinstance(kind.get("min_period"), int):
            # only the first sample was taken (a warm-up): its cost is not measured yet
            text += f" (1 every >= {kind['min_period']} steps)"
        if kind.get("armed_declined"):
            text += f", {kind['armed_declined']} armed declined"
        parts.append(text)
    budget = sampling.get("budget")
    share = sampling.get("sampled_share")
    head = f"budget {budget:.0%}" if isinstance(budget, (int, float)) and budget else "no budget"
    if isinstance(share, (int, float)):
        head += f", sampled steps took {share:.1%} of training time"
    warmup = sampling.get("warmup_ms")
    if isinstance(warmup, (int, float)) and warmup > 0:
        # the first samples' one-time work (hooks, a compiled graph variant): not in the share
        head += f" after {_duration(warmup)} of first-sample warm-up"
    return f"{', '.join(parts)} [{head}]"


def _duration(ms: float) -> str:
    return f"{ms / 1e3:.3g} s" if ms >= 1e3 else f"{ms:.3g} ms"
