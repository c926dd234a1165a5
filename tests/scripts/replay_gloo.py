"""A 2-rank job on CPU (gloo) whose bad steps go non-finite, for the replay (issue 34).

Usage (under ``amprobe run -- torchrun``): replay_gloo.py RESULT_DIR. Environment: ``WRAP``
``ddp`` (DistributedDataParallel, CPU autocast fp16, GradScaler) or ``fsdp`` (fully_shard with
an fp16 MixedPrecisionPolicy, no autocast, ShardedGradScaler); ``CASES``, the bad steps as
``CASE@STEP,...`` (default ``layer@5``), each CASE one of:

* ``layer`` (ddp): ``big``'s output overflows fp16 on both ranks (its batch x10000).
* ``cosine`` (fsdp): the custom cosine similarity ``cos`` overflows fp16 on both ranks.
* ``cosine_nomem1`` (fsdp): ``cosine``, and rank 1's memory check says it has not the memory
  for a replay.
* ``cosine_fail1`` (fsdp): ``cosine``, and on rank 1 the replay's second variant ("autocast
  off") raises after its forward and backward (planted in ``_Runner._settle``, after the
  variant's collectives): every rank must stop at the next agreement, none left waiting.
* ``nan_rank1``: only rank 1's batch holds a NaN; rank 0 gets it through the reduction.
* ``spike`` (fsdp): the batch x10000 and the loss x256 on both ranks: the forward is finite (the
  LayerNorm), the fp16 gradients overflow at the loss scale and are finite at a lower one.

``STEPS`` (default 8) steps in all.

Writes to RESULT_DIR/result<rank>.txt (one file per rank: torchrun interleaves stdout) a line
``loss STEP VALUE`` per step, ``grads STEP DIGEST`` (the gradients after the step's update,
before they are zeroed), ``reductions N`` (the gradient reductions: DDP's buckets through a comm hook, FSDP2's
reduce-scatters) and
``digest VALUE`` (the final weights, bit for bit).
"""

import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import amprobe.capture.collectors.replay as replay
import amprobe.capture.collectors.replay_run as replay_run

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

replay.TIME_FACTOR = 1e6  # the budget never cuts a replay short: the test is deterministic
memory_headroom = replay._memory_headroom


def no_memory(kept: object) -> tuple[bool, str]:
    return False, "1 MiB free, 2 MiB needed (planted)"


# rank 1's second variant of a replay raises after its collectives (case cosine_fail1)
PLANT = {"on": False, "settled": 0}
settle = replay_run._Runner._settle


def failing_settle(self: replay_run._Runner) -> None:
    settle(self)
    if PLANT["on"]:
        PLANT["settled"] += 1
        if PLANT["settled"] == 2:
            raise RuntimeError("planted failure in a variant")


replay_run._Runner._settle = failing_settle  # type: ignore[method-assign]


WRAP = os.environ.get("WRAP", "ddp")
CASES = {
    int(at): case
    for case, at in (c.split("@") for c in os.environ.get("CASES", "layer@5").split(",") if c)
}


# the single-process replay jobs' models (tests/scripts/train_replay.py), the same layers
from train_replay import CosineNet, Net  # noqa: E402


def batch(step: int, rank: int) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
    case = CASES.get(step)
    if case == "nan_rank1":
        if rank == 1:
            x[0, 0] = float("nan")
        return x
    if case in ("layer", "cosine", "cosine_nomem1", "cosine_fail1", "spike"):
        return x * 10000.0
    return x


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.detach().float().numpy().tobytes())
    return h.hexdigest()[:16]


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
reductions = {"n": 0}
if WRAP == "ddp":
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    net: nn.Module = Net()
    if "layer" in CASES.values():
        with torch.no_grad():
            net.big.weight.mul_(100.0)
    model: nn.Module = nn.parallel.DistributedDataParallel(net)

    def counting_hook(state, bucket):  # noqa: ANN001, ANN202  (DDP checks the annotation)
        reductions["n"] += 1
        return allreduce_hook(None, bucket)

    model.register_comm_hook(None, counting_hook)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    autocast = True
else:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    cosine = {"cosine", "cosine_nomem1", "cosine_fail1"} & set(CASES.values())
    net = CosineNet() if cosine else Net()
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for child in net.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mp_policy=policy)
    model = fully_shard(net, mp_policy=policy)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    autocast = False
    reduce_scatter = dist.reduce_scatter_single  # FSDP2 reduces gradients through this name

    def counting_reduce_scatter(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        reductions["n"] += 1
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counting_reduce_scatter
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
lines = []
for step in range(int(os.environ.get("STEPS", 8))):
    opt.zero_grad()
    # rank 1 judges that it has not the memory for a replay of this step (its check replaced)
    short = CASES.get(step) == "cosine_nomem1" and rank == 1
    replay._memory_headroom = no_memory if short else memory_headroom
    PLANT.update(on=CASES.get(step) == "cosine_fail1" and rank == 1, settled=0)
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        out = model(batch(step, rank))
    loss = out.float().pow(2).mean()
    if CASES.get(step) == "spike":  # a loss spike: the scaled gradients overflow fp16
        loss = loss * 256.0
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    lines.append(f"loss {step} {float(loss.detach())!r}")
    lines.append(
        f"grads {step} {digest([p.grad for p in model.parameters() if p.grad is not None])}"
    )
lines.append(f"reductions {reductions['n']}")
lines.append(f"digest {digest(list(model.parameters()))}")
with open(os.path.join(sys.argv[1], f"result{rank}.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
dist.destroy_process_group()
