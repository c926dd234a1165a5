"""A tiny compiled transformer trained with bf16 autocast; counts how often compiled graphs run.

Usage: ``python train_compiled.py OUT_JSON [--steps N] [--backend aot_eager|inductor]
[--how module|method|function|eager] [--attach compiled|original|none] [--scaler] [--plant STEP]``
(``--how eager``: the same model and steps, not compiled).

The backend is wrapped so that every call of a compiled forward graph is counted; the script
writes, per step, the graph calls, the loss (as a float's exact repr) and torch._dynamo's own
counters (unique graphs, graph breaks, recompiles) to ``OUT_JSON``. ``--attach`` calls
``amprobe.attach`` in the script (with the compiled wrapper or the original module); under
``amprobe run`` use ``--attach none``. Used by tests/test_compile.py and
benchmarks/bench_compile.py.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

CALLS = Counter()


def counting(name: str):
    """``name``'s backend, counting the graphs it compiles (``CALLS["graphs_compiled"]``, the
    seconds it took in ``CALLS["backend_ms"]``) and every call of one (``graph_calls``)."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(name)

    def backend(gm, example_inputs):
        t0 = time.perf_counter()
        compiled = inner(gm, example_inputs)
        CALLS["backend_ms"] += round((time.perf_counter() - t0) * 1e3)
        CALLS["graphs_compiled"] += 1

        def run(*args):
            CALLS["graph_calls"] += 1
            return compiled(*args)

        return run

    backend.compiler_name = name  # what amprobe reads as the backend (it wraps ``name``)
    return backend


def dynamo_counts() -> dict:
    """What the compiler did in this process: dynamo's own counters and compile time, and the
    counting backend's graphs."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
        "frames_ok": counters["frames"]["ok"],
        "frames_total": counters["frames"]["total"],
        "graphs_compiled": CALLS["graphs_compiled"],
        "backend_s": CALLS["backend_ms"] / 1e3,
        # every frame's tracing and its backend compile
        "dynamo_compile_s": sum(compilation_time_metrics.get("_compile.compile_inner", [])),
    }


class Booster(nn.Module):
    """Multiplies its input by a large factor on the planted step (a forward overflow)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("factor", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.booster = Booster()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        x = x + self.booster(self.out(F.gelu(self.fc(self.ln2(x)))))
        return x


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, blocks: int = 2, t: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(t, d))
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--how", default="module", choices=["module", "method", "function", "eager"])
    ap.add_argument("--attach", default="none", choices=["compiled", "original", "none"])
    ap.add_argument("--scaler", action="store_true", help="fp16 + GradScaler instead of bf16")
    ap.add_argument("--plant", type=int, default=-1, help="step whose booster multiplies by 1e6")
    ap.add_argument("--config", default="{}", help="amprobe config as JSON (with --attach)")
    ap.add_argument("--d", type=int, default=32)
    ap.add_argument(
        "--switch-dtype-at", type=int, default=-1, help="from this step autocast runs fp16"
    )
    args = ap.parse_args()

    torch.manual_seed(0)
    model = TinyGPT(d=args.d)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = torch.float16 if args.scaler else torch.bfloat16
    scaler = torch.amp.GradScaler("cpu", enabled=args.scaler)
    backend = counting(args.backend)

    if args.how == "module":
        compiled = torch.compile(model, backend=backend)
    elif args.how == "method":
        model.compile(backend=backend)
        compiled = model
    else:  # a compiled function, or not compiled at all
        compiled = model

    current = {"dtype": dtype}

    def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=current["dtype"]):
            logits = (compiled if args.how != "function" else model)(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))

    if args.how == "function":
        forward_loss = torch.compile(forward_loss, backend=backend)

    probe = None
    if args.attach != "none":
        import amprobe

        target = compiled if args.attach == "compiled" else model
        probe = amprobe.attach(
            model=target, optimizer=opt, scaler=scaler, config=json.loads(args.config)
        )

    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g))
        for _ in range(4)
    ]
    boosters = [m for m in model.modules() if isinstance(m, Booster)]
    steps = []
    for step in range(args.steps):
        before = CALLS["graph_calls"]
        for b in boosters:
            b.factor.fill_(1e6 if step == args.plant else 1.0)
        if step == args.switch_dtype_at:
            current["dtype"] = torch.float16
        x, y = data[step % len(data)]
        t0 = time.perf_counter()
        loss = forward_loss(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        steps.append(
            {"graph_calls": CALLS["graph_calls"] - before, "loss": repr(loss.item()), "t": dt}
        )
    if probe is not None:
        probe.close()
    result = {"steps": steps, **dynamo_counts()}
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"trained {args.steps} steps")


if __name__ == "__main__":
    main()
