"""Block-scaled number formats as data: element types, block shapes, scale rules, orientations.

The capture side (:mod:`amprobe.capture.collectors.blockstats`) measures what casting a GEMM
operand to each format here would lose; the read side (``analysis/blockfit``, rules AMP-P04 and
AMP-P05) reads the rows back by the keys and labels declared here. Nothing numeric about a format
lives anywhere else. Pure Python: the read side imports it without torch.

Sources:
    * OCP Microscaling Formats (MX) Specification v1.0 (2023): MXFP8 (e4m3 or e5m2 elements) and
      MXFP4 (e2m1 elements), 32-element blocks, one e8m0 (power-of-two) scale per block chosen as
      ``2**(floor(log2(amax)) - emax_elem)``; elements cast round-to-nearest-even, saturating.
    * NVIDIA NVFP4 (Blackwell; "Pretraining LLMs with NVFP4", 2025): e2m1 elements in 16-element
      blocks, one e4m3 scale per block (``amax_b / 6``, expressed in units of a second-level
      per-tensor fp32 scale ``amax_t / (448 * 6)``); NVFP4 training recipes use 16x16 weight tiles.
    * Blockwise fp8 (DeepSeek-V3 recipe, Transformer Engine ``Float8BlockScaling``): e4m3 with
      fp32 scales ``amax / 448`` per 1x128 tile for activations and gradients and per 128x128 block
      for weights.

Hardware: MX and NVFP4 tensor cores are Blackwell's (sm_100). On Hopper, fp8 GEMMs take one scale
per tensor; 1x128 / 128x128 tiles there are a software recipe (the kernel applies the tile scales
around fp8 tensor-core products), not a hardware feature.

Orientations: each operand feeds two GEMMs that reduce along different dimensions, and training
recipes quantize it once per GEMM with blocks laid along the reduced dimension. Canonical 2-D
views: X ``[T, K]``, W ``[N, K]``, dY ``[T, N]`` (T tokens, K in-features, N out-features).
``ORIENTATIONS[op][0]`` lays blocks along dim 1 of the view, ``[1]`` along dim 0:

    X  fwd: along K (Y = X W^T reduces K);   X  wgrad: along T (dW = dY^T X reduces T)
    W  fwd: along K;                         W  dgrad: along N (dX = dY W reduces N)
    dY dgrad: along N;                       dY wgrad: along T

2-D weight tiles serve both GEMMs with the same scales (orientation ``"both"``); a per-tensor scale
has orientation ``"tensor"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_FORMATS",
    "ELEMENTS",
    "FORMATS",
    "NARROWEST",
    "ORIENTATIONS",
    "STAT_FIELDS",
    "BlockFormat",
    "Element",
    "rows_for",
]


@dataclass(frozen=True)
class Element:
    """An element type and how a saturating round-to-nearest-even cast treats it.

    Attributes:
        name: ``"e4m3"``, ``"e5m2"`` or ``"e2m1"``.
        bits: storage bits per element.
        max: largest finite magnitude.
        emax: exponent of the largest binade (``max = m * 2**emax``); OCP MX's shared exponent is
            ``floor(log2(amax)) - emax``.
        mantissa: explicit mantissa bits.
        min_normal_exp: exponent of the smallest normal binade; below it values are subnormal,
            spaced ``min_subnormal`` apart.
        min_subnormal: smallest positive magnitude.
        clip_from: the saturation bound: a magnitude beyond it would round (with an unbounded
            exponent) above ``max``, so the saturating cast clips it to ``max``.
        clip_inclusive: whether ``clip_from`` itself saturates (the tie at ``clip_from`` rounds to
            even: down to ``max`` for e4m3, up past ``max`` for e5m2 and e2m1).
        flush_to: magnitudes at or below it round to zero (the tie at half the smallest subnormal
            goes to the even value, zero).
    """

    name: str
    bits: int
    max: float
    emax: int
    mantissa: int
    min_normal_exp: int
    min_subnormal: float
    clip_from: float
    clip_inclusive: bool
    flush_to: float


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled (or per-tensor scaled) cast of a GEMM operand.

    Attributes:
        name: key (``FORMATS`` key, the ``format`` column of the ``blockstats`` table).
        label: what users read, e.g. ``"MXFP4"``.
        element: :data:`ELEMENTS` key of the element type.
        block: 1-D block length along the dimension the GEMM reduces; 0 = one scale per tensor.
        weight_block: 2-D tiles ``(rows, cols)`` of the canonical weight ``[N, K]``, one scale per
            tile serving both GEMMs; None when weights use ``block`` 1-D like the other operands.
        scale: the scale's type: ``"fp32"``, ``"e8m0"`` (power of two) or ``"e4m3"``.
        scale_rounding: ``"exact"`` (``s = amax / max``, then cast to the scale type: for an
            e4m3 scale (NVFP4) round-to-nearest-even in units of the per-tensor scale), ``"floor"``
            (OCP MX: ``2**(floor(log2 amax) - emax)``; values above ``max * s`` clip) or
            ``"ceil"`` (``2**ceil(log2(amax / max))``: nothing clips, more flushes).
        tensor_scale: NVFP4's second-level per-tensor fp32 scale.
        element_rounding: how elements are cast.
        bits: storage bits per element including the scales (the order of :data:`NARROWEST`).
        recipe: where the format is defined.
        hardware: where it runs natively.
        operands: the operands (``"x"``, ``"w"``, ``"dy"``) it applies to.
        default: measured unless the configuration names formats.
    """

    name: str
    label: str
    element: str
    block: int
    weight_block: tuple[int, int] | None
    scale: str
    scale_rounding: str
    tensor_scale: bool
    element_rounding: str
    bits: float
    recipe: str
    hardware: str
    operands: tuple[str, ...] = ("x", "w", "dy")
    default: bool = True


ELEMENTS: dict[str, Element] = {
    "e4m3": Element(
        name="e4m3",
        bits=8,
        max=448.0,
        emax=8,
        mantissa=3,
        min_normal_exp=-6,
        min_subnormal=2.0**-9,
        clip_from=464.0,
        clip_inclusive=False,
        flush_to=2.0**-10,
    ),
    "e5m2": Element(
        name="e5m2",
        bits=8,
        max=57344.0,
        emax=15,
        mantissa=2,
        min_normal_exp=-14,
        min_subnormal=2.0**-16,
        clip_from=61440.0,
        clip_inclusive=True,
        flush_to=2.0**-17,
    ),
    "e2m1": Element(
        name="e2m1",
        bits=4,
        max=6.0,
        emax=2,
        mantissa=1,
        min_normal_exp=0,
        min_subnormal=0.5,
        clip_from=7.0,
        clip_inclusive=True,
        flush_to=0.25,
    ),
}

_RNE = "nearest-even, saturating"
_MX = "OCP MX v1.0"
_NV = "NVIDIA NVFP4"
_BLACKWELL = "Blackwell tensor cores (sm_100)"

FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat(
            name="fp8_tensor",
            label="fp8 per-tensor",
            element="e4m3",
            block=0,
            weight_block=None,
            scale="fp32",
            scale_rounding="exact",
            tensor_scale=False,
            element_rounding=_RNE,
            bits=8.0,
            recipe="per-tensor fp8 (one fp32 scale amax / 448 per tensor)",
            hardware="Hopper and Blackwell fp8 tensor cores (sm_90, sm_100)",
        ),
        BlockFormat(
            name="fp8_block",
            label="fp8 1x128 blockwise",
            element="e4m3",
            block=128,
            weight_block=(128, 128),
            scale="fp32",
            scale_rounding="exact",
            tensor_scale=False,
            element_rounding=_RNE,
            bits=8.25,
            recipe="blockwise fp8 (1x128 activations and gradients, 128x128 weights)",
            hardware="software recipe on Hopper (tile scales applied around fp8 tensor-core GEMMs)",
        ),
        BlockFormat(
            name="mxfp8",
            label="MXFP8",
            element="e4m3",
            block=32,
            weight_block=None,
            scale="e8m0",
            scale_rounding="floor",
            tensor_scale=False,
            element_rounding=_RNE,
            bits=8.25,
            recipe=_MX,
            hardware=_BLACKWELL,
        ),
        BlockFormat(
            name="mxfp4",
            label="MXFP4",
            element="e2m1",
            block=32,
            weight_block=None,
            scale="e8m0",
            scale_rounding="floor",
            tensor_scale=False,
            element_rounding=_RNE,
            bits=4.25,
            recipe=_MX,
            hardware=_BLACKWELL,
        ),
        BlockFormat(
            name="nvfp4",
            label="NVFP4",
            element="e2m1",
            block=16,
            weight_block=None,
            scale="e4m3",
            scale_rounding="exact",
            tensor_scale=True,
            element_rounding=_RNE,
            bits=4.5,
            recipe=_NV,
            hardware=_BLACKWELL,
        ),
        BlockFormat(
            name="mxfp8_e5m2",
            label="MXFP8 (e5m2)",
            element="e5m2",
            block=32,
            weight_block=None,
            scale="e8m0",
            scale_rounding="floor",
            tensor_scale=False,
            element_rounding=_RNE,
            bits=8.25,
            recipe=_MX + " (e5m2 elements for gradients)",
            hardware=_BLACKWELL,
            operands=("dy",),
            default=False,
        ),
        BlockFormat(
            name="mxfp8_ceil",
            label="MXFP8 (round-up scale)",
            element="e4m3",
            block=32,
            weight_block=None,
            scale="e8m0",
            scale_rounding="ceil",
            tensor_scale=False,
            element_rounding=_RNE,
            bits=8.25,
            recipe=_MX + " elements, scale rounded up (2**ceil(log2(amax / 448))): nothing clips",
            hardware=_BLACKWELL,
            default=False,
        ),
        BlockFormat(
            name="nvfp4_w16",
            label="NVFP4 (16x16 weights)",
            element="e2m1",
            block=16,
            weight_block=(16, 16),
            scale="e4m3",
            scale_rounding="exact",
            tensor_scale=True,
            element_rounding=_RNE,
            bits=4.5,
            recipe=_NV + " training recipe (16x16 weight tiles)",
            hardware=_BLACKWELL,
            default=False,
        ),
    )
}

#: the formats measured unless the configuration names others (``amprobe.config`` keeps the
#: same names, ``BLOCK_FORMAT_NAMES`` and ``DEFAULT_BLOCK_FORMATS``, to validate
#: ``block_formats``: the configuration sits below the store, and the store imports no
#: configuration; tests/test_blockstats.py checks that the two agree)
DEFAULT_FORMATS: tuple[str, ...] = ("fp8_tensor", "fp8_block", "mxfp8", "mxfp4", "nvfp4")

#: The order AMP-P04 tries formats in, narrowest first (bits per element with scales: MXFP4 4.25,
#: NVFP4 4.5, MXFP8 and blockwise fp8 8.25).
NARROWEST: tuple[str, ...] = ("mxfp4", "nvfp4", "mxfp8", "fp8_block")

#: Per operand, the GEMMs it feeds: index 0 blocks along dim 1 of the canonical view, index 1
#: along dim 0 (see the module docstring).
ORIENTATIONS: dict[str, tuple[str, str]] = {
    "x": ("fwd", "wgrad"),
    "w": ("fwd", "dgrad"),
    "dy": ("dgrad", "wgrad"),
}

#: The statistics of one (operand, orientation, format) row, in the column order
#: ``measure()`` returns: counts (``elements``, ``nonzero``, ``nonfinite``, ``flushed``,
#: ``clipped``, ``blocks``, ``scale_under``, ``scale_sat``) then the float64 sums ``signal``
#: (sum x**2) and ``noise`` (sum (x - dequantized)**2) over finite elements.
STAT_FIELDS: tuple[str, ...] = (
    "elements",
    "nonzero",
    "nonfinite",
    "flushed",
    "clipped",
    "blocks",
    "scale_under",
    "scale_sat",
    "signal",
    "noise",
)


def rows_for(operand: str, formats: Sequence[str]) -> list[tuple[str, str]]:
    """The ``(orientation, format)`` rows measured for ``operand``, in the order ``measure()`` returns.

    Formats in the order given, each skipped where it does not apply to the operand; per format:
    ``("tensor", f)`` for a per-tensor scale, ``("both", f)`` for a weight with 2-D tiles, else
    both orientations of :data:`ORIENTATIONS` (along dim 1 first).

    Raises:
        KeyError: an unknown operand or format, with the known names.
    """
    if operand not in ORIENTATIONS:
        raise KeyError(f"unknown operand {operand!r}; known: {sorted(ORIENTATIONS)}")
    rows: list[tuple[str, str]] = []
    for name in formats:
        fmt = FORMATS.get(name)
        if fmt is None:
            raise KeyError(f"unknown block format {name!r}; known: {sorted(FORMATS)}")
        if operand not in fmt.operands:
            continue
        if fmt.block == 0:
            rows.append(("tensor", name))
        elif operand == "w" and fmt.weight_block is not None:
            rows.append(("both", name))
        else:
            rows.extend((orient, name) for orient in ORIENTATIONS[operand])
    return rows
