"""A 2-rank DCP save on CPU (gloo): a clean save, then one where only rank POISON_RANK (default
1) holds a NaN in its local shard of a DTensor. Usage: dcp_gloo.py CHECKPOINT_DIR.

Prints "rank R saved" or "rank R refused elsewhere=BOOL" for the poisoned save, then trains one
more step and saves again ("rank R trained on").
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import amprobe

dist.init_process_group("gloo")
rank = dist.get_rank()
base = sys.argv[1]
torch.manual_seed(0)
model = nn.Linear(8, 4)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
sharded = distribute_tensor(torch.randn(4, 8), mesh, [Shard(0)])


def train_step() -> None:
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def state() -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "sharded": sharded}


for _ in range(2):
    train_step()
dcp.save(state(), checkpoint_id=os.path.join(base, "good"))
if rank == int(os.environ.get("POISON_RANK", 1)):
    with torch.no_grad():
        sharded.to_local()[0, 0] = float("nan")
try:
    dcp.save(state(), checkpoint_id=os.path.join(base, "poisoned"))
    print(f"rank {rank} saved", flush=True)
except amprobe.PoisonedCheckpointError as exc:
    print(f"rank {rank} refused elsewhere={exc.elsewhere}", flush=True)
with torch.no_grad():
    sharded.to_local().nan_to_num_(0.0)
train_step()
dcp.save(state(), checkpoint_id=os.path.join(base, "after"))
print(f"rank {rank} trained on", flush=True)
dist.barrier()
dist.destroy_process_group()
