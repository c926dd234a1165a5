"""Probe overhead on a small CPU transformer: plain training vs amprobe attached.

Run: ``python benchmarks/bench_overhead.py``. Prints median per-step CPU time and the ratio
probe/plain, all configurations measured side by side in one process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import compare, print_table  # noqa: E402

import amprobe  # noqa: E402


def attach_with(config: dict | None = None):
    def start(model, opt, scaler, run_dir):
        return amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=run_dir, config=config)
    return start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8, help="steps per block")
    parser.add_argument("--fp16", action="store_true",
                        help="also measure fp16 + GradScaler (CPU fp16 matmuls are ~30x slower)")
    args = parser.parse_args()
    setups = [("bf16 autocast", torch.bfloat16, False), ("bf16 autocast + GradScaler", torch.bfloat16, True)]
    if args.fp16:
        setups.append(("fp16 + GradScaler", torch.float16, True))
    for label, dtype, scaler in setups:
        print(f"\n== {label} ==")
        medians = compare(
            {"off": None, "amprobe default": attach_with()},
            dtype=dtype, use_scaler=scaler, blocks=args.blocks, steps_per_block=args.steps,
        )
        print_table(medians)


if __name__ == "__main__":
    main()
