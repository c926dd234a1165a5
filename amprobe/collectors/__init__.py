"""Collectors: subscribers to the hub's events that turn a training process into records.

:data:`REGISTRY` maps the names accepted in ``Config.collectors`` to collector classes. Adding a
collector: subclass :class:`Collector`, override the ``on_*`` events it needs, declare its steps
columns in :mod:`amprobe.store.fields`, and register it here. It never patches torch.
"""

from __future__ import annotations

from amprobe.collectors.base import Collector, StepFacts, due
from amprobe.collectors.compiled import CompileCollector
from amprobe.collectors.compute import ComputeCollector
from amprobe.collectors.discovery import RootModelFinder
from amprobe.collectors.numerics import NumericsCollector
from amprobe.collectors.prometheus import PrometheusCollector
from amprobe.collectors.runtime import RuntimeCollector
from amprobe.collectors.scaler import ScalerCollector

__all__ = [
    "REGISTRY",
    "Collector",
    "CompileCollector",
    "ComputeCollector",
    "NumericsCollector",
    "PrometheusCollector",
    "RootModelFinder",
    "RuntimeCollector",
    "ScalerCollector",
    "StepFacts",
    "due",
]

REGISTRY: dict[str, type[Collector]] = {
    "scaler": ScalerCollector,
    "compile": CompileCollector,
    "numerics": NumericsCollector,
    "compute": ComputeCollector,
    "runtime": RuntimeCollector,
    "discovery": RootModelFinder,
    "prometheus": PrometheusCollector,
}
