"""What the framework callbacks share: live metrics, the end-of-training summary, config checks."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from amprobe.capture.probe import Probe
from amprobe.config import Config, make_config
from amprobe.report.summary import print_run_summary

__all__ = ["PREFIX", "METRIC_KEYS", "check_config", "live_metrics", "print_summary"]

PREFIX = "amprobe/"

#: The live metrics the callbacks push into the framework's logging, keyed by the name the
#: probe's accessor gives them, and what they mean.
METRIC_KEYS: Mapping[str, str] = {
    "loss_scale": "GradScaler loss scale after the last recorded update()",
    "skipped_steps": "iterations whose optimizer update the GradScaler skipped so far (count)",
    "nonfinite_layers": "layers whose output or gradient held inf/NaN on sampled steps (count)",
}


def check_config(config: Config | Mapping[str, Any] | None) -> Config:
    """Validate ``config`` now (raises :class:`amprobe.ConfigError` with the fix)."""
    return make_config(config)


def live_metrics(probe: Probe | None) -> dict[str, float]:
    """The probe's live metrics, namespaced ``amprobe/<name>``; empty when it exposes none.

    Reads only values the probe already holds as Python numbers (materialized at its last
    flush): no host-device sync. The probe provides them through ``Probe.live_metrics()``;
    a probe without that accessor yields nothing (see the integration tests).
    """
    if probe is None or probe.closed:
        return {}
    accessor = getattr(probe, "live_metrics", None)
    if accessor is None:
        return {}
    try:
        values = accessor()
    except Exception:  # metrics are best effort; never raise into the training loop
        return {}
    out: dict[str, float] = {}
    for key in METRIC_KEYS:
        value = values.get(key) if isinstance(values, Mapping) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[PREFIX + key] = float(value)
    return out


def print_summary(run_dir: str | Path) -> None:
    """The run directory and its findings on stderr, as ``amprobe run`` prints them. Never raises."""
    print_run_summary(Path(run_dir))
