"""One replay of a bad step: the variants, run on the step's weights and inputs, and the cause.

:func:`replay_step` is called by :class:`~amprobe.capture.collectors.replay.ReplayCollector` at a
bad step's end. Its order of experiments is fixed (G§5.1 of the seeds, done for the user):

1. **as it ran** (the compiled graphs when compiled, the step's autocast setting; the plain
   graphs, without amprobe's statistics): the gradient that reached the model's output was
   non-finite while the output was finite -> ``loss-computation`` (the loss is computed outside
   the model; ``loss-scale`` when the loss was finite and that gradient overflowed to inf); the
   step finite now -> on a step amprobe sampled under compile, once more with amprobe's
   statistics variant: non-finite -> ``instrumentation``; else ``not-reproduced``;
2. compiled: **eager** (``torch.compiler.set_stance("force_eager")``: nothing compiles, the
   user's graphs are not touched); finite -> ``compiler``; the later variants run eager;
3. the forward non-finite: **autocast off** (fp32 end to end); still non-finite ->
   ``data-or-model``; finite -> ``precision``, then the pins;
4. the forward finite, the gradients not: the same backward at the **loss scale / 2^k**; finite
   -> ``loss-scale`` (the scale was too high, benign); else autocast off, then the pins;
5. **pins**: the layer measured first non-finite, then the normalizations, softmax/attention
   layers, the output projection and the module that feeds the loss, each run in fp32 (autocast
   off inside it, its floating inputs cast to fp32) one at a time, then cumulatively; at most
   :data:`MAX_PIN_RUNS` runs; the fewest layers that make the step finite are the verified fix.

A variant's result: the forward's outputs finite, the parameters' gradients (seeded with the
step's output gradient, taken with ``torch.autograd.grad``: no ``.grad`` is written) finite, the
first non-finite layer (forward hooks on the eager path, read once per variant) and the largest
magnitude. The generators are set to the step's forward state before each variant and to their
state at the replay's start after the last; the model's buffers likewise.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from amprobe.capture.collectors.graphstats import GRAPH_SAMPLE
from amprobe.capture.collectors.sharded import local_tensor, user_model, user_module_name

__all__ = [
    "COMPILED_DDP_NOTE",
    "MAX_PIN_RUNS",
    "SCALE_DIVISORS",
    "Kept",
    "ReplayPlan",
    "describe_model",
    "exchange",
    "exchange_device",
    "fsdp_backward_blocker",
    "fsdp_states",
    "replay_step",
    "replay_target",
]

#: pin variants (single, then cumulative) at most per replay
MAX_PIN_RUNS = 8
#: the lower loss scales tried, in order: scale / d for each divisor d (one backward each)
SCALE_DIVISORS = tuple(2.0**k for k in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24))

_NORM_TYPES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
    torch.nn.LocalResponseNorm,
    *((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()),
)
_SOFTMAX_TYPES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.Softmax,
    torch.nn.LogSoftmax,
    torch.nn.Softmin,
    torch.nn.MultiheadAttention,
)
_HALF = (torch.float16, torch.bfloat16)
_PLAIN_VALUES = (int, float, bool, str, type(None))


def _finite(t: torch.Tensor) -> torch.Tensor:
    """All of ``t`` finite, as a 0-d device bool; a DTensor is read on its local shard (a
    reduction over the whole DTensor would be a collective, and a replay may run on one rank)."""
    return torch.isfinite(local_tensor(t)).all()


def _all_finite(tensors: Any) -> bool:
    """Whether every tensor is finite (local shards: see :func:`_finite`); one read of the
    device (a sync: a replay only)."""
    flags = [_finite(t) for t in tensors]
    if not flags:
        return True
    with torch.no_grad():
        return bool(torch.stack(flags).all().item())


def _float_leaves(value: Any) -> list[torch.Tensor]:
    return [
        t
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]


def _leaves(value: Any) -> list[Any]:
    """``pytree.tree_leaves(value)``, without pytree's walk for what a root forward usually
    gets and returns (a tensor, a flat tuple or list of tensors, no keyword arguments): the
    walk is most of what keeping a step costs (about 500 of its 800 bytecodes)."""
    kind = type(value)
    if kind is torch.Tensor:
        return [value]
    if (kind is tuple or kind is list) and all(type(v) is torch.Tensor for v in value):
        return list(value)
    if kind is dict and not value:
        return []
    return pytree.tree_leaves(value)


#: outputs up to this size are held by the kept forward until the next one (a weak reference
#: to larger ones: a language model's logits are not kept alive for this)
_HELD_OUTPUT_BYTES = 4 << 20


class _Held:
    """A strong reference that reads like a weak one."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()  # its values only: not the graph behind it

    def __call__(self) -> torch.Tensor:
        return self.tensor


class Kept:
    """What one root forward leaves for a replay: references, no copies (see the module)."""

    __slots__ = (
        "args",
        "autocast",
        "device_rng",
        "device_type",
        "grads",
        "kwargs",
        "model",
        "outputs",
        "rng",
        "versions",
        "__weakref__",
    )

    model: weakref.ReferenceType[torch.nn.Module]
    args: Any
    kwargs: Any
    versions: list[tuple[torch.Tensor, int]]
    device_type: str
    rng: torch.Tensor
    device_rng: tuple[int, torch.Tensor] | None
    autocast: tuple[bool, torch.dtype | None]

    def __init__(self) -> None:
        self.grads: dict[int, torch.Tensor] = {}
        self.outputs: list[Callable[[], torch.Tensor | None]] = []

    @classmethod
    def take(cls, model: torch.nn.Module, args: Any, kwargs: Any, device: Any) -> Kept:
        kept = cls()
        kept.model = weakref.ref(model)
        kept.args = args
        kept.kwargs = kwargs
        leaves = _leaves(args) + _leaves(kwargs)  # pytree.tree_leaves((args, kwargs))
        kept.versions = [(t, t._version) for t in leaves if isinstance(t, torch.Tensor)]
        # the job's device (its parameters'), else the first input's: a model given CPU
        # lengths beside CUDA activations runs its autocast on CUDA
        dtype = device.type if isinstance(device, torch.device) else None
        if dtype is None or dtype == "meta":
            dtype = next((t.device.type for t in leaves if isinstance(t, torch.Tensor)), "cpu")
        kept.device_type = dtype
        kept.rng = torch.get_rng_state()
        kept.device_rng = None
        if dtype == "cuda" and torch.cuda.is_available():
            kept.device_rng = (torch.cuda.current_device(), torch.cuda.get_rng_state())
        enabled = torch.is_autocast_enabled(dtype)
        kept.autocast = (enabled, torch.get_autocast_dtype(dtype) if enabled else None)
        return kept

    def watch_output(self, output: Any) -> None:
        """Keep the gradient that reaches each floating output (a tensor hook each)."""
        leaves = _leaves(output)
        self.grads = {}
        self.outputs = []
        ref = weakref.ref(self)
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                # a small output is held (the replay then knows whether the step's own output
                # was finite even when the job dropped it); a large one (logits) only weakly
                small = t.numel() * t.element_size() <= _HELD_OUTPUT_BYTES
                self.outputs.append(_Held(t) if small else weakref.ref(t))
                if t.requires_grad:
                    t.register_hook(_keeper(ref, i))

    def output_finite(self) -> bool | None:
        """Whether the step's own floating outputs were finite (a sync: at a replay only);
        None when the job no longer holds them (or there were none)."""
        live = [r() for r in self.outputs]
        if not live or any(t is None for t in live):
            return None
        return _all_finite(live)

    def grads_finite(self) -> bool:
        """Whether the gradients that reached the outputs are finite (a sync: a replay only)."""
        return _all_finite(self.grads.values())


def _keeper(ref: weakref.ReferenceType[Kept], index: int) -> Any:
    def keep(grad: torch.Tensor) -> None:
        kept = ref()
        if kept is not None:
            have = kept.grads.get(index)
            kept.grads[index] = grad if have is None else have + grad
        return None

    return keep


@dataclasses.dataclass
class ReplayPlan:
    """The facts a replay is decided on (see :func:`replay_step`)."""

    budget_s: float
    scale: float | None
    compiled: bool
    sampled_graph: bool
    micro_batch: int
    micro_batches: int
    loss: float | None = None
    #: FSDP2: the forward gathers parameters across ranks; every rank of ``group`` runs the same
    #: sequence of variants, agreed at fixed points (see :func:`exchange`)
    collective: bool = False
    group: Any = None
    #: whether the variants' backward runs (a collective replay: agreed by every rank)
    backward: bool = True
    #: why not (a collective replay)
    forward_only: str | None = None


def describe_model(kept: Kept) -> str | None:
    """Why the kept forward cannot be replayed, or None."""
    model = kept.model()
    if model is None:
        return "the model was freed before the step ended"
    for t, version in kept.versions:
        if t._version != version:
            return (
                "the step's inputs were modified in place after its forward started "
                "(a replay would read other values)"
            )
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        return (
            "FSDP (the first version, FullyShardedDataParallel): its flat parameters are "
            "gathered and its gradients reduced by the wrapper; only FSDP2 (fully_shard) is "
            "replayed"
        )
    return None


#: the note of a replay that skipped a compiled wrapper around DDP (see :func:`replay_target`)
COMPILED_DDP_NOTE = (
    "compiled DDP: replayed eager through DDP's module; a forward through the compiled DDP "
    "wrapper would prepare its reducer"
)


def replay_target(root: torch.nn.Module) -> tuple[torch.nn.Module, bool]:
    """The module a replay calls, and whether a compiled wrapper was skipped to reach it.

    DDP anywhere in the chain of wrappers (``torch.compile``'s ``_orig_mod``, DDP's ``module``):
    DDP's inner module, never DDP itself, whose forward prepares its reducer and broadcasts the
    buffers (collectives, while ranks may replay different variants). ``torch.compile(DDP(m))``
    (the order of PyTorch's DDP and compile docs) has the compiled wrapper outside DDP: the
    replay then calls DDP's module eager (True). Without DDP: the root as it ran."""
    inner: Any = root
    compiled_above = False
    for _ in range(8):
        if type(inner).__name__ == "DistributedDataParallel":
            module = getattr(inner, "module", None)
            if isinstance(module, torch.nn.Module):
                return module, compiled_above
            break
        orig = getattr(inner, "_orig_mod", None)
        if isinstance(orig, torch.nn.Module):
            compiled_above = True
            inner = orig
            continue
        module = getattr(inner, "module", None)
        if type(inner).__name__ in _MODULE_WRAPPERS and isinstance(module, torch.nn.Module):
            inner = module
            continue
        break
    return root, False


#: wrappers that hold the model as ``.module`` and may sit between compile and DDP
_MODULE_WRAPPERS = frozenset({"DataParallel", "Float16Module"})


# -- FSDP2 (fully_shard) -------------------------------------------------------------------------
def fsdp_states(module: torch.nn.Module) -> list[Any]:
    """The FSDP2 states of ``module``'s tree (one per ``fully_shard`` call), outermost first."""
    states: list[Any] = []
    seen: set[int] = set()
    for m in module.modules():
        get = getattr(m, "_get_fsdp_state", None)
        if get is None:
            continue
        try:
            state = get()
        except Exception:  # a module that only looks like one
            continue
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            states.append(state)
    return states


def _fsdp_groups(states: list[Any]) -> list[Any]:
    return [g for s in states for g in getattr(s, "_fsdp_param_groups", ())]


def fsdp_backward_blocker(states: list[Any]) -> str | None:
    """Why FSDP2's post-backward would reduce-scatter (and write ``.grad``) even for a backward
    taken with ``torch.autograd.grad``, or None. The replay's backward differentiates with
    respect to the unsharded parameters: autograd hands their gradients back instead of
    accumulating them into ``.grad``, so the post-backward finds no gradient and reduces
    nothing, except a gradient still being accumulated unreduced or
    ``reduce_scatter_unused_params`` (zeros are reduced then)."""
    for group in _fsdp_groups(states):
        if getattr(group, "reduce_scatter_unused_params", False):
            return "FSDP2's reduce_scatter_unused_params would reduce-scatter zeros into `.grad`"
        for fp in getattr(group, "fsdp_params", ()):
            if getattr(fp, "unsharded_accumulated_grad", None) is not None:
                return (
                    "FSDP2 holds a gradient accumulated without reduction: its post-backward "
                    "would reduce it into `.grad`"
                )
    return None


def _fsdp_half(states: list[Any]) -> bool:
    """Whether a MixedPrecisionPolicy casts the parameters to half precision (it computes in
    fp16/bf16 without autocast)."""
    return any(
        getattr(getattr(s, "_mp_policy", None), "param_dtype", None) in _HALF for s in states
    )


def exchange(row: list[int], plan: ReplayPlan, device: str) -> list[list[int]]:
    """Every rank's ``row`` (small integers), by one all-reduce over the plan's group; every
    rank of the group must call it at the same point (a collective)."""

    group = plan.group
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    table = torch.zeros(world, len(row), dtype=torch.int64, device=device)
    table[me] = torch.tensor(row, dtype=torch.int64, device=device)
    dist.all_reduce(table, group=group)
    return [[int(v) for v in r] for r in table.tolist()]


def exchange_device(group: Any) -> str:
    """Where the tensors of an all-reduce over ``group`` live (NCCL: the current GPU)."""

    try:
        backend = str(dist.get_backend(group)).lower()
    except Exception:
        backend = ""
    if backend == "nccl" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


@dataclasses.dataclass
class _Result:
    variant: str
    finite: bool = False
    forward_finite: bool = False
    grads_finite: bool | None = None
    first_nonfinite: str | None = None
    nonfinite_params: list[str] = dataclasses.field(default_factory=list)
    max_abs: float | None = None
    seconds: float = 0.0
    pins: list[str] = dataclasses.field(default_factory=list)
    scale: float | None = None
    error: str | None = None

    def row(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "variant": self.variant,
            "finite": self.finite,
            "forward_finite": self.forward_finite,
            "grads_finite": self.grads_finite,
            "first_nonfinite": self.first_nonfinite,
            "max_abs": self.max_abs,
            "seconds": round(self.seconds, 6),
        }
        if self.pins:
            row["pins"] = list(self.pins)
        if self.scale is not None:
            row["scale"] = self.scale
        if self.nonfinite_params:
            row["nonfinite_params"] = self.nonfinite_params[:5]
        if self.error:
            row["error"] = self.error
        return row


class _Budget(Exception):
    """The replay's time is spent."""


class _Runner:
    """Runs the variants of one replay on one kept forward."""

    def __init__(self, kept: Kept, plan: ReplayPlan) -> None:
        self.kept = kept
        self.plan = plan
        root = kept.model()
        assert root is not None
        self.root = root
        self.user = user_model(root)  # the layers' names as the user's code writes them
        # what is called: DDP's inner module (a forward through the wrapper arms its reducer)
        self.target = replay_target(root)[0]
        self.params = [(n, p) for n, p in self.user.named_parameters() if p.requires_grad]
        # FSDP2: the registered parameters are sharded DTensors outside the forward's graph;
        # the graph's leaves are the unsharded parameters the forward gathers (see _leaves)
        self.fsdp = fsdp_states(self.user)
        self.fsdp_half = _fsdp_half(self.fsdp)
        groups = _fsdp_groups(self.fsdp)
        self._sharded_at_start = [g for g in groups if getattr(g, "is_sharded", False)]
        self._fsdp_orders = [(g, list(getattr(g, "_post_forward_indices", []))) for g in groups]
        ctx = getattr(groups[0], "comm_ctx", None) if groups else None
        self._forward_order = (
            (ctx, list(ctx.post_forward_order))
            if ctx is not None and hasattr(ctx, "post_forward_order")
            else None
        )
        self.names = {id(m): n for n, m in self.user.named_modules() if n}
        self.device = exchange_device(plan.group) if plan.collective else "cpu"
        self.reset_state: Any = lambda: None  # set by replay_step: its saved buffers and attributes
        self.start = time.perf_counter()
        self.results: list[_Result] = []
        self.order: list[str] = []  # module names in forward completion order (eager)
        seeds = kept.grads
        if any(g.dim() == 0 for g in seeds.values()) and any(g.dim() for g in seeds.values()):
            # a model that returns its loss and the logits it came from (HF with labels): the
            # logits' gradient already holds the loss's part; seeding both would count it twice
            seeds = {i: g for i, g in seeds.items() if g.dim() == 0}
        self.seeds = seeds
        #: why the backward could not run (reentrant activation checkpointing refuses
        #: torch.autograd.grad): the variants are then judged by their forward
        self.backward_error: str | None = None

    # -- one variant ---------------------------------------------------------------------------
    def run(
        self,
        variant: str,
        *,
        eager: bool,
        autocast: bool = True,
        pins: tuple[str, ...] = (),
        scales: tuple[float, ...] = (1.0,),
        observe: bool = False,
        stop_at_finite: bool = False,
        graph_sample: bool = False,
    ) -> list[_Result]:
        """One forward, and one backward per entry of ``scales`` (seed multipliers)."""
        elapsed = time.perf_counter() - self.start
        if self.results and elapsed >= self.plan.budget_s and not self.plan.collective:
            raise _Budget  # (a collective replay: the ranks agree when to stop, see exchange)
        kept = self.kept
        base = self.plan.scale
        results = [
            _Result(variant, pins=list(pins), scale=None if base is None else base * s)
            for s in scales
        ]
        t0 = time.perf_counter()
        flags: list[tuple[str, torch.Tensor]] = []
        order: list[str] = []
        with contextlib.ExitStack() as stack:
            self._set_rng()
            self.reset_state()  # a forward's counters and buffers as the replay found them
            if eager and self.plan.compiled:
                stack.enter_context(torch.compiler.set_stance("force_eager"))
            stack.enter_context(torch.enable_grad())
            if graph_sample:  # amprobe's statistics variant of the compiled graphs
                stack.enter_context(_graph_sample())
            # the forward under the step's autocast setting (and the pins); the backward after
            # it, outside autocast, as a training loop runs it (on the CPU a backward inside an
            # autocast region would cast its matmuls too)
            with contextlib.ExitStack() as forward:
                enabled, dtype = kept.autocast
                if enabled and autocast:
                    forward.enter_context(torch.autocast(kept.device_type, dtype=dtype))
                else:
                    forward.enter_context(torch.autocast(kept.device_type, enabled=False))
                    if not autocast:  # and the autocast a wrapped forward enters (accelerate's)
                        forward.enter_context(_original_forwards(self.target, self.user))
                    if not autocast and self.fsdp_half:  # the policy's half parameters:
                        # the whole model in fp32
                        forward.enter_context(_pinned(self.user, kept.device_type, True))
                if observe:
                    self._observe(forward, flags, order)
                for name in pins:
                    forward.enter_context(
                        _pinned(self.user.get_submodule(name), kept.device_type, self.fsdp_half)
                    )
                out = self.target(*kept.args, **(kept.kwargs or {}))
            leaves = pytree.tree_leaves(out)
            floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
            with torch.no_grad():
                fwd_ok = (
                    torch.stack([_finite(t) for t in floats]).all()
                    if floats
                    else torch.tensor(True)
                )
                locals_ = [local_tensor(t.detach()) for t in floats]
                peaks = [
                    t.abs().float().nan_to_num(0.0, 0.0, 0.0).amax() for t in locals_ if t.numel()
                ]
                amax = torch.stack(peaks).amax() if peaks else None
            fwd = bool(fwd_ok.item())
            peak = float(amax.item()) if amax is not None else None
            first = None
            if flags:
                ok = torch.stack([f for _, f in flags]).tolist()
                for (name, _), good in zip(flags, ok, strict=False):
                    if not good:
                        first = name
                        break
            # a layer's non-finite output that a later op hides (tanh(inf) = 1) is a
            # non-finite forward too: its backward is not finite
            fwd = fwd and first is None
            self.order = order or self.order
            pairs = [
                (leaves[i], g)
                for i, g in self.seeds.items()
                if i < len(leaves)
                and isinstance(leaves[i], torch.Tensor)
                and leaves[i].requires_grad
            ]
            params = self._leaves()
            if not self.plan.backward:
                pairs = []
            done: list[_Result] = []
            for k, (s, r) in enumerate(zip(scales, results, strict=False)):
                r.forward_finite = fwd
                r.max_abs = peak
                r.first_nonfinite = first
                done.append(r)
                if pairs and params and self.backward_error is None:
                    outs = [o for o, _ in pairs]
                    seeds = [g.to(o.dtype) * s if s != 1.0 else g.to(o.dtype) for o, g in pairs]
                    try:
                        grads = torch.autograd.grad(
                            outs,
                            [p for _, p in params],
                            grad_outputs=seeds,
                            allow_unused=True,
                            retain_graph=k < len(scales) - 1,
                        )
                    except RuntimeError as exc:
                        if self.plan.collective or isinstance(exc, torch.OutOfMemoryError):
                            raise
                        # (e.g. reentrant activation checkpointing: "incompatible with .grad()")
                        self.backward_error = f"{type(exc).__name__}: {exc}"
                        r.error = self.backward_error
                        r.finite = fwd
                        continue
                    unreached = [
                        n
                        for (n, p), g in zip(params, grads, strict=False)
                        if g is None and getattr(p, "grad", None) is not None
                    ]
                    if not self.plan.collective and (unreached or all(g is None for g in grads)):
                        # reentrant activation checkpointing computes its parameters' gradients
                        # in a backward of its own, which torch.autograd.grad does not reach
                        self.backward_error = (
                            f"torch.autograd.grad does not reach {len(unreached) or len(grads)} "
                            "parameter(s) that got a gradient in the step (reentrant activation "
                            "checkpointing?)"
                        )
                        r.error = self.backward_error
                        r.finite = fwd
                        del grads, seeds
                        continue
                    with torch.no_grad():
                        per = torch.stack(
                            [_finite(g) if g is not None else fwd_ok.new_ones(()) for g in grads]
                        ).tolist()
                    del grads, seeds
                    r.grads_finite = all(per)
                    if not r.grads_finite:
                        r.nonfinite_params = [
                            n for (n, _), good in zip(params, per, strict=False) if not good
                        ]
                r.finite = fwd and r.grads_finite is not False
                if stop_at_finite and r.finite:
                    break
                if k < len(scales) - 1 and time.perf_counter() - self.start >= self.plan.budget_s:
                    break
            results = done
            del out, leaves, floats, pairs
        self._settle()
        took = time.perf_counter() - t0
        for r in results:
            r.seconds = took / len(results)
        self.results.extend(results)
        return results

    def _leaves(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters the backward differentiates: the model's own, or under FSDP2 the
        unsharded parameters its forward gathered (autograd returns their gradients: FSDP2's
        post-backward finds none in ``.grad`` and reduce-scatters nothing)."""
        if not self.fsdp:
            return self.params
        out = []
        for group in _fsdp_groups(self.fsdp):
            for fp in getattr(group, "fsdp_params", ()):
                p = getattr(fp, "_unsharded_param", None)
                if isinstance(p, torch.Tensor) and p.requires_grad:
                    out.append((user_module_name(str(getattr(fp, "_param_fqn", "?"))), p))
        return out

    def _settle(self) -> None:
        """FSDP2 after a variant: the groups that were sharded when the replay began are
        sharded again (a forward without backward leaves the root's parameters gathered)."""
        for group in self._sharded_at_start:
            if not group.is_sharded:
                group._to_sharded()

    def restore(self) -> None:
        """FSDP2: the forward order its backward prefetch reads, as it was before the replay."""
        for group, indices in self._fsdp_orders:
            group._post_forward_indices[:] = indices
        if self._forward_order is not None:
            ctx, order = self._forward_order
            ctx.post_forward_order[:] = order

    def reset_after_failure(self) -> None:
        """FSDP2 after a variant that raised: its per-iteration state reset (FSDP2's own
        recovery), the groups sharded again."""
        for state in self.fsdp:
            reset = getattr(state, "_reset_iter_state", None)
            if reset is not None:
                with contextlib.suppress(Exception):
                    reset()
        with contextlib.suppress(Exception):
            self._settle()

    def _set_rng(self) -> None:
        torch.set_rng_state(self.kept.rng)
        if self.kept.device_rng is not None:
            index, state = self.kept.device_rng
            torch.cuda.set_rng_state(state, index)

    def _observe(
        self, stack: contextlib.ExitStack, flags: list[tuple[str, torch.Tensor]], order: list[str]
    ) -> None:
        """Forward hooks on every named module (eager variants only): each output's finiteness,
        kept on the device and read once with the variant's other values."""
        names = self.names

        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            name = names.get(id(module))
            if name is None:
                return
            order.append(name)
            floats = _float_leaves(out)
            if floats:
                with torch.no_grad():
                    flags.append((name, torch.stack([_finite(t) for t in floats]).all()))

        handles = [m.register_forward_hook(hook) for n, m in self.user.named_modules() if n]
        stack.callback(lambda: [h.remove() for h in reversed(handles)])


@contextlib.contextmanager
def _graph_sample() -> Iterator[None]:
    was = GRAPH_SAMPLE.on
    GRAPH_SAMPLE.on = True
    try:
        yield
    finally:
        GRAPH_SAMPLE.on = was


@contextlib.contextmanager
def _original_forwards(*modules: torch.nn.Module) -> Iterator[None]:
    """Run the modules' own forwards for the block where a framework wrapped them in autocast:
    accelerate's native AMP (the HF Trainer's) sets ``module.forward`` to an autocast-wrapped
    copy and keeps the original as ``module._original_forward``; an outer ``autocast(enabled=
    False)`` does not reach inside it."""
    swapped: list[tuple[torch.nn.Module, Any]] = []
    for module in dict.fromkeys(modules):
        own = module.__dict__
        if "forward" in own and callable(own.get("_original_forward")):
            swapped.append((module, own["forward"]))
            module.forward = own["_original_forward"]  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module, forward in reversed(swapped):
            module.forward = forward  # type: ignore[method-assign]


def _wrapped_autocast(*modules: torch.nn.Module) -> torch.dtype | None:
    """The dtype of an enabled autocast that a wrapped forward enters (see
    :func:`_original_forwards`), read from the wrappers' ``__wrapped__`` chain; None if none."""
    for module in dict.fromkeys(modules):
        own = module.__dict__
        if "forward" not in own or "_original_forward" not in own:
            continue
        fn: Any = getattr(own["forward"], "__func__", own["forward"])
        for _ in range(8):
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if isinstance(value, torch.autocast) and getattr(value, "_enabled", False):
                    return value.fast_dtype
            fn = getattr(fn, "__wrapped__", None)
            if fn is None:
                break
    return None


@contextlib.contextmanager
def _pinned(module: torch.nn.Module, device_type: str, children: bool = False) -> Iterator[None]:
    """Run ``module`` in fp32 for the block: autocast off inside it, floating inputs cast, and
    half-precision parameters (FSDP2's MixedPrecisionPolicy gathers them in its param_dtype,
    without autocast) cast to fp32 in it and, with ``children``, in its children, where FSDP2
    does not cast their inputs back to half."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_fp32_forward(module, device_type, top=True))
        for m in module.modules() if children else ():
            if m is not module and m._parameters:
                stack.enter_context(_fp32_forward(m, device_type, top=False))
        for state in fsdp_states(module):
            policy: Any = getattr(state, "_mp_policy", None)
            if getattr(policy, "cast_forward_inputs", False) and policy.param_dtype is not None:
                state._mp_policy = dataclasses.replace(policy, cast_forward_inputs=False)
                stack.callback(setattr, state, "_mp_policy", policy)
        yield


@contextlib.contextmanager
def _fp32_forward(module: torch.nn.Module, device_type: str, top: bool) -> Iterator[None]:
    had = "forward" in module.__dict__
    forward = module.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        if top:
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t.float() if t.dtype in _HALF else t, (args, kwargs)
            )
        # the parameters as the forward sees them now (FSDP2 swaps in the gathered ones in its
        # pre-forward hook, which has run): half ones replaced by differentiable fp32 casts
        params = module._parameters
        saved = {n: p for n, p in params.items() if p is not None and p.dtype in _HALF}
        for name, p in saved.items():
            params[name] = p.float()  # type: ignore[assignment]
        try:
            if top:
                with torch.autocast(device_type, enabled=False):
                    return forward(*args, **kwargs)
            return forward(*args, **kwargs)
        finally:
            params.update(saved)

    module.forward = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            module.forward = forward  # type: ignore[method-assign]
        else:
            del module.forward


def _candidates(runner: _Runner, first: str | None, order: list[str] | None = None) -> list[str]:
    """The layers to pin, in the stated order: the one measured first non-finite, the
    normalizations, softmax/attention layers, the output projection, the module feeding the
    loss; among the modules in ``order`` (default: the eager forward's order of completion)."""
    user = runner.user
    order = runner.order if order is None else order
    seen: dict[str, None] = {}
    if first:
        seen[first] = None
    executed = list(dict.fromkeys(order))
    modules = dict(user.named_modules())
    for name in executed:
        if isinstance(modules.get(name), _NORM_TYPES):
            seen.setdefault(name, None)
    for name in executed:
        m = modules.get(name)
        if isinstance(m, _SOFTMAX_TYPES) or "attention" in type(m).__name__.lower():
            seen.setdefault(name, None)
    linears = [n for n in executed if isinstance(modules.get(n), torch.nn.Linear)]
    if linears:
        seen.setdefault(linears[-1], None)
    leaves = [
        n
        for n in executed
        if modules.get(n) is not None and not any(True for _ in modules[n].children())
    ]
    if leaves:
        seen.setdefault(leaves[-1], None)
    return list(seen)


def _dropout_in_training(module: torch.nn.Module) -> bool:
    return any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0
        for m in module.modules()
    )


class _State:
    """What a replay must leave as it found it, taken at its start and put back at its end.

    The random streams: torch's CPU generator, every CUDA device's, Python's ``random`` and
    NumPy's global one (a forward that draws from them must not shift the job's later draws; the
    replay's own forward draws from torch's generators as the step did, set per variant). The
    model's buffers: their values and which tensor each name holds (a forward that rebinds a
    buffer, ``self.count = self.count + 1``). Its modules' plain attributes (numbers, strings,
    flags), the contents of their list, dict and set attributes (a call counter, a history) and
    the generators they hold (``torch.Generator`` attributes). The side effects of the user's
    own hooks (they run in the replay: FSDP2's are hooks too) and generators held elsewhere are
    not covered. Each part is restored on its own; what fails is named in
    :attr:`failed`."""

    def __init__(self, user: torch.nn.Module) -> None:
        self.failed: list[str] = []
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng: list[torch.Tensor] | None = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.cuda_rng = torch.cuda.get_rng_state_all()
        self.py_rng = random.getstate()
        numpy = sys.modules.get("numpy")
        self.np_rng = numpy.random.get_state() if numpy is not None else None
        self.modules = list(user.modules())
        self.buffer_slots = [(m, dict(m._buffers)) for m in self.modules if m._buffers]
        self.buffer_values = [
            (b, b.detach().clone())
            for _, slots in self.buffer_slots
            for b in slots.values()
            if isinstance(b, torch.Tensor)
        ]
        self.attrs: list[tuple[torch.nn.Module, dict[str, Any]]] = []
        self.containers: list[tuple[Any, Any]] = []
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []
        for m in self.modules:
            plain = {}
            for k, v in vars(m).items():
                if type(v) in _PLAIN_VALUES:
                    plain[k] = v
                elif not k.startswith("_") and type(v) in (list, dict, set):
                    self.containers.append((v, copy.copy(v)))
                elif isinstance(v, torch.Generator):  # a generator the model draws from
                    self.generators.append((v, v.get_state()))
            self.attrs.append((m, plain))

    def restore_module_state(self) -> None:
        """The buffers and the modules' attributes (before each variant, and at the end)."""
        for m, slots in self.buffer_slots:
            try:
                m._buffers.clear()
                m._buffers.update(slots)
            except Exception as exc:
                self._fail(f"the buffers of {type(m).__name__}", exc)
        with torch.no_grad():
            for b, saved in self.buffer_values:
                try:
                    if b._version != saved._version or not torch.equal(b, saved):
                        b.copy_(saved)
                except Exception as exc:  # an expanded or inference-mode buffer
                    self._fail("a buffer's values", exc)
        for m, values in self.attrs:
            m.__dict__.update(values)
        for live, saved in self.containers:
            try:
                if live != saved:
                    live.clear()
                    (live.extend if isinstance(live, list) else live.update)(saved)
            except Exception as exc:
                self._fail("a list or dict attribute", exc)

    def restore(self) -> None:
        """Everything, the random streams first."""
        for what, put in (
            ("torch's CPU generator", lambda: torch.set_rng_state(self.cpu_rng)),
            ("the CUDA generators", self._put_cuda),
            ("Python's random", lambda: random.setstate(self.py_rng)),
            ("NumPy's random", self._put_numpy),
            ("the model's own generators", self._put_generators),
        ):
            try:
                put()
            except Exception as exc:
                self._fail(what, exc)
        self.restore_module_state()

    def _put_cuda(self) -> None:
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def _put_generators(self) -> None:
        for generator, saved in self.generators:
            generator.set_state(saved)

    def _put_numpy(self) -> None:
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.np_rng is not None:
            numpy.random.set_state(self.np_rng)

    def _fail(self, what: str, exc: Exception) -> None:
        self.failed.append(f"{what} ({type(exc).__name__}: {exc})")


def replay_step(kept: Kept, plan: ReplayPlan) -> dict[str, Any]:
    """Replay the kept forward in the fixed order of variants; return the ``replay`` event's
    detail. Never raises: a failure of the replay itself is recorded as its ``reason``."""
    t0 = time.perf_counter()
    root = kept.model()
    if root is None:
        return {"replayed": False, "reason": "the model was freed before the step ended"}
    user = user_model(root)
    state = _State(user)
    detail: dict[str, Any] = {"replayed": True}
    runner: _Runner | None = None

    try:
        runner = _Runner(kept, plan)
        runner.reset_state = state.restore_module_state
        detail.update(
            _decide_collective(runner, plan) if plan.collective else _decide(runner, plan)
        )
    except _Budget:
        detail.update(cause=None, verified_fix=[], incomplete="the replay's time budget was spent")
    except torch.OutOfMemoryError:
        detail = {"replayed": False, "reason": "out of memory"}
        if runner is not None and plan.collective:
            runner.reset_after_failure()
    except Exception as exc:  # a replay that fails is recorded, never raised
        detail = {"replayed": False, "reason": f"the replay failed: {type(exc).__name__}: {exc}"}
        if runner is not None and plan.collective:
            runner.reset_after_failure()
    finally:
        state.restore()  # generators first; each part on its own: one failing skips no other
        if state.failed:
            detail.setdefault("notes", []).append(
                "not restored after the replay: " + "; ".join(state.failed)
            )
        if runner is not None:
            runner.restore()
            detail["experiments"] = [r.row() for r in runner.results]
        if detail.get("reason") == "out of memory" and torch.cuda.is_available():
            torch.cuda.empty_cache()
        if plan.collective and detail.get("replayed") is False:
            # the memory was judged before starting; a failure inside leaves the other ranks
            # in the collective this rank did not reach: say so, nothing can be undone
            detail["reason"] += (
                " (inside an FSDP2 replay: the other ranks may be waiting in a collective this "
                "rank did not reach)"
            )
    detail["seconds"] = round(time.perf_counter() - t0, 6)
    detail["budget_s"] = round(plan.budget_s, 6)
    if plan.micro_batches > 1:
        detail["micro_batch"] = plan.micro_batch
        detail["micro_batches"] = plan.micro_batches
    detail["compiled"] = plan.compiled
    detail["device_type"] = kept.device_type
    world = _world_size()
    if world > 1:
        # this rank's own step on replay (its forward, and its backward where one ran): in a
        # data-parallel job a rank whose own step is finite received the non-finite gradient
        # from another rank through the gradient reduction (the read side names the origin)
        detail["world_size"] = world
        as_ran = next(
            (e for e in detail.get("experiments", ()) if e.get("variant") == "as it ran"), None
        )
        detail["local_finite"] = None if as_ran is None else bool(as_ran["finite"])
        detail["collective"] = plan.collective
    enabled, dtype = kept.autocast
    if not enabled:  # autocast entered inside a wrapped forward (accelerate's) is the step's too
        dtype = _wrapped_autocast(user, root)
        enabled = dtype is not None
    detail["autocast_dtype"] = str(dtype).replace("torch.", "") if enabled and dtype else None
    if plan.scale is not None:
        detail["scale"] = plan.scale
    return detail


def _decide(r: _Runner, plan: ReplayPlan) -> dict[str, Any]:
    """The fixed order of experiments (see the module docstring)."""
    out: dict[str, Any] = {"verified_fix": []}
    notes: list[str] = []
    seed_finite = _all_finite(r.seeds.values()) if r.seeds else None
    if not r.seeds:
        notes.append("no gradient reached the model's output in the step: forward variants only")
    out["output_grad_finite"] = seed_finite
    real = r.kept.output_finite()
    out["output_finite"] = real
    if seed_finite is False:
        # a gradient computed from a non-finite output (or by a non-finite loss): no backward
        # can be seeded with it; the variants are judged by their forward
        r.seeds = {}
        notes.append(
            "the gradient that reached the model's output was non-finite: the variants are "
            "judged by their forward"
        )
    compiled = plan.compiled
    as_ran = r.run("as it ran", eager=False, observe=not compiled)[0]
    if r.backward_error is not None:
        notes.append(f"the backward cannot be replayed ({r.backward_error})")
        if as_ran.forward_finite:  # the bad value is in the backward, which cannot be run
            out.update(cause=None, incomplete="the backward cannot be replayed", notes=notes)
            return out
    # finite now where the step was not: its output (or, unknown, the gradient it got)
    finite_now = (
        as_ran.finite if seed_finite is not False else (as_ran.forward_finite and real is not True)
    )
    if finite_now and plan.sampled_graph:
        # the step was one of amprobe's sampled steps under compile: its graphs ran with
        # amprobe's statistics; as it ran without them the step is finite. With them?
        ours = r.run("as it ran, with amprobe's statistics", eager=False, graph_sample=True)[0]
        if not ours.finite:
            out["cause"] = "instrumentation"
            notes.append(
                "the step is finite as the model compiles without amprobe, and non-finite with "
                "the statistics variant amprobe compiled for its sampled steps: amprobe's "
                "instrumentation made it (please report it)"
            )
            out["notes"] = notes
            return out
    if seed_finite is False and as_ran.forward_finite:
        out.update(_seed_cause(r, plan, real, notes))
        out["notes"] = notes
        return out
    if as_ran.finite:
        out["cause"] = "not-reproduced"
        if plan.micro_batches > 1:
            # not a measured cause: the micro-batches before the last were not replayed
            out["confirmed"] = False
            notes.append(
                f"only the last of {plan.micro_batches} micro-batches is kept: an earlier one "
                "may hold the non-finite value"
            )
        out["notes"] = notes
        return out
    base = as_ran
    if compiled:
        eager = r.run("eager", eager=True, observe=True)[0]
        if eager.finite:
            out["cause"] = "compiler"
            out["compiled_first_nonfinite"] = as_ran.first_nonfinite
            if _dropout_in_training(r.user):
                notes.append(
                    "the model uses dropout in training: inductor draws its randomness "
                    "differently from eager, so the two runs are not the same computation "
                    "(not confirmed)"
                )
                out["confirmed"] = False
            out["notes"] = notes
            return out
        base = eager
    if base.forward_finite and r.seeds:
        # gradient-only overflow: the same backward at lower loss scales
        found = _lower_scale(r)
        if found is not None:
            out["cause"] = "loss-scale"
            out["finite_at_scale_divisor"] = found
            if plan.scale:
                out["finite_at_scale"] = plan.scale / found
            out["notes"] = notes
            return out
    off: _Result | None = _try(r, "autocast off", eager=True, autocast=False, observe=True)
    if off is not None and off.error:
        notes.append(f"autocast off could not run ({off.error})")
        off = None
    if off is not None and not off.finite:
        out["cause"] = "data-or-model"
        out["notes"] = notes
        return out
    first = base.first_nonfinite or _grad_culprit(base, r)
    fix = _pins(r, _candidates(r, first))
    out["verified_fix"] = fix
    out["first_nonfinite"] = first
    if off is None and not fix:
        # neither fp32 end to end nor a pin ran finite: precision is not measured
        out.update(cause=None, incomplete="autocast off could not run and no pin made it finite")
        out["notes"] = notes
        return out
    out["cause"] = "precision"  # fp32 end to end finite, or a verified pin
    if not fix:
        notes.append("no pin of the candidate layers alone made the step finite")
    out["notes"] = notes
    return out


def _has_inf(grads: dict[int, torch.Tensor]) -> bool:
    with torch.no_grad():
        return any(bool(torch.isinf(local_tensor(g)).any().item()) for g in grads.values())


def _grad_culprit(result: _Result, r: _Runner) -> str | None:
    """For a gradient-only overflow: the module owning the first non-finite parameter gradient."""
    if not result.nonfinite_params:
        return None
    name = result.nonfinite_params[-1]
    return name.rsplit(".", 1)[0] if "." in name else None


def _lower_scale(r: _Runner) -> float | None:
    """The smallest power-of-two divisor of the loss scale at which the step's gradients are
    finite: one forward, a backward per divisor of :data:`SCALE_DIVISORS` until one is, then
    the powers of two between it and the last that was not (the largest finite scale); None
    when none is."""
    results = r.run(
        "lower loss scale",
        eager=True,
        scales=tuple(1.0 / d for d in SCALE_DIVISORS),
        stop_at_finite=True,
    )
    if not results[-1].finite:
        return None
    found = SCALE_DIVISORS[len(results) - 1]
    below = SCALE_DIVISORS[len(results) - 2] if len(results) > 1 else 1.0
    between = []
    d = found / 2
    while d > below:
        between.append(d)
        d /= 2
    if between:
        refined = r.run("lower loss scale", eager=True, scales=tuple(1.0 / d for d in between))
        for d, res in zip(between, refined, strict=False):
            if not res.finite:
                break
            found = d
    return found


def _pins(r: _Runner, candidates: list[str]) -> list[str]:
    """Single pins in the stated order, then cumulative, at most :data:`MAX_PIN_RUNS` runs.

    The cumulative pins follow the overflow: a set of pins that leaves the step non-finite adds
    the layer that is now first non-finite (pinning one layer often moves the overflow to the
    next half-precision op), else the next candidate; the first set that makes the step finite
    is the fix (the fewest layers: every smaller set tried first was not)."""
    runs = 0
    moved: list[str] = []  # where each failed single pin moved the overflow
    for name in candidates:
        if runs >= MAX_PIN_RUNS:
            return []
        runs += 1
        result = _try_pins(r, (name,))
        if result.finite:
            return [name]
        moved.append(result.first_nonfinite or "")
    if not candidates:
        return []
    pins = [candidates[0]]
    after = moved[0] if moved else ""
    rest = [c for c in candidates[1:]]
    while runs < MAX_PIN_RUNS:
        nxt = (
            after if after and after not in pins else next((c for c in rest if c not in pins), None)
        )
        if nxt is None:
            break
        pins.append(nxt)
        runs += 1
        result = _try_pins(r, tuple(pins))
        if result.finite:
            return list(pins)
        after = result.first_nonfinite or ""
    return []


def _try(r: _Runner, variant: str, **kwargs: Any) -> _Result:
    """One variant that may raise (a kernel that only takes half precision under autocast off
    or a pin, a layer whose fp32 output meets a half-precision weight): recorded with its error
    and not finite, so it is never the fix and the replay goes on. The time budget, an out of
    memory and any failure in a collective replay (its ranks must stop together) propagate."""
    try:
        return r.run(variant, **kwargs)[0]
    except _Budget:
        raise
    except Exception as exc:
        if r.plan.collective or isinstance(exc, torch.OutOfMemoryError):
            raise
        failed = _Result(variant, pins=list(kwargs.get("pins", ())))
        failed.error = f"{type(exc).__name__}: {exc}"
        r.results.append(failed)
        return failed


def _try_pins(r: _Runner, pins: tuple[str, ...]) -> _Result:
    """One pin variant (see :func:`_try`)."""
    return _try(r, "fp32 " + ", ".join(pins), eager=True, pins=pins, observe=True)


def _world_size() -> int:
    try:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except Exception:
        return 1


#: an exchanged module index meaning "none"
_NONE = 1 << 30


def _decide_collective(r: _Runner, plan: ReplayPlan) -> dict[str, Any]:
    """The variants of an FSDP2 replay, the same on every rank (the forward all-gathers):
    as it ran, the lower loss scales, autocast off, then single and cumulative fp32 pins of the candidates in a
    shared order, the ranks exchanging after each variant whether any still needs another and
    whether any spent its time budget (one all-reduce each). Each rank then takes the cause
    of its own results. A gradient-only overflow is tried at the lower loss scales first, one
    forward and backward per divisor, while a rank still needs one."""
    out: dict[str, Any] = {"verified_fix": []}
    notes = [
        "FSDP2: every rank ran the same variants (the forward gathers parameters across "
        "ranks), agreeing after each variant whether to go on"
    ]
    seed_finite = _all_finite(r.seeds.values()) if r.seeds else None
    out["output_grad_finite"] = seed_finite
    real = r.kept.output_finite()
    out["output_finite"] = real
    if plan.backward:
        notes.append(
            "the backward differentiated the gathered (unsharded) parameters with "
            "torch.autograd.grad: FSDP2's post-backward reduce-scattered nothing and no `.grad` "
            "was written; the gradients are this rank's own, before the reduction"
        )
    else:
        r.seeds = {}
        notes.append("forward only: " + (plan.forward_only or "no backward could be run"))
    order = [n for n, _ in r.user.named_modules() if n]
    where = {n: i for i, n in enumerate(order)}

    # a variant that raises on one rank (an out of memory in its backward, a failing hook) is
    # caught here and carried by the next agreement, which every rank reaches after every
    # variant: all ranks stop there together and each records the failure (no rank is left
    # waiting for another that stopped; see the docs' residual risk: a failure between a
    # forward's collectives)
    failed: dict[str, Any] = {"error": None, "variant": None, "ranks": []}

    def attempt(variant: str, **kwargs: Any) -> _Result | None:
        """One variant on this rank; None when it raised (recorded, carried by the next
        agreement)."""
        try:
            res = r.run(variant, **kwargs)[0]
            if res.error:  # (a failure the variant recorded itself: the same for the ranks)
                failed["error"], failed["variant"] = res.error, variant
                return None
            return res
        except Exception as exc:
            failed["error"] = f"{type(exc).__name__}: {exc}"
            failed["variant"] = variant
            r.results.append(_Result(variant, error=failed["error"]))
            r.reset_after_failure()
            if isinstance(exc, torch.OutOfMemoryError) and torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None

    def agree(flag: bool) -> tuple[bool, bool]:
        """(any rank's flag, any rank over its budget or failed)."""
        over = time.perf_counter() - r.start >= plan.budget_s
        rows = exchange([int(flag), int(over), int(failed["error"] is not None)], plan, r.device)
        failed["ranks"] = [i for i, row in enumerate(rows) if row[2]]
        return any(row[0] for row in rows), any(row[1] or row[2] for row in rows)

    as_ran = attempt("as it ran", eager=True, observe=True)
    local_first = where.get((as_ran.first_nonfinite if as_ran else None) or "", _NONE)
    rows = exchange(
        [
            local_first,
            int(time.perf_counter() - r.start >= plan.budget_s),
            int(failed["error"] is not None),
        ],
        plan,
        r.device,
    )
    failed["ranks"] = [i for i, row in enumerate(rows) if row[2]]
    if as_ran is None or failed["ranks"]:
        return _failed_collective(out, notes, failed)
    shared = min(row[0] for row in rows)
    first = order[shared] if shared < len(order) else None
    over = any(row[1] for row in rows)
    seed_case = seed_finite is False and as_ran.forward_finite
    # gradient-only overflow: the same forward and backward at the loss scale / d, one run per
    # divisor (a second backward through FSDP2's graph is not taken), while a rank needs one
    grad_only = bool(r.seeds) and as_ran.forward_finite and not as_ran.finite
    divisor: float | None = None
    need, over = agree(grad_only) if not over else (False, True)
    if need and not over:
        for d in SCALE_DIVISORS:
            res = attempt("lower loss scale", eager=True, scales=(1.0 / d,))
            if grad_only and divisor is None and res is not None and res.finite:
                divisor = d
            more, over = agree(grad_only and divisor is None)
            if not more or over:
                break
    local_done = seed_case or as_ran.finite or divisor is not None
    off: _Result | None = None
    need, over = agree(not local_done) if not over else (False, True)
    if need and not over:
        off = attempt("autocast off", eager=True, autocast=False, observe=True)
        if off is None:  # (this rank's failure: the next agreement stops every rank)
            agree(False)
    if r.fsdp_half:
        notes.append(
            "FSDP2's MixedPrecisionPolicy computes in half precision without autocast: "
            "'autocast off' and the fp32 pins compute in fp32 on the gathered half-precision "
            "weights, without the policy's casts of the layers' inputs"
        )
    precision = not local_done and off is not None and off.finite
    fix: list[str] = []
    if off is not None:
        need, over = agree(precision)
        if need and not over:
            fix = _pins_collective(r, _candidates_shared(r, first), precision, agree, attempt)
    if failed["ranks"]:
        return _failed_collective(out, notes, failed)
    if seed_case:
        out.update(_seed_cause(r, plan, real, notes))
    elif as_ran.finite:
        out["cause"] = "not-reproduced"
    elif divisor is not None:
        out["cause"] = "loss-scale"
        out["finite_at_scale_divisor"] = divisor
        if plan.scale:
            out["finite_at_scale"] = plan.scale / divisor
        notes.append(
            "the divisors of the loss scale were tried in the order "
            f"{', '.join(f'{d:g}' for d in SCALE_DIVISORS)}: the first that made the step "
            "finite is recorded (not refined between them)"
        )
    elif off is None:
        out["cause"] = None
        out["incomplete"] = "a rank's time budget was spent"
    elif not off.finite:
        out["cause"] = "data-or-model"
        beyond = _beyond_param_dtype(r) if r.fsdp_half else []
        if beyond:
            out["params_beyond_param_dtype"] = beyond
            notes.append(
                "this rank's shard of "
                + ", ".join(beyond)
                + " holds values beyond the MixedPrecisionPolicy's param_dtype: FSDP2 gathers "
                "them as inf, so no variant (they all compute on the gathered weights) can be "
                "finite; the weights, not the fp32 arithmetic, are out of range"
            )
    else:
        out["cause"] = "precision"
        out["verified_fix"] = fix
        out["first_nonfinite"] = as_ran.first_nonfinite or _grad_culprit(as_ran, r)
        if not fix:
            notes.append("no pin of the candidate layers alone made the step finite")
    out["notes"] = notes
    return out


def _candidates_shared(r: _Runner, first: str | None) -> list[str]:
    """:func:`_candidates` in the module tree's order (every rank holds the same tree), after
    the first non-finite layer the ranks agreed on; not the local order of execution."""
    return _candidates(r, first, [n for n, _ in r.user.named_modules() if n])


def _pins_collective(
    r: _Runner, candidates: list[str], need: bool, agree: Any, attempt: Any
) -> list[str]:
    """:func:`_pins` run alike on every rank: after each pin the ranks agree whether any still
    needs one (a rank with its fix found, or without a precision cause, runs along)."""
    runs = 0
    fix: list[str] = []
    tries: list[tuple[str, ...]] = [(c,) for c in candidates]
    tries += [tuple(candidates[:n]) for n in range(2, len(candidates) + 1)]
    for pins in tries:
        if runs >= MAX_PIN_RUNS:
            break
        runs += 1
        res = attempt("fp32 " + ", ".join(pins), eager=True, pins=pins, observe=True)
        if need and not fix and res is not None and res.finite:
            fix = list(pins)
        more, over = agree(need and not fix)
        if not more or over:
            break
    return fix


def _failed_collective(
    out: dict[str, Any], notes: list[str], failed: dict[str, Any]
) -> dict[str, Any]:
    """A collective replay stopped on every rank together because a variant raised on one or
    more ranks (each rank records it: the failing rank its error, the others its rank)."""
    ranks = ", ".join(str(i) for i in failed["ranks"])
    if failed["error"] is not None:
        why = f"the variant '{failed['variant']}' failed on this rank: {failed['error']}"
    else:
        why = f"a variant failed on rank {ranks} of the group"
    out["cause"] = None
    out["verified_fix"] = []
    out["incomplete"] = why + " (FSDP2: every rank stopped together at the next agreement)"
    out["failed_ranks"] = list(failed["ranks"])
    notes.append(
        f"a variant raised on rank {ranks}: the ranks agreed to stop after it, none was left "
        "waiting in a collective"
    )
    out["notes"] = notes
    return out


def _seed_cause(
    r: _Runner, plan: ReplayPlan, real: bool | None, notes: list[str]
) -> dict[str, Any]:
    """The cause when the gradient reaching the model's output was non-finite and the forward
    is finite on replay (``real``: whether the step's own output was finite, None when it was
    no longer held); its reason goes into ``notes``."""
    loss = plan.loss
    if real is True and loss is not None and not math.isfinite(loss):
        notes.append(
            "the model's output was finite and the loss computed from it was not: the loss "
            "computation (outside the model) made it"
        )
        return {"cause": "loss-computation"}
    if real is True and _has_inf(r.kept.grads) and plan.scale and loss is not None:
        notes.append(
            f"the loss ({loss:.6g}) and the model's output were finite, and the gradient "
            "reached the model's output as inf: the scaled gradient overflowed in the "
            f"loss's backward, before the model; the loss scale ({plan.scale:g}) was too "
            "high for it (how much lower it must be cannot be measured without the loss "
            "computation)"
        )
        return {"cause": "loss-scale"}
    if real is True:
        notes.append(
            "the model's output was finite and the gradient that entered the model was not: "
            "the loss computation (outside the model) made it"
        )
        return {"cause": "loss-computation"}
    notes.append(
        "the forward is finite on replay"
        + (
            " and was not in the step"
            if real is False
            else " (the step's output was no longer held: whether the forward or the "
            "loss computation made the gradient non-finite cannot be told)"
        )
    )
    return {"cause": "not-reproduced"}


def _beyond_param_dtype(r: _Runner) -> list[str]:
    """The parameters (first 5) whose local shard holds finite values beyond the largest of
    their FSDP2 param_dtype: gathered, they are inf (a sync per parameter: a replay only)."""
    names: list[str] = []
    with torch.no_grad():
        for group in _fsdp_groups(r.fsdp):
            for fp in getattr(group, "fsdp_params", ()):
                dtype = getattr(fp, "param_dtype", None)
                param = getattr(fp, "sharded_param", None)
                if dtype not in _HALF or param is None:
                    continue
                local = param.to_local() if hasattr(param, "to_local") else param
                if not local.numel():
                    continue
                finite = local.detach().float().nan_to_num(0.0, 0.0, 0.0).abs().amax()
                if float(finite) > torch.finfo(dtype).max:
                    names.append(user_module_name(str(getattr(fp, "_param_fqn", "?"))))
                if len(names) >= 5:
                    return names
    return names
