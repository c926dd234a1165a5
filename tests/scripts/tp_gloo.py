"""A 2-rank tensor-parallel script on CPU (gloo): every Linear in the plan (all parameters are
DTensors), ``mlp.fc1`` ``ColwiseParallel`` and ``mlp.fc2`` ``RowwiseParallel`` (its output an
all-reduce whose result is an ``AsyncCollectiveTensor``), ``inp`` and ``head`` column-parallel
with replicated outputs. Both ranks train on the same batches, as tensor parallelism does.

Environment: ``DTYPE`` (``float16``: with ``GradScaler("cpu")``; ``bfloat16``: without) of
``torch.autocast("cpu")``; ``USE_LOCAL_OUTPUT`` (``1``/``0``) of every style; ``STEPS``;
``PLANT=a,b`` the steps on which ``mlp.fc2`` multiplies its input by ``GAIN`` (1e6) inside its
forward; ``LOSSES=path``: each rank writes ``path.<rank>.json``, per step the loss (as
``float.hex``), the scale before and after and whether the optimizer step was skipped.
"""

import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Gained(nn.Linear):
    """A Linear that multiplies its input by ``gain`` on the planted calls: the overflow is
    its own (its inputs, as its hooks see them, are finite)."""

    def __init__(self, n_in: int, n_out: int, gain: float, at: set[int]) -> None:
        super().__init__(n_in, n_out)
        self.gain, self.at, self.calls = gain, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        return super().forward(x * self.gain if call in self.at else x)


class MLP(nn.Module):
    def __init__(self, gain: float, at: set[int]) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = Gained(32, 16, gain, at)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, gain: float, at: set[int]) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mlp = MLP(gain, at)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(torch.relu(self.inp(x))))  # head reads fc2's output as is


dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
plant = {int(s) for s in os.environ.get("PLANT", "").split(",") if s}
model = Net(float(os.environ.get("GAIN", 1e6)), plant)
local = os.environ.get("USE_LOCAL_OUTPUT", "1") == "1"
parallelize_module(
    model,
    mesh,
    {
        "inp": ColwiseParallel(output_layouts=Replicate(), use_local_output=local),
        "mlp.fc1": ColwiseParallel(use_local_output=local),
        "mlp.fc2": RowwiseParallel(use_local_output=local),
        "head": ColwiseParallel(output_layouts=Replicate(), use_local_output=local),
    },
)
dtype = getattr(torch, os.environ.get("DTYPE", "float16"))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if dtype == torch.float16 else None
g = torch.Generator().manual_seed(0)  # the same batches on both ranks
record = []
for _ in range(int(os.environ.get("STEPS", 6))):
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    if isinstance(out, DTensor):
        out = out.full_tensor()
    loss = nn.functional.mse_loss(out.float(), y)
    before = scaler.get_scale() if scaler is not None else 1.0
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad()
    after = scaler.get_scale() if scaler is not None else 1.0
    record.append(
        {"loss": float.hex(loss.item()), "scale": [before, after], "skipped": after < before}
    )
if os.environ.get("LOSSES"):
    with open(f"{os.environ['LOSSES']}.{rank}.json", "w") as f:
        json.dump(record, f)
dist.destroy_process_group()
