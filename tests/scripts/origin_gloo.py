"""A multi-rank job on CPU (gloo) in which one rank produces a non-finite value, for AMP-D04.

Usage: ``torchrun origin_gloo.py RESULT_DIR`` (under ``amprobe run`` too). ``PHASES``, the jobs
one launch runs in turn, each from a fresh model: ``off`` (amprobe off), ``on`` (the same job
under ``amprobe.attach``, recorded in RESULT_DIR/run), ``healthy`` (attached, no fault,
``HEALTHY_STEPS`` steps, default 500, recorded in RESULT_DIR/healthy; its GradScaler at its
default settings, so its start-up calibration skips the first steps, and rank 1's batch
``HEALTHY_GAIN`` times larger, default 64, so that rank's scaled gradients overflow there while
rank 0's do not: the scaler's job, not an origin), ``noreplay`` (attached
with ``replay="off"``, only the ``backward`` faults, recorded in RESULT_DIR/noreplay); default
``off``. Environment: ``WRAP`` ``ddp`` (DistributedDataParallel) or ``hsdp``
(FSDP2's ``fully_shard`` on a 2x2 DeviceMesh ``(replicate, shard)``: 4 ranks), both with CPU
autocast fp16 and a GradScaler (``ShardedGradScaler`` for HSDP, which all-reduces found-inf
over every rank); ``CASES``, the planted faults as ``CASE:RANK@STEP,...``, each CASE one of:

* ``input``: a NaN in that rank's batch.
* ``layer``: ``booster`` (a Linear) multiplies its output by 1e9 on that rank: inf in fp16.
* ``backward``: ``bomb`` passes its input through in the forward and multiplies its gradient
  by inf in the backward, on that rank: the forward and the loss stay finite.

The plants fire on a marker in that rank's batch at that step (a finite value), so a replay of
the step, which runs the forward on the step's own inputs, fires them as the step did. ``STEPS`` (default 12) steps.

Writes RESULT_DIR/<phase><rank>.txt: ``loss STEP VALUE`` per step, ``seconds VALUE`` (the
training loop's wall time) and ``digest VALUE`` (the final weights, bit for bit).
"""

import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

WRAP = os.environ.get("WRAP", "ddp")
CASES: dict[int, tuple[str, int]] = {}
for item in (c for c in os.environ.get("CASES", "").split(",") if c):
    what, where = item.split(":")
    rank_text, step_text = where.split("@")
    CASES[int(step_text)] = (what, int(rank_text))


#: the finite marker a batch's x[0, 0] holds to fire each plant
MARKS = {"layer": 1234.5, "backward": 2345.5}


class Booster(nn.Linear):
    """A Linear whose output is multiplied by 1e9 when armed (inf in fp16)."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * 1e9 if self.armed else y


class _Bomb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, armed):  # noqa: ANN001, ANN205
        ctx.armed = armed
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return (grad * float("inf") if ctx.armed else grad), None


class Bomb(nn.Module):
    """The identity forward; its gradient times inf when armed."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Bomb.apply(x, self.armed)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.booster = Booster(16, 16)
        self.bomb = Bomb()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marker = float(x[0, 0])  # (a host read: a test job)
        self.booster.armed = marker == MARKS["layer"]
        self.bomb.armed = marker == MARKS["backward"]
        x = torch.relu(self.inp(x))
        return self.head(self.bomb(self.booster(x)))


def batch(step: int, rank: int) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
    case = CASES.get(step)
    if case == ("input", rank):
        x[0, 0] = float("nan")
    elif case is not None and case[1] == rank:
        x[0, 0] = MARKS[case[0]]
    return x


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.detach().float().numpy().tobytes())
    return h.hexdigest()[:16]


def train(
    steps: int,
    cases: dict[int, tuple[str, int]],
    run_dir: str | None,
    config: dict[str, object] | None = None,
    healthy: bool = False,
) -> list[str]:
    """One job from a fresh model (seed 0): ``steps`` steps with the faults of ``cases``;
    under ``amprobe.attach(run_dir=..., config=config)`` when ``run_dir`` is given. ``healthy``:
    the GradScaler at its defaults, rank 1's batch ``HEALTHY_GAIN`` times larger and a smaller
    learning rate (see the module's docstring). Its result lines."""
    CASES.clear()
    CASES.update(cases)
    torch.manual_seed(0)
    net = Net()
    if WRAP == "ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(net)
        scaler = (
            torch.amp.GradScaler("cpu")
            if healthy
            else torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
        )
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for layer in (net.inp, net.booster, net.head):
            fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
        scaler = (
            ShardedGradScaler("cpu")
            if healthy
            else ShardedGradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
        )
    gain = float(os.environ.get("HEALTHY_GAIN", 64)) if healthy and rank == 1 else 1.0
    opt = torch.optim.SGD(model.parameters(), lr=1e-4 if healthy else 1e-2)
    probe = None
    if run_dir is not None:
        import amprobe

        probe = amprobe.attach(
            model=model, optimizer=opt, scaler=scaler, run_dir=run_dir, config=config
        )
    lines = []
    t0 = time.perf_counter()
    for step in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(batch(step, rank) * gain if gain != 1.0 else batch(step, rank))
        loss = out.float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        lines.append(f"loss {step} {float(loss.detach())!r}")
    lines.append(f"seconds {time.perf_counter() - t0:.3f}")
    if probe is not None:
        probe.close()
    lines.append(f"digest {digest(list(model.parameters()))}")
    return lines


dist.init_process_group("gloo")
rank = dist.get_rank()
planted_cases = dict(CASES)
steps = int(os.environ.get("STEPS", 12))
# PHASES (see the module's docstring); default "off" (for amprobe run)
for phase in os.environ.get("PHASES", "off").split(","):
    if phase == "healthy":
        got = train(
            int(os.environ.get("HEALTHY_STEPS", 500)), {}, f"{sys.argv[1]}/healthy", healthy=True
        )
    elif phase == "noreplay":  # the backward-only faults alone, with the replay off
        only = {k: v for k, v in planted_cases.items() if v[0] == "backward"}
        got = train(steps, only, f"{sys.argv[1]}/noreplay", {"replay": "off"})
    else:
        got = train(steps, planted_cases, f"{sys.argv[1]}/run" if phase == "on" else None)
    with open(os.path.join(sys.argv[1], f"{phase}{rank}.txt"), "w") as f:
        f.write("\n".join(got) + "\n")
dist.destroy_process_group()
