"""Collectors: what runs inside the training process and records it.

:data:`REGISTRY` maps the names accepted in ``Config.collectors`` to collector classes.
"""

from __future__ import annotations

from amprobe.collectors.base import Collector
from amprobe.collectors.discovery import RootModelFinder
from amprobe.collectors.prometheus import PrometheusCollector
from amprobe.collectors.scaler import ScalerCollector

__all__ = ["REGISTRY", "Collector", "PrometheusCollector", "RootModelFinder", "ScalerCollector"]

REGISTRY: dict[str, type[Collector]] = {
    "scaler": ScalerCollector,
    "discovery": RootModelFinder,
    "prometheus": PrometheusCollector,
}
