"""A long-running training job written without amprobe in mind (used by the dormant tests).

Usage: python train_dormant.py WEIGHTS_OUT STOP_FILE [STEPS]

fp16 autocast + GradScaler on CPU; an inf is planted in the input of every iteration i with
i % 7 == 3, so those iterations are skipped by the scaler (a recorded window can be checked
against the true iteration numbers). Trains until STOP_FILE exists (bounded: 20000 steps, and
60 s or the seconds in the environment's TRAIN_DORMANT_MAX_S), or exactly STEPS iterations when
given; then saves {"state": state_dict, "steps": n}.
"""

import os
import sys
import time

import torch
from torch import nn


def main(weights, stop_file, steps=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=5)
    deadline = time.monotonic() + float(os.environ.get("TRAIN_DORMANT_MAX_S", "60"))
    i = 0
    while (
        (i < steps)
        if steps is not None
        else (not os.path.exists(stop_file) and i < 20000 and time.monotonic() < deadline)
    ):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        if i % 7 == 3:
            x[0, 0] = float("inf")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        i += 1
        if steps is None:
            time.sleep(0.005)
    torch.save({"state": model.state_dict(), "steps": i}, weights)
    print(f"trained {i} steps", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
