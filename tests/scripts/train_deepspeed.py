"""A DeepSpeed job on CPU (gloo), written without amprobe in mind: a layer multiplies its output
by 1e6 on the iterations in PLANT (default 3,4,5) so fp16 overflows there.

Environment: CONFIGS: comma-separated ``precision:zero_stage[:accumulation]`` (default
``fp16:1``); STEPS: optimizer iterations (default 10). With AMPROBE_OUT set, each config is
recorded by ``amprobe.attach(model=engine)`` into ``$AMPROBE_OUT/<precision>-z<stage>[-ga<n>]``
(the attach path) and rank 0 writes each iteration's mean micro-batch loss next to it
(``<name>-losses.json``, or into LOSSES_DIR); without it, the job is meant to run under
``amprobe run`` (zero-code).
"""

import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _planted import BlowNet  # noqa: E402

STEPS = int(os.environ.get("STEPS", 10))
PLANT = {int(s) for s in os.environ.get("PLANT", "3,4,5").split(",") if s}
OUT = os.environ.get("AMPROBE_OUT")
LOSSES = os.environ.get("LOSSES_DIR", OUT)  # where rank 0 writes <name>-losses.json


def train(precision: str, stage: int, accumulation: int) -> None:
    torch.manual_seed(0)
    model = BlowNet()
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
    }
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 2}
    else:
        cfg["bf16"] = {"enabled": True}
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    name = f"{precision}-z{stage}" + (f"-ga{accumulation}" if accumulation > 1 else "")
    probe = None
    if OUT:
        import amprobe

        probe = amprobe.attach(model=engine, run_dir=f"{OUT}/{name}")
    dtype = next(engine.module.parameters()).dtype
    torch.manual_seed(1)
    losses = [0.0] * STEPS
    for i in range(STEPS * accumulation):
        x, y = torch.randn(4, 8).to(dtype), torch.randn(4, 4)
        model.blow = i // accumulation in PLANT
        loss = nn.functional.mse_loss(engine(x).float(), y)
        losses[i // accumulation] += float(loss) / accumulation
        engine.backward(loss)
        engine.step()
    if probe is not None:
        probe.close()
    if engine.global_rank == 0:
        print(f"{name} skipped_steps={engine.skipped_steps}", flush=True)
        if LOSSES:
            with open(f"{LOSSES}/{name}-losses.json", "w") as f:
                json.dump(losses, f)


# DeepSpeed's CPU accelerator allows fp16 only where oneDNN has fp16 instructions (Intel
# AVX512-FP16 / AMX-FP16; an AMD EPYC has neither). What these jobs test is what amprobe records
# of DeepSpeed's fp16 loss scaler, which runs the same on any CPU (torch computes fp16 on every
# x86 CPU, more slowly), so that policy is lifted here, in the test job only.
_accelerator = get_accelerator()
if not _accelerator.is_fp16_supported():
    _accelerator.is_fp16_supported = lambda: True
deepspeed.init_distributed(dist_backend="gloo")
for item in os.environ.get("CONFIGS", "fp16:1").split(","):
    precision, stage, *accumulation = item.split(":")
    train(precision, int(stage), int(accumulation[0]) if accumulation else 1)
