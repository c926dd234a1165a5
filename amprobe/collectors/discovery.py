"""Root-model discovery for zero-code and live attach.

Two ways to find the root modules being trained, with no reference to the user's objects:
:class:`RootModelFinder` watches which modules are called at top level during the first steps;
:func:`find_live_training_objects` scans the garbage collector's object list once (used when
attaching to a job that is already running, where there is no "first step" to watch).
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from amprobe.collectors.base import Collector

__all__ = ["LiveObjects", "RootModelFinder", "find_live_training_objects", "find_root_modules"]

_GIVE_UP_AFTER_STEPS = 3


class RootModelFinder(Collector):
    """Finds the root modules being trained, with no reference to the user's objects.

    A global forward pre/post hook tracks call depth; modules called at depth 0 are candidate
    roots. At the end of each of the first steps, the candidates whose parameters an optimizer
    updates are registered with the probe (``probe.add_model``) and the global hooks are removed,
    so the cost is paid for the first steps only.

    A dormant probe installs nothing: when recording starts and no model is known yet
    (:meth:`amprobe.Probe.start_recording` scans live objects first), the hooks are installed
    for the first recorded steps; when recording stops they are removed.
    """

    name = "discovery"

    def on_attach(self, probe: Any) -> None:
        super().on_attach(probe)
        self._depth = 0
        self._roots: list[weakref.ReferenceType[torch.nn.Module]] = []
        self._handles: list[Any] = []
        self._first_step = 0
        if probe.recording:
            self._install()

    def _install(self) -> None:
        from torch.nn.modules import module as module_mod

        self._depth = 0
        self._first_step = self.probe.step
        self._handles.append(module_mod.register_module_forward_pre_hook(self._pre))
        self._handles.append(module_mod.register_module_forward_hook(self._post, always_call=True))

    def on_recording(self, active: bool) -> None:
        if not active:
            self.on_close()
        elif not self._handles and not any(ref() is not None for ref in self.probe.models):
            self._install()

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if (
            self._depth == 0
            and torch.is_grad_enabled()
            and not any(r() is module for r in self._roots)
        ):
            self._roots.append(weakref.ref(module))
        self._depth += 1

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        if not self._handles:
            return
        trained: set[int] = set()
        for opt in _live_optimizers():
            for group in opt.param_groups:
                trained.update(id(p) for p in group["params"])
        found = False
        for ref in self._roots:
            root = ref()
            if root is not None and any(id(p) in trained for p in root.parameters()):
                self.probe.add_model(root)
                found = True
        if found or step + 1 - self._first_step >= _GIVE_UP_AFTER_STEPS:
            if not found:
                self.probe.event(
                    "discovery_failed",
                    reason="no module called at top level owns optimizer parameters",
                )
            self.on_close()

    def on_close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _live_optimizers() -> list[torch.optim.Optimizer]:
    """Optimizers seen by the scaler collector's global step hooks."""
    from amprobe.probe import current_probe

    probe = current_probe()
    if probe is None:
        return []
    for collector in probe.collectors:
        seen = getattr(collector, "_seen_opts", None)
        if seen is not None:
            return list(seen)
    return []


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
