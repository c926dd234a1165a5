"""Per-layer activation statistics that run inside a compiled graph, on sampled steps only.

A forward hook met inside a ``torch.compile`` region is traced into the graph. The hooks made
here are written for that: on a step that is not sampled they return at once (a guarded Python
flag, so the compiled graph is exactly the model's), and on a sampled step they add a handful of
reductions of the layer's output to a device buffer, as tensor ops with no ``.item()``, no
Python branch on a value and no host-device sync. The two settings of the flag are two graph
variants, each compiled once; the buffer is read at the step's end (on CPU) or at flush.

Per layer and sampled step (columns of the buffer): elements, NaN, inf, finite values a real
fp16 cast makes inf (``>= 65520``), finite amax, non-finite elements in the layer's floating
inputs, the position of its first call among the hooked layers, its calls, and the small end of
the range as the eager statistics define it: zeros, nonzero values a real fp16 cast makes zero
(``|v| <= 2**-25``), nonzero values below fp16's smallest subnormal and smallest normal
(``2**-24``, ``2**-14``). Not in the graph: the exponent histogram and output gradients.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GRAPH_SAMPLE", "COLUMNS", "first_float", "graph_stats_hook", "new_buffer"]


class _Flag:
    """Read by the hooks at trace time: dynamo guards on it, so each value has its own graph."""

    on = False


GRAPH_SAMPLE = _Flag()

#: buffer columns
COLUMNS = (
    "elements",
    "nan",
    "inf",
    "over_fp16",
    "amax",
    "in_nonfinite",
    "order",
    "calls",
    "zeros",
    "underflow_at_scale",
    "below_subnormal",
    "below_normal",
)
(_ELEMS, _NAN, _INF, _OVER, _AMAX, _INBAD, _ORDER, _CALLS, _ZEROS, _UNDER, _BSUB, _BNORM) = range(
    len(COLUMNS)
)
_FP16_OVERFLOW = 65520.0  # the smallest magnitude a round-to-nearest fp16 cast makes inf
_FP16_FLUSH = 2.0**-25  # the largest magnitude a round-to-nearest fp16 cast makes zero
_FP16_MIN_SUBNORMAL = 2.0**-24
_FP16_MIN_NORMAL = 2.0**-14


def new_buffer(slots: int, device: torch.device | None) -> torch.Tensor:
    """A zeroed ``[slots + 1, len(COLUMNS)]`` float64 table on ``device``; the last row holds
    the call counter (compiled graphs keep the mutations of the one buffer they read)."""
    return torch.zeros(slots + 1, len(COLUMNS), dtype=torch.float64, device=device)


def first_float(out: Any) -> torch.Tensor | None:
    """A module output's first floating tensor (the output itself, or in a tuple/list)."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                return item
    return None


def graph_stats_hook(buf: torch.Tensor, slot: int) -> Any:
    """A forward hook adding its module's output statistics to row ``slot`` of ``buf``."""

    def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
        if not GRAPH_SAMPLE.on:
            return
        x = first_float(out)
        if x is None or x.device != buf.device or x.numel() == 0:
            return
        with torch.no_grad():
            _accumulate(buf, slot, x.detach(), args)

    return hook


def _accumulate(buf: torch.Tensor, slot: int, x: torch.Tensor, args: Any) -> None:
    # the counter is taken from the buffer here, in the graph: a compiled graph keeps the
    # mutations of the buffer it reads, not those of a separate view passed in
    counter = buf[buf.shape[0] - 1, 0]
    finite = torch.isfinite(x)
    nan = torch.isnan(x).sum()
    inf = x.numel() - finite.sum() - nan
    # fp32 magnitudes (exact for every 16-bit value; fused by inductor, never materialized),
    # compared with the fp16 boundaries as the eager statistics define them (numstats)
    mag = torch.where(finite, x.float().abs(), 0.0)
    over = (mag >= _FP16_OVERFLOW).sum()
    amax = mag.amax().to(buf.dtype)
    nonzero = mag > 0
    zeros = (x == 0).sum()
    flush = (nonzero & (mag <= _FP16_FLUSH)).sum()
    below_subnormal = (nonzero & (mag < _FP16_MIN_SUBNORMAL)).sum()
    below_normal = (nonzero & (mag < _FP16_MIN_NORMAL)).sum()
    in_bad = torch.zeros((), dtype=buf.dtype, device=buf.device)
    for arg in args if isinstance(args, tuple) else (args,):
        if isinstance(arg, torch.Tensor) and arg.is_floating_point() and arg.device == x.device:
            in_bad = in_bad + (~torch.isfinite(arg.detach())).sum().to(buf.dtype)
    row = buf[slot]
    counts = torch.stack([nan, inf, over]).to(buf.dtype)
    row[_ELEMS].add_(float(x.numel()))
    row[_NAN : _OVER + 1].add_(counts)
    row[_AMAX].copy_(torch.maximum(row[_AMAX], amax))
    row[_INBAD].add_(in_bad)
    row[_ORDER].copy_(torch.where(row[_CALLS] == 0, counter, row[_ORDER]))
    row[_CALLS].add_(1.0)
    small = torch.stack([zeros, flush, below_subnormal, below_normal]).to(buf.dtype)
    row[_ZEROS : _BNORM + 1].add_(small)
    counter.add_(1.0)
