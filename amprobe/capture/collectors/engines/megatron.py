"""Megatron-core as a source of step facts: its ``DynamicGradScaler``/``ConstantGradScaler`` as
its mixed-precision optimizer drives them.

``MixedPrecisionOptimizer.step`` unscales the main gradients, all-reduces ``found_inf``, calls
``grad_scaler.update(found_inf)`` and skips the update on overflow; the loss was scaled by
``optimizer.scale_loss`` (``config.grad_scale_func``) before Megatron's own backward call (which
may bypass ``torch.autograd.backward``). So:

* step boundary: ``update(found_inf)`` of the scaler (called once per iteration, skipped or
  not); the optimizer steps Megatron makes itself inside its ``step`` are not boundaries;
* loss scale: the scaler's ``_scale`` tensor before and after ``update`` (device clones, no
  sync); found-inf: the flag passed to ``update``; hysteresis shows as skips without a cut;
* loss: the loss passed to ``MegatronOptimizer.scale_loss``; a loop that multiplies the loss by
  ``grad_scaler.scale`` itself and calls ``backward`` gets its loss divided by that scale.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any

import torch

from amprobe.capture.collectors.engines.base import EngineScaler, StepSource, called_from

__all__ = ["MegatronSource"]

_SCALERS = "megatron.core.optimizer.grad_scaler"
_OPTIMIZER = "megatron.core.optimizer.optimizer"


class MegatronSource(StepSource):
    name = "megatron"
    module = _SCALERS

    def install(self) -> None:
        mod = sys.modules[_SCALERS]
        self._base = mod.MegatronGradScaler
        self._pkg = os.path.dirname(os.path.dirname(os.path.abspath(mod.__file__ or ""))) + os.sep
        self._views: weakref.WeakKeyDictionary[Any, EngineScaler] = weakref.WeakKeyDictionary()
        self._current: weakref.ReferenceType[Any] | None = None
        self._in_update = 0
        source = self
        hub = self.hub

        def wrap_init(orig: Any) -> Any:
            def __init__(scaler: Any, *args: Any, **kwargs: Any) -> None:
                orig(scaler, *args, **kwargs)
                if not hub.probe.closed:
                    hub.safe(source._view, scaler)

            return __init__

        def wrap_update(orig: Any) -> Any:
            def update(scaler: Any, found_inf: Any, *args: Any, **kwargs: Any) -> Any:
                before = None
                if not hub.probe.closed:
                    before = hub.safe(source._clone_scale, scaler)
                source._in_update += 1
                try:
                    result = orig(scaler, found_inf, *args, **kwargs)
                finally:
                    source._in_update -= 1
                if not hub.probe.closed:
                    hub.safe(source._after_update, scaler, before, found_inf)
                return result

            return update

        def wrap_scale_loss(orig: Any) -> Any:
            def scale_loss(optimizer: Any, loss: Any) -> Any:
                if not hub.probe.closed:
                    hub.safe(source._on_scale_loss, optimizer, loss)
                return orig(optimizer, loss)

            return scale_loss

        for cls in (mod.DynamicGradScaler, mod.ConstantGradScaler):
            hub.patch_source(cls, "__init__", wrap_init)
            hub.patch_source(cls, "update", wrap_update)
        opt_mod = sys.modules.get(_OPTIMIZER)
        if opt_mod is not None and hasattr(opt_mod, "MegatronOptimizer"):
            hub.patch_source(opt_mod.MegatronOptimizer, "scale_loss", wrap_scale_loss)

    # -- the seam -----------------------------------------------------------------------------
    def owns_optimizer_step(self) -> bool:
        return called_from(self._pkg, depth=3)

    def on_backward(self, loss: torch.Tensor) -> bool:
        scaler = self._current() if self._current is not None else None
        if scaler is None or not self.hub.probe.recording:
            return False
        view = self._view(scaler)
        scale = view._scale
        if scale is None:
            return False
        with torch.no_grad():  # the program multiplied its loss by grad_scaler.scale itself
            loss = loss.detach().reshape(()).float() / scale.to(loss.device, non_blocking=True)
        self.hub.source_scaled(view, loss)
        return True

    # -- Megatron's calls -----------------------------------------------------------------------
    def _view(self, scaler: Any) -> EngineScaler:
        view = self._views.get(scaler)
        if view is None:
            dynamic = hasattr(scaler, "hysteresis")
            view = EngineScaler(
                "megatron",
                type(scaler).__name__,
                str(scaler._scale.device),
                growth_factor=_number(getattr(scaler, "growth_factor", None)) if dynamic else 1.0,
                backoff_factor=_number(getattr(scaler, "backoff_factor", None)) if dynamic else 1.0,
                growth_interval=getattr(scaler, "growth_interval", None),
                hysteresis=getattr(scaler, "hysteresis", None),
                init_scale=_number(scaler._scale),
            )
            self._views[scaler] = view
        self._current = weakref.ref(scaler)
        view.set_scale(scaler._scale)
        return view

    def _clone_scale(self, scaler: Any) -> torch.Tensor | None:
        if not self.hub.probe.recording:
            return None
        with torch.no_grad():
            return scaler._scale.detach().reshape(()).float().clone()

    def _on_scale_loss(self, optimizer: Any, loss: Any) -> None:
        scaler = getattr(optimizer, "grad_scaler", None)
        if (
            scaler is None
            or not isinstance(loss, torch.Tensor)
            or loss.numel() != 1
            or not loss.requires_grad  # Megatron asks grad_scale_func(ones(1)) for MoE aux losses
            or not self.hub.probe.recording
        ):
            return
        self.hub.source_scaled(self._view(scaler), loss)

    def _after_update(self, scaler: Any, before: torch.Tensor | None, found_inf: Any) -> None:
        if self._in_update:
            return  # a subclass's update calling its parent's
        view = self._view(scaler)
        if before is None:
            self.hub.source_step(view, None, None, None)
            return
        with torch.no_grad():
            after = scaler._scale.detach().reshape(()).float().clone()
            if isinstance(found_inf, torch.Tensor):
                found = (found_inf.detach().reshape(()) > 0).float()
            else:
                found = torch.tensor(1.0 if found_inf else 0.0)
        self.hub.source_step(view, before, after, found)


def _number(value: Any) -> float | None:
    """A setting as a float, read only from the CPU (a CUDA tensor would cost a sync)."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() == 1:
        return float(value.reshape(()))
    return None
