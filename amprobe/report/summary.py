"""The one-screen summary printed after a recorded job ends (``amprobe run``, the callbacks)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from amprobe.rules import diagnose
from amprobe.store import load_run

__all__ = ["collector_errors", "print_run_summary"]


def collector_errors(run: Any) -> list[str]:
    """One line per collector switched off during the run (``collector_error`` events), e.g. a
    busy ``--prometheus-port``: the run's data is complete without it, but the user asked for it."""
    lines = []
    for e in run.events_of("collector_error")[:20]:
        lines.append(
            f"collector {e.get('collector')!r} was switched off on rank {e.get('rank')} "
            f"at step {e.get('step')}: {e.get('error')}"
        )
    return lines


def print_run_summary(run_dir: Path) -> None:
    """One screen of findings after the child exits; never raises."""
    try:
        run = load_run(run_dir)
        run.warnings.extend(collector_errors(run))
        diagnosis = diagnose(run)
    except Exception as exc:
        print(f"amprobe: nothing to diagnose in {run_dir}: {exc}", file=sys.stderr)
        return
    steps = int(run.steps["step"].nunique()) if len(run.steps) else 0
    if not steps and any((r.manifest.get("config") or {}).get("dormant") for r in run.ranks):
        print(
            f"\namprobe: the job ran dormant and was never attached: nothing recorded in {run_dir}",
            file=sys.stderr,
        )
        return
    status = f"{run.status}: {run.end_reason}" if run.end_reason else run.status
    print(
        f"\namprobe: recorded {steps} steps on {len(run.ranks)} rank(s) in {run_dir} ({status})",
        file=sys.stderr,
    )
    for line in collector_errors(run):
        print(f"  warning: {line}", file=sys.stderr)
    for f in diagnosis.findings[:12]:
        print(f"  [{f.severity}] {f.id} {f.name}: {f.title}", file=sys.stderr)
    if len(diagnosis.findings) > 12:
        print(f"  ... {len(diagnosis.findings) - 12} more", file=sys.stderr)
    if not diagnosis.findings:
        print("  no findings", file=sys.stderr)
    print(f"amprobe: details: amprobe diagnose {run_dir}", file=sys.stderr)
