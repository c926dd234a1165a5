"""amprobe: a diagnostic profiler and health monitor for mixed-precision training in PyTorch.

Attach it to a training job::

    probe = amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir="runs/exp1")
    ...  # the unchanged training loop
    probe.close()

then diagnose the recording with ``amprobe diagnose runs/exp1`` or :func:`diagnose`.

``import amprobe`` loads the configuration only. Every other public name loads with the module
that defines it, on first use (PEP 562's module ``__getattr__``): the read side (``load_run``,
``Run``, ``diagnose``, ``Diagnosis``, ``Finding``: pandas, never torch), so that a run copied
from a cluster can be diagnosed where torch is not installed; the capture side (``attach``,
``Probe``, ``current_probe``: torch, never pandas), so that a training script that imports
amprobe does not load pandas. A process started by ``amprobe run`` loads the capture side at
once (see the end of this file).
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from amprobe.config import ENV_RUN_DIR, Config, ConfigError
from amprobe.errors import PoisonedCheckpointError
from amprobe.lazy import lazy_names
from amprobe.store.layout import RunLoadError
from amprobe.version import __version__

if TYPE_CHECKING:
    from amprobe.api import attach
    from amprobe.capture.probe import Probe, current_probe
    from amprobe.rules import Diagnosis, Finding, diagnose
    from amprobe.store.loader import Run, load_run

__all__ = [
    "Config",
    "ConfigError",
    "Diagnosis",
    "Finding",
    "PoisonedCheckpointError",
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
#: the read side's public names -> the module that defines them (imported on first access;
#: pandas). ``diagnose`` comes from the rules package, whose import registers every rule.
_READ = {
    "Diagnosis": "amprobe.rules",
    "Finding": "amprobe.rules",
    "diagnose": "amprobe.rules",
    "Run": "amprobe.store.loader",
    "load_run": "amprobe.store.loader",
}
#: read-side packages, as attributes (``amprobe.rules`` after ``import amprobe``, as when this
#: file imported them)
_SUBPACKAGES = ("analysis", "report", "rules", "store")


__getattr__, __dir__ = lazy_names(__name__, {**_CAPTURE, **_READ}, _SUBPACKAGES, globals())


# `amprobe run` (its environment names the run directory): the process is a training job, so
# the capture side loads now, as it always did, and the automatic probe attaches once this
# package is complete (idempotent). Attaching from here, not from the bootstrap's torch-import
# hook, matters when a capture module (`amprobe.capture.probe`, an integration) is imported before
# torch: the hook would fire while that module is half-initialized. Imported by name, like the
# capture side above: outside `amprobe run` the read side never loads it.
if os.environ.get(ENV_RUN_DIR):
    importlib.import_module("amprobe.control.autoattach").activate_from_env()
