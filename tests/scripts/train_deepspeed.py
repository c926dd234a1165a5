"""A DeepSpeed job on CPU (gloo), written without amprobe in mind: a layer multiplies its output
by 1e6 on the iterations in PLANT (default 3,4,5) so fp16 overflows there.

Environment: CONFIGS: comma-separated ``precision:zero_stage`` (default ``fp16:1``); STEPS
(default 10). With AMPROBE_OUT set, each config is recorded by ``amprobe.attach(model=engine)``
into ``$AMPROBE_OUT/<precision>-z<stage>`` (the attach path); without it, the job is meant to
run under ``amprobe run`` (zero-code).
"""

import os

import deepspeed
import torch
from torch import nn

STEPS = int(os.environ.get("STEPS", 10))
PLANT = {int(s) for s in os.environ.get("PLANT", "3,4,5").split(",") if s}
OUT = os.environ.get("AMPROBE_OUT")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.blow = False

    def forward(self, x):
        h = torch.relu(self.embed(x))
        if self.blow:
            h = h * 1e6
        return self.head(h)


def train(precision: str, stage: int) -> None:
    torch.manual_seed(0)
    model = Net()
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
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
    probe = None
    if OUT:
        import amprobe

        probe = amprobe.attach(model=engine, run_dir=f"{OUT}/{precision}-z{stage}")
    dtype = next(engine.module.parameters()).dtype
    torch.manual_seed(1)
    for i in range(STEPS):
        x, y = torch.randn(4, 8).to(dtype), torch.randn(4, 4)
        model.blow = i in PLANT
        loss = nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
    if probe is not None:
        probe.close()
    if engine.global_rank == 0:
        print(f"{precision}-z{stage} skipped_steps={engine.skipped_steps}", flush=True)


deepspeed.init_distributed(dist_backend="gloo")
for item in os.environ.get("CONFIGS", "fp16:1").split(","):
    precision, stage = item.split(":")
    train(precision, int(stage))
