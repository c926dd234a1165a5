"""In-graph activation statistics (graphstats): the same counts and exponent histogram as the
eager statistics of the same tensors, hooked eagerly and traced into a compiled graph."""

from __future__ import annotations

import json

import pytest
import torch

from amprobe.capture.collectors import graphstats, numstats
from amprobe.capture.collectors.numerics import summarize_hist


def _values(dtype: torch.dtype) -> torch.Tensor:
    """Zeros, values at and around fp16's flush, subnormal and normal boundaries, overflow,
    fp32 subnormals (resolved binades and the lump below 2**-133), NaN and inf, and a spread of
    ordinary values."""
    plain = [0.0, -0.0, 2.0**-26, 2.0**-25, 1.5 * 2.0**-25, 2.0**-24, 3.0 * 2.0**-24]
    plain += [2.0**-15, 2.0**-14, 1e-3, -0.5, 1.0, 70000.0, -65520.0, 65504.0]
    plain += [2.0**-126, 2.0**-127, -(2.0**-130), 2.0**-133, 2.0**-134, 2.0**-149, 3e38]
    x = torch.tensor(plain * 3, dtype=torch.float32)
    spread = torch.randn(500, generator=torch.Generator().manual_seed(0)) * 10.0 ** torch.arange(
        -8, 8, 16 / 500
    )
    x = torch.cat([x, spread, torch.tensor([float("nan"), float("inf"), -float("inf")])])
    return x.to(dtype)


def _hooked_row(x: torch.Tensor, backend: str | None) -> torch.Tensor:
    buf = graphstats.new_buffer(1, x.device)
    module = torch.nn.Identity()
    module.register_forward_hook(graphstats.graph_stats_hook(buf, 0))
    run = module if backend is None else torch.compile(module, backend=backend, fullgraph=True)
    graphstats.GRAPH_SAMPLE.on = True
    try:
        run(x)
    finally:
        graphstats.GRAPH_SAMPLE.on = False
    return buf[0]


def _counts(row: torch.Tensor) -> dict[str, int]:
    """The count columns (not the histogram, not ``amax``)."""
    values = zip(graphstats.COLUMNS, row.tolist(), strict=False)
    return {k: int(v) for k, v in values if k != "amax"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_small_end_counts_match_the_eager_statistics(dtype):
    x = _values(dtype)
    got = _counts(_hooked_row(x, None))
    row = numstats.stats_v2(x)
    want = summarize_hist(row.tolist())
    assert got["zeros"] == int(row[numstats.C_ZEROS]) > 0
    for key in ("underflow_at_scale", "below_subnormal", "below_normal", "over_fp16"):
        assert got[key] == want[key], (key, got[key], want[key])
    if dtype is not torch.float16:  # fp16 cannot hold these values: nothing to count there
        assert got["underflow_at_scale"] > 0 and got["below_subnormal"] > 0
    assert got["below_normal"] > 0 and got["nan"] == 1 and got["inf"] >= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_exponent_histogram_and_amax_match_the_eager_statistics(dtype):
    x = _values(dtype)
    got = _hooked_row(x, None)
    hist = got[graphstats.HIST0 :].to(torch.int64)
    want = numstats.stats_v2(x)
    assert hist.tolist() == want[numstats.H0 : numstats.H0 + numstats.NBINS].tolist()
    assert int(hist.sum()) == x.numel()
    assert int((hist > 0).sum()) > 20, "a spread of binades"
    if dtype is torch.float32:  # fp32 subnormals: resolved binades and the lump both occupied
        assert hist[numstats.H_LUMP - numstats.H0] > 0 and hist[-133 - numstats.E_MIN] > 0
    # the largest magnitude as the eager row records it (with NaN present it is not read):
    # inf when inf is present, else the largest finite magnitude
    amax = graphstats.COLUMNS.index("amax")
    for part in (x[~torch.isnan(x)], x[torch.isfinite(x)]):
        eager = numstats.stats_v2(part)[numstats.C_AMAX].to(torch.int32).view(torch.float32)
        assert float(_hooked_row(part, None)[amax]) == float(eager) == float(part.abs().max())
    code = int(got[graphstats.COLUMNS.index("dtype")])
    assert graphstats.DTYPES[code - 1] == dtype


def test_exponent_bins_place_every_bit_pattern_as_the_eager_statistics():
    """Every 16-bit upper half of an fp32 pattern with several lower halves: zeros, each
    subnormal binade and the lump, every normal exponent, inf and NaN."""
    upper = torch.arange(1 << 16, dtype=torch.int64) << 16
    bits = torch.cat([upper | low for low in (0, 1, 0x7FFF, 0x8000, 0xFFFF)])
    bits = torch.cat([bits, torch.arange(1 << 16, dtype=torch.int64)])  # the lowest patterns
    values = bits.to(torch.int32).view(torch.float32)  # signs included: the magnitude counts
    want = numstats.exponent_column(bits & 0x7FFFFFFF) - numstats.H0
    assert torch.equal(graphstats.exponent_bins(values), want)
    # bf16 (read through its own 16-bit pattern): every pattern, as its exact fp32 value
    bf16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16).view(torch.bfloat16)
    want = numstats.exponent_column(bf16.float().abs().view(torch.int32).to(torch.int64))
    assert torch.equal(graphstats.exponent_bins(bf16), want - numstats.H0)


@pytest.mark.parametrize(
    "backend, dtype",
    [
        ("aot_eager", torch.float32),
        ("aot_eager", torch.bfloat16),
        ("aot_eager", torch.float16),
        ("inductor", torch.bfloat16),
    ],
)
def test_compiled_hook_records_what_the_eager_hook_records(backend, dtype):
    """Traced with fullgraph=True (a graph break would raise): the whole row, histogram
    included, equals the eager hook's."""
    torch._dynamo.reset()
    x = _values(dtype)
    compiled = _hooked_row(x, backend)
    assert compiled.tolist() == _hooked_row(x, None).tolist()
    assert int(compiled[graphstats.HIST0 :].sum()) == x.numel()


def test_two_calls_add_up_and_keep_the_first_calls_order_and_dtype():
    buf = graphstats.new_buffer(2, None)
    first, second = torch.nn.Identity(), torch.nn.Identity()
    first.register_forward_hook(graphstats.graph_stats_hook(buf, 0))
    second.register_forward_hook(graphstats.graph_stats_hook(buf, 1))
    a, b = _values(torch.bfloat16), _values(torch.float32)
    graphstats.GRAPH_SAMPLE.on = True
    try:
        second(a)
        first(b)
        second(b)
    finally:
        graphstats.GRAPH_SAMPLE.on = False
    row = _counts(buf[1])
    assert row["calls"] == 2 and row["order"] == 0 and _counts(buf[0])["order"] == 1
    assert graphstats.DTYPES[row["dtype"] - 1] == torch.bfloat16
    both = numstats.stats_v2(a)[numstats.H0 : numstats.H0 + numstats.NBINS]
    both = both + numstats.stats_v2(b)[numstats.H0 : numstats.H0 + numstats.NBINS]
    assert buf[1, graphstats.HIST0 :].to(torch.int64).tolist() == both.tolist()


def test_unsampled_step_adds_nothing():
    buf = graphstats.new_buffer(1, None)
    module = torch.nn.Identity()
    module.register_forward_hook(graphstats.graph_stats_hook(buf, 0))
    module(_values(torch.float32))
    assert not buf.any()


def test_exp_hist_row_text_reads_as_the_eager_rows():
    """The collector writes the histogram as the eager rows do: exponent -> count, JSON."""
    x = _values(torch.bfloat16)
    hist = _hooked_row(x, None)[graphstats.HIST0 :].tolist()
    text = json.dumps(
        {str(e + numstats.E_MIN): int(n) for e, n in enumerate(hist) if n}, separators=(",", ":")
    )
    assert json.loads(text)["128"] == 3 and sum(json.loads(text).values()) == x.numel()
