"""A Lightning loop on a tiny MLP with random data (zero-code tests, integration tests, benchmarks).

Usage: python train_lightning.py [--precision P] [--steps N] [--accum K] [--plant KIND]
       [--plant-step S] [--callback RUN_DIR] [--config JSON] [--width W] [--batch B]
P: a Lightning precision ("32-true", "bf16-mixed", ...) or "fp16-cpu" (16-mixed on the CPU
through an explicit MixedPrecision plugin; Lightning turns a plain "16-mixed" into bf16 there).
KIND: none; blow (layer "blow" multiplies its output by 1e5 on optimizer step S: an fp16
overflow); booster (layer "booster" multiplies its fp32 output by 1e5 on every step, before the
half-precision "head" matmul). Prints one "micro_loss <value>" line per training micro-batch and
"train_time cpu_s=... wall_s=..." (process CPU and wall time of trainer.fit).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _planted import PlantedLinear  # noqa: E402


class TinyModule(pl.LightningModule):
    def __init__(self, plant: str = "none", plant_at: int = 3, accum: int = 1, width: int = 32):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.act = nn.ReLU()
        calls = range(plant_at * accum, (plant_at + 1) * accum)
        if plant == "blow":
            self.blow: nn.Module = PlantedLinear(width, 1e5, at=calls)
        elif plant == "booster":
            self.booster: nn.Module = PlantedLinear(width, 1e5, fp32=True)
        else:
            self.mid: nn.Module = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)
        self.micro_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.inp(x))
        for name in ("blow", "booster", "mid"):
            if hasattr(self, name):
                h = getattr(self, name)(h)
        return self.head(h)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.micro_losses.append(float(loss.detach()))
        self.log("train_loss", loss, on_step=True, on_epoch=False, batch_size=x.shape[0])
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def make_trainer(
    precision: str, steps: int, accum: int, callbacks: list, root: str, logger: Any = False
) -> pl.Trainer:
    plugins = []
    if precision == "fp16-cpu":
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins.append(MixedPrecision("16-mixed", "cpu"))
        precision_arg = None
    else:
        precision_arg = precision
    kwargs = {} if precision_arg is None else {"precision": precision_arg}
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accum,
        callbacks=callbacks,
        plugins=plugins,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        default_root_dir=root,
        **kwargs,
    )


def data(steps: int, accum: int, batch: int = 8) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    n = steps * accum * batch
    ds = torch.utils.data.TensorDataset(
        torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)
    )
    return torch.utils.data.DataLoader(ds, batch_size=batch)


def main(argv: list[str] | None = None) -> TinyModule:
    p = argparse.ArgumentParser()
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--plant", default="none")
    p.add_argument("--plant-step", type=int, default=3)
    p.add_argument("--callback", default=None)
    p.add_argument("--config", default=None)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--root", default=".")
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    callbacks = []
    if a.callback:
        from amprobe.integrations.lightning import AmprobeCallback

        callbacks.append(AmprobeCallback(a.callback, json.loads(a.config) if a.config else None))
    module = TinyModule(a.plant, a.plant_step, a.accum, a.width)
    trainer = make_trainer(a.precision, a.steps, a.accum, callbacks, a.root)
    loader = data(a.steps, a.accum, a.batch)
    cpu, wall = time.process_time(), time.perf_counter()
    trainer.fit(module, loader)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    for value in module.micro_losses:
        print(f"micro_loss {value!r}")
    print(f"train_time cpu_s={cpu:.6f} wall_s={wall:.6f}")
    print(f"trained {trainer.global_step} steps", flush=True)
    return module


if __name__ == "__main__":
    main()
