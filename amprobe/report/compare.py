"""Renderers of a two-run :class:`~amprobe.rules.compare.Comparison` (``amprobe compare`` and
``amprobe baseline`` print the same)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from amprobe.analysis.frames import percent_text, range_text
from amprobe.rules.compare import Comparison

__all__ = [
    "COMPARISON_COLUMNS",
    "comparison_rows",
    "render_comparison_text",
    "render_comparison_json",
]

#: the columns of :func:`comparison_rows`
COMPARISON_COLUMNS = ("measure", "baseline", "candidate", "candidate vs baseline", "steps")


def _steps(pair: Sequence[int] | None) -> str:
    if not pair:
        return "not recorded"
    first, last = pair
    return range_text(int(first), int(last), word=True)


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f} MiB"


def comparison_rows(metrics: Mapping[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """The metrics of :func:`~amprobe.analysis.compare.compute_comparison` as a small table:
    one ``(measure, baseline, candidate, candidate vs baseline, steps)`` row of text each (see
    :data:`COMPARISON_COLUMNS`), with the numbers ``amprobe compare`` prints and the steps they
    cover. A metric that was not measured says why in its row."""
    c = metrics
    notes = c.get("notes") or {}
    rows: list[tuple[str, str, str, str, str]] = []
    if c.get("speedup") is not None:
        ranges = c.get("timed_step_ranges") or (None, None)
        counts = c.get("timed_steps") or ("?", "?")
        rows.append(
            (
                "step time (median after warm-up)",
                f"{1e3 / c['steps_per_s_baseline']:.1f} ms",
                f"{1e3 / c['steps_per_s_candidate']:.1f} ms",
                f"speedup {c['speedup']:.2f}x",
                f"baseline {_steps(ranges[0])} ({counts[0]} timed), "
                f"candidate {_steps(ranges[1])} ({counts[1]} timed)",
            )
        )
    else:
        rows.append(_missing("step time", notes.get("speedup")))
    if c.get("memory_ratio") is not None:
        rows.append(
            (
                f"peak memory ({c['memory_kind']})",
                _mib(c["peak_memory_baseline"]),
                _mib(c["peak_memory_candidate"]),
                f"ratio {c['memory_ratio']:.2f}",
                "all recorded steps",
            )
        )
    else:
        rows.append(_missing("peak memory", notes.get("memory_ratio")))
    if c.get("loss_diff") is not None:
        rows.append(
            (
                "final loss (mean over the last shared steps)",
                f"{c['final_loss_baseline']:.4g}",
                f"{c['final_loss_candidate']:.4g}",
                f"difference {c['loss_diff']:+.4g}",
                _steps(c.get("final_loss_step_range")),
            )
        )
        rows.append(
            (
                "loss, mean |candidate - baseline|",
                "",
                "",
                f"{c['loss_mean_abs_diff']:.4g}",
                f"{c['shared_loss_steps']} steps with a loss in both runs, within "
                f"{_steps(c.get('shared_loss_step_range'))}",
            )
        )
    else:
        rows.append(_missing("loss difference", notes.get("loss_diff")))

    def rate(side: str) -> str:
        value = c.get(f"scaler_success_rate_{side}")
        if value is None:
            return str(notes.get(f"scaler_success_rate_{side}", "not recorded"))
        return percent_text(value, space=False)

    rows.append(("scaler success rate", rate("baseline"), rate("candidate"), "", "all steps"))
    return rows


def _missing(measure: str, note: str | None) -> tuple[str, str, str, str, str]:
    return (measure, "", "", f"not measured: {note or 'not recorded'}", "")


def render_comparison_text(comparison: Comparison) -> str:
    """The side-by-side metrics, then AMP-S06's finding when the pair gives it."""
    c = comparison.metrics
    notes = c.get("notes") or {}
    lines = [f"baseline:  {c['baseline']}", f"candidate: {c['candidate']}"]
    if c.get("speedup") is not None:
        lines.append(
            f"throughput: {c['steps_per_s_baseline']:.2f} -> {c['steps_per_s_candidate']:.2f} "
            f"steps/s, speedup {c['speedup']:.2f}x"
            + (
                f" (median step time, baseline {_steps(c['timed_step_ranges'][0])}, "
                f"candidate {_steps(c['timed_step_ranges'][1])})"
                if c.get("timed_step_ranges")
                else ""
            )
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
            + (f" ({_steps(c['final_loss_step_range'])})" if c.get("final_loss_step_range") else "")
        )

    def rate(side: str) -> str:
        value = c.get(f"scaler_success_rate_{side}")
        if value is None:
            return str(notes.get(f"scaler_success_rate_{side}", "not recorded"))
        return percent_text(value, space=False)

    lines.append(f"scaler success rate: {rate('baseline')} -> {rate('candidate')}")
    for f in comparison.findings:
        lines.append(f"[{f.severity}] {f.id} {f.name}: {f.title}")
        lines.append(f"    fix: {f.fix}")
    return "\n".join(lines) + "\n"


def render_comparison_json(comparison: Comparison) -> str:
    """The metrics with ``findings`` (each a :meth:`~amprobe.rules.Finding.to_dict`)."""
    payload: dict[str, Any] = comparison.to_dict()
    return json.dumps(payload, indent=2, default=str) + "\n"
