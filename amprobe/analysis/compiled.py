"""torch.compile in a recorded run: what was compiled, and when the compiler worked again.

Pure functions of a loaded run: the ``compile`` facts of the rank manifests, the per-step
compile counters (``compile_frames``, ``compile_graphs``, ``graph_breaks``, ``recompiles``) and
the ``recompile`` / ``graph_break`` events with the compiler's own reasons.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from amprobe.store.loader import Run

__all__ = ["compile_steps", "compiled_targets", "is_compiled", "recompile_reasons"]

_COUNTERS = ("compile_frames", "compile_graphs", "graph_breaks", "recompiles")


def compiled_targets(run: Run) -> list[dict[str, Any]]:
    """What the job compiled (every rank's manifest, each target once)."""
    seen: set[tuple[Any, ...]] = set()
    targets: list[dict[str, Any]] = []
    for info in run.ranks:
        for fact in info.manifest.get("compile") or ():
            if not isinstance(fact, dict):
                continue
            key = (fact.get("target"), fact.get("kind"), fact.get("backend"))
            if key not in seen:
                seen.add(key)
                targets.append(dict(fact))
    for event in run.events_of("compiled"):  # a compile seen only through dynamo's counters
        key = (event.get("target"), event.get("kind"), event.get("backend"))
        if key not in seen:
            seen.add(key)
            targets.append({k: event.get(k) for k in ("target", "kind", "backend", "mode")})
    return targets


def is_compiled(run: Run) -> bool:
    """The job ran torch.compile'd code (as recorded)."""
    return bool(compiled_targets(run))


def compile_steps(run: Run) -> pd.DataFrame:
    """Per rank and step: the compile counters (zeros where a column was not recorded)."""
    steps = run.steps
    cols = ["rank", "step", *_COUNTERS]
    if steps.empty:
        return pd.DataFrame(columns=cols)
    frame = steps[[c for c in ("rank", "step") if c in steps.columns]].copy()
    if "rank" not in frame.columns:
        frame["rank"] = 0
    for col in _COUNTERS:
        values = steps[col] if col in steps.columns else 0
        frame[col] = pd.to_numeric(values, errors="coerce").fillna(0).astype(int)
    return frame[cols].reset_index(drop=True)


def recompile_reasons(run: Run, kind: str = "recompile") -> list[dict[str, Any]]:
    """The ``recompile`` (or ``graph_break``) events, in step order."""
    events = [dict(e) for e in run.events_of(kind)]
    return sorted(events, key=lambda e: (e.get("step") or 0, e.get("rank") or 0))
