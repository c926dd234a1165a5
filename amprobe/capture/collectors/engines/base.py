"""The step-facts seam: a training engine that owns the loss scale reports the same step facts
as ``torch.amp.GradScaler`` does.

DeepSpeed and Megatron-core keep their own loss scale and skip the optimizer update on overflow
themselves; a bare GradScaler is never called. A :class:`StepSource` wraps the engine's own
entry points (installed by the hub once the program has imported the engine, removed with the
hub's other patches) and turns them into the hub's calls:

* :meth:`amprobe.capture.hub.Hub.source_scaled`: the unscaled loss of a backward, and the loss scale its
  gradients carry (an :class:`EngineScaler`, the GradScaler-shaped view every collector reads);
* :meth:`amprobe.capture.hub.Hub.source_step`: the engine's optimizer iteration ended: scale before and
  after, found-inf (the update was skipped). This is the step boundary, one per iteration,
  skipped or not;
* :meth:`unwrap`: the user's model inside the engine's wrapper module, so layers keep the names
  the user wrote.

A source never imports its engine: it reads the engine's classes from ``sys.modules`` once the
program has imported them, so amprobe runs without the engine installed. No rule knows which
engine produced the facts.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from amprobe.capture.hub import Hub

__all__ = ["EngineScaler", "StepSource", "called_from"]


class EngineScaler:
    """A GradScaler-shaped view of an engine's loss scaler, for the collectors.

    Carries what the collectors read from a GradScaler: ``_enabled``, ``_scale`` (the current
    loss scale as a 0-d float32 tensor: on the CPU when the engine keeps it as a Python float,
    so reading it costs no sync; on the engine's device when the engine keeps a tensor),
    ``_init_scale``, ``_growth_factor``, ``_backoff_factor``, ``_growth_interval`` and
    ``_device``; plus ``engine`` (which engine), ``scaler_class`` (the engine's class that owns
    the scale) and ``hysteresis`` (overflows in a row before the scale is cut; 1 when it is
    cut at each).
    """

    def __init__(self, engine: str, scaler_class: str, device: str, **settings: Any) -> None:
        self.engine = engine
        self.scaler_class = scaler_class
        self._enabled = True
        self._device = device
        self._scale: torch.Tensor | None = None
        self._init_scale = settings.get("init_scale")
        self._growth_factor = settings.get("growth_factor")
        self._backoff_factor = settings.get("backoff_factor")
        self._growth_interval = settings.get("growth_interval")
        self.hysteresis = settings.get("hysteresis")

    def set_scale(self, scale: Any) -> torch.Tensor | None:
        """Point ``_scale`` at the engine's current scale (a float or a tensor); return it."""
        if isinstance(scale, torch.Tensor):
            value = scale.detach().reshape(()).float()
        elif isinstance(scale, (int, float)):
            value = torch.tensor(float(scale), dtype=torch.float32)
        else:
            return None
        self._scale = value
        return value


def called_from(package_dir: str, depth: int = 2, limit: int = 40) -> bool:
    """True when a frame below the caller's ``depth`` runs code of ``package_dir``."""
    try:
        frame: Any = sys._getframe(depth)
    except ValueError:
        return False
    for _ in range(limit):
        if frame is None:
            return False
        if frame.f_code.co_filename.startswith(package_dir):
            return True
        frame = frame.f_back
    return False


class StepSource:
    """One engine as a source of step facts; see the module docstring.

    Class attributes:
        name: the engine's name (``"deepspeed"``), recorded with its facts.
        module: the engine module whose presence in ``sys.modules`` makes the hub install it.
    """

    name: ClassVar[str] = "engine"
    module: ClassVar[str] = ""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def install(self) -> None:
        """Wrap the engine's entry points through ``self.hub.patch_source``."""

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's model inside ``model`` when ``model`` is this engine's wrapper."""
        return model

    def owns_optimizer_step(self) -> bool:
        """True when the optimizer step now running is one the engine makes itself (its set-up
        step, or the inner step of its own ``step``): no optimizer-step boundary for it."""
        return False

    def on_backward(self, loss: torch.Tensor) -> bool:
        """A scalar backward no engine call announced; True when this source recorded it (a
        loss the program scaled by the engine's scale itself)."""
        return False
