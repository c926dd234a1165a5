"""What a replay leaves as it found it, and what it survives (issue 34, from the review of the
merged replay): Python's and NumPy's random streams, a generator the model holds, a buffer the
forward rebinds, a list the forward appends to, a buffer that cannot be written in place; a
model that returns its loss beside the logits it came from; a layer that takes only half
precision; a backward that ``torch.autograd.grad`` cannot run (reentrant checkpointing).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import amprobe
import amprobe.capture.collectors.replay as replay_mod
from amprobe.capture.collectors.replay_run import Kept, ReplayPlan, _Runner, replay_step

D = 16


class Net(nn.Module):
    """``big`` overflows fp16 on the bad step; ``case`` says what else the forward does."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.inp = nn.Linear(8, D)
        self.big = nn.Linear(D, D)
        self.head = nn.Linear(D, 1)
        self.register_buffer("count", torch.zeros(()))
        self.gen = torch.Generator().manual_seed(123)
        self.hist: list[int] = []
        with torch.no_grad():
            self.big.weight.mul_(100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if self.case == "python-random" and random.random() < 0.5:
            h = h * 0.5
        if self.case == "numpy-random" and np.random.rand() < 0.5:
            h = h * 0.5
        if self.case == "own-generator":
            h = h * (1 + 0.01 * torch.rand(h.shape, generator=self.gen))
        if self.case == "rebound-buffer":
            self.count = self.count + 1  # a new tensor, not written in place
            h = h * (1 + 1e-3 * self.count)
        if self.case == "list-attribute":
            self.hist.append(1)
            h = h * (1 + 1e-3 * len(self.hist))
        return self.head(self.big(h))


def _job(tmp_path, case: str, replay: str) -> tuple[list[str], list[dict], float, float]:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    net = Net(case)
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    run_dir = tmp_path / f"{case}-{replay}"
    probe = amprobe.attach(
        net, opt, scaler, run_dir=run_dir, config={"replay": replay, "numerics_every": 0}
    )
    losses = []
    try:
        for step in range(8):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            if step == 5:
                x = x * 1000.0
            with torch.autocast("cpu", dtype=torch.float16):
                out = net(x)
            loss = out.float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(float(loss.detach()).hex())
    finally:
        probe.close()
    events = amprobe.load_run(run_dir).events_of("replay")
    return losses, events, random.random(), float(np.random.rand())


@pytest.mark.parametrize(
    "case", ["python-random", "numpy-random", "own-generator", "rebound-buffer", "list-attribute"]
)
def test_the_training_after_a_replay_is_the_training_without_it(tmp_path, monkeypatch, case):
    monkeypatch.setattr(replay_mod, "TIME_FACTOR", 1e4)
    off = _job(tmp_path, case, "off")
    on = _job(tmp_path, case, "on")
    assert on[1] and all(e["replayed"] is True for e in on[1]), on[1]  # replays happened
    assert on[0] == off[0], "every step's loss, bit for bit"
    assert on[2:] == off[2:], "Python's and NumPy's next draws"


def _kept_step(model: nn.Module, *args: torch.Tensor, **kwargs: torch.Tensor) -> Kept:
    kept = Kept.take(model, args, kwargs, torch.device("cpu"))
    out = model(*args, **kwargs)
    kept.watch_output(out)
    loss = out["loss"] if isinstance(out, dict) else out.float().sum()
    loss.backward()
    return kept


def _plan() -> ReplayPlan:
    return ReplayPlan(
        budget_s=100.0, scale=None, compiled=False, sampled_graph=False, micro_batch=1,
        micro_batches=1,
    )  # fmt: skip


def test_a_buffer_that_cannot_be_written_in_place_does_not_stop_the_restore():
    class Expanded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(1).expand(4))  # overlapping memory
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(self.lin(x) * self.scale)

    model = Expanded()  # (the kept forward holds its model weakly)
    kept = _kept_step(model, torch.randn(2, 4))
    before = torch.get_rng_state()
    detail = replay_step(kept, _plan())  # raised out of its finally block before
    assert detail["replayed"] is True
    assert torch.equal(torch.get_rng_state(), before)


def test_a_loss_returned_beside_its_logits_is_seeded_once():
    """HF models called with labels return the loss and the logits it came from: the logits'
    gradient already holds the loss's part; seeding both doubled the replay's gradients."""

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.lin(x)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    torch.manual_seed(0)
    model = LM()
    kept = _kept_step(model, torch.randn(5, 4), labels=torch.randint(0, 3, (5,)))
    assert len(kept.grads) == 2  # both outputs got a gradient in the step
    runner = _Runner(kept, _plan())
    assert [g.dim() for g in runner.seeds.values()] == [0], "the loss only"
    step_grad = model.lin.weight.grad.clone()
    (res,) = runner.run("as it ran", eager=True)
    assert res.finite and res.grads_finite
    outs = model(*kept.args, **kept.kwargs)
    seeds = [(outs["loss"], g) for g in runner.seeds.values()]
    (again,) = torch.autograd.grad([o for o, _ in seeds], [model.lin.weight], [g for _, g in seeds])
    assert torch.allclose(again, step_grad)


class HalfOnly(nn.Module):
    """As flash-attention kernels: fp16/bf16 inputs only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only supports fp16 and bf16 data type")
        return torch.softmax(x, -1) * x


def test_a_variant_that_raises_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    """'autocast off' and the pins of a half-only layer raise: recorded on their rows; the
    replay goes on and claims no cause it did not measure."""
    monkeypatch.setattr(replay_mod, "TIME_FACTOR", 1e4)

    class Net2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, D)
            self.attn = HalfOnly()
            self.head = nn.Linear(D, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.attn(self.inp(x)))

    torch.manual_seed(0)
    net = Net2()
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    probe = amprobe.attach(net, opt, scaler, run_dir=tmp_path / "r", config={"numerics_every": 0})
    try:
        for step in range(7):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.float16):
                out = net(x * (1e5 if step == 5 else 1.0))
            scaler.scale(out.float().pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    finally:
        probe.close()
    (event,) = amprobe.load_run(tmp_path / "r").events_of("replay")
    assert event["replayed"] is True, event  # was: "the replay failed: RuntimeError: ..."
    rows = {x["variant"]: x for x in event["experiments"]}
    assert "FlashAttention" in rows["autocast off"]["error"]
    assert event["cause"] in (None, "precision")
    if event["cause"] is None:
        assert event["incomplete"]
    else:
        assert event["verified_fix"], "precision is claimed only with a verified pin"


def test_a_backward_autograd_grad_cannot_run_is_said_not_guessed():
    """Reentrant activation checkpointing refuses ``torch.autograd.grad``: the variants are
    judged by their forward, and a finite forward gives no cause (the bad value was in the
    backward, which cannot be replayed)."""

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.lin, x, use_reentrant=True)

    torch.manual_seed(0)
    model = Checkpointed()
    kept = _kept_step(model, torch.randn(2, 4, requires_grad=True))
    detail = replay_step(kept, _plan())
    assert detail["replayed"] is True, detail
    assert detail["cause"] is None and detail["incomplete"] == "the backward cannot be replayed"
    assert any("backward cannot be replayed" in n for n in detail["notes"])


def test_several_root_models_the_one_that_reproduces_is_named(tmp_path, monkeypatch):
    """Two root models in one step (an encoder and a head trained together): ``A`` overflows,
    ``B`` runs last on a tame input. Replaying only the last forward said 'not reproduced' and
    called the two roots two micro-batches; each root is now replayed, latest first."""
    monkeypatch.setattr(replay_mod, "TIME_FACTOR", 1e4)

    class Encoder(nn.Sequential):
        pass

    class Head(nn.Sequential):
        pass

    torch.manual_seed(0)
    a = Encoder(nn.Linear(8, 16), nn.Linear(16, 8))
    b = Head(nn.Linear(8, 16), nn.Linear(16, 1))
    with torch.no_grad():
        a[1].weight.mul_(100.0)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    probe = amprobe.attach(None, opt, scaler, run_dir=tmp_path / "r", config={"numerics_every": 0})
    try:
        for step in range(8):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.float16):
                h = a(x * (1000.0 if step == 5 else 1.0))
                out = b(h.detach().float() / 1e6)  # finite on its own
                loss = out.float().pow(2).mean() + h.float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    finally:
        probe.close()
    events = [e for e in amprobe.load_run(tmp_path / "r").events_of("replay") if e["replayed"]]
    assert events, "the bad step was replayed"
    event = events[0]
    assert event["cause"] not in (None, "not-reproduced"), event
    assert event["root"] == "Encoder", event
    assert "micro_batches" not in event, "two roots are not two micro-batches"
    assert any("Head" in n and "Encoder" in n for n in event["notes"]), event["notes"]
