"""Output gradients of layers inside a compiled region, on sampled steps only.

Eager numerics measures a layer's output gradient with ``out.register_hook``. Inside a
``torch.compile`` region that hook is traced: dynamo turns it into a subgraph that AOTAutograd
inlines into the backward graph, so the statistics buffer it adds to becomes a tensor saved
for backward and written back in place once the backward has run. A second compiled call
before the backward (the same compiled model run twice, or a model that a graph break splits
in two) then fails the user's backward with "one of the variables needed for gradient
computation has been modified by an inplace operation" (torch 2.13, aot_eager and inductor;
see README, torch.compile). The hooks here keep the buffer out of the graph instead:

* a forward hook traced into the graph returns, on a sampled step, the layer's output passed
  through :class:`_Tap` (an autograd function: forward a copy, which inductor may fuse away;
  backward the custom op ``amprobe::grad_tap``); on other steps it returns at once (the
  guarded flag of :mod:`~amprobe.capture.collectors.graphstats`: the unsampled graph variant
  is exactly the model's);
* ``amprobe::grad_tap(grad, key)`` is opaque to the compiler: at run time, inside the
  compiled backward, it hands the gradient to the sink registered under the layer's key
  (:func:`~amprobe.capture.collectors.graphstats.layer_key`, a CPU tensor, so identical blocks
  share one graph: see graphstats) — the numerics collector's eager measurement: the same
  statistics, loss-scale division and rows as eager output gradients, no host-device sync on
  accelerators — and returns a copy of it. The sink's buffers are not graph inputs, so no
  saved tensor is ever mutated; the op is tagged ``cudagraph_unsafe`` (a CUDA graph replay
  would not run the callback).

Cost on a sampled step: per tapped layer a copy of its output (forward) and of its output
gradient (backward) besides the measurement itself; nothing on other steps.
"""

from __future__ import annotations

from typing import Any

import torch

from amprobe.capture.collectors.compiled import is_compiling
from amprobe.capture.collectors.graphstats import GRAPH_SAMPLE, first_float, sink_of
from amprobe.capture.collectors.sharded import PLAIN_TENSORS

__all__ = ["grad_tap_hook"]


@torch.library.custom_op("amprobe::grad_tap", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _grad_tap(grad: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    sink, slot = sink_of(key)
    if sink is not None:
        sink.grad(slot, grad)
    return grad.clone()  # a custom op's output may not alias its input


@_grad_tap.register_fake
def _grad_tap_fake(grad: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


class _Tap(torch.autograd.Function):
    """Identity whose backward hands the incoming gradient to ``amprobe::grad_tap``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(key)
        # a copy, not a view: the layer's output may be modified in place downstream, which
        # autograd forbids on a view returned by a custom function
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (key,) = ctx.saved_tensors
        return torch.ops.amprobe.grad_tap(grad, key), None


def grad_tap_hook(key: torch.Tensor, eager_only: bool = False) -> Any:
    """A forward hook that, on sampled steps, routes its module's output gradient to the sink
    and slot of ``key`` (:func:`~amprobe.capture.collectors.graphstats.layer_key`).

    Only a plain tensor that requires grad is tapped (a tensor subclass such as a DTensor would
    need sharding rules for the op): the output itself, or the first floating tensor of a plain
    tuple or list output, as the eager hooks take it (other containers are left as they are).
    ``eager_only``: as for :func:`~amprobe.capture.collectors.graphstats.graph_stats_hook`.
    """

    def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
        if not GRAPH_SAMPLE.on or (eager_only and is_compiling()):
            return None
        if not isinstance(out, torch.Tensor) and type(out) not in (tuple, list):
            return None
        x = first_float(out)
        if x is None or type(x) not in PLAIN_TENSORS or not x.requires_grad:
            return None
        tapped = _Tap.apply(x, key)
        if out is x:
            return tapped
        items = list(out)
        items[next(i for i, item in enumerate(items) if item is x)] = tapped
        return items if type(out) is list else tuple(items)

    return hook
