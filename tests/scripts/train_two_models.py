"""PyTorch's AMP examples recipe "Working with Multiple Models, Losses, and Optimizers".

Two unnamed ``nn.Sequential`` models, two losses, two optimizers, one GradScaler. The second
model's first layer multiplies its output by 1e6 at training calls 3 and 4 (an fp16 overflow planted in
the second model only). Widths: model0 16-32-4 (676 parameters), model1 16-24-4 (508).

Usage: python train_two_models.py STEPS
"""

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _planted import PlantedLinear  # noqa: E402

steps = int(sys.argv[1])
torch.manual_seed(0)
model0 = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
model1 = nn.Sequential(
    PlantedLinear(16, 1e6, at=[3, 4], out_features=24), nn.ReLU(), nn.Linear(24, 4)
)
optimizer0 = torch.optim.SGD(model0.parameters(), lr=0.01)
optimizer1 = torch.optim.SGD(model1.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
loss_fn = nn.MSELoss()
for _ in range(steps):
    x, target = torch.randn(8, 16), torch.randn(8, 4)
    optimizer0.zero_grad()
    optimizer1.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        output0 = model0(x)
        output1 = model1(x)
        loss0 = loss_fn(2 * output0 + 3 * output1, target)
        loss1 = loss_fn(3 * output0 - 5 * output1, target)
    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()
    scaler.unscale_(optimizer0)
    scaler.step(optimizer0)
    scaler.step(optimizer1)
    scaler.update()
print(f"trained {steps} steps", flush=True)
