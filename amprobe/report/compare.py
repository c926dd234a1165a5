"""Renderers of a two-run :class:`~amprobe.rules.compare.Comparison` (``amprobe compare`` and
``amprobe baseline`` print the same)."""

from __future__ import annotations

import json
from typing import Any

from amprobe.rules.compare import Comparison

__all__ = ["render_comparison_text", "render_comparison_json"]


def render_comparison_text(comparison: Comparison) -> str:
    """The side-by-side metrics, then AMP-S06's finding when the pair gives it."""
    c = comparison.metrics
    notes = c.get("notes") or {}
    lines = [f"baseline:  {c['baseline']}", f"candidate: {c['candidate']}"]
    if c.get("speedup") is not None:
        lines.append(
            f"throughput: {c['steps_per_s_baseline']:.2f} -> {c['steps_per_s_candidate']:.2f} "
            f"steps/s, speedup {c['speedup']:.2f}x"
        )
    else:
        lines.append(f"throughput: not measured: {notes.get('speedup', 'not recorded')}")
    if c.get("memory_ratio") is not None:
        lines.append(
            f"peak memory ({c['memory_kind']}): {c['peak_memory_baseline'] / 2**20:.1f} -> "
            f"{c['peak_memory_candidate'] / 2**20:.1f} MiB, ratio {c['memory_ratio']:.2f}"
        )
    else:
        lines.append(f"peak memory: not measured: {notes.get('memory_ratio', 'not recorded')}")
    if c.get("loss_diff") is not None:
        lines.append(
            f"loss over {c['shared_loss_steps']} shared steps: mean |diff| "
            f"{c['loss_mean_abs_diff']:.4g}, final {c['final_loss_baseline']:.4g} -> "
            f"{c['final_loss_candidate']:.4g}"
        )

    def rate(side: str) -> str:
        value = c.get(f"scaler_success_rate_{side}")
        if value is None:
            return str(notes.get(f"scaler_success_rate_{side}", "not recorded"))
        return f"{value:.1%}"

    lines.append(f"scaler success rate: {rate('baseline')} -> {rate('candidate')}")
    for f in comparison.findings:
        lines.append(f"[{f.severity}] {f.id} {f.name}: {f.title}")
        lines.append(f"    fix: {f.fix}")
    return "\n".join(lines) + "\n"


def render_comparison_json(comparison: Comparison) -> str:
    """The metrics with ``findings`` (each a :meth:`~amprobe.rules.Finding.to_dict`)."""
    payload: dict[str, Any] = comparison.to_dict()
    return json.dumps(payload, indent=2, default=str) + "\n"
