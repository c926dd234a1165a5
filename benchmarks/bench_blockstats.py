"""Block statistics (#36) alone: the compiled CPU kernel against the eager torch reduction.

Run: ``python benchmarks/bench_blockstats.py [--reps 5]``.

Part 1: one 2048x1024 tensor (fp32 and bf16) reduced for X's default rows (9 format
orientations: per-tensor fp8, blockwise fp8, MXFP8, MXFP4, NVFP4, both orientations), best of
``--reps``, one intra-op thread; printed as ns per element per format-evaluation (the time of
the whole call, amax pass and read included, over elements x rows).

Part 2: the GEMM operands of one TinyGPT bf16 step (``common.TinyGPT``, batch 16x128; X, W and
dY of each ``nn.Linear``, kept by hooks, reduced outside the step) against the time of one
plain training step: what a sampled step's block statistics add, before hooks and bookkeeping.

Measured 2026-12-06 on an Intel Xeon (Sapphire Rapids, AVX-512; 2 cores shared, load 3.7):
part 1 kernel 0.44 / 0.42 ns per element per format-evaluation (fp32 / bf16), eager 24 / 23
ns; part 2 a 337 ms step, 27 operands, 26.0M elements, 231M format-evaluations: 109 ms (0.47
ns each), 1.32x the step (an earlier run at load 3.5: 0.71 / 0.76 ns, 1.40x).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import TinyGPT, make_batch, train_steps  # noqa: E402
from machine import cpu_model  # noqa: E402

from amprobe.capture.collectors import blockstats, numkernel  # noqa: E402
from amprobe.store.blockformats import DEFAULT_FORMATS, rows_for  # noqa: E402


def _best(f, reps: int) -> float:
    f()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def part1(reps: int) -> None:
    k = numkernel.wait()
    rows = rows_for("x", DEFAULT_FORMATS)
    print(f"kernel: {numkernel.status()}")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2048, 1024).to(dtype)
        n = x.numel() * len(rows)
        cells = []
        if k is not None:
            t = _best(lambda x=x: blockstats._kernel(k, x, "x", rows, None), reps)
            cells.append(f"kernel {t * 1e3:6.1f} ms {t / n * 1e9:6.3f} ns")
        t = _best(lambda x=x: blockstats._eager(x, "x", rows, None), max(1, reps // 3))
        cells.append(f"eager {t * 1e3:7.1f} ms {t / n * 1e9:6.2f} ns")
        print(f"2048x1024 {str(dtype):15s} {len(rows)} rows: " + " | ".join(cells))


def part2(reps: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = make_batch()
    step = sorted(train_steps(model, opt, None, torch.bfloat16, batch, 3))[1]
    kept: list[tuple[str, torch.Tensor]] = []
    handles = []
    for m in model.modules():
        if isinstance(m, nn.Linear):

            def fwd(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
                kept.append(("x", args[0].detach()))
                kept.append(("w", mod.weight.detach()))

            def bwd(mod: nn.Module, gin: tuple, gout: tuple) -> None:
                kept.append(("dy", gout[0].detach()))

            handles.append(m.register_forward_hook(fwd))
            handles.append(m.register_full_backward_hook(bwd))
    train_steps(model, opt, None, torch.bfloat16, batch, 1)
    for h in handles:
        h.remove()
    views = [(op, blockstats.canonical(op, t, "Linear")[0]) for op, t in kept]
    elements = sum(v.numel() for _, v in views)
    evals = sum(v.numel() * len(rows_for(op, DEFAULT_FORMATS)) for op, v in views)

    def run() -> None:
        for op, v in views:
            blockstats.measure(v, op, DEFAULT_FORMATS)

    t = _best(run, reps)
    print(
        f"TinyGPT bf16 step {step * 1e3:.0f} ms (thread CPU); its {len(views)} Linear operands, "
        f"{elements / 1e6:.1f}M elements, {evals / 1e6:.0f}M format-evaluations: "
        f"{t * 1e3:.0f} ms ({t / evals * 1e9:.3f} ns each), {1 + t / step:.2f}x the step"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-tinygpt", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"CPU: {cpu_model()}")
    part1(args.reps)
    if not args.skip_tinygpt:
        part2(args.reps)


if __name__ == "__main__":
    main()
