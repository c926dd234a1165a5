"""The per-step figures of a run of many ranks: their JSON size and build time (issue #33).

Run: ``python benchmarks/bench_rank_figures.py [--ranks 64 256 1024] [--steps 10000]
[--run DIR]``. Builds the loss-scale, step-time, runtime and ranks figures (and the rank x step
heatmap) from a synthetic steps frame (every rank 10 ms a step, one rank 3x slower, one rank's
loss scale halved for one step) and prints, per rank count, each figure's ``to_json()`` size and
CPU seconds. A run of more than 8 ranks is drawn as bands across ranks computed on the server
(:mod:`amprobe.analysis.rankbands`): the figure's size stays flat as ranks grow. With ``--run``,
it also builds every tab of the dashboard's run page of that recorded run (figure JSON bytes
and CPU seconds per tab, and the overview's, which is the page's first paint after diagnosis).
With ``--sections RUN``, it times the report's loss-scale and runtime sections of that run
(after loading and diagnosing it; CPU seconds, peak RSS), split into the derived store's
check and each section, and says whether their results were kept from an earlier report
(``derived/results/``: warm) or computed now (cold); run it twice for both.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd


def synthetic_steps(ranks: int, steps: int, seed: int = 0) -> pd.DataFrame:
    """Every rank 10 ms a step (5 % noise), scale 65536; rank 37 % ranks 3x slower, the rank
    before the last halving its scale for one step in the middle."""
    rng = np.random.default_rng(seed)
    slow, drop, at = 37 % ranks, ranks - 2 if ranks > 1 else 0, steps // 2
    rank = np.repeat(np.arange(ranks), steps)
    step = np.tile(np.arange(steps), ranks)
    wall = 0.010 * (1 + 0.05 * rng.standard_normal(len(rank)))
    wall[rank == slow] *= 3
    scale = np.full(len(rank), 65536.0)
    scale[(rank == drop) & (step == at)] = 32768.0
    return pd.DataFrame(
        {
            "rank": rank,
            "step": step,
            "wall_s": wall,
            "probe_s": np.full(len(rank), 1e-4),
            "data_wait_s": np.full(len(rank), 2e-4),
            "scaler_enabled": True,
            "scale_before": scale,
            "scale_after": scale,
            "skipped": False,
            "loss": 2.0 - step / steps + 0.05 * rng.standard_normal(len(rank)),
            "loss_nonfinite": False,
        }
    )


def _timed(make: Any) -> tuple[int, float]:
    start = time.process_time()
    fig = make()
    return len(fig.to_json()), time.process_time() - start


def bench_synthetic(ranks: list[int], steps: int) -> None:
    from amprobe.report.ranks import make_rank_heatmap_figure, make_ranks_figure
    from amprobe.report.runtime import make_runtime_figure
    from amprobe.report.scale import make_loss_scale_figure
    from dashboard.figures import make_step_time_figure

    for n in ranks:
        frame = synthetic_steps(n, steps)
        figures = {
            "loss scale": lambda f=frame: make_loss_scale_figure(f),
            "step time": lambda f=frame: make_step_time_figure(f),
            "runtime": lambda f=frame: make_runtime_figure(f, pd.DataFrame()),
            "ranks": lambda f=frame: make_ranks_figure(f),
            "rank x step heatmap": lambda f=frame: make_rank_heatmap_figure(f, "wall_s"),
        }
        parts = []
        for name, make in figures.items():
            size, cpu = _timed(make)
            parts.append(f"{name} {size / 1e3:,.0f} KB {cpu:.2f} s")
        print(f"{n:6,} ranks x {steps:,} steps: " + "; ".join(parts), flush=True)


def bench_run(path: Path) -> None:
    from dash import dcc
    from dash._utils import to_json

    import amprobe
    from dashboard.layout import RunQuery, build_run_page, build_tab_body, run_tabs
    from dashboard.runs import LoadedRun

    def graphs(component: Any, out: list[Any]) -> list[Any]:
        if isinstance(component, dcc.Graph):
            out.append(component.figure)
        children = getattr(component, "children", None)
        for child in children if isinstance(children, (list, tuple)) else [children]:
            if hasattr(child, "to_plotly_json"):
                graphs(child, out)
        return out

    start = time.process_time()
    run = amprobe.load_run(path)
    loaded = LoadedRun(path.name, run, amprobe.diagnose(run))
    diagnosed = time.process_time()
    page = build_run_page(loaded, 5000, RunQuery())
    print(
        f"{path}: load + diagnose {diagnosed - start:.2f} s CPU; the overview (first paint) "
        f"{time.process_time() - diagnosed:.2f} s CPU, {len(to_json(page)):,} bytes"
    )
    for key, label in run_tabs()[1:]:
        start = time.process_time()
        body = build_tab_body(loaded, RunQuery(tab=key))
        cpu = time.process_time() - start
        sizes = [len(f.to_json()) for f in graphs(body, []) if f is not None]
        print(f"  {label:18s} {cpu:6.2f} s CPU; figures {sum(sizes):>11,} bytes {sizes}")


def bench_sections(path: Path) -> None:
    import resource

    import amprobe
    from amprobe.report.runtime import build_runtime_section
    from amprobe.report.scale import build_scale_section, many_relations

    run = amprobe.load_run(path)
    diagnosis = amprobe.diagnose(run)
    start = time.process_time()
    import amprobe.store.derived as derived  # duckdb: paid once by whoever reads the store

    imported = time.process_time()
    rels = many_relations(run)
    checked = time.process_time()
    results = rels.get("results")
    kept = bool(results is not None and results.folder.is_dir() and any(results.folder.iterdir()))
    times = []
    for name, build in (("loss scale", build_scale_section), ("runtime", build_runtime_section)):
        begin = time.process_time()
        section = build(run, diagnosis)
        times.append(f"{name} {time.process_time() - begin:.2f} s ({len(section.figures)} fig)")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(
        f"{path} ({'warm: results kept' if kept else 'cold: results computed'}): import "
        f"duckdb {imported - start:.2f} s, store check {checked - imported:.2f} s; "
        + "; ".join(times)
        + f" CPU; peak RSS {rss:.2f} GB (with load and diagnose); {derived.RESULTS_DIR}/"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--run", type=Path, help="a recorded run: build its run page's tabs")
    parser.add_argument(
        "--sections", type=Path, help="a recorded run: time its loss-scale and runtime sections"
    )
    args = parser.parse_args()
    if args.sections:
        bench_sections(args.sections)
        return
    bench_synthetic(args.ranks, args.steps)
    if args.run:
        bench_run(args.run)


if __name__ == "__main__":
    main()
