"""The step boundary and the facts of the iteration in progress.

:class:`StepBoundary` (one per hub, ``hub.boundary``) decides where an iteration ends: the
``update()`` of the first GradScaler used (``"scaler"``), else an engine's own step
(``"source"``, DeepSpeed, Megatron-core), else the ``step()`` of the first optimizer that steps
(``"optimizer"``, not one an engine makes itself). It gathers the iteration's
:class:`~amprobe.capture.protocol.StepFacts` from the hub's wrappers (the loss that reaches
backward, unscaled; the scale before and after ``update()``; found-inf), closes the step with
the probe, and starts the next one: ``on_step_begin``, the module stack and the op mode on the
steps a collector asked for. It also keeps the optimizers and GradScalers seen.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.amp import GradScaler
from torch.optim import Optimizer

from amprobe.capture.collectors.engines import EngineScaler
from amprobe.capture.collectors.numstats import count_nonfinite
from amprobe.capture.collectors.sharded import PLAIN_TENSORS, local_tensor, user_class_name
from amprobe.capture.compilewatch import CompileWatch
from amprobe.capture.dispatch import Dispatcher
from amprobe.capture.install import ScalerMethods
from amprobe.capture.modules import ModuleStack
from amprobe.capture.opmode import OpMode
from amprobe.capture.phases import PhaseClock
from amprobe.capture.protocol import Collector, StepFacts
from amprobe.capture.sites import dtype_name, user_call_site
from amprobe.capture.sources import EngineSources

if TYPE_CHECKING:
    from amprobe.capture.discovery import RootModelFinder
    from amprobe.capture.probe import Probe

__all__ = ["StepBoundary", "host_value"]


def _unwrapped_scaler_step() -> tuple[bool, Any]:
    """Whether this runs inside a ``GradScaler.step`` that is not wrapped (entered before the
    hub patched it, in a live attach, or while the probe is dormant), and that call's scaler."""
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return False, None
        code = frame.f_code
        if code.co_name == "step" and code.co_filename.endswith("grad_scaler.py"):
            return True, frame.f_locals.get("self")
        frame = frame.f_back  # type: ignore[assignment]
    return False, None


def _host_scalar(t: torch.Tensor) -> Any:
    """A one-element tensor's value kept for the step record, at the least cost that adds no
    host-device sync: a Python number for a CPU tensor (``item()`` reads host memory, ~0.5 us,
    where a clone is a dispatched op, ~5 us), a detached device copy otherwise (read back at
    flush with the other device values, one transfer per device)."""
    if _on_host(t):
        return t.item()
    return t.detach().clone()


def host_value(value: Any) -> Any:
    """A one-element CPU tensor's value as a Python number or bool (no sync); anything else as
    it is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and _on_host(value):
        return value.item()
    return value


def _on_host(t: torch.Tensor) -> bool:
    """Reading ``t`` costs no host-device sync (a CPU tensor)."""
    return t.is_cpu


class StepBoundary:
    """Owns the step boundary and the facts of the iteration in progress.

    Attributes:
        facts: the shared facts of the iteration in progress.
        optimizers: every optimizer seen (weakly held).
        scalers: every GradScaler seen (weakly held).
        mode: what ends a step: ``"scaler"``, ``"source"`` (an engine), ``"optimizer"``, or
            None until the first one is seen.
    """

    def __init__(
        self,
        probe: Probe,
        dispatch: Dispatcher,
        ops: OpMode,
        modules: ModuleStack,
        compile_watch: CompileWatch,
        sources: EngineSources,
        scaler_methods: ScalerMethods,
        discovery: RootModelFinder,
    ) -> None:
        self.probe = probe
        self.dispatch = dispatch
        self.ops = ops
        self.modules = modules
        self.compile = compile_watch
        self.sources = sources
        self.scaler_methods = scaler_methods
        self.discovery = discovery
        self._emit = dispatch.emit
        self._subs = dispatch.subs  # event -> its subscribers now (rebuilt in place per key)
        self.facts = StepFacts()
        #: the forward/backward/optimizer phase clock (on when a collector asked for it, on
        #: detail steps)
        self.clock = PhaseClock()
        #: the step in progress records its details (``Config.details_every``, a sampled step,
        #: or the boundary not known yet): the wrappers that only gather details (autocast,
        #: ``unscale_``, ``GradScaler.step``, clipping, the optimizer pre-hook) return at once
        #: on other steps
        self.detail = True
        self._autocast_seen: set[tuple[str, str | None, bool]] = set()
        self._inputs_described: set[int] = set()  # root models whose inputs were described
        #: DataLoader iterators that returned a batch (``on_dataloader`` once each)
        self.iterators: weakref.WeakSet[Any] = weakref.WeakSet()
        # a collector asked for ops or detail events at the last step start (asked again now)
        self._asked = True
        self.optimizers: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self.scalers: weakref.WeakSet[GradScaler] = weakref.WeakSet()
        self.mode: str | None = None
        self._primary_scaler: weakref.ReferenceType[GradScaler] | None = None
        self._primary_used = False
        self._primary_opt: weakref.ReferenceType[Optimizer] | None = None
        #: depth of GradScaler.step calls running now, per thread (read by the wrapper)
        self.in_scaler_step = threading.local()
        self._scaled_this_step = False
        self._engine_scaled = False  # an engine announced this iteration's backward

    # -- objects --------------------------------------------------------------------------------
    def see_scaler(self, scaler: GradScaler, site: str | None) -> None:
        """A GradScaler is seen (created, used or passed to attach): ``on_scaler`` once."""
        if scaler in self.scalers:
            return
        self.scaler_methods.hook_class(type(scaler))
        self.scalers.add(scaler)
        self._emit("on_scaler", scaler, site)

    def see_optimizer(self, opt: Optimizer) -> None:
        """An optimizer is seen (created, stepped or passed to attach): ``on_optimizer`` once."""
        if opt in self.optimizers:
            return
        self.optimizers.add(opt)
        self.sources.load()
        self._emit("on_optimizer", opt)
        self.discovery.claim_compiled_roots()

    # -- the facts ------------------------------------------------------------------------------
    def _capture_loss(self, loss: torch.Tensor) -> None:
        """Add ``loss`` (a scalar backpropagated into ``.grad``, unscaled) to the step's loss."""
        facts = self.facts
        if facts.loss_dtype is None:
            facts.loss_dtype = dtype_name(loss.dtype)
        if self.probe.config.capture_loss:
            value = _host_scalar(loss)
            total = facts.loss
            if isinstance(value, torch.Tensor):  # on a device: summed there, read at flush
                value = value.reshape(()).float()
                if isinstance(total, torch.Tensor):
                    value = value.to(total.device, non_blocking=True)
            # a Python number and a tensor add into a tensor on the tensor's device
            facts.loss = value if total is None else total + value
            facts.loss_count += 1

    def on_scale(self, scaler: GradScaler, outputs: Any, result: Any = None) -> None:
        """``scaler.scale(outputs)`` returned ``result``."""
        primary = self._primary_scaler() if self._primary_scaler is not None else None
        if primary is scaler:
            self._primary_used = True
        if not self.probe.recording:
            return
        facts = self.facts
        if scaler not in facts.scalers_scaled:
            if primary is not scaler and scaler not in self.scalers:  # (the primary was seen)
                self.see_scaler(scaler, None)
            facts.scalers_scaled.append(scaler)
        if self.probe.t_step_start is None:
            self.probe.touch()
        self._scaled_this_step = True
        loss = outputs if isinstance(outputs, torch.Tensor) and outputs.numel() == 1 else None
        if loss is not None and isinstance(result, torch.Tensor):
            # not the step's loss yet: only what reaches torch.autograd.backward is (a scaled
            # loss given to torch.autograd.grad, as for a gradient penalty, never is)
            scale = getattr(scaler, "_scale", None) if getattr(scaler, "_enabled", False) else None
            # the loss itself, not a detached copy (a dispatched op): only read, never used
            facts.scaled.append((weakref.ref(result), loss, scale))
        if self._subs["on_scale"]:
            self._emit("on_scale", scaler, loss)

    def _unscaled(self, root: torch.Tensor) -> torch.Tensor:
        """The loss a backward root stands for: the ``scale()`` input it is the output of, the
        root divided by the last scale used when it was computed from a scaled loss, or the
        root itself when nothing was scaled in this iteration."""
        scaled = self.facts.scaled
        for ref, loss, _ in scaled:
            if ref() is root:
                return loss
        if not self._scaled_this_step:
            return root
        scale = scaled[-1][2] if scaled else None
        if not isinstance(scale, torch.Tensor):
            return root  # the scaler was disabled: scale() returned its input
        with torch.no_grad():
            return root.detach().float() / scale.to(root.device, non_blocking=True)

    def on_backward_begin(self, tensors: Any) -> None:
        """``torch.autograd.backward(tensors)`` starts: the step's loss, then the event."""
        if self.probe.t_step_start is None:
            self.probe.touch()
        roots = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
        for root in roots:
            if not (isinstance(root, torch.Tensor) and root.numel() == 1):
                continue
            if self._engine_scaled or (
                self.sources.sources and self.sources.recognizes_backward(root)
            ):
                continue  # the engine recorded this loss, unscaled, when it announced it
            self._capture_loss(self._unscaled(root))
        if self.clock.on:
            self.clock.begin("bwd")
        if self._subs["on_backward_begin"]:
            single = tensors if isinstance(tensors, torch.Tensor) and tensors.numel() == 1 else None
            self._emit("on_backward_begin", single)

    def on_backward_end(self) -> None:
        """``torch.autograd.backward`` returned (or raised)."""
        if self.clock.on:
            self.clock.end("bwd")
        if self._subs["on_backward_end"]:
            self._emit("on_backward_end")

    def on_forward_begin(self, model: torch.nn.Module, args: Any, kwargs: Any) -> None:
        """A root model's forward starts: its inputs' non-finite count (when asked), then the
        event."""
        if self.clock.on:
            self.clock.begin("fwd")
        if self.dispatch.checks_inputs:
            self._check_inputs(model, (*args, *kwargs.values()) if kwargs else args)
        if self._subs["on_forward_begin"]:
            self._emit("on_forward_begin", model, args, kwargs)

    def _check_inputs(self, model: torch.nn.Module, inputs: Any) -> None:
        """Add the non-finite elements of ``inputs`` (a root model's) to the step's facts: in
        the kernel on CPU (no dispatched op, read at once), else a device count read back at
        flush. Integer inputs (token ids) cannot be non-finite: a step that saw only those
        counts 0."""
        if id(model) not in self._inputs_described:
            self._describe_inputs(model, inputs)
        device = self.probe.device
        sync_free = device is None or device.type != "cpu"
        facts = self.facts
        bad = facts.input_nonfinite
        for t in inputs:
            if not isinstance(t, torch.Tensor):
                continue
            if bad is None:
                bad = 0
            if not t.is_floating_point():
                continue
            if type(t) not in PLAIN_TENSORS:
                t = local_tensor(t)
            # (a tensor off the host is never read back here, whatever the job's device says)
            bad = bad + count_nonfinite(t, sync_free or not t.is_cpu)
        facts.input_nonfinite = bad

    def _describe_inputs(self, model: torch.nn.Module, inputs: Any) -> None:
        """The ``model_inputs`` event, once per root model."""
        self._inputs_described.add(id(model))
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        floating = sum(1 for t in tensors if t.is_floating_point())
        self.probe.event(
            "model_inputs",
            root=user_class_name(model),
            floating=floating,
            integer=len(tensors) - floating,
            dtypes=sorted({str(t.dtype).replace("torch.", "") for t in tensors}),
        )

    def on_forward_end(self, model: torch.nn.Module) -> None:
        """A root model's forward ended (or raised)."""
        if self.clock.on:
            self.clock.end("fwd")
        if self._subs["on_forward_end"]:
            self._emit("on_forward_end", model)

    def on_unscale(self, scaler: GradScaler, optimizer: Optimizer) -> None:
        """``scaler.unscale_(optimizer)`` ran."""
        facts = self.facts
        facts.unscale_calls += 1
        facts.unscaled_opts.append(optimizer)
        if self._subs["on_unscale"]:
            self._emit("on_unscale", scaler, optimizer)

    def on_autocast(self, device: str, dtype: str | None, enabled: bool) -> None:
        """An autocast region was entered (the user's line is read for a new setting only)."""
        if enabled:
            self.facts.autocast = (device, dtype)
        key = (device, dtype, enabled)
        if key not in self._autocast_seen:
            self._autocast_seen.add(key)
            self.facts.autocast_new.append((device, dtype, enabled, user_call_site(2)))
        if self._subs["on_autocast"]:
            self._emit("on_autocast", device, dtype, enabled)

    def on_autocast_exit(self, device: str) -> None:
        """An autocast region was left."""
        if self._subs["on_autocast_exit"]:
            self._emit("on_autocast_exit", device)

    def on_scaler_step(self, scaler: GradScaler, optimizer: Optimizer) -> None:
        """``scaler.step(optimizer)`` starts."""
        if self.mode is None:
            self.mode = "scaler"
        self.see_scaler(scaler, None)
        self.see_optimizer(optimizer)
        if self.probe.recording:
            self.facts.scaler_steps.append((scaler, optimizer))
            if self._subs["on_scaler_step"]:
                self._emit("on_scaler_step", scaler, optimizer)

    def claim_boundary(self, scaler: GradScaler) -> None:
        """``update()`` is called: the first scaler used owns the step boundary."""
        if self.mode is None:
            self.mode = "scaler"
        primary = self._primary_scaler() if self._primary_scaler is not None else None
        if self.probe.recording:
            used = self._primary_used
        else:
            # dormant: scale() is not wrapped; the primary's steps since its last update()
            # (torch's per-optimizer states) say it is in use in this iteration
            self.see_scaler(scaler, None)
            used = primary is not None and bool(getattr(primary, "_per_optimizer_states", None))
        if primary is None or (primary is not scaler and not used):
            # first scaler, or the old one is no longer used (a scaler rebuilt in the loop);
            # seen here, so that scale() need not ask the weak set on every step
            self.see_scaler(scaler, None)
            self._primary_scaler = weakref.ref(scaler)

    def update_begins(self, scaler: GradScaler) -> dict[str, Any]:
        """``update()`` is called: claim the boundary, then the facts before it (recording)."""
        self.claim_boundary(scaler)
        if not self.probe.recording:  # dormant: no facts to read before the update
            return {}
        return self.before_update(scaler)

    def before_update(self, scaler: GradScaler) -> dict[str, Any]:
        """The scale and found-inf before ``update()`` (device clones; reads torch internals):
        ``enabled``, and for an enabled scaler with a scale ``host`` (the scale is a CPU
        tensor: read at once), ``scale_before`` and ``found_inf``. Called by
        :meth:`update_begins` while recording."""
        current = self._primary_scaler
        if current is None or current() is not scaler:
            return {}
        enabled = False
        try:
            enabled = bool(scaler._enabled)
            scale = scaler._scale
            if not (enabled and isinstance(scale, torch.Tensor)):
                return {"enabled": enabled}
            # the scale and growth tracker live together: one decision for the update
            host = _on_host(scale)
            count: float | None = None  # found-inf on the host (reading it is free)
            total: torch.Tensor | None = None  # on the device: read back at flush
            stepped = 0  # optimizers this scaler's step() was called for (a host fact)
            for state in scaler._per_optimizer_states.values():
                stage = state.get("stage")
                if getattr(stage, "name", None) == "STEPPED":
                    stepped += 1
                per_device = state.get("found_inf_per_device")
                if not per_device:
                    continue
                for f in per_device.values():
                    if _on_host(f):
                        count = f.item() if count is None else count + f.item()
                    elif total is None:
                        total = f.detach().to(scale.device, non_blocking=True).clone()
                    else:
                        total += f.to(scale.device, non_blocking=True)
            found: Any = None
            if total is not None:
                found = total if count is None else total + count
            elif count is not None:
                found = float(count)
            return {
                "enabled": True,
                "host": host,
                "scale_before": scale.item() if host else scale.detach().clone(),
                "found_inf": found,
                "stepped": stepped,
            }
        except Exception as exc:  # torch internals changed: record, keep counting steps
            self.probe.event("scaler_internals_unreadable", error=f"{type(exc).__name__}: {exc}")
            return {"enabled": enabled}

    def after_update(self, scaler: GradScaler, before: dict[str, Any]) -> None:
        """``update()`` returned: the step boundary when ``scaler`` owns it."""
        primary = self._primary_scaler
        if primary is None or primary() is not scaler or self.mode != "scaler":
            return
        self._primary_used = False
        if self.probe.recording:
            facts = self.facts
            facts.scaler = scaler
            facts.scaler_enabled = before.get("enabled", False)
            if "scale_before" in before:
                facts.scale_before = before["scale_before"]
                host = before["host"]  # (as _host_scalar would read them)
                scale: Any = scaler._scale
                facts.scale_after = scale.item() if host else scale.detach().clone()
                tracker = getattr(scaler, "_growth_tracker", None)
                if isinstance(tracker, torch.Tensor):
                    facts.growth_tracker = tracker.item() if host else tracker.detach().clone()
                facts.found_inf = before["found_inf"]
                facts.scaler_stepped = before.get("stepped", 0)
            if self._subs["on_scaler_update"]:
                self._emit(
                    "on_scaler_update",
                    scaler,
                    facts.scale_before,
                    facts.scale_after,
                    facts.found_inf,
                )
        self.end_step()

    def opt_pre(self, opt: Optimizer, args: Any, kwargs: Any) -> None:
        """torch's global optimizer step pre-hook."""
        if self.probe.closed:
            return
        self.see_optimizer(opt)
        if self.probe.recording:
            if self.probe.t_step_start is None:
                self.probe.touch()
            self.clock.begin("opt")
            if self._subs["on_optimizer_step_begin"]:
                self._emit("on_optimizer_step_begin", opt)

    def opt_post(self, opt: Optimizer, args: Any, kwargs: Any) -> None:
        """torch's global optimizer step post-hook: the boundary in ``"optimizer"`` mode."""
        if self.probe.closed:
            return
        if self.probe.recording:
            if self.clock.on:
                self.clock.end("opt")
            self.facts.opt_steps += 1
            if self._subs["on_optimizer_step_end"]:
                self._emit("on_optimizer_step_end", opt)
        else:  # dormant: the pre-hook that sees optimizers is not installed
            self.see_optimizer(opt)
        if self.mode is None and getattr(self.in_scaler_step, "depth", 0) == 0:
            inside, scaler = _unwrapped_scaler_step()
            if inside:
                if not self.probe.recording and isinstance(scaler, GradScaler):
                    self.see_scaler(scaler, None)  # a subclass's own update() is hooked now
            elif not self.sources.owns_optimizer_step():
                self.mode = "optimizer"
                self._primary_opt = weakref.ref(opt)
        if (
            self.mode == "optimizer"
            and self._primary_opt is not None
            and self._primary_opt() is opt
        ):
            self.end_step()

    # -- engines that own the loss scale (amprobe.capture.sources) ------------------------------
    def source_scaled(self, scaler: EngineScaler | None, loss: torch.Tensor | None) -> None:
        """An engine backpropagates ``loss`` (unscaled) with ``scaler``'s scale (None: unscaled)."""
        if not self.probe.recording:
            return
        if self.probe.t_step_start is None:
            self.probe.touch()
        self._scaled_this_step = True
        self._engine_scaled = True
        if loss is not None:
            self._capture_loss(loss)
        if scaler is not None:
            self.see_scaler(scaler, None)  # type: ignore[arg-type]
            self._emit("on_scale", scaler, loss)

    def source_step(
        self,
        scaler: EngineScaler | None,
        scale_before: torch.Tensor | None,
        scale_after: torch.Tensor | None,
        found_inf: torch.Tensor | None,
    ) -> None:
        """An engine's optimizer iteration ended (skipped or not): the step boundary, with the
        same facts a GradScaler's ``update()`` gives. A GradScaler boundary keeps precedence."""
        if self.mode == "scaler":
            return
        self.mode = "source"
        if self.probe.recording:
            facts = self.facts
            facts.scaler = scaler
            facts.scaler_enabled = scaler is not None
            # host values as Python numbers, as for a GradScaler (read at once: no sync)
            facts.scale_before = host_value(scale_before)
            facts.scale_after = host_value(scale_after)
            facts.found_inf = host_value(found_inf)
            if scaler is not None:
                self._emit("on_scaler_update", scaler, scale_before, scale_after, found_inf)
        self.end_step()

    # -- the boundary ---------------------------------------------------------------------------
    def end_step(self) -> None:
        """Close the iteration: the op mode and module stack go, the probe records the step,
        and the next one begins (while recording)."""
        probe = self.probe
        self._scaled_this_step = False
        self._engine_scaled = False
        if not probe.recording:  # dormant: nothing was gathered, the facts stay fresh
            probe.end_step(self.facts)
            return
        facts, self.facts = self.facts, StepFacts()
        facts.detail = self.detail
        if facts.detail and facts.autocast is None:
            # autocast inside a compiled region runs in the graph, not through __enter__
            facts.autocast = self.compile.autocast
        facts.scaled.clear()  # the losses scaled in the step: found its loss, held no longer
        clock = self.clock
        if clock.on:
            taken = clock.take()
            if taken is not None:
                facts.phase_s, facts.cuda_phases = taken
        if self.dispatch.observing or self.ops.pushed:
            self.ops.pop()
        if self.modules.active:
            self.modules.stop()
        if self._subs["on_step_nonfinite"] and facts.host_nonfinite():
            self._emit("on_step_nonfinite", probe.step, facts)
        if self._subs["on_step_bad"] and (facts.host_skipped() or facts.host_nonfinite()):
            self._emit("on_step_bad", probe.step, facts)
        probe.end_step(facts)  # dispatches on_step_end, flushes, applies control requests
        if probe.recording and not probe.closed:
            self.begin_step(probe.step)

    def begin_step(self, step: int) -> None:
        """Start iteration ``step``: ``on_step_begin``, then the module stack and the op mode
        if anyone asked (the module stack never while torch.compile is in use). A compile
        amprobe did not see being made is looked for on the steps that may install something
        (not quiet, or detail steps)."""
        dispatch = self.dispatch
        clock = self.clock
        every = self.probe.config.details_every
        self.detail = details = (
            step == 0 or self.mode is None or (every > 0 and (step + 1) % every == 0)
        )
        timed = details and dispatch.phase_times
        if clock.on != timed:
            clock.on = timed
            clock.reset()
        if timed:  # (each detail step: the device may be noted, or change, after the first)
            device = self.probe.device
            clock.cuda = device is not None and device.type == "cuda"
        budget = self.probe.budget
        if not self._asked and budget.quiet(step):
            # no sample can start and none ends here: the samplers are not asked
            if details:
                self.compile.check()
            if dispatch.step_begin_always:
                dispatch.deliver(dispatch.step_begin_always, (step,))
            return
        self.compile.check()
        self._emit("on_step_begin", step)
        if not (budget.sampling or self._asked):
            return  # no sample this step nor the last: nobody asks for ops or detail
        call = dispatch.call
        observers: list[tuple[Collector, Callable[..., None]]] = [
            (c, fn)
            for c, fn in dispatch.subs["on_op"]
            if call(c, c.wants_ops, step)  # type: ignore[arg-type]
        ]
        detail = False
        for collector in dispatch.detailed:  # their detail events on the steps they ask for
            on = bool(call(collector, collector.wants_detail, step))
            dispatch.set_detail(collector, on)
            detail = detail or on
        self._asked = bool(observers) or detail
        if self._asked:
            self.detail = True  # a sampled step: the per-call events reach their collectors
        if observers:
            if not self.compile.in_use:
                for collector, _ in observers:
                    if collector.track_modules:
                        self.modules.start()  # before the op mode: removed after it (LIFO)
                        break
            self.ops.push(observers)

    def end_recording(self) -> None:
        """Recording stops at this boundary: drop the op mode and the module stack."""
        for collector in self.dispatch.detailed:
            self.dispatch.set_detail(collector, False)
        self._asked = True  # the next window asks everyone at its first step
        self.detail = True  # dormant: the wrappers act as before any window
        self.clock.reset()
        self.ops.pop()
        if self.modules.active:
            self.modules.stop()
