"""Rules on torch.compile'd jobs (checklist AMP-S08)."""

from __future__ import annotations

from collections.abc import Iterator

from amprobe.analysis.compiled import compile_steps, is_compiled, recompile_reasons
from amprobe.rules.data import step_ranges, steps_list
from amprobe.rules.engine import Finding, RuleContext, requirement, rule
from amprobe.rules.refs import COMPILE_GRAPH_BREAKS, COMPILE_RECOMPILES
from amprobe.store.loader import Run

__all__ = ["check_recompile_storm"]


@requirement("compiled")
def _has_compiled(run: Run) -> str | None:
    return None if is_compiled(run) else "nothing was compiled with torch.compile"


@rule(
    "AMP-S08",
    "recompile-storm",
    "warning",
    "speed",
    requires=("steps", "compiled"),
    thresholds={"warmup_steps": 3, "max_recompiles": 0, "max_graph_breaks": 0},
    refs=(COMPILE_RECOMPILES, COMPILE_GRAPH_BREAKS),
)
def check_recompile_storm(ctx: RuleContext) -> Iterator[Finding]:
    """A compiled model or function keeps recompiling after warm-up, or is split by breaks.

    Algorithm: from the per-step compiler counters (``recompiles``, ``graph_breaks``, read from
    ``torch._dynamo``'s own counters at each step boundary), count the recompilations after the
    first ``warmup_steps`` steps of each rank; more than ``max_recompiles`` is a storm: each one
    stalls the step for a compile and, past dynamo's recompile limit, the frame falls back to
    eager. Independently, more than ``max_graph_breaks`` graph breaks split the compiled region
    into several graphs that run every step with Python in between. The finding quotes the
    guard that failed (dynamo's words) and the source line of the function, from the
    ``recompile`` / ``graph_break`` events.
    """
    th = ctx.thresholds
    frame = compile_steps(ctx.run)
    if frame.empty:
        return
    first = frame.groupby("rank")["step"].transform("min")
    late = frame[frame["step"] >= first + int(th["warmup_steps"])]
    recompiles = int(late["recompiles"].sum())
    breaks = int(frame["graph_breaks"].sum())
    storm = recompiles > th["max_recompiles"]
    split = breaks > th["max_graph_breaks"]
    if not (storm or split):
        return
    steps = sorted(set(late.loc[late["recompiles"] > 0, "step"].astype(int)))
    reasons = [
        e for e in recompile_reasons(ctx.run) if int(e.get("step") or 0) in set(steps)
    ] or recompile_reasons(ctx.run)
    break_reasons = recompile_reasons(ctx.run, "graph_break")
    parts = []
    if storm:
        parts.append(
            f"{recompiles} recompile(s) after the first {int(th['warmup_steps'])} steps "
            f"(steps {', '.join(str(s) for s in steps_list(steps))})"
        )
    if split:
        parts.append(f"{breaks} graph break(s) split the compiled region")
    first_reason = reasons[0] if storm and reasons else None
    quote = ""
    if first_reason is not None:
        where = first_reason.get("where") or "?"
        quote = (
            f": guard failed in {first_reason.get('function') or '?'} ({where}): "
            + str(first_reason.get("reason") or "?").splitlines()[0]
        )
    elif split and break_reasons:
        quote = ": " + str(break_reasons[0].get("reason") or "?").splitlines()[0]
    yield ctx.finding(
        title="compiled code keeps recompiling: " + " and ".join(parts) + quote,
        evidence={
            "recompiles_after_warmup": recompiles,
            "recompile_steps": steps_list(steps),
            "recompile_step_ranges": step_ranges(steps),
            "graph_breaks": breaks,
            "warmup_steps": int(th["warmup_steps"]),
            "recompile_reasons": [
                {k: e.get(k) for k in ("step", "function", "where", "reason")} for e in reasons[:5]
            ],
            "graph_break_reasons": [e.get("reason") for e in break_reasons[:5]],
        },
        fix=(
            "Keep what the guards check stable between steps: the same autocast state and "
            "dtypes on every call, shapes that do not vary (pad to a few fixed sizes, or mark "
            "the varying dimension dynamic with torch._dynamo.mark_dynamic / dynamic=True), "
            "and no Python values that change per step in the compiled code; move what must "
            "vary (or what breaks the graph: .item(), print, data-dependent branches) out of "
            "the compiled region. TORCH_LOGS=recompiles,graph_breaks shows every guard."
        ),
    )
