"""Probe overhead on an accelerator, timed in wall-clock per block (for a GPU session).

Run: ``python benchmarks/bench_overhead_device.py --device cuda`` (``--device cpu`` runs the same
code path here). TinyGPT scaled up (``--width``) trained with bf16 autocast (or fp16 +
GradScaler with ``--fp16``); probe off, default and full detail alternate in blocks; each block is
timed from a device synchronize to a device synchronize, so the probe's deferred device work
(its read-backs at flush) is inside the timed span. Prints mean step time per configuration and
the ratio to plain training.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import TinyGPT, make_batch  # noqa: E402

import amprobe  # noqa: E402

FULL = {"numerics_every": 1, "shapes_every": 1, "shapes_captures": 0, "syncs_every": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=1024, help="model width d (layers: 8)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="steps per block")
    parser.add_argument("--fp16", action="store_true", help="fp16 autocast + GradScaler")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu, or on a GPU machine")
    torch.manual_seed(0)
    model = TinyGPT(d=args.width, heads=max(1, args.width // 64), layers=8).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    dtype = torch.float16 if args.fp16 else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type) if args.fp16 else None
    x, y = (t.to(device) for t in make_batch(batch=args.batch))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def block(n: int) -> float:
        sync()
        t = time.perf_counter()
        for _ in range(n):
            with torch.autocast(device.type, dtype=dtype):
                loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        return (time.perf_counter() - t) / n

    block(10)
    configs = {"off": None, "amprobe default": {}, "amprobe full detail": FULL}
    times: dict[str, list[float]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for b in range(args.blocks):
            for name, config in configs.items():
                probe = None
                if config is not None:
                    probe = amprobe.attach(
                        model=model,
                        optimizer=opt,
                        scaler=scaler,
                        run_dir=f"{tmp}/{b}-{len(times[name])}-{name.replace(' ', '_')}",
                        config=config,
                    )
                try:
                    times[name].append(block(args.steps))
                finally:
                    if probe is not None:
                        probe.close()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{time.strftime('%Y-%m-%d')} {name}, torch {torch.__version__}, d={args.width}, "
        f"batch {args.batch}x128, {'fp16+GradScaler' if args.fp16 else 'bf16'}, "
        f"{args.blocks}x{args.steps} steps per configuration"
    )
    base = statistics.fmean(times["off"])
    print(f"| {'configuration':<22} | mean step (ms) | ratio |")
    print(f"|{'-' * 24}|----------------|-------|")
    for key, values in times.items():
        mean = statistics.fmean(values)
        print(f"| {key:<22} | {mean * 1e3:>14.2f} | {mean / base:>5.3f} |")


if __name__ == "__main__":
    main()
