"""amprobe: a diagnostic profiler and health monitor for mixed-precision training in PyTorch.

Attach it to a training job::

    probe = amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir="runs/exp1")
    ...  # the unchanged training loop
    probe.close()

then diagnose the recording with ``amprobe diagnose runs/exp1`` or :func:`diagnose`.
"""

from __future__ import annotations

from amprobe.api import attach
from amprobe.config import Config, ConfigError
from amprobe.probe import Probe, current_probe
from amprobe.rules import Diagnosis, Finding, diagnose
from amprobe.store import Run, RunLoadError, load_run
from amprobe.version import __version__

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

# `amprobe run`: when this package is imported before torch, the bootstrap's torch-import hook
# fires while amprobe is still initializing and leaves the automatic probe to this line.
from amprobe.autoattach import activate_from_env as _activate_from_env  # noqa: E402

_activate_from_env()
