"""A DDP job on CPU (gloo) for the sampling agreement tests (tests/test_sample_agreement.py).

Environment: STEPS (500), SLEEP_MS (each rank's step sleeps this long, so that a step costs a
few ms as a real one would), SLOW_RANK and SLOW (that rank's sleep is SLOW times longer, half
before its forward and half after its backward: it reaches the step boundary late), INJECT_RANK
and INJECT_STEP (an inf in that rank's batch at that step: the GradScaler skips the update on
every rank, the gradients being all-reduced). SCHED_OUT: the run directory amprobe records into
(attached in each rank with the default configuration: every sampling collector, the default
budget).
"""

import os
import time

import torch
import torch.distributed as dist
from torch import nn

import amprobe

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
sleep = float(os.environ.get("SLEEP_MS", 4)) / 1e3
if str(rank) == os.environ.get("SLOW_RANK"):
    sleep *= float(os.environ.get("SLOW", 3))
inject = (int(os.environ.get("INJECT_RANK", -1)), int(os.environ.get("INJECT_STEP", -1)))
gen = torch.Generator().manual_seed(rank)
with amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=os.environ["SCHED_OUT"]):
    for step in range(int(os.environ.get("STEPS", 500))):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        if (rank, step) == inject:
            x[0, 0] = float("inf")
        time.sleep(sleep / 2)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        time.sleep(sleep / 2)  # after the all-reduce: a slow rank ends its step late
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
dist.destroy_process_group()
