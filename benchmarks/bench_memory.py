"""Resource bounds: probe memory (RSS) over a long run, and run-directory growth per 1,000 steps.

Run: ``python benchmarks/bench_memory.py [--steps 20000]``. Trains a tiny model (so the probe's
own memory dominates any growth) with the default probe, printing RSS every 2,000 steps and the
bytes per step of each record file.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import amprobe


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--config", default="{}", help="probe config as JSON")
    args = parser.parse_args()
    import json

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        probe = amprobe.attach(
            model=model,
            optimizer=opt,
            scaler=scaler,
            run_dir=run_dir,
            config=json.loads(args.config),
        )
        t0 = time.perf_counter()
        print(f"{'step':>8}{'RSS MiB':>10}")
        for i in range(args.steps):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if i % 2000 == 0 or i == args.steps - 1:
                print(f"{i:>8}{rss_mib():>10.1f}", flush=True)
        probe.close()
        elapsed = time.perf_counter() - t0
        print(f"\n{args.steps} steps in {elapsed:.1f} s")
        total = 0
        for path in sorted((run_dir / "rank0").iterdir()):
            size = path.stat().st_size
            total += size
            print(f"{path.name:<20}{size:>12,} bytes  {size / args.steps:8.1f} bytes/step")
        print(
            f"{'run directory':<20}{total:>12,} bytes  {total / args.steps * 1000 / 1024:8.1f} KiB per 1,000 steps"
        )


if __name__ == "__main__":
    main()
