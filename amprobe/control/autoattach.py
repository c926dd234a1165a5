"""Zero-code attach: what ``amprobe run`` activates inside every Python process it starts.

``amprobe run`` puts ``amprobe/control/_bootstrap`` first on ``PYTHONPATH``; its ``sitecustomize``
waits until the process imports torch and then calls :func:`activate_from_env`, which attaches
an automatic probe. The probe writes nothing until the process runs a training step, so the
launcher processes (torchrun's agent, helper scripts) leave no trace. Root models are found by
a temporary global forward hook: the modules called at depth 0 whose parameters the optimizer
updates.

Environment (set by the CLI):
    AMPROBE_RUN_DIR: the run directory (required to activate).
    AMPROBE_CONFIG: JSON object of :class:`amprobe.Config` fields.
    AMPROBE_FORCE_FP32: "1" disables autocast and GradScalers (the FP32 baseline).
    AMPROBE_BASELINE: path of the FP32 baseline run, recorded in the manifest of this run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from typing import Any

from torch.amp import GradScaler
from torch.amp.autocast_mode import autocast

from amprobe.capture.probe import attach, current_probe
from amprobe.config import ENV_BASELINE, ENV_CONFIG, ENV_FORCE_FP32, ENV_RUN_DIR, make_config
from amprobe.control.watcher import start_control

__all__ = ["activate_from_env", "ENV_RUN_DIR", "ENV_CONFIG", "ENV_FORCE_FP32", "ENV_BASELINE"]


def _force_fp32() -> None:
    """Turn every autocast region and GradScaler of this process off (the FP32 baseline)."""
    autocast_init = autocast.__init__
    scaler_init = GradScaler.__init__

    def __init__(self: autocast, *args: Any, **kwargs: Any) -> None:
        autocast_init(self, *args, **kwargs)
        self._enabled = False

    def scaler_init_fp32(self: GradScaler, *args: Any, **kwargs: Any) -> None:
        kwargs["enabled"] = False
        if len(args) > 4:  # enabled is the 5th positional parameter after device
            args = args[:4]
        scaler_init(self, *args, **kwargs)

    autocast.__init__ = __init__  # type: ignore[method-assign]
    GradScaler.__init__ = scaler_init_fp32  # type: ignore[method-assign]


def _close_on_sigterm() -> None:
    """Close the probe on SIGTERM when the program has no handler of its own, then die as asked."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def handler(signum: int, frame: Any) -> None:
        probe = current_probe()
        if probe is not None:
            with contextlib.suppress(Exception):
                probe.event("terminated", signal=signum)
                probe.close(ended_by=signal.Signals(signum).name)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, handler)


def activate_from_env() -> Any:
    """Attach the automatic probe if ``AMPROBE_RUN_DIR`` is set. Never raises into the program.

    Idempotent: a process where the probe is already attached keeps it.
    """
    run_dir = os.environ.get(ENV_RUN_DIR)
    if not run_dir:
        return None
    try:
        if current_probe() is not None:
            return current_probe()
        overrides = json.loads(os.environ.get(ENV_CONFIG) or "{}")
        cfg = make_config(overrides)
        if os.environ.get(ENV_FORCE_FP32) == "1":
            _force_fp32()
        probe = attach(
            run_dir=run_dir, config=cfg, adoptable=True, lazy=True, on_announce=start_control
        )
        facts: dict[str, Any] = {"launched_by": "amprobe run"}
        if os.environ.get(ENV_FORCE_FP32) == "1":
            facts["forced_fp32"] = True
        if os.environ.get(ENV_BASELINE):
            facts["baseline_run"] = os.environ[ENV_BASELINE]
        probe.annotate_manifest(**facts)
        _close_on_sigterm()
        return probe
    except Exception as exc:  # amprobe's failure must never break the user's program
        print(f"amprobe: not recording this process: {exc}", file=sys.stderr)
        return None
