"""A tiny transformer whose blocks are compiled one by one, as large-model recipes do.

Usage: ``python train_roots.py [--how method|module|eager] [--steps N] [--plant 0,1,2]
[--scaler] [--backend aot_eager] [--ddp]``

``--how method`` calls ``block.compile()`` on each block, ``--how module`` replaces each block
by ``torch.compile(block)`` in its ``ModuleList``, ``--how eager`` compiles nothing. The outer
model (``embedding``, ``layers``, ``norm``, ``output``) is never compiled: the optimizer trains
its parameters, so it is the root model and layers are named from it (``layers.0.mlp.booster``).
On the steps in ``--plant`` the booster of block 0 multiplies by 1e6: an overflow made inside
block 0, whose non-finite output is block 1's input (never the model's). ``--scaler``: fp16
with ``GradScaler("cpu")``; else bf16 autocast. ``--ddp``: the model is wrapped in
``DistributedDataParallel`` (gloo; a 1-rank group on ``MASTER_PORT`` when not started by
torchrun). Run it under ``amprobe run``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # imported by path too
from train_compiled import Booster  # noqa: E402  (this script's folder)


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y)


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)
        self.booster = Booster()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.booster(self.out(F.gelu(self.fc(x))))


class TransformerBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attention = Attention(d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = Mlp(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, blocks: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(TransformerBlock(d) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)
        self.output = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--how", default="method", choices=["method", "module", "eager"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--plant", default="", help="comma-separated steps whose booster blows up")
    ap.add_argument("--scaler", action="store_true", help="fp16 + GradScaler instead of bf16")
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--ddp", action="store_true", help="wrap the model in DDP (gloo)")
    args = ap.parse_args()
    plant = {int(s) for s in args.plant.split(",") if s}

    torch.manual_seed(0)
    model = Transformer()
    if args.how == "method":
        for block in model.layers:
            block.compile(backend=args.backend)
    elif args.how == "module":
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=args.backend)
    if args.ddp:
        import torch.distributed as dist

        if "RANK" not in os.environ:  # one rank, no launcher
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        dist.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = torch.float16 if args.scaler else torch.bfloat16
    scaler = torch.amp.GradScaler("cpu", enabled=args.scaler)
    booster = next(m for m in model.modules() if isinstance(m, Booster))  # block 0's
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        x = torch.randint(0, 32, (2, 8), generator=g)
        y = torch.randint(0, 32, (2, 8), generator=g)
        booster.factor.fill_(1e6 if step in plant else 1.0)
        with torch.autocast("cpu", dtype=dtype):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    if args.ddp:
        dist.destroy_process_group()
    print(f"trained {args.steps} steps")


if __name__ == "__main__":
    main()
