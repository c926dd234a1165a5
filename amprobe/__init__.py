"""amprobe: a diagnostic profiler and health monitor for mixed-precision training in PyTorch.

Attach it to a training job::

    probe = amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir="runs/exp1")
    ...  # the unchanged training loop
    probe.close()

then diagnose the recording with ``amprobe diagnose runs/exp1`` or :func:`diagnose`.

``import amprobe`` loads the read side only (config, store, rules): a run copied from a cluster
can be diagnosed where torch is not installed. The capture side (``attach``, ``Probe``,
``current_probe``), which needs torch, loads on first use (PEP 562's module ``__getattr__``), or
at once in a process started by ``amprobe run`` (see the end of this file).
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from amprobe.config import ENV_RUN_DIR, Config, ConfigError
from amprobe.rules import Diagnosis, Finding, diagnose
from amprobe.store import Run, RunLoadError, load_run
from amprobe.version import __version__

if TYPE_CHECKING:
    from amprobe.api import attach
    from amprobe.capture.probe import Probe, current_probe

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

#: the capture side's public names -> the module that defines them (imported on first access;
#: each of these modules imports torch)
_CAPTURE = {
    "attach": "amprobe.api",
    "Probe": "amprobe.capture.probe",
    "current_probe": "amprobe.capture.probe",
}


def __getattr__(name: str) -> Any:
    module = _CAPTURE.get(name)
    if module is None:
        raise AttributeError(f"module 'amprobe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain attribute read
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_CAPTURE))


# `amprobe run` (its environment names the run directory): the process is a training job, so
# the capture side loads now, as it always did, and the automatic probe attaches once this
# package is complete (idempotent). Attaching from here, not from the bootstrap's torch-import
# hook, matters when a capture module (`amprobe.capture.probe`, an integration) is imported before
# torch: the hook would fire while that module is half-initialized. Imported by name, like the
# capture side above: outside `amprobe run` the read side never loads it.
if os.environ.get(ENV_RUN_DIR):
    importlib.import_module("amprobe.control.autoattach").activate_from_env()
