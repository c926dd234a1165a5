"""Output gradients of layers inside a compiled region, on sampled steps only.

Eager numerics measures a layer's output gradient with ``out.register_hook``. Inside a
``torch.compile`` region that hook is traced: dynamo turns it into a subgraph that AOTAutograd
inlines into the backward graph. When the hook adds to a statistics buffer, that buffer becomes
a tensor saved for backward and written back in place once the backward has run, and a second
compiled call before the backward (the same compiled model run twice, or a model that a graph
break splits in two) fails the user's backward with "one of the variables needed for gradient
computation has been modified by an inplace operation" (torch 2.13, aot_eager and inductor;
``tests/test_graphstats.py`` keeps the case). The hooks here keep every buffer out of the
graph instead:

* a forward hook traced into the graph registers, on a sampled step, a gradient hook on the
  layer's output that passes the gradient through ``amprobe::grad_tap``; on other steps it
  returns at once (the guarded flag of :mod:`~amprobe.capture.collectors.graphstats`: the
  unsampled graph variant is exactly the model's);
* ``amprobe::grad_tap(grad, key)`` is opaque to the compiler: at run time, inside the
  compiled backward, it hands the gradient to the sink registered under the layer's key
  (:func:`~amprobe.capture.collectors.graphstats.layer_key`, a CPU tensor read only, so
  identical blocks share one graph and nothing saved is mutated) — the numerics collector's
  eager measurement: the same statistics, loss-scale division and rows as eager output
  gradients, no host-device sync on accelerators — and returns a copy of it. The op is tagged
  ``cudagraph_unsafe`` (a CUDA graph replay would not run the callback).

An autograd function (forward a copy, backward the op) did the same until 2026-12-05; AOTAutograd
does not cache a graph holding one (``autograd_function_apply``), so the sampled variant was
traced anew in every process, warm cache or not (a 1.2 s longer first step at 2 to 32
compiled blocks). A gradient hook is cached.

Cost on a sampled step: per tapped layer a copy of its output gradient besides the measurement
itself; nothing on other steps.
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


def grad_tap_hook(key: torch.Tensor, eager_only: bool = False) -> Any:
    """A forward hook that, on sampled steps, routes its module's output gradient to the sink
    and slot of ``key`` (:func:`~amprobe.capture.collectors.graphstats.layer_key`).

    Only a plain tensor that requires grad is tapped (a tensor subclass such as a DTensor would
    need sharding rules for the op): the output itself, or the first floating tensor of a
    tuple, list or dict output, as the eager hooks take it (the output is returned as it is).
    ``eager_only``: as for :func:`~amprobe.capture.collectors.graphstats.graph_stats_hook`.
    """

    def tap(grad: torch.Tensor) -> torch.Tensor:
        return torch.ops.amprobe.grad_tap(grad, key)

    def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
        if not GRAPH_SAMPLE.on or (eager_only and is_compiling()):
            return
        x = first_float(out)
        if x is None or type(x) not in PLAIN_TENSORS or not x.requires_grad:
            return
        x.register_hook(tap)

    return hook
