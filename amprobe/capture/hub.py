"""The hub: every interception of torch, installed once, fanned out to the collectors.

One :class:`Hub` per probe wraps, at class level and exactly once:

* ``GradScaler.__init__``/``scale``/``unscale_``/``step``/``update``/``load_state_dict``, and
  the overrides of those a subclass defines (``ShardedGradScaler``), once one of its instances
  is seen;
* ``Optimizer.__init__``/``load_state_dict`` and torch's global optimizer step pre/post hooks;
* ``autocast.__enter__``/``__exit__``; ``torch.autograd.backward`` (``Tensor.backward`` calls it);
* ``DataLoader`` iteration (``_BaseDataLoaderIter.__next__``);
* the gradient-clipping helpers' grouping function (``clip_grad_norm_``/``clip_grad_value_``);
* per root model, one forward pre-hook and one forward hook;
* the entry points of an engine that owns the loss scale (DeepSpeed, Megatron-core), once the
  program imports it: its :class:`~amprobe.capture.collectors.engines.StepSource` reports the same step
  facts a GradScaler gives (:meth:`Hub.source_scaled`, :meth:`Hub.source_step`);
* while root models are being discovered, a global module forward pre/post hook (installed by
  :class:`~amprobe.capture.discovery.RootModelFinder`, the hub's ``discovery``);
* on the steps a collector asks for, one probe-owned ``TorchDispatchMode`` that hands every op
  to each collector that asked (sync counting, shape capture, FLOP counting), so no two of
  amprobe's modes can ever shadow each other.

Each wrapper turns the call into a typed event (:class:`amprobe.capture.protocol.Collector`) and
delivers it through one guard: a collector that raises is switched off and recorded once, and
nothing reaches the training loop. While the probe is dormant, the wrappers only count step
boundaries (a few attribute reads). The hub also owns the step boundary: the ``update()`` of the
first GradScaler used, else an engine's own step, else the ``step()`` of the first optimizer
that steps (not one an engine makes itself). Everything it
installs is removed by :meth:`Hub.close`, in the reverse order of installation.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
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
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils.data import dataloader as _dataloader

from amprobe.capture.collectors.compiled import (
    backend_name,
    compiled_frames,
    graph_facts,
    is_compiled_module,
    is_compiling,
    unwrap_compiled,
)
from amprobe.capture.collectors.engines import SOURCES, EngineScaler, StepSource
from amprobe.capture.discovery import RootModelFinder
from amprobe.capture.patching import Patch, patch
from amprobe.capture.protocol import Collector, StepFacts
from amprobe.capture.sites import dtype_name, user_call_site

if TYPE_CHECKING:
    from amprobe.capture.probe import Probe

__all__ = ["EVENTS", "Hub", "dtype_name", "user_call_site"]

# frames that torch's decorators (no_grad and friends) put between clip_grad_norm_ and its helper
_DECORATOR_FRAMES = frozenset({"_no_grad_wrapper", "decorate_context", "wrapper", "inner"})

#: every event of the collector protocol, in the order of a typical iteration, and whether it
#: is delivered while the probe is dormant (rare facts and lifecycle) or only while recording
_EVENT_TABLE: dict[str, bool] = {
    "on_model": True,
    "on_recording": True,
    "on_optimizer": True,
    "on_scaler": True,
    "on_scaler_state_loaded": True,
    "on_optimizer_state_loaded": True,
    "on_compile": True,
    "on_compiled_graph": True,
    "on_step_begin": False,
    "on_batch": False,
    "on_forward_begin": False,
    "on_forward_end": False,
    "on_autocast": False,
    "on_autocast_exit": False,
    "on_scale": False,
    "on_backward_begin": False,
    "on_backward_end": False,
    "on_unscale": False,
    "on_clip": False,
    "on_scaler_step": False,
    "on_optimizer_step_begin": False,
    "on_optimizer_step_end": False,
    "on_scaler_update": False,
    "on_op": False,
    "on_step_end": False,
    "on_flush": True,
    "on_rows": True,
    "on_close": True,
}
EVENTS = tuple(_EVENT_TABLE)
_ALWAYS = frozenset(name for name, dormant in _EVENT_TABLE.items() if dormant)


def _inside_unwrapped_scaler_step() -> bool:
    """True inside a ``GradScaler.step`` entered before the hub patched it (a live attach)."""
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "step" and code.co_filename.endswith("grad_scaler.py"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _host_scalar(t: torch.Tensor) -> Any:
    """A one-element tensor's value kept for the step record, at the least cost that adds no
    host-device sync: a Python number for a CPU tensor (``item()`` reads host memory, ~0.5 us,
    where a clone is a dispatched op, ~5 us), a detached device copy otherwise (read back at
    flush with the other device values, one transfer per device)."""
    if _on_host(t):
        return t.item()
    return t.detach().clone()


def _on_host(t: torch.Tensor) -> bool:
    """Reading ``t`` costs no host-device sync (a CPU tensor)."""
    return bool(t.is_cpu)


class _OpMux(TorchDispatchMode):
    """amprobe's only dispatch mode: hands each op to the collectors that asked for this step."""

    def __init__(self, hub: Hub) -> None:
        super().__init__()
        self.hub = hub
        self.observers: list[tuple[Collector, Callable[..., None]]] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile neither skips a frame met while this mode is active (it would run the
        # model uncompiled for the rest of the job) nor traces it: the mode is off while dynamo
        # and AOTAutograd compile, and sees the compiled artifacts' ops as they run
        return True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        hub = self.hub
        if self.observers and not hub.busy:
            for collector, fn in self.observers:
                hub.call(collector, fn, func, args, kwargs, out)
        return out


class Hub:
    """Installs every interception once and delivers its events to the collectors.

    Attributes:
        facts: the shared facts of the iteration in progress.
        optimizers: every optimizer seen (weakly held).
        scalers: every GradScaler seen (weakly held).
        busy: non-zero while collector code runs (its own tensor ops are not the job's).
    """

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.facts = StepFacts()
        self.optimizers: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self.scalers: weakref.WeakSet[GradScaler] = weakref.WeakSet()
        self.busy = 0
        self._subs: dict[str, list[tuple[Collector, Callable[..., Any]]]] = {e: [] for e in EVENTS}
        self._failed: set[str] = set()
        self._hub_failed = False
        self._patches: list[Patch] = []
        self._handles: list[Any] = []  # optimizer hooks, model hooks: removed LIFO at close
        self._models: list[weakref.ReferenceType[torch.nn.Module]] = []
        self._mux: _OpMux | None = None
        self._mux_pushed = False
        # step boundary
        self._mode: str | None = None  # "scaler" | "optimizer" | "source" (an engine)
        self._primary_scaler: weakref.ReferenceType[GradScaler] | None = None
        self._primary_used = False
        self._primary_opt: weakref.ReferenceType[Optimizer] | None = None
        self._in_scaler_step = threading.local()
        self._scaled_this_step = False
        self._engine_scaled = False  # an engine announced this iteration's backward
        # GradScaler subclasses: the wrapper factories, the classes seen, the owners wrapped
        self._scaler_makers: dict[str, Callable[[Any], Any]] = {}
        self._scaler_calls = threading.local()
        self._hooked_scaler_classes: set[type] = set()
        self._hooked_scaler_owners: dict[str, set[type]] = {}
        # engines that own the loss scale (installed once the program imports them)
        self._pending_sources: list[type[StepSource]] = list(SOURCES)
        self._sources: list[StepSource] = []
        #: root-model discovery (the global module hooks, the candidates)
        self.discovery = RootModelFinder(self)
        # torch.compile: once anything is compiled, no hook that dynamo could trace is installed
        self.compile_in_use = False
        self._frames_at_start = compiled_frames()  # what the process compiled before attach
        #: something was compiled in this process before amprobe attached: a hook added now
        #: would recompile what already runs, so no in-graph statistics are installed
        self.compiled_before_attach = self._frames_at_start > 0
        self.compiled_autocast: tuple[str, str | None] | None = None  # inside a compiled graph
        self._compiled: list[dict[str, Any]] = []
        self._compiled_ids: set[int] = set()
        self._method_compiled: set[int] = set()  # modules whose own compile() ran
        self.closed = False

    # -- subscribers and the guard ------------------------------------------------------------
    def subscribe(self, collectors: list[Collector]) -> None:
        """Register the collectors; an event goes only to those that override it."""
        for collector in collectors:
            for event in EVENTS:
                if getattr(type(collector), event) is not getattr(Collector, event):
                    self._subs[event].append((collector, getattr(collector, event)))

    def is_enabled(self, name: str) -> bool:
        return name not in self._failed

    def call(self, collector: Collector, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run collector code under the one guard: never raises, switches it off on failure."""
        if collector.name in self._failed:
            return None
        self.busy += 1
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.failed(collector, exc)
            return None
        finally:
            self.busy -= 1

    @contextlib.contextmanager
    def own_work(self) -> Iterator[None]:
        """amprobe's own tensor work outside a collector (reading live metrics for a callback):
        its ops are not the job's, so no op observer (sync counter, shape capture) books them."""
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1

    def safe(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run the hub's own body of a wrapper: a failure is recorded once, never raised.

        ``SystemExit`` (``max_steps`` reached, asked for by ``amprobe baseline``) passes. Its
        tensor ops (reading a CPU loss scale) are amprobe's: no op observer books them.
        """
        self.busy += 1
        try:
            return fn(*args)
        except Exception as exc:
            if not self._hub_failed:
                self._hub_failed = True
                tb = traceback.extract_tb(exc.__traceback__)
                where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
                self.probe.event("hub_error", error=f"{type(exc).__name__}: {exc}", where=where)
            return None
        finally:
            self.busy -= 1

    def guard(self, collector: Collector, fn: Callable[..., Any]) -> Callable[..., None]:
        """Wrap a hook a collector registers on the user's modules or tensors with the guard."""
        probe = self.probe

        def hook(*args: Any, **kwargs: Any) -> None:
            if not probe.closed:
                self.call(collector, fn, *args, **kwargs)

        return hook

    def emit(self, event: str, *args: Any) -> None:
        """Deliver ``event`` to every collector that overrides it (dormant: rare events only)."""
        subs = self._subs[event]
        if not subs or self.closed and event != "on_close":
            return
        if not self.probe.recording and event not in _ALWAYS:
            return
        for collector, fn in subs:  # self.call, inlined: this is the per-step hot path
            if collector.name in self._failed:
                continue
            self.busy += 1
            try:
                fn(*args)
            except Exception as exc:
                self.failed(collector, exc)
            finally:
                self.busy -= 1

    def failed(self, collector: Collector, exc: BaseException) -> None:
        """Switch ``collector`` off and record why, once."""
        if collector.name in self._failed:
            return
        self._failed.add(collector.name)
        tb = traceback.extract_tb(exc.__traceback__)
        where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
        self.probe.event(
            "collector_error",
            collector=collector.name,
            error=f"{type(exc).__name__}: {exc}",
            where=where,
        )
        for event, subs in self._subs.items():
            self._subs[event] = [(c, fn) for c, fn in subs if c is not collector]
        if self._mux is not None:
            self._mux.observers = [(c, fn) for c, fn in self._mux.observers if c is not collector]
        try:
            collector.on_close()
        except Exception:
            pass

    # -- installation ---------------------------------------------------------------------------
    def _patch(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        self._patches.append(patch(owner, attr, make))

    def install(self) -> None:
        """Install every class-level interception (once per probe)."""
        hub = self
        probe = self.probe

        def wrap_scaler_init(orig: Any) -> Any:
            def __init__(self: GradScaler, *args: Any, **kwargs: Any) -> None:
                orig(self, *args, **kwargs)
                if not probe.closed:
                    hub.safe(hub.see_scaler, self, user_call_site(2) or "?")

            return __init__

        def wrap_scale(orig: Any) -> Any:
            def scale(self: GradScaler, outputs: Any) -> Any:
                result = orig(self, outputs)
                if not probe.closed:
                    hub.safe(hub._on_scale, self, outputs, result)
                return result

            return scale

        def wrap_unscale(orig: Any) -> Any:
            def unscale_(self: GradScaler, optimizer: Optimizer) -> None:
                orig(self, optimizer)
                if probe.recording and not probe.closed:
                    hub.emit("on_unscale", self, optimizer)

            return unscale_

        def wrap_scaler_step(orig: Any) -> Any:
            def step(self: GradScaler, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
                if not probe.closed:
                    hub.safe(hub._on_scaler_step, self, optimizer)
                local = hub._in_scaler_step
                depth = getattr(local, "depth", 0)
                local.depth = depth + 1
                try:
                    return orig(self, optimizer, *args, **kwargs)
                finally:
                    local.depth = depth

            return step

        def wrap_update(orig: Any) -> Any:
            def update(self: GradScaler, new_scale: Any = None) -> None:
                before = None
                if not probe.closed:
                    hub.safe(hub._claim_boundary, self)
                    before = hub.safe(hub._before_update, self)
                orig(self, new_scale)
                if not probe.closed:  # the step boundary survives a failed read of internals
                    hub.safe(hub._after_update, self, before or {})

            return update

        def wrap_scaler_load(orig: Any) -> Any:
            def load_state_dict(self: GradScaler, state_dict: dict[str, Any]) -> None:
                orig(self, state_dict)
                if not probe.closed:
                    hub.safe(hub.see_scaler, self, None)
                    hub.emit("on_scaler_state_loaded", self, state_dict)

            return load_state_dict

        def wrap_opt_init(orig: Any) -> Any:
            def __init__(self: Optimizer, *args: Any, **kwargs: Any) -> None:
                orig(self, *args, **kwargs)
                if not probe.closed:
                    hub.safe(hub.see_optimizer, self)

            return __init__

        def wrap_opt_load(orig: Any) -> Any:
            def load_state_dict(self: Optimizer, state_dict: dict[str, Any]) -> None:
                orig(self, state_dict)
                if not probe.closed:
                    # a restore loads trained state; accelerate re-places a fresh optimizer's
                    # (empty) state through the same call
                    restored = bool(self.state) and any(bool(s) for s in self.state.values())
                    hub.emit("on_optimizer_state_loaded", self, restored)

            return load_state_dict

        def wrap_autocast_enter(orig: Any) -> Any:
            def __enter__(self: autocast) -> Any:
                result = orig(self)
                if probe.recording and not probe.closed:
                    probe.touch()
                    hub.emit(
                        "on_autocast",
                        str(getattr(self, "device", "?")),
                        dtype_name(getattr(self, "fast_dtype", None)),
                        bool(getattr(self, "_enabled", True)),
                    )
                return result

            return __enter__

        def wrap_autocast_exit(orig: Any) -> Any:
            def __exit__(self: autocast, *exc: Any) -> Any:
                if probe.recording and not probe.closed:
                    hub.emit("on_autocast_exit", str(getattr(self, "device", "?")))
                return orig(self, *exc)

            return __exit__

        def wrap_backward(orig: Any) -> Any:
            def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
                if not probe.recording or probe.closed:
                    return orig(tensors, *args, **kwargs)
                hub.safe(hub._on_backward_begin, tensors)
                try:
                    return orig(tensors, *args, **kwargs)
                finally:
                    hub.emit("on_backward_end")

            return backward

        def wrap_next(orig: Any) -> Any:
            def __next__(self_it: Any) -> Any:
                if not probe.recording or probe.closed:
                    return orig(self_it)
                probe.touch()
                t0 = time.perf_counter()
                p0 = probe.probe_time
                try:
                    return orig(self_it)
                finally:
                    spent = time.perf_counter() - t0 - max(0.0, probe.probe_time - p0)
                    hub.emit("on_batch", spent, self_it)

            return __next__

        def wrap_group(orig: Any) -> Any:
            def _group_tensors_by_device_and_dtype(
                tensorlistlist: Any, *args: Any, **kwargs: Any
            ) -> Any:
                if probe.recording and not probe.closed:
                    hub.safe(hub._maybe_clip, tensorlistlist)
                return orig(tensorlistlist, *args, **kwargs)

            return _group_tensors_by_device_and_dtype

        def wrap_compile(orig: Any) -> Any:
            def compile(model: Any = None, *args: Any, **kwargs: Any) -> Any:
                result = orig(model, *args, **kwargs)
                if model is not None and not kwargs.get("disable") and not probe.closed:
                    hub.safe(hub.note_compile, model, result, kwargs)
                return result

            compile.__doc__ = orig.__doc__
            return compile

        self._patch(torch, "compile", wrap_compile)
        self._patch(GradScaler, "__init__", wrap_scaler_init)
        self._patch_scaler_method("scale", wrap_scale)
        self._patch_scaler_method("unscale_", wrap_unscale)
        self._patch_scaler_method("step", wrap_scaler_step)
        self._patch_scaler_method("update", wrap_update)
        self._patch_scaler_method("load_state_dict", wrap_scaler_load)
        self._patch(Optimizer, "__init__", wrap_opt_init)
        self._patch(Optimizer, "load_state_dict", wrap_opt_load)
        self._patch(autocast, "__enter__", wrap_autocast_enter)
        self._patch(autocast, "__exit__", wrap_autocast_exit)
        self._patch(torch.autograd, "backward", wrap_backward)
        self._patch(_dataloader._BaseDataLoaderIter, "__next__", wrap_next)
        if hasattr(_clip_grad, "_group_tensors_by_device_and_dtype"):
            self._patch(_clip_grad, "_group_tensors_by_device_and_dtype", wrap_group)
        self._handles.append(
            register_optimizer_step_pre_hook(lambda *a: self.safe(self._opt_pre, *a))
        )
        self._handles.append(
            register_optimizer_step_post_hook(lambda *a: self.safe(self._opt_post, *a))
        )
        self.load_sources()

    def close(self) -> None:
        """Remove everything the hub installed, newest first. Idempotent."""
        if self.closed:
            return
        self._pop_mux(final=True)
        self.discovery.stop()
        for handle in reversed(self._handles):
            try:
                handle.remove()
            except Exception:
                pass
        self._handles.clear()
        for p in reversed(self._patches):
            p.remove()
        self._patches.clear()
        self.closed = True

    # -- GradScaler subclasses (ShardedGradScaler and the like) -----------------------------------
    def _patch_scaler_method(self, attr: str, make: Callable[[Any], Any]) -> None:
        """Wrap ``GradScaler.<attr>`` and remember ``make`` for subclasses that override it."""
        self._scaler_makers[attr] = make
        self._patch(GradScaler, attr, self._outermost(attr, make))

    def _outermost(self, attr: str, make: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``make`` whose wrapper acts only in the outermost ``<attr>`` call on a scaler.

        A subclass's own ``update`` that calls ``super().update()`` reaches the wrapped base
        method too; only the outer call is the user's, so the inner one passes straight through
        (one step boundary, one ``on_unscale``). Cost: a set insert and removal per call.
        """
        local = self._scaler_calls

        def make_outermost(orig: Any) -> Any:
            inner = make(orig)

            def outermost(scaler: Any, *args: Any, **kwargs: Any) -> Any:
                active: set[tuple[int, str]] = local.__dict__.setdefault("active", set())
                key = (id(scaler), attr)
                if key in active:
                    return orig(scaler, *args, **kwargs)
                active.add(key)
                try:
                    return inner(scaler, *args, **kwargs)
                finally:
                    active.discard(key)

            return outermost

        return make_outermost

    def _hook_scaler_class(self, cls: type) -> None:
        """Wrap the methods a GradScaler subclass overrides, the first time one of its
        instances is seen: ``ShardedGradScaler`` has its own ``scale``/``unscale_``/``update``,
        so the class-level wrappers on ``GradScaler`` never see its step boundary. For each
        wrapped method, the class the instance's MRO resolves it to is wrapped (a GradScaler
        subclass only: a mixin shared with other classes is left alone and reported)."""
        if cls is GradScaler or cls in self._hooked_scaler_classes or self.closed:
            return
        self._hooked_scaler_classes.add(cls)
        for attr, make in self._scaler_makers.items():
            owner = next((k for k in cls.__mro__ if attr in vars(k)), None)
            if (
                owner is None
                or owner is GradScaler
                or owner in self._hooked_scaler_owners.get(attr, ())
            ):
                continue
            if not (isinstance(owner, type) and issubclass(owner, GradScaler)):
                self.probe.event(
                    "scaler_method_unhooked",
                    scaler_class=cls.__name__,
                    method=attr,
                    owner=getattr(owner, "__qualname__", "?"),
                )
                continue
            self._hooked_scaler_owners.setdefault(attr, set()).add(owner)
            self._patch(owner, attr, self._outermost(attr, make))

    # -- objects ----------------------------------------------------------------------------------
    def see_scaler(self, scaler: GradScaler, site: str | None) -> None:
        if scaler in self.scalers:
            return
        self._hook_scaler_class(type(scaler))
        self.scalers.add(scaler)
        self.emit("on_scaler", scaler, site)

    def see_optimizer(self, opt: Optimizer) -> None:
        if opt in self.optimizers:
            return
        self.optimizers.add(opt)
        self.load_sources()
        self.emit("on_optimizer", opt)
        self.discovery.claim_compiled_roots()

    def watch_model(self, model: torch.nn.Module) -> None:
        """Install the forward pre/post hooks of a root model (events for every collector)."""
        if any(ref() is model for ref in self._models):
            return
        if is_compiled_module(model):
            self.note_compile(model, model, None)
        if id(model) in self._method_compiled:
            # Module.compile(): the module's own hooks run inside the compiled frame, and adding
            # them after it compiled would recompile it; its forward is not timed
            self.probe.event("model_hooks_skipped", reason="module compiled with .compile()")
            return
        self._models.append(weakref.ref(model))
        if not (self._subs["on_forward_begin"] or self._subs["on_forward_end"]):
            return
        probe = self.probe

        def pre(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            # inside a compiled region (module.compile(), a compiled train step) dynamo traces
            # this hook: it returns at once, so the graph is the one without amprobe
            if probe.recording and not probe.closed and not is_compiling():
                probe.touch()
                self.emit("on_forward_begin", module, args, kwargs)

        def post(module: torch.nn.Module, args: Any, out: Any) -> None:
            if probe.recording and not probe.closed and not is_compiling():
                self.emit("on_forward_end", module)

        self._handles.append(model.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(model.register_forward_hook(post, always_call=True))

    # -- torch.compile ------------------------------------------------------------------------------
    def note_compile(self, target: Any, compiled: Any, kwargs: dict[str, Any] | None) -> None:
        """``torch.compile`` was called on ``target`` (or a compiled model became known).

        From here on no hook that dynamo could trace is installed (collectors hear
        ``on_compile``), discovery stops watching global module calls, and the run's manifest
        lists what was compiled, how.
        """
        owner = getattr(target, "__self__", None)
        if isinstance(owner, torch.nn.Module):  # Module.compile() compiles its _call_impl
            module, kind, called = owner, "method", owner
        elif isinstance(target, torch.nn.Module):
            module = unwrap_compiled(target)
            if compiled is not target or module is not target:  # torch.compile(module)
                kind, called = "module", compiled
            else:  # a model whose compile() ran before amprobe attached
                kind, called = "method", target
        else:
            module, kind, called = None, "function", None
        key = id(module if module is not None else target)
        if kind == "method":
            self._method_compiled.add(key)
        if key in self._compiled_ids:
            return
        self._compiled_ids.add(key)
        if module is not None:
            name = type(module).__name__
        else:
            code = getattr(target, "__code__", None)
            where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
            name = f"{getattr(target, '__qualname__', type(target).__name__)}{where}"
        if kwargs is None:  # compiled before amprobe saw the call: read what the wrapper keeps
            backend = _wrapper_backend(target)
            fact: dict[str, Any] = {"target": name, "kind": kind, "backend": backend}
        else:
            fact = {
                "target": name,
                "kind": kind,
                "backend": backend_name(kwargs.get("backend")),
                "mode": kwargs.get("mode"),
                "dynamic": kwargs.get("dynamic"),
                "fullgraph": bool(kwargs.get("fullgraph", False)),
            }
        self._compiled.append(fact)
        first = not self.compile_in_use
        self.compile_in_use = True
        self.probe.annotate_manifest(compile=list(self._compiled))
        self.probe.event("compiled", **fact)
        self.discovery.compiled(called)
        if first:
            self._compile_started()
        self.discovery.claim_compiled_roots()

    def _check_compiled(self) -> None:
        """A compile amprobe did not see being made (before attach) shows in dynamo's counters.

        Only frames compiled since attach count: what the process compiled and ran before (an
        earlier job in the same interpreter) says nothing about the model trained now."""
        if not self.compile_in_use and compiled_frames() > self._frames_at_start:
            self.compile_in_use = True
            self.probe.event("compiled", target="(compiled before amprobe attached)", kind="?")
            self._compile_started()

    def compile_seen(self) -> bool:
        """Whether ``torch.compile`` is in use in this process since attach (checked now)."""
        self._check_compiled()
        return self.compile_in_use

    def _compile_started(self) -> None:
        self._watch_graphs()
        self.emit("on_compile")

    def _watch_graphs(self) -> None:
        """Read each graph dynamo hands its backend (shapes, dtypes, modules, autocast): at
        compile time, never at run time. The backend gets the very same graph."""
        try:
            from torch._dynamo.output_graph import OutputGraph
        except (ImportError, AttributeError) as exc:
            self.probe.event("compiled_graphs_unreadable", error=f"{type(exc).__name__}: {exc}")
            return
        if not hasattr(OutputGraph, "call_user_compiler"):
            self.probe.event(
                "compiled_graphs_unreadable", error="no OutputGraph.call_user_compiler"
            )
            return
        hub = self

        def wrap_call_user_compiler(orig: Any) -> Any:
            def call_user_compiler(self: Any, gm: Any, example_inputs: Any) -> Any:
                if not hub.probe.closed:
                    hub.safe(hub._on_graph, gm)
                return orig(self, gm, example_inputs)

            return call_user_compiler

        self._patch(OutputGraph, "call_user_compiler", wrap_call_user_compiler)

    def _on_graph(self, gm: Any) -> None:
        facts = graph_facts(gm)
        if facts["autocast"]:
            self.compiled_autocast = facts["autocast"][-1]
        self.emit("on_compiled_graph", facts)

    # -- wrapper bodies -----------------------------------------------------------------------------
    def _capture_loss(self, loss: torch.Tensor) -> None:
        """Add ``loss`` (a scalar backpropagated into ``.grad``, unscaled) to the step's loss."""
        facts = self.facts
        if facts.loss_dtype is None:
            facts.loss_dtype = dtype_name(loss.dtype)
        if self.probe.config.capture_loss:
            value = _host_scalar(loss)
            if isinstance(value, torch.Tensor):
                value = value.reshape(()).float()
            total = facts.loss
            if total is None:
                facts.loss = value
            elif isinstance(total, torch.Tensor) or isinstance(value, torch.Tensor):
                device = total.device if isinstance(total, torch.Tensor) else value.device  # type: ignore[union-attr]
                facts.loss = torch.as_tensor(total, device=device) + torch.as_tensor(
                    value, device=device
                )
            else:
                facts.loss = total + value
            facts.loss_count += 1

    def _on_scale(self, scaler: GradScaler, outputs: Any, result: Any = None) -> None:
        primary = self._primary_scaler() if self._primary_scaler is not None else None
        if primary is scaler:
            self._primary_used = True
        if not self.probe.recording:
            return
        self.see_scaler(scaler, None)
        self.probe.touch()
        self._scaled_this_step = True
        loss = outputs if isinstance(outputs, torch.Tensor) and outputs.numel() == 1 else None
        if loss is not None and isinstance(result, torch.Tensor):
            # not the step's loss yet: only what reaches torch.autograd.backward is (a scaled
            # loss given to torch.autograd.grad, as for a gradient penalty, never is)
            scale = getattr(scaler, "_scale", None) if getattr(scaler, "_enabled", False) else None
            self.facts.scaled.append((weakref.ref(result), loss.detach(), scale))
        self.emit("on_scale", scaler, loss)

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

    def _on_backward_begin(self, tensors: Any) -> None:
        self.probe.touch()
        roots = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
        for root in roots:
            if not (isinstance(root, torch.Tensor) and root.numel() == 1):
                continue
            if self._engine_scaled or self._source_backward(root):
                continue  # the engine recorded this loss, unscaled, when it announced it
            self._capture_loss(self._unscaled(root))
        single = tensors if isinstance(tensors, torch.Tensor) and tensors.numel() == 1 else None
        self.emit("on_backward_begin", single)

    def _on_scaler_step(self, scaler: GradScaler, optimizer: Optimizer) -> None:
        if self._mode is None:
            self._mode = "scaler"
        self.see_scaler(scaler, None)
        self.see_optimizer(optimizer)
        if self.probe.recording:
            self.emit("on_scaler_step", scaler, optimizer)

    def _claim_boundary(self, scaler: GradScaler) -> None:
        """``update()`` is called: the first scaler used owns the step boundary."""
        if self._mode is None:
            self._mode = "scaler"
        primary = self._primary_scaler() if self._primary_scaler is not None else None
        if primary is None or (primary is not scaler and not self._primary_used):
            # first scaler, or the old one is no longer used (a scaler rebuilt in the loop)
            self._primary_scaler = weakref.ref(scaler)

    def _before_update(self, scaler: GradScaler) -> dict[str, Any]:
        """The scale and found-inf before ``update()`` (device clones; reads torch internals)."""
        before: dict[str, Any] = {}
        current = self._primary_scaler
        if current is None or current() is not scaler or not self.probe.recording:
            return before
        try:
            enabled = bool(getattr(scaler, "_enabled", True))
            before["enabled"] = enabled
            scale = getattr(scaler, "_scale", None)
            if enabled and isinstance(scale, torch.Tensor):
                before["scale_before"] = _host_scalar(scale)
                found = [
                    f
                    for state in scaler._per_optimizer_states.values()
                    for f in state.get("found_inf_per_device", {}).values()
                ]
                if found and all(_on_host(f) for f in found):
                    before["found_inf"] = sum(f.item() for f in found)
                elif found:  # on the device: summed there, read back at flush (no sync)
                    total = found[0].detach().to(scale.device, non_blocking=True).clone()
                    for f in found[1:]:
                        total += f.to(scale.device, non_blocking=True)
                    before["found_inf"] = total
        except Exception as exc:  # torch internals changed: record, keep counting steps
            self.probe.event("scaler_internals_unreadable", error=f"{type(exc).__name__}: {exc}")
        return before

    def _after_update(self, scaler: GradScaler, before: dict[str, Any]) -> None:
        if self._primary_scaler is None or self._primary_scaler() is not scaler:
            return
        if self._mode != "scaler":
            return
        self._primary_used = False
        if self.probe.recording:
            facts = self.facts
            facts.scaler = scaler
            facts.scaler_enabled = bool(before.get("enabled", False))
            if "scale_before" in before:
                facts.scale_before = before["scale_before"]
                facts.scale_after = _host_scalar(scaler._scale)  # type: ignore[arg-type]
                tracker = getattr(scaler, "_growth_tracker", None)
                if isinstance(tracker, torch.Tensor):
                    facts.growth_tracker = _host_scalar(tracker)
            facts.found_inf = before.get("found_inf")
            self.emit(
                "on_scaler_update", scaler, facts.scale_before, facts.scale_after, facts.found_inf
            )
        self._end_step()

    def _opt_pre(self, opt: Optimizer, args: Any, kwargs: Any) -> None:
        if self.probe.closed:
            return
        self.see_optimizer(opt)
        if self.probe.recording:
            self.probe.touch()
            self.emit("on_optimizer_step_begin", opt)

    def _opt_post(self, opt: Optimizer, args: Any, kwargs: Any) -> None:
        if self.probe.closed:
            return
        if self.probe.recording:
            self.emit("on_optimizer_step_end", opt)
        if (
            self._mode is None
            and getattr(self._in_scaler_step, "depth", 0) == 0
            and not _inside_unwrapped_scaler_step()
            and not self._source_owns_step()
        ):
            self._mode = "optimizer"
            self._primary_opt = weakref.ref(opt)
        if (
            self._mode == "optimizer"
            and self._primary_opt is not None
            and self._primary_opt() is opt
        ):
            self._end_step()

    def _maybe_clip(self, tensorlistlist: Any) -> None:
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
        self.emit("on_clip", function, grads, user_call_site(3))

    # -- step-facts sources: engines that own the loss scale (amprobe.capture.collectors.engines) ---------
    def load_sources(self) -> None:
        """Install the step-facts source of each engine the program has imported by now."""
        if not self._pending_sources or self.closed:
            return
        for cls in list(self._pending_sources):
            if cls.module not in sys.modules:
                continue
            self._pending_sources.remove(cls)
            source = cls(self)
            try:
                source.install()
            except Exception as exc:  # the engine changed: record, keep the torch-level capture
                self.probe.event(
                    "engine_source_failed", engine=cls.name, error=f"{type(exc).__name__}: {exc}"
                )
                continue
            self._sources.append(source)
            self.probe.event("engine_source_installed", engine=cls.name)

    def patch_source(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        """Wrap an engine's entry point (removed by :meth:`close` with the hub's own patches)."""
        self._patch(owner, attr, make)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's model inside an engine's wrapper module (``DeepSpeedEngine.module``)."""
        self.load_sources()
        for source in self._sources:
            try:
                model = source.unwrap(model)
            except Exception:
                pass
        return model

    def _source_owns_step(self) -> bool:
        """An optimizer step that an engine makes itself is no step boundary."""
        self.load_sources()
        return any(source.owns_optimizer_step() for source in self._sources)

    def _source_backward(self, loss: torch.Tensor) -> bool:
        """A backward no engine call announced: a source may recognize a loss scaled by hand."""
        for source in self._sources:
            if self.safe(source.on_backward, loss):
                return True
        return False

    def source_scaled(self, scaler: EngineScaler | None, loss: torch.Tensor | None) -> None:
        """An engine backpropagates ``loss`` (unscaled) with ``scaler``'s scale (None: unscaled)."""
        if not self.probe.recording:
            return
        self.probe.touch()
        self._scaled_this_step = True
        self._engine_scaled = True
        if loss is not None:
            self._capture_loss(loss)
        if scaler is not None:
            self.see_scaler(scaler, None)  # type: ignore[arg-type]
            self.emit("on_scale", scaler, loss)

    def source_step(
        self,
        scaler: EngineScaler | None,
        scale_before: torch.Tensor | None,
        scale_after: torch.Tensor | None,
        found_inf: torch.Tensor | None,
    ) -> None:
        """An engine's optimizer iteration ended (skipped or not): the step boundary, with the
        same facts a GradScaler's ``update()`` gives. A GradScaler boundary keeps precedence."""
        if self._mode == "scaler":
            return
        self._mode = "source"
        if self.probe.recording:
            facts = self.facts
            facts.scaler = scaler
            facts.scaler_enabled = scaler is not None
            facts.scale_before = scale_before
            facts.scale_after = scale_after
            facts.found_inf = found_inf
            if scaler is not None:
                self.emit("on_scaler_update", scaler, scale_before, scale_after, found_inf)
        self._end_step()

    # -- step boundary ------------------------------------------------------------------------------
    def _end_step(self) -> None:
        probe = self.probe
        facts, self.facts = self.facts, StepFacts()
        self._scaled_this_step = False
        self._engine_scaled = False
        if not probe.recording:
            probe.end_step(facts)
            return
        self._pop_mux()
        probe.end_step(facts)  # dispatches on_step_end, flushes, applies control requests
        if probe.recording and not probe.closed:
            self.begin_step(probe.step)

    def begin_step(self, step: int) -> None:
        """Start iteration ``step``: ``on_step_begin``, then the op mode if anyone asked."""
        self._check_compiled()
        self.emit("on_step_begin", step)
        observers = [
            (c, fn)
            for c, fn in self._subs["on_op"]
            if self.call(c, c.wants_ops, step)  # type: ignore[arg-type]
        ]
        if observers:
            self._push_mux(observers)

    def end_recording(self) -> None:
        """Recording stops at this boundary: drop the op mode."""
        self._pop_mux()

    def _push_mux(self, observers: list[tuple[Collector, Callable[..., None]]]) -> None:
        if self._mux is None:
            self._mux = _OpMux(self)
        self._mux.observers = observers
        if not self._mux_pushed:
            self._mux.__enter__()
            self._mux_pushed = True

    def _pop_mux(self, final: bool = False) -> None:
        mux = self._mux
        if mux is None:
            return
        mux.observers = []
        if not self._mux_pushed:
            return
        if _get_current_dispatch_mode() is mux:
            mux.__exit__(None, None, None)
            self._mux_pushed = False
        elif final:
            # someone pushed a mode above ours and keeps it: ours stays a pass-through
            self.probe.event("op_mode_left_inert", reason="another TorchDispatchMode is above it")


def _wrapper_backend(module: Any) -> str:
    """The backend of a module compiled before amprobe attached, where torch keeps it."""
    try:
        ctx = getattr(module, "dynamo_ctx", None)
        if ctx is None:
            impl = getattr(module, "_compiled_call_impl", None)
            ctx = getattr(impl, "_torchdynamo_orig_callable", None) and impl
        callback = getattr(ctx, "callback", None)
        backend = getattr(callback, "_torchdynamo_orig_backend", None)
        inner = getattr(backend, "_torchdynamo_orig_backend", backend)
        return backend_name(inner) if inner is not None else "unknown"
    except Exception:
        return "unknown"
