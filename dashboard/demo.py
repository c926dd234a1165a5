"""Runs to look at: a small real AMP recording and synthetic run directories.

Used by the tests, the screenshot script and the benchmark. :func:`record_amp_run` records a
real run with :func:`amprobe.attach` on a tiny CPU model (fp16 autocast, ``GradScaler("cpu")``,
an injected inf to force a backoff); :func:`write_synthetic_run` writes a run directory in the
documented JSON Lines layout (:mod:`amprobe.store.schema`) directly, fast enough for 100,000
steps; :class:`SyntheticLiveRun` appends steps to one while a dashboard watches it.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path

import numpy as np
import torch

import amprobe

__all__ = ["record_amp_run", "write_synthetic_run", "SyntheticLiveRun"]


def record_amp_run(
    run_dir: str | os.PathLike[str],
    steps: int = 40,
    inf_steps: tuple[int, ...] = (12, 13),
    seed: int = 0,
) -> Path:
    """Record a real run: a tiny MLP on CPU under fp16 autocast with a GradScaler.

    The loss is multiplied by inf at ``inf_steps`` so the scaler skips those steps and backs off.
    """
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    probe = amprobe.attach(model, opt, scaler, run_dir=run_dir, config={"flush_every": 5})
    try:
        for i in range(steps):
            x = torch.randn(8, 16)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            if i in inf_steps:
                loss = loss * float("inf")
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    finally:
        probe.close()
    return Path(run_dir)


def _manifests(run_dir: Path, live: bool) -> None:
    (run_dir / "rank0").mkdir(parents=True, exist_ok=True)
    top = {
        "format": "amprobe-run",
        "schema_version": 1,
        "world_size": 1,
        "argv": ["synthetic"],
        "hostname": socket.gethostname(),
        "created_unix": time.time(),
    }
    rank = {
        "format": "amprobe-run",
        "schema_version": 1,
        "rank": 0,
        "world_size": 1,
        "device": "cuda:0",
        "gpu_name": "synthetic GPU",
        "hostname": socket.gethostname(),
        # a live run is one whose writing process is alive on this host: this one
        "pid": os.getpid() if live else 0,
        "start_unix": time.time(),
    }
    (run_dir / "manifest.json").write_text(json.dumps(top))
    (run_dir / "rank0" / "manifest.json").write_text(json.dumps(rank))


def _step_rows(
    start: int,
    count: int,
    rng: np.random.Generator,
    scale: float = 65536.0,
    growth_interval: int = 500,
    overflow_above: float = 2.0**17,
    overflow_chance: float = 0.001,
) -> list[str]:
    """Steps of a dynamic loss scaler: overflow once the scale passes ``overflow_above`` or at random."""
    lines = []
    tracker = 0
    for step in range(start, start + count):
        overflow = scale >= overflow_above or float(rng.random()) < overflow_chance
        before = scale
        if overflow:
            scale, tracker = scale / 2, 0
        else:
            tracker += 1
            if tracker >= growth_interval:
                scale, tracker = scale * 2, 0
        wall = 0.05 + 0.005 * float(rng.standard_normal()) ** 2
        lines.append(
            json.dumps(
                {
                    "step": step,
                    "window": 0,
                    "t": step * 0.05,
                    "wall_s": wall,
                    "probe_s": 0.0002,
                    "scaler_enabled": True,
                    "scale_before": before,
                    "scale_after": scale,
                    "growth_tracker": tracker,
                    "found_inf": 1.0 if overflow else 0.0,
                    "skipped": overflow,
                    "opt_steps": 0 if overflow else 1,
                    "unscale_calls": 1,
                    "clip_calls": 0,
                    "clip_scaled": 0,
                    "loss": 0.5 + 3.5 * math.exp(-step / 5000) + 0.1 * float(rng.random()),
                    "loss_dtype": "float32",
                    "autocast_device": "cuda",
                    "autocast_dtype": "float16",
                }
            )
        )
    return lines


def write_synthetic_run(
    run_dir: str | os.PathLike[str], steps: int, live: bool = False, seed: int = 0
) -> Path:
    """Write a run directory with ``steps`` fp16 steps (periodic overflow, scale growth).

    With ``live`` the rank manifest names this process, so the run reads as live until
    :class:`SyntheticLiveRun` closes it; otherwise an ``end.json`` marks it finished.
    """
    path = Path(run_dir)
    _manifests(path, live)
    rng = np.random.default_rng(seed)
    lines = _step_rows(0, steps, rng)
    (path / "rank0" / "steps.jsonl").write_text("\n".join(lines) + ("\n" if lines else ""))
    events = [
        {"step": 0, "t": 0.0, "kind": "run_start", "detail": json.dumps({"recording": True})},
        {
            "step": 0,
            "t": 0.0,
            "kind": "autocast_seen",
            "detail": json.dumps({"device": "cuda", "dtype": "float16", "enabled": True}),
        },
    ]
    (path / "rank0" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if not live:
        (path / "rank0" / "end.json").write_text(json.dumps({"final_step": steps}))
    return path


class SyntheticLiveRun:
    """A synthetic run that grows: :meth:`append` adds steps, :meth:`close` finishes it."""

    def __init__(self, run_dir: str | os.PathLike[str], steps: int = 0, seed: int = 0) -> None:
        self.path = write_synthetic_run(run_dir, steps, live=True, seed=seed)
        self.steps = steps
        self._rng = np.random.default_rng(seed + 1)

    def append(self, count: int) -> None:
        lines = _step_rows(self.steps, count, self._rng, scale=self._scale())
        with open(self.path / "rank0" / "steps.jsonl", "a", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        self.steps += count

    def _scale(self) -> float:
        try:
            with open(self.path / "rank0" / "steps.jsonl", "rb") as fh:
                last = fh.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
            return float(json.loads(last)["scale_after"])
        except (OSError, ValueError, KeyError, IndexError):
            return 65536.0

    def close(self) -> None:
        (self.path / "rank0" / "end.json").write_text(json.dumps({"final_step": self.steps}))
