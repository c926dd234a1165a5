"""Collectors: what runs inside the training process and records it.

:data:`REGISTRY` maps the names accepted in ``Config.collectors`` to collector classes.
"""

from __future__ import annotations

from amprobe.collectors.base import Collector
from amprobe.collectors.compute import ComputeCollector
from amprobe.collectors.discovery import RootModelFinder
from amprobe.collectors.numerics import NumericsCollector
from amprobe.collectors.prometheus import PrometheusCollector
from amprobe.collectors.runtime import RuntimeCollector
from amprobe.collectors.scaler import ScalerCollector

__all__ = [
    "REGISTRY",
    "Collector",
    "ComputeCollector",
    "NumericsCollector",
    "PrometheusCollector",
    "RootModelFinder",
    "RuntimeCollector",
    "ScalerCollector",
]

REGISTRY: dict[str, type[Collector]] = {
    "scaler": ScalerCollector,
    "numerics": NumericsCollector,
    "compute": ComputeCollector,
    "runtime": RuntimeCollector,
    "discovery": RootModelFinder,
    "prometheus": PrometheusCollector,
}
