"""Per-tensor range statistics: the reduction behind the ``numerics`` collector.

A measured tensor is reduced into one row of a per-step table, one row per slot (module and
tensor kind). The row layout (``K`` int64 columns) is what the collector reads back:

* ``C_ZEROS``: exact zeros of ``|x|`` (for gradients: of ``|x| / scale`` in fp32, so values
  that underflow to zero when unscaled count as zeros);
* ``C_NAN``: NaN count;
* ``C_AMAX``: fp32 bit pattern of the largest ``|x|`` (of ``|x| / scale`` for gradients);
  meaningless when NaN are present;
* ``C_IN_BAD``: non-finite elements in the module's floating inputs (added by the caller);
* ``C_OVER16``: values ``v`` (``|x|``, or ``|x| / scale`` for gradients) with ``v >= 65520``,
  inf included, NaN not: what a real fp16 cast makes inf (65520 is the round-to-nearest
  boundary: 65504 < v < 65520 rounds down to 65504);
* ``C_FLUSH16``: values with ``fp16(v * scale) == 0`` (``v * scale`` computed in fp32; scale 1
  for activations), zeros included: ``v * scale <= 2**-25``, the tie at 2**-25 rounding to
  even, i.e. to zero (:func:`flush_threshold` gives the bound on ``v``);
* ``H0 .. H0 + NBINS - 1``: histogram of the base-2 exponent ``e`` of ``v`` (``v`` in
  ``[2**e, 2**(e+1))``), column ``H0 + e - E_MIN`` for ``e`` in -149 .. 128. Exponents -133 ..
  -127 are fp32 subnormal binades, resolved exactly; column ``H_ZERO`` (exponent -127) also
  holds the zeros; ``H_LUMP`` (exponent -149) holds every nonzero value below 2**-133 (fp32
  subnormal binades -149 .. -134, which a 16-bit key cannot tell apart); exponents -148 ..
  -134 stay empty; ``H_NONFINITE`` (exponent 128) holds inf and NaN.

The reference for this table is the original per-element reduction (about eight elementwise
passes per tensor: fp32 copy, abs, divide by the scale, shift, ``index_add_``, two compares
with their sums, max). It does not ship: it lives with the tests, in
``tests/numstats_reference.py``, which compare every path here against it;
``benchmarks/bench_numerics_v2.py`` times it as the baseline.

:class:`StepStats` (and :func:`stats_v2` for one tensor) histograms the 16-bit magnitude
pattern of each tensor (``bits & 0x7FFF`` of fp16/bf16; the upper half of fp32, which is its
bf16 truncation) in one elementwise pass and one histogram pass. Every recorded count is a
sum of those 32768 bins: the exponent bins, the zeros, NaN, fp16-overflow and fp16-flush
counts of 16-bit tensors (each key's value is classified by a real fp16 cast), and, for
16-bit gradients, the effect of dividing by the loss scale (each bin's value is unscaled
exactly as the reference unscales each element, an fp32 division, so any scale gives the
reference's result, rounding into fp32 subnormals included). fp32 tensors need exact zeros,
NaN and the maximum besides: one ``aminmax`` reduction per tensor, plus a zero (or NaN) count
only when the histogram shows zeros (or non-finite values) could be present; and, since their
key (the bf16 truncation) cannot place 65520 or 2**-25 exactly, the fp16-overflow and
fp16-flush counts: an ``abs`` and two compare-and-count passes, kept on the device. The
32768-bin rows are folded into the table once per step (:meth:`StepStats.table`).

Devices: on CPU the histogram is ``bincount`` and the rare extra counts are decided on the host
(reading a CPU tensor costs no sync); scratch buffers are reused so large tensors do not fault
in fresh pages every call, and a large tensor object measured again in the same step at the
same version (a ``Dropout(p=0)`` or ``Identity`` returns its input; a gradient hooked twice)
reuses its histogram. With ``sync_free=True`` (the default on accelerators) no value is read
back: histograms go through ``index_add_``, fp32 zeros/NaN are always counted on the device,
and the fold's indices travel by pinned non-blocking copies, so a step issues kernels only.

On CPU the host mode runs the compiled kernel of :mod:`amprobe.capture.collectors.numkernel`
once it is built (a plain C pass, one per tensor: the 16-bit key, or for fp32 the unscaled key
and its exact extras), and this eager reduction until then or when no C compiler is available;
both give the same table. The kernel adds each tensor straight into the slot's table row
through a plan of its format and scale (:class:`_Plan`: the fold maps as runs of keys), so
those tensors keep no 32768-bin row and need no fold at the step's end. Each tensor's own row
is kept for the step (``K + 1`` counts): the same object measured again at the same version
adds it again instead of a pass; an activation's non-finite count is kept for
:meth:`StepStats.count_nonfinite`.

Cost on CPU (TinyGPT, one thread, cold tensors replayed): about 1 ns per element of a 16-bit
tensor with the eager reduction, against about 8 ns for the reference, and about 0.35 ns with
the compiled kernel (about 0.7 ns for fp32); see ``benchmarks/bench_numerics_v2.py``. With the
eager reduction an fp32 tensor costs about 4 ns per element (one thread, 4M-element
``randn``): about 2 ns for the key histogram and its extras, and about 2 ns more for the exact
fp16-overflow and fp16-flush counts (two compare-and-count passes), which its truncated key
cannot give.
"""

from __future__ import annotations

import math
import struct
import weakref
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from amprobe.capture.collectors import numkernel
from amprobe.capture.collectors.sharded import PLAIN_TENSORS

__all__ = [
    "C_ZEROS",
    "C_NAN",
    "C_AMAX",
    "C_IN_BAD",
    "C_OVER16",
    "C_FLUSH16",
    "E_MIN",
    "H0",
    "H_LUMP",
    "H_NONFINITE",
    "H_ZERO",
    "K",
    "NBINS",
    "OVER16",
    "FLUSH16",
    "SPARSE_LAYOUTS",
    "StepStats",
    "count_nonfinite",
    "counts_from_hist",
    "exponent_column",
    "flush_threshold",
    "stats_v2",
]

# table columns (the layout the collector reads back)
C_ZEROS, C_NAN, C_AMAX, C_IN_BAD, C_OVER16, C_FLUSH16 = 0, 1, 2, 3, 4, 5
_HOST_COLS = 6  # the per-slot counts before the histogram
H0 = 6
E_MIN = -149  # exponent of column H0: fp32's smallest subnormal binade
NBINS = 128 - E_MIN + 1  # exponents -149 .. 128
_N = TypeVar("_N", int, float)  # the counts of a table row: ints (eager) or floats (graph)
#: the sparse layouts: a tensor of one stores only its nonzero entries
SPARSE_LAYOUTS = (
    torch.sparse_coo,
    torch.sparse_csr,
    torch.sparse_csc,
    torch.sparse_bsr,
    torch.sparse_bsc,
)
K = H0 + NBINS
H_LUMP = H0  # nonzero values below 2**-133 (fp32 subnormal binades -149 .. -134)
H_ZERO = H0 + (-127 - E_MIN)  # zeros and [2**-127, 2**-126)
H_NONFINITE = K - 1  # inf and NaN
#: fp16's cast makes ``|v| >= OVER16`` inf (round to nearest: 65504 + half its step of 32)
OVER16 = 65520.0
#: fp16's cast makes ``|v| <= FLUSH16`` zero (half the min subnormal 2**-24; the tie goes to 0)
FLUSH16 = 2.0**-25
_OVER16_BITS = 0x477FF000  # fp32 bits of OVER16
_FLUSH16_BITS = 0x33000000  # fp32 bits of FLUSH16
_NAN_BITS = 0x7F800000  # |x| bits above this are NaN
_NKEYS = 1 << 15  # 16-bit magnitude patterns
_INF_KEY = 0x7F80  # upper half of fp32 inf: keys above are NaN
_SMALL = 8192  # below this many elements index_add_ beats bincount's 32768-bin output
_DUMMY = K  # scratch column for bins that add to no count
_ROW_BYTES = (K + 1) * 8  # a host-mode table row (int64)
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the kernel reads them as they are

# formats of the 16-bit key
_F16, _BF16, _F32 = 0, 1, 2  # _F32: upper 16 bits of an fp32 (exactly a bf16 truncation)
_KERNEL_FORMATS = {torch.float16: _F16, torch.bfloat16: _BF16, torch.float32: _F32}
_KEY_DTYPE = {_F16: torch.float16, _BF16: torch.bfloat16, _F32: torch.bfloat16}


def exponent_column(bits: torch.Tensor) -> torch.Tensor:
    """Table column of each fp32 magnitude bit pattern (int64, nonnegative): see the layout."""
    normal = H_ZERO + (bits >> 23)  # biased exponent b >= 1 is exponent b - 127
    # a subnormal's binade from its leading mantissa bit: bits in [2**j, 2**(j+1)) -> j - 149
    lead = torch.frexp(bits.to(torch.float64))[1].to(torch.int64) - 1
    sub = torch.where(bits >= 1 << 16, H0 + lead, H_LUMP)
    return torch.where(bits >= 1 << 23, normal, torch.where(bits == 0, H_ZERO, sub))


def flush_threshold(scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The largest fp32 ``t`` with ``fp16(t * scale) == 0`` (``t * scale`` rounded to fp32).

    ``fl32(t * scale)`` is monotone in ``t``, so the values a real fp16 cast at this scale
    flushes are exactly ``|v| <= t``. For a power-of-two scale ``t = 2**-25 / scale``; other
    scales are settled by trying the fp32 neighbours of that quotient, on the device (no sync).
    Returns a 0-d fp32 tensor on ``device``.
    """
    limit = torch.full((), FLUSH16, dtype=torch.float32, device=device)  # a fill: no copy
    if scale is None:
        return limit
    s = scale.detach().to(device=device, dtype=torch.float32)
    guess = (limit / s).view(torch.int32)
    steps = torch.arange(-2, 3, dtype=torch.int32, device=device)
    candidates = (guess + steps).clamp_min(0).view(torch.float32)
    fits = candidates * s <= limit
    return torch.where(fits, candidates, 0.0).amax()


# -- v2 ----------------------------------------------------------------------------------------
def count_nonfinite(x: torch.Tensor, sync_free: bool | None = None) -> torch.Tensor | int:
    """Non-finite elements of a floating tensor.

    On CPU (``sync_free`` False) the compiled kernel counts a contiguous fp32/fp16/bf16 tensor
    in one pass without a dispatched op (once it is built), else one ``aminmax`` pass decides on
    the host whether anything is non-finite and only then counts, returning an int; otherwise
    returns a 0-d int64 tensor on ``x``'s device without reading it back.
    """
    if x.is_nested or x.layout is not torch.strided:
        return _count_stored_nonfinite(x, sync_free)
    if sync_free is None:
        sync_free = x.device.type != "cpu"
    if not sync_free:
        fmt = _KERNEL_FORMATS.get(x.dtype)
        # (a host pointer only: a caller's sync_free=False on a device tensor costs a read)
        if fmt is not None and type(x) in PLAIN_TENSORS and x.is_cpu and x.is_contiguous():
            kern = numkernel.kernel()
            if kern is not None:
                return int(kern.nonfinite(x.data_ptr(), x.numel(), fmt))
    x = x.detach()
    if not sync_free:
        if x.numel() == 0:
            return 0
        lo, hi = torch.aminmax(x)
        if math.isfinite(float(lo)) and math.isfinite(float(hi)):
            return 0
        return x.numel() - int(torch.isfinite(x).sum())
    return x.numel() - torch.isfinite(x).sum()


def _count_stored_nonfinite(x: torch.Tensor, sync_free: bool | None) -> torch.Tensor | int:
    """Non-finite elements of a tensor that is not one strided block: a sparse tensor's stored
    entries (the others are zeros), a nested tensor's components, another layout densified."""
    if x.is_nested:
        total: torch.Tensor | int = 0
        for part in x.unbind():
            total = total + count_nonfinite(part, sync_free)
        return total
    if x.layout is torch.sparse_coo:
        return count_nonfinite(x._values(), sync_free)
    if x.layout in SPARSE_LAYOUTS:  # the compressed ones
        return count_nonfinite(x.values(), sync_free)
    return count_nonfinite(x.to_dense(), sync_free)


def counts_from_hist(hist: Sequence[_N], zeros: _N, nan: _N) -> dict[str, _N]:
    """What a row's exponent histogram (``NBINS`` counts, exponent ``E_MIN`` first) tells
    beyond its count columns: ``inf`` (the last bin holds inf and NaN), ``below_normal`` and
    ``below_subnormal`` (nonzero ``|v| < 2**-14`` / ``< 2**-24``: whole binades, the zeros
    sharing the -127 bin). Read the same way from the eager table and the in-graph buffer."""
    return {
        "inf": hist[-1] - nan,
        "below_normal": sum(hist[: -14 - E_MIN]) - zeros,
        "below_subnormal": sum(hist[: -24 - E_MIN]) - zeros,
    }


def _key_format(dtype: torch.dtype) -> int:
    if dtype == torch.float16:
        return _F16
    if dtype == torch.bfloat16:
        return _BF16
    return _F32


class _Maps:
    """Where each of the 32768 key values lands in a row, for one format and scale.

    ``fbits`` is the fp32 bit pattern of each key's value (unscaled exactly as the reference
    unscales an element: an fp32 division), ``exp_col`` its histogram column, ``flag_col``
    (zeros, NaN), ``over_col`` and ``flush_col`` the count columns it adds to (16-bit formats;
    an fp32 key is a truncation and its counts are taken per tensor instead). On the host the
    fold is cheaper: keys come in blocks that share a source exponent (128 keys for bf16
    layouts, 1024 for fp16); a block whose keys all land in one exponent bin is summed first (a
    reshape-sum), and only the other blocks (subnormals, rounding at a non-power-of-two scale)
    are gathered key by key. Zero and flushed keys form prefixes, NaN and fp16-overflowing keys
    suffixes, ``fbits`` being monotone.
    """

    def __init__(
        self,
        fmt: int,
        scale: torch.Tensor | None,
        flush_at: torch.Tensor,
        device: torch.device,
        host: bool,
    ) -> None:
        keys = torch.arange(_NKEYS, dtype=torch.int16, device=device)
        values = keys.view(_KEY_DTYPE[fmt]).to(torch.float32)
        if scale is not None:
            values = values / scale  # the reference's unscaling, per value instead of per element
        fbits = values.view(torch.int32).to(torch.int64)
        self.fbits = fbits
        self.exp_col = exponent_column(fbits)
        if fmt == _F32:  # key 0: zeros and values below 2**-133; the zeros are moved per tensor
            self.exp_col[0] = H_LUMP
        wide = fmt == _F32
        zero, nan = fbits == 0, fbits > _NAN_BITS
        over = (fbits >= _OVER16_BITS) & ~nan
        flushed = values <= flush_at
        # fp32 zeros and NaN are counted exactly per tensor instead (torch.where, not a mask
        # assignment: that would read a count back on an accelerator)
        self.flag_col = torch.where(
            zero & (not wide), C_ZEROS, torch.where(nan & (not wide), C_NAN, _DUMMY)
        )
        self.over_col = torch.where(over & (not wide), C_OVER16, _DUMMY)
        self.flush_col = torch.where(flushed & (not wide), C_FLUSH16, _DUMMY)
        if not host:
            return
        self.block = block = 1024 if fmt == _F16 else 128
        blocks = self.exp_col.view(_NKEYS // block, block)
        aligned = (blocks == blocks[:, :1]).all(1)
        self.coarse_blocks = aligned.nonzero().flatten()
        self.coarse_col = blocks[self.coarse_blocks, 0]
        fine = (~aligned).nonzero().flatten()
        self.fine_keys = (fine[:, None] * block + torch.arange(block)).flatten()
        self.fine_col = self.exp_col[self.fine_keys]
        self.zero_end = int(zero.sum())
        self.flush_end = int(flushed.sum())
        self.nan_start = _NKEYS - int(nan.sum())
        self.over_start = _NKEYS - int(over.sum()) - int(nan.sum())


class _Plan:
    """:class:`_Maps` as the compiled kernel reads it (host mode): the keys in segments.

    A segment is a maximal run of keys that add to the same columns: one histogram column and
    the count columns of its flags (``numkernel.SEGMENT_FLAGS``: zeros, NaN, fp16-overflow,
    fp16-flush; none for fp32 keys, whose counts are exact per element). A run ends at every
    change and at the first non-finite key (the kernel returns the count from there on: an
    activation's inf/NaN count). ``seg_of`` gives each key's segment (uint16), ``fbits`` its
    value's fp32 bits (for the maximum, 16-bit formats), ``plan`` the int32 header and
    segment arrays (layout: ``numkernel.PLAN_FIELDS``). Built once per format and scale.
    """

    def __init__(self, maps: _Maps, fmt: int) -> None:
        col = maps.exp_col
        flags = torch.zeros(_NKEYS, dtype=torch.int64)
        if fmt != _F32:
            bit = numkernel.SEGMENT_FLAGS
            flags |= torch.where(maps.flag_col == C_ZEROS, bit["zeros"], 0)
            flags |= torch.where(maps.flag_col == C_NAN, bit["nan"], 0)
            flags |= torch.where(maps.over_col == C_OVER16, bit["over"], 0)
            flags |= torch.where(maps.flush_col == C_FLUSH16, bit["flush"], 0)
        bad_from = {_F16: 0x7C00, _BF16: _INF_KEY}.get(fmt, _NKEYS)
        cls = col * 16 + flags
        change = torch.ones(_NKEYS, dtype=torch.bool)
        change[1:] = cls[1:] != cls[:-1]
        if bad_from < _NKEYS:
            change[bad_from] = True
        starts = change.nonzero().flatten()
        nseg = starts.numel()
        if nseg > numkernel.MAXSEG:  # cannot happen: columns are monotone in the key
            raise RuntimeError(f"numstats kernel plan: {nseg} segments")
        values = {
            "nseg": nseg,
            "bad_from": bad_from,
            "amax_from_keys": int(fmt != _F32),
            "zeros": C_ZEROS,
            "nan": C_NAN,
            "amax": C_AMAX,
            "over": C_OVER16,
            "flush": C_FLUSH16,
            "lump": H_LUMP,
            "zero_bin": H_ZERO,
            "ncols": K + 1,
        }
        header = torch.zeros(numkernel.PLAN_HEADER, dtype=torch.int64)
        header[: len(numkernel.PLAN_FIELDS)] = torch.tensor(
            [values[f] for f in numkernel.PLAN_FIELDS]
        )
        ends = torch.tensor([_NKEYS])
        parts = [header, starts, ends, col[starts], flags[starts]]
        self.plan = torch.cat(parts).to(torch.int32)
        self.seg_of = (change.cumsum(0) - 1).to(torch.int16)
        self.fbits = maps.fbits.to(torch.int32)  # nonnegative: magnitudes
        self.pointers = (self.plan.data_ptr(), self.seg_of.data_ptr(), self.fbits.data_ptr())


class StepStats:
    """Statistics of one step on one device: 32768-bin key histograms, folded at the end.

    Args:
        slots: rows of the table.
        device: where the measured tensors live.
        sync_free: never read a device value back (default: True off CPU).
        kernel: host mode on CPU: use the compiled kernel (``numkernel``) once it is built
            (None, the default), never (False), or wait for it and raise when it cannot be
            built (True: tests and benchmarks).

    ``add`` is the hot path; ``table`` folds everything into the ``(slots, K)`` table once.
    ``reset`` makes the object reusable for another step with the same slots and device.
    """

    def __init__(
        self,
        slots: int,
        device: torch.device,
        sync_free: bool | None = None,
        kernel: bool | None = None,
    ) -> None:
        self.slots = slots
        self.device = device
        self.sync_free = device.type != "cpu" if sync_free is None else sync_free
        # the compiled CPU kernel (numkernel): None = once it is built, True = wait for it
        self._kernel_mode = kernel
        self._kernel: numkernel.Kernel | None = None
        if kernel and not self.sync_free:
            self._kernel = numkernel.wait()
            if self._kernel is None:
                raise RuntimeError(f"numstats kernel: {numkernel.status()}")
        self._sub: torch.Tensor | None = None  # the kernel's sub-histogram scratch (zeroed)
        # this step's kernel function and arguments per (dtype, grad): see _call
        self._calls: dict[tuple[torch.dtype, bool], tuple[Any, tuple[Any, ...]]] = {}
        # the kernel's plans per (format, grad, scale), kept across steps like the fold maps
        self._plans: dict[tuple[int, bool, float | None], _Plan] = {}
        # host mode: the table rows the kernel adds into, per call (C_AMAX holds a maximum)
        self._kt = torch.zeros(0 if self.sync_free else slots, K + 1, dtype=torch.int64)
        self._kt_ptr = self._kt.data_ptr()
        self._kt_used = False
        # host mode: each kernel-measured tensor's own row, added again for a repeat
        self._keep = torch.zeros(0, K + 1, dtype=torch.int64)
        self._keep_ptr = self._keep.data_ptr()
        self._keep_used = 0
        self._ones = torch.ones(1, dtype=torch.int64, device=device)
        # per (format, grad) group: histogram rows [n, 32768] and the slot of each row
        self._hist: dict[tuple[int, bool], torch.Tensor] = {}
        self._row_of: dict[tuple[int, bool], dict[int, int]] = {}
        self._scratch: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        # fold maps per (format, grad, scale): kept across steps on the host, where the scale
        # is a known value (a step's scale seldom changes); rebuilt per step when sync-free
        self._maps: dict[tuple[int, bool, float | None], _Maps] = {}
        self._flush16 = flush_threshold(None, device)
        self.reset()

    def reset(self) -> StepStats:
        """Zero everything for the next step (keeps buffers)."""
        for group, rows in self._row_of.items():
            self._hist[group][: len(rows)].zero_()
            rows.clear()
        if self.sync_free or len(self._maps) > 16:
            self._maps.clear()
        if len(self._plans) > 16:
            self._plans.clear()
        if self._kt_used:
            self._kt.zero_()
            self._kt_used = False
        self._calls.clear()  # the scale may change
        self.scale: torch.Tensor | None = None
        self._scale_one = False
        self._scale_f = 1.0  # host mode: the scale as a Python float (the kernel divides by it)
        self._grad_flush_bits: int | None = None
        self._grad_flush: torch.Tensor | None = None  # flush_threshold of the step's scale
        # fp32 tensors' fp16-overflow and fp16-flush counts, per slot, kept on the device
        self._f32 = torch.zeros(self.slots, 2, dtype=torch.int64, device=self.device)
        # fp32 extras and the callers' input counts
        if self.sync_free:
            self._extra = torch.zeros(self.slots, K + 1, dtype=torch.int64, device=self.device)
        self._host: dict[int, list[int]] = {}  # CPU: slot -> [zeros, nan, amax bits, in_bad, 0, 0]
        # CPU: id(tensor) -> (weakref, version, group, key histogram, fp32 extras, fp32 counts,
        # non-finite count, kernel row); the eager path keeps the histogram and extras (group:
        # (format, grad)), the kernel the tensor's own row in _keep and the count (group:
        # (dtype, grad), never equal to an eager group)
        self._seen: dict[int, tuple[Any, int, tuple[Any, bool], Any, Any, Any, Any, Any]] = {}
        if self._keep_used:
            self._keep[: self._keep_used].zero_()
            self._keep_used = 0
        self._table: torch.Tensor | None = None
        return self

    def grow(self, slots: int) -> None:
        """Add rows (a root model registered in the middle of a step); counts so far are kept."""
        more = slots - self.slots
        if more <= 0:
            return
        pad = torch.zeros(more, 2, dtype=torch.int64, device=self.device)
        self._f32 = torch.cat([self._f32, pad])
        if not self.sync_free:
            self._kt = torch.cat([self._kt, torch.zeros(more, K + 1, dtype=torch.int64)])
            self._kt_ptr = self._kt.data_ptr()
        if self.sync_free:
            pad = torch.zeros(more, K + 1, dtype=torch.int64, device=self.device)
            self._extra = torch.cat([self._extra, pad])
        self.slots = slots

    # -- hot path --------------------------------------------------------------------------------
    def add(
        self,
        slot: int,
        x: torch.Tensor,
        scale: torch.Tensor | None = None,
        in_bad: torch.Tensor | int | None = None,
    ) -> None:
        """Accumulate a floating tensor into ``slot``.

        Args:
            slot: row of the table.
            x: the tensor (any layout; not modified).
            scale: for gradients, the loss scale to divide by (0-d fp32 on ``x``'s device); the
                same tensor for the whole step. Pass ``torch.ones(())`` for unscaled gradients
                (what the reference divides them by).
            in_bad: non-finite count of the module's inputs, added to ``C_IN_BAD``.
        """
        grad = scale is not None
        if grad and self.scale is None:
            self.scale = scale
            if not self.sync_free:
                self._scale_f = float(scale)  # type: ignore[arg-type]
                self._scale_one = self._scale_f == 1.0
        if in_bad is not None:
            self.add_in_bad(slot, in_bad)
        n = x.numel()
        if n == 0:
            return
        if not self.sync_free:
            kern = self._kernel if self._kernel is not None else self._ready_kernel()
            if kern is not None and x.device.type == "cpu":
                self._add_kernel(kern, slot, x, grad)
                return
        fmt = _key_format(x.dtype)
        group = (_F32, False) if fmt == _F32 else (fmt, grad)  # fp32 is unscaled per tensor
        hist = self._row(group, slot)
        if self.sync_free:
            self._add_device(slot, hist, x.detach(), fmt, grad)
            return
        if n < _SMALL:
            self._add_small(slot, hist, x.detach(), fmt, grad)
            return
        # the same tensor object measured again in this step, unchanged (a Dropout(p=0) or
        # Identity returns its input; a gradient hooked twice): reuse its histogram
        seen = self._seen.get(id(x))
        if (
            seen is not None
            and seen[0]() is x
            and seen[1] == x._version
            and seen[2] == group
            and seen[3] is not None
        ):
            hist.add_(seen[3])
            self._add_host_extra(slot, seen[4])
            self._add_f32_counts(slot, seen[5])
            return
        h, extra, counts = self._measure_host(x.detach(), fmt, grad)
        hist.add_(h)
        self._add_host_extra(slot, extra)
        self._add_f32_counts(slot, counts)
        self._seen[id(x)] = (weakref.ref(x), x._version, group, h, extra, counts, None, None)

    def _ready_kernel(self) -> numkernel.Kernel | None:
        if self._kernel_mode is False:
            return None
        self._kernel = numkernel.kernel()
        return self._kernel

    def _add_kernel(self, kern: numkernel.Kernel, slot: int, x: torch.Tensor, grad: bool) -> None:
        """One compiled pass over ``x`` (CPU, host mode), added straight into the slot's table
        row through the plan of its format and scale (no 32768-bin row, no fold at the end).
        The pass counts into the tensor's own row (in ``_keep``), then adds it to the slot's:
        the same tensor object measured again in the step at the same version (a
        ``Dropout(p=0)`` or ``Identity`` returns its input; a gradient hooked twice) adds that
        row again instead of a pass. An activation's non-finite count is kept for
        :meth:`count_nonfinite`. (Lean: a hook runs this after the training's own ops have
        evicted most of the interpreter's data from the cache.)"""
        group = (x.dtype, grad)
        call = self._calls.get(group)
        if call is None:
            call = self._call(kern, x.dtype, grad)
        row = self._kt_ptr + slot * _ROW_BYTES
        self._kt_used = True
        seen = self._seen.get(id(x))
        if seen is not None and seen[2] == group and seen[0]() is x and seen[1] == x._version:
            kern.add_row(row, self._keep_ptr + seen[7] * _ROW_BYTES, call[1][1])
            return
        t = x if x.dtype in _KERNEL_DTYPES else x.to(torch.float32)  # fp64, fp8: as fp32
        if not t.is_contiguous() and not _dense(t):
            t = t.contiguous()
        ptr = t.data_ptr()
        if not ptr:  # a wrapper subclass has no memory of its own: never hand C a null pointer
            raise ValueError(f"{type(x).__name__} has no data of its own to measure")
        index = self._keep_used
        if index == self._keep.shape[0]:
            self._grow_keep()
        self._keep_used = index + 1
        keep = self._keep_ptr + index * _ROW_BYTES
        bad = call[0](ptr, t.numel(), row, keep, *call[1])
        self._seen[id(x)] = (weakref.ref(x), x._version, group, None, None, None, bad, index)

    def _grow_keep(self) -> None:
        grown = torch.zeros(max(64, 2 * self._keep.shape[0]), K + 1, dtype=torch.int64)
        grown[: self._keep_used] = self._keep[: self._keep_used]
        self._keep = grown
        self._keep_ptr = grown.data_ptr()

    def _call(
        self, kern: numkernel.Kernel, dtype: torch.dtype, grad: bool
    ) -> tuple[Any, tuple[Any, ...]]:
        """The kernel function for ``dtype`` and its arguments after the row (this step)."""
        if self._sub is None:
            self._sub = torch.zeros(numkernel.SUB_WORDS, dtype=torch.int32)
        sub = self._sub.data_ptr()
        fmt = _key_format(dtype)
        scaled = grad and fmt != _F32  # fp32 is unscaled in the kernel, its plan is the same
        plan = self._plans.get((fmt, scaled, self._scale_f if scaled else None))
        if plan is None:
            plan = self._plan(fmt, scaled)
        call: tuple[Any, tuple[Any, ...]]
        if fmt != _F32:
            call = (kern.row16, (sub, *plan.pointers))
        else:
            divide = grad and not self._scale_one
            scale = self._scale_f if divide else 1.0
            flush = self._flush_bits(grad)
            call = (kern.row32, (sub, *plan.pointers[:2], scale, int(divide), flush))
        self._calls[(dtype, grad)] = call
        return call

    def _plan(self, fmt: int, scaled: bool) -> _Plan:
        scale = self.scale if scaled else None
        maps = _Maps(fmt, scale, self._flush_at(scaled), self.device, host=False)
        plan = _Plan(maps, fmt)
        self._plans[(fmt, scaled, self._scale_f if scaled else None)] = plan
        return plan

    def _flush_bits(self, grad: bool) -> int:
        """fp32 bit pattern of :meth:`_flush_at` (host mode)."""
        if not grad:
            return _FLUSH16_BITS
        if self._grad_flush_bits is None:
            self._grad_flush_bits = _float_bits(float(self._flush_at(True)))
        return self._grad_flush_bits

    def _measure_host(
        self, x: torch.Tensor, fmt: int, grad: bool
    ) -> tuple[torch.Tensor, tuple[int, int, int] | None, torch.Tensor | None]:
        """Key histogram of a large tensor (CPU) and, for fp32, its exact zeros, NaN, amax and
        fp16-overflow/flush counts."""
        n = x.numel()
        if fmt != _F32:
            # |x| clears the sign bit: its 16-bit pattern is the key (abs runs vectorized in
            # the float type, faster here than an integer and)
            key = torch.abs(x, out=self._buf(x.dtype, n, x.shape)).view(torch.int16)
            return torch.bincount(key.view(-1), minlength=_NKEYS), None, None
        y = self._unscaled_f32(x, grad)
        # the sign bit is clear: the upper half is the key
        key = torch.bitwise_right_shift(
            y.view(torch.int32), 16, out=self._buf(torch.int16, n, x.shape)
        )
        h = torch.bincount(key.view(-1), minlength=_NKEYS)
        # bin 0 holds zeros and fp32 values below 2**-133: count zeros only if it is occupied
        zeros = n - int(torch.count_nonzero(y)) if int(h[0]) else 0
        return h, (zeros, *self._nan_amax_host(y)), self._fp16_counts(y, grad)

    def _fp16_counts(self, y: torch.Tensor, grad: bool) -> torch.Tensor:
        """(fp16-overflowing, fp16-flushed) counts of unscaled fp32 magnitudes, as a device
        tensor: ``y >= 65520`` and ``y <= flush_threshold(scale)`` (no read-back)."""
        flags = self._buf(torch.bool, y.numel(), y.shape)
        over = torch.count_nonzero(torch.ge(y, OVER16, out=flags))
        flush = torch.count_nonzero(torch.le(y, self._flush_at(grad), out=flags))
        return torch.stack([over, flush])

    def _flush_at(self, grad: bool) -> torch.Tensor:
        """The fp16 flush bound on unscaled values: 2**-25, or for gradients 2**-25 / scale."""
        if not grad:
            return self._flush16
        if self._grad_flush is None:
            self._grad_flush = flush_threshold(self.scale, self.device)
        return self._grad_flush

    def _add_f32_counts(self, slot: int, counts: torch.Tensor | None) -> None:
        if counts is not None:
            self._f32[slot] += counts

    def _index_add_keys(
        self, hist: torch.Tensor, x: torch.Tensor, fmt: int, grad: bool
    ) -> torch.Tensor | None:
        """Add ``x``'s magnitude keys to ``hist`` with ``index_add_`` (no sync); the unscaled fp32
        values for fp32 tensors (their extras are counted by the caller), else None."""
        n = x.numel()
        if fmt != _F32:
            key = torch.bitwise_and(
                x.view(torch.int16), 0x7FFF, out=self._buf(torch.int32, n, x.shape)
            )
            hist.index_add_(0, key.view(-1), self._ones.expand(n))
            return None
        y = self._unscaled_f32(x, grad)
        key = torch.bitwise_right_shift(
            y.view(torch.int32), 16, out=self._buf(torch.int32, n, x.shape)
        )
        hist.index_add_(0, key.view(-1), self._ones.expand(n))
        return y

    def _add_small(
        self, slot: int, hist: torch.Tensor, x: torch.Tensor, fmt: int, grad: bool
    ) -> None:
        y = self._index_add_keys(hist, x, fmt, grad)
        if y is None:
            return
        zeros = x.numel() - int(torch.count_nonzero(y))
        self._add_host_extra(slot, (zeros, *self._nan_amax_host(y)))
        self._add_f32_counts(slot, self._fp16_counts(y, grad))

    def _add_device(
        self, slot: int, hist: torch.Tensor, x: torch.Tensor, fmt: int, grad: bool
    ) -> None:
        """Sync-free: histogram by ``index_add_``, fp32 extras counted on the device."""
        y = self._index_add_keys(hist, x, fmt, grad)
        if y is None:
            return
        amax = y.amax().view(torch.int32)
        extra = self._extra[slot]
        extra[C_AMAX : C_AMAX + 1].clamp_min_(amax)
        extra[C_ZEROS].add_(x.numel() - torch.count_nonzero(y))
        extra[C_NAN].add_(torch.isnan(y).sum())
        self._add_f32_counts(slot, self._fp16_counts(y, grad))

    def _unscaled_f32(self, x: torch.Tensor, grad: bool) -> torch.Tensor:
        """``|x|`` as fp32, divided by the step's loss scale for gradients (as the reference
        does), in a scratch buffer (the magnitude's upper half is the key, no masking needed)."""
        if x.dtype != torch.float32:  # fp64, fp8, ...: measured as their fp32 value, as reference
            x = x.to(torch.float32)
        out = self._buf(torch.float32, x.numel(), x.shape)
        torch.abs(x, out=out)
        if grad and not self._scale_one:
            out.div_(self.scale)  # type: ignore[arg-type]
        return out

    @staticmethod
    def _nan_amax_host(y: torch.Tensor) -> tuple[int, int]:
        """NaN count and amax bits of fp32 magnitudes (``amax`` propagates NaN)."""
        hi = float(y.amax())
        if math.isfinite(hi):
            return 0, _float_bits(hi)
        # inf or NaN somewhere: count NaN exactly (an inf key may hide a signaling NaN) and take
        # the reference's maximum (inf, or a NaN pattern, not reported then)
        return int(torch.isnan(y).sum()), int(y.view(torch.int32).amax())

    def _add_host_extra(self, slot: int, extra: tuple[int, int, int] | None) -> None:
        if extra is None:
            return
        acc = self._host.setdefault(slot, [0] * _HOST_COLS)
        acc[C_ZEROS] += extra[0]
        acc[C_NAN] += extra[1]
        acc[C_AMAX] = max(acc[C_AMAX], extra[2])

    def count_nonfinite(self, x: torch.Tensor) -> torch.Tensor | int:
        """Non-finite elements of ``x``; free when this step already measured the same tensor
        object at the same version (a module's input is usually another module's output):
        its histogram's inf/NaN keys hold the count. Otherwise :func:`count_nonfinite`."""
        seen = self._seen.get(id(x)) if not self.sync_free else None
        if seen is not None and seen[0]() is x and seen[1] == x._version and not seen[2][1]:
            if seen[6] is not None:
                return seen[6]
            if seen[3] is not None:
                first_nonfinite = 0x7C00 if seen[2][0] == _F16 else _INF_KEY
                return int(seen[3][first_nonfinite:].sum())
        return count_nonfinite(x, self.sync_free)

    def add_in_bad(self, slot: int, in_bad: torch.Tensor | int) -> None:
        """Add ``in_bad`` (non-finite elements of the module's inputs) to ``slot``'s row."""
        if self.sync_free:
            self._extra[slot, C_IN_BAD] += in_bad
        else:
            self._host.setdefault(slot, [0] * _HOST_COLS)[C_IN_BAD] += int(in_bad)

    def _row(self, group: tuple[int, bool], slot: int) -> torch.Tensor:
        rows = self._row_of.get(group)
        if rows is None:
            rows = self._row_of[group] = {}
        row = rows.get(slot)
        if row is None:
            row = rows[slot] = len(rows)
            hist = self._hist.get(group)
            if hist is None or hist.shape[0] <= row:
                grown = torch.zeros(max(8, 2 * row), _NKEYS, dtype=torch.int64, device=self.device)
                if hist is not None:
                    grown[: hist.shape[0]] = hist
                self._hist[group] = hist = grown
        return self._hist[group][row]

    def _buf(self, dtype: torch.dtype, n: int, shape: torch.Size, tag: int = 0) -> torch.Tensor:
        """A reusable output of ``n`` elements (fresh on accelerators: no cross-stream reuse);
        ``tag`` tells apart two buffers of one dtype that are live together."""
        if self.sync_free:
            return torch.empty(shape, dtype=dtype, device=self.device)
        buf = self._scratch.get((dtype, tag))
        if buf is None or buf.numel() < n:
            buf = self._scratch[(dtype, tag)] = torch.empty(max(n, 1 << 16), dtype=dtype)
        return buf[:n].view(shape)

    # -- once per step ---------------------------------------------------------------------------
    def table(self) -> torch.Tensor:
        """The ``(slots, K)`` int64 table of this step (computed once, then cached)."""
        if self._table is not None:
            return self._table
        with torch.no_grad():
            out = torch.zeros(self.slots, K + 1, dtype=torch.int64, device=self.device)
            amax = torch.zeros(self.slots, dtype=torch.int64, device=self.device)
            for (fmt, grad), rows in self._row_of.items():
                if not rows:
                    continue
                self._fold(fmt, grad, rows, out, amax)
            if self.sync_free:
                out += self._extra
                amax = torch.maximum(amax, self._extra[:, C_AMAX])
                f32_zeros = self._extra[:, C_ZEROS]
            elif self._host:
                index = torch.tensor(list(self._host.keys()), dtype=torch.int64)
                extra = torch.tensor(list(self._host.values()), dtype=torch.int64)
                amax[index] = torch.maximum(amax[index], extra[:, C_AMAX])
                extra[:, C_AMAX] = 0
                out[:, :H0].index_add_(0, index, extra)
                f32_zeros = torch.zeros(self.slots, dtype=torch.int64)
                f32_zeros[index] = extra[:, C_ZEROS]
            else:
                f32_zeros = torch.zeros(self.slots, dtype=torch.int64, device=self.device)
            if self._kt_used:  # the rows the kernel added to, complete (host mode)
                out += self._kt
                amax = torch.maximum(amax, self._kt[:, C_AMAX])
            # fp32 key 0 went to the lump: its zeros (counted exactly) belong to the zero bin
            out[:, H_LUMP] -= f32_zeros
            out[:, H_ZERO] += f32_zeros
            out[:, C_OVER16 : C_FLUSH16 + 1] += self._f32
            out[:, C_AMAX] = amax
            self._table = out[:, :K]
            self._seen.clear()
        return self._table

    def _fold(
        self,
        fmt: int,
        grad: bool,
        rows: dict[int, int],
        out: torch.Tensor,
        amax: torch.Tensor,
    ) -> None:
        key = (fmt, grad, None if self.sync_free or not grad else self._scale_f)
        maps = self._maps.get(key)
        if maps is None:
            scale = self.scale if grad and fmt != _F32 else None
            maps = self._maps[key] = _Maps(
                fmt, scale, self._flush_at(grad), self.device, not self.sync_free
            )
        n = len(rows)
        hist = self._hist[(fmt, grad)][:n]
        slots = _index(list(rows.keys()), self.device)
        part = torch.zeros(n, K + 1, dtype=torch.int64, device=self.device)
        if self.sync_free:
            part.index_add_(1, maps.exp_col, hist)
            if fmt != _F32:
                part.index_add_(1, maps.flag_col, hist)
                part.index_add_(1, maps.over_col, hist)
                part.index_add_(1, maps.flush_col, hist)
                # amax: the value of the largest occupied key (fbits are monotone in the key)
                present = hist > 0
                last = (_NKEYS - 1) - present.flip(1).to(torch.int8).argmax(1)
                top = torch.where(present.any(1), maps.fbits[last], 0)
                amax[slots] = torch.maximum(amax[slots], top)  # slots of a group are distinct
        else:
            block = maps.block
            blocks = hist.view(n, _NKEYS // block, block)
            coarse = blocks.sum(-1)
            part.index_add_(1, maps.coarse_col, coarse[:, maps.coarse_blocks])
            if maps.fine_keys.numel():
                part.index_add_(1, maps.fine_col, hist[:, maps.fine_keys])
            if fmt != _F32:
                part[:, C_ZEROS] = hist[:, : maps.zero_end].sum(1)
                part[:, C_NAN] = hist[:, maps.nan_start :].sum(1)
                part[:, C_OVER16] = hist[:, maps.over_start : maps.nan_start].sum(1)
                part[:, C_FLUSH16] = hist[:, : maps.flush_end].sum(1)
                # amax: the last occupied block, then the last occupied key in it
                index = torch.arange(_NKEYS // block)
                last_block = torch.where(coarse > 0, index, -1).amax(1)
                found = last_block >= 0
                last_block.clamp_(min=0)
                sub = blocks[torch.arange(n), last_block]
                within = torch.where(sub > 0, torch.arange(block), 0).amax(1)
                top = torch.where(found, maps.fbits[last_block * block + within], 0)
                amax[slots] = torch.maximum(amax[slots], top)
        out.index_add_(0, slots, part)


def stats_v2(
    x: torch.Tensor,
    scale: torch.Tensor | None = None,
    sync_free: bool | None = None,
    kernel: bool | None = None,
) -> torch.Tensor:
    """The row (``K`` int64) of one tensor, computed the v2 way (equal to the reference's row)."""
    stats = StepStats(1, x.device, sync_free=sync_free, kernel=kernel)
    stats.add(0, x, scale=scale)
    return stats.table()[0]


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 index on ``device``; a pinned, non-blocking copy on CUDA (a plain one syncs)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    host = torch.tensor(values, dtype=torch.int64).pin_memory()
    return host.to(device, non_blocking=True)


def _dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements fill ``numel`` consecutive slots from its data pointer (in
    some order: a transpose or permute of a contiguous tensor), so one pass reads them all."""
    if x.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _float_bits(value: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", value))[0])
