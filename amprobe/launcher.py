"""Start a user's command with amprobe active in every Python process it spawns.

Used by ``amprobe run`` and ``amprobe baseline``. The child's exit code and output pass through
unchanged; SIGINT and SIGTERM are forwarded to it; amprobe's own failures after the child ends
never change the exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import amprobe
from amprobe.autoattach import ENV_BASELINE, ENV_CONFIG, ENV_FORCE_FP32, ENV_RUN_DIR
from amprobe.config import ConfigError, make_config

__all__ = ["launch", "bootstrap_env", "LaunchError"]

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "_bootstrap"
PACKAGE_PARENT = Path(__file__).resolve().parent.parent


class LaunchError(Exception):
    """The command could not be started (not found, not executable)."""


def bootstrap_env(
    run_dir: Path,
    config: Mapping[str, Any] | None = None,
    force_fp32: bool = False,
    baseline: Path | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment that activates amprobe in the child processes."""
    env = dict(os.environ if base is None else base)
    parts = [str(BOOTSTRAP_DIR)]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    parts.append(str(PACKAGE_PARENT))  # amprobe itself, after the user's own entries
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env[ENV_RUN_DIR] = str(run_dir.resolve())
    env[ENV_CONFIG] = json.dumps(dict(config or {}))
    if force_fp32:
        env[ENV_FORCE_FP32] = "1"
    else:
        env.pop(ENV_FORCE_FP32, None)
    if baseline is not None:
        env[ENV_BASELINE] = str(baseline.resolve())
    else:
        env.pop(ENV_BASELINE, None)
    return env


def _prepare_run_dir(run_dir: Path, overwrite: bool) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out {str(run_dir)!r} exists and is not a directory")
    if run_dir.exists() and any(run_dir.iterdir()):
        if not (run_dir / "manifest.json").exists() and not any(
            run_dir.glob("rank*/manifest.json")
        ):
            raise ConfigError(
                f"--out {str(run_dir)!r} is a non-empty directory that is not an amprobe run"
            )
        if not overwrite:
            raise ConfigError(
                f"--out {str(run_dir)!r} already holds a run; choose another or pass --overwrite"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)


def launch(
    command: Sequence[str],
    run_dir: Path,
    config: Mapping[str, Any] | None = None,
    force_fp32: bool = False,
    baseline: Path | None = None,
    overwrite: bool = False,
    quiet: bool = False,
) -> int:
    """Run ``command`` recorded into ``run_dir``; return the child's exit code.

    Raises:
        ConfigError: bad config or run directory (before anything is started).
        LaunchError: the command cannot be started.
    """
    if not command:
        raise ConfigError("no command given: use `amprobe run --out DIR -- python train.py`")
    make_config(config)  # validate now, loudly, before starting anything
    _prepare_run_dir(run_dir, overwrite)
    env = bootstrap_env(run_dir, config, force_fp32=force_fp32, baseline=baseline)
    try:
        child = subprocess.Popen(list(command), env=env)
    except FileNotFoundError:
        raise LaunchError(f"command not found: {command[0]}") from None
    except PermissionError:
        raise LaunchError(f"command is not executable: {command[0]}") from None

    def forward(signum: int, frame: Any) -> None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not quiet:
        _print_summary(run_dir)
    return code


def _print_summary(run_dir: Path) -> None:
    """One screen of findings after the child exits; never raises."""
    try:
        run = amprobe.load_run(run_dir)
        diagnosis = amprobe.diagnose(run)
    except Exception as exc:
        print(f"amprobe: nothing to diagnose in {run_dir}: {exc}", file=sys.stderr)
        return
    steps = int(run.steps["step"].nunique()) if len(run.steps) else 0
    if not steps and any((r.manifest.get("config") or {}).get("dormant") for r in run.ranks):
        print(
            f"\namprobe: the job ran dormant and was never attached: nothing recorded in {run_dir}",
            file=sys.stderr,
        )
        return
    print(
        f"\namprobe: recorded {steps} steps on {len(run.ranks)} rank(s) in {run_dir} ({run.status})",
        file=sys.stderr,
    )
    for f in diagnosis.findings[:12]:
        print(f"  [{f.severity}] {f.id} {f.name}: {f.title}", file=sys.stderr)
    if len(diagnosis.findings) > 12:
        print(f"  ... {len(diagnosis.findings) - 12} more", file=sys.stderr)
    if not diagnosis.findings:
        print("  no findings", file=sys.stderr)
    print(f"amprobe: details: amprobe diagnose {run_dir}", file=sys.stderr)
