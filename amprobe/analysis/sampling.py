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
    """The first rank's recorded sampling (``budget``, ``kinds`` ...), or None if none was;
    with ``fell_back_ranks`` (rank, step, reason) when some rank stopped following rank 0's
    schedule (``schedule.fell_back`` in its ``end.json``: its sampled steps may differ)."""
    first: dict[str, Any] | None = None
    fell: list[dict[str, Any]] = []
    for info in run.ranks:
        sampling = (info.end or {}).get("sampling")
        if not (isinstance(sampling, dict) and isinstance(sampling.get("kinds"), dict)):
            continue
        if first is None:
            first = sampling
        schedule = sampling.get("schedule")
        if isinstance(schedule, dict) and isinstance(schedule.get("fell_back"), dict):
            lost = schedule.get("plans_lost")
            fell.append(
                {
                    "rank": info.rank,
                    **schedule["fell_back"],
                    **({"plans_lost": lost} if isinstance(lost, int) and lost else {}),
                }
            )
    if first is not None and fell:
        first = {**first, "fell_back_ranks": fell}
    return first


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
    schedule = sampling.get("schedule")
    fell = sampling.get("fell_back_ranks")
    if isinstance(fell, list) and fell:
        head += "; " + "; ".join(_fell_text(f) for f in fell if isinstance(f, dict))
    elif isinstance(schedule, dict) and schedule.get("shared"):
        head += f"; one schedule for {schedule.get('world_size')} ranks (rank 0's)"
    return f"{', '.join(parts)} [{head}]"


def _fell_text(f: dict[str, Any]) -> str:
    """A rank that did not follow rank 0's schedule throughout: for good (the exchange failed),
    or for a while (it missed some of rank 0's plans and followed the next one it could read)."""
    lost = f.get("plans_lost")
    if isinstance(lost, int) and lost:
        plans = "plan" if lost == 1 else "plans"
        return (
            f"rank {f.get('rank')} missed {lost} of rank 0's {plans} (the first at step "
            f"{f.get('step')}: {f.get('reason')}) and chose its own sampled steps until it "
            "could follow the next one"
        )
    return (
        f"rank {f.get('rank')} chose its own sampled steps from step {f.get('step')} "
        f"({f.get('reason')})"
    )


def _duration(ms: float) -> str:
    return f"{ms / 1e3:.3g} s" if ms >= 1e3 else f"{ms:.3g} ms"
