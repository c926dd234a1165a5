"""blockstats: the block statistics of #36 on small cases worked out by hand, the element casts
against torch's float8 casts, and the compiled CPU kernel equal to the eager reduction on every
format, orientation, dtype and awkward tensor (tiny, all-zero blocks, inf/NaN, odd shapes).

The independent reference (the truth test against real casts) lives in tests/blockref.py; this
file shares nothing with it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from amprobe.capture.collectors import blockstats, numkernel
from amprobe.store.blockformats import (
    DEFAULT_FORMATS,
    ELEMENTS,
    FORMATS,
    NARROWEST,
    STAT_FIELDS,
    rows_for,
)

COL = {name: i for i, name in enumerate(STAT_FIELDS)}


def _row(out: torch.Tensor, operand: str, formats: list[str], orient: str, fmt: str) -> dict:
    i = rows_for(operand, formats).index((orient, fmt))
    return {name: float(out[i, j]) for name, j in COL.items()}


# ---------------------------------------------------------------------------------------------
# formats as data


def test_rows_for_orders_formats_and_orientations() -> None:
    assert rows_for("x", list(DEFAULT_FORMATS)) == [
        ("tensor", "fp8_tensor"),
        ("fwd", "fp8_block"),
        ("wgrad", "fp8_block"),
        ("fwd", "mxfp8"),
        ("wgrad", "mxfp8"),
        ("fwd", "mxfp4"),
        ("wgrad", "mxfp4"),
        ("fwd", "nvfp4"),
        ("wgrad", "nvfp4"),
    ]
    # weights: 2-D tiles serve both GEMMs; e5m2 is for gradients only
    assert ("both", "fp8_block") in rows_for("w", ["fp8_block"])
    assert rows_for("w", ["mxfp8_e5m2"]) == []
    assert rows_for("dy", ["mxfp8_e5m2"]) == [("dgrad", "mxfp8_e5m2"), ("wgrad", "mxfp8_e5m2")]
    assert rows_for("w", ["nvfp4_w16"]) == [("both", "nvfp4_w16")]
    with pytest.raises(KeyError, match="known"):
        rows_for("x", ["fp6"])
    assert [f for f, v in FORMATS.items() if v.default] == list(DEFAULT_FORMATS)
    assert [FORMATS[f].bits for f in NARROWEST] == sorted(FORMATS[f].bits for f in NARROWEST)


def test_element_bounds_are_where_the_cast_saturates_and_flushes() -> None:
    """clip_from / flush_to as declared are the RNE boundaries of the element cast."""
    for elem in ELEMENTS.values():
        lo = torch.tensor([elem.clip_from]).nextafter(torch.tensor([0.0]))
        at = torch.tensor([elem.clip_from])
        q_lo = blockstats._rne(lo, elem)
        assert float(q_lo) == elem.max
        # below the bound a value rounds to at most max; at it, an unbounded cast passes max
        wide = dataclasses.replace(elem, max=2 * elem.max)
        unbounded = blockstats._rne(at, wide)
        assert (float(unbounded) > elem.max) == elem.clip_inclusive
        assert float(blockstats._rne(torch.tensor([elem.flush_to]), elem)) == 0.0
        above = torch.tensor([elem.flush_to]).nextafter(torch.tensor([1.0]))
        assert float(blockstats._rne(above, elem)) == elem.min_subnormal


def test_element_cast_equals_torch_float8_casts() -> None:
    g = torch.Generator().manual_seed(1)
    for name, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        elem = ELEMENTS[name]
        grid = torch.arange(0, 1 << 12, dtype=torch.float32) * elem.min_subnormal / 4
        v = torch.cat(
            [
                grid,  # every subnormal and its midpoints
                torch.rand(20000, generator=g) * elem.max * 1.2,
                torch.exp2(torch.rand(20000, generator=g) * 30 - 20),
            ]
        )
        ref = v.clamp_max(elem.max).to(dtype).float()
        assert torch.equal(blockstats._rne(v, elem), ref), name
    e2m1 = ELEMENTS["e2m1"]
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    v = torch.rand(20000, generator=g) * 8
    nearest = table[(v[:, None] - table).abs().argmin(dim=1)]
    tie = ((v[:, None] - table).abs() == (v[:, None] - nearest[:, None]).abs()).sum(1) > 1
    assert torch.equal(blockstats._rne(v, e2m1)[~tie], nearest[~tie].clamp_max(6))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0])
    assert blockstats._rne(ties, e2m1).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0]


# ---------------------------------------------------------------------------------------------
# small cases by hand (both paths)


def _blocks_built() -> bool:
    k = numkernel.wait()
    return k is not None and k.has_blocks


@pytest.fixture(params=["eager", "kernel"])
def path(request: pytest.FixtureRequest) -> str:
    if request.param == "kernel" and not _blocks_built():
        pytest.skip(f"no compiled block kernel: {numkernel.status()}")
    return str(request.param)


def _measure(path: str, x: torch.Tensor, operand: str, formats: list[str], divisor=None):
    rows = rows_for(operand, formats)
    if path == "eager":
        return blockstats._eager(x, operand, rows, divisor)
    k = numkernel.wait()
    assert k is not None
    out = blockstats._kernel(k, x, operand, rows, divisor)
    assert out is not None
    return out


def test_mxfp4_block_by_hand(path: str) -> None:
    """One 32-value MXFP4 block: amax 6 -> e8m0 exponent floor(log2 6) - 2 = 0, scale 1."""
    vals = [6.0, 0.2, 0.25, 0.3, 5.0, 2.5, -1.25] + [0.0] * 25
    x = torch.tensor([vals])
    r = _row(_measure(path, x, "x", ["mxfp4"]), "x", ["mxfp4"], "fwd", "mxfp4")
    # 0.2 and the tie 0.25 flush; 0.3 -> 0.5, 5 -> 4 (tie to even), 2.5 -> 2, 1.25 -> 1
    assert (r["elements"], r["nonzero"], r["flushed"], r["clipped"]) == (32, 7, 2, 0)
    assert (r["blocks"], r["scale_under"], r["scale_sat"]) == (1, 0, 0)
    f32 = [float(torch.tensor(v)) for v in vals[:7]]
    deq = [6.0, 0.0, 0.0, 0.5, 4.0, 2.0, 1.0]
    assert r["noise"] == pytest.approx(
        sum((abs(a) - d) ** 2 for a, d in zip(f32, deq, strict=True)), rel=1e-12
    )
    assert r["signal"] == pytest.approx(sum(a * a for a in f32), rel=1e-12)

    # amax 7: the same scale (floor(log2 7) = 2), so 7 clips (7 is the tie above 6, rounding
    # up past the max) while 6.9 rounds to 6 without clipping
    x = torch.tensor([[7.0, 6.9, 3.0] + [0.0] * 29])
    r = _row(_measure(path, x, "x", ["mxfp4"]), "x", ["mxfp4"], "fwd", "mxfp4")
    assert (r["clipped"], r["flushed"]) == (1, 0)
    # round-up scale instead: 2**ceil(log2(7 / 6)) = 2, nothing clips
    r = _row(_measure(path, x, "x", ["mxfp8_ceil"]), "x", ["mxfp8_ceil"], "fwd", "mxfp8_ceil")
    assert r["clipped"] == 0


def test_scale_underflow_and_nvfp4_block_scales_by_hand(path: str) -> None:
    tiny = 2.0**-140
    x = torch.zeros(1, 64)
    x[0, 0] = tiny  # block 0: e = -140 - 8 < -127 (MXFP8): under, scale 2**-127, v = 2**-13 flushes
    x[0, 32] = 1.0  # block 1: fine
    fmts = ["mxfp8", "fp8_block", "nvfp4"]
    out = _measure(path, x, "x", fmts)
    mx = _row(out, "x", fmts, "fwd", "mxfp8")
    assert (mx["blocks"], mx["scale_under"], mx["flushed"]) == (2, 1, 1)
    # one 128-block holds both: scale 1 / 448, the tiny value 2**-140 * 448 flushes in e4m3
    fb = _row(out, "x", fmts, "fwd", "fp8_block")
    assert (fb["blocks"], fb["scale_under"], fb["flushed"]) == (1, 0, 1)
    assert fb["noise"] == pytest.approx(tiny**2, rel=1e-12)
    # alone, its fp32 scale 2**-140 / 448 = 1.14 * 2**-149 rounds to the subnormal 2**-149:
    # no underflow, but v = 2**9 clips to 448 (the block's own maximum is lost)
    alone = _measure(path, x[:, :32], "x", ["fp8_block"])
    got = [float(alone[0, COL[c]]) for c in ("scale_under", "flushed", "clipped", "noise")]
    assert got == [0, 0, 1, (tiny - 448 * 2.0**-149) ** 2]
    # NVFP4: s_t = 1 / 2688; the tiny block's e4m3 scale (tiny / 6) * 2688 underflows to 0
    nv = _row(out, "x", fmts, "fwd", "nvfp4")
    assert (nv["blocks"], nv["scale_under"], nv["flushed"], nv["clipped"]) == (4, 1, 1, 0)
    assert nv["noise"] == pytest.approx(tiny**2, rel=1e-12)

    # wgrad of the same X: blocks along dim 0 (one row: 64 one-element blocks)
    wg = _row(out, "x", fmts, "wgrad", "mxfp8")
    assert (wg["blocks"], wg["scale_under"], wg["flushed"]) == (64, 1, 1)


def test_divisor_and_nonfinite(path: str) -> None:
    x = torch.tensor([[1024.0, float("inf"), float("nan"), 2048.0] + [0.0] * 28])
    fmts = ["mxfp8"]
    r = _row(_measure(path, x, "dy", fmts, divisor=1024.0), "dy", fmts, "dgrad", "mxfp8")
    assert (r["elements"], r["nonfinite"], r["nonzero"], r["flushed"]) == (32, 2, 2, 0)
    assert r["signal"] == 5.0 and r["noise"] == 0.0


# ---------------------------------------------------------------------------------------------
# the kernel equals the eager reduction


def _cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for shape in ((70, 150), (3, 17)):  # partial strips and blocks along both dims
        base = torch.randn(*shape, generator=g)
        heavy = torch.randn(*shape, generator=g) * torch.exp(3 * torch.randn(*shape, generator=g))
        zero = base.clone()
        zero[:, : min(40, shape[1])] = 0
        zero[: min(33, shape[0])] = 0
        bad = heavy.clone()
        bad.view(-1)[::7] = float("inf")
        bad.view(-1)[3::11] = float("nan")
        out += [
            ("randn", base),
            ("heavy", heavy),
            ("tiny", torch.randn(*shape, generator=g) * 1e-40),
            ("zero-blocks", zero),
            ("nonfinite", bad),
        ]
    return out


@pytest.fixture(params=["avx512", "avx2", "generic"])
def kernel(request: pytest.FixtureRequest):
    """The kernel with each of its per-element loops (AVX-512 and AVX2 where the CPU has them;
    a level the CPU lacks runs the best it has)."""
    k = numkernel.wait()
    if k is None or not k.has_blocks:
        pytest.skip(f"no compiled block kernel: {numkernel.status()}")
    k.block_simd({"avx512": 2, "avx2": 1, "generic": 0}[request.param])
    yield k
    k.block_simd(-1)


def test_kernel_equals_eager_everywhere(kernel: numkernel.Kernel) -> None:
    k = kernel
    every = list(FORMATS)
    checked = 0
    for name, t in _cases():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = t.to(dtype)
            for op, view, div in (
                ("dy", x, None),
                ("w", x.t(), None),  # transposed memory, 2-D tiles
                ("x", x, torch.tensor(3.0)),  # an fp32 division
                ("dy", x.t(), 1024.0),  # a power-of-two divisor
                ("x", x[:, 1:], None),  # rows with a stride, unaligned
                ("w", x[::2, ::2], None),  # neither dim contiguous: copied
            ):
                rows = rows_for(op, every)
                want = blockstats._eager(view, op, rows, div)
                got = blockstats._kernel(k, view, op, rows, div)
                assert got is not None
                where = f"{name} {dtype} {op} {tuple(view.shape)} {view.stride()} /{div}"
                assert torch.equal(got[:, :8], want[:, :8]), where
                torch.testing.assert_close(got[:, 8:], want[:, 8:], rtol=1e-9, atol=0, msg=where)
                checked += 1
    assert checked == 10 * 3 * 6


def test_measure_uses_the_kernel_on_cpu_and_stays_on_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(64, 96)
    want = blockstats._eager(x, "x", rows_for("x", list(DEFAULT_FORMATS)), None)
    if _blocks_built():
        monkeypatch.setattr(blockstats, "_eager", None)  # the kernel must answer
    out = blockstats.measure(x, "x", list(DEFAULT_FORMATS))
    monkeypatch.undo()
    assert out.shape == (9, len(STAT_FIELDS)) and out.dtype == torch.float64
    assert torch.equal(out[:, :8], want[:, :8])
    # the eager path reads no value back: it runs on the meta device, where a read raises
    meta = blockstats.measure(torch.empty(64, 96, device="meta"), "dy", list(FORMATS), 8.0)
    assert meta.device.type == "meta" and meta.shape == (15, len(STAT_FIELDS))
    empty = blockstats.measure(torch.empty(0, 8), "x", ["mxfp8"])
    assert empty[:, COL["elements"]].tolist() == [0.0, 0.0]


def test_eager_chunks_give_the_same_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager path takes rows in chunks (bounded temporaries): the same counts, sums."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 70, generator=g) * torch.exp(2 * torch.randn(300, 70, generator=g))
    x[5, 3] = float("inf")
    for op, view in (("dy", x), ("w", x)):
        rows = rows_for(op, list(FORMATS))
        whole = blockstats._eager(view, op, rows, 2.0)
        monkeypatch.setattr(blockstats, "EAGER_CHUNK", 1000)  # 128 rows a chunk: 3 chunks
        chunked = blockstats._eager(view, op, rows, 2.0)
        monkeypatch.undo()
        assert torch.equal(chunked[:, :8], whole[:, :8])
        torch.testing.assert_close(chunked[:, 8:], whole[:, 8:], rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------------------------
# canonical views


def test_canonical_views() -> None:
    x = torch.randn(2, 5, 8)
    v, why = blockstats.canonical("x", x, "Linear")
    assert v.shape == (10, 8) and why is None and v.data_ptr() == x.data_ptr()
    w = torch.randn(8, 4)  # Hugging Face Conv1D keeps [K, N]
    v, why = blockstats.canonical("w", w, "Conv1D")
    assert v.shape == (4, 8) and why is None
    xc = torch.randn(2, 3, 4, 5)
    v, why = blockstats.canonical("x", xc, "Conv2d")
    assert v.shape == (40, 3) and why == blockstats.CONV_APPROX
    assert torch.equal(v[7], xc[0, :, 1, 2])
    v, why = blockstats.canonical("w", torch.randn(6, 3, 2, 2), "Conv2d")
    assert v.shape == (6, 12) and why is None
    v, why = blockstats.canonical("dy", torch.randn(2, 6, 4, 5), "Conv2d")
    assert v.shape == (40, 6) and why is None
    assert math.isfinite(float(blockstats.measure(v, "dy", ["nvfp4"])[0, COL["noise"]]))


def test_float64_on_cpu_is_read_by_the_kernel_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float64 operand on CPU is converted to fp32 for the kernel (the eager path, which
    reads it in fp32 too, would cost a sampled step far more): the same rows."""
    if not _blocks_built():
        pytest.skip(f"no compiled block kernel: {numkernel.status()}")
    g = torch.Generator().manual_seed(5)
    x = (
        torch.randn(96, 80, generator=g) * torch.exp(3 * torch.randn(96, 80, generator=g))
    ).double()
    rows = rows_for("dy", list(DEFAULT_FORMATS))
    want = blockstats._eager(x, "dy", rows, 4.0)
    monkeypatch.setattr(blockstats, "_eager", None)  # the kernel must answer
    got = blockstats.measure(x, "dy", list(DEFAULT_FORMATS), 4.0)
    assert torch.equal(got[:, :8], want[:, :8])
    torch.testing.assert_close(got[:, 8:], want[:, 8:], rtol=1e-9, atol=0)


def test_the_configuration_names_the_formats_the_store_defines() -> None:
    """``amprobe.config`` validates ``block_formats`` with its own copy of the names (it sits
    below the store, which imports no configuration): the two must agree."""
    from amprobe import config
    from amprobe.store import blockformats

    assert tuple(blockformats.FORMATS) == config.BLOCK_FORMAT_NAMES
    assert blockformats.DEFAULT_FORMATS == config.DEFAULT_BLOCK_FORMATS
    assert config.Config().block_formats == blockformats.DEFAULT_FORMATS
