"""Root-model discovery for zero-code and live attach.

Two ways to find the root modules being trained, with no reference to the user's objects:
:class:`RootModelFinder` has the hub watch which modules are called at top level;
:func:`find_live_training_objects` scans the garbage collector's object list once (used when
attaching to a job that is already running, where there is no "first step" to watch).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch

from amprobe.capture.protocol import Collector

__all__ = [
    "LiveObjects",
    "RootModelFinder",
    "find_live_training_objects",
    "find_root_modules",
    "name_in_caller",
]

_HOLD_GIL_S = 100.0  # switch interval during a GC scan: no other thread runs meanwhile
# frames of torch and amprobe are never the user's
_NOT_USER = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)


class RootModelFinder(Collector):
    """Finds the root modules being trained, with no reference to the user's objects.

    Asks the hub to watch top-level module calls (a global forward pre/post hook tracking call
    depth): every module called at depth 0 with gradients enabled whose parameters an optimizer
    updates, and that is not inside a root already known, is registered at that very call (so
    step 0 is recorded in full; several models trained together are all found); modules whose
    optimizer appears only later are checked at each of the first step boundaries. The global
    hooks are removed at the end of the first step that found a root (or in which a root was
    passed to ``attach``), or after three steps.

    A dormant probe installs nothing: when recording starts and no model is known yet
    (:meth:`amprobe.Probe.start_recording` scans live objects first), discovery runs for the
    first recorded steps; when recording stops it is removed.
    """

    name = "discovery"

    def on_attach(self, probe: Any) -> None:
        super().on_attach(probe)
        if probe.recording:
            probe.hub.start_discovery()

    def _knows_a_model(self) -> bool:
        return any(ref() is not None for ref in self.probe.models)

    def on_recording(self, active: bool) -> None:
        if not active:
            self.probe.hub.stop_discovery()
        elif not self._knows_a_model():
            self.probe.hub.start_discovery()

    def on_step_end(self, step: int, record: dict[str, Any], facts: Any) -> None:
        self.probe.hub.check_candidates(step)

    def on_close(self) -> None:
        self.probe.hub.stop_discovery()


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
    previous = sys.getswitchinterval()
    sys.setswitchinterval(_HOLD_GIL_S)
    try:
        time.sleep(0)  # hand the GIL over once; waiting threads come back under the long interval
        modules, optimizers, scalers = _scan_gc()
    finally:
        sys.setswitchinterval(previous)
    return LiveObjects(find_root_modules(optimizers, modules), optimizers, scalers)


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
