"""Numerics of compiled layers: the in-graph activation statistics (graphstats), the same counts
and exponent histogram as the eager statistics of the same tensors, hooked eagerly and traced
into a compiled graph; and the output-gradient taps (gradtap) run from a compiled backward."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch._dynamo.utils import counters

from amprobe.capture.collectors import gradtap, graphstats, numstats
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
    """The count columns as read (not the histogram, not ``amax``)."""
    return {k: int(v) for k, v in graphstats.read_row(row.tolist()).items() if k != "amax"}


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
    for part in (x[~torch.isnan(x)], x[torch.isfinite(x)]):
        eager = numstats.stats_v2(part)[numstats.C_AMAX].to(torch.int32).view(torch.float32)
        read = graphstats.read_row(_hooked_row(part, None).tolist())["amax"]
        assert read == float(eager) == float(part.abs().max())
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


# -- output gradients of compiled layers (gradtap) ----------------------------------------------


class _TwoLayers(torch.nn.Module):
    """Linear -> in-place ReLU -> Linear; ``split`` adds a graph break, ``ckpt`` runs the first
    two under (non-reentrant) activation checkpointing."""

    def __init__(self, split: bool = False, ckpt: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.act = torch.nn.ReLU(inplace=True)  # in place on the tapped output
        self.b = torch.nn.Linear(8, 2)
        self.split = split
        self.ckpt = ckpt

    def first(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.a(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt:
            h = torch.utils.checkpoint.checkpoint(self.first, x, use_reentrant=False)
        else:
            h = self.first(x)
        if self.split:
            torch._dynamo.graph_break()
        return self.b(h)


class _Pair(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner(x), x.sum(-1)


def _taps(model: torch.nn.Module) -> tuple[dict[str, list[torch.Tensor]], list[int]]:
    got: dict[str, list[torch.Tensor]] = {}
    taps = []
    for name in ("inner.a", "inner.b"):
        tap = gradtap.register_tap(lambda g, name=name: got.setdefault(name, []).append(g.clone()))
        taps.append(tap)
        model.get_submodule(name).register_forward_hook(gradtap.grad_tap_hook(tap))
    return got, taps


def _train(model: torch.nn.Module, run: object, twice: bool, sampled: list[bool]) -> list:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    grads = []
    for on in sampled:
        graphstats.GRAPH_SAMPLE.on = on
        try:
            out, side = run(x)  # type: ignore[operator]
            loss = out.square().sum() + side.sum()
            if twice:
                loss = loss + run(x * 2)[0].sum()  # type: ignore[operator]
            loss.backward()
        finally:
            graphstats.GRAPH_SAMPLE.on = False
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    return grads


@pytest.mark.parametrize(
    "backend, split, twice, ckpt",
    [
        ("aot_eager", False, False, False),
        ("aot_eager", True, False, False),  # two graphs per forward
        ("aot_eager", False, True, False),  # the compiled model run twice before the backward
        ("aot_eager", False, False, True),
        ("inductor", False, True, False),
    ],
)
def test_output_gradients_reach_the_tap_from_the_compiled_backward(backend, split, twice, ckpt):
    """Each sampled step hands every tapped layer's output gradient to its callback, once per
    call, equal to what eager autograd computes; unsampled steps hand nothing; the model's
    own gradients are unchanged; no graph break beyond the model's own."""
    torch._dynamo.reset()
    torch.manual_seed(1)
    eager = _Pair(_TwoLayers(split, ckpt))
    compiled = copy.deepcopy(eager)
    want, eager_taps = _taps(eager)
    got, compiled_taps = _taps(compiled)
    run = torch.compile(compiled, backend=backend, fullgraph=not split)
    counters.clear()
    try:
        plain = _train(eager, eager, twice, [False, True])
        traced = _train(compiled, run, twice, [True, False, True])
    finally:
        for tap in eager_taps + compiled_taps:
            gradtap.unregister_tap(tap)
    calls = 2 if twice else 1
    assert [len(want[n]) for n in want] == [calls, calls]  # eager: the sampled step only
    assert [len(got[n]) for n in got] == [2 * calls, 2 * calls]  # two sampled steps of three
    for name in ("inner.a", "inner.b"):
        for seen in (got[name][:calls], got[name][calls:]):
            for g, w in zip(seen, want[name], strict=True):
                exact = backend == "aot_eager"  # the eager kernels: bit for bit
                torch.testing.assert_close(
                    g, w, rtol=0 if exact else None, atol=0 if exact else None
                )
    assert (got["inner.a"][0] == 0).any(), "the in-place ReLU's zeros reached the tap"
    for step in traced:
        for g, w in zip(step, plain[1], strict=True):
            torch.testing.assert_close(g, w)
    breaks = list(counters["graph_break"])  # the model's own graph break only
    assert all("User-inserted graph break" in reason for reason in breaks)
    assert bool(breaks) == split


def test_unsampled_variant_is_the_models_graph():
    """With the flag off the hooks return before tracing anything: the graph handed to the
    backend is the one of the model without hooks; with it on, the tap is in the graph."""
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(str([n.target for n in gm.graph.nodes if n.op == "call_function"]))
        return gm.forward

    torch.manual_seed(0)
    bare = _TwoLayers()
    hooked = copy.deepcopy(bare)
    tap = gradtap.register_tap(lambda g: None)
    hooked.a.register_forward_hook(gradtap.grad_tap_hook(tap))
    x = torch.randn(4, 8)
    try:
        torch._dynamo.reset()  # (dynamo does not guard on module hooks: one cache per model)
        torch.compile(bare, backend=backend)(x)
        torch._dynamo.reset()
        run = torch.compile(hooked, backend=backend)
        run(x)
        graphstats.GRAPH_SAMPLE.on = True
        run(x)  # the flag's guard fails: the sampled variant
    finally:
        graphstats.GRAPH_SAMPLE.on = False
        gradtap.unregister_tap(tap)
    assert len(graphs) == 3 and graphs[0] == graphs[1] != graphs[2]
    assert "AutogradFunctionApply" in graphs[2]


def test_register_hook_inside_the_graph_fails_a_second_compiled_call():
    """Why the taps use an opaque op: a gradient hook traced into the graph (dynamo's
    register_hook on an intermediate, torch 2.13) makes its buffer a tensor saved for backward
    and writes it back in place, so a second compiled call before the backward fails the
    user's backward. If torch stops doing this, README's torch.compile section is stale."""
    torch._dynamo.reset()
    buf = torch.zeros(2, dtype=torch.float64)

    def on_grad(g: torch.Tensor) -> None:
        with torch.no_grad():
            buf[0].add_(g.numel())

    def hook(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(on_grad)

    model = torch.nn.Linear(4, 4)
    model.register_forward_hook(hook)
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 4)
    run(x).sum().backward()  # one call: traced with no graph break, and it counts
    assert buf[0] == 8
    loss = run(x).sum() + run(x).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
