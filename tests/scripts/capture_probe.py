"""A plain training loop for the capture-core tests, run under `amprobe run`.

argv: STEPS [--import-amprobe-first]. Each step calls `.item()` six times (host syncs) and
prints one JSON line with amprobe's dispatch-mode stack as the job sees it.
"""

import json
import sys

if "--import-amprobe-first" in sys.argv:
    import amprobe  # noqa: F401  (before torch: the automatic probe must still attach)

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

steps = int(sys.argv[1])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
for step in range(steps):
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    for _ in range(6):
        loss.item()  # six host syncs per step, from this line
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    modes = [type(m).__name__ for m in _get_current_dispatch_mode_stack()]
    print(json.dumps({"step": step, "modes": modes}), flush=True)
print("done", flush=True)
