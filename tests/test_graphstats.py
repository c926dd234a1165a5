"""Numerics of compiled layers: the in-graph hooks (graphstats) hand a sampled step's layer
outputs and inputs to an opaque op whose run-time sink is the eager measurement, with the
layer's identity a tensor (identical blocks compiled one by one share one graph, at any depth,
``fullgraph=True``), and never change what the compiled model computes; and the
output-gradient taps (gradtap) run from a compiled backward."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from amprobe.capture.collectors import gradtap, graphstats


class _Collect:
    """A sink that keeps what the compiled layers hand over (copies), per slot."""

    def __init__(self) -> None:
        self.forward: list[tuple[int, torch.Tensor, list[torch.Tensor], int]] = []
        self.grads: dict[int, list[torch.Tensor]] = {}
        self.ident = graphstats.register_sink(graphstats.LayerSink(self._fwd, self._grad))

    def _fwd(self, slot: int, x: torch.Tensor, inputs: list[torch.Tensor], unread: int) -> None:
        self.forward.append((slot, x.clone(), [i.clone() for i in inputs], unread))

    def _grad(self, slot: int, grad: torch.Tensor) -> None:
        self.grads.setdefault(slot, []).append(grad.clone())

    def key(self, slot: int) -> torch.Tensor:
        return graphstats.layer_key(self.ident, slot)

    def close(self) -> None:
        graphstats.unregister_sink(self.ident)


@pytest.fixture
def sink():
    collect = _Collect()
    yield collect
    collect.close()
    graphstats.GRAPH_SAMPLE.on = False


def _counting(name: str, seen: Counter) -> object:
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(name)

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen["graphs"] += 1
        return inner(gm, example_inputs)

    return backend


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_layer_hands_over_the_output_the_model_returns(sink, backend):
    """Traced with fullgraph=True (a graph break would raise): the op receives the layer's
    output as the compiled graph computed it (the tensor the model returns) and its input."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    layer.register_forward_hook(graphstats.graph_stats_hook(sink.key(3)))
    run = torch.compile(layer, backend=backend, fullgraph=True)
    x = torch.randn(5, 8)
    graphstats.GRAPH_SAMPLE.on = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(x)
    graphstats.GRAPH_SAMPLE.on = False
    assert len(sink.forward) == 1
    slot, seen, inputs, unread = sink.forward[0]
    assert slot == 3 and unread == 0
    assert seen.dtype == torch.bfloat16 and torch.equal(seen, out)
    assert len(inputs) == 1 and torch.equal(inputs[0], x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run(x)  # unsampled: nothing handed over
    assert len(sink.forward) == 1


def test_an_input_the_op_cannot_take_is_counted_unread(sink):
    """A wrapper tensor subclass input (torch's TwoTensor, as float8/NF4 tensors are) is not
    handed over: the sink hears it was not read, so it is never counted as finite."""
    from torch.testing._internal.two_tensor import TwoTensor

    layer = torch.nn.Identity()
    layer.register_forward_hook(graphstats.graph_stats_hook(sink.key(0)))
    graphstats.GRAPH_SAMPLE.on = True
    layer(TwoTensor(torch.ones(3), torch.ones(3)))  # its output is one too: not handed over
    assert sink.forward == []

    class Mix(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a * 2

    mix = Mix()
    mix.register_forward_hook(graphstats.graph_stats_hook(sink.key(1)))
    mix(torch.ones(3), TwoTensor(torch.ones(3), torch.ones(3)))
    ((slot, _, inputs, unread),) = sink.forward
    assert slot == 1 and len(inputs) == 1 and unread == 1


def test_materialized_outputs_are_matmul_and_convolution_layers():
    assert graphstats.materialized_output(torch.nn.Linear(2, 2))
    assert graphstats.materialized_output(torch.nn.Conv2d(1, 1, 1))
    assert graphstats.materialized_output(torch.nn.ConvTranspose1d(1, 1, 1))

    class Conv1D(torch.nn.Module):  # Hugging Face GPT-2's addmm layer, named as transformers does
        pass

    assert graphstats.materialized_output(Conv1D())
    for fused in (torch.nn.LayerNorm(2), torch.nn.GELU(), torch.nn.Embedding(2, 2)):
        assert not graphstats.materialized_output(fused)


class _Block(torch.nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _blocks_job(
    depth: int, backend: str, hooked: bool, dtype: torch.dtype, sink: _Collect, steps: int = 4
) -> tuple[int, list[float]]:
    """Each of ``depth`` identical blocks compiled on its own (``fullgraph=True``), trained a
    few steps, every other one sampled; hooks on the matmul layers (``hooked``). Returns the
    graphs compiled and the losses."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block() for _ in range(depth)])
    if hooked:
        for i, mod in enumerate(m for m in model.modules() if isinstance(m, torch.nn.Linear)):
            mod.register_forward_hook(graphstats.graph_stats_hook(sink.key(2 * i)))
            mod.register_forward_hook(gradtap.grad_tap_hook(sink.key(2 * i + 1)))
    seen: Counter = Counter()
    counting = _counting(backend, seen)  # one backend for all blocks, as a user passes one
    for block in model:
        block.compile(backend=counting, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(steps):
        graphstats.GRAPH_SAMPLE.on = hooked and step % 2 == 0
        with torch.autocast("cpu", dtype=dtype):
            loss = model(x).float().square().mean()
        graphstats.GRAPH_SAMPLE.on = False
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return seen["graphs"], losses


@pytest.mark.parametrize("depth", [2, 10, 32])
def test_identical_blocks_compile_one_graph_and_one_sampled_variant_at_any_depth(sink, depth):
    """The layer keys are tensors: identical blocks compiled one by one share the plain graphs
    and one sampled variant of each, at any depth, with fullgraph=True (a per-block int made
    each block compile its own graph and a 10-block model fail at step 0)."""
    plain_graphs, plain = _blocks_job(depth, "aot_eager", False, torch.bfloat16, sink)
    graphs, losses = _blocks_job(depth, "aot_eager", True, torch.bfloat16, sink)
    assert plain_graphs <= graphs <= 2 * plain_graphs, (plain_graphs, graphs)
    assert losses == plain
    linears = 2 * depth
    assert len(sink.forward) == 2 * linears  # two sampled steps
    assert sorted({slot for slot, *_ in sink.forward}) == list(range(0, 2 * linears, 2))
    assert sum(len(g) for g in sink.grads.values()) == 2 * linears


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_inductor_computes_the_plain_numbers_on_sampled_steps(sink, dtype):
    """Hooks only where inductor stores the output anyway (the matmul layers), the values read
    by an opaque op: every loss is the unhooked job's, bit for bit, sampled steps included."""
    plain_graphs, plain = _blocks_job(2, "inductor", False, dtype, sink)
    graphs, losses = _blocks_job(2, "inductor", True, dtype, sink)
    assert losses == plain
    assert graphs <= 2 * plain_graphs
    assert len(sink.forward) == 2 * 4


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


def _taps(model: torch.nn.Module) -> tuple[dict[str, list[torch.Tensor]], _Collect]:
    collect = _Collect()
    names = ("inner.a", "inner.b")
    for slot, name in enumerate(names):
        model.get_submodule(name).register_forward_hook(gradtap.grad_tap_hook(collect.key(slot)))
    got = {name: collect.grads.setdefault(slot, []) for slot, name in enumerate(names)}
    return got, collect


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
        eager_taps.close()
        compiled_taps.close()
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
    backend is the one of the model without hooks; with it on, the gradient hook is in it."""
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(str([n.target for n in gm.graph.nodes if n.op == "call_function"]))
        return gm.forward

    torch.manual_seed(0)
    bare = _TwoLayers()
    hooked = copy.deepcopy(bare)
    collect = _Collect()
    hooked.a.register_forward_hook(gradtap.grad_tap_hook(collect.key(0)))
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
        collect.close()
    assert len(graphs) == 3 and graphs[0] == graphs[1] != graphs[2]
    assert "RegisterHookOp" in graphs[2] and "RegisterHookOp" not in graphs[0]


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
