"""A reference block-scaled quantize-dequantize written from the format definitions (tests only).

The truth the block statistics of :mod:`amprobe.capture.collectors.blockstats` are checked
against (``tests/test_block_truth.py``). It shares no code with the capture side and imports
nothing from amprobe: the formats are restated here from their definitions, and the two are
compared field by field in the test.

* Elements are rounded by enumeration: the element type's finite values are listed (e4m3 and
  e5m2 from their bit definitions, e2m1 from its 16-value table), a value is placed between its
  two neighbours by ``searchsorted`` and the nearer one is taken, a tie going to the neighbour
  with the even code (even mantissa). Round-to-nearest-even with an unbounded exponent would go
  on past the largest finite value to the next value of the same progression (:attr:`Element.
  beyond`: 480 for e4m3, 2**16 for e5m2, 8 for e2m1); a value that rounds there or beyond is
  *saturated*: the cast returns the largest finite value.
* Scales, per block of finite values with ``amax > 0`` (OCP MX v1.0 section 6.3 for e8m0, the
  NVFP4 two-level recipe, fp32 ``amax / max`` for the fp8 recipes):

  - ``fp32``: ``s = amax / max`` (fp32 division); underflow when it is 0, saturation when inf.
  - ``e8m0_floor``: ``e = floor(log2 amax) - emax`` (``floor(log2)`` read off ``frexp`` in
    float64, exact for fp32 subnormals too), clamped to [-127, 127] (an underflow / saturation).
  - ``e8m0_ceil``: the smallest ``e`` with ``2**e * max >= amax`` (checked in float64, exact),
    clamped the same way.
  - ``e4m3_tensor`` (NVFP4): ``s_t = amax_t / (448 * 6)``; ``s_b = e4m3((amax / 6) / s_t)``
    with this module's own e4m3 rounding (subnormals, saturating); an underflow when ``s_b`` is
    0, a saturation when the e4m3 cast saturates; ``s = s_b * s_t`` (fp32 throughout).

* Then ``v = |x| / s`` (fp32), ``q = round(v)``, ``deq = sign(x) * (q * s)`` (fp32). A block whose
  scale is 0 dequantizes to 0 and does not divide: its elements are flushed, not saturated.

Non-finite elements take no part (not in any amax); their ``deq`` is the element itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "ELEMENTS",
    "FORMATS",
    "Element",
    "Format",
    "Quantized",
    "along",
    "e8m0_exponent",
    "quantize",
    "round_element",
]


@dataclass(frozen=True)
class Element:
    """An element type as its list of finite non-negative values.

    Attributes:
        name: ``"e4m3"``, ``"e5m2"`` or ``"e2m1"``.
        values: the finite non-negative values in code order (code = index; ascending).
        beyond: the value the next code would have if the exponent were unbounded (where
            round-to-nearest-even goes past ``max``).
    """

    name: str
    values: tuple[float, ...]
    beyond: float

    @property
    def max(self) -> float:
        return self.values[-1]

    @property
    def emax(self) -> int:
        """floor(log2(max)): the exponent of the largest binade."""
        return math.frexp(self.max)[1] - 1


def _minifloat(exp_bits: int, man_bits: int, bias: int, codes: int) -> tuple[float, ...]:
    """Values of codes ``0 .. codes-1`` (sign bit 0) of an IEEE-like binary format.

    Exponent field 0: subnormal ``m / 2**man_bits * 2**(1 - bias)``; else
    ``(1 + m / 2**man_bits) * 2**(e - bias)``.
    """
    out = []
    for code in range(codes):
        e, m = code >> man_bits, code & ((1 << man_bits) - 1)
        frac = m / (1 << man_bits)
        out.append(math.ldexp(frac, 1 - bias) if e == 0 else math.ldexp(1 + frac, e - bias))
    assert exp_bits > 0 and all(a < b for a, b in zip(out, out[1:], strict=False))
    return tuple(out)


# e4m3 (OCP "E4M3", torch float8_e4m3fn): bias 7, no infinities, only S.1111.111 is NaN: the
# finite non-negative codes are 0x00..0x7E; 0x7F would be 1.875 * 2**8 = 480.
_E4M3 = _minifloat(4, 3, 7, 0x80)
# e5m2 (IEEE-like): bias 15, exponent field 31 holds inf/NaN: finite codes 0x00..0x7B; 0x7C
# would be 2**16.
_E5M2 = _minifloat(5, 2, 15, 0x7D)
# e2m1 (OCP MX FP4): its 16 codes, sign in bit 3 (the table of the OCP MX v1.0 spec, 5.3.3);
# the value past 6 = 1.5 * 2**2 is 2**3 = 8.
E2M1_TABLE: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip

ELEMENTS: dict[str, Element] = {
    "e4m3": Element("e4m3", _E4M3[:-1], _E4M3[-1]),
    "e5m2": Element("e5m2", _E5M2[:-1], _E5M2[-1]),
    "e2m1": Element("e2m1", E2M1_TABLE[:8], 8.0),
}


def _grid(elem: Element) -> torch.Tensor:
    # the values and `beyond` are exact in fp32, and so are the midpoints between neighbours
    # (at most one more significant bit than the type's mantissa)
    return torch.tensor((*elem.values, elem.beyond), dtype=torch.float32)


def round_element(elem: Element, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest-even, saturating, of fp32 magnitudes ``v >= 0`` (inf allowed) to ``elem``.

    Returns:
        ``(q, saturated)``: ``q`` fp32, the chosen value (``max`` where saturated);
        ``saturated`` bool, where the unbounded rounding would exceed ``max``.
    """
    grid = _grid(elem)
    top = len(elem.values)  # the code of `beyond`
    v = v.to(torch.float32).contiguous()
    lo = torch.searchsorted(grid, v).clamp_(1, top) - 1  # grid[lo] < v <= grid[lo + 1]
    mid = (grid[lo] + grid[lo + 1]) * 0.5
    odd = (lo & 1).bool()  # a tie goes to the even code
    code = lo + ((v > mid) | ((v == mid) & odd)).to(torch.int64)
    saturated = (code >= top) | (v > elem.beyond)
    q = grid[code.clamp_(max=top - 1)]
    return torch.where(saturated, elem.max, q), saturated


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) of positive finite fp32 values, exact (frexp of the float64 copy)."""
    return torch.frexp(a.to(torch.float64)).exponent.to(torch.int64) - 1


def e8m0_exponent(amax: torch.Tensor, elem: Element, rounding: str) -> torch.Tensor:
    """The unclamped e8m0 scale exponent of positive finite block maxima.

    ``"floor"`` (OCP MX v1.0): ``floor(log2 amax) - emax``; ``"ceil"``: the smallest ``e`` with
    ``2**e * max >= amax``.
    """
    if rounding == "floor":
        return _floor_log2(amax) - elem.emax
    if rounding != "ceil":
        raise ValueError(rounding)
    a = amax.to(torch.float64)
    e = _floor_log2(amax) - elem.emax - 1  # 2**e * max < amax: max < 2**(emax + 1)
    for _ in range(4):
        short = torch.ldexp(torch.full_like(a, elem.max), e.to(torch.float64)) < a
        if not bool(short.any()):
            break
        e = e + short.to(torch.int64)
    ok = torch.ldexp(torch.full_like(a, elem.max), e.to(torch.float64)) >= a
    prev = torch.ldexp(torch.full_like(a, elem.max), (e - 1).to(torch.float64)) < a
    assert bool((ok & prev).all())
    return e


@dataclass(frozen=True)
class Format:
    """A format as its definition states it.

    Attributes:
        element: :data:`ELEMENTS` key.
        block: 1-D block length; 0 = one scale for the whole tensor.
        weight_tile: 2-D ``(rows, cols)`` tiles of the weight ``[N, K]`` (both GEMMs), or None.
        scale: ``"fp32"``, ``"e8m0_floor"``, ``"e8m0_ceil"`` or ``"e4m3_tensor"``.
    """

    element: str
    block: int
    weight_tile: tuple[int, int] | None
    scale: str


FORMATS: dict[str, Format] = {
    # per-tensor fp8: one fp32 scale amax / 448
    "fp8_tensor": Format("e4m3", 0, None, "fp32"),
    # blockwise fp8 (DeepSeek-V3 / TE Float8BlockScaling): 1x128 tiles, 128x128 weight blocks
    "fp8_block": Format("e4m3", 128, (128, 128), "fp32"),
    # OCP MX v1.0: 32-element blocks, e8m0 scale 2**(floor(log2 amax) - emax)
    "mxfp8": Format("e4m3", 32, None, "e8m0_floor"),
    "mxfp4": Format("e2m1", 32, None, "e8m0_floor"),
    "mxfp8_e5m2": Format("e5m2", 32, None, "e8m0_floor"),
    "mxfp8_ceil": Format("e4m3", 32, None, "e8m0_ceil"),
    # NVIDIA NVFP4: 16-element blocks, e4m3 block scale times a per-tensor fp32 scale
    "nvfp4": Format("e2m1", 16, None, "e4m3_tensor"),
    "nvfp4_w16": Format("e2m1", 16, (16, 16), "e4m3_tensor"),
}

#: per operand, the dimension of its canonical 2-D view that each GEMM reduces
#: (X [T, K]: fwd K, wgrad T; W [N, K]: fwd K, dgrad N; dY [T, N]: dgrad N, wgrad T)
_REDUCED_DIM = {
    ("x", "fwd"): 1,
    ("x", "wgrad"): 0,
    ("w", "fwd"): 1,
    ("w", "dgrad"): 0,
    ("dy", "dgrad"): 1,
    ("dy", "wgrad"): 0,
}


def along(fmt: Format, operand: str, orientation: str, shape: tuple[int, int]) -> tuple[int, int]:
    """The block tile ``(rows, cols)`` of a row: ``(1, b)`` / ``(b, 1)`` for 1-D blocks along
    dim 1 / dim 0, the weight tile for ``"both"``, the whole tensor for ``"tensor"``."""
    if orientation == "tensor":
        assert fmt.block == 0
        return (max(shape[0], 1), max(shape[1], 1))
    if orientation == "both":
        assert operand == "w" and fmt.weight_tile is not None
        return fmt.weight_tile
    return (1, fmt.block) if _REDUCED_DIM[(operand, orientation)] == 1 else (fmt.block, 1)


@dataclass(frozen=True)
class Quantized:
    """A reference quantize-dequantize of a 2-D tensor.

    Attributes:
        x: the fp32 tensor that was cast (after the divisor).
        deq: the dequantized tensor, fp32, ``x``'s shape (non-finite elements passed through).
        saturated: bool, ``x``'s shape: the element's ``|x| / s`` rounds past the element's max.
        amax: fp32 per block (over finite elements; 0 for all-zero blocks).
        scale: fp32 per block (0 where ``amax`` is 0 or the scale underflowed).
        scale_under: bool per block: ``amax > 0`` and the scale underflowed its type.
        scale_sat: bool per block: ``amax > 0`` and the scale saturated its type.
    """

    x: torch.Tensor
    deq: torch.Tensor
    saturated: torch.Tensor
    amax: torch.Tensor
    scale: torch.Tensor
    scale_under: torch.Tensor
    scale_sat: torch.Tensor


def _tiles(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """``[blocks, rows*cols]`` of ``x`` cut in tiles (edge tiles zero-padded), row-major blocks."""
    r, c = x.shape
    tr, tc = tile
    pr, pc = -r % tr, -c % tc
    p = torch.nn.functional.pad(x, (0, pc, 0, pr))
    nr, nc = p.shape[0] // tr, p.shape[1] // tc
    return p.reshape(nr, tr, nc, tc).permute(0, 2, 1, 3).reshape(nr * nc, tr * tc)


def _untile(b: torch.Tensor, tile: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    r, c = shape
    tr, tc = tile
    nr, nc = -(-r // tr), -(-c // tc)
    return b.reshape(nr, nc, tr, tc).permute(0, 2, 1, 3).reshape(nr * tr, nc * tc)[:r, :c]


def quantize(
    x2d: torch.Tensor,
    fmt: Format,
    tile: tuple[int, int],
    divisor: float | None = None,
) -> Quantized:
    """Quantize-dequantize ``x2d / divisor`` (fp32) to ``fmt`` with one scale per ``tile``."""
    x = x2d.detach().to(torch.float32)
    if divisor is not None:
        x = x / torch.tensor(divisor, dtype=torch.float32)
    x = x.contiguous()
    elem = ELEMENTS[fmt.element]
    finite = torch.isfinite(x)
    xf = torch.where(finite, x, 0.0)
    blocks = _tiles(xf, tile)
    amax = blocks.abs().amax(dim=1) if blocks.shape[1] else torch.zeros(blocks.shape[0])
    live = amax > 0
    if fmt.scale == "fp32":
        scale = amax / torch.tensor(elem.max, dtype=torch.float32)
        under, sat = live & (scale == 0), torch.isinf(scale)
    elif fmt.scale in ("e8m0_floor", "e8m0_ceil"):
        e = torch.zeros(amax.shape, dtype=torch.int64)
        e[live] = e8m0_exponent(amax[live], elem, fmt.scale.removeprefix("e8m0_"))
        under, sat = live & (e < -127), live & (e > 127)
        scale = torch.ldexp(torch.ones(e.shape, dtype=torch.float64), e.clamp(-127, 127).double())
        scale = scale.to(torch.float32)  # 2**-127 .. 2**127: exact in fp32
    elif fmt.scale == "e4m3_tensor":
        amax_t = xf.abs().amax() if xf.numel() else torch.tensor(0.0)
        s_t = amax_t / torch.tensor(448.0 * 6.0, dtype=torch.float32)
        raw = (amax / torch.tensor(elem.max, dtype=torch.float32)) / s_t
        s_b, sat = round_element(ELEMENTS["e4m3"], torch.where(live, raw, 0.0))
        under, sat = live & (s_b == 0), live & sat
        scale = s_b * s_t
    else:
        raise ValueError(fmt.scale)
    scale = torch.where(live, scale, 0.0)
    usable = scale > 0  # a zero scale (underflow, all-zero block) dequantizes to 0
    safe = torch.where(usable, scale, 1.0)[:, None]
    v = blocks.abs() / safe
    q, saturated = round_element(elem, v)
    deq = torch.sign(blocks) * (q * safe)
    deq = torch.where(usable[:, None], deq, 0.0)
    saturated &= usable[:, None] & (blocks != 0)
    shape = (x.shape[0], x.shape[1])
    deq = torch.where(finite, _untile(deq, tile, shape), x)
    saturated = _untile(saturated, tile, shape) & finite
    return Quantized(x, deq, saturated, amax, scale, under, sat)
