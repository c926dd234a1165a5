"""Overhead of amprobe on a compiled transformer: step CPU time, probe on vs off, side by side.

Usage: ``python benchmarks/bench_compile.py [--backend inductor|aot_eager] [--blocks N]
[--steps N]``, or ``--fresh N`` for N alternating pairs of fresh processes in which amprobe
attaches before the first compiled call (so its in-graph statistics hooks are compiled in, as
under ``amprobe run``), or ``--sampled N`` for N fresh processes so attached with per-layer
numerics on every other step (``numerics_every=2``, numerics only): the median step CPU time of
sampled and of unsampled steps (the first 4 steps left out) and their ratio, the cost of a
sampled step of a compiled model (in-graph statistics, gradient taps, parameter gradients).

The benchmark's TinyGPT (4 layers, d=256) is wrapped in ``torch.compile`` and warmed up (its
graphs compiled) before any timing; then blocks of plain steps and of steps with
``amprobe.attach(model=compiled, ...)`` in the default configuration alternate (the order
reversed every other block), each block long enough to include the sampled steps (numerics
every 100, sync counting every 50, shape capture). It prints the CPU model, the median and mean
step CPU time of each configuration and their ratios, and checks that the probed blocks ran the
compiled graph on every step (a counting backend wrapper) and compiled nothing new.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "scripts"))
from common import TinyGPT, make_batch, train_steps  # noqa: E402
from machine import cpu_model  # noqa: E402
from train_compiled import CALLS, counting  # noqa: E402  (the tests' counting backend)

import amprobe  # noqa: E402


def one_job(backend: str, job: str, steps: int) -> None:
    """A fresh process's job (``--job``): attach (or not) before the first compiled call, so
    the in-graph statistics hooks are compiled in; prints one JSON line with the step times
    (``sampled``: every step, and whether per-layer numerics sampled it)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT()
    compiled = torch.compile(model, backend=counting(backend))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {"numerics_every": 2, "collectors": ["numerics"]} if job == "sampled" else None
    sampled: list[bool] = []
    with tempfile.TemporaryDirectory() as tmp:
        probe = None
        if job != "off":
            probe = amprobe.attach(
                model=compiled, optimizer=opt, run_dir=tmp + "/run", config=config
            )
        times = train_steps(compiled, opt, None, torch.bfloat16, make_batch(), steps + 3)
        if probe is not None:
            probe.close()
        if job == "sampled":
            sampled = [bool(v) for v in amprobe.load_run(tmp + "/run").steps["numerics_sampled"]]
        else:
            times = times[3:]
    from torch._dynamo.utils import counters

    out = {"times": times, "calls": CALLS["graph_calls"], "frames": counters["frames"]["total"]}
    print(json.dumps({**out, "sampled": sampled}))


def sampled_steps(backend: str, runs: int, steps: int) -> None:
    """Fresh processes with numerics on every other step: sampled / unsampled step time."""
    ratios = []
    for run in range(runs):
        argv = [sys.executable, __file__, "--job", "sampled", "--backend", backend]
        out = subprocess.run(
            [*argv, "--steps", str(steps)], capture_output=True, text=True, check=True
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        pairs = list(zip(result["times"], result["sampled"], strict=True))[4:]
        on = statistics.median(t for t, s in pairs if s)
        off = statistics.median(t for t, s in pairs if not s)
        ratios.append(on / off)
        print(
            f"run {run}: sampled {on * 1e3:.1f} ms, unsampled {off * 1e3:.1f} ms, ratio "
            f"{ratios[-1]:.3f} ({sum(s for _, s in pairs)} / {len(pairs)} steps sampled); graph "
            f"calls {result['calls']} in {len(result['times'])} steps, frames compiled "
            f"{result['frames']}"
        )
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; 1 intra-op thread; {backend}")
    print(f"median ratio (step CPU time, sampled / unsampled): {statistics.median(ratios):.3f}")


def fresh(backend: str, pairs: int, steps: int) -> None:
    """Alternating fresh processes, plain and probed from the start; median of pair ratios."""
    ratios, medians = [], {"off": [], "amprobe": []}
    for pair in range(pairs):
        order = ["off", "amprobe"] if pair % 2 == 0 else ["amprobe", "off"]
        result = {}
        for name in order:
            argv = [sys.executable, __file__, "--job", name, "--backend", backend]
            out = subprocess.run(
                [*argv, "--steps", str(steps)], capture_output=True, text=True, check=True
            )
            result[name] = json.loads(out.stdout.strip().splitlines()[-1])
            medians[name].append(statistics.median(result[name]["times"]))
        ratios.append(medians["amprobe"][-1] / medians["off"][-1])
        print(
            f"pair {pair}: off {medians['off'][-1] * 1e3:.1f} ms, amprobe "
            f"{medians['amprobe'][-1] * 1e3:.1f} ms, ratio {ratios[-1]:.3f}; graph calls "
            f"{result['off']['calls']} / {result['amprobe']['calls']}, frames compiled "
            f"{result['off']['frames']} / {result['amprobe']['frames']}"
        )
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; 1 intra-op thread; {backend}")
    print(f"median of pair ratios (step CPU time, amprobe / off): {statistics.median(ratios):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100, help="steps per block")
    ap.add_argument("--fresh", type=int, default=0, help="N alternating pairs of fresh processes")
    ap.add_argument("--sampled", type=int, default=0, help="N fresh processes, numerics every 2")
    ap.add_argument("--job", choices=["off", "amprobe", "sampled"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        return one_job(args.backend, args.job, args.steps)
    if args.fresh:
        return fresh(args.backend, args.fresh, args.steps)
    if args.sampled:
        return sampled_steps(args.backend, args.sampled, args.steps)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT()
    compiled = torch.compile(model, backend=counting(args.backend))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = make_batch()
    t0 = time.perf_counter()
    train_steps(compiled, opt, None, torch.bfloat16, batch, 3)
    print(f"compile + 3 warm-up steps: {time.perf_counter() - t0:.1f} s ({args.backend})")
    from torch._dynamo.utils import counters

    frames0 = counters["frames"]["total"]
    samples: dict[str, list[float]] = {"off": [], "amprobe": []}
    calls: dict[str, list[int]] = {"off": [], "amprobe": []}
    with tempfile.TemporaryDirectory() as tmp:
        for block in range(args.blocks):
            order = ["off", "amprobe"] if block % 2 == 0 else ["amprobe", "off"]
            for name in order:
                probe = None
                if name == "amprobe":
                    probe = amprobe.attach(
                        model=compiled, optimizer=opt, run_dir=f"{tmp}/run-{block}"
                    )
                before = CALLS["graph_calls"]
                try:
                    samples[name].extend(
                        train_steps(compiled, opt, None, torch.bfloat16, batch, args.steps)
                    )
                finally:
                    if probe is not None:
                        probe.close()
                calls[name].append(CALLS["graph_calls"] - before)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; 1 intra-op thread")
    print(
        f"{'configuration':<14}{'median ms':>12}{'mean ms':>12}{'ratio (median)':>16}"
        f"{'ratio (mean)':>14}"
    )
    base_med = statistics.median(samples["off"])
    base_mean = statistics.fmean(samples["off"])
    for name, values in samples.items():
        med, mean = statistics.median(values), statistics.fmean(values)
        print(
            f"{name:<14}{med * 1e3:>12.2f}{mean * 1e3:>12.2f}{med / base_med:>16.3f}"
            f"{mean / base_mean:>14.3f}"
        )
    print(f"compiled-graph calls per block: off {calls['off']}, amprobe {calls['amprobe']}")
    print(f"frames compiled during timing: {counters['frames']['total'] - frames0}")


if __name__ == "__main__":
    main()
