"""A 2-rank FSDP2 script on CPU (gloo): every Linear and the root under ``fully_shard``.

Environment: ``PARAM_DTYPE`` / ``REDUCE_DTYPE`` (``float16``, ``bfloat16``, ``float32``) of the
``MixedPrecisionPolicy``; ``SCALER=1`` for a ``ShardedGradScaler("cpu")``; ``STEPS``;
``PLANT=a,b`` the steps on which ``booster`` multiplies its output by ``GAIN`` (1e6);
``CKPT=1`` wraps ``mid`` in an activation-checkpoint wrapper before sharding.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


class Booster(nn.Linear):
    """A Linear whose output is multiplied by ``gain`` on the planted steps."""

    def __init__(self, n: int, gain: float, at: set[int]) -> None:
        super().__init__(n, n)
        self.gain, self.at, self.calls = gain, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        call, self.calls = self.calls, self.calls + 1
        return y * self.gain if call in self.at else y


class Net(nn.Module):
    def __init__(self, at: set[int]) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 32)
        self.booster = Booster(32, float(os.environ.get("GAIN", 1e6)), at)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        x = torch.relu(self.mid(x))
        return self.head(self.booster(x))


dist.init_process_group("gloo")
torch.manual_seed(0)
plant = {int(s) for s in os.environ.get("PLANT", "").split(",") if s}
model = Net(plant)
if os.environ.get("CKPT") == "1":
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model.mid = checkpoint_wrapper(model.mid)
policy = MixedPrecisionPolicy(
    param_dtype=getattr(torch, os.environ.get("PARAM_DTYPE", "float16")),
    reduce_dtype=getattr(torch, os.environ.get("REDUCE_DTYPE", "float32")),
)
for layer in (model.inp, model.mid, model.booster, model.head):
    fully_shard(layer, mp_policy=policy)
fully_shard(model, mp_policy=policy)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = ShardedGradScaler("cpu", init_scale=1024.0) if os.environ.get("SCALER") == "1" else None
g = torch.Generator().manual_seed(dist.get_rank())
for _ in range(int(os.environ.get("STEPS", 12))):
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = nn.functional.mse_loss(model(x).float(), y)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad()
dist.destroy_process_group()
