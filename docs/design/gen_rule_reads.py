"""Which parts of a run each rule reads, traced while the rules run (for docs/design/read-side.md).

Run: ``python docs/design/gen_rule_reads.py [RUN ...]`` (default: the five sample runs; add a
multi-rank run, e.g. one that ``benchmarks/bench_cluster_read.py --keep`` built, so that the
cross-rank rules run too). Prints a Markdown table, one row per rule (and per requirement, and
the health and what-if summaries), naming:

- the tables it read through ``Run.table`` (``steps``, ``numerics``, ...), the event kinds it read
  through ``Run.events_of``, and the per-run derived frames it read through ``Run.cached``
  (with the tables and events those read, the first time they were computed, listed under
  their own ``cached:`` row);
- how it walks the ranks: ``per rank`` when it called ``analysis.frames.per_rank`` or grouped a
  frame by its ``rank`` column, ``across ranks`` when it called ``compute_rank_grid`` /
  ``compute_rank_medians`` (a step x rank grid, a median per rank), ``manifests`` when it read
  ``Run.rank_manifest``, else ``merged`` (all ranks' rows as one frame, or no rank at all). A
  derived frame cached once per rank (its key ends in the rank) is listed as ``:<rank>`` and
  counts as ``per rank``.

Reads are traced by wrapping these methods and functions, so the table is what the code did on
the runs given; a branch none of them takes is not in it.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import amprobe  # noqa: E402
from amprobe.analysis import frames, ranks  # noqa: E402
from amprobe.rules import engine  # noqa: E402
from amprobe.store import loader  # noqa: E402

SAMPLES = ("healthy", "overflow", "misuse", "bf16", "fp8-whatif")

reads: dict[str, set[str]] = defaultdict(set)
walks: dict[str, set[str]] = defaultdict(set)
stack: list[str] = []


@contextlib.contextmanager
def reader(name: str) -> Iterator[None]:
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def note(kind: str, what: str) -> None:
    """Record a read (or a way of walking the ranks) for the innermost reader running."""
    if not stack:
        return
    if kind == "read":
        key = re.sub(r":\d+$", ":<rank>", what)  # a derived frame cached once per rank
        reads[stack[-1]].add(key)
        if key != what:
            walks[stack[-1]].add("per rank")
    else:
        walks[stack[-1]].add(what)


def wrap(owner: Any, attr: str, before: Callable[..., None]) -> None:
    original = getattr(owner, attr)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(owner, attr, wrapped)


def patch() -> None:
    wrap(loader.Run, "table", lambda self, name: note("read", name))
    wrap(loader.Run, "events_of", lambda self, kind: note("read", f"events:{kind}"))
    original_cached = loader.Run.cached

    def cached(self: loader.Run, key: str, compute: Callable[[loader.Run], Any]) -> Any:
        note("read", f"cached:{key}")

        def traced(run: loader.Run) -> Any:
            with reader(re.sub(r":\d+$", ":<rank>", f"cached:{key}")):
                return compute(run)

        return original_cached(self, key, traced)

    loader.Run.cached = cached  # type: ignore[method-assign]
    loader.Run.rank_manifest = property(  # type: ignore[method-assign, assignment]
        lambda self: (note("walk", "manifests"), self.ranks[0].manifest if self.ranks else {})[1]
    )
    per_rank = frames.per_rank

    def traced_per_rank(frame: pd.DataFrame) -> Iterator[Any]:
        note("walk", "per rank")
        return per_rank(frame)

    across = {fn: getattr(ranks, fn) for fn in ("compute_rank_grid", "compute_rank_medians")}
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("amprobe"):
            continue
        if getattr(module, "per_rank", None) is per_rank:
            module.per_rank = traced_per_rank  # type: ignore[attr-defined]
        for fn, original in across.items():
            if getattr(module, fn, None) is original:
                setattr(module, fn, _across(original))
    groupby = pd.DataFrame.groupby

    def traced_groupby(self: pd.DataFrame, by: Any = None, *args: Any, **kwargs: Any) -> Any:
        keys = by if isinstance(by, list) else [by]
        if "rank" in keys:
            note("walk", "per rank")
        return groupby(self, by, *args, **kwargs)

    pd.DataFrame.groupby = traced_groupby  # type: ignore[method-assign, assignment]


def _across(fn: Callable[..., Any]) -> Callable[..., Any]:
    def traced(*args: Any, **kwargs: Any) -> Any:
        note("walk", "across ranks")
        return fn(*args, **kwargs)

    return traced


def trace(run_dir: Path) -> None:
    run = amprobe.load_run(run_dir)
    for rid, spec in list(engine.REGISTRY.items()):
        engine.REGISTRY[rid] = _traced_spec(rid, spec)
    for name, fn in list(engine.REQUIREMENTS.items()):
        engine.REQUIREMENTS[name] = _traced_fn(f"requires:{name}", fn)
    try:
        amprobe.diagnose(run)  # compute_health runs inside, traced below
    finally:
        for rid, spec in list(engine.REGISTRY.items()):
            engine.REGISTRY[rid] = spec.__wrapped_spec__  # type: ignore[attr-defined]
        for name, fn in list(engine.REQUIREMENTS.items()):
            engine.REQUIREMENTS[name] = fn.__wrapped__  # type: ignore[attr-defined]
    from amprobe.analysis.whatif import compute_whatif

    with reader("what-if (diagnose --format json)"):
        compute_whatif(run)


def _traced_fn(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def traced(*args: Any, **kwargs: Any) -> Any:
        with reader(label):
            result = fn(*args, **kwargs)
            return list(result) if hasattr(result, "__next__") else result

    traced.__wrapped__ = fn  # type: ignore[attr-defined]
    return traced


def _traced_spec(rid: str, spec: Any) -> Any:
    import dataclasses

    new = dataclasses.replace(spec, fn=_traced_fn(rid, spec.fn))
    object.__setattr__(new, "__wrapped_spec__", spec)
    return new


def main() -> None:
    runs = [Path(a) for a in sys.argv[1:]] or []
    runs = [REPO / "sample_runs" / s for s in SAMPLES] + runs
    patch()
    from amprobe.analysis import health

    health.compute_health = _traced_fn("health", health.compute_health)
    engine.compute_health = health.compute_health  # type: ignore[attr-defined]
    for run_dir in runs:
        trace(run_dir)
    names = sorted(set(reads) | set(walks), key=lambda n: (not n.startswith("AMP-"), n))
    print("| reader | reads | ranks |")
    print("|---|---|---|")
    for name in names:
        got = sorted(reads.get(name, ()), key=lambda r: (r.count(":"), r))
        walk = ", ".join(sorted(walks.get(name, ()))) or "merged"
        print(f"| {name} | {', '.join(f'`{r}`' for r in got) or '—'} | {walk} |")


if __name__ == "__main__":
    main()
