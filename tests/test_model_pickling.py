"""A watched model can still be pickled and copied: ``torch.save(model)``, ``copy.deepcopy``.

amprobe's hooks on the user's modules are local functions, which pickle refuses; while attached,
``Module.__getstate__`` leaves them out of the pickled state (the live module keeps them), and
the patch is gone after close.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import amprobe


def _amprobe_hooks(module: nn.Module) -> list[object]:
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return [h for h in hooks if str(getattr(h, "__module__", "")).startswith("amprobe.")]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_torch_save_and_deepcopy_of_a_watched_model(tmp_path, compiled):
    original = torch.nn.Module.__getstate__
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    model = torch.compile(net, backend="aot_eager") if compiled else net
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    probe = amprobe.attach(model, opt, run_dir=tmp_path / "r", config={"numerics_every": 1})
    try:
        for _ in range(2):
            model(torch.randn(2, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        watched = [m for m in (model, *net.modules()) if _amprobe_hooks(m)]
        assert watched, "amprobe hooks the model while attached"
        buf = io.BytesIO()
        torch.save(model, buf)  # failed: "Can't pickle local object ...<locals>.post"
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert not any(_amprobe_hooks(m) for m in loaded.modules())
        copied = copy.deepcopy(net)
        assert not any(_amprobe_hooks(m) for m in copied.modules())
        assert all(_amprobe_hooks(m) for m in watched), "the live modules keep their hooks"
        x = torch.randn(3, 4)
        assert torch.equal(loaded(x), model(x)) and torch.equal(copied(x), net(x))
    finally:
        probe.close()
    assert torch.nn.Module.__getstate__ is original
