"""Megatron-core's real grad scalers driven as its ``MixedPrecisionOptimizer.step`` drives them,
on CPU (gloo, 2 ranks): scale the loss, unscale the fp32 main gradients and check them for
inf/NaN, all-reduce ``found_inf``, ``grad_scaler.update(found_inf)``, skip or step.

What runs is Megatron's: ``parallel_state.initialize_model_parallel``, ``DynamicGradScaler`` /
``ConstantGradScaler`` (their constructors hard-code ``device='cuda'``: ``cuda`` is mapped to the
CPU while they are constructed, nothing else), and ``MegatronOptimizer.scale_loss`` with
``MixedPrecisionOptimizer.get_loss_scale`` (that optimizer's constructor rejects CPU parameters,
so only the attribute those methods read is set). The unscale/all-reduce/skip follow
``MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan`` and ``step``.

Environment: CONFIGS: comma-separated ``scaler:mode`` with scaler ``dynamic``/``constant`` and
mode ``scale_loss`` (Megatron's ``grad_scale_func``) or ``hand`` (the loop multiplies the loss
by ``grad_scaler.scale`` itself); each is recorded by ``amprobe.attach(model=...)`` into
``$AMPROBE_OUT/<scaler>-<mode>``. STEPS (default 10), PLANT (default 3,4,5). ATTACH=0: no
``amprobe.attach`` in the script (run it under ``amprobe run``, one config: nothing names the
model, whose fp16 parameters the optimizer holds only as fp32 copies).
"""

import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer import grad_scaler as gs
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
from torch import nn

import amprobe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _planted import BlowNet  # noqa: E402

STEPS = int(os.environ.get("STEPS", 10))
PLANT = {int(s) for s in os.environ.get("PLANT", "3,4,5").split(",") if s}
ATTACH = os.environ.get("ATTACH", "1") != "0"
OUT = os.environ["AMPROBE_OUT"] if ATTACH else ""


@contextlib.contextmanager
def cuda_as_cpu():
    """``torch.tensor(..., device='cuda')`` makes a CPU tensor (the scalers' constructors)."""
    orig = torch.tensor

    def tensor(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return orig(*args, **kwargs)

    torch.tensor = tensor
    try:
        yield
    finally:
        torch.tensor = orig


def train(kind: str, mode: str) -> None:
    torch.manual_seed(0)
    model = BlowNet().half()
    main = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.SGD(main, lr=0.01)
    probe = amprobe.attach(model=model, run_dir=f"{OUT}/{kind}-{mode}") if ATTACH else None
    with cuda_as_cpu():
        if kind == "dynamic":
            scaler = gs.DynamicGradScaler(
                initial_scale=4096.0,
                min_scale=1.0,
                growth_factor=2.0,
                backoff_factor=0.5,
                growth_interval=1000,
                hysteresis=2,
            )
        else:
            scaler = gs.ConstantGradScaler(4096.0)
    stub = type("CpuMixedPrecisionOptimizer", (MixedPrecisionOptimizer,), {})
    stub.__abstractmethods__ = frozenset()
    mp_opt = stub.__new__(stub)
    mp_opt.grad_scaler = scaler
    torch.manual_seed(1)
    for i in range(STEPS):
        x, y = torch.randn(4, 8).half(), torch.randn(4, 4)
        model.blow = i in PLANT
        loss = nn.functional.mse_loss(model(x).float(), y)
        scaled = mp_opt.scale_loss(loss) if mode == "scale_loss" else loss * scaler.scale
        scaled.backward()
        grads = [p.grad.float() for p in model.parameters()]
        found_inf = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, scaler.inv_scale)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        found = found_inf.item() > 0
        scaler.update(found)
        if not found:
            for m, g in zip(main, grads, strict=True):
                m.grad = g
            opt.step()
            with torch.no_grad():
                for p, m in zip(model.parameters(), main, strict=True):
                    p.copy_(m)
        opt.zero_grad()
        model.zero_grad()
    if probe is not None:
        probe.close()


dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(1, 1)
for item in os.environ.get("CONFIGS", "dynamic:scale_loss").split(","):
    kind, mode = item.split(":")
    train(kind, mode)
dist.destroy_process_group()
