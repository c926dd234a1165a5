"""Overhead of the compute collector on the small CPU transformer (bf16 autocast).

Run: ``python benchmarks/bench_compute.py``. Prints median per-step CPU time and the ratio
probe/plain for: the default probe, the default probe plus the ``compute`` collector with its
default schedule (a capture at step 1, then every ``shapes_every`` steps, ``shapes_captures``
in all), and a capture on every step (the price of one captured step). All configurations are
measured side by side in one process (see ``common.compare``).
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
        return amprobe.attach(
            model=model, optimizer=opt, scaler=scaler, run_dir=run_dir, config=config
        )

    return start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="steps per block")
    parser.add_argument(
        "--run-steps",
        type=int,
        default=1000,
        help="run length for the amortized estimate of the default schedule",
    )
    args = parser.parse_args()
    compute = ("scaler", "compute")
    medians = compare(
        {
            "off": None,
            "amprobe default": attach_with(),
            "+ compute (default)": attach_with({"collectors": compute}),
            "+ compute every step": attach_with(
                {"collectors": compute, "shapes_every": 1, "shapes_captures": 0}
            ),
        },
        dtype=torch.bfloat16,
        blocks=args.blocks,
        steps_per_block=args.steps,
    )
    print_table(medians)
    cfg = amprobe.Config()
    capture = medians["+ compute every step"] / medians["off"]
    base = medians["+ compute (default)"] / medians["off"]
    captures = min(
        cfg.shapes_captures or args.run_steps, 1 + (args.run_steps - 2) // cfg.shapes_every
    )
    amortized = base + (capture - 1.0) * captures / args.run_steps
    print(
        f"\ncaptured step costs {capture:.2f}x a plain step; default schedule captures {captures} of "
        f"{args.run_steps} steps -> amortized ratio {amortized:.3f}"
    )


if __name__ == "__main__":
    main()
