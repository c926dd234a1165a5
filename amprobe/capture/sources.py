"""Engine step sources: the engines that own the loss scale, installed once they are imported.

:class:`EngineSources` (one per hub, ``hub.sources``) installs the
:class:`~amprobe.capture.collectors.engines.StepSource` of each engine in
:data:`~amprobe.capture.collectors.engines.SOURCES` once the program has imported its module
(DeepSpeed, Megatron-core), and asks them what only the engine knows: the user's model inside
its wrapper, whether an optimizer step is the engine's own, whether a backward is of a loss the
engine scaled. The sources report their step facts to the hub (``hub.source_scaled``,
``hub.source_step``); their patches are the hub's, removed with the others at close.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from amprobe.capture.collectors.engines import SOURCES, StepSource
from amprobe.capture.dispatch import Dispatcher
from amprobe.capture.install import Installed

if TYPE_CHECKING:
    from amprobe.capture.hub import Hub

__all__ = ["EngineSources"]


class EngineSources:
    """The installed engine step sources (see the module docstring)."""

    def __init__(self, hub: Hub, dispatch: Dispatcher, installed: Installed) -> None:
        self.hub = hub
        self.probe = hub.probe
        self.dispatch = dispatch
        self.installed = installed
        self._pending: list[type[StepSource]] = list(SOURCES)
        self.sources: list[StepSource] = []

    def load(self) -> None:
        """Install the step-facts source of each engine the program has imported by now."""
        if not self._pending or self.installed.closed:
            return
        for cls in list(self._pending):
            if cls.module not in sys.modules:
                continue
            self._pending.remove(cls)
            source = cls(self.hub)
            try:
                source.install()
            except Exception as exc:  # the engine changed: record, keep the torch-level capture
                self.probe.event(
                    "engine_source_failed", engine=cls.name, error=f"{type(exc).__name__}: {exc}"
                )
                continue
            self.sources.append(source)
            self.probe.event("engine_source_installed", engine=cls.name)

    def patch(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        """Wrap an engine's entry point (removed at close with the hub's own patches)."""
        self.installed.patch(owner, attr, make)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's model inside an engine's wrapper module (``DeepSpeedEngine.module``)."""
        self.load()
        for source in self.sources:
            try:
                model = source.unwrap(model)
            except Exception:
                pass
        return model

    def owns_optimizer_step(self) -> bool:
        """An optimizer step that an engine makes itself is no step boundary."""
        self.load()
        return any(source.owns_optimizer_step() for source in self.sources)

    def recognizes_backward(self, loss: torch.Tensor) -> bool:
        """A backward no engine call announced: a source may recognize a loss scaled by hand."""
        for source in self.sources:
            if self.dispatch.safe(source.on_backward, loss):
                return True
        return False
