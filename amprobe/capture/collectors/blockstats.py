"""Block statistics of a GEMM operand: what casting it to each block-scaled format would lose.

:func:`measure` reduces one operand (its canonical 2-D view, :func:`canonical`) to one row per
``(orientation, format)`` of :func:`amprobe.store.blockformats.rows_for`, with the columns of
:data:`~amprobe.store.blockformats.STAT_FIELDS`. The definitions (binding, shared with the
reference the tests check against):

* the tensor is ``x / divisor`` in fp32 (gradients: the loss scale); ``elements`` counts all
  elements, ``nonfinite`` its inf/NaN, which take part in nothing else; ``nonzero`` the finite
  nonzero elements; ``signal`` is ``sum x**2`` over finite elements (float64);
* ``blocks``: runs of ``block`` elements along the orientation's dimension (the last block of a
  row may be shorter), 2-D weight tiles, or the whole tensor; ``amax_b`` the largest finite
  ``|x|`` of a block; a block with ``amax_b > 0`` gets a scale ``s`` (fp32): ``exact``
  ``amax_b / max``; ``floor`` (OCP MX) ``2**(floor(log2 amax_b) - emax)``; ``ceil``
  ``2**ceil(log2(amax_b / max))``, e8m0 exponents clamped to [-127, 127] and counted in
  ``scale_under`` / ``scale_sat``; NVFP4 ``e4m3((amax_b / 6) / s_t) * s_t`` with
  ``s_t = amax_t / (448 * 6)``;
* each element: ``v = |x| / s``, ``q`` = round-to-nearest-even of ``v`` in the element type
  (subnormals kept, saturating at its max), ``deq = q * s`` (fp32); ``flushed``: nonzero
  elements with ``deq == 0``; ``clipped``: nonzero elements with ``v`` beyond the element's
  saturation bound; ``noise``: ``sum (|x| - deq)**2`` (float64).

  One reading of the contract made explicit here: a block whose scale is 0 (an fp32 or e4m3
  scale that underflows) dequantizes to 0, so its nonzero elements count as flushed and not as
  clipped (``v = |x| / 0`` is not a saturated value but a lost one).

Two implementations give the same counts (and the same sums up to float64 summation order):
the compiled CPU kernel of :mod:`~amprobe.capture.collectors.numkernel` (one pass over the
tensor for all rows, fp32/bf16/fp16 read directly, a 128x128 strip buffer, no tensor-sized
temporaries) when it is built, and an eager torch reduction otherwise (any device, no
host-device sync: no value is read back; its fp32 and float64 temporaries are made per
chunk of rows, :data:`EAGER_CHUNK` elements). The kernel needs fp32/bf16/fp16 on CPU and blocks
of 16 to 128 elements (tiles up to 128 x 128, powers of two): another float dtype on CPU
(float64, fp8) is converted to fp32 for it; other block shapes run eagerly.

The element cast is arithmetic on fp32 bits, no float8 dtype needed: ``v`` in binade ``E``
(clamped below at the element's smallest normal binade) is a multiple of ``2**(E - mantissa)``
after ``(v + 2**(E - mantissa + 23)) - 2**(E - mantissa + 23)``, an fp32 add that rounds to
nearest even at exactly that step.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import torch

from amprobe.capture.collectors import numkernel
from amprobe.store.blockformats import (
    ELEMENTS,
    FORMATS,
    ORIENTATIONS,
    STAT_FIELDS,
    Element,
    rows_for,
)

__all__ = ["CONV_APPROX", "canonical", "measure"]

#: why a conv layer's input rows are approximate
CONV_APPROX = "conv: blocks along input channels at each position, not the im2col patch"

_NF = len(STAT_FIELDS)

_E4M3 = ELEMENTS["e4m3"]
_KERNEL_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def _f32_bits(x: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", x))[0])


def _clip_gt(elem: Element) -> float:
    """The bound ``v > bound`` of saturated values (an inclusive bound moved one fp32 down)."""
    if not elem.clip_inclusive:
        return elem.clip_from
    return float(struct.unpack("<f", struct.pack("<I", _f32_bits(elem.clip_from) - 1))[0])


# ---------------------------------------------------------------------------------------------
# canonical views


def canonical(operand: str, t: torch.Tensor, module_kind: str) -> tuple[torch.Tensor, str | None]:
    """The canonical 2-D view of a layer's operand and why it is approximate (None if exact).

    Linear (and any other matmul layer) X ``[..., K] -> [T, K]``, W ``[N, K]``, dY
    ``[..., N] -> [T, N]``; Hugging Face ``Conv1D`` keeps its weight as ``[K, N]``: transposed
    (a view). Conv (``module_kind`` ``Conv1d``/``Conv2d``/``Conv3d``): X ``[B, C, *S]`` ->
    ``[B*prod(S), C]``, W ``[Cout, Cin, *k] -> [Cout, Cin*prod(k)]``, dY ``[B, Cout, *S] ->
    [B*prod(S), Cout]``. A conv's X is approximate (:data:`CONV_APPROX`): its GEMM reduces over
    the im2col patch (channels x kernel window), its blocks here run over channels at one
    position; W's flattening is the patch order and dY's channels are what the GEMMs reduce,
    so those are exact. Views where the layout allows; a conv's X and dY are copied when not
    channels-last.
    """
    if operand not in ORIENTATIONS:
        raise KeyError(f"unknown operand {operand!r}; known: {sorted(ORIENTATIONS)}")
    kind = module_kind.rsplit(".", 1)[-1]
    conv = kind.lower().startswith("conv") and kind != "Conv1D" and t.dim() >= 3
    if operand == "w":
        if kind == "Conv1D" and t.dim() == 2:
            return t.t(), None
        if t.dim() == 2:
            return t, None
        return t.reshape(t.shape[0], -1), None
    if conv:
        flat = t.movedim(1, -1).reshape(-1, t.shape[1])
        return flat, CONV_APPROX if operand == "x" else None
    if t.dim() == 1:
        return t.reshape(1, -1), None
    return t.reshape(-1, t.shape[-1]), None


# ---------------------------------------------------------------------------------------------
# the eager reduction (any device)


def _rne(v: torch.Tensor, elem: Element) -> torch.Tensor:
    """Round-to-nearest-even of ``v >= 0`` (fp32) in ``elem``, subnormals kept, saturating.

    NaN saturates too (the kernel's select does the same): NVFP4's ``(amax_b / 6) / s_t`` is
    ``0 / 0`` when both underflow (a tensor whose amax is below ``2688 * 2**-150``); its scale
    is then ``448 * 0``, and the block flushes."""
    cap = 2.0 * elem.max
    vc = torch.where(v < cap, v, cap)
    eb = (vc.view(torch.int32) >> 23).clamp_min(127 + elem.min_normal_exp)
    magic = ((eb + (23 - elem.mantissa)) << 23).view(torch.float32)
    return ((vc + magic) - magic).clamp_max(elem.max)


def _exponent(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``floor(log2 a)`` and the 23-bit mantissa field of ``a > 0`` (fp32), subnormals exact."""
    bits = a.view(torch.int32)
    eb = bits >> 23
    frac = bits & 0x7FFFFF
    norm = frac.float().view(torch.int32)  # a subnormal's integer mantissa, normalised exactly
    sub = eb == 0
    e = torch.where(sub, (norm >> 23) - 127 - 149, eb - 127)
    m = torch.where(sub, norm & 0x7FFFFF, frac)
    return e, m


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2**e`` in fp32 for integer ``e`` in [-127, 127] (2**-127 is subnormal)."""
    return torch.where(e >= -126, (e + 127) << 23, 0x00400000).to(torch.int32).view(torch.float32)


def _scales(
    amax: torch.Tensor, fmt_name: str, amax_t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block: the scale (0 for an all-zero block), and which blocks under/saturate."""
    fmt = FORMATS[fmt_name]
    elem = ELEMENTS[fmt.element]
    pos = amax > 0
    if fmt.tensor_scale:
        s_t = amax_t / (_E4M3.max * elem.max)
        raw = (amax / elem.max) / s_t
        sat = raw >= _E4M3.clip_from if _E4M3.clip_inclusive else raw > _E4M3.clip_from
        sb = _rne(torch.where(pos, raw, 0.0), _E4M3)
        under = sb == 0
        s = sb * s_t
    elif fmt.scale_rounding == "exact" or fmt.block == 0:
        s = amax / elem.max
        under = s == 0
        sat = torch.isinf(s)
    else:
        e, m = _exponent(amax)
        e = e - elem.emax
        if fmt.scale_rounding == "ceil":
            e = e + (m > (_f32_bits(elem.max) & 0x7FFFFF)).to(e.dtype)
        elif fmt.scale_rounding != "floor":
            raise ValueError(f"unknown scale rounding {fmt.scale_rounding!r} of {fmt_name}")
        under = e < -127
        sat = e > 127
        s = _pow2(e.clamp(-127, 127))
    return torch.where(pos, s, 0.0), pos & under, pos & sat


def _blocked(a: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``a`` [R, C] zero-padded to multiples of ``rows`` x ``cols``, one tile per row."""
    r, c = a.shape
    pr, pc = -r % rows, -c % cols
    if pr or pc:
        a = torch.nn.functional.pad(a, (0, pc, 0, pr))
    nr, nc = a.shape[0] // rows, a.shape[1] // cols
    return a.reshape(nr, rows, nc, cols).permute(0, 2, 1, 3).reshape(nr * nc, rows * cols)


def _geometry(operand: str, orient: str, fmt_name: str, shape: tuple[int, int]) -> tuple[int, int]:
    """The block shape ``(rows, cols)`` in the canonical view."""
    fmt = FORMATS[fmt_name]
    if fmt.block == 0:
        return shape
    if orient == "both":
        assert fmt.weight_block is not None
        return fmt.weight_block
    if orient == ORIENTATIONS[operand][0]:
        return 1, fmt.block
    return fmt.block, 1


def _nblocks(shape: tuple[int, int], geom: tuple[int, int], per_tensor: bool) -> int:
    r, c = shape
    if r * c == 0:
        return 0
    if per_tensor:
        return 1
    return -(-r // geom[0]) * -(-c // geom[1])


#: rows of the operand the eager path takes at a time hold about this many elements: its fp32
#: and float64 temporaries are made per chunk, so a large operand adds a bounded peak
EAGER_CHUNK = 1 << 22


def _eager(
    x2d: torch.Tensor,
    operand: str,
    rows: list[tuple[str, str]],
    divisor: torch.Tensor | float | None,
) -> torch.Tensor:
    dev = x2d.device
    shape = (int(x2d.shape[0]), int(x2d.shape[1]))
    f64 = torch.float32 if dev.type == "mps" else torch.float64  # MPS has no float64
    acc = torch.zeros(len(rows), _NF, dtype=f64, device=dev)
    if shape[0] * shape[1] == 0 or not rows:
        return acc
    d: torch.Tensor | float | None = divisor
    if isinstance(divisor, torch.Tensor):
        d = divisor.to(device=dev, dtype=torch.float32, non_blocking=True)

    def magnitudes(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = part.float()
        if d is not None:
            y = y / (d if isinstance(d, torch.Tensor) else float(d))
        a = y.abs()
        fin = torch.isfinite(a)
        return torch.where(fin, a, 0.0), fin

    geoms = [_geometry(operand, orient, name, shape) for orient, name in rows]
    tensor_rows = [FORMATS[name].block == 0 for _, name in rows]
    step = math.lcm(1, *(g[0] for g, t in zip(geoms, tensor_rows, strict=True) if not t))
    chunk = max(step, EAGER_CHUNK // shape[1] // step * step)
    amax_t = torch.zeros((), device=dev)
    if any(t or FORMATS[name].tensor_scale for t, (_, name) in zip(tensor_rows, rows, strict=True)):
        for r0 in range(0, shape[0], chunk):
            amax_t = torch.maximum(amax_t, magnitudes(x2d[r0 : r0 + chunk])[0].amax())
    tensor_scale: dict[int, torch.Tensor] = {}
    for i, (_, name) in enumerate(rows):
        if tensor_rows[i]:
            s, under, sat = _scales(amax_t.reshape(1), name, amax_t)
            tensor_scale[i] = s
            acc[i, 6] += under.sum()
            acc[i, 7] += sat.sum()
    common = torch.zeros(3, dtype=f64, device=dev)  # nonzero, nonfinite, signal
    for r0 in range(0, shape[0], chunk):
        a, fin = magnitudes(x2d[r0 : r0 + chunk])
        common += torch.stack(
            [(a > 0).sum().to(f64), (~fin).sum().to(f64), a.to(f64).square().sum()]
        )
        for i, (_, name) in enumerate(rows):
            elem = ELEMENTS[FORMATS[name].element]
            if tensor_rows[i]:
                blk, s = a.reshape(1, -1), tensor_scale[i]
            else:
                blk = _blocked(a, *geoms[i])
                s, under, sat = _scales(blk.amax(dim=1), name, amax_t)
                acc[i, 6] += under.sum()
                acc[i, 7] += sat.sum()
            sc = s[:, None]
            live = sc > 0
            v = torch.where(live, blk / torch.where(live, sc, 1.0), 0.0)
            bound = elem.clip_from
            clipped = (v >= bound) if elem.clip_inclusive else (v > bound)
            deq = _rne(v, elem) * sc
            acc[i, 3] += ((blk > 0) & (deq == 0)).sum()
            acc[i, 4] += clipped.sum()
            acc[i, 9] += (blk.to(f64) - deq.to(f64)).square().sum()
    acc[:, 0] = float(shape[0] * shape[1])
    acc[:, 1] = common[0]
    acc[:, 2] = common[1]
    acc[:, 8] = common[2]
    for i in range(len(rows)):
        acc[i, 5] = float(_nblocks(shape, geoms[i], tensor_rows[i]))
    return acc


# ---------------------------------------------------------------------------------------------
# the public call


def measure(
    x2d: torch.Tensor,
    operand: str,
    formats: Sequence[str],
    divisor: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Block statistics of one operand's canonical 2-D view, one row per format orientation.

    Args:
        x2d: the canonical view (:func:`canonical`), any float dtype, any strides.
        operand: ``"x"``, ``"w"`` or ``"dy"`` (which orientations its rows are).
        formats: :data:`~amprobe.store.blockformats.FORMATS` keys.
        divisor: the loss scale for gradients (the tensor measured is ``x / divisor`` in fp32).

    Returns:
        float64 ``[len(rows_for(operand, formats)), len(STAT_FIELDS)]`` on ``x2d``'s device. No
        host-device sync. On CPU the compiled kernel (numkernel's library) once it is built
        (another float dtype than fp32/bf16/fp16 converted to fp32 first), the eager torch
        reduction otherwise (the same counts).
    """
    if x2d.dim() != 2:
        raise ValueError(f"measure takes a 2-D view, got shape {tuple(x2d.shape)}")
    rows = rows_for(operand, formats)
    if x2d.device.type == "cpu" and x2d.is_floating_point():
        k = numkernel.kernel()
        if k is not None and k.has_blocks:
            # another float dtype (float64, fp8) is read in fp32, as the eager path reads it:
            # one conversion costs less than the eager reduction's passes
            res = _kernel(
                k, x2d if x2d.dtype in _KERNEL_DTYPES else x2d.float(), operand, rows, divisor
            )
            if res is not None:
                return res
    return _eager(x2d, operand, rows, divisor)


# the job words of numkernel's block pass (J_* in its SOURCE)
_J_WORDS = 20
_GEOM = {"rows": 0, "cols": 1, "tile": 2, "tensor": 3}
_SCALE = {"exact": 0, "floor": 1, "ceil": 2}
_S_NVFP4 = 3
_O_WORDS = 5  # flushed, clipped, scale_under, scale_sat, noise


def _log2(n: int) -> int | None:
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else None


def _job(fmt_name: str, geom: tuple[int, int], per_tensor: bool) -> list[int] | None:
    """A job's words for a block shape ``geom`` in memory order, or None if the kernel's
    128 x 128 strips cannot hold its blocks (the eager path then runs)."""
    fmt = FORMATS[fmt_name]
    elem = ELEMENTS[fmt.element]
    br, bc = geom
    lr, lc = _log2(br), _log2(bc // 16) if bc >= 16 else None
    if per_tensor:
        kind, lr, lc = _GEOM["tensor"], 7, 3
    elif bc == 1 and lr is not None and 16 <= br <= 128:
        kind, lc = _GEOM["cols"], 0
    elif br == 1 and lc is not None and bc <= 128:
        kind, lr = _GEOM["rows"], 0
    elif lr is not None and lc is not None and br <= 128 and bc <= 128:
        kind = _GEOM["tile"]
    else:
        return None
    scale = _S_NVFP4 if fmt.tensor_scale else _SCALE.get(fmt.scale_rounding)
    if per_tensor:
        scale = _SCALE["exact"]
    if scale is None or (fmt.tensor_scale and fmt.scale != "e4m3"):
        return None
    words = [kind, lr, lc, scale, elem.mantissa, 127 + elem.min_normal_exp]
    words += [_f32_bits(elem.max) & 0x7FFFFF, elem.emax]
    words += [_f32_bits(x) for x in (elem.max, 2 * elem.max, _clip_gt(elem))]
    words += [_E4M3.mantissa, 127 + _E4M3.min_normal_exp]
    words += [_f32_bits(x) for x in (_E4M3.max, 2 * _E4M3.max, _clip_gt(_E4M3))]
    words += [_f32_bits(_E4M3.max * elem.max)]
    return words + [0] * (_J_WORDS - len(words))


def _kernel(
    k: numkernel.Kernel,
    x2d: torch.Tensor,
    operand: str,
    rows: list[tuple[str, str]],
    divisor: torch.Tensor | float | None,
) -> torch.Tensor | None:
    """The compiled pass, or None where it does not apply (the eager path then runs)."""
    shape = (int(x2d.shape[0]), int(x2d.shape[1]))
    r, c = shape
    if r * c == 0:
        return None
    s0, s1 = x2d.stride()
    s0, s1 = (s0 if r > 1 else c), (s1 if c > 1 else 1)
    if s1 == 1 and s0 >= c:
        mem, ld, transposed = x2d, s0, False
    elif s0 == 1 and s1 >= r:
        mem, ld, transposed = x2d, s1, True
    else:
        mem, ld, transposed = x2d.contiguous(), c, False
    div_t: torch.Tensor | None = None
    if isinstance(divisor, torch.Tensor):
        if divisor.device.type != "cpu" or divisor.numel() != 1:
            return None
        div_t = divisor.detach().reshape(1).to(torch.float32)
    elif divisor is not None:
        div_t = torch.tensor([float(divisor)], dtype=torch.float32)
    jobs: list[int] = []
    need_amax = False
    for orient, name in rows:
        fmt = FORMATS[name]
        geom = _geometry(operand, orient, name, shape)
        if transposed:
            geom = (geom[1], geom[0])
        words = _job(name, geom, fmt.block == 0)
        if words is None:
            return None
        need_amax |= fmt.block == 0 or fmt.tensor_scale
        jobs += words
    mr, mc = (c, r) if transposed else (r, c)
    kind = _KERNEL_DTYPES[x2d.dtype]
    ptr = mem.data_ptr()
    dptr = div_t.data_ptr() if div_t is not None else None
    amax_t = k.block_amax(ptr, kind, mr, mc, ld, dptr) if need_amax else 0.0
    words_t = torch.tensor(jobs, dtype=torch.int32)
    res = torch.zeros(len(rows), _O_WORDS, dtype=torch.float64)
    stats = torch.zeros(3, dtype=torch.float64)
    k.block_pass(
        ptr,
        kind,
        mr,
        mc,
        ld,
        dptr,
        amax_t,
        len(rows),
        words_t.data_ptr(),
        res.data_ptr(),
        stats.data_ptr(),
    )
    out = torch.empty(len(rows), _NF, dtype=torch.float64)
    out[:, 0] = float(r * c)
    out[:, 1] = stats[1]
    out[:, 2] = stats[0]
    out[:, 3:5] = res[:, 0:2]
    out[:, 6:8] = res[:, 2:4]
    out[:, 8] = stats[2]
    out[:, 9] = res[:, 4]
    for i, (orient, name) in enumerate(rows):
        fmt = FORMATS[name]
        out[i, 5] = float(_nblocks(shape, _geometry(operand, orient, name, shape), fmt.block == 0))
    return out
