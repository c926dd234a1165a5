"""Shared pieces of the overhead benchmarks: a small transformer and a side-by-side timer.

Timing method (see shared/notes/feasibility.md): per-thread CPU time with one intra-op thread,
all configurations in one process, interleaved in blocks after warm-up, median per-step times
compared. Wall time on the shared 2-core machine is too noisy for percent-level ratios.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["TinyGPT", "make_batch", "train_steps", "compare", "print_table"]


class TinyGPT(nn.Module):
    """Decoder-only transformer: 4 layers, d=256, 4 heads, vocab 1024 (as in the feasibility notes)."""

    def __init__(
        self, vocab: int = 1024, d: int = 256, heads: int = 4, layers: int = 4, seq: int = 128
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[:, : idx.shape[1]]
        x = self.blocks(x, mask=self.mask[: idx.shape[1], : idx.shape[1]], is_causal=True)
        return self.head(self.norm(x))


def make_batch(
    batch: int = 16, seq: int = 128, vocab: int = 1024, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def train_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    dtype: torch.dtype | None,
    batch: tuple[torch.Tensor, torch.Tensor],
    n: int,
) -> list[float]:
    """Run ``n`` training steps; return each step's thread CPU time in seconds."""
    x, y = batch
    times = []
    for _ in range(n):
        t = time.thread_time()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.thread_time() - t)
    return times


def compare(
    configs: Mapping[str, Callable[[nn.Module, torch.optim.Optimizer, Any], Any] | None],
    dtype: torch.dtype = torch.bfloat16,
    use_scaler: bool = False,
    blocks: int = 6,
    steps_per_block: int = 8,
    warmup: int = 3,
) -> dict[str, float]:
    """Median step CPU time per configuration, measured in interleaved blocks.

    ``configs`` maps a name to ``None`` (plain training) or to a function
    ``(model, opt, scaler) -> closeable`` that attaches a probe and returns it.
    """
    stats = compare_stats(
        configs,
        dtype=dtype,
        use_scaler=use_scaler,
        blocks=blocks,
        steps_per_block=steps_per_block,
        warmup=warmup,
        skip_first=True,
    )
    return {name: median for name, (median, _) in stats.items()}


def compare_stats(
    configs: Mapping[str, Callable[..., Any] | None],
    dtype: torch.dtype = torch.bfloat16,
    use_scaler: bool = False,
    blocks: int = 2,
    steps_per_block: int = 100,
    warmup: int = 3,
    skip_first: bool = False,
    alternate: bool = False,
    per_block: dict[str, list[float]] | None = None,
) -> dict[str, tuple[float, float]]:
    """Like :func:`compare`, but returns ``(median, mean)`` per configuration.

    The mean over whole blocks includes the rare sampled steps (numerics every 100 steps, shape
    capture, sync counting) that a median hides; use blocks at least as long as the sampling
    period. ``skip_first`` leaves the first step after each attach untimed; ``alternate``
    reverses the order of the configurations every other block, so that none always runs right
    after another. ``per_block``, when given, receives each configuration's median step per
    block (for ratios of neighbouring blocks, which a machine whose speed drifts over minutes
    leaves comparable where overall medians are not).
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu") if use_scaler else None
    batch = make_batch()
    train_steps(model, opt, scaler, dtype, batch, warmup)
    samples: dict[str, list[float]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for block in range(blocks):
            order = list(configs.items())
            if alternate and block % 2:
                order.reverse()
            for i, (name, start) in enumerate(order):
                handle = start(model, opt, scaler, f"{tmp}/{name}-{block}-{i}") if start else None
                try:
                    if skip_first:
                        train_steps(model, opt, scaler, dtype, batch, 1)  # first step after attach
                    times = train_steps(model, opt, scaler, dtype, batch, steps_per_block)
                    samples[name].extend(times)
                    if per_block is not None:
                        per_block.setdefault(name, []).append(statistics.median(times))
                finally:
                    if handle is not None:
                        handle.close()
    return {name: (statistics.median(v), statistics.fmean(v)) for name, v in samples.items()}


def print_table(medians: Mapping[str, float], baseline: str = "off") -> None:
    base = medians[baseline]
    print(f"{'configuration':<28}{'median step (ms CPU)':>22}{'ratio':>10}")
    for name, value in medians.items():
        print(f"{name:<28}{value * 1e3:>22.1f}{value / base:>10.3f}")
