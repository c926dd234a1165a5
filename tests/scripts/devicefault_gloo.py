"""2 DDP ranks on gloo, amprobe attached, the known-answer check on every boundary.

``FAULTY_RANK``: that rank's GEMM returns one wrong element (the device faked at the one
function that runs it); every rank gets a fake NVML identity naming its rank. ``OUT``: the run
directory; ``STEPS``: iterations.
"""

import os

import torch
import torch.distributed as dist
from torch import nn

import amprobe
from amprobe.capture.collectors import devicecheck

dist.init_process_group("gloo")
rank = dist.get_rank()
real_gemm = devicecheck.run_gemm


def wrong_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = real_gemm(a, b).clone()
    out[5, 7] += 1
    return out


if rank == int(os.environ.get("FAULTY_RANK", "-1")):
    devicecheck.run_gemm = wrong_gemm
devicecheck.device_identity = lambda device: {
    "device": f"cuda:{rank}",
    "gpu_name": "Fake GPU",
    "uuid": f"GPU-fake-{rank}",
    "pci_bus_id": f"00000000:{0x3B + rank:02X}:00.0",
    "serial": None,
    "source": "nvml",
    "note": None,
}
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
probe = amprobe.attach(
    model,
    opt,
    scaler,
    run_dir=os.environ["OUT"],
    config={"collectors": "scaler", "device_check_minutes": 1e-9, "replay": "off"},
)
for _ in range(int(os.environ.get("STEPS", 4))):
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
probe.close()
dist.destroy_process_group()
