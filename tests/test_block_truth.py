"""Truth of the block statistics (#36): the capture side against a cast from the definitions.

``tests/blockref.py`` quantizes from the OCP MX v1.0, NVFP4 and fp8 recipe definitions, sharing
no code with the capture side. Here it is first checked against torch's own casts (e4m3, e5m2,
e8m0) and against torchao's MX and NVFP4 casts (where the definitions and torchao disagree, the
definitions are the truth and each difference is pinned, with its numbers). Then
``blockstats.measure`` (the compiled C kernel and the eager reduction) is compared with it on
Gaussian, heavy-tailed (Student-t, 2 degrees of freedom), outlier-channel, tiny-gradient (fp32
subnormals), all-zero-block, wide-range (12 decades) and non-finite tensors, in shapes the blocks
divide and shapes they do not (128x512 and 72x200 for each kind, 130x260 across the kernel's
128x128 strips, degenerate ones), fp32/bf16/fp16, transposed views and divided by a loss scale
(a float and a 0-d tensor), for every format in ``FORMATS``, every operand and orientation. The
formats' data (``amprobe.store.blockformats``) is first compared with the reference's own
statement of them, field by field.

Tolerance (the issue's "Truth"): flushed and clipped shares of the nonzero elements within
0.1 percentage point, scale underflow and saturation shares of the blocks within 0.1 percentage
point, SQNR within 0.5 dB; element, nonzero, non-finite and block counts exact. The same
comparison with a wrong block size (32 for 16, 16 for 32, 64 for 128, 1-D rows for 2-D tiles,
1x128 blocks for one scale per tensor) must fall outside the tolerance (the statistics, not the
block count) for at least one tensor kind per format.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import pytest
import torch

from amprobe.store import blockformats as bf
from tests import blockref as ref

SHARE_TOL_PP = 0.1  # flushed, clipped (of nonzero); scale_under, scale_sat (of blocks)
SQNR_TOL_DB = 0.5

# --------------------------------------------------------------------------- tensors


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _gaussian(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g)


def _heavy(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    # Student-t with 2 degrees of freedom: z / sqrt(chi2_2 / 2)
    z, a, b = (torch.randn(shape, generator=g) for _ in range(3))
    return z / torch.sqrt((a * a + b * b) / 2)


def _outlier(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    # a few K columns (dim 1) 100 to 1000 times the rest
    x = torch.randn(shape, generator=g)
    cols = torch.randperm(shape[1], generator=g)[:4]
    x[:, cols] *= torch.pow(10.0, torch.empty(4).uniform_(2, 3, generator=g))
    return x


def _tiny(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    # magnitudes log-uniform in 1e-42 .. 1e-38 (mostly fp32 subnormals, below 2**-126), random
    # signs; two rows 300 times smaller still (blocks whose fp32 or e4m3 scale underflows)
    lo, hi = math.log(1e-42), math.log(1e-38)
    x = torch.exp(torch.empty(shape).uniform_(lo, hi, generator=g))
    x = x * torch.randn(shape, generator=g).sign()
    x[1:3] /= 300.0
    return x


def _zero_blocks(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    # all-zero blocks in both orientations and all-zero 2-D tiles
    x = torch.randn(shape, generator=g)
    x[:16] = 0.0
    x[:, :32] = 0.0
    x[:128, 128:256] = 0.0
    return x


def _wide(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    # magnitudes log-uniform over 12 decades: what a block flushes depends on its amax
    x = torch.pow(10.0, torch.empty(shape).uniform_(-6, 6, generator=g))
    return x * torch.randn(shape, generator=g).sign()


def _nonfinite(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    x = 3.0 * torch.randn(shape, generator=g)
    idx = torch.randperm(x.numel(), generator=g)[:30]
    x.view(-1)[idx[:10]] = math.inf
    x.view(-1)[idx[10:20]] = -math.inf
    x.view(-1)[idx[20:]] = math.nan
    return x


KINDS: dict[str, Callable[[tuple[int, int], torch.Generator], torch.Tensor]] = {
    "gaussian": _gaussian,
    "heavy": _heavy,
    "outlier": _outlier,
    "tiny": _tiny,
    "zero_blocks": _zero_blocks,
    "wide": _wide,
    "nonfinite": _nonfinite,
}


@cache
def tensor(kind: str, shape: tuple[int, int] = (256, 512), seed: int = 0) -> torch.Tensor:
    return KINDS[kind](shape, _gen(seed))


# --------------------------------------------------------------------------- the reference, checked


def _around(values: torch.Tensor) -> torch.Tensor:
    """Values, the midpoints between neighbours (the ties) and fp32 neighbours of both."""
    v = values.to(torch.float32)
    mids = ((values[1:].double() + values[:-1].double()) / 2).to(torch.float32)
    pts = torch.cat([v, mids])
    up = torch.nextafter(pts, torch.tensor(math.inf))
    down = torch.nextafter(pts, torch.tensor(0.0))
    return torch.cat([pts, up, down])


def _random_magnitudes(lo: float, hi: float, n: int = 50_000) -> torch.Tensor:
    g = _gen(7)
    return torch.exp2(torch.empty(n, dtype=torch.float64).uniform_(lo, hi, generator=g)).float()


@pytest.mark.parametrize(
    ("name", "dtype"), [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)]
)
def test_reference_elements_are_torchs_casts(name: str, dtype: torch.dtype) -> None:
    elem = ref.ELEMENTS[name]
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = torch.unique(every[torch.isfinite(every) & (every >= 0)])
    assert finite.double().tolist() == list(elem.values)  # the enumeration is the type
    grid = torch.tensor((*elem.values, elem.beyond), dtype=torch.float64)
    v = torch.cat([_around(grid), _random_magnitudes(-30, 18), _random_magnitudes(-149, -120)])
    v = torch.cat([v, -v])
    q, saturated = ref.round_element(elem, v.abs())
    q = q * v.sign()
    cast = v.to(dtype).float()
    if name == "e4m3":
        # torch's e4m3 cast saturates (448): equal everywhere
        assert torch.equal(q, cast)
        # the tie 464 between 448 (even) and 480 (odd code) rounds down: only v > 464 clips
        assert bool(saturated[v.abs() > 464].all()) and not bool(saturated[v.abs() <= 464].any())
    else:
        # torch's e5m2 cast does not saturate: it overflows to inf exactly where the unbounded
        # rounding passes 57344 (v >= 61440, the tie going to the even 2**16)
        assert torch.equal(torch.isinf(cast), saturated)
        assert torch.equal(q[~saturated], cast[~saturated])
        assert bool(saturated[v.abs() >= 61440].all()) and not bool(
            saturated[v.abs() < 61440].any()
        )


def test_reference_e2m1_is_its_table() -> None:
    elem = ref.ELEMENTS["e2m1"]
    # the bit definition: sign, 2 exponent bits (bias 1), 1 mantissa bit, subnormal at exponent 0
    bits = [((-1) ** (c >> 3), (c >> 1) & 3, c & 1) for c in range(16)]
    from_bits = [s * (m / 2 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)) for s, e, m in bits]
    assert from_bits == list(ref.E2M1_TABLE) and elem.values == ref.E2M1_TABLE[:8]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 6.5, 7.5, math.inf])
    q, saturated = ref.round_element(elem, ties)
    assert q.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0]
    assert saturated.tolist() == [False] * 6 + [False, True, False, True, True]


def test_reference_e8m0_scales_are_torchs_e8m0() -> None:
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).float()
    assert torch.isnan(every[255])
    assert every[:255].double().tolist() == [math.ldexp(1.0, e) for e in range(-127, 128)]
    # floor(log2 a): torch's e8m0 cast returns one of the two powers of two around a
    # (normal range): the floor is the one not above a
    pow2 = torch.ldexp(torch.tensor(1.0), torch.arange(-126, 127).float())
    a = torch.cat([_around(pow2), _random_magnitudes(-126, 126)])
    a = a[(a >= 2.0**-126) & (a < 2.0**127)]
    c = a.to(torch.float8_e8m0fnu).float()
    floor = torch.frexp(torch.where(c > a, c / 2, c).double()).exponent - 1
    for name in ("e4m3", "e2m1", "e5m2"):
        elem = ref.ELEMENTS[name]
        assert torch.equal(ref.e8m0_exponent(a, elem, "floor"), floor - elem.emax)
        # the round-up rule: the smallest e with 2**e * max >= a (checked inside, in float64)
        ref.e8m0_exponent(a, elem, "ceil")
    e4m3 = ref.ELEMENTS["e4m3"]
    a = torch.tensor([448.0, 448.00003, 224.0, 1.0, 2.0**-130])
    assert ref.e8m0_exponent(a, e4m3, "ceil").tolist() == [0, 1, -1, -8, -138]
    # fp32 subnormals: floor(log2) exact below 2**-126
    sub = torch.tensor([2.0**-149, 2.0**-140 * 1.5, 2.0**-127, 2.0**-126 * 0.99])
    assert ref.e8m0_exponent(sub, ref.ELEMENTS["e4m3"], "floor").tolist() == [
        -157,
        -148,
        -135,
        -135,
    ]


def test_formats_data_is_the_definition() -> None:
    """The capture side's formats are the reference's, field by field."""
    scale_kind = {
        ("fp32", "exact", False): "fp32",
        ("e8m0", "floor", False): "e8m0_floor",
        ("e8m0", "ceil", False): "e8m0_ceil",
        ("e4m3", "exact", True): "e4m3_tensor",
    }
    assert set(bf.FORMATS) == set(ref.FORMATS)
    for name, f in bf.FORMATS.items():
        r = ref.FORMATS[name]
        assert (f.element, f.block, f.weight_block) == (r.element, r.block, r.weight_tile), name
        assert scale_kind[(f.scale, f.scale_rounding, f.tensor_scale)] == r.scale, name
    for name, e in bf.ELEMENTS.items():
        r = ref.ELEMENTS[name]
        top = len(r.values)
        assert (e.max, e.emax, e.min_subnormal) == (r.max, r.emax, r.values[1]), name
        assert (e.flush_to, e.clip_from) == (r.values[1] / 2, (r.max + r.beyond) / 2), name
        assert e.clip_inclusive == (top % 2 == 0), name  # the tie goes to `beyond` if even
    for op, orients in bf.ORIENTATIONS.items():
        f = ref.FORMATS["mxfp8"]
        assert [ref.along(f, op, o, (64, 64)) for o in orients] == [(1, 32), (32, 1)]
    for op in bf.ORIENTATIONS:
        expected = []
        for name in bf.FORMATS:
            f = bf.FORMATS[name]
            if op not in f.operands:
                continue
            if f.block == 0:
                expected.append(("tensor", name))
            elif op == "w" and f.weight_block:
                expected.append(("both", name))
            else:
                expected += [(o, name) for o in bf.ORIENTATIONS[op]]
        assert bf.rows_for(op, list(bf.FORMATS)) == expected


# --------------------------------------------------------------------------- torchao's casts


def _torchao() -> None:
    pytest.importorskip(
        "torchao.prototype.mx_formats",
        reason="torchao not installed (test-only extra: pip install -e '.[truth]')",
    )


def _share(mask: torch.Tensor, of: torch.Tensor) -> float:
    return 100.0 * float((mask & of).sum()) / max(int(of.sum()), 1)


def _sqnr(x: torch.Tensor, deq: torch.Tensor) -> float:
    fin = torch.isfinite(x)
    s = float((x[fin].double() ** 2).sum())
    n = float(((x[fin].double() - deq[fin].double()) ** 2).sum())
    return math.inf if n == 0 else 10 * math.log10(s / n)


def _per_element(blocks: torch.Tensor, shape: tuple[int, int], b: int) -> torch.Tensor:
    """A per-block tensor of 1-D blocks along dim 1 spread over the elements."""
    return blocks.reshape(shape[0], shape[1] // b).repeat_interleave(b, dim=1)


def _flushed(x: torch.Tensor, deq: torch.Tensor) -> float:
    return _share(deq == 0, (x != 0) & torch.isfinite(x))


def test_reference_e2m1_is_torchaos_fp4_cast() -> None:
    """e2m1 has no torch dtype cast: torchao's fp4 cast (RNE, saturating) on the values, the
    ties, their fp32 neighbours and random magnitudes."""
    _torchao()
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

    elem = ref.ELEMENTS["e2m1"]
    grid = torch.tensor((*elem.values, elem.beyond), dtype=torch.float64)
    v = torch.cat([_around(grid), _random_magnitudes(-4, 4)])
    v = torch.cat([v, -v])
    q, _ = ref.round_element(elem, v.abs())
    cast = f4_unpacked_to_f32(f32_to_f4_unpacked(v.contiguous()))
    assert torch.equal(q * v.sign(), cast)


MX_KINDS = ("gaussian", "heavy", "outlier", "zero_blocks", "tiny")


@pytest.mark.parametrize(
    ("fmt", "mode"), [("mxfp8", "FLOOR"), ("mxfp4", "FLOOR"), ("mxfp8_ceil", "RCEIL")]
)
def test_torchao_mx_agrees_except_at_the_smallest_scale(fmt: str, mode: str) -> None:
    """torchao 0.18.0's ``to_mx`` (CPU) is the definition except in blocks whose e8m0 scale is
    2**-127 (code 0), which the definitions and torchao handle differently:

    * FLOOR: torchao divides by ``max(scale, 2**-126)`` (its float32-normal clamp) and multiplies
      back by 2**-127: those blocks come back at half their value. On the "tiny" tensor
      (256x512, magnitudes 1e-42..1e-38, every block at code 0) MXFP8 flushes 26.80 % of the
      nonzero values and keeps 6.01 dB SQNR, against 19.27 % and 31.56 dB by the definition;
      MXFP4: 86.89 % / 5.11 dB against 79.37 % / 12.99 dB.
    * RCEIL (torchao's round-up mode, the definition's ``ceil``: ``2**ceil(log2(amax / max))``):
      at code 0 its reciprocal is taken as 1.0 instead of 2**127, so the values are cast unscaled
      and flush: 100 % flushed, 0 dB on "tiny", against 19.27 % / 31.56 dB by the definition.
      (torchao's mode named CEIL is another rule, ``2**(ceil(log2 amax) - emax)``, not compared.)

    Everywhere else the e8m0 codes and the dequantized values are bit-identical.
    """
    _torchao()
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    r = ref.FORMATS[fmt]
    elem = ref.ELEMENTS[r.element]
    dtype = torch.float8_e4m3fn if r.element == "e4m3" else torch.float4_e2m1fn_x2
    seen = {}
    for kind in MX_KINDS:
        x = tensor(kind)
        shape = (x.shape[0], x.shape[1])
        codes, data = to_mx(x, dtype, 32, getattr(ScaleCalculationMode, mode))
        got = to_dtype(data, codes, dtype, 32, torch.float32)
        q = ref.quantize(x, r, (1, 32))
        live = q.amax > 0
        e = torch.frexp(q.scale.double()).exponent - 1
        codes = codes.view(torch.uint8).reshape(-1).to(torch.int64)
        assert torch.equal(codes[live], e[live] + 127), kind
        assert bool((codes[~live] == 0).all()), kind  # an all-zero block: code 0, values 0
        smallest = _per_element(live & (e == -127), shape, 32)
        # the torchao cast of a code-0 block: x / d rounded, times 2**-127
        d = 2.0**-126 if mode == "FLOOR" else 1.0
        qs, _ = ref.round_element(elem, x.abs() / d)
        model = torch.where(smallest, x.sign() * (qs * 2.0**-127), q.deq)
        assert torch.equal(got, model), kind
        seen[kind] = (_flushed(x, got), _flushed(x, q.deq), _sqnr(x, got), _sqnr(x, q.deq))
        if not bool(smallest.any()):
            assert torch.equal(got, q.deq), kind
    # every block of "tiny" is at code 0: the numbers of the docstring, pinned
    flushed_ao, flushed_def, sqnr_ao, sqnr_def = seen["tiny"]
    expected = {
        "mxfp8": (26.80, 19.27, 6.01, 31.56),
        "mxfp4": (86.89, 79.37, 5.11, 12.99),
        "mxfp8_ceil": (100.0, 19.27, 0.0, 31.56),
    }[fmt]
    assert flushed_ao == pytest.approx(expected[0], abs=0.01)
    assert flushed_def == pytest.approx(expected[1], abs=0.01)
    assert sqnr_ao == pytest.approx(expected[2], abs=0.01)
    assert sqnr_def == pytest.approx(expected[3], abs=0.01)
    for kind in ("gaussian", "heavy", "outlier", "zero_blocks"):
        assert seen[kind][0] == seen[kind][1] and seen[kind][2] == seen[kind][3], kind


# --------------------------------------------------------------------------- the capture side


#: the shape of the truth test's main tensors (four 128x128 weight tiles)
MAIN = (128, 512)


@dataclass(frozen=True)
class Case:
    """One tensor measured as each operand: its kind, shape, dtype, layout and loss scale."""

    kind: str
    shape: tuple[int, int] = MAIN
    dtype: torch.dtype = torch.float32
    divisor: float | None = None
    transposed: bool = False  # measured through a non-contiguous (transposed) view
    divisor_tensor: bool = False  # the loss scale as a 0-d fp32 tensor (as numerics passes it)

    def tensor(self) -> torch.Tensor:
        if self.transposed:
            x = tensor(self.kind, (self.shape[1], self.shape[0])).t()
        else:
            x = tensor(self.kind, self.shape)
        return x.to(self.dtype)


def _nvfp4_saturating_divisor() -> float:
    return float(tensor("tiny", (72, 200)).abs().amax()) / (2688.0 * 1.49 * 2.0**-149)


CASES = [Case(k) for k in KINDS if k != "nonfinite"] + [
    # shapes no block divides (72 = 4.5 x 16, 200 = 6.25 x 32), all kinds
    *(Case(k, (72, 200)) for k in KINDS),
    # gradients divided by their loss scale (a power of two, and not), bf16 and fp16 operands,
    # a transposed view
    Case("gaussian", (72, 200), divisor=1024.0, divisor_tensor=True),
    Case("tiny", (72, 200), divisor=3.0),
    Case("heavy", (72, 200), dtype=torch.bfloat16),
    Case("outlier", (72, 200), dtype=torch.float16),
    Case("outlier", (200, 72), transposed=True),
    # more than one 128x128 strip each way, neither a multiple; degenerate shapes
    Case("heavy", (130, 260)),
    Case("tiny", (1, 7)),
    Case("gaussian", (3, 1)),
    Case("gaussian", (0, 16)),
    # NVFP4's per-tensor scale amax_t / 2688 an fp32 subnormal of one bit (2**-149): block
    # scales (amax_b / 6) / s_t up to 448 * 1.49, past e4m3's 464 (scale saturation)
    Case("tiny", (72, 200), divisor=_nvfp4_saturating_divisor()),
]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # many small elementwise ops: on a shared 2-core machine torch's second thread costs more
    # than it gives
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


ALL_FORMATS = list(bf.FORMATS)


def ref_stats(q: ref.Quantized) -> dict[str, float]:
    """The STAT_FIELDS of a reference cast (the spec's definitions)."""
    fin = torch.isfinite(q.x)
    nz = fin & (q.x != 0)
    xd, dd = torch.where(fin, q.x, 0.0).double(), torch.where(fin, q.deq, 0.0).double()
    return {
        "elements": q.x.numel(),
        "nonzero": int(nz.sum()),
        "nonfinite": int((~fin).sum()),
        "flushed": int((nz & (q.deq == 0)).sum()),
        "clipped": int((nz & q.saturated).sum()),
        "blocks": q.amax.numel(),
        "scale_under": int(q.scale_under.sum()),
        "scale_sat": int(q.scale_sat.sum()),
        "signal": float((xd * xd).sum()),
        "noise": float(((xd - dd) ** 2).sum()),
    }


def _db(signal: float, noise: float) -> float:
    if signal == 0:
        return math.nan
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def deviations(got: dict[str, float], want: dict[str, float]) -> dict[str, float]:
    """Per statistic, how far ``got`` is from ``want`` (pp of nonzero / blocks, dB, counts)."""
    out = {}
    for f in ("elements", "nonzero", "nonfinite", "blocks"):
        out[f] = abs(got[f] - want[f])
    for f, of in (
        ("flushed", "nonzero"),
        ("clipped", "nonzero"),
        ("scale_under", "blocks"),
        ("scale_sat", "blocks"),
    ):
        out[f] = 100.0 * abs(got[f] / max(got[of], 1) - want[f] / max(want[of], 1))
    a, b = _db(got["signal"], got["noise"]), _db(want["signal"], want["noise"])
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        out["sqnr"] = 0.0 if (a == b or (math.isnan(a) and math.isnan(b))) else math.inf
    else:
        out["sqnr"] = abs(a - b)
    out["signal"] = abs(got["signal"] - want["signal"]) / max(want["signal"], 1e-300)
    return out


def within_tolerance(dev: dict[str, float]) -> bool:
    """The issue's tolerance: shares within 0.1 pp, SQNR within 0.5 dB."""
    return (
        all(dev[f] <= SHARE_TOL_PP for f in ("flushed", "clipped", "scale_under", "scale_sat"))
        and dev["sqnr"] <= SQNR_TOL_DB
    )


def within(dev: dict[str, float]) -> bool:
    """The tolerance, and the counts exact (the same tensor, blocks and sums)."""
    return (
        within_tolerance(dev)
        and all(dev[f] == 0 for f in ("elements", "nonzero", "nonfinite", "blocks"))
        and dev["signal"] <= 1e-9
    )


@cache
def reference(case: Case, fmt: str, tile: tuple[int, int]) -> dict[str, float]:
    return ref_stats(ref.quantize(case.tensor(), ref.FORMATS[fmt], tile, case.divisor))


@contextmanager
def path(which: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """measure() through the C kernel (the eager reduction made to fail; "kernel-generic": its
    generic per-element loop, which CPUs without AVX-512 run), the eager one, or the eager one on
    a CUDA device."""
    from amprobe.capture.collectors import blockstats, numkernel

    if which == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
    elif which == "eager":
        monkeypatch.setattr(numkernel, "kernel", lambda: None)
    else:
        k = numkernel.wait()
        if k is None and numkernel.status().startswith("unavailable"):
            pytest.skip(f"no compiled kernel: {numkernel.status()}")
        assert k is not None and hasattr(k, "block_pass"), "the kernel has no block pass"

        eager = blockstats._eager

        def no_eager(x2d: torch.Tensor, *args: object) -> torch.Tensor:
            # an empty tensor is left to the eager reduction by design
            assert x2d.numel() == 0, "measure() fell back to the eager reduction"
            return eager(x2d, *args)

        monkeypatch.setattr(blockstats, "_eager", no_eager)
        if which == "kernel-generic":
            assert k.block_simd(0) == 0
            try:
                yield
            finally:
                k.block_simd(-1)
            return
    yield


def measured(
    case: Case, operand: str, device: str = "cpu"
) -> list[tuple[str, str, dict[str, float]]]:
    from amprobe.capture.collectors import blockstats

    divisor: torch.Tensor | float | None = case.divisor
    if case.divisor_tensor:
        divisor = torch.tensor(case.divisor, dtype=torch.float32, device=device)
    out = blockstats.measure(case.tensor().to(device), operand, ALL_FORMATS, divisor)
    assert out.device.type == device
    out = out.cpu()
    rows = bf.rows_for(operand, ALL_FORMATS)
    assert out.dtype == torch.float64 and tuple(out.shape) == (len(rows), len(bf.STAT_FIELDS))
    return [
        (orient, fmt, dict(zip(bf.STAT_FIELDS, r.tolist(), strict=True)))
        for (orient, fmt), r in zip(rows, out, strict=True)
    ]


def compare_all(which: str) -> tuple[list[str], dict[tuple[str, str], float]]:
    """Failures (one line each) and the largest deviation per (format, statistic)."""
    failures, worst = [], {}
    for case in CASES:
        shape = (case.shape[0], case.shape[1])
        for operand in bf.ORIENTATIONS:
            device = "cuda" if which == "cuda" else "cpu"
            for orient, fmt, got in measured(case, operand, device):
                tile = ref.along(ref.FORMATS[fmt], operand, orient, shape)
                dev = deviations(got, reference(case, fmt, tile))
                for stat, d in dev.items():
                    worst[(fmt, stat)] = max(worst.get((fmt, stat), 0.0), d)
                if not within(dev):
                    bad = {k: round(v, 4) for k, v in dev.items() if v}
                    failures.append(f"{which} {case} {operand}/{orient} {fmt}: {bad}")
    return failures, worst


@pytest.mark.parametrize(
    "which", ["kernel", "kernel-generic", "eager", pytest.param("cuda", marks=pytest.mark.cuda)]
)
def test_capture_matches_the_definition(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with path(which, monkeypatch):
        failures, _ = compare_all(which)
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} rows outside tolerance)"


def _wrong(fmt: str, tile: tuple[int, int], shape: tuple[int, int]) -> tuple[int, int]:
    """A wrong block for the same row: 32 for 16, 16 for 32, 64 for 128, 1-D for 2-D tiles,
    1x128 blocks for one scale per tensor."""
    if tile == shape:
        return (1, 128)
    if min(tile) > 1:
        return (1, tile[1])
    b = max(tile)
    w = {16: 32, 32: 16, 128: 64}[b]
    return (1, w) if tile[0] == 1 else (w, 1)


def test_a_wrong_block_size_falls_outside_the_tolerance() -> None:
    """Not a tautology: the comparison tells the block size (per format and row kind). measure()
    runs its default path here (the kernel once built): both paths are checked above."""
    caught: dict[tuple[str, str], set[str]] = {}
    for case in [c for c in CASES if c.shape == MAIN]:
        shape = (case.shape[0], case.shape[1])
        for operand in bf.ORIENTATIONS:
            for orient, fmt, got in measured(case, operand):
                if orient == bf.ORIENTATIONS[operand][1]:
                    continue  # one 1-D orientation is enough (and keeps the test fast)
                key = (fmt, "2-D" if orient == "both" else "1-D")
                tile = ref.along(ref.FORMATS[fmt], operand, orient, shape)
                wrong = reference(case, fmt, _wrong(fmt, tile, shape))
                # the statistics, not the block count, must tell
                if not within_tolerance(deviations(got, wrong)):
                    caught.setdefault(key, set()).add(case.kind)
                else:
                    caught.setdefault(key, set())
    assert all(caught.values()), [k for k, v in caught.items() if not v]
    assert {f for f, _ in caught} == set(bf.FORMATS)
    # the round-up scale keeps every Gaussian-like value normal in e4m3 at 16 or 32: only the
    # wide-range kind tells its block size
    assert caught[("mxfp8_ceil", "1-D")] == {"wide"}


def _tiny_rows(shape: tuple[int, int] = (256, 512)) -> torch.Tensor:
    # gradient rows of very different sizes: Gaussian rows scaled by 10**U(-38, -32) (the
    # tensor's amax stays above 2688 * 64 / FLT_MAX, where torchao's NVFP4 reciprocal
    # (1 / s_t) / s_b is finite for the blocks it raises to s_b = 2**-6)
    g = _gen(3)
    return torch.randn(shape, generator=g) * torch.pow(
        10.0, torch.empty(shape[0], 1).uniform_(-38, -32, generator=g)
    )


def test_torchao_nvfp4_agrees_except_for_small_block_scales() -> None:
    """torchao 0.18.0's NVFP4 cast (``NVFP4Tensor.to_nvfp4`` with the per-tensor scale
    ``amax_t / (448 * 6)``, CPU) is the definition except in two places:

    * a block scale ``(amax_b / 6) / s_t`` below 2**-6 (e4m3's smallest normal) is raised to
      2**-6 instead of rounded to e4m3 (subnormals down to 2**-9, 0 below 2**-10): such blocks
      are cast with a coarser scale (more flushed) or, where the definition's scale underflows
      to 0, kept. On ``_tiny_rows`` (256x512) 29.8 % of the blocks are affected: torchao
      flushes 20.51 % of the nonzero values, the definition 16.27 % (SQNR both 20.36 dB).
    * its per-tensor reciprocal ``1 / s_t`` overflows to inf when ``amax_t < 2688 / FLT_MAX``
      (about 7.9e-36): every nonzero value then comes back as ``±6 * s`` (saturated) and the
      zeros as garbage. On "tiny" (magnitudes 1e-42..1e-38) torchao flushes 0 % at -8.35 dB
      SQNR, the definition 59.09 % at 21.47 dB.

    Elsewhere (Gaussian, heavy-tailed, outlier-channel, all-zero blocks) the e4m3 block scales
    and the dequantized values are bit-identical.
    """
    _torchao()
    from torchao.prototype.mx_formats.nvfp4_tensor import (
        NVFP4Tensor,
        per_tensor_amax_to_scale,
    )

    r, e4m3, e2m1 = ref.FORMATS["nvfp4"], ref.ELEMENTS["e4m3"], ref.ELEMENTS["e2m1"]
    seen = {}
    for kind in (*MX_KINDS, "tiny_rows"):
        x = _tiny_rows() if kind == "tiny_rows" else tensor(kind)
        shape = (x.shape[0], x.shape[1])
        amax_t = x.abs().amax()
        t = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(amax_t))
        got = t.dequantize(torch.float32)
        q = ref.quantize(x, r, (1, 16))
        seen[kind] = (_flushed(x, got), _flushed(x, q.deq), _sqnr(x, got), _sqnr(x, q.deq))
        s_t = amax_t / (448.0 * 6.0)
        raw = (q.amax / 6.0) / s_t
        live = q.amax > 0
        s_b, _ = ref.round_element(e4m3, raw)
        ao_s_b = t.scale.float().reshape(-1)
        if kind == "tiny":
            assert bool(torch.isinf(1.0 / s_t))
            nz = x != 0
            per = _per_element(ao_s_b * s_t, shape, 16)
            assert torch.equal(got[nz], x.sign()[nz] * 6.0 * per[nz])
            continue
        small = live & (raw < 2.0**-6)
        assert torch.equal(ao_s_b[live & ~small], s_b[live & ~small]), kind
        assert bool((ao_s_b[small] == 2.0**-6).all()), kind
        s = 2.0**-6 * s_t
        qs, _ = ref.round_element(e2m1, x.abs() / s)
        model = torch.where(_per_element(small, shape, 16), x.sign() * (qs * s), q.deq)
        assert torch.equal(got, model), kind
        if kind != "tiny_rows":
            assert not bool(small.any()) and torch.equal(got, q.deq), kind
    pinned = {"tiny": (0.0, 59.09, -8.35, 21.47), "tiny_rows": (20.51, 16.27, 20.36, 20.36)}
    for kind, (flushed_ao, flushed_def, sqnr_ao, sqnr_def) in pinned.items():
        assert seen[kind] == pytest.approx((flushed_ao, flushed_def, sqnr_ao, sqnr_def), abs=0.01)
    for kind in ("gaussian", "heavy", "outlier", "zero_blocks"):
        assert seen[kind][0] == seen[kind][1] and seen[kind][2] == seen[kind][3], kind


def test_the_cases_exercise_every_statistic() -> None:
    """The tensors reach every statistic, so agreement on them means something."""
    hits: dict[str, set[str]] = {}
    for case in CASES:
        shape = (case.shape[0], case.shape[1])
        for operand in bf.ORIENTATIONS:
            for orient, fmt in bf.rows_for(operand, ALL_FORMATS):
                st = reference(case, fmt, ref.along(ref.FORMATS[fmt], operand, orient, shape))
                hits.setdefault(fmt, set()).update(
                    k
                    for k in ("flushed", "clipped", "scale_under", "scale_sat", "nonfinite")
                    if st[k]
                )
    for fmt, got in hits.items():
        # an fp32 scale never saturates, and clips only when subnormal (a per-tensor scale is
        # not, here); e8m0 saturates only for amax >= 2**127 * 2**emax (beyond fp32); a
        # round-up scale never clips
        expected = {"flushed", "nonfinite"} | {
            "fp8_tensor": set(),
            "fp8_block": {"clipped", "scale_under"},
            "mxfp8_ceil": {"scale_under"},
        }.get(fmt, {"clipped", "scale_under"})
        if fmt.startswith("nvfp4"):
            expected |= {"scale_sat"}
        assert got == expected, fmt
