"""Overhead of the runtime collector (step timing, data wait, sampled sync counting, NVML thread).

Run: ``python benchmarks/bench_runtime.py``. Prints, side by side in one process:

1. the harness's median per-step CPU time (``common.compare``) for plain training, amprobe's
   default config, and the default plus the ``runtime`` collector;
2. the mean per-step CPU time over longer attached stretches, which includes the sampled steps
   that run the sync-counting dispatch mode (one in ``syncs_every``): the amortized cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import TinyGPT, compare, make_batch, print_table, train_steps  # noqa: E402

import amprobe  # noqa: E402

RUNTIME = {"collectors": ("scaler", "runtime")}


def attach_with(config: dict | None = None):
    def start(model, opt, scaler, run_dir):
        return amprobe.attach(
            model=model, optimizer=opt, scaler=scaler, run_dir=run_dir, config=config
        )

    return start


def amortized(steps: int, rounds: int, config: dict) -> dict[str, float]:
    """Mean step CPU time over ``steps``-step attached stretches, interleaved with plain ones."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = make_batch()
    train_steps(model, opt, None, torch.bfloat16, batch, 3)
    samples: dict[str, list[float]] = {"off": [], "runtime": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            samples["off"] += train_steps(model, opt, None, torch.bfloat16, batch, steps)
            with amprobe.attach(model, opt, run_dir=f"{tmp}/{r}", config=config):
                samples["runtime"] += train_steps(model, opt, None, torch.bfloat16, batch, steps)
    return {name: statistics.fmean(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="steps per block")
    parser.add_argument("--amortized-steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print("== bf16 autocast, median step (harness) ==")
    medians = compare(
        {"off": None, "amprobe default": attach_with(), "default + runtime": attach_with(RUNTIME)},
        dtype=torch.bfloat16,
        blocks=args.blocks,
        steps_per_block=args.steps,
    )
    print_table(medians)
    print(
        f"\n== bf16 autocast, mean step over {args.amortized_steps}-step stretches "
        f"(sync counting on 1 step in {amprobe.Config().syncs_every}) =="
    )
    means = amortized(args.amortized_steps, args.rounds, RUNTIME)
    print_table(means)


if __name__ == "__main__":
    main()
