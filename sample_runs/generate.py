"""Regenerate the golden sample runs: ``python sample_runs/generate.py``.

Each scenario is the embedded demo model with different planted faults, recorded on CPU.
Tests (tests/test_sample_runs.py) diagnose these directories and check the findings.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from amprobe.demo import train

HERE = Path(__file__).resolve().parent

#: name -> (description, train() keyword arguments)
SCENARIOS: dict[str, tuple[str, dict]] = {
    "healthy": (
        "fp16 autocast + GradScaler used correctly (unscale_ before clipping), no fault",
        {"faults": (), "steps": 150, "init_scale": 2.0**10, "growth_interval": 2000},
    ),
    "overflow": (
        "fp16: a layer overflows for 40 steps; every such step is skipped and the scale collapses",
        {"faults": ("overflow",), "steps": 200},
    ),
    "misuse": (
        "fp16: clipping before unscale_, a GradScaler rebuilt in the loop, a resume that "
        "does not restore the scaler, and the loss computed in fp16",
        {
            "faults": (
                "clip_before_unscale",
                "scaler_in_loop",
                "resume_without_scaler",
                "half_loss",
            ),
            "steps": 120,
        },
    ),
    "bf16": (
        "bf16 autocast with a (needless) GradScaler",
        {"faults": (), "steps": 100, "dtype": torch.bfloat16},
    ),
    "fp8-whatif": (
        "bf16 autocast without a GradScaler, per-layer numerics every 10 steps; proj has an "
        "outlier output channel 2**12 times larger than the others: embed and head fit fp8 "
        "with per-tensor scaling (AMP-P01), proj's activations do not (AMP-P02)",
        {
            "faults": ("outlier_channel",),
            "steps": 60,
            "dtype": torch.bfloat16,
            "use_scaler": False,
            "config": {"numerics_every": 10},
        },
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "names", nargs="*", default=sorted(SCENARIOS), help="scenarios to regenerate"
    )
    parser.add_argument("--device", default="cpu", help="cpu (the golden runs) or cuda")
    parser.add_argument(
        "--out", default=None, help="folder for the runs (default: next to this script)"
    )
    parser.add_argument(
        "--prefix", default="", help="prefix for the run folders, e.g. h200- for a GPU recording"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    root = Path(args.out) if args.out else HERE
    for name in args.names:
        description, kwargs = SCENARIOS[name]
        kwargs = dict(kwargs)
        config = {"flush_every": 50, **kwargs.pop("config", {})}
        target = root / f"{args.prefix}{name}"
        if target.exists():
            shutil.rmtree(target)
        train(target, device=device, config=config, **kwargs)
        origin = f" Recorded on {device}" + (
            f" ({torch.cuda.get_device_name(device)})." if device.type == "cuda" else "."
        )
        (target / "README.txt").write_text(
            f"{name}: {description}.{origin}\n"
            f"Regenerate: python sample_runs/generate.py {name} --device {device.type}\n"
        )
        print(f"recorded {target}")


if __name__ == "__main__":
    main()
