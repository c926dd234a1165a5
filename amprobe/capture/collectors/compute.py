"""Compute profile: the matmul, convolution and attention ops a training step executes.

On sampled steps a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op
below the Autocast and Autograd keys, so it records the dtypes autocast chose and the backward
GEMMs too; the hub's module stack (:class:`amprobe.capture.modules.ModuleStack`, asked for with
``track_modules``) names the module each op runs in, and the formulas registered in :mod:`torch.utils.flop_counter` give each op's FLOPs.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.utils import flop_counter

from amprobe.capture.collectors.sharded import user_class_name, user_model, user_module_name
from amprobe.capture.protocol import Collector, StepFacts
from amprobe.capture.sites import dtype_name

__all__ = ["ComputeCollector", "GEMM_OPS", "CONV_OPS", "is_attention_op", "op_dims"]

#: aten overload packets recorded as matrix multiplies (operands a [.., M, K], b [.., K, N]).
GEMM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "_scaled_mm"})
#: aten overload packets recorded as convolutions (forward and backward).
CONV_OPS = frozenset(
    {
        "convolution",
        "_convolution",
        "convolution_backward",
        "cudnn_convolution",
        "convolution_overrideable",
    }
)
# ops that move no data (views, metadata, RNG state, allocation without a write)
_FREE_OPS = frozenset(
    {
        "detach",
        "alias",
        "lift_fresh",
        "_unsafe_view",
        "view",
        "t",
        "transpose",
        "permute",
        "expand",
        "as_strided",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "unbind",
        "_reshape_alias",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "set_",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "is_same_size",
        "_local_scalar_dense",
        "_to_copy_noop",
        "record_stream",
    }
)
_BWD_PREFIX = "Backward"


def is_attention_op(name: str) -> bool:
    """True for fused scaled-dot-product attention kernels (forward or backward)."""
    return name.startswith(("_scaled_dot_product_", "_flash_attention", "_efficient_attention"))


def _shape(t: Any) -> list[int] | None:
    return [int(s) for s in t.shape] if isinstance(t, torch.Tensor) else None


def op_dims(name: str, args: tuple[Any, ...]) -> dict[str, Any]:
    """The problem dimensions of a recorded op, from its aten arguments.

    GEMMs give ``m``, ``n``, ``k`` (and ``batch`` for bmm); convolutions give the implicit-GEMM
    ``m`` (= N x output pixels, estimated from the input size), ``n`` (= Cout / groups), ``k``
    (= Cin / groups x kernel) plus ``cin``, ``cout``, ``kernel``; attention gives ``batch``
    (= B x heads), ``m`` (query length), ``n`` (key length) and ``k`` (head dimension).
    """
    if name in ("addmm", "baddbmm", "_addmm_activation"):
        a, b = args[1], args[2]
    elif name in GEMM_OPS:
        a, b = args[0], args[1]
    else:
        a = b = None
    if a is not None and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        out: dict[str, Any] = {"m": int(a.shape[-2]), "k": int(a.shape[-1]), "n": int(b.shape[-1])}
        if a.dim() == 3:
            out["batch"] = int(a.shape[0])
        return out
    if name in CONV_OPS:
        x, w = (args[1], args[2]) if name == "convolution_backward" else (args[0], args[1])
        groups = 1
        if name == "convolution_backward" and len(args) > 9 and isinstance(args[9], int):
            groups = args[9]
        elif name != "convolution_backward" and len(args) > 8 and isinstance(args[8], int):
            groups = args[8]
        transposed = (
            bool(args[7] if name == "convolution_backward" else args[6]) if len(args) > 7 else False
        )
        cin = int(x.shape[1])
        cout = int(w.shape[1] * groups if transposed else w.shape[0])
        kernel = [int(s) for s in w.shape[2:]]
        return {
            "m": int(x.shape[0]) * math.prod(int(s) for s in x.shape[2:]),
            "n": cout // max(groups, 1),
            "k": cin // max(groups, 1) * math.prod(kernel),
            "batch": int(x.shape[0]),
            "cin": cin,
            "cout": cout,
            "kernel": "x".join(str(s) for s in kernel),
        }
    if is_attention_op(name):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        q, k = (tensors[1], tensors[2]) if "backward" in name else (tensors[0], tensors[1])
        if name.startswith(("_flash_attention", "_efficient_attention")):  # [B, S, H, D]
            return {
                "batch": int(q.shape[0] * q.shape[2]),
                "m": int(q.shape[1]),
                "n": int(k.shape[1]),
                "k": int(q.shape[-1]),
            }
        return {
            "batch": int(math.prod(q.shape[:-2])),
            "m": int(q.shape[-2]),
            "n": int(k.shape[-2]),
            "k": int(q.shape[-1]),
        }
    return {}


def _flops(
    packet: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
) -> float | None:
    """FLOPs of one op from torch's registered formula (SDPA CPU kernels via its SDPA helpers)."""
    formula = flop_counter.flop_registry.get(packet)
    if formula is not None:
        return float(formula(*args, **kwargs, out_val=out))
    if is_attention_op(name):
        shapes = [a.shape for a in args if isinstance(a, torch.Tensor)]
        if "backward" in name and len(shapes) >= 4:
            return float(
                flop_counter.sdpa_backward_flop_count(shapes[0], shapes[1], shapes[2], shapes[3])
            )
        if len(shapes) >= 3:
            return float(flop_counter.sdpa_flop_count(shapes[0], shapes[1], shapes[2]))
    return None


def _dtype(t: Any) -> str | None:
    return str(t.dtype).replace("torch.", "") if isinstance(t, torch.Tensor) else None


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(v.numel() * v.element_size() for v in value if isinstance(v, torch.Tensor))
    return 0


class ComputeCollector(Collector):
    """Records what the step computes: GEMM/conv/attention shapes, dtypes, modules and FLOPs.

    On captured steps (step 1, then every ``Config.shapes_every`` steps, at most
    ``Config.shapes_captures`` times) it writes:

    * ``compute_ops``: one row per distinct (module, op, phase, shape, dtypes, autocast state)
      with ``count`` (calls) and ``flops`` (FLOPs of all those calls, from
      ``torch.utils.flop_counter``; a multiply-add counts 2). Dimensions: ``m``, ``n``, ``k``
      (elements), ``batch``, and for convolutions ``cin``, ``cout``, ``kernel``. ``autocast`` is
      ``enabled`` / ``disabled`` (inside an ``autocast(enabled=False)`` region) / ``outside``
      (no autocast region for the op's device) / ``backward``, with ``autocast_dtype``.
    * ``compute_steps``: per captured step, ``matmul_flops`` (FLOPs), ``matmul_ops`` (calls),
      ``other_ops`` and ``other_bytes`` (bytes read + written by every other forward/backward
      op: elementwise, normalization, reductions, copies; views excluded), ``optimizer_bytes``
      (the same inside ``optimizer.step``), ``tf32`` (fp32 matmuls may use TF32), ``capture_s``.

    Events: ``model_params`` (root class, parameters, trainable parameters, parameter dtypes),
    ``compute_capture_error`` (a capture that could not be completed).

    Modules: a forward op is booked to the innermost module running it (the hub's module
    stack, asked for with ``track_modules`` on captured steps). A backward op is booked to the module that ran the forward op whose
    autograd node is executing it (each forward op's output ``grad_fn`` is remembered with its
    module; ``torch._C._current_autograd_node()`` names the node in backward), so the user's
    own hooks, and modules whose backward hooks fire out of order, change nothing; ops of nodes
    not seen in forward fall back to the module stack's backward hooks. A forward op that runs
    during backward (activation checkpointing recomputing a module) has phase ``recompute``.

    The ops come from the hub's one dispatch mode, asked for on captured steps only. A capture
    counts from the root model's first forward of the sampled step (or, when no model is known,
    from the step's start) to the step's end; ops of a forward or backward run inside
    ``optimizer.step(closure)`` count as forward/backward, not optimizer, bytes. Cost: nothing
    on other steps; a captured step runs every aten op through Python (several times a plain
    step on CPU). No host-device sync: only shapes and dtypes are read.
    """

    name = "compute"
    samples = True  # on_step_begin decides its samples (skipped on quiet steps)
    track_modules = True
    # where an op runs (autocast state, model or optimizer) matters only while capturing
    detail_events = frozenset(
        {
            "on_autocast",
            "on_autocast_exit",
            "on_forward_begin",
            "on_forward_end",
            "on_backward_begin",
            "on_backward_end",
            "on_optimizer_step_begin",
            "on_optimizer_step_end",
            "on_step_end",  # a capture ends with its step
        }
    )

    def on_attach(self, probe: Any) -> None:
        super().on_attach(probe)
        self._every, fixed = probe.config.sample_period("shapes_every")
        probe.budget.register("shapes", self._every, fixed=fixed, first=1)
        self._limit = probe.config.shapes_captures
        self._captures = 0
        self._capturing = False
        self._started = False
        self._capture_step = -1
        self._stack: Any = probe.hub.modules  # ModuleStack: active on the captured steps
        self._roots: list[tuple[weakref.ReferenceType[torch.nn.Module], str]] = []
        self._rows: list[dict[str, Any]] = []
        self._capture_error: Exception | None = None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._in_optimizer = 0
        self._in_model = 0  # forward/backward nested inside optimizer.step(closure)
        self._compiled_modules: dict[tuple[Any, ...], list[str]] = {}
        self._turns: dict[tuple[Any, ...], int] = {}

    # -- schedule ----------------------------------------------------------------------------
    def _due(self, step: int) -> bool:
        if self._limit and self._captures >= self._limit:
            return False
        return bool(self.probe.budget.due("shapes", step))

    def on_step_begin(self, step: int) -> None:
        if self._capturing:
            self._stop()
        if self._due(step):
            self._start(step)

    def wants_ops(self, step: int) -> bool:
        return self._capturing

    def on_recording(self, active: bool) -> None:
        if not active and self._capturing:
            self._stop()

    def on_model(self, model: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            return
        model = user_model(model)  # the user's module and names, not a wrapper's (DDP, compile)
        params = trainable = 0
        dtypes: dict[str, int] = defaultdict(int)
        for p in model.parameters():
            params += p.numel()
            if p.requires_grad:
                trainable += p.numel()
            dtypes[str(p.dtype).replace("torch.", "")] += p.numel()
        self.probe.event(
            "model_params",
            root=user_class_name(model),
            params=params,
            trainable_params=trainable,
            param_dtypes=dict(dtypes),
        )
        self._roots.append((weakref.ref(model), type(model).__name__))

    def on_forward_begin(self, model: Any, args: Any, kwargs: Any) -> None:
        self._started = self._capturing  # the capture counts from the root's forward
        if self._in_optimizer:
            self._in_model += 1

    def on_forward_end(self, model: Any) -> None:
        if self._in_optimizer and self._in_model:
            self._in_model -= 1

    def on_backward_begin(self, loss: Any) -> None:
        if self._in_optimizer:
            self._in_model += 1

    def on_backward_end(self) -> None:
        if self._in_optimizer and self._in_model:
            self._in_model -= 1

    def on_optimizer_step_begin(self, optimizer: Any) -> None:
        self._in_optimizer += 1

    def on_optimizer_step_end(self, optimizer: Any) -> None:
        self._in_optimizer = max(0, self._in_optimizer - 1)
        if not self._in_optimizer:
            self._in_model = 0

    def on_autocast(self, device: str, dtype: str | None, enabled: bool) -> None:
        if not self._capturing:
            return
        stack = getattr(self._local, "stack", None) or [dict(self._seed)]
        top = dict(stack[-1])
        top[device] = ("enabled", dtype) if enabled else ("disabled", None)
        stack.append(top)
        self._local.stack = stack

    def on_autocast_exit(self, device: str) -> None:
        stack = getattr(self._local, "stack", None)
        if self._capturing and stack and len(stack) > 1:
            stack.pop()

    def on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self._started:
            try:
                self._observe(func, args, kwargs, out)
            except Exception as exc:  # loses this capture only (recorded at its end)
                self._capture_error = exc

    def on_step_end(self, step: int, record: dict[str, Any], facts: StepFacts) -> None:
        if self._capturing:
            self._finish(step)

    def on_flush(self, writer: Any) -> None:
        rows, self._rows = self._rows, []
        tables: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in rows:
            tables[row.pop("_table")].append(row)
        for table, part in tables.items():
            writer.append(table, part)

    def on_close(self) -> None:
        if self._capturing:
            with contextlib.suppress(Exception):
                self._stop()

    # -- capture -------------------------------------------------------------------------------
    def _start(self, step: int) -> None:
        self._capturing = True
        self._started = not self._roots  # no model known: count from the step's start
        self._capture_step = step
        self._in_optimizer = self._in_model = 0  # detail events are delivered from here on
        self._t_start = time.perf_counter()
        self._ops: dict[tuple[Any, ...], list[float]] = {}
        self._other_ops = 0
        self._other_bytes = 0
        self._opt_bytes = 0
        self._capture_error = None
        # autograd node -> module of the forward op that made it (held until the capture ends)
        self._node_modules: dict[Any, str] = {}
        self._pending: list[tuple[torch.Tensor, str]] = []  # outputs whose grad_fn is not set yet
        self._seed_autocast()
        self._turns = {}

    def on_compiled_graph(self, facts: dict[str, Any]) -> None:
        # no module hook runs inside a compiled region: the ops it runs are named from the
        # graphs dynamo compiled (module per GEMM shape, in graph order)
        for op in facts.get("ops", ()):
            for backward in (False, True):
                key = _signature(op["kind"], op.get("m"), op.get("n"), op.get("k"), backward)
                if key is not None:
                    self._compiled_modules.setdefault(key, []).append(op["module"] or "")

    def _compiled_module(self, name: str, dims: dict[str, Any], backward: bool) -> str:
        """The module of an op run by compiled code: from the compiled graphs' GEMM shapes.

        Layers of equal shapes (a transformer's blocks) take turns in graph order (reversed in
        backward): their shapes and FLOPs are equal, so what is booked per layer is exact."""
        kind = "conv" if name in CONV_OPS else "attention" if is_attention_op(name) else "linear"
        key = _signature(kind, dims.get("m"), dims.get("n"), dims.get("k"), backward)
        modules = self._compiled_modules.get(key) if key is not None else None
        root = self._root_name()
        if not modules:
            return root
        turn = (key, backward)
        i = self._turns.get(turn, 0)
        self._turns[turn] = i + 1
        i %= len(modules)
        return modules[len(modules) - 1 - i if backward else i] or root

    def _stop(self) -> None:
        self._capturing = False
        self._started = False
        self._node_modules = {}
        self._pending = []

    def _finish(self, step: int) -> None:
        self._stop()
        self._captures += 1
        if self._capture_error is not None:
            exc = self._capture_error
            self.probe.event(
                "compute_capture_error", step=step, error=f"{type(exc).__name__}: {exc}"
            )
            return
        total = 0.0
        count = 0
        for key, (n, flops) in self._ops.items():
            module, op, phase, dims, in_dtype, out_dtype, state, ac_dtype = key
            row = {
                "_table": "compute_ops",
                "step": step,
                "module": module,
                "op": op,
                "phase": phase,
                **dict(dims),
                "in_dtype": in_dtype,
                "out_dtype": out_dtype,
                "autocast": state,
                "autocast_dtype": ac_dtype,
                "count": int(n),
                "flops": float(flops) if not math.isnan(flops) else None,
            }
            self._rows.append(row)
            total += 0.0 if math.isnan(flops) else flops
            count += int(n)
        self._rows.append(
            {
                "_table": "compute_steps",
                "step": step,
                "matmul_flops": total,
                "matmul_ops": count,
                "other_ops": self._other_ops,
                "other_bytes": self._other_bytes,
                "optimizer_bytes": self._opt_bytes,
                "tf32": _tf32_enabled(),
                "capture_s": time.perf_counter() - self._t_start,
            }
        )

    # -- autocast state: not visible inside the dispatch mode (the key is excluded there) --------
    def _seed_autocast(self) -> None:
        state: dict[str, tuple[str, str | None]] = {}
        for dev in ("cpu", "cuda"):
            with contextlib.suppress(Exception):
                if torch.is_autocast_enabled(dev):
                    state[dev] = ("enabled", dtype_name(torch.get_autocast_dtype(dev)))
        self._seed = state
        self._local.stack = [dict(state)]

    def _autocast_state(self, device: str) -> tuple[str, str | None]:
        stack = getattr(self._local, "stack", None) or [self._seed]
        return stack[-1].get(device, ("outside", None))

    # -- per-op work (inside the dispatch mode) --------------------------------------------------
    def _observe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self._pending:
            self._note_nodes()
        packet = func._overloadpacket
        name = packet.__name__
        stack = self._stack
        tracking = stack.active
        phase = "forward"
        if torch._C._current_graph_task_id() != -1:
            phase = "recompute" if tracking and stack.forward_depth else "backward"
        matmul = name in GEMM_OPS or name in CONV_OPS or is_attention_op(name)
        free = name in _FREE_OPS or func.is_view
        module = None
        if phase != "backward" and tracking and (matmul or not free):
            module = self._module()
            # autograd sets the output's grad_fn once this op returns: read it at the next op
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(first, torch.Tensor):
                self._pending.append((first, module))
        if matmul:
            self._record_op(packet, name, args, kwargs, out, phase, module)
            return
        if free:
            return
        moved = _nbytes(out)
        for a in args:
            moved += _nbytes(a)
        with self._lock:
            if self._in_optimizer and not self._in_model:
                self._opt_bytes += moved
            else:
                self._other_ops += 1
                self._other_bytes += moved

    def _note_nodes(self) -> None:
        """Remember the autograd node of each pending forward output with its module."""
        nodes = self._node_modules
        for tensor, module in self._pending:
            node = tensor.grad_fn
            if node is not None and node not in nodes:
                nodes[node] = module
        self._pending = []

    def _backward_module(self) -> str:
        """The module of a backward op: the one whose forward op made the executing node."""
        if self._pending:
            self._note_nodes()
        node = torch._C._current_autograd_node()
        module = self._node_modules.get(node) if node is not None else None
        return module if module is not None else self._module()

    def _record_op(
        self,
        packet: Any,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        phase: str,
        module: str | None,
    ) -> None:
        backward = phase == "backward"
        dims = op_dims(name, args)
        operand = next(
            (
                a
                for a in (args[1:] if name in ("addmm", "baddbmm", "_addmm_activation") else args)
                if isinstance(a, torch.Tensor)
            ),
            None,
        )
        result = out[0] if isinstance(out, (tuple, list)) and out else out
        if name == "convolution_backward":
            result = next((o for o in out if isinstance(o, torch.Tensor)), None)
        device = operand.device.type if operand is not None else "cpu"
        if backward:
            state, ac_dtype = "backward", None
        else:
            state, ac_dtype = self._autocast_state(device)
        flops = _flops(packet, name, args, kwargs, out)
        if not self._stack.active and self.probe.hub.compile_in_use:
            module = self._compiled_module(name, dims, phase != "forward")
        elif backward:
            module = self._backward_module()
        elif module is None:
            module = self._module()
        key = (
            module,
            name,
            phase,
            tuple(sorted(dims.items())),
            _dtype(operand),
            _dtype(result),
            state,
            ac_dtype,
        )
        with self._lock:
            entry = self._ops.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += float("nan") if flops is None else flops

    def _module(self) -> str:
        stack = self._stack
        if not stack.active:
            return "(no module)"
        inner = stack.innermost()
        if inner is None:
            return self._root_name()
        if len(self._roots) > 1:
            return user_module_name(inner)  # names start with their root's name (root_name)
        for ref, root_name in self._roots:
            root = ref()
            # the stack names a root called inside a wrapper (an engine's module, such as
            # ``DeepSpeedEngine.module``) by the wrapper's path: strip that path too
            for prefix in (root_name, stack.name_of(root)):
                if not prefix:
                    continue
                if inner == prefix:  # FSDP2's generated FSDPNet is the user's Net
                    return self._root_name()
                if inner.startswith(prefix + "."):
                    return user_module_name(inner[len(prefix) + 1 :])
        return user_module_name(inner)

    def _root_name(self) -> str:
        """Where an op that ran in no known layer is booked: the (first) root model."""
        if not self._roots:
            return "(no module)"
        ref, cls = self._roots[0]
        model = ref()
        if model is None:
            return cls
        return self.probe.root_name(model) or user_class_name(model)


def _signature(kind: str, m: Any, n: Any, k: Any, backward: bool) -> tuple[Any, ...] | None:
    """How a compiled op is matched to its layer: a forward GEMM by its dimensions, a backward
    GEMM by their set (the input- and weight-gradient GEMMs permute the forward's M, N, K)."""
    if m is None or n is None or k is None:
        return None
    family = "attention" if kind == "attention" else "conv" if kind == "conv" else "gemm"
    dims = (int(m), int(n), int(k))
    if kind == "attention":  # its backward op carries the forward's shapes
        return (family, backward, *dims)
    return (family, backward, *(sorted(dims) if backward else dims))


def _tf32_enabled() -> bool:
    """Whether fp32 CUDA matmuls may run as TF32 (the setting, read without touching CUDA)."""
    with contextlib.suppress(Exception):
        return bool(torch.backends.cuda.matmul.allow_tf32)
    return False


def dims_json(row: dict[str, Any]) -> str:
    """A compact display of an op row's dimensions (used by reports)."""
    keys = ("batch", "m", "n", "k", "cin", "cout", "kernel")
    return json.dumps({k: row[k] for k in keys if row.get(k) is not None})
