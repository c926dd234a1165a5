"""Small fp16 jobs whose first bad step has a known cause, for the replay (issue 34).

Usage: python train_replay.py --case CASE [--steps N] [--bad S] [--compile] [--attach RUN_DIR]
[--replay on|off] [--time-factor F]. Cases (the bad step is S, default 5):

* ``layer``: ``big``'s output overflows fp16 at step S; pinning ``big`` to fp32 fixes it.
* ``elsewhere``: ``inv`` (1 / (x - 1)) is the first non-finite layer, but the cause is ``proj``,
  whose fp16 output rounds 1.0001 to 1.0; only pinning ``proj`` fixes it.
* ``cosine``: a custom cosine-similarity head (the seeds' G§5.1 example) overflows in fp16.
* ``nan_batch``: the batch of step S holds a NaN (the data: fp32 would break too).
* ``loss``: the loss computed outside the model is non-finite at step S; the model is fine.
* ``oneoff``: a forward hook plants a NaN once, at step S; a replay does not see it again.
* ``scale``: the gradients overflow at the scaler's grown loss scale, the forward is finite.
* ``startup``: the scaler starts so high (2**40) that 16 leading halvings do not bring it down
  (past the start-up calibration); the gradients are finite at a lower scale.
* ``compiler`` (with ``--compile``): a compiler backend that miscompiles the batch of step S.

Prints ``loss STEP VALUE`` per step and ``digest VALUE`` (the final weights, bit for bit).
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch
from torch import nn

D = 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.big = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.big(torch.relu(self.inp(x)))))


class Inv(nn.Module):
    """1 / (x - 1): finite while ``x`` is not exactly 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1.0 / (x - 1.0)


class ElsewhereNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, D)
        self.inv = Inv()
        self.out = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inv(self.proj(x)) * 1e-4).sum(-1, keepdim=True)


class Cosine(nn.Module):
    """A custom cosine similarity written out (no eps, no fp32 upcast): |a| overflows fp16."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        num = (a * b).sum(-1)
        den = a.pow(2).sum(-1).sqrt() * b.pow(2).sum(-1).sqrt()
        return (num / den).unsqueeze(-1)


class CosineNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(8, D)
        self.right = nn.Linear(8, D)
        self.cos = Cosine()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cos(self.left(x), self.right(x))


class ScaleNet(nn.Module):
    """Small activations, large weights in ``amp``: the backward's fp16 gradients overflow at a
    large loss scale while the forward stays finite."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.amp = nn.Linear(D, D)
        self.head = nn.Linear(D, 1)
        with torch.no_grad():
            self.amp.weight.mul_(8.0)
            self.head.weight.mul_(8.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.amp(self.inp(x)))


def build(case: str, bad: int) -> tuple[nn.Module, torch.amp.GradScaler]:
    torch.manual_seed(0)
    if case == "elsewhere":
        net: nn.Module = ElsewhereNet()
        with torch.no_grad():
            net.proj.weight.zero_()
            net.proj.weight[:, 0] = 1.0
            net.proj.bias.fill_(1.0)
    elif case == "cosine":
        net = CosineNet()
    elif case in ("scale", "startup"):
        net = ScaleNet()
    else:
        net = Net()
        if case == "layer":
            with torch.no_grad():
                net.big.weight.mul_(100.0)
    if case == "oneoff":
        calls = {"n": 0}

        def plant(module: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor | None:
            calls["n"] += 1
            if calls["n"] == bad + 1:
                return out * float("nan")
            return None

        net.big.register_forward_hook(plant)
    if case == "scale":
        return net, torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=2)
    if case == "startup":  # so high that its calibration is a collapse (16 halvings or more)
        return net, torch.amp.GradScaler("cpu", init_scale=2.0**40)
    return net, torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)


def batch(case: str, step: int, bad: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=g)
    if case == "elsewhere":  # proj's output is 1 + x[:, 0]: 1.5 and more, 1.0001 at the bad step
        first = x[:, :1].abs() + 0.5 if step != bad else torch.full((4, 1), 1e-4)
        return torch.cat([first, torch.zeros(4, 7)], dim=1)
    if step != bad:
        return x
    if case == "layer":
        return x * 1000.0
    if case == "cosine":
        return x * 1000.0
    if case == "nan_batch":
        x[0, 0] = float("nan")
        return x
    return x


#: the buggy backend's forward returns NaN while this is on (the training loop sets it)
MISCOMPILE = {"on": False}


def _buggy_backend() -> object:
    """A compiler backend that miscompiles: its forward returns NaN on the bad step."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def fw(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        def run(*args: object) -> object:
            out = gm(*args)
            if MISCOMPILE["on"]:  # the bad step's inputs hit the compiler's bug
                out = [
                    o * float("nan") if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                    for o in out
                ]
            return out

        return make_boxed_func(run)

    return aot_autograd(fw_compiler=fw)


def train(
    case: str,
    steps: int = 8,
    bad: int = 5,
    compiled: bool = False,
    attach: str | None = None,
    replay: str = "on",
    backend: object = None,
    config: dict | None = None,
) -> tuple[list[float], str, object]:
    net, scaler = build(case, bad)
    opt = torch.optim.SGD(net.parameters(), lr=1e-5 if case in ("scale", "startup") else 1e-2)
    model: nn.Module = net
    if compiled:
        model = torch.compile(
            net, backend=backend or (_buggy_backend() if case == "compiler" else "aot_eager")
        )
    probe = None
    if attach:
        import amprobe

        probe = amprobe.attach(
            model,
            opt,
            scaler,
            run_dir=attach,
            config={"replay": replay, "numerics_every": 0, **(config or {})},
        )
    losses = []
    for step in range(steps):
        x = batch(case, step, bad)
        MISCOMPILE["on"] = case == "compiler" and step == bad
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = out.float().pow(2).mean()
        if case == "loss" and step == bad:
            loss = loss / torch.zeros(())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    if probe is not None:
        probe.close()
    h = hashlib.sha256()
    for p in net.state_dict().values():
        h.update(p.detach().cpu().numpy().tobytes())
    return losses, h.hexdigest(), probe


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--bad", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--attach", default=None)
    p.add_argument("--replay", default="on")
    # the replay's budget factor (tests: a large one makes the measured cause deterministic)
    p.add_argument("--time-factor", type=float, default=None)
    a = p.parse_args(argv)
    if a.time_factor is not None:
        import amprobe.capture.collectors.replay as replay

        replay.TIME_FACTOR = a.time_factor
    losses, digest, _ = train(a.case, a.steps, a.bad, a.compile, a.attach, a.replay)
    for i, v in enumerate(losses):
        print(f"loss {i} {v!r}")
    print(f"digest {digest}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
