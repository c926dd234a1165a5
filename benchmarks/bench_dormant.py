"""Cost of a dormant probe on a small CPU transformer: plain training vs ``dormant=True``.

Run: ``python benchmarks/bench_dormant.py``. Prints median per-step CPU time of the training
thread and the ratio dormant/plain, measured side by side in one process (target: <= 1.005).
The dormant probe's control watcher runs on its own thread (one ``stat`` per 0.5 s); its CPU
time is not in the training thread's time, and is negligible by construction.

Percent-level ratios on a shared machine are within noise, so the script also measures the
dormant probe's absolute added CPU time per step on a tiny model (where the probe's fixed
per-step cost is not hidden by the matmuls) and prints the ratio that cost implies for the
transformer step: an upper-bound estimate that does not depend on timing noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import compare, print_table  # noqa: E402

import amprobe  # noqa: E402


def attach_with(config: dict | None = None):
    def start(model, opt, scaler, run_dir):
        return amprobe.attach(
            model=model, optimizer=opt, scaler=scaler, run_dir=run_dir, config=config
        )

    return start


def added_cost_per_step(use_scaler: bool, steps: int = 400, rounds: int = 7) -> float:
    """Median extra training-thread CPU seconds per step of a dormant probe, on a tiny model."""
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if use_scaler else None
    x = torch.randn(4, 8)

    def run(n: int) -> float:
        t = time.thread_time()
        for _ in range(n):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().sum()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.thread_time() - t) / n

    run(50)
    diffs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            plain = run(steps)
            probe = amprobe.attach(
                model=model,
                optimizer=opt,
                scaler=scaler,
                run_dir=f"{tmp}/{i}",
                config={"dormant": True},
            )
            try:
                run(5)  # first dormant step announces the rank (writes its manifest)
                dormant = run(steps)
            finally:
                probe.close()
            diffs.append(dormant - plain)
    return statistics.median(diffs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=8, help="steps per block")
    parser.add_argument(
        "--scaler", action="store_true", help="also measure bf16 autocast + GradScaler"
    )
    parser.add_argument(
        "--recording", action="store_true", help="also measure the default (recording) probe"
    )
    args = parser.parse_args()
    setups = [("bf16 autocast", torch.bfloat16, False)]
    if args.scaler:
        setups.append(("bf16 autocast + GradScaler", torch.bfloat16, True))
    configs = {"off": None, "amprobe dormant": attach_with({"dormant": True})}
    if args.recording:
        configs["amprobe recording"] = attach_with()
    for label, dtype, scaler in setups:
        print(f"\n== {label} ==")
        medians = compare(
            configs, dtype=dtype, use_scaler=scaler, blocks=args.blocks, steps_per_block=args.steps
        )
        print_table(medians)
        added = added_cost_per_step(scaler)
        print(
            f"dormant probe's added CPU per step (tiny model): {added * 1e6:.1f} us "
            f"-> implied ratio on this transformer step: {1 + added / medians['off']:.5f}"
        )


if __name__ == "__main__":
    main()
