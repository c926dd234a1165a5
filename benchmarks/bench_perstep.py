"""amprobe's host cost per training step, in microseconds, on a loop too small to hide it.

Run: ``python benchmarks/bench_perstep.py [--pairs 5] [--steps 1500] [--warmup 300]``.

The loop is issue #20's: a tiny MLP under CPU fp16 autocast with ``GradScaler("cpu")`` (a step
is about a millisecond), so what amprobe adds per step is not hidden by the model's own work, as
on a launch-bound job on a fast GPU. Each measurement is a fresh process: it builds the loop,
optionally attaches amprobe (``attach(model, optimizer, scaler)``, the default configuration, or
``dormant=True``), runs ``--warmup`` steps untimed, then times ``--steps`` steps: every step of the
default schedule is included (sampled numerics steps, shape captures, sync-counting steps, flushes
and the always-on path), so the figure is the amortized cost. Plain and probed processes
alternate; the cost is the median over pairs of (probed - plain) per step, in wall time and in
the training thread's CPU time. The CPU model is printed beside the figures.

Targets (issue #20): <= 100 us per step amortized with the default configuration, <= 20 us for a
dormant probe.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

MODES = {
    "plain": None,
    "default": {},
    "dormant": {"dormant": True},
}


def worker(mode: str, steps: int, warmup: int, run_dir: str) -> dict[str, float]:
    """One measurement in this process: per-step wall and thread-CPU microseconds."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    probe = None
    config = MODES[mode]
    if config is not None:
        import amprobe

        probe = amprobe.attach(
            model=model, optimizer=opt, scaler=scaler, run_dir=run_dir, config=config
        )

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        step()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    if probe is not None:
        probe.close()
    return {"wall_us": wall / steps * 1e6, "cpu_us": cpu / steps * 1e6}


def measure(mode: str, steps: int, warmup: int, tmp: str, index: int) -> dict[str, float]:
    run_dir = os.path.join(tmp, f"{mode}-{index}")
    out = subprocess.run(
        [sys.executable, __file__, "--worker", mode, "--steps", str(steps)]
        + ["--warmup", str(warmup), "--run-dir", run_dir],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1500, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--modes", default="default,dormant", help="probed modes, comma-separated")
    parser.add_argument("--worker", choices=sorted(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.warmup, args.run_dir)))
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); python {sys.version.split()[0]}")
    print(
        f"tiny MLP, fp16 autocast + GradScaler('cpu'), {args.warmup} warm-up + {args.steps} "
        f"timed steps per fresh process, {args.pairs} alternating pairs per mode"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            plain, probed, wall, cpu = [], [], [], []
            for i in range(args.pairs):
                order = ("plain", mode) if i % 2 == 0 else (mode, "plain")
                got = {m: measure(m, args.steps, args.warmup, tmp, i) for m in order}
                plain.append(got["plain"]["wall_us"])
                probed.append(got[mode]["wall_us"])
                wall.append(got[mode]["wall_us"] - got["plain"]["wall_us"])
                cpu.append(got[mode]["cpu_us"] - got["plain"]["cpu_us"])
            print(
                f"{mode:>8}: plain {statistics.median(plain):7.1f} us/step, probed "
                f"{statistics.median(probed):7.1f} us/step; added per step (median of pairs): "
                f"wall {statistics.median(wall):+7.1f} us, thread CPU "
                f"{statistics.median(cpu):+7.1f} us  [pairs: "
                + ", ".join(f"{w:+.0f}" for w in wall)
                + "]"
            )


if __name__ == "__main__":
    main()
