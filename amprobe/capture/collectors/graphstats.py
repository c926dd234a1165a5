"""Per-layer activation statistics that run inside a compiled graph, on sampled steps only.

A forward hook met inside a ``torch.compile`` region is traced into the graph. The hooks made
here are written for that: on a step that is not sampled they return at once (a guarded Python
flag, so the compiled graph is exactly the model's), and on a sampled step they add a handful of
reductions of the layer's output to a device buffer, as tensor ops with no ``.item()``, no
Python branch on a value and no host-device sync. The two settings of the flag are two graph
variants, each compiled once; the buffer is read at the step's end (on CPU) or at flush.

Per layer and sampled step (columns of the buffer): elements, NaN, inf, finite values a real
fp16 cast makes inf (``>= 65520``), the largest magnitude (inf when inf is present, as the eager
statistics record it; the read side drops it when NaN is present), non-finite elements in the
layer's floating inputs, the position of its first call among the hooked layers, its calls, the
small end of the range as the eager statistics define it: zeros, nonzero values a real fp16 cast
makes zero (``|v| <= 2**-25``), nonzero values below fp16's smallest subnormal and smallest
normal (``2**-24``, ``2**-14``); the output's dtype (of its first call); and from column
:data:`HIST0` on the exponent histogram of its fp32 magnitudes in the eager statistics' bins
(``numstats``: exponent ``e`` in column ``HIST0 + e - E_MIN``, the zeros in the -127 bin,
nonzero values below ``2**-133`` in the -149 bin, inf and NaN in the 128 bin), binned with
integer and bit operations and added with one ``index_add_``. Not in the graph: output
gradients (see README, torch.compile).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from amprobe.capture.collectors.numstats import E_MIN, NBINS, counts_from_hist

__all__ = [
    "GRAPH_SAMPLE",
    "COLUMNS",
    "DTYPES",
    "HIST0",
    "exponent_bins",
    "first_float",
    "graph_stats_hook",
    "new_buffer",
]


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
    "dtype",
)
(
    _ELEMS,
    _NAN,
    _INF,
    _OVER,
    _AMAX,
    _INBAD,
    _ORDER,
    _CALLS,
    _ZEROS,
    _UNDER,
    _BSUB,
    _BNORM,
    _DTYPE,
) = range(len(COLUMNS))
#: the columns a call adds to, in the order ``_accumulate`` stacks its counts
_ADDED = (_NAN, _OVER, _ZEROS, _UNDER, _INBAD, _ELEMS, _CALLS)
#: first column of the exponent histogram (``NBINS`` columns follow, exponent ``E_MIN`` first)
HIST0 = len(COLUMNS)
#: the ``dtype`` column holds ``1 + `` the output dtype's index here (0: another dtype)
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
_FP16_OVERFLOW = 65520.0  # the smallest magnitude a round-to-nearest fp16 cast makes inf
_FP16_FLUSH = 2.0**-25  # the largest magnitude a round-to-nearest fp16 cast makes zero
_FP16_MIN_SUBNORMAL = 2.0**-24
_FP16_MIN_NORMAL = 2.0**-14


def read_row(values: list[float]) -> dict[str, float]:
    """A buffer row (``buf[slot].tolist()``) as the eager statistics record it: its columns by
    name, with what the graph leaves to the histogram read from it as an eager row's is
    (``numstats.counts_from_hist``: ``inf``, ``below_normal``, ``below_subnormal``), and
    ``amax`` inf when inf is present."""
    row = dict(zip(COLUMNS, values[:HIST0], strict=True))
    row.update(counts_from_hist(values[HIST0:], row["zeros"], row["nan"]))
    if row["inf"]:
        row["amax"] = math.inf
    return row


def new_buffer(slots: int, device: torch.device | None) -> torch.Tensor:
    """A zeroed ``[slots + 1, HIST0 + NBINS]`` float64 table on ``device`` (counts are exact
    up to 2**53); the last row holds the call counter (compiled graphs keep the mutations of
    the one buffer they read)."""
    return torch.zeros(slots + 1, HIST0 + NBINS, dtype=torch.float64, device=device)


def exponent_bins(x: torch.Tensor) -> torch.Tensor:
    """Histogram bin (``exponent - E_MIN``, int64) of each element's fp32 magnitude, as
    ``numstats.exponent_column`` places it (minus ``H0``), with integer and bit operations only.

    A normal value's bin is its biased exponent field plus 22; a subnormal's binade is that of
    its leading mantissa bit (bit patterns in ``[2**j, 2**(j+1))``, ``j`` = 16 .. 22, are the
    binade ``j - 149``), patterns below 2**16 (values below 2**-133) share the lump bin 0; zeros
    go to the -127 bin, inf and NaN (exponent field 255) to the last. A bf16 tensor's fp32
    pattern is its own shifted left by 16 (read as is: inductor vectorizes a 16-bit view better
    than a cast and a 32-bit view).
    """
    if x.dtype == torch.bfloat16:
        bits = (x.view(torch.int16).to(torch.int32) & 0x7FFF) << 16
    else:
        bits = x.float().abs().view(torch.int32)
    zero_bin = -127 - E_MIN
    normal = zero_bin + (bits >> 23)
    # a subnormal pattern's leading bit: the exponent of the pattern read as an integer and
    # converted to fp32 (exact below 2**24), four ops where comparing with each power of two
    # took eighteen (every op of this hook is traced and compiled once per layer)
    lead = (bits.to(torch.float32).view(torch.int32) >> 23) - 127
    sub = torch.where(bits >= 1 << 16, lead, 0)
    bins = torch.where(bits >= 1 << 23, normal, torch.where(bits == 0, zero_bin, sub))
    return bins.to(torch.int64)


def first_float(out: Any) -> torch.Tensor | None:
    """A module output's first floating tensor (the output itself, or in a tuple/list, or a
    dict's values: a Hugging Face ``ModelOutput``, whose first is the loss when there is one)."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, (tuple, list, dict)):
        for item in out.values() if isinstance(out, dict) else out:
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
    # What the histogram holds is read from it on the host, as the eager rows read theirs
    # (numstats.counts_from_hist): inf (its last bin holds inf and NaN), the counts below fp16's
    # normal and subnormal ranges, and an amax of inf when inf is present. Every op left here
    # is traced and compiled once per layer, in the sampled-step variant of the graph.
    finite = torch.isfinite(x)
    nan = torch.isnan(x).sum()
    # fp32 magnitudes (exact for every 16-bit value; fused by inductor, never materialized),
    # compared with the fp16 boundaries as the eager statistics define them (numstats)
    mag = torch.where(finite, x.float().abs(), 0.0)
    over = (mag >= _FP16_OVERFLOW).sum()
    amax = mag.amax().to(buf.dtype)  # of the finite values
    zeros = (x == 0).sum()
    flush = ((mag > 0) & (mag <= _FP16_FLUSH)).sum()
    in_bad = torch.zeros((), dtype=torch.int64, device=buf.device)
    for arg in args if isinstance(args, tuple) else (args,):
        if isinstance(arg, torch.Tensor) and arg.is_floating_point() and arg.device == x.device:
            in_bad = in_bad + (~torch.isfinite(arg.detach())).sum()
    row = buf[slot]
    first = row[_CALLS] == 0  # (read before the counts below add this call)
    row[_AMAX].copy_(torch.maximum(row[_AMAX], amax))
    row[_ORDER].copy_(torch.where(first, counter, row[_ORDER]))
    code = DTYPES.index(x.dtype) + 1 if x.dtype in DTYPES else 0  # a constant of the trace
    row[_DTYPE].copy_(torch.where(first, code, row[_DTYPE]))  # the first call's
    # the additive columns in one index_add_ (where seven slice updates were: every op of this
    # hook is traced and compiled once per layer)
    counts = torch.stack([nan, over, zeros, flush, in_bad])
    one = torch.ones((), dtype=buf.dtype, device=buf.device)
    added = torch.cat([counts.to(buf.dtype), torch.stack([one * float(x.numel()), one])])
    row.index_add_(0, torch.tensor(_ADDED, device=buf.device), added)
    bins = exponent_bins(x).reshape(-1)
    row[HIST0:].index_add_(0, bins, one.expand(bins.numel()))
    counter.add_(1.0)
