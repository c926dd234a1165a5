"""Overhead of per-layer numerics on the CPU TinyGPT benchmark (bf16 autocast).

Run: ``python benchmarks/bench_numerics.py``. Same timing method as ``common.compare`` (thread
CPU time, one intra-op thread, configurations interleaved in blocks after warm-up), but a
sampled collector makes a few steps expensive and the rest cheap, so a median hides its cost.
This benchmark therefore times sampled and unsampled steps separately and prints the
amortised ratio ``((every - 1) * median(unsampled) + median(sampled)) / every / median(off)``
next to the plain mean ratio of the steps it ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import TinyGPT, make_batch, train_steps  # noqa: E402

import amprobe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    args = parser.parse_args()
    default_every = amprobe.Config().numerics_every
    configs: dict[str, dict | None] = {
        "off": None,
        "scaler only": {"collectors": ["scaler"]},
        f"numerics default (every {default_every})": {"collectors": ["scaler", "numerics"]},
        "numerics every step": {"collectors": ["scaler", "numerics"], "numerics_every": 1},
    }
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = make_batch()
    train_steps(model, opt, None, torch.bfloat16, batch, 3)
    times: dict[str, list[tuple[float, bool]]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for block in range(args.blocks):
            for index, (name, cfg) in enumerate(configs.items()):
                probe = None
                if cfg is not None:
                    probe = amprobe.attach(
                        model, opt, None, run_dir=f"{tmp}/{block}-{index}", config=cfg
                    )
                every = (
                    (cfg or {}).get("numerics_every", default_every)
                    if cfg and "numerics" in cfg["collectors"]
                    else 0
                )
                try:
                    for i, t in enumerate(
                        train_steps(model, opt, None, torch.bfloat16, batch, args.steps)
                    ):
                        times[name].append((t, bool(every) and i % every == 0))
                finally:
                    if probe is not None:
                        probe.close()
    base = statistics.median(t for t, _ in times["off"])
    print(
        f"TinyGPT bf16 autocast, {args.blocks} blocks x {args.steps} steps, baseline {base * 1e3:.1f} ms CPU/step"
    )
    print(
        f"{'configuration':<34}{'unsampled ms':>14}{'sampled ms':>12}{'amortised':>11}{'mean ratio':>12}"
    )
    for name in configs:
        samples = times[name]
        plain = [t for t, s in samples if not s]
        sampled = [t for t, s in samples if s]
        every = 1 if name == "numerics every step" else default_every
        mu = statistics.median(plain) if plain else float("nan")
        ms = statistics.median(sampled) if sampled else float("nan")
        if sampled and plain:
            amortised = ((every - 1) * mu + ms) / every / base
        else:
            amortised = (ms if sampled else mu) / base
        mean_ratio = statistics.mean(t for t, _ in samples) / base
        print(f"{name:<34}{mu * 1e3:>14.1f}{ms * 1e3:>12.1f}{amortised:>11.3f}{mean_ratio:>12.3f}")


if __name__ == "__main__":
    main()
