"""A DDP job on CPU (gloo) for the sampling agreement tests (tests/test_sample_agreement.py).

Environment: STEPS (500), SLEEP_MS (each rank's step sleeps this long, so that a step costs a
few ms as a real one would: half before the forward, half after the backward), SLOW_RANK and
SLOW (that rank's step is SLOW times longer, all of it before its forward: the other ranks wait
for it at the all-reduce, which hides what their own samples cost them), INJECT_RANK
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
before = after = sleep / 2
if str(rank) == os.environ.get("SLOW_RANK"):
    before, after = sleep * float(os.environ.get("SLOW", 3)) - after, after
inject = (int(os.environ.get("INJECT_RANK", -1)), int(os.environ.get("INJECT_STEP", -1)))
gen = torch.Generator().manual_seed(rank)
with amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=os.environ["SCHED_OUT"]):
    for step in range(int(os.environ.get("STEPS", 500))):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        if (rank, step) == inject:
            x[0, 0] = float("inf")
        time.sleep(before)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        time.sleep(after)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
dist.destroy_process_group()
