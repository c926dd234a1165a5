"""amprobe: a diagnostic profiler and health monitor for mixed-precision training in PyTorch.

Attach it to a training job::

    probe = amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir="runs/exp1")
    ...  # the unchanged training loop
    probe.close()

then diagnose the recording with ``amprobe diagnose runs/exp1`` or :func:`diagnose`.
"""

from __future__ import annotations

__version__ = "0.1.0"

from amprobe.config import Config, ConfigError
from amprobe.probe import Probe, attach, current_probe
from amprobe.rules import Diagnosis, Finding, diagnose
from amprobe.store import Run, RunLoadError, load_run

__all__ = [
    "Config",
    "ConfigError",
    "Diagnosis",
    "Finding",
    "Probe",
    "Run",
    "RunLoadError",
    "__version__",
    "attach",
    "current_probe",
    "diagnose",
    "load_run",
]
