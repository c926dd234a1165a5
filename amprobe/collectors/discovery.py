"""Root-model discovery for zero-code attach."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from amprobe.collectors.base import Collector

__all__ = ["RootModelFinder"]

_GIVE_UP_AFTER_STEPS = 3


class RootModelFinder(Collector):
    """Finds the root modules being trained, with no reference to the user's objects.

    A global forward pre/post hook tracks call depth; modules called at depth 0 are candidate
    roots. At the end of each of the first steps, the candidates whose parameters an optimizer
    updates are registered with the probe (``probe.add_model``) and the global hooks are removed,
    so the cost is paid for the first steps only.
    """

    name = "discovery"

    def on_attach(self, probe: Any) -> None:
        super().on_attach(probe)
        self._depth = 0
        self._roots: list[weakref.ReferenceType[torch.nn.Module]] = []
        self._handles: list[Any] = []
        from torch.nn.modules import module as module_mod

        self._handles.append(module_mod.register_module_forward_pre_hook(self._pre))
        self._handles.append(module_mod.register_module_forward_hook(self._post, always_call=True))

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if self._depth == 0 and torch.is_grad_enabled() and not any(r() is module for r in self._roots):
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
        if found or step + 1 >= _GIVE_UP_AFTER_STEPS:
            if not found:
                self.probe.event("discovery_failed", reason="no module called at top level owns optimizer parameters")
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
