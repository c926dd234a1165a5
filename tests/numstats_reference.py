"""The v1 reference reduction of numstats: the original per-element statistics, kept for tests.

:func:`stats_v1_` is the reduction amprobe first shipped (about eight elementwise passes per
tensor: fp32 copy, abs, divide, shift, ``index_add_``, two compares with their sums, max). It
says what every column of the numstats table means in the plainest terms, so the tests compare
:class:`~amprobe.capture.collectors.numstats.StepStats` (eager and compiled kernel, host and
sync-free modes) against it, and ``benchmarks/bench_numerics_v2.py`` times it as the baseline.
It is not part of the package: amprobe records with the v2 reduction only.
"""

from __future__ import annotations

import torch

from amprobe.capture.collectors.numstats import (
    C_AMAX,
    C_FLUSH16,
    C_IN_BAD,
    C_NAN,
    C_OVER16,
    C_ZEROS,
    OVER16,
    K,
    exponent_column,
    flush_threshold,
)

__all__ = ["StepStatsV1", "count_nonfinite_v1", "stats_v1", "stats_v1_"]

_NAN_BITS = 0x7F800000  # |x| bits above this are NaN (fp32 inf's pattern)


def stats_v1_(
    row: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor | None = None,
    ones: torch.Tensor | None = None,
) -> None:
    """Accumulate ``x`` into ``row`` (``K`` int64 columns) the original way (reference).

    Args:
        row: the slot's row of the table, updated in place.
        x: a floating tensor; gradients are passed with their ``scale``.
        scale: the loss scale to divide by (a 0-d fp32 tensor on ``x``'s device), or None.
        ones: a one-element int64 tensor on ``x``'s device (allocated when None).
    """
    if ones is None:
        ones = torch.ones(1, dtype=torch.int64, device=x.device)
    with torch.no_grad():
        a = x.detach().to(torch.float32, copy=True).abs_()
        if scale is not None:
            a.div_(scale)
        bits = a.view(torch.int32).reshape(-1)
        row.index_add_(0, exponent_column(bits.to(torch.int64)), ones.expand(bits.numel()))
        row[C_ZEROS].add_((bits == 0).sum())
        row[C_OVER16].add_((a >= OVER16).sum())
        row[C_FLUSH16].add_((a <= flush_threshold(scale, x.device)).sum())
        row[C_NAN].add_((bits > _NAN_BITS).sum())
        row[C_AMAX : C_AMAX + 1].clamp_min_(bits.amax())


def stats_v1(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The v1 row (``K`` int64) of one tensor."""
    row = torch.zeros(K, dtype=torch.int64, device=x.device)
    if x.numel():
        stats_v1_(row, x, scale)
    return row


def count_nonfinite_v1(x: torch.Tensor, sync_free: bool | None = None) -> torch.Tensor:
    """v1's non-finite count of a module input (reference for ``numstats.count_nonfinite``)."""
    return (~torch.isfinite(x.detach())).sum()


class StepStatsV1:
    """``StepStats``' interface over the v1 reduction (reference and benchmark baseline)."""

    def __init__(self, slots: int, device: torch.device, sync_free: bool | None = None) -> None:
        self.slots = slots
        self.device = device
        self.sync_free = device.type != "cpu" if sync_free is None else sync_free
        self._buf = torch.zeros(slots, K, dtype=torch.int64, device=device)
        self._ones = torch.ones(1, dtype=torch.int64, device=device)

    def reset(self) -> StepStatsV1:
        self._buf.zero_()
        return self

    def add(
        self,
        slot: int,
        x: torch.Tensor,
        scale: torch.Tensor | None = None,
        in_bad: torch.Tensor | int | None = None,
    ) -> None:
        if x.numel():
            stats_v1_(self._buf[slot], x, scale, self._ones)
        if in_bad is not None:
            self._buf[slot, C_IN_BAD] += in_bad

    def add_in_bad(self, slot: int, in_bad: torch.Tensor | int) -> None:
        self._buf[slot, C_IN_BAD] += in_bad

    def count_nonfinite(self, x: torch.Tensor) -> torch.Tensor:
        return count_nonfinite_v1(x)

    def table(self) -> torch.Tensor:
        return self._buf.clone()
