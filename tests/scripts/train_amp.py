"""A plain training script written without amprobe in mind (used by the zero-code tests).

Usage: python train_amp.py MODE STEPS [extra]
MODE: fp16 (autocast + GradScaler, inf planted at step 3), bf16, fp32, crash (raises at step 4),
      attach (calls amprobe.attach itself), dataloader (fp16 with a 2-worker DataLoader),
      nomodel (a bare parameter tensor and SGD: no nn.Module, no scaler, no autocast).
"""

import sys

import torch
from torch import nn

mode, steps = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
if mode == "nomodel":
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(steps):
        loss = (w - 1).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"trained {steps} steps", flush=True)
    sys.exit(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
dtype = {"bf16": torch.bfloat16, "fp32": None}.get(mode, torch.float16)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if dtype == torch.float16 else None
if mode == "attach":
    import amprobe

    probe = amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=sys.argv[3])


def batches():
    if mode == "dataloader":
        data = torch.utils.data.TensorDataset(torch.randn(steps * 8, 16), torch.randn(steps * 8, 4))
        yield from torch.utils.data.DataLoader(data, batch_size=8, num_workers=2)
    else:
        for _ in range(steps):
            yield torch.randn(8, 16), torch.randn(8, 4)


for i, (x, y) in enumerate(batches()):
    if i == 3 and scaler is not None:
        x[0, 0] = float("inf")
    if mode == "crash" and i == 4:
        raise RuntimeError("planted crash")
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = nn.functional.mse_loss(model(x).float(), y)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad()
print(f"trained {steps} steps", flush=True)
