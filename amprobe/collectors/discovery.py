"""Root-model discovery for zero-code and live attach.

Two ways to find the root modules being trained, with no reference to the user's objects:
:class:`RootModelFinder` has the hub watch which modules are called at top level;
:func:`find_live_training_objects` scans the garbage collector's object list once (used when
attaching to a job that is already running, where there is no "first step" to watch).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterable
from typing import Any

import torch

from amprobe.collectors.base import Collector

__all__ = ["LiveObjects", "RootModelFinder", "find_live_training_objects", "find_root_modules"]


class RootModelFinder(Collector):
    """Finds the root modules being trained, with no reference to the user's objects.

    Asks the hub to watch top-level module calls (a global forward pre/post hook tracking call
    depth): the first module called at depth 0 with gradients enabled whose parameters an
    optimizer updates is registered at that very call (so step 0 is recorded in full); modules
    whose optimizer appears only later are checked at each of the first step boundaries. The
    global hooks are removed as soon as a root is found, or after three steps.

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

    def on_model(self, model: Any) -> None:
        self.probe.hub.stop_discovery()

    def on_recording(self, active: bool) -> None:
        if not active:
            self.probe.hub.stop_discovery()
        elif not self._knows_a_model():
            self.probe.hub.start_discovery()

    def on_step_end(self, step: int, record: dict[str, Any], facts: Any) -> None:
        self.probe.hub.check_candidates(step)

    def on_close(self) -> None:
        self.probe.hub.stop_discovery()


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
    """
    kinds: dict[type, int] = {}
    modules: list[torch.nn.Module] = []
    optimizers: list[torch.optim.Optimizer] = []
    scalers: list[torch.amp.GradScaler] = []
    for obj in gc.get_objects():
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
    return LiveObjects(find_root_modules(optimizers, modules), optimizers, scalers)


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
