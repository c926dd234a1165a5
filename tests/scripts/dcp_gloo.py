"""A 2-rank DCP save on CPU (gloo): a clean save, then one where only rank POISON_RANK (default
1) holds a NaN in its local shard of a DTensor. Usage: dcp_gloo.py CHECKPOINT_DIR.

Writes, to result<R>.txt beside CHECKPOINT_DIR, "saved" or "refused elsewhere=BOOL" for the
poisoned save, then trains one more step, saves again and adds "trained on" (one file per rank:
the ranks' stdout lines interleave).
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
results: list[str] = []
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
    results.append("saved")
except amprobe.PoisonedCheckpointError as exc:
    results.append(f"refused elsewhere={exc.elsewhere}")
with torch.no_grad():
    sharded.to_local().nan_to_num_(0.0)
train_step()
dcp.save(state(), checkpoint_id=os.path.join(base, "after"))
results.append("trained on")
with open(os.path.join(os.path.dirname(base), f"result{rank}.txt"), "w") as f:
    f.write("\n".join(results))
dist.barrier()
dist.destroy_process_group()
