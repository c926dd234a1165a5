"""Per-layer activation statistics of layers inside a compiled graph, on sampled steps only.

A forward hook met inside a ``torch.compile`` region is traced into the graph. The hooks made
here are written for that:

* On a step that is not sampled they return at once (a guarded Python flag,
  :data:`GRAPH_SAMPLE`): the compiled graph is exactly the model's. The two settings of the flag
  are two graph variants, each compiled once per compiled code object.
* On a sampled step they hand the layer's output and floating inputs to ``amprobe::layer_stats``,
  a custom op the compiler does not look into. At run time it passes them to the eager
  measurement of the collector registered under the layer's key (the same statistics, rows and
  offenders as eager layers; no host-device sync on accelerators).
* A layer's identity in the graph is a small CPU tensor (``[sink, slot]``, :func:`layer_key`)
  that the op reads at run time, never a Python int: dynamo guards an int closure value (or
  attribute) by value, so identical blocks compiled one by one would each need a graph of their
  own (and a 10-block ``fullgraph=True`` model failed at step 0 with ``FailOnRecompileLimitHit``).
  A tensor is guarded by its dtype, device and shape only, which all keys share. It is held by
  the hook's closure: not a registered buffer (no change to ``named_buffers``/``state_dict``,
  nothing DDP broadcasts or FSDP moves).
* Nothing is computed in the graph. An in-graph reader of a value makes the compiler store it:
  under inductor a fused half-precision intermediate that the model's kernels keep in fp32 is
  then rounded, and the model computes different numbers on sampled steps (an fp16 loss turned
  NaN; issue 31). So under a fusing backend a hook reads, inside a compiled region, only a
  layer whose output the compiled graph stores anyway (:func:`materialized_output`: matmul and
  convolution layers, computed by extern kernels); another layer's hook is ``eager_only``: it
  returns at once where dynamo traces it ("not checked under inductor") and measures where the
  layer runs eagerly. The op's inputs are then buffers the graph already holds, and it is
  opaque, so no kernel of the model changes. With ``aot_eager`` or ``eager`` (no fusion)
  every layer is read.

Output gradients: :mod:`~amprobe.capture.collectors.gradtap`, the same keys and sinks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.node

from amprobe.capture.collectors.compiled import is_compiling
from amprobe.capture.collectors.sharded import PLAIN_TENSORS, local_tensor

__all__ = [
    "GRAPH_SAMPLE",
    "NON_FUSING_BACKENDS",
    "LayerSink",
    "first_float",
    "graph_stats_hook",
    "layer_key",
    "materialized_output",
    "plain_local",
    "register_sink",
    "sink_of",
    "unregister_sink",
]


class _Flag:
    """Read by the hooks at trace time: dynamo guards on it, so each value has its own graph."""

    on = False


GRAPH_SAMPLE = _Flag()

#: backends that run the traced ops one by one, as eager does: reading a layer's output there
#: changes no value the model computes, so every layer is hooked
NON_FUSING_BACKENDS = frozenset({"eager", "aot_eager"})

#: module class names (besides ``nn.Linear`` and convolutions) whose output is a matmul's:
#: Hugging Face's ``Conv1D`` (GPT-2: ``addmm`` of its bias, input and weight)
_MATMUL_CLASS_NAMES = frozenset({"Conv1D"})


class LayerSink:
    """Where a collector's compiled layers hand their values at run time.

    Attributes:
        forward: ``(slot, output, floating inputs, unread)`` of a layer on a sampled step;
            ``unread`` counts its floating inputs of a tensor subclass the op cannot take
            (their values are not checked, never counted as finite).
        grad: ``(slot, output gradient)`` from the compiled backward (gradtap).
    """

    __slots__ = ("forward", "grad")

    def __init__(
        self,
        forward: Callable[[int, torch.Tensor, list[torch.Tensor], int], None],
        grad: Callable[[int, torch.Tensor], None],
    ) -> None:
        self.forward = forward
        self.grad = grad


#: sink id -> sink (ids are never reused in a process: a graph compiled for a closed collector
#: may still run and must find nothing)
_SINKS: dict[int, LayerSink] = {}
_IDS = itertools.count(1)


def register_sink(sink: LayerSink) -> int:
    """A new sink id whose layers' values go to ``sink`` (its callbacks must not raise)."""
    ident = next(_IDS)
    _SINKS[ident] = sink
    return ident


def unregister_sink(ident: int) -> None:
    """Values keyed with ``ident`` are no longer measured (a compiled graph may still run)."""
    _SINKS.pop(ident, None)


def sink_of(key: torch.Tensor) -> tuple[LayerSink | None, int]:
    """The sink and the slot a layer key names (a CPU tensor: reading it is no device sync)."""
    sink, slot = key.tolist()
    return _SINKS.get(int(sink)), int(slot)


def layer_key(sink: int, slot: int) -> torch.Tensor:
    """A layer's identity in the graph: ``[sink, slot]`` as a CPU int64 tensor (see the module
    docstring: a tensor, so that identical blocks share one compiled graph)."""
    return torch.tensor([sink, slot], dtype=torch.int64)


def materialized_output(module: torch.nn.Module) -> bool:
    """Whether a fusing compiler stores ``module``'s output anyway: a matmul or convolution
    layer (``nn.Linear`` and its subclasses, ``nn.Conv*``/``nn.ConvTranspose*``, Hugging
    Face's ``Conv1D``), computed by an extern kernel into a buffer of its own."""
    return isinstance(module, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)) or (
        type(module).__name__ in _MATMUL_CLASS_NAMES
    )


def first_float(out: Any) -> torch.Tensor | None:
    """A module output's first floating tensor (the output itself, or in a tuple/list, or a
    dict's values: a Hugging Face ``ModelOutput``, whose first is the loss when there is one)."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, (tuple, list, dict)):
        for item in out.values() if isinstance(out, dict) else out:
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                return item
    return None


def plain_local(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as a plain tensor the op can take: itself, a DTensor's local shard (a tensor
    parallel layer's output), or None for another tensor subclass."""
    local = local_tensor(x)
    return local if local is not x or type(x) in PLAIN_TENSORS else None


@torch.library.custom_op(
    "amprobe::layer_stats", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)
def _layer_stats(
    x: torch.Tensor, inputs: list[torch.Tensor], unread: int, key: torch.Tensor
) -> None:
    sink, slot = sink_of(key)
    if sink is not None:
        sink.forward(slot, x, inputs, unread)


@_layer_stats.register_fake
def _layer_stats_fake(
    x: torch.Tensor, inputs: list[torch.Tensor], unread: int, key: torch.Tensor
) -> None:
    return None


# it returns nothing and mutates nothing: without this, dead-code elimination (FX's, AOT
# autograd's and inductor's scheduler, which all ask torch._library.utils.is_impure) drops it
torch.fx.node.has_side_effect(torch.ops.amprobe.layer_stats.default)


def graph_stats_hook(key: torch.Tensor, eager_only: bool = False) -> Any:
    """A forward hook that, on sampled steps, hands its module's output and floating inputs
    (detached; a DTensor as its local shard) to ``amprobe::layer_stats`` under ``key``, with
    the number of floating inputs it could not hand over (another tensor subclass).

    ``eager_only``: return at once where dynamo traces it (a layer whose output a fusing
    compiler does not store: reading it would change the model's numbers), and measure it where
    it runs eagerly. Identical blocks' hooks carry the same value, so they share their graphs.
    """

    def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
        if not GRAPH_SAMPLE.on or (eager_only and is_compiling()):
            return
        x = first_float(out)
        if x is None:
            return
        x = plain_local(x)
        if x is None or x.numel() == 0:
            return
        inputs = []
        unread = 0  # (a constant of the trace, the same for identical blocks)
        for arg in args if isinstance(args, tuple) else (args,):
            if isinstance(arg, torch.Tensor) and arg.is_floating_point():
                local = plain_local(arg)
                if local is None:
                    unread += 1
                elif local.device == x.device:
                    inputs.append(local.detach())
        torch.ops.amprobe.layer_stats(x.detach(), inputs, unread, key)

    return hook
