"""Large-model training shapes on one process: a transformer whose blocks are compiled one by one.

Usage: ``python train_blocks.py OUT_JSON [--blocks N] [--backend aot_eager|inductor]
[--dtype fp16|bf16] [--compile blocks|root|none] [--fullgraph] [--ac] [--plant STEP]
[--model gpt|mlp] [--steps N] [--attach]``.

``--compile blocks`` compiles each transformer block (``block.compile()``, as torchtitan does,
after activation checkpointing with ``--ac``); ``root`` compiles the whole model; ``none`` runs
it eagerly. ``--model mlp`` is the 2-layer MLP with a LayerNorm whose fp16 inductor job changed
its numbers under amprobe (issue 31 section 5). ``--plant STEP`` multiplies the weight of
``layers.0.mlp.booster`` (a Linear) by 1e6 on that step and the two after it (a recurring fp16
overflow in that layer's own output: the first arms amprobe's per-layer samples of the next). The backend is wrapped so that every call of a compiled graph is counted; the script
writes per step the graph calls and the loss (a float's exact repr), and dynamo's counters, to
``OUT_JSON``. Used by tests/test_compile_blocks.py and benchmarks/bench_compile_blocks.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # imported by path too
from train_compiled import CALLS, counting, dynamo_counts  # noqa: E402  (this script's folder)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.booster = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.booster(self.fc2(F.gelu(self.fc1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d)
        self.attention = Attention(d)
        self.ffn_norm = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.ffn_norm(x))


class TinyGPT(nn.Module):
    """torchtitan's layout: ``tok_embeddings``, ``layers`` (a ModuleDict), ``norm``, ``output``."""

    def __init__(self, blocks: int, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(d) for i in range(blocks)})
        self.norm = nn.LayerNorm(d)
        self.output = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(idx)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


class TwoLayerMLP(nn.Module):
    """The section-5 job's model: Linear, LayerNorm, GELU, Linear (with a Linear booster)."""

    def __init__(self, d: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.norm = nn.LayerNorm(4 * d)
        self.fc2 = nn.Linear(4 * d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--compile", default="blocks", choices=["blocks", "root", "none"])
    ap.add_argument("--fullgraph", action="store_true")
    ap.add_argument("--ac", action="store_true", help="activation checkpointing of each block")
    ap.add_argument("--plant", type=int, default=-1)
    ap.add_argument("--overflow-at", type=int, default=-1, help="mlp: inputs x1e5 at this step")
    ap.add_argument("--model", default="gpt", choices=["gpt", "mlp"])
    ap.add_argument("--attach", action="store_true", help="amprobe.attach() in the script")
    ap.add_argument("--run-dir", default=None, help="with --attach: the run directory")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun (gloo): fully_shard each block after its compile, then the root "
        "(torchtitan's order), param dtype fp16/bf16 with fp32 reduce, no autocast; each rank "
        "writes OUT_JSON with -r<rank> before .json",
    )
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    rank = 0
    if args.fsdp:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        args.out = args.out.replace(".json", f"-r{rank}.json")
    torch.manual_seed(0)
    model: nn.Module = TinyGPT(args.blocks) if args.model == "gpt" else TwoLayerMLP()
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    if args.fsdp:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler("cpu", enabled=args.dtype == "fp16")
    else:
        scaler = torch.amp.GradScaler("cpu", enabled=args.dtype == "fp16")
    backend = counting(args.backend)
    kw = {"backend": backend, "fullgraph": args.fullgraph}
    if args.model == "gpt":
        for name, block in list(model.layers.items()):
            if args.ac:
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                    checkpoint_wrapper,
                )

                block = checkpoint_wrapper(block, preserve_rng_state=False)
                model.layers[name] = block
            if args.compile == "blocks":
                block.compile(**kw)
            if args.fsdp:
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
                fully_shard(block, mp_policy=policy)
        if args.fsdp:
            fully_shard(model, mp_policy=policy)
    if args.compile == "root":
        model.compile(**kw)
    elif args.model == "mlp" and args.compile == "blocks":
        model.compile(**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    probe = None
    if args.attach:
        import amprobe

        probe = amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=args.run_dir)

    g = torch.Generator().manual_seed(1 + rank)
    if args.model == "gpt":
        data = [
            (torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g))
            for _ in range(4)
        ]
    else:
        data = [
            (torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
            for _ in range(4)
        ]
    booster = model.get_submodule("layers.0.mlp.booster") if args.model == "gpt" else None
    steps = []
    t_start = time.perf_counter()
    for step in range(args.steps):
        before = CALLS["graph_calls"]
        x, y = data[step % len(data)]
        if step == args.overflow_at:
            x = x * 1e5
        saved = None
        if booster is not None and args.plant <= step < args.plant + 3:
            saved = booster.weight.detach().clone()
            with torch.no_grad():
                booster.weight.mul_(1e6)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype, enabled=not args.fsdp):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if saved is not None:
            with torch.no_grad():
                booster.weight.copy_(saved)
        steps.append(
            {
                "graph_calls": CALLS["graph_calls"] - before,
                "loss": repr(loss.item()),
                "scale": scaler.get_scale() if scaler.is_enabled() else None,
                "t": dt,
            }
        )
    wall = time.perf_counter() - t_start
    if probe is not None:
        probe.close()
    if args.fsdp:
        dist.destroy_process_group()
    result = {"steps": steps, "wall_s": wall, **dynamo_counts()}
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"trained {args.steps} steps")


if __name__ == "__main__":
    main()
