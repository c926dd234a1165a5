"""Data-parallel replicas on CPU (gloo), one of which may get a flipped bit (AMP-D05).

Usage (under ``amprobe run -- torchrun``): replicas_gloo.py RESULT_DIR. Environment:

* ``WRAP``: ``ddp`` (DistributedDataParallel over every rank, CPU autocast fp16, GradScaler)
  or ``hsdp`` (FSDP2 ``fully_shard`` on a 2 x 2 DeviceMesh, replicate x shard: 4 ranks,
  ShardedGradScaler) or ``fsdp`` (FSDP2 on a 1-D mesh: pure sharding).
* ``STEPS`` (default 12).
* ``FLIP``: ``RANK@STEP``: after step STEP's optimizer update (before the scaler's update, the
  step boundary), rank RANK flips the lowest mantissa bit of one element of ``0.weight`` (its
  local shard under FSDP2): a change no float sum of the weights would see.

Writes RESULT_DIR/losses<rank>.txt: one line per step, the loss's exact value (``float.hex``).
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
wrap = os.environ.get("WRAP", "ddp")
steps = int(os.environ.get("STEPS", 12))
flip = os.environ.get("FLIP", "")
flip_rank, flip_step = (int(v) for v in flip.split("@")) if flip else (-1, -1)
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
if wrap == "ddp":
    model: nn.Module = nn.parallel.DistributedDataParallel(net)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    autocast = True
else:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if wrap == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    model = net
    scaler = ShardedGradScaler("cpu", init_scale=1024.0)
    autocast = False
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(1000 + rank)
losses = []
for step in range(steps):
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    if step == flip_step and rank == flip_rank:
        with torch.no_grad():
            weight = net[0].weight
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            local.view(torch.int32).view(-1)[3] ^= 1  # the lowest mantissa bit
    scaler.update()
    opt.zero_grad()
    losses.append(float(loss.item()).hex())
Path(sys.argv[1], f"losses{rank}.txt").write_text("\n".join(losses) + "\n")
dist.destroy_process_group()
