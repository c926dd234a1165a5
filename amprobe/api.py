"""The public attach call: the capture core plus the control channel a dormant probe needs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from amprobe.capture.probe import Probe
from amprobe.capture.probe import attach as _attach
from amprobe.config import Config
from amprobe.control.watcher import start_control

__all__ = ["attach"]


def attach(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    config: Config | Mapping[str, Any] | None = None,
) -> Probe:
    """Start recording this training process.

    Everything is optional: the GradScalers, optimizers and autocast regions of the process are
    found through class-level hooks; passing them only records them from the first step. Under
    ``amprobe run`` this joins the automatic probe instead of attaching a second one.

    Args:
        model: the root module being trained. Without it, each top-level module whose
            parameters an optimizer trains is taken as a root at its first forward (or at
            the end of the first step, for an optimizer created before attaching), and the
            per-layer collectors record it from then on. Models trained beside the one passed
            (two models, two optimizers) are found the same way in the first step.
        optimizer: an optimizer to record from the start.
        scaler: a GradScaler created before attaching.
        run_dir: directory to write the run to; default ``amprobe_runs/<time>-<pid>``.
        config: a :class:`Config` or a dict of its fields.

    Returns:
        The attached :class:`Probe` (also a context manager).

    Raises:
        ConfigError: an unknown config key, a bad value, an unusable run directory, or a
            second probe attached in the same process.
    """
    return _attach(model, optimizer, scaler, run_dir, config, on_announce=start_control)
