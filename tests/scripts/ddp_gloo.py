"""A 2-rank DDP script on CPU (gloo); INIT_SCALE_R<rank> sets a rank's GradScaler init_scale."""

import os

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=float(os.environ.get(f"INIT_SCALE_R{rank}", 1024)))
for _ in range(int(os.environ.get("STEPS", 12))):
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
dist.destroy_process_group()
