"""The class-level interceptions of torch, each turned into a hub event.

:class:`Interceptions` installs, once per probe and in the hub's
:class:`~amprobe.capture.install.Installed` stack, what a dormant probe needs:

* ``GradScaler.__init__``/``update``/``load_state_dict`` (and, through
  :class:`~amprobe.capture.install.ScalerMethods`, a subclass's overrides of them);
* ``Optimizer.__init__``/``load_state_dict`` and torch's global optimizer step post-hook;
* ``torch.compile`` (to :class:`~amprobe.capture.compilewatch.CompileWatch`);
* the checkpoint saves (``torch.save``, DCP, the frameworks': see
  :class:`~amprobe.capture.checkpoints.CheckpointGuard`, ``checkpoints``), unless
  ``checkpoint_guard="off"``;

and, in each recording window's layer of that stack (removed when the window closes), the
per-step interceptions that do nothing while dormant:

* ``GradScaler.scale``/``unscale_``/``step`` (and a subclass's overrides);
* torch's global optimizer step pre-hook;
* ``autocast.__enter__``/``__exit__``; ``torch.autograd.backward`` (``Tensor.backward`` calls it);
* ``DataLoader`` iteration (``_BaseDataLoaderIter.__next__``: the wait into the step's facts,
  ``on_dataloader`` once per iterator);
* the gradient-clipping helpers' grouping function (``clip_grad_norm_``/``clip_grad_value_``).

:class:`RootModelHooks` adds, per root model and in the same layer, one forward pre-hook and
one forward hook. Every wrapper checks ``probe.recording``/``probe.closed`` first and calls the
dispatcher's ``emit``/``safe`` or the step boundary directly: no layer in between.
"""

from __future__ import annotations

import contextlib
import sys
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.utils.clip_grad as _clip_grad
from torch.amp import GradScaler
from torch.amp.autocast_mode import autocast
from torch.optim import Optimizer
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.data import dataloader as _dataloader

from amprobe.capture.boundary import StepBoundary
from amprobe.capture.checkpoints import CheckpointGuard
from amprobe.capture.collectors.compiled import is_compiled_module, is_compiling
from amprobe.capture.compilewatch import CompileWatch
from amprobe.capture.dispatch import Dispatcher
from amprobe.capture.install import Installed, ScalerMethods
from amprobe.capture.patching import gated
from amprobe.capture.sites import dtype_name, user_call_site
from amprobe.capture.sources import EngineSources

if TYPE_CHECKING:
    from amprobe.capture.probe import Probe

__all__ = ["Interceptions", "RootModelHooks"]

# frames that torch's decorators (no_grad and friends) put between clip_grad_norm_ and its helper
_DECORATOR_FRAMES = frozenset({"_no_grad_wrapper", "decorate_context", "wrapper", "inner"})


class Interceptions:
    """Installs the class-level wrappers (see the module docstring)."""

    def __init__(
        self,
        probe: Probe,
        dispatch: Dispatcher,
        installed: Installed,
        scaler_methods: ScalerMethods,
        boundary: StepBoundary,
        compile_watch: CompileWatch,
        sources: EngineSources,
    ) -> None:
        self.probe = probe
        self.dispatch = dispatch
        self.installed = installed
        self.scaler_methods = scaler_methods
        self.boundary = boundary
        self.compile = compile_watch
        self.sources = sources
        self.checkpoints = CheckpointGuard(probe, dispatch, installed)
        self._recording_makers: dict[str, Any] = {}

    def install(self) -> None:
        """Install the interceptions a dormant probe needs (once per probe, in the hub's own
        stack): the step boundary (``GradScaler.update``, the optimizer step post-hook, the
        engine sources), the objects' ``__init__``/``load_state_dict``, ``torch.compile`` and
        the checkpoint saves. The others are installed by :meth:`install_recording`."""
        probe = self.probe
        emit = self.dispatch.emit
        safe = self.dispatch.safe
        boundary = self.boundary
        watch = self.compile
        clip = self._maybe_clip
        in_scaler_step = boundary.in_scaler_step
        dispatch = self.dispatch
        hub_error = dispatch.hub_error
        clock = boundary.clock
        subs = dispatch.subs
        on_scale = boundary.on_scale
        on_backward_begin = boundary.on_backward_begin
        update_begins = boundary.update_begins
        after_update = boundary.after_update
        iterators = boundary.iterators
        checkpoints = self.checkpoints

        def see_iterator(iterator: Any) -> None:
            with contextlib.suppress(TypeError):  # (an iterator without weak references)
                iterators.add(iterator)
            emit("on_dataloader", iterator)

        def wrap_scaler_init(orig: Any) -> Any:
            def __init__(self: GradScaler, *args: Any, **kwargs: Any) -> None:
                orig(self, *args, **kwargs)
                if not probe.closed:
                    safe(boundary.see_scaler, self, user_call_site(2) or "?")

            return __init__

        # the wrappers every step runs are gated (see amprobe.capture.patching.gated): they
        # pass straight to the original once removed, and on a subclass's inner call
        @gated
        def wrap_scale(orig: Any, gate: Any) -> Any:
            def scale(self: GradScaler, outputs: Any) -> Any:
                inner = gate.inner_calls
                if not gate.alive or (inner and (id(self), "scale") in inner):
                    return orig(self, outputs)
                result = orig(self, outputs)
                if probe.closed:
                    return result
                if dispatch.observing:
                    safe(on_scale, self, outputs, result)
                else:  # safe(), inlined: every step runs this
                    try:
                        on_scale(self, outputs, result)
                    except Exception as exc:
                        hub_error(exc)
                return result

            return scale

        @gated
        def wrap_unscale(orig: Any, gate: Any) -> Any:
            def unscale_(self: GradScaler, optimizer: Optimizer) -> None:
                inner = gate.inner_calls
                if not gate.alive or (inner and (id(self), "unscale_") in inner):
                    return orig(self, optimizer)  # type: ignore[no-any-return]
                orig(self, optimizer)
                if boundary.detail and probe.recording and not probe.closed:
                    safe(boundary.on_unscale, self, optimizer)

            return unscale_

        @gated
        def wrap_scaler_step(orig: Any, gate: Any) -> Any:
            def step(self: GradScaler, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
                inner = gate.inner_calls
                if not gate.alive or (inner and (id(self), "step") in inner):
                    return orig(self, optimizer, *args, **kwargs)
                if boundary.detail and not probe.closed:
                    safe(boundary.on_scaler_step, self, optimizer)
                if boundary.mode is not None:  # the depth only tells an unknown boundary
                    return orig(self, optimizer, *args, **kwargs)
                depth = getattr(in_scaler_step, "depth", 0)
                in_scaler_step.depth = depth + 1
                try:
                    return orig(self, optimizer, *args, **kwargs)
                finally:
                    in_scaler_step.depth = depth

            return step

        @gated
        def wrap_update(orig: Any, gate: Any) -> Any:
            def update(self: GradScaler, new_scale: Any = None) -> None:
                inner = gate.inner_calls
                if not gate.alive or probe.closed or (inner and (id(self), "update") in inner):
                    return orig(self, new_scale)  # type: ignore[no-any-return]
                if dispatch.observing:
                    before = safe(update_begins, self)
                    orig(self, new_scale)
                    safe(after_update, self, before or {})
                    return None
                try:  # safe(), inlined: every step runs this
                    before = update_begins(self)
                except Exception as exc:
                    hub_error(exc)
                    before = {}
                orig(self, new_scale)
                try:  # the step boundary survives a failed read of internals
                    after_update(self, before)
                except Exception as exc:
                    hub_error(exc)
                return None

            return update

        def wrap_scaler_load(orig: Any) -> Any:
            def load_state_dict(self: GradScaler, state_dict: dict[str, Any]) -> None:
                orig(self, state_dict)
                if not probe.closed:
                    safe(boundary.see_scaler, self, None)
                    emit("on_scaler_state_loaded", self, state_dict)

            return load_state_dict

        def wrap_opt_init(orig: Any) -> Any:
            def __init__(self: Optimizer, *args: Any, **kwargs: Any) -> None:
                orig(self, *args, **kwargs)
                if not probe.closed:
                    safe(boundary.see_optimizer, self)
                    # a framework imported since attach (its Trainer builds the optimizer)
                    safe(checkpoints.load)

            return __init__

        def wrap_opt_load(orig: Any) -> Any:
            def load_state_dict(self: Optimizer, state_dict: dict[str, Any]) -> None:
                orig(self, state_dict)
                if not probe.closed:
                    # a restore loads trained state; accelerate re-places a fresh optimizer's
                    # (empty) state through the same call
                    restored = bool(self.state) and any(bool(s) for s in self.state.values())
                    emit("on_optimizer_state_loaded", self, restored)

            return load_state_dict

        @gated
        def wrap_autocast_enter(orig: Any, gate: Any) -> Any:
            def __enter__(self: autocast) -> Any:
                result = orig(self)
                if not gate.alive:
                    return result
                if boundary.detail and probe.recording and not probe.closed:
                    if probe.t_step_start is None:
                        probe.touch()
                    safe(
                        boundary.on_autocast,
                        str(getattr(self, "device", "?")),
                        dtype_name(getattr(self, "fast_dtype", None)),
                        bool(getattr(self, "_enabled", True)),
                    )
                return result

            return __enter__

        @gated
        def wrap_autocast_exit(orig: Any, gate: Any) -> Any:
            def __exit__(self: autocast, *exc: Any) -> Any:
                if boundary.detail and gate.alive and probe.recording and not probe.closed:
                    safe(boundary.on_autocast_exit, str(getattr(self, "device", "?")))
                return orig(self, *exc)

            return __exit__

        @gated
        def wrap_backward(orig: Any, gate: Any) -> Any:
            def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
                if not gate.alive or not probe.recording or probe.closed:
                    return orig(tensors, *args, **kwargs)
                if dispatch.observing:
                    safe(on_backward_begin, tensors)
                else:  # safe(), inlined: every step runs this
                    try:
                        on_backward_begin(tensors)
                    except Exception as exc:
                        hub_error(exc)
                try:
                    return orig(tensors, *args, **kwargs)
                finally:
                    if clock.on or subs["on_backward_end"]:
                        safe(boundary.on_backward_end)

            return backward

        def wrap_next(orig: Any) -> Any:
            def __next__(self_it: Any) -> Any:
                if not probe.recording or probe.closed:
                    return orig(self_it)
                if probe.t_step_start is None:
                    probe.touch()
                t0 = time.perf_counter()
                p0 = probe.probe_time
                try:
                    return orig(self_it)
                finally:
                    spent = time.perf_counter() - t0 - max(0.0, probe.probe_time - p0)
                    facts = boundary.facts
                    facts.data_wait_s += spent if spent > 0.0 else 0.0
                    facts.batches += 1
                    if self_it not in iterators:
                        safe(see_iterator, self_it)

            return __next__

        def wrap_group(orig: Any) -> Any:
            def _group_tensors_by_device_and_dtype(
                tensorlistlist: Any, *args: Any, **kwargs: Any
            ) -> Any:
                if boundary.detail and probe.recording and not probe.closed:
                    safe(clip, tensorlistlist)
                return orig(tensorlistlist, *args, **kwargs)

            return _group_tensors_by_device_and_dtype

        def wrap_compile(orig: Any) -> Any:
            def compile(model: Any = None, *args: Any, **kwargs: Any) -> Any:
                result = orig(model, *args, **kwargs)
                if model is not None and not kwargs.get("disable") and not probe.closed:
                    safe(watch.note, model, result, kwargs)
                return result

            compile.__doc__ = orig.__doc__
            return compile

        self._recording_makers = {
            "scale": wrap_scale,
            "unscale_": wrap_unscale,
            "step": wrap_scaler_step,
            "autocast.__enter__": wrap_autocast_enter,
            "autocast.__exit__": wrap_autocast_exit,
            "backward": wrap_backward,
            "__next__": wrap_next,
            "group": wrap_group,
            "opt_pre": lambda *a: safe(boundary.opt_pre, *a) if boundary.detail else None,
        }
        installed = self.installed
        installed.patch(torch, "compile", wrap_compile)
        installed.patch(torch.nn.Module, "__getstate__", _wrap_getstate)
        installed.patch(GradScaler, "__init__", wrap_scaler_init)
        self.scaler_methods.wrap(
            installed, {"update": wrap_update, "load_state_dict": wrap_scaler_load}
        )
        installed.patch(Optimizer, "__init__", wrap_opt_init)
        installed.patch(Optimizer, "load_state_dict", wrap_opt_load)
        opt_post = boundary.opt_post

        def post_hook(opt: Optimizer, args: Any, kwargs: Any) -> None:
            if dispatch.observing:
                safe(opt_post, opt, args, kwargs)
                return
            try:  # safe(), inlined: every step runs this
                opt_post(opt, args, kwargs)
            except Exception as exc:
                hub_error(exc)

        installed.hook(register_optimizer_step_post_hook(post_hook))
        self.sources.load()
        self.checkpoints.install()

    def install_recording(self, layer: Installed) -> None:
        """Install the per-step recording interceptions in ``layer`` (a recording window's
        stack): the wrappers that do nothing while the probe is dormant."""
        make = self._recording_makers
        self.scaler_methods.wrap(
            layer, {"scale": make["scale"], "unscale_": make["unscale_"], "step": make["step"]}
        )
        layer.patch(autocast, "__enter__", make["autocast.__enter__"])
        layer.patch(autocast, "__exit__", make["autocast.__exit__"])
        layer.patch(torch.autograd, "backward", make["backward"])
        layer.patch(_dataloader._BaseDataLoaderIter, "__next__", make["__next__"])
        if hasattr(_clip_grad, "_group_tensors_by_device_and_dtype"):
            layer.patch(_clip_grad, "_group_tensors_by_device_and_dtype", make["group"])
        layer.hook(register_optimizer_step_pre_hook(make["opt_pre"]))
        self.dispatch.safe(self.checkpoints.load)  # (in the hub's own stack, not the layer)

    def _maybe_clip(self, tensorlistlist: Any) -> None:
        """The grouping helper runs: ``on_clip`` when a clipping function called it."""
        caller: Any = sys._getframe(1)
        while caller is not None and not caller.f_code.co_filename.endswith("clip_grad.py"):
            caller = caller.f_back  # skip amprobe's own wrapper frames
        if caller is None:
            return
        name = caller.f_code.co_name
        if name == "_get_total_norm":
            outer = caller.f_back
            while outer is not None and outer.f_code.co_name in _DECORATOR_FRAMES:
                outer = outer.f_back
            if outer is None or outer.f_code.co_name != "clip_grad_norm_":
                return
            function = "clip_grad_norm_"
        elif name == "clip_grad_value_":
            function = "clip_grad_value_"
        else:
            return
        grads = list(tensorlistlist[0]) if tensorlistlist else []
        self.dispatch.emit("on_clip", function, grads, user_call_site(3), self.boundary.facts)


#: a module's hook dicts, and the dicts keyed by the same hook ids
_HOOK_DICTS = (
    ("_forward_hooks", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
    ("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",)),
    ("_backward_hooks", ()),
    ("_backward_pre_hooks", ()),
)


def _amprobe_hook(hook: Any) -> bool:
    return str(getattr(hook, "__module__", None) or "").startswith("amprobe.")


def _wrap_getstate(orig: Any) -> Any:
    """``Module.__getstate__`` (pickling: ``torch.save(model)``, ``copy.deepcopy``) leaves out
    the hooks amprobe put on the module: they are local functions (pickle refuses them:
    ``torch.save(model)`` of a watched model failed), and a copy of the model is not the model
    amprobe watches. Nothing else changes; the live module keeps its hooks."""

    def __getstate__(self: torch.nn.Module) -> Any:
        state = orig(self)
        if not isinstance(state, dict):
            return state
        for key, related in _HOOK_DICTS:
            hooks = state.get(key)
            if not hooks or not any(_amprobe_hook(h) for h in hooks.values()):
                continue
            ours = {k for k, h in hooks.items() if _amprobe_hook(h)}
            state[key] = type(hooks)((k, h) for k, h in hooks.items() if k not in ours)
            for name in related:
                value = state.get(name)
                if isinstance(value, dict):
                    state[name] = type(value)((k, v) for k, v in value.items() if k not in ours)
                elif isinstance(value, set):
                    state[name] = {k for k in value if k not in ours}
        return state

    return __getstate__


class RootModelHooks:
    """One forward pre-hook and one forward hook per root model, installed in the recording
    window's layer (:meth:`install`; dropped with it): they time the forward phase on the hub's
    phase clock and deliver ``on_forward_begin``/``_end``."""

    def __init__(
        self,
        probe: Probe,
        dispatch: Dispatcher,
        installed: Installed,
        compile_watch: CompileWatch,
        boundary: StepBoundary,
    ) -> None:
        self.probe = probe
        self.dispatch = dispatch
        self.installed = installed
        self.compile = compile_watch
        self.boundary = boundary
        self._models: list[weakref.ReferenceType[torch.nn.Module]] = []
        self._layer: Installed | None = None  # the recording layer the hooks go in

    def watch(self, model: torch.nn.Module) -> None:
        """A root model: its forward pre/post hooks (events for every collector), now if a
        recording layer is installed, else when one is."""
        if any(ref() is model for ref in self._models):
            return
        if is_compiled_module(model):
            self.compile.note(model, model, None)
        for sub in model.modules():
            # blocks compiled one by one before attach (torchtitan's per-block compile): no
            # frame has compiled yet, so dynamo's counters do not tell; a global module hook
            # installed now would be traced into each block's graph (a graph break, and a
            # crash with fullgraph=True)
            if sub is not model and is_compiled_module(sub):
                self.compile.note(sub, sub, None)
        if self.compile.method_compiled(model):
            # Module.compile(): the module's own hooks run inside the compiled frame, and adding
            # them after it compiled would recompile it; its forward is not timed
            self.probe.event("model_hooks_skipped", reason="module compiled with .compile()")
            return
        self._models.append(weakref.ref(model))
        if self._layer is not None:
            self._hook(model, self._layer)

    def install(self, layer: Installed | None) -> None:
        """Hook every root model in ``layer`` (a recording window's stack); ``None``: the
        layer is being removed, hook no more models."""
        self._layer = layer
        if layer is None:
            return
        for ref in self._models:
            model = ref()
            if model is not None:
                self._hook(model, layer)

    def _hook(self, model: torch.nn.Module, layer: Installed) -> None:
        dispatch = self.dispatch
        subscribed = dispatch.subscribed
        if not (
            subscribed("on_forward_begin")
            or subscribed("on_forward_end")
            or subscribed("on_forward_output")
            or dispatch.phase_times
        ):
            return
        probe = self.probe
        safe = dispatch.safe
        boundary = self.boundary

        clock = boundary.clock
        subs = dispatch.subs
        on_forward_begin = boundary.on_forward_begin

        def pre(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            # inside a compiled region (module.compile(), a compiled train step) dynamo traces
            # this hook: it returns at once, so the graph is the one without amprobe; and
            # before reading anything that changes between steps (dynamo would guard on it: a
            # recording window opening would recompile the region)
            if not is_compiling() and probe.recording and not probe.closed:
                if probe.t_step_start is None:
                    probe.touch()
                if dispatch.observing:
                    safe(on_forward_begin, module, args, kwargs)
                    return
                try:  # safe(), inlined: every step runs this
                    on_forward_begin(module, args, kwargs)
                except Exception as exc:
                    dispatch.hub_error(exc)

        def post(module: torch.nn.Module, args: Any, out: Any) -> None:
            # is_compiling() first: what changes between steps is never read inside a graph
            # (dynamo would guard on it); then nothing to do on most steps (no phase clock,
            # nobody asked for the event)
            if is_compiling() or not (
                clock.on or subs["on_forward_end"] or subs["on_forward_output"]
            ):
                return
            if probe.recording and not probe.closed:
                safe(boundary.on_forward_end, module)
                if subs["on_forward_output"]:
                    dispatch.emit("on_forward_output", module, out)

        layer.hook(model.register_forward_pre_hook(pre, with_kwargs=True))
        layer.hook(model.register_forward_hook(post, always_call=True))
