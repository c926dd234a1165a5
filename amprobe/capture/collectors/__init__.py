"""Collectors: subscribers to the hub's events that turn a training process into records.

:data:`REGISTRY` maps the names accepted in ``Config.collectors`` to collector classes. Adding a
collector: subclass :class:`Collector`, override the ``on_*`` events it needs, declare its steps
columns in :mod:`amprobe.store.fields`, and register it here. It never patches torch.
"""

from __future__ import annotations

from amprobe.capture.collectors.compiled import CompileCollector
from amprobe.capture.collectors.compute import ComputeCollector
from amprobe.capture.collectors.devicecheck import DeviceCheckCollector
from amprobe.capture.collectors.numerics import NumericsCollector
from amprobe.capture.collectors.prometheus import PrometheusCollector
from amprobe.capture.collectors.replay import ReplayCollector
from amprobe.capture.collectors.replicas import ReplicasCollector
from amprobe.capture.collectors.runtime import RuntimeCollector
from amprobe.capture.collectors.scaler import ScalerCollector
from amprobe.capture.protocol import Collector, StepFacts, due

__all__ = [
    "REGISTRY",
    "Collector",
    "CompileCollector",
    "ComputeCollector",
    "NumericsCollector",
    "PrometheusCollector",
    "ReplayCollector",
    "ReplicasCollector",
    "RuntimeCollector",
    "ScalerCollector",
    "DeviceCheckCollector",
    "StepFacts",
    "due",
]

REGISTRY: dict[str, type[Collector]] = {
    "scaler": ScalerCollector,
    "compile": CompileCollector,
    "numerics": NumericsCollector,
    "compute": ComputeCollector,
    "runtime": RuntimeCollector,
    "prometheus": PrometheusCollector,
    "replay": ReplayCollector,
    "devicecheck": DeviceCheckCollector,
    "replicas": ReplicasCollector,
}
