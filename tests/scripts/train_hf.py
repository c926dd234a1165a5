"""A Hugging Face Trainer loop on a tiny GPT-2 built from a config, random token ids, CPU.

Nothing is downloaded. Usage: python train_hf.py [--precision no|bf16|fp16] [--steps N]
[--accum K] [--plant-step S] [--callback RUN_DIR] [--config JSON] [--out DIR]
With --plant-step, the layer "transformer.h.0.mlp.c_proj" multiplies its output by a gain that
overflows the run's precision on optimizer step S. Prints "logged_loss STEP VALUE" for each
entry of the Trainer's log history and "train_time cpu_s=... wall_s=..." (process CPU and wall
time of trainer.train()).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _planted import PlantedLinear  # noqa: E402

VOCAB, SEQ, EMBD = 64, 16, 32


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def build_model(precision: str, plant_step: int | None, accum: int, embd: int = EMBD):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=embd, n_head=2, vocab_size=VOCAB, n_positions=SEQ)
    model = GPT2LMHeadModel(config)
    if plant_step is not None:
        gain = 1e5 if precision == "fp16" else 1e39  # beyond fp16's range / beyond fp32 and bf16's
        calls = range(plant_step * accum, (plant_step + 1) * accum)
        mlp = model.transformer.h[0].mlp
        mlp.c_proj = PlantedLinear(4 * embd, gain, at=calls, out_features=embd)
    return model


def main(argv: list[str] | None = None, callbacks: list | None = None) -> Trainer:
    p = argparse.ArgumentParser()
    p.add_argument("--precision", default="bf16")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--plant-step", type=int, default=None)
    p.add_argument("--callback", default=None)
    p.add_argument("--config", default=None)
    p.add_argument("--out", default="hf_out")
    p.add_argument("--embd", type=int, default=EMBD)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args(argv)
    callbacks = list(callbacks or [])
    if a.callback:
        from amprobe.integrations.hf import AmprobeCallback

        config = json.loads(a.config) if a.config else None
        callbacks.insert(0, AmprobeCallback(a.callback, config))
    args = TrainingArguments(
        output_dir=a.out,
        per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=a.accum,
        max_steps=a.steps,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-3,
        fp16=a.precision == "fp16",
        bf16=a.precision == "bf16",
        dataloader_num_workers=0,
    )
    model = build_model(a.precision, a.plant_step, a.accum, a.embd)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(a.steps * a.accum * a.batch),
        callbacks=callbacks,
    )
    cpu, wall = time.process_time(), time.perf_counter()
    trainer.train()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"logged_loss {entry['step']} {entry['loss']!r}")
    print(f"train_time cpu_s={cpu:.6f} wall_s={wall:.6f}")
    print(f"trained {trainer.state.global_step} steps", flush=True)
    return trainer


if __name__ == "__main__":
    main()
