"""Root-model discovery: finding the models, optimizers and scalers of a process, in one place.

Two ways to find the root modules being trained, with no reference to the user's objects:

* :class:`RootModelFinder`, one per hub (``hub.discovery``), watches which modules are called
  at top level (zero-code runs, ``attach()`` with no model, a dormant probe starting to record)
  and learns compiled roots from ``torch.compile`` itself;
* :func:`find_live_training_objects` scans the garbage collector's object list once (used when
  attaching to a job that is already running, where there is no "first step" to watch, and by
  the finder for a compiled train step whose modules are never seen being called).

How a root is found, in this order (the ``model_registered`` event's ``found_by``):

1. ``attach``: the model passed to ``attach()`` (or by a framework callback);
2. ``engine``: an engine's own model (``DeepSpeedEngine.module``, registered by its source);
3. ``optimizer``: a module called at top level that holds parameters an optimizer updates. A
   compiled module is no root of its own when it holds only part of them (each block of a
   model compiled on its own): the root is the container it is a part of, up the module tree,
   the lowest that holds every such parameter its topmost container holds;
4. ``optimizer_copies``: the optimizers' parameters are no module's (Megatron's fp32 main
   parameters): a module called at top level (or compiled) whose trainable parameters have the
   shapes of the optimizers' parameters;
5. ``gradients``: none of that (an optimizer amprobe never saw, DeepSpeed's flattened
   partitions without the engine's source): a module called at top level with gradients
   enabled whose trainable parameters hold gradients at the step's end.

Steps 4 and 5 are tried only at a step boundary where no root is known. When all fail for the
first steps, the ``discovery_failed`` event says ``root unknown`` and why: nothing is guessed.

Discovery is not a collector (it records nothing; it tells the probe which models to hook). It
is always on; ``"discovery"`` (:data:`DISCOVERY`) is still accepted in ``Config.collectors``
and listed in every run's manifest, so configs and runs that name it keep working.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules import module as _module_mod

from amprobe.capture.collectors.compiled import is_compiling
from amprobe.capture.collectors.sharded import wrapped_module

if TYPE_CHECKING:
    from amprobe.capture.hub import Hub

__all__ = [
    "DISCOVERY",
    "FOUND_BY",
    "ROOT_UNKNOWN",
    "LiveObjects",
    "RootModelFinder",
    "find_live_training_objects",
    "find_root_modules",
    "name_in_caller",
    "root_of",
]

#: the name of discovery in ``Config.collectors`` (accepted, always on; see the module docstring)
DISCOVERY = "discovery"
_DISCOVERY_STEPS = 3  # give up finding a root model after this many steps
#: how a root model can be found, in the order tried (see the module docstring)
FOUND_BY = ("attach", "engine", "optimizer", "optimizer_copies", "gradients")
#: how the ``discovery_failed`` event's reason starts when no way found a root
ROOT_UNKNOWN = "root unknown"
_HOLD_GIL_S = 100.0  # switch interval during a GC scan: no other thread runs meanwhile
# frames of torch and amprobe are never the user's
_NOT_USER = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)


class RootModelFinder:
    """Finds the root modules being trained, with no reference to the user's objects.

    Watches top-level module calls (a global forward pre/post hook tracking call depth): every
    module called at depth 0 with gradients enabled whose parameters an optimizer updates, and
    that is not inside a root already known, is registered at that very call (so step 0 is
    recorded in full; several models trained together are all found); modules whose optimizer
    appears only later are checked at each of the first step boundaries, where the fallbacks
    (the module docstring's steps 4 and 5) are tried when no root is known. The global hooks
    are removed at the end of the first step that found a root (or in which a root was passed
    to ``attach``), or after three steps. Once ``torch.compile`` is in use no global hook is
    installed (dynamo would trace it): the modules compiled are the candidates instead, and a
    compiled module is a part of the model it is in (:func:`root_of`), not a root of its own.

    A dormant probe installs nothing: when recording starts and no model is known yet
    (:meth:`amprobe.Probe.start_recording` scans live objects first), discovery runs for the
    first recorded steps; when recording stops it is removed.

    The interface, all on the training thread: the probe calls :meth:`on_attach`,
    :meth:`on_recording` and :meth:`on_step_end` (after the collectors' events of the same
    name); the hub calls :meth:`compiled` and :meth:`claim_compiled_roots` when it sees
    ``torch.compile`` and optimizers, and :meth:`stop` when it closes. A failure at a step
    boundary or a recording change switches discovery off for the run and is recorded as a
    ``collector_error`` of ``"discovery"`` (the run summary lists it); one inside a module call
    is recorded as ``discovery_failed`` and stops the current search only. Never raises into the
    training loop.
    """

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.failed = False
        self._handles: list[Any] = []  # the global module hooks
        self._checking = False  # candidates checked at step boundaries
        self._depth = 0
        self._first = 0
        self._candidates: list[weakref.ReferenceType[torch.nn.Module]] = []
        #: candidates that torch.compile named, not a top-level call: parts of a model, maybe
        self._from_compile: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._compiled = False  # discovering without global hooks (a compiled job)

    # -- driven by the probe ----------------------------------------------------------------------
    def on_attach(self) -> None:
        """The probe attached: search at once if it records from the start (may raise: attach
        time errors are loud)."""
        if self.hub.probe.recording:
            self.start()

    def on_recording(self, active: bool) -> None:
        """A recording window starts (search if no model is known) or ends (stop)."""
        if self.hub.closed or self.failed:
            return
        try:
            if not active:
                self.stop()
            elif not self._knows_a_model():
                self.start()
        except Exception as exc:
            self._fail(exc)

    @property
    def checking(self) -> bool:
        """Candidates wait for a step boundary (:meth:`on_step_end` has work to do)."""
        return (self._checking or self._compiled) and not self.failed and not self.hub.closed

    def on_step_end(self, step: int) -> None:
        """At a recorded step boundary: register the candidates an optimizer trains, or give up."""
        if not self.checking:
            return
        try:
            self._check_candidates(step)
        except Exception as exc:
            self._fail(exc)

    # -- driven by the hub ------------------------------------------------------------------------
    def compiled(self, called: Any) -> None:
        """``torch.compile`` was noted; ``called`` is the module the job calls (or ``None``).

        Global module hooks make torch warn on every ``OptimizedModule`` call and are traced
        inside compiled regions: they go, and the compiled module itself is the candidate root.
        """
        if self._handles:
            self.stop()
            self._compiled = True
        if called is None:
            return
        self._from_compile.add(called)
        if not any(r() is called for r in self._candidates):
            self._candidates.append(weakref.ref(called))

    def claim_compiled_roots(self) -> None:
        """Discovering without global hooks: each compiled candidate whose parameters an
        optimizer already trains is a root now, or the model it is a part of is (so step 0 is
        sampled like an eager model's). Discovery goes on to the step boundary: several
        compiled models may be trained. Cost: one pass over the GC's objects when a compiled
        module holds only part of the trained parameters (see :func:`root_of`)."""
        if not self._compiled:
            return
        trained = _trained_params(self.hub.optimizers)
        if not trained:
            return
        for ref in list(self._candidates):
            candidate = ref()
            if candidate is not None and self._is_new_root(candidate, trained):
                root = self._by_optimizer(candidate, trained)
                self.hub.probe.add_model(root, found_by="optimizer")

    def start(self) -> None:
        """Watch top-level module calls until a root model is found (zero-code and live attach)."""
        hub = self.hub
        if self._handles or hub.closed:
            return
        self._depth = 0
        self._first = hub.probe.step
        self._candidates = [r for r in self._candidates if r() is not None]
        if hub.compile_seen():  # global hooks would be traced: candidates come from compile()
            self._compiled = True
            return
        self._checking = True
        self._handles.append(_module_mod.register_module_forward_pre_hook(self._pre))
        self._handles.append(_module_mod.register_module_forward_hook(self._post, always_call=True))

    def stop(self) -> None:
        """Remove the global hooks and stop checking candidates. Idempotent."""
        self._checking = False
        self._remove_hooks()

    # -- the search -------------------------------------------------------------------------------
    def _knows_a_model(self) -> bool:
        return any(ref() is not None for ref in self.hub.probe.models)

    def _fail(self, exc: Exception) -> None:
        self.failed = True
        tb = traceback.extract_tb(exc.__traceback__)
        where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
        self.hub.probe.event(
            "collector_error",
            collector=DISCOVERY,
            error=f"{type(exc).__name__}: {exc}",
            where=where,
        )
        self.stop()

    def _remove_hooks(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()

    def _is_new_root(self, module: torch.nn.Module, trained: set[int]) -> bool:
        """``module`` holds parameters an optimizer trains that no known root holds (a module
        inside a known root, or a wrapper around one such as DDP, is not a new root)."""
        known: set[int] = set()
        for ref in self.hub.probe.models:
            root = ref()
            if root is not None:
                known.update(id(p) for p in root.parameters())
        return any(id(p) in trained and id(p) not in known for p in module.parameters())

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if is_compiling():  # traced inside a compiled region: leave the graph as it is
            return
        depth = self._depth
        self._depth = depth + 1
        probe = self.hub.probe
        if depth or not probe.recording or not torch.is_grad_enabled():
            return
        try:
            if any(r() is module for r in self._candidates):
                return
            self._candidates.append(weakref.ref(module))
            trained = _trained_params(self.hub.optimizers)
            if trained and self._is_new_root(module, trained):
                # the root's own pre-hook, installed now, would not run for this call; the
                # global hooks stay to the step's end: other models may be trained with it
                probe.add_model(module, found_by="optimizer")
                self.hub.boundary.on_forward_begin(module, args, {})
        except Exception as exc:
            probe.event("discovery_failed", reason=f"{type(exc).__name__}: {exc}")
            self.stop()

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if is_compiling():
            return
        self._depth = max(0, self._depth - 1)

    def _root_of(
        self,
        candidate: torch.nn.Module,
        marked: Callable[[torch.nn.Parameter], bool],
        total: int | None = None,
    ) -> torch.nn.Module:
        """The root ``candidate`` stands for: itself when it was called at top level; the
        model a compiled candidate is a part of (:func:`root_of`). ``total``: the numel of
        every marked parameter there is, when known (a candidate holding them all is the
        root, found with no scan)."""
        if candidate not in self._from_compile:
            return candidate
        return root_of(candidate, marked, _live_modules, total)

    def _by_optimizer(self, candidate: torch.nn.Module, trained: set[int]) -> torch.nn.Module:
        total = _trained_numel(self.hub.optimizers)
        return self._root_of(candidate, lambda p: id(p) in trained, total)

    def _check_candidates(self, step: int) -> None:
        """The global hooks go at the end of the first step that knows a root; the modules they
        saw called at top level are checked again at the boundaries of the first steps (an
        optimizer created before attaching is seen only at its first ``step()``), then the
        fallbacks while no root is known."""
        if not self._checking and not self._compiled:
            return
        probe = self.hub.probe
        trained = _trained_params(self.hub.optimizers)
        for ref in self._candidates:
            candidate = ref()
            if candidate is not None and self._is_new_root(candidate, trained):
                probe.add_model(self._by_optimizer(candidate, trained), found_by="optimizer")
        found = self._knows_a_model()
        if not found and self._compiled and trained:
            # a compiled train-step function: its modules were never seen being called
            for root in find_live_training_objects().models[:8]:
                if self._is_new_root(root, trained):
                    probe.add_model(root, found_by="optimizer")
                    found = True
        if not found:
            found = self._fall_back()
        if found:
            self._remove_hooks()
        if step + 1 - self._first >= _DISCOVERY_STEPS:
            if not found:
                probe.event("discovery_failed", reason=self._unknown_reason(trained))
            self._compiled = False
            self.stop()

    def _fall_back(self) -> bool:
        """No root known at a step boundary: the candidates whose trainable parameters the
        optimizers hold copies of (``optimizer_copies``), else those whose trainable parameters
        hold gradients now (``gradients``) are roots. Whether one was found."""
        shapes = _optimizer_shapes(self.hub.optimizers)
        candidates = [m for ref in self._candidates if (m := ref()) is not None]
        if self._compiled:
            # no module call was watched (torch.compile in use, if only on functions, as
            # Megatron-core's fusions are): the live modules no other module holds
            candidates += [m for m in _top_modules(_live_modules()) if _has_trainable(m)][:8]
        for found_by, qualifies, marked in (
            ("optimizer_copies", lambda m: _mirrored(m, shapes), _trainable),
            ("gradients", _has_grads, _holds_grad),
        ):
            if found_by == "optimizer_copies" and not shapes:
                continue
            roots: list[torch.nn.Module] = []
            for candidate in candidates:
                if not qualifies(candidate):
                    continue
                root = self._root_of(candidate, marked)
                if not any(r is root for r in roots) and (root is candidate or qualifies(root)):
                    roots.append(root)
            # a root inside another one found now (a compiled block and its model): the outer
            roots = [r for r in roots if not any(o is not r and _contains(o, r) for o in roots)]
            for root in roots:
                self.hub.probe.add_model(root, found_by=found_by)
            if roots:
                return True
        return False

    def _unknown_reason(self, trained: set[int]) -> str:
        """Why no root was found, for the ``discovery_failed`` event (starts with
        :data:`ROOT_UNKNOWN`)."""
        seen = sum(1 for ref in self._candidates if ref() is not None)
        held = "holds the optimizers' parameters or copies of them" if trained else "was trained"
        if self._compiled:
            what = (
                "torch.compile is in use, so no module call was watched, and no compiled or "
                f"live module {held} or held gradients at a step's end"
            )
        elif not seen:
            what = "no module was called at top level with gradients enabled"
        else:
            what = (
                f"{seen} module(s) called at top level with gradients enabled, but none {held} "
                "or held gradients at a step's end"
            )
        return (
            f"{ROOT_UNKNOWN}: {what} in the first {_DISCOVERY_STEPS} steps; pass model= to "
            "amprobe.attach"
        )


def _trained_params(optimizers: Any) -> set[int]:
    ids: set[int] = set()
    for opt in list(optimizers):
        for group in opt.param_groups:
            ids.update(id(p) for p in group["params"])
    return ids


def _trained_numel(optimizers: Any) -> int:
    seen: set[int] = set()
    total = 0
    for opt in list(optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
    return total


def _optimizer_shapes(optimizers: Any) -> Counter[tuple[int, ...]]:
    """The shapes of the optimizers' parameters, each as often as it occurs."""
    shapes: Counter[tuple[int, ...]] = Counter()
    for opt in list(optimizers):
        for group in opt.param_groups:
            shapes.update(tuple(p.shape) for p in group["params"])
    return shapes


def _trainable(p: torch.nn.Parameter) -> bool:
    return bool(p.requires_grad)


def _holds_grad(p: torch.nn.Parameter) -> bool:
    """A gradient reached ``p`` (``main_grad``: Megatron's DDP accumulates there)."""
    return p.requires_grad and (p.grad is not None or getattr(p, "main_grad", None) is not None)


def _mirrored(module: torch.nn.Module, shapes: Counter[tuple[int, ...]]) -> bool:
    """The optimizers hold a copy of each of ``module``'s trainable parameters: the shapes of
    its trainable parameters are among theirs, each as often (fp32 main parameters)."""
    own = Counter(tuple(p.shape) for p in module.parameters() if p.requires_grad)
    return bool(own) and all(shapes[shape] >= n for shape, n in own.items())


def _has_trainable(module: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _top_modules(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules of ``modules`` that none of them holds as a child, largest first."""
    modules = list(modules)
    children = {id(child) for m in modules for child in m.children()}
    tops = [m for m in modules if id(m) not in children]
    return sorted(tops, key=lambda m: sum(p.numel() for p in m.parameters()), reverse=True)


def _has_grads(module: torch.nn.Module) -> bool:
    return any(_holds_grad(p) for p in module.parameters())


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _marked_numel(module: torch.nn.Module, marked: Callable[[torch.nn.Parameter], bool]) -> int:
    return sum(p.numel() for p in module.parameters() if marked(p))


def root_of(
    module: torch.nn.Module,
    marked: Callable[[torch.nn.Parameter], bool],
    modules: Callable[[], Iterable[torch.nn.Module]],
    total: int | None = None,
) -> torch.nn.Module:
    """The model ``module`` is a part of: up its containers (parents among ``modules()``, the
    one holding most ``marked`` parameters at each level), the lowest that holds every marked
    parameter its topmost container holds (the model, not a trainer module around it).

    ``total``, when given, is the element count of every marked parameter there is: a module
    holding that many is its own root and ``modules`` (for the live modules, a pass over the
    GC's objects) is not called. Never raises: ``module`` when the search fails.
    """
    try:
        own = _marked_numel(module, marked)
        if total is not None and own >= total:
            return module
        parents: dict[int, list[torch.nn.Module]] = {}
        for m in modules():
            for child in m.children():
                parents.setdefault(id(child), []).append(m)
        start = module
        while id(start) not in parents and (inner := wrapped_module(start)) is not None:
            # `layers[i] = torch.compile(block)` compiles before it assigns: the block is
            # still where the wrapper will be
            start = inner
        chain = [module] if start is module else [module, start]
        seen = {id(module), id(start)}
        while True:
            ups = [p for p in parents.get(id(chain[-1]), ()) if id(p) not in seen]
            if not ups:
                break
            up = max(ups, key=lambda p: _marked_numel(p, marked))
            chain.append(up)
            seen.add(id(up))
        if len(chain) == 1:
            return module
        need = _marked_numel(chain[-1], marked)
        if own >= need:
            return module
        return next(m for m in chain if _marked_numel(m, marked) >= need)
    except Exception:
        return module


def name_in_caller(*objs: Any) -> str | None:
    """The name the user's code gives one of ``objs``, in the first frame outside torch and
    amprobe: a local or global variable bound to it, else an attribute of that frame's
    ``self``. ``None`` when there is none. Reads frames only; never raises."""
    try:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_NOT_USER):
            frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        scopes = [frame.f_locals, frame.f_globals]
        if owner is not None and hasattr(owner, "__dict__"):
            scopes.append(vars(owner))
        for scope in scopes:
            for name, value in list(scope.items()):
                if not name.startswith("_") and any(value is obj for obj in objs):
                    return str(name)
    except Exception:
        return None
    return None


@dataclasses.dataclass
class LiveObjects:
    """The training objects alive in this interpreter.

    Attributes:
        models: root modules, most trained parameters first (see :func:`find_root_modules`).
        optimizers: every live ``torch.optim.Optimizer`` that holds parameters.
        scalers: every live ``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler`` included).
    """

    models: list[torch.nn.Module]
    optimizers: list[torch.optim.Optimizer]
    scalers: list[torch.amp.GradScaler]


def find_live_training_objects() -> LiveObjects:
    """Find the live model, optimizers and GradScalers of this process through the GC's object list.

    Cost: one pass over ``gc.get_objects()`` (tens of milliseconds per million objects) with a
    type check per object; no tensor is touched, so no device work. Objects waiting in
    unreachable cycles may be included; an optimizer counts only if it holds parameters.

    Thread safety: the GC's list also holds objects other threads are still building (a
    ``tuple(generator)`` in progress), and CPython's in-place resize of such a tuple fails with
    ``SystemError`` in that thread while another reference to it exists. So no other thread may
    run while the list exists: the interpreter's switch interval is raised for the scan (after
    one hand-over, so threads already waiting for the GIL re-wait under the long interval) and
    the list is dropped before it is restored.
    """
    modules, optimizers, scalers = _held_scan()
    return LiveObjects(find_root_modules(optimizers, modules), optimizers, scalers)


def _live_modules() -> list[torch.nn.Module]:
    """Every live module (one pass over the GC's objects; see :func:`find_live_training_objects`)."""
    return _held_scan()[0]


def _held_scan() -> tuple[
    list[torch.nn.Module], list[torch.optim.Optimizer], list[torch.amp.GradScaler]
]:
    """:func:`_scan_gc` with no other thread running (see :func:`find_live_training_objects`)."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(_HOLD_GIL_S)
    try:
        time.sleep(0)  # hand the GIL over once; waiting threads come back under the long interval
        return _scan_gc()
    finally:
        sys.setswitchinterval(previous)


def _scan_gc() -> tuple[
    list[torch.nn.Module], list[torch.optim.Optimizer], list[torch.amp.GradScaler]
]:
    kinds: dict[type, int] = {}
    modules: list[torch.nn.Module] = []
    optimizers: list[torch.optim.Optimizer] = []
    scalers: list[torch.amp.GradScaler] = []
    objects = gc.get_objects()
    for obj in objects:
        cls = type(obj)
        kind = kinds.get(cls)
        if kind is None:
            kind = (
                1
                if issubclass(cls, torch.nn.Module)
                else 2
                if issubclass(cls, torch.optim.Optimizer)
                else 3
                if issubclass(cls, torch.amp.GradScaler)
                else 0
            )
            kinds[cls] = kind
        if kind == 1:
            modules.append(obj)
        elif kind == 2:
            if any(group.get("params") for group in getattr(obj, "param_groups", ())):
                optimizers.append(obj)
        elif kind == 3:
            scalers.append(obj)
    del objects, obj  # no reference to a half-built object survives the scan
    return modules, optimizers, scalers


def find_root_modules(
    optimizers: Iterable[torch.optim.Optimizer], modules: Iterable[torch.nn.Module]
) -> list[torch.nn.Module]:
    """The root modules being trained: modules holding parameters that an optimizer updates,
    not contained in another such module.

    Args:
        optimizers: the optimizers whose parameters define "being trained".
        modules: the candidate modules (for example every live module).

    Returns:
        The roots, those holding the most trained parameters first.
    """
    trained: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            trained.update(id(p) for p in group["params"])
    if not trained:
        return []
    modules = list(modules)
    parents: dict[int, list[torch.nn.Module]] = {}
    owners: list[torch.nn.Module] = []
    for module in modules:
        for child in module.children():
            parents.setdefault(id(child), []).append(module)
        if any(id(p) in trained for p in module.parameters(recurse=False)):
            owners.append(module)
    roots: dict[int, torch.nn.Module] = {}
    seen: set[int] = set()
    stack = list(owners)
    while stack:  # climb from each owner of trained parameters to its topmost containers
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        ups = parents.get(id(module))
        if ups:
            stack.extend(ups)
        else:
            roots[id(module)] = module

    def trained_count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters() if id(p) in trained)

    return sorted(roots.values(), key=trained_count, reverse=True)
