"""Per-layer numerics: overflow, underflow and non-finite counts in activations and gradients.

On sampled steps (every ``numerics_every`` steps, plus the steps armed after something went
wrong) the collector installs hooks on the selected modules of every root model:

* a forward hook per module (the module's output, and whether its floating inputs were
  finite), which also registers ``out.register_hook`` for the gradient of that output (this
  survives a following in-place op, unlike ``register_full_backward_hook``);
* ``register_post_accumulate_grad_hook`` per parameter (the accumulated ``param.grad``);
* a forward pre-hook on each root model (its floating inputs).

Inside a ``torch.compile`` region (hooks installed before its first compiled call) the layers'
outputs are reduced in the graph by :mod:`~amprobe.capture.collectors.graphstats` (the same
counts and exponent histogram, read at the step's end) and their output gradients reach the
measurement below from the compiled backward through
:mod:`~amprobe.capture.collectors.gradtap`; both only on sampled steps (a graph variant).

Each tensor is reduced on its device by :mod:`amprobe.capture.collectors.numstats` with no
host-device sync: one histogram of its 16-bit magnitude patterns, folded once per step into a base-2
exponent histogram of the fp32 ``|x|`` plus exact-zero, NaN, fp16-overflow and fp16-flush
counts and the maximum. Gradients are measured as divided by the current loss scale (the GradScaler's
``_scale`` tensor, kept on device). Tables are read back at flush in one transfer. Hooks exist
only during sampled steps, so other steps pay nothing but the always-on check.

Always on: a forward pre-hook on the root models counts non-finite elements of their
floating inputs into a device counter, and the loss tensor recorded by the scaler collector is
checked for non-finite values. Both go into the step record. When they (or the scaler's
``found_inf``) show a problem, the next ``numerics_arm_steps`` steps are captured in full: at
once on CPU, where reading the flag costs no sync; on an accelerator when the flag is read at
the next flush. In a job of several ranks only an update the GradScaler skipped arms the
capture (every rank knows it on the host at the same step): a value one rank alone saw would
make it sample alone (``numerics_not_armed``, once; see :mod:`amprobe.capture.agree`).

Records:
    ``steps`` fields: ``input_nonfinite`` (non-finite elements in the root models' floating
    inputs, count), ``loss_nonfinite`` (the loss was inf/NaN, bool), ``numerics_sampled``.
    ``numerics`` table, one row per module, kind and sampled step: ``kind`` (``input``,
    ``output``, ``grad_output``, ``grad_param``; on budgeted samples with ``block_formats`` set,
    a matmul layer's GEMM operands ``gemm_input`` and ``gemm_weight``: see
    :mod:`~amprobe.capture.collectors.operands`, which also writes the ``blockstats`` table),
    ``dtype``, ``calls``, ``order`` (position of
    the first call in execution order of that kind in the step), ``elements``, ``zeros``,
    ``nan``, ``inf``, ``finite``. With ``v`` the recorded magnitude (``|x|`` in fp32; for
    gradients ``|x| / loss_scale``, divided in fp32): ``over_fp16`` (finite values that a real
    fp16 cast makes inf: ``v >= 65520``, the round-to-nearest boundary; 65504 < v < 65520
    rounds down to 65504), ``below_normal`` and ``below_subnormal`` (nonzero ``v < 2**-14`` =
    6.1e-5 and ``v < 2**-24`` = 5.96e-8: value thresholds, not what a cast flushes),
    ``underflow_at_scale`` (nonzero values that a real fp16 cast at the row's scale makes zero:
    ``fp16(v * s) == 0`` with ``v * s`` in fp32, i.e. ``v * s <= 2**-25``, the tie at 2**-25
    rounding to even, zero; ``s`` is the loss scale for gradients and 1 for other kinds, so
    values in ``(2**-25, 2**-24)`` are not counted: they round up to 2**-24), ``loss_scale``
    (scale the gradients were divided by; 1 without a scaler), ``amax`` (largest magnitude;
    null when NaN present), ``in_nonfinite`` (non-finite elements in the module's floating
    inputs), ``exp_hist`` (JSON object: base-2 exponent ``e`` -> count of ``v`` in
    ``[2**e, 2**(e+1))``; -127 also holds the zeros; -133 .. -128 are fp32 subnormal binades;
    -149 holds every nonzero value below 2**-133, whose binade is not resolved; 128 holds
    inf/NaN).
    ``offenders`` table: the first module (execution order) whose forward output was
    non-finite while its inputs were finite (``kind=forward``); the module whose backward
    first produced non-finite output gradients, i.e. the last module in backward order whose
    output gradient was still finite (``kind=backward``); non-finite root inputs
    (``kind=input``).

On CPU the per-tensor reduction is a compiled C kernel (``numkernel``: built once in a
subprocess started when the first CPU model is seen, cached per user), and the eager torch
reduction until it is ready or when it cannot be built (event ``numerics_kernel``, once, with
the reason); both record the same table.

Cost: nothing on unsampled steps beyond one reduction over the root inputs. On a sampled
step one pass per hooked tensor on CPU (the compiled kernel; eagerly, one elementwise and one
histogram pass, fp32 tensors adding a max reduction and two compare-and-count passes for the
exact fp16 boundaries), and one ``aminmax`` per module input not measured already; see
``benchmarks/bench_numerics_v2.py``.
"""

from __future__ import annotations

import fnmatch
import json
import math
import struct
import weakref
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch.amp import GradScaler
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from amprobe.capture.collectors import numkernel
from amprobe.capture.collectors.compiled import is_compiled_module, is_compiling, unwrap_compiled
from amprobe.capture.collectors.gradtap import grad_tap_hook
from amprobe.capture.collectors.graphstats import (
    GRAPH_SAMPLE,
    LayerSink,
    first_float,
    graph_stats_hook,
    layer_key,
    materialized_output,
    register_sink,
    unregister_sink,
)
from amprobe.capture.collectors.numstats import C_AMAX as _C_AMAX
from amprobe.capture.collectors.numstats import C_FLUSH16 as _C_FLUSH16
from amprobe.capture.collectors.numstats import C_IN_BAD as _C_IN_BAD
from amprobe.capture.collectors.numstats import C_NAN as _C_NAN
from amprobe.capture.collectors.numstats import C_OVER16 as _C_OVER16
from amprobe.capture.collectors.numstats import C_ZEROS as _C_ZEROS
from amprobe.capture.collectors.numstats import E_MIN as _E_MIN
from amprobe.capture.collectors.numstats import H0 as _H0
from amprobe.capture.collectors.numstats import H_NONFINITE as _H_NONFINITE
from amprobe.capture.collectors.numstats import NBINS as _NBINS
from amprobe.capture.collectors.numstats import (
    SPARSE_LAYOUTS,
    StepStats,
    count_nonfinite,
    counts_from_hist,
)
from amprobe.capture.collectors.operands import OPERAND_KINDS, GemmOperands
from amprobe.capture.collectors.sharded import (
    PLAIN_TENSORS,
    local_tensor,
    user_class_name,
    user_model,
    user_module_name,
    wrapped_module,
)
from amprobe.capture.protocol import Collector, StepFacts
from amprobe.store.fields import Field, fields_of

__all__ = [
    "NumericsCollector",
    "FP16_MAX",
    "FP16_MIN_NORMAL",
    "FP16_MIN_SUBNORMAL",
    "summarize_hist",
]

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14  # 6.1e-5
FP16_MIN_SUBNORMAL = 2.0**-24  # 5.96e-8
# histogram positions (exponent - E_MIN) of the value thresholds: below 2**-14 (fp16's min
# normal), below 2**-24 (its min subnormal)
_MAX_INPUTS = 8  # floating inputs per root model given their own slot
KINDS = ("input", "output", "grad_output", "grad_param", *OPERAND_KINDS)
#: kinds that are not a layer's own values (root inputs; a matmul's operands, which are other
#: layers' outputs and parameters): not counted as a layer that held inf/NaN
_NOT_OWN = ("input", *OPERAND_KINDS)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def summarize_hist(row: Iterable[int]) -> dict[str, int]:
    """The fp16 range counts of one row of the statistics table (see ``numstats``).

    Args:
        row: the ``K`` counts of a slot: zeros, NaN, the fp16-overflow and fp16-flush counts
            (real-cast boundaries, inf and zeros included) and the exponent histogram.

    Returns:
        ``over_fp16`` (finite values a real fp16 cast makes inf: ``|v| >= 65520``),
        ``below_normal`` / ``below_subnormal`` (nonzero ``|v| < 2**-14`` / ``< 2**-24``) and
        ``underflow_at_scale`` (nonzero values a real fp16 cast at the row's scale makes zero:
        ``fp16(v * scale) == 0``, i.e. ``|v| * scale <= 2**-25``).
    """
    r = list(row)
    zeros = r[_C_ZEROS]
    read = counts_from_hist(r[_H0 : _H0 + _NBINS], zeros, r[_C_NAN])
    return {
        "over_fp16": r[_C_OVER16] - read["inf"],
        "below_normal": read["below_normal"],
        "below_subnormal": read["below_subnormal"],
        "underflow_at_scale": r[_C_FLUSH16] - zeros,
    }


class _Slot:
    __slots__ = ("index", "name", "module_type", "kind", "root", "container")

    def __init__(
        self, index: int, name: str, module_type: str, kind: str, root: int, container: bool
    ) -> None:
        self.index = index
        self.name = name
        self.module_type = module_type
        self.kind = kind
        self.root = root
        #: the output of a module with children and no parameters of its own: measured on
        #: eager sampled steps only to find the first non-finite output (its own code between
        #: its children produced it); no row of its own in the ``numerics`` table
        self.container = container


class _Capture:
    """One sampled step: its device statistics and the host-side facts (order, dtypes, counts)."""

    __slots__ = (
        "step",
        "stats",
        "device",
        "table",
        "scale",
        "calls",
        "elements",
        "dtypes",
        "order",
        "bad_hint",
        "grad_hooked",
        "inputs_unread",
    )

    def __init__(self, step: int, stats: StepStats) -> None:
        self.step = step
        self.stats: StepStats | None = stats
        self.device = stats.device
        self.table: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.calls: dict[int, int] = {}
        self.elements: dict[int, int] = {}
        self.dtypes: dict[int, str] = {}
        self.order: dict[str, list[int]] = {k: [] for k in KINDS}
        self.bad_hint = False
        self.grad_hooked: set[int] = set()  # output-gradient slots hooked in this step
        #: output slots with a floating input whose values could not be read: not checked
        self.inputs_unread: set[int] = set()

    @property
    def buf(self) -> torch.Tensor:
        """The step's ``(slots, K)`` int64 table (see ``numstats``), folded on first use."""
        if self.table is None:
            assert self.stats is not None
            self.table = self.stats.table()
        return self.table

    def settle(self) -> StepStats | None:
        """Fold the table and give up the statistics buffers (returned for reuse)."""
        if self.stats is None:
            return None
        self.buf  # noqa: B018 - folds
        stats, self.stats = self.stats, None
        return stats


class NumericsCollector(Collector):
    """Per-module forward/gradient range statistics, first offenders and the non-finite check.

    See the module docstring for every recorded field and its units.
    """

    name = "numerics"
    samples = True  # on_step_begin decides its samples (skipped on quiet steps)
    fields: ClassVar[tuple[Field, ...]] = fields_of("numerics")
    # the scaler that divides the gradients, and the root models' inputs, matter on the steps
    # measured in full
    detail_events = frozenset({"on_scale", "on_forward_begin"})
    checks_inputs = True  # the hub counts the inputs' non-finite elements on every step

    def on_attach(self, probe: Any) -> None:
        super().on_attach(probe)
        cfg = probe.config
        self.every, fixed = cfg.sample_period("numerics_every")
        probe.budget.register("numerics", self.every, fixed=fixed)
        self.patterns: tuple[str, ...] = tuple(cfg.numerics_layers)
        self.arm_steps: int = cfg.numerics_arm_steps
        self._slots: list[_Slot] = []
        self._module_slots: dict[
            int, tuple[int, int | None, int | None]
        ] = {}  # id -> out, gout, gparam
        self._input_slots: dict[int, list[int]] = {}
        self._roots: list[tuple[weakref.ReferenceType[torch.nn.Module], int]] = []
        self._targets: list[
            tuple[weakref.ReferenceType[torch.nn.Module], tuple[int, int | None, int | None]]
        ] = []
        self._containers: list[tuple[weakref.ReferenceType[torch.nn.Module], int]] = []
        self._params: list[tuple[weakref.ReferenceType[torch.nn.Parameter], int]] = []
        self._capture_handles: list[Any] = []
        self._armed_until = -1
        self._local_noted = False  # several ranks: a rank-local non-finite value did not arm
        self._sampled_now = False  # this step is measured in full (asked in on_step_begin)
        self._cur: _Capture | None = None
        self._done: list[_Capture] = []
        self._pool: list[StepStats] = []
        self._device: torch.device | None = None
        self._ones: torch.Tensor | None = None
        self._watch: list[dict[str, Any]] = []
        # CUDA: (step, pinned host flag, event) copies in flight; read once the event has passed
        self._in_flight: list[tuple[int, torch.Tensor, Any]] = []
        self._scaler: weakref.ReferenceType[GradScaler] | None = None
        self._nonfinite_modules: set[str] = set()
        # armed steps: (step, parameter names, device flags "holds inf/NaN") not read yet
        self._weight_checks: list[tuple[int, list[str], torch.Tensor]] = []
        self._compiled_noted = False
        self._kernel_noted = False
        self._unmeasured_noted: set[str] = set()  # kinds of tensor skipped (one event each)
        # compiled regions: permanent hooks traced into the graph that hand sampled steps'
        # values to this sink (see graphstats, gradtap)
        self._sink: int | None = None
        self._graph_handles: list[Any] = []
        self._graph_hooked: set[int] = set()  # output slots with an in-graph hook
        self._fused_noted = False
        # matmul layers' GEMM operands and their block statistics (budgeted samples only)
        self._operands = GemmOperands(self, cfg.block_formats)

    # -- set-up ---------------------------------------------------------------------------------
    def on_scaler(self, scaler: GradScaler, site: str | None) -> None:
        if self._scaler is None and getattr(scaler, "_enabled", False):
            self._scaler = weakref.ref(scaler)

    def on_scale(self, scaler: GradScaler, loss: torch.Tensor | None) -> None:
        if getattr(scaler, "_enabled", False):  # the scaler in use divides this step's grads
            current = self._scaler() if self._scaler is not None else None
            if current is not scaler:
                self._scaler = weakref.ref(scaler)

    def _selected(self, name: str) -> bool:
        return not self.patterns or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def _new_slot(
        self, name: str, module_type: str, kind: str, root: int, container: bool = False
    ) -> int:
        slot = _Slot(len(self._slots), name, module_type, kind, root, container)
        self._slots.append(slot)
        return slot.index

    def on_model(self, model: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            return
        root = len(self._roots)
        self._roots.append((weakref.ref(model), root))
        if self._device is None:
            for p in model.parameters():
                self._device = p.device
                break
            if self._device is not None and self._device.type == "cpu":
                # compiled beside the first step, not inside it: the hub's input check of every
                # step uses it too (numerics_every=0 included)
                numkernel.start_build()
        # names as written: from the user's model inside its wrappers (DDP, torch.compile)
        inner = user_model(model)
        self._input_slots[root] = [
            self._new_slot(f"<input {root}>[{i}]", user_class_name(model), "input", root)
            for i in range(_MAX_INPUTS)
        ]
        self._operands.discover(model, inner, self._selected)  # before add(): attention
        for name, mod in inner.named_modules():
            if id(mod) in self._module_slots:
                continue
            own = list(mod.parameters(recurse=False))
            if not own and wrapped_module(mod) is not None:
                continue  # a wrapper inside the model (a compiled block): its module has the name
            is_leaf = next(iter(mod.children()), None) is None
            label = user_module_name(name) or "<root>"  # as written: no wrapper segments
            if not self._selected(label):
                continue
            mtype = user_class_name(mod)
            if not (is_leaf or own):
                # a container: its own code between its children (attention scores and softmax
                # written as tensor ops, a loss computed in the root's forward) can be where the
                # first inf/NaN appears; its output is checked on eager sampled steps
                out = self._new_slot(label, mtype, "output", root, container=True)
                self._module_slots[id(mod)] = (out, None, None)
                self._containers.append((weakref.ref(mod), out))
                continue
            out = self._new_slot(label, mtype, "output", root)
            gout = self._new_slot(label, mtype, "grad_output", root)
            gparam = (
                self._new_slot(label, mtype, "grad_param", root)
                if any(p.requires_grad for p in own)
                else None
            )
            slots = (out, gout, gparam)
            self._module_slots[id(mod)] = slots
            self._operands.add(mod, label, mtype, root, slots)
            self._targets.append((weakref.ref(mod), slots))
            if gparam is not None:
                for p in own:
                    if p.requires_grad:
                        self._params.append((weakref.ref(p), gparam))
        cap = self._cur
        if cap is not None and cap.stats is not None:  # a root found in the middle of a step
            cap.stats.grow(len(self._slots))
        if self.probe.hub.compile_in_use:
            self._install_graph_hooks()
        if self._sampled(self.probe.step):
            if self._capture_handles:  # a capture in progress: hook the new root's modules too
                self._remove_capture()
            self._install_capture()
            self._sampled_now = True
            self._operands.begin(self.probe.step, self._budgeted(self.probe.step))
        self._live_step_end()  # the device is known: on CPU, nothing at unsampled steps' ends

    def _layer_name(self, slot: _Slot) -> str:
        """A slot's layer name: its path in its root model, prefixed with the root's name when
        several root models are watched (see :meth:`amprobe.capture.probe.Probe.root_name`)."""
        if slot.kind == "input" or len(self._roots) < 2:
            return slot.name
        model = self._roots[slot.root][0]()
        root = self.probe.root_name(model) if model is not None else None
        if root is None:
            return slot.name
        return root if slot.name == "<root>" else f"{root}.{slot.name}"

    # -- compiled regions: statistics inside the graph ------------------------------------------
    def _install_graph_hooks(self) -> None:
        """Compiled regions: permanent forward hooks that, on sampled steps, hand each layer's
        output and inputs to ``amprobe::layer_stats`` and route its output gradient through
        ``amprobe::grad_tap`` (two graph variants per compiled code object, each compiled once;
        see graphstats, gradtap); at run time both reach the eager measurement below. Under a
        fusing backend (inductor) a layer whose output the graph does not store (not a matmul
        or convolution layer) is measured only where it runs eagerly: reading it inside a
        compiled region would change what the model computes, so there it is "not checked"
        (one event). Containers get an eager-only check of their own code, as on eager steps."""
        if self.every == 0 or self.probe.hub.compiled_before_attach:
            return  # (a late attach: adding hooks would recompile the graphs that run)
        if self._sink is None:
            self._sink = register_sink(
                LayerSink(self._guarded(self._graph_forward), self._guarded(self._graph_grad))
            )
        watch = self.probe.hub.compile
        fusing = watch.fusing()
        compiled = watch.compiled_modules()
        # ids of the modules inside a compiled module (None: a function was compiled, and a
        # compiled train step may run any module inside its graph)
        inside = None if watch.functions else {id(m) for c in compiled for m in c.modules()}
        # a compiled root's own hooks run around its compiled frame, not inside it: not in the
        # graph; nor a compiled module's own (block.compile(): its _call_impl calls them under the
        # compile context, where dynamo compiles each as a frame of its own)
        roots = {
            id(unwrap_compiled(root))
            for ref, _ in self._roots
            if (root := ref()) is not None and is_compiled_module(root)
        }
        roots.update(id(m) for m in compiled)
        skipped: list[str] = []
        for ref, slots in self._targets:
            mod = ref()
            if mod is None or slots[0] in self._graph_hooked or id(mod) in roots:
                continue
            eager_only = fusing and not materialized_output(mod)
            if eager_only and (inside is None or id(mod) in inside):
                skipped.append(self._slots[slots[0]].name)
            key = layer_key(self._sink, slots[0])
            hook = graph_stats_hook(key, eager_only)
            self._graph_handles.append(mod.register_forward_hook(hook))
            self._graph_hooked.add(slots[0])
            if slots[1] is not None:
                gkey = layer_key(self._sink, slots[1])
                tap = grad_tap_hook(gkey, eager_only)
                self._graph_handles.append(mod.register_forward_hook(tap))
        fwd = self._guarded(self._on_forward)
        for ref, out in self._containers:
            mod = ref()
            if mod is None or out in self._graph_hooked or id(mod) in roots:
                continue
            hook = self._bind_container(fwd, (out, None, None), permanent=True)
            self._graph_handles.append(mod.register_forward_hook(hook, with_kwargs=True))
            self._graph_hooked.add(out)
        if skipped:
            self._note_fused(skipped, inside is None)
        GRAPH_SAMPLE.on = bool(self._graph_hooked) and self._sampled(self.probe.step)

    def _note_fused(self, names: list[str], maybe: bool) -> None:
        if self._fused_noted:
            return
        self._fused_noted = True
        where = (
            "that run inside a compiled function"
            if maybe
            else f"inside compiled modules (first: {names[0]})"
        )
        self.probe.event(
            "numerics_not_checked",
            what="fused_activations",
            layers=len(names),
            first_at=names[0],
            reason=(
                f"not checked under inductor: the outputs of {len(names)} layer(s) {where} are "
                "fused into the kernels that read them and never stored; reading them would "
                "make the compiler store and round them, so the model would compute different "
                "numbers on sampled steps. Matmul and convolution layers are measured (the "
                "graph stores their outputs), and so are parameter gradients and layers that "
                "run eagerly; run a diagnostic job uncompiled or with backend='aot_eager' to "
                "see every layer"
            ),
            step=self.probe.step,
        )

    def _graph_forward(
        self, slot: int, x: torch.Tensor, inputs: list[torch.Tensor], unread: int
    ) -> None:
        """``amprobe::layer_stats`` at run time: a compiled layer's output, measured as an
        eager layer's (its inputs' non-finite count beside it)."""
        # a matmul's X and W (budgeted samples); positional inputs only (kwargs unknown: None)
        self._operands.forward(slot, tuple(inputs), None, unread)
        self._on_forward((slot, None, None), tuple(inputs), x, unread=unread)

    def _graph_grad(self, slot: int, grad: torch.Tensor) -> None:
        """``amprobe::grad_tap`` at run time: a compiled layer's output gradient."""
        self._measure(slot, grad, grad=True)
        self._operands.grad(slot, grad)

    # -- sampling ------------------------------------------------------------------------------
    def _sampled(self, step: int) -> bool:
        """Whether ``step`` is measured in full: armed by a problem, or due (the budget
        spaces the default schedule; see :mod:`amprobe.capture.budget`)."""
        if not self.probe.recording or not self._roots:
            return False  # no model known yet (discovery): the first sample waits for one
        if step <= self._armed_until and self.probe.budget.take_armed("numerics", step):
            return True
        return bool(self.probe.budget.due("numerics", step))

    def _budgeted(self, step: int) -> bool:
        """Whether a sampled ``step`` is a budgeted (periodic) sample, not one a problem armed:
        the GEMM operands' block statistics are taken on those only."""
        armed = step <= self._armed_until and self.probe.budget.take_armed("numerics", step)
        return not armed

    def _guarded(self, fn: Any) -> Any:
        return self.probe.hub.guard(self, fn)

    def _install_capture(self) -> None:
        if self._capture_handles:
            return
        fwd = self._guarded(self._on_forward)
        if self.probe.hub.compile_in_use:
            # an eager forward hook inside a compiled region is traced by dynamo: graph breaks,
            # recompiles, a changed fusion. Outputs are measured by the in-graph hooks
            # (graphstats), output gradients through their taps (gradtap), parameter gradients
            # outside the graph below.
            if self.probe.hub.compiled_before_attach:
                self._note_compiled()
        else:
            for ref, slots in self._targets:
                mod = ref()
                if mod is not None:
                    self._capture_handles.append(mod.register_forward_hook(self._bind(fwd, slots)))
            for ref, out in self._containers:
                mod = ref()
                if mod is not None:
                    hook = self._bind_container(fwd, (out, None, None))
                    self._capture_handles.append(mod.register_forward_hook(hook, with_kwargs=True))
            self._operands.install(self._capture_handles, self._guarded)
        for pref, slot in self._params:
            p = pref()
            if p is not None:
                self._capture_handles.append(
                    p.register_post_accumulate_grad_hook(self._guarded(self._bind_param(slot)))
                )

    def _note_compiled(self) -> None:
        if self._compiled_noted:
            return
        self._compiled_noted = True
        self.probe.event(
            "numerics_not_checked",
            what="activations",
            reason=(
                "compiled region: per-layer outputs and output gradients are not measured "
                "inside a torch.compile'd model or function that ran before amprobe attached "
                "(a hook added now would recompile the graphs that run); parameter gradients "
                "are measured. To see activations, attach before the first compiled call "
                "(amprobe run does), or run a diagnostic job uncompiled "
                "(torch.compiler.set_stance('force_eager'))"
            ),
            step=self.probe.step,
        )

    def _note_kernel(self) -> None:
        """Record once why the compiled CPU kernel is not used (the eager reduction runs
        instead and records the same table)."""
        if self._kernel_noted:
            return
        state = numkernel.status()
        if state in ("ready", "building"):
            self._kernel_noted = state == "ready"
            return
        self._kernel_noted = True
        self.probe.event("numerics_kernel", status="eager fallback", reason=state)

    def on_compile(self) -> None:
        if self._capture_handles:  # installed before the compile was seen: drop the module hooks
            self._remove_capture()
            self._install_capture()
        self._install_graph_hooks()

    @staticmethod
    def _bind(fn: Any, slots: tuple[int, int | None, int | None]) -> Any:
        def hook(mod: torch.nn.Module, args: Any, out: Any) -> None:
            # traced by dynamo (a train step compiled before amprobe knew): leave the graph as
            # it is; the hooks go once compile is seen at the step boundary
            if not is_compiling():
                fn(slots, args, out)

        return hook

    @staticmethod
    def _bind_container(
        fn: Any, slots: tuple[int, int | None, int | None], permanent: bool = False
    ) -> Any:
        """As :meth:`_bind`, for a container: its keyword inputs count as inputs too (a
        Hugging Face block is called with ``hidden_states=...``), so that one whose inputs were
        already non-finite is never named the first to produce inf/NaN. ``permanent``: left
        installed while compile is in use, it measures on sampled steps only, and only where
        the container runs eagerly (traced by dynamo it returns at once)."""

        def hook(mod: torch.nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            if permanent and not GRAPH_SAMPLE.on:
                return
            if not is_compiling():
                fn(slots, (*args, *kwargs.values()) if kwargs else args, out)

        return hook

    def _bind_param(self, slot: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                self._measure(slot, p.grad, grad=True)

        return hook

    def _remove_capture(self) -> None:
        for handle in self._capture_handles:
            handle.remove()
        self._capture_handles.clear()

    # -- measurement (hot path of sampled steps) --------------------------------------------------
    def _capture(self, device: torch.device) -> _Capture:
        cap = self._cur
        if cap is None or cap.step != self.probe.step:
            stats = self._pool.pop() if self._pool else None
            sync_free = self._sync_free()
            if (
                stats is None
                or stats.device != device
                or stats.slots != len(self._slots)
                or stats.sync_free != sync_free
            ):
                if device.type == "cpu" and self.every:
                    numkernel.start_build()  # (once per process; a model found late)
                stats = StepStats(len(self._slots), device, sync_free=sync_free)
            cap = _Capture(self.probe.step, stats)
            self._cur = cap
        return cap

    def _job_device(self) -> torch.device | None:
        """The probe's device, which the hub's input check uses too (else the first model's)."""
        return self.probe.device if self.probe.device is not None else self._device

    def _sync_free(self) -> bool:
        """Read no value back unless the job runs on CPU (where reading costs no sync)."""
        device = self._job_device()
        return device is None or device.type != "cpu"

    def _own_values(self, x: torch.Tensor, slot: int | None) -> torch.Tensor | None:
        """``x`` as a strided tensor whose memory holds its values, or None when it has none
        (an event says so once per kind): a DTensor as its local shard; a tensor subclass
        backed by its own storage as a plain tensor over it. Not measured: a wrapper subclass
        (``_make_wrapper_subclass``: a float8 or NF4 tensor, torch's ``TwoTensor``), whose data
        pointer is null and whose values live in inner tensors it alone knows how to read; a
        sparse tensor (``Embedding(sparse=True)``'s gradient), which stores only its nonzero
        entries; a nested tensor (strided or jagged) and any other layout."""
        x = local_tensor(x)
        if type(x).__name__ == "AsyncCollectiveTensor":
            # a functional collective's result (RowwiseParallel's output; a DTensor's local
            # tensor with use_local_output=False): measured as the tensor it becomes once
            # waited on. Only sampled steps get here, where the next layer reads it anyway
            x = x.trigger_wait()  # type: ignore[attr-defined]
        if x.is_nested or x.layout is not torch.strided:
            if x.is_nested:
                kind, what = f"nested {x.layout}", "nested_tensors"
                why = f"a nested tensor ({x.layout}) keeps its components' values in a buffer"
            elif x.layout in SPARSE_LAYOUTS:
                # a sparse gradient: Embedding(sparse=True), EmbeddingBag
                kind, what = str(x.layout), "sparse_tensors"
                why = f"a sparse tensor ({x.layout}) stores only its nonzero entries"
            else:
                kind, what = str(x.layout), "other_layouts"
                why = f"a {x.layout} tensor keeps its values in a layout of its own"
            self._note_unmeasured(
                slot, what, kind, f"{why}, which the per-layer histogram does not take"
            )
            return None
        if type(x) in PLAIN_TENSORS:
            return x
        if is_traceable_wrapper_subclass(x) or (x.numel() and not x.data_ptr()):
            cls = type(x)
            self._note_unmeasured(
                slot,
                "subclass_tensors",
                f"{cls.__module__}.{cls.__qualname__}",
                f"{cls.__qualname__} is a wrapper tensor subclass: its values live in inner "
                "tensors only it can read",
            )
            return None
        with torch.no_grad():
            return x.as_subclass(torch.Tensor)

    def _note_unmeasured(self, slot: int | None, what: str, kind: str, why: str) -> None:
        """One ``numerics_not_checked`` event per kind of tensor the statistics skip."""
        if kind in self._unmeasured_noted:
            return
        self._unmeasured_noted.add(kind)
        where = self._layer_name(self._slots[slot]) if slot is not None else "a module input"
        self.probe.event(
            "numerics_not_checked",
            what=what,
            tensor_type=kind,
            first_at=where,
            reason=(
                f"{why}, so per-layer statistics skip tensors of this kind (first: {where}); "
                "other layers are measured"
            ),
            step=self.probe.step,
        )

    def _count_nonfinite(self, x: torch.Tensor) -> torch.Tensor | int | None:
        """Non-finite elements of a module input (reusing the step's measurement of it); None
        when its values cannot be read (a wrapper tensor subclass): not checked, never 0."""
        if x.layout is not torch.strided or x.is_nested:  # counted by what it stores
            return count_nonfinite(x, self._sync_free())
        own = self._own_values(x, None)
        if own is None:
            return None
        x = own
        cap = self._capture(x.device)
        if cap.stats is not None and cap.device == x.device:
            return cap.stats.count_nonfinite(x)
        return count_nonfinite(x, self._sync_free())

    def _recycle(self, cap: _Capture) -> None:
        stats = cap.settle()
        if stats is not None:
            self._pool.append(stats.reset())
            del self._pool[2:]

    def _measure(
        self,
        slot: int,
        x: torch.Tensor,
        grad: bool = False,
        in_bad: torch.Tensor | int | None = None,
    ) -> StepStats | None:
        """Measure ``x`` into ``slot``; the step's statistics it went into (None: not measured)."""
        # (a DTensor, FSDP2's, is measured as this rank's shard, where it lives)
        own = (
            x
            if type(x) in PLAIN_TENSORS and x.layout is torch.strided and not x.is_nested
            else self._own_values(x, slot)
        )
        if own is None:
            return None
        x = own
        if not x.is_floating_point() or x.numel() == 0:
            return None
        cap = self._capture(x.device)
        if cap.device != x.device or cap.stats is None:
            return None  # one device per capture (model parallel across devices is not measured)
        with torch.no_grad():
            scale = self._scale_tensor(cap) if grad else None
            cap.stats.add(slot, x, scale=scale, in_bad=in_bad)
        if slot not in cap.calls:
            cap.order[self._slots[slot].kind].append(slot)
            cap.dtypes[slot] = _dtype_name(x.dtype)
        cap.calls[slot] = cap.calls.get(slot, 0) + 1
        cap.elements[slot] = cap.elements.get(slot, 0) + x.numel()
        return cap.stats

    def _scale_tensor(self, cap: _Capture) -> torch.Tensor | None:
        if cap.scale is None:
            scaler = self._scaler() if self._scaler is not None else None
            scale = getattr(scaler, "_scale", None) if scaler is not None else None
            if isinstance(scale, torch.Tensor):  # an engine's scale may live on the CPU
                value = scale.detach().reshape(()).float()
                same = value.device == cap.device
                cap.scale = value.clone() if same else value.to(cap.device, non_blocking=True)
            else:
                cap.scale = torch.ones((), dtype=torch.float32, device=cap.device)
        return cap.scale

    def _on_forward(
        self, slots: tuple[int, int | None, int | None], args: Any, out: Any, unread: int = 0
    ) -> None:
        """A layer's output into its slot, and beside it the non-finite count of its floating
        inputs; an input whose values could not be read (``unread``, or one met here) marks
        the row's inputs "not checked" instead of counting it as finite."""
        tensor = first_float(out)
        if tensor is None:
            return
        gout = slots[1]
        if torch._C._current_graph_task_id() != -1:
            # a forward run during backward is activation checkpointing recomputing it: its
            # values were measured in the forward pass. Only the output gradient is taken
            # here, when the forward made no graph to hook (reentrant checkpointing)
            cap = self._capture(tensor.device)
            if gout is not None and tensor.requires_grad and gout not in cap.grad_hooked:
                cap.grad_hooked.add(gout)
                tensor.register_hook(self._guarded(self._bind_grad(gout)))
            return
        # the output first: an input that is the output (an identity, Dropout(p=0)) is then
        # counted from the histogram just taken instead of another pass
        measured = self._measure(slots[0], tensor)
        bad: torch.Tensor | int | None = None
        for arg in args if isinstance(args, tuple) else (args,):
            if (
                isinstance(arg, torch.Tensor)
                and arg.is_floating_point()
                and arg.device == tensor.device
            ):
                count = self._count_nonfinite(arg)
                if count is None:
                    unread += 1
                    continue
                bad = count if bad is None else bad + count
        if unread and measured is not None:
            self._capture(tensor.device).inputs_unread.add(slots[0])
        if measured is not None:
            if bad is None:
                bad = torch.zeros((), dtype=torch.int64, device=tensor.device)
            measured.add_in_bad(slots[0], bad)
        if gout is not None and tensor.requires_grad:
            self._capture(tensor.device).grad_hooked.add(gout)
            tensor.register_hook(self._guarded(self._bind_grad(gout)))

    def _bind_grad(self, slot: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._measure(slot, grad, grad=True)
            self._operands.grad(slot, grad)

        return hook

    def on_forward_begin(self, model: torch.nn.Module, args: Any, kwargs: Any) -> None:
        """On the steps measured in full: the root model's floating inputs into their slots
        (their non-finite count on every step is the hub's, ``StepFacts.input_nonfinite``)."""
        if not self._capture_handles:
            return
        root = None
        for ref, r in self._roots:
            if ref() is model:
                root = r
                break
        if root is None:
            return
        slots = self._input_slots[root]
        i = 0
        for t in (*args, *kwargs.values()) if kwargs else args:
            if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
                continue
            if i >= _MAX_INPUTS:
                break
            self._measure(slots[i], t)  # (a DTensor is measured as its local shard)
            i += 1

    # -- step boundary ------------------------------------------------------------------------------
    def wants_detail(self, step: int) -> bool:
        return self._sampled_now

    def on_step_begin(self, step: int) -> None:
        self._sampled_now = sampled = self._sampled(step)
        self._live_step_end()
        GRAPH_SAMPLE.on = bool(self._graph_hooked) and sampled
        self._operands.begin(step, sampled and self._budgeted(step))
        if sampled:
            self._install_capture()
            if step <= self._armed_until:
                self._check_weights(step)
        elif self._capture_handles:
            self._remove_capture()

    def _check_weights(self, step: int) -> None:
        """Which hooked modules' own parameters hold inf/NaN as this armed step begins.

        After a bad step whose update was applied (no GradScaler to skip it, or a learning rate
        that diverges), the weights themselves are non-finite, and the first module to use them
        outputs NaN from finite inputs without overflowing anything: AMP-N05 must not blame it.
        One ``isfinite`` pass over the weights, on armed steps only; read at once on CPU, at the
        next flush elsewhere (no sync).
        """
        names: list[str] = []
        flags: list[torch.Tensor] = []
        with torch.no_grad():
            for ref, slots in self._targets:
                mod = ref()
                if mod is None:
                    continue
                label = self._layer_name(self._slots[slots[0]])
                for pname, p in mod.named_parameters(recurse=False):
                    if p.is_floating_point() and p.numel():
                        names.append(pname if label == "<root>" else f"{label}.{pname}")
                        flags.append(~torch.isfinite(local_tensor(p)).all())
            if not flags:
                return
            device = flags[0].device
            stacked = torch.stack([f.to(device, non_blocking=True) for f in flags])
        self._weight_checks.append((step, names, stacked))
        if device.type == "cpu":
            self._read_weight_checks()

    def _read_weight_checks(self) -> None:
        checks, self._weight_checks = self._weight_checks, []
        for step, names, flags in checks:
            bad = [name for name, flag in zip(names, flags.cpu().tolist(), strict=True) if flag]
            if bad:
                self.probe.event("nonfinite_weights", at_step=step, count=len(bad), params=bad[:10])

    def on_recording(self, active: bool) -> None:
        if not active:
            self._remove_capture()

    def _live_step_end(self) -> None:
        """Called at a step's end only when there is live work there: a step measured in
        full, or non-finite flags on an accelerator (or a device not known yet) to copy to the
        host; on CPU a non-finite step arms the capture through ``on_step_nonfinite``."""
        live = self._sampled_now or self._sync_free() or bool(self._in_flight)
        self.probe.hub.dispatch.mute(self, "on_step_end", muted=not live)

    def on_step_nonfinite(self, step: int, facts: StepFacts) -> None:
        if not self.probe.budget.several_ranks():
            self._arm(step)  # host values: the next steps are measured in full at once
        elif not facts.host_skipped():
            self._not_armed(step)  # (a skipped update arms every rank: on_step_bad)

    def on_step_bad(self, step: int, facts: StepFacts) -> None:
        """Several ranks: a GradScaler-skipped update arms the capture, a fact every rank
        knows on the host at the same step (the gradients were reduced before the scaler
        looked for inf/NaN in them; a sharded scaler reduces what it found). One process arms
        from its own values (:meth:`on_step_nonfinite`, the device flags).

        Assumed: the found-inf is reduced across every rank (DDP, FSDP2, ZeRO's scaler). Where
        it is not (one plain GradScaler per pipeline stage), a skip arms only the ranks of the
        stages that skipped: they take armed samples the others do not (a stall for the others
        at the next collective or transfer), and a rank other than 0 armed alone finds no plan
        of that step (it waits for it once, up to ``agree.TIMEOUT_S``, and decides alone until
        rank 0's next plan: :mod:`amprobe.capture.budget`). Armed steps are not carried in the
        plan, so nothing corrects it."""
        if facts.host_skipped() and self.probe.budget.several_ranks():
            self._arm(step)

    def _arm_local(self, step: int) -> None:
        """A non-finite value this rank alone knows of (a device flag read back): arms the
        capture in a single process only."""
        if not self.probe.budget.several_ranks():
            self._arm(step)
        elif step + 1 > self._armed_until:
            self._not_armed(step)

    def _not_armed(self, step: int) -> None:
        """Several ranks: a non-finite value only this rank saw does not arm (said once)."""
        if self.every == 0 or self._local_noted:
            return
        self._local_noted = True
        self.probe.event(
            "numerics_not_armed",
            at_step=step,
            reason=(
                "a non-finite value this rank alone saw (its loss, its inputs, or a device "
                "flag read back later) does not arm the per-layer capture in a job of several "
                "ranks: the ranks sample the same steps, and a sample on one rank alone stalls "
                "the others at the next collective. An update the GradScaler skipped arms it "
                "on every rank at once; the scheduled samples still run"
            ),
        )

    def on_step_end(self, step: int, record: dict[str, Any], facts: StepFacts) -> None:
        """Live (see :meth:`_live_step_end`): a sampled step's buffers, and on an accelerator
        the step's non-finite flags."""
        if self._capture_handles or GRAPH_SAMPLE.on:
            record["numerics_sampled"] = True
        GRAPH_SAMPLE.on = False  # (a forward between steps, an evaluation, is not sampled)
        self._operands.end()
        cap = self._cur
        if cap is not None:
            if cap.step == step:
                self._recycle(cap)  # fold now: the step's histograms are large; reuse buffers
                self._done.append(cap)
                if cap.device.type == "cpu":  # live count at once where reading costs no sync
                    self._note_nonfinite(cap)
                    self._note_kernel()
            self._cur = None
        if self._sync_free():
            # an accelerator's flags: read back at flush with the step records, and on CUDA
            # copied to pinned memory at once (no sync)
            flags: dict[str, Any] = {"step": step, "found_inf": facts.found_inf}
            if facts.input_nonfinite is not None:
                flags["input_nonfinite"] = facts.input_nonfinite
            loss_bad = _loss_nonfinite(facts.loss)
            if loss_bad is not None:
                flags["loss_nonfinite"] = record["loss_nonfinite"] = loss_bad
            self._watch.append(flags)
            device = self._job_device()
            if device is not None and device.type == "cuda":
                self._watch_async(step, flags)
        if self._in_flight:
            self._poll_in_flight()

    def on_step_fold(self, step: int, record: dict[str, Any], facts: StepFacts) -> None:
        record.setdefault("numerics_sampled", False)
        if facts.input_nonfinite is not None:
            record["input_nonfinite"] = facts.input_nonfinite
        if "loss_nonfinite" not in record:
            loss_bad = _loss_nonfinite(facts.loss)
            if loss_bad is not None:
                record["loss_nonfinite"] = loss_bad

    def _watch_async(self, step: int, record: dict[str, Any]) -> None:
        """Copy this step's "something is non-finite" flag to pinned host memory, no sync.

        The copy is queued behind the step's kernels; a CUDA event tells when it has landed, so
        a later step boundary arms the capture one or two steps after the problem instead of
        at the next flush.
        """
        flags = [
            v > 0
            for k in ("input_nonfinite", "found_inf")
            if isinstance(v := record.get(k), torch.Tensor)
        ]
        loss_bad = record.get("loss_nonfinite")
        if isinstance(loss_bad, torch.Tensor):
            flags.append(loss_bad)
        if not flags:
            return
        bad = flags[0].to(torch.bool)
        for flag in flags[1:]:
            bad = bad | flag.to(device=bad.device, dtype=torch.bool)
        host = _pinned_flag()
        host.copy_(bad, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._in_flight.append((step, host, event))

    def _poll_in_flight(self) -> None:
        """Arm for every landed flag that is set; ``Event.query`` never blocks."""
        pending = []
        for step, host, event in self._in_flight:
            if event.query():
                if bool(host):  # a pinned CPU tensor: reading it is no device sync
                    self._arm_local(step)
            else:
                pending.append((step, host, event))
        self._in_flight = pending[-64:]  # bounded even if the device falls far behind

    def _arm(self, step: int) -> None:
        if self.every == 0:  # per-layer samples are off: nothing to arm
            return
        if step + self.arm_steps > self._armed_until:
            self._armed_until = step + self.arm_steps
            self.probe.budget.arm(self._armed_until)  # the next steps are not quiet
            self.probe.event("numerics_armed", from_step=step + 1, until_step=self._armed_until)

    # -- flush ------------------------------------------------------------------------------------
    def on_flush(self, writer: Any) -> None:
        self._read_weight_checks()
        watch, self._watch = self._watch, []
        for flags in _to_host(watch):  # device flags: one transfer per device, at flush
            if _record_bad(flags):
                self._arm_local(int(flags["step"]))
        self._operands.flush(writer)
        done, self._done = self._done, []
        if not done:
            return
        with torch.no_grad():
            # a root model registered between captures adds slots: pad the earlier tables
            slots = max(c.buf.shape[0] for c in done)
            tables = [
                torch.nn.functional.pad(c.buf, (0, 0, 0, slots - c.buf.shape[0])) for c in done
            ]
            stacked = torch.stack(tables).cpu().tolist()
            with_scale = [c.scale for c in done if c.scale is not None]
            read = iter(torch.stack(with_scale).double().cpu().tolist() if with_scale else [])
            scales = [next(read) if c.scale is not None else 1.0 for c in done]
        rows: list[dict[str, Any]] = []
        offenders: list[dict[str, Any]] = []
        for cap, table, scale in zip(done, stacked, scales, strict=True):
            step_rows = self._rows(cap, table, scale)
            rows.extend(r for i, r in step_rows.items() if not self._slots[i].container)
            offenders.extend(self._offenders(cap, step_rows))
        self._nonfinite_modules.update(
            r["module"] for r in rows if r["nan"] + r["inf"] > 0 and r["kind"] not in _NOT_OWN
        )
        self.probe.publish("nonfinite_layers", len(self._nonfinite_modules))

        writer.append("numerics", rows)
        if offenders:
            writer.append("offenders", offenders)
            for o in offenders[:10]:
                self.probe.event(
                    "numerics_offender",
                    **{k: o[k] for k in ("kind", "module", "module_type")},
                    at_step=o["step"],
                )

    def _note_nonfinite(self, cap: _Capture) -> None:
        """Modules whose output or gradients held inf/NaN in this (CPU) step, for live metrics."""
        bad = (cap.buf[:, _H_NONFINITE] > 0).nonzero().flatten().tolist()  # inf and NaN
        self._nonfinite_modules.update(
            self._layer_name(self._slots[i])
            for i in bad
            if self._slots[i].kind not in _NOT_OWN and not self._slots[i].container
        )
        self.probe.publish("nonfinite_layers", len(self._nonfinite_modules))

    def _rows(
        self, cap: _Capture, table: list[list[int]], scale: float
    ) -> dict[int, dict[str, Any]]:
        rows: dict[int, dict[str, Any]] = {}
        for kind in KINDS:
            position = -1
            for index in cap.order[kind]:
                slot = self._slots[index]
                if not slot.container:  # a container's position: that of the layer before it
                    position += 1
                values = table[index]
                hist = values[_H0 : _H0 + _NBINS]
                zeros, nan = int(values[_C_ZEROS]), int(values[_C_NAN])
                inf = int(hist[-1]) - nan
                grad = kind.startswith("grad")
                counts = summarize_hist(values)
                amax_bits = int(values[_C_AMAX])
                elements = cap.elements[index]
                rows[index] = {
                    "step": cap.step,
                    "module": self._layer_name(slot),
                    "module_type": slot.module_type,
                    "kind": kind,
                    "dtype": cap.dtypes.get(index),
                    "calls": cap.calls.get(index, 0),
                    "order": max(position, 0),
                    "elements": elements,
                    "zeros": zeros,
                    "nan": nan,
                    "inf": inf,
                    "finite": elements - nan - inf,
                    **counts,
                    "loss_scale": scale if grad else None,
                    "amax": None if nan else _bits_to_float(amax_bits),
                    "in_nonfinite": (
                        int(values[_C_IN_BAD])
                        if kind == "output" and index not in cap.inputs_unread
                        else None
                    ),
                    "exp_hist": json.dumps(
                        {str(e + _E_MIN): int(n) for e, n in enumerate(hist) if n},
                        separators=(",", ":"),
                    ),
                }
        return rows

    def _offenders(self, cap: _Capture, rows: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []

        def bad(index: int) -> bool:
            r = rows.get(index)
            return r is not None and (r["nan"] + r["inf"]) > 0

        def row(kind: str, index: int, detail: dict[str, Any]) -> dict[str, Any]:
            slot = self._slots[index]
            return {
                "step": cap.step,
                "kind": kind,
                "module": self._layer_name(slot),
                "module_type": slot.module_type,
                "detail": json.dumps(detail, sort_keys=True),
            }

        for index in cap.order["input"]:
            if bad(index):
                r = rows[index]
                out.append(
                    row(
                        "input",
                        index,
                        {"nan": r["nan"], "inf": r["inf"], "elements": r["elements"]},
                    )
                )
        forward = cap.order["output"]
        for index in forward:
            if index in cap.inputs_unread:
                # inputs not checked: it cannot be named the first to produce inf/NaN, and
                # a later layer could only be named from a finite output of this one
                if bad(index):
                    break
                continue
            if bad(index) and not rows[index]["in_nonfinite"]:
                r = rows[index]
                out.append(
                    row(
                        "forward",
                        index,
                        {
                            "nan": r["nan"],
                            "inf": r["inf"],
                            "elements": r["elements"],
                            "order": r["order"],
                            # its children's outputs were finite: its own code made inf/NaN
                            **({"own_code": True} if self._slots[index].container else {}),
                        },
                    )
                )
                break
        backward = cap.order["grad_output"]
        first_bad = next((i for i, index in enumerate(backward) if bad(index)), None)
        if first_bad is not None:
            received = self._layer_name(self._slots[backward[first_bad]])
            if first_bad > 0:
                out.append(
                    row(
                        "backward",
                        backward[first_bad - 1],
                        {"first_nonfinite_grad_output": received, "order": first_bad - 1},
                    )
                )
            else:
                out.append(
                    {
                        "step": cap.step,
                        "kind": "backward",
                        "module": "<loss>",
                        "module_type": "loss",
                        "detail": json.dumps(
                            {"first_nonfinite_grad_output": received, "order": -1}
                        ),
                    }
                )
        return out

    def on_close(self) -> None:
        self._remove_capture()
        GRAPH_SAMPLE.on = False
        for handle in self._graph_handles:
            handle.remove()
        self._graph_handles.clear()
        if self._sink is not None:
            unregister_sink(self._sink)
            self._sink = None


def _to_host(watch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The flag tensors of the watched steps as Python values: one stacked copy per device."""
    out = [dict(flags) for flags in watch]
    by_device: dict[torch.device, list[tuple[dict[str, Any], str, torch.Tensor]]] = {}
    for flags in out:
        for key, value in flags.items():
            if isinstance(value, torch.Tensor):
                by_device.setdefault(value.device, []).append((flags, key, value))
    for items in by_device.values():
        values = torch.stack([v.detach().reshape(()).double() for _, _, v in items]).cpu().tolist()
        for (flags, key, _), value in zip(items, values, strict=True):
            flags[key] = value
    return out


def _pinned_flag() -> torch.Tensor:
    """A page-locked host bool, the target of a non-blocking device-to-host copy."""
    return torch.empty((), dtype=torch.bool, pin_memory=True)


def _loss_nonfinite(loss: Any) -> Any:
    """Whether the step's loss is non-finite: a bool for a host number, a device bool tensor
    otherwise (read back at flush), None when no loss was seen."""
    if type(loss) is float:
        return not math.isfinite(loss)
    if isinstance(loss, torch.Tensor):
        return ~torch.isfinite(loss).all()
    return None


def _record_bad(record: dict[str, Any]) -> bool:
    """A step's "something is non-finite" flags, read back (None: unknown)."""
    for key in ("input_nonfinite", "found_inf"):
        count = record.get(key)
        if count is not None and bool(count > 0):
            return True
    return bool(record.get("loss_nonfinite") or False)


def _bits_to_float(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0])
