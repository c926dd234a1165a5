"""Training engines that own the loss scale, as sources of the hub's step facts.

:data:`SOURCES` lists them; the hub installs one once the program has imported its module
(``StepSource.module``). See :mod:`amprobe.capture.collectors.engines.base` for the seam.
"""

from __future__ import annotations

from amprobe.capture.collectors.engines.base import EngineScaler, StepSource
from amprobe.capture.collectors.engines.deepspeed import DeepSpeedSource
from amprobe.capture.collectors.engines.megatron import MegatronSource

__all__ = ["SOURCES", "EngineScaler", "StepSource"]

SOURCES: tuple[type[StepSource], ...] = (DeepSpeedSource, MegatronSource)
