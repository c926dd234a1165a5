"""DeepSpeed as a source of step facts: ``DeepSpeedEngine.backward``/``step`` (ZeRO stages 0-2,
fp16 through ``FP16_Optimizer``/``FP16_UnfusedOptimizer`` or ``DeepSpeedZeroOptimizer``, bf16).

* step boundary: ``DeepSpeedEngine.step`` when it reached a gradient-accumulation boundary
  (``global_steps`` advanced), skipped on overflow or not; the optimizer step DeepSpeed makes
  during ``deepspeed.initialize`` (``FP16_UnfusedOptimizer`` initializes its state that way) is
  not an iteration;
* loss scale: the engine optimizer's ``loss_scale`` (a Python float in both fp16 optimizer
  families) before and after ``step``; found-inf: ``engine.skipped_steps`` advanced. Its dynamic
  scaler's hysteresis shows as skipped steps without a cut;
* loss: the loss passed to ``engine.backward`` (divided by the accumulation count, as DeepSpeed
  does), not the scaled loss DeepSpeed backpropagates;
* model: ``engine.module``, so layers keep the user's names.

With ``torch_autocast`` and ZeRO 0 DeepSpeed drives a ``torch.amp.GradScaler``: the hub records
that scaler as usual and this source stays out of the way.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from amprobe.capture.collectors.engines.base import EngineScaler, StepSource, called_from

__all__ = ["DeepSpeedSource"]


def _precision(engine: Any) -> str:
    try:
        if engine.fp16_enabled():
            return "fp16"
        if engine.bfloat16_enabled():
            return "bf16"
    except Exception:
        pass
    return "fp32"


class DeepSpeedSource(StepSource):
    name = "deepspeed"
    module = "deepspeed.runtime.engine"

    def install(self) -> None:
        mod = sys.modules[self.module]
        self._engine_cls = mod.DeepSpeedEngine
        self._pkg = os.path.dirname(os.path.dirname(os.path.abspath(mod.__file__ or ""))) + os.sep
        self._views: dict[int, EngineScaler] = {}
        self._annotated = False
        self._unscaled_noted = False
        self._stepping = 0
        self._models: set[int] = set()
        source = self
        hub = self.hub

        def wrap_backward(orig: Any) -> Any:
            def backward(engine: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
                if not hub.probe.closed:
                    hub.safe(source._on_backward_call, engine, loss, kwargs)
                return orig(engine, loss, *args, **kwargs)

            return backward

        def wrap_step(orig: Any) -> Any:
            def step(engine: Any, *args: Any, **kwargs: Any) -> Any:
                before = None
                if not hub.probe.closed:
                    before = hub.safe(source._before_step, engine)
                source._stepping += 1
                try:
                    result = orig(engine, *args, **kwargs)
                finally:
                    source._stepping -= 1
                if before is not None and not hub.probe.closed:
                    hub.safe(source._after_step, engine, before)
                return result

            return step

        def wrap_forward(orig: Any) -> Any:
            def forward(engine: Any, *args: Any, **kwargs: Any) -> Any:
                if id(engine) not in source._models and not hub.probe.closed:
                    hub.safe(source._register, engine)
                return orig(engine, *args, **kwargs)

            return forward

        hub.patch_source(self._engine_cls, "forward", wrap_forward)
        hub.patch_source(self._engine_cls, "backward", wrap_backward)
        hub.patch_source(self._engine_cls, "step", wrap_step)

    # -- the seam -----------------------------------------------------------------------------
    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        inner = getattr(model, "module", None)
        if isinstance(model, self._engine_cls) and isinstance(inner, torch.nn.Module):
            return inner
        return model

    def owns_optimizer_step(self) -> bool:
        return self._stepping > 0 or called_from(self._pkg, depth=3)

    # -- DeepSpeed's calls ----------------------------------------------------------------------
    def _mine(self, engine: Any) -> bool:
        """False when DeepSpeed drives a torch GradScaler (the hub records that one)."""
        return getattr(engine, "torch_autocast_z0_gradscaler", None) is None

    def _view(self, engine: Any) -> EngineScaler | None:
        """The engine's fp16 loss scaler (None in bf16/fp32: nothing scales the loss)."""
        if _precision(engine) != "fp16":
            return None
        view = self._views.get(id(engine))
        if view is None:
            opt = engine.optimizer
            cfg = getattr(opt, "loss_scale_config", None) or getattr(opt, "loss_scaler", None)
            dynamic = bool(getattr(cfg, "dynamic_loss_scale", getattr(cfg, "dynamic", False)))
            factor = getattr(cfg, "scale_factor", None)
            view = EngineScaler(
                "deepspeed",
                type(opt).__name__,
                str(getattr(engine, "device", "cpu")),
                init_scale=getattr(opt, "loss_scale", None),
                growth_factor=factor if dynamic else 1.0,
                backoff_factor=(1.0 / factor) if dynamic and factor else 1.0,
                growth_interval=getattr(cfg, "scale_window", None),
                hysteresis=getattr(cfg, "delayed_shift", getattr(cfg, "hysteresis", 1)),
            )
            self._views[id(engine)] = view
        return view

    def _grad_scale(self, engine: Any) -> float:
        """The scale ``engine.backward`` multiplies the loss by, as it decides: a ZeRO optimizer's
        loss scale; 1 for ``FP16_Optimizer``/``FP16_UnfusedOptimizer`` (ZeRO 0), whose loss
        DeepSpeed 0.19 backpropagates unscaled although ``step`` divides by ``loss_scale``."""
        opt = engine.optimizer
        zero = getattr(sys.modules.get("deepspeed.runtime.base_optimizer"), "ZeROOptimizer", None)
        if zero is not None and isinstance(opt, zero) and getattr(opt, "loss_scaler", None):
            return float(opt.loss_scale)
        if not self._unscaled_noted:
            self._unscaled_noted = True
            self.hub.probe.event(
                "engine_loss_not_scaled",
                engine="deepspeed",
                optimizer=type(opt).__name__,
                loss_scale=float(getattr(opt, "loss_scale", 1.0) or 1.0),
            )
        return 1.0

    def _annotate(self, engine: Any) -> None:
        self._annotated = True
        facts: dict[str, Any] = {"engine": "deepspeed", "engine_precision": _precision(engine)}
        try:
            facts["engine_zero_stage"] = int(engine.zero_optimization_stage())
            facts["engine_optimizer"] = type(engine.optimizer).__name__
            facts["engine_version"] = str(getattr(sys.modules.get("deepspeed"), "__version__", ""))
        except Exception:
            pass
        self.hub.probe.annotate_manifest(**facts)

    def _register(self, engine: Any) -> None:
        """The engine's model is a root (its optimizer trains fp32 master copies, so discovery
        by trained parameters cannot find it); the user's module inside, as the user named it."""
        self._models.add(id(engine))
        if isinstance(getattr(engine, "module", None), torch.nn.Module):
            self.hub.probe.add_model(engine.module, found_by="engine")

    def _on_backward_call(self, engine: Any, loss: Any, kwargs: dict[str, Any]) -> None:
        if not self._mine(engine) or not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        if not self.hub.probe.recording:
            return
        if kwargs.get("scale_wrt_gas", True):
            gas = int(engine.gradient_accumulation_steps())
            if gas > 1:
                with torch.no_grad():
                    loss = loss.detach() / gas
        view = self._view(engine)
        if view is not None:
            view.set_scale(self._grad_scale(engine))  # what this backward's gradients carry
        self.hub.source_scaled(view, loss)

    def _before_step(self, engine: Any) -> tuple[int, int, torch.Tensor | None] | None:
        if not self._mine(engine):
            return None
        if not self._annotated:
            self._annotate(engine)
        view = self._view(engine)
        scale = _scale_of(engine) if view is not None else None
        return int(engine.global_steps), int(engine.skipped_steps), scale

    def _after_step(self, engine: Any, before: tuple[int, int, torch.Tensor | None]) -> None:
        steps, skipped, scale_before = before
        if int(engine.global_steps) == steps:
            return  # a micro-batch between accumulation boundaries: no optimizer iteration
        view = self._views.get(id(engine))
        scale_after = _scale_of(engine) if view is not None else None
        found = int(engine.skipped_steps) - skipped
        found_inf = torch.tensor(float(found)) if view is not None or found else None
        self.hub.source_step(view, scale_before, scale_after, found_inf)


def _scale_of(engine: Any) -> torch.Tensor:
    """The engine optimizer's loss scale (a Python float in DeepSpeed) as a CPU tensor."""
    return torch.tensor(float(engine.optimizer.loss_scale), dtype=torch.float32)
