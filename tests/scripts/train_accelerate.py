"""An accelerate loop on a tiny MLP with random data, CPU (zero-code tests, benchmarks).

Usage: python train_accelerate.py [--precision no|bf16|fp16|fp16-manual] [--steps N] [--accum K]
[--attach RUN_DIR] [--width W] [--batch B]
fp16-manual: accelerate without mixed precision, and the loop's own torch.autocast(float16) with
GradScaler("cpu") around the prepared optimizer (accelerate itself refuses fp16 on a CPU).
--attach calls amprobe.attach(run_dir=RUN_DIR) with nothing else before accelerate prepares
anything. Prints one "micro_loss <value>" line per micro-batch and "train_time cpu_s=...
wall_s=..." (process CPU and wall time of the training loop).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from accelerate import Accelerator
from torch import nn


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--precision", default="bf16")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--attach", default=None)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--quiet", action="store_true", help="no micro_loss lines (benchmarks)")
    a = p.parse_args(argv)
    probe = None
    if a.attach:
        import amprobe

        probe = amprobe.attach(run_dir=a.attach)
    torch.manual_seed(0)
    manual = a.precision == "fp16-manual"
    accelerator = Accelerator(
        cpu=True,
        mixed_precision="no" if manual else a.precision,
        gradient_accumulation_steps=a.accum,
    )
    model = nn.Sequential(
        nn.Linear(16, a.width), nn.ReLU(), nn.Linear(a.width, a.width), nn.Linear(a.width, 4)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    n = a.steps * a.accum * a.batch
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(
        torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)
    )
    loader = torch.utils.data.DataLoader(ds, batch_size=a.batch)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if manual else None
    cpu, wall = time.process_time(), time.perf_counter()
    for x, y in loader:
        with accelerator.accumulate(model):
            region = (
                torch.autocast("cpu", dtype=torch.float16) if manual else contextlib.nullcontext()
            )
            with region:
                loss = nn.functional.mse_loss(model(x).float(), y)
            if not a.quiet:
                print(f"micro_loss {float(loss.detach())!r}")
            if scaler is not None:
                accelerator.backward(scaler.scale(loss))
                if accelerator.sync_gradients:
                    scaler.step(opt)
                    scaler.update()
            else:
                accelerator.backward(loss)
                opt.step()
            opt.zero_grad()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if probe is not None:
        probe.close()
    print(f"train_time cpu_s={cpu:.6f} wall_s={wall:.6f}")
    print(f"trained {a.steps} steps", flush=True)


if __name__ == "__main__":
    main()
