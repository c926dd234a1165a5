"""The embedded demo: a small model trained with planted AMP faults, recorded and diagnosed.

Everything is generated in-process (no download). On a CUDA machine it trains on the GPU,
elsewhere with CPU autocast. :func:`train` is also what ``sample_runs/generate.py`` uses to
record the golden sample runs.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from amprobe.capture.probe import attach

__all__ = ["FAULTS", "DemoModel", "DemoResult", "train", "run_demo"]

#: fault name -> what it plants
FAULTS: dict[str, str] = {
    "overflow": "a layer whose output is multiplied by 1e6 for a stretch of steps: fp16 overflows, "
    "every step in the stretch is skipped and the loss scale collapses",
    "clip_before_unscale": "clip_grad_norm_ runs before scaler.unscale_ (clips scaled gradients)",
    "scaler_in_loop": "a new GradScaler is built every 25 steps inside the loop",
    "resume_without_scaler": "a checkpoint restores model and optimizer but not the scaler",
    "half_loss": "the loss is computed from fp16 logits",
    "nan_input": "one data batch holds a NaN",
    "outlier_channel": "one output channel of proj is 2**12 times larger than the others (an "
    "outlier feature): too wide a range for fp8 even with per-tensor scaling",
}
#: how much larger the planted outlier channel is
OUTLIER_FACTOR = 2.0**12


class Booster(nn.Module):
    """Multiplies its input by ``factor``: the planted overflow when factor is huge."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor if self.factor != 1.0 else x


class DemoModel(nn.Module):
    """A small MLP classifier (about 70k parameters) with a planted booster layer."""

    def __init__(self, d_in: int = 64, hidden: int = 128, classes: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, hidden)
        self.act1 = nn.GELU()
        self.booster = Booster()
        self.proj = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.act2 = nn.GELU()
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.booster(self.act1(self.embed(x)))
        x = self.act2(self.norm(self.proj(x)))
        return self.head(x)


@dataclass(frozen=True)
class DemoResult:
    run_dir: Path
    steps: int
    faults: tuple[str, ...]


def _batches(
    steps: int, batch: int, d_in: int, classes: int, seed: int
) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(d_in, classes, generator=g)
    for _ in range(steps):
        x = torch.randn(batch, d_in, generator=g)
        yield x, (x @ teacher).argmax(dim=1)


#: how the demo records: the default periods exactly, and a replay budget that no machine's
#: speed cuts short (its experiments then print the same verified fix everywhere; jobs keep the
#: default 10x). The screenshots and the tests that record the demo use it too.
DEMO_CONFIG: dict[str, object] = {"overhead_budget": 0, "replay_time_factor": 200}


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def train(
    run_dir: str | Path,
    faults: Iterable[str] = ("overflow", "clip_before_unscale"),
    steps: int = 300,
    dtype: torch.dtype = torch.float16,
    use_scaler: bool = True,
    init_scale: float = 2.0**16,
    growth_interval: int = 50,
    device: torch.device | None = None,
    config: Mapping[str, Any] | None = None,
    progress: bool = False,
    seed: int = 0,
) -> DemoResult:
    """Train the demo model for ``steps`` iterations with ``faults`` planted, recording a run.

    Raises:
        ValueError: an unknown fault name.
    """
    faults = tuple(faults)
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")
    device = device or default_device()
    torch.manual_seed(seed)
    model = DemoModel().to(device)
    if "outlier_channel" in faults:
        with torch.no_grad():
            model.proj.weight[0].mul_(OUTLIER_FACTOR)
            model.proj.bias[0].mul_(OUTLIER_FACTOR)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def new_scaler() -> torch.amp.GradScaler:
        return torch.amp.GradScaler(
            device.type, init_scale=init_scale, growth_interval=growth_interval, enabled=use_scaler
        )

    scaler = new_scaler()
    overflow_span = range(int(steps * 0.4), int(steps * 0.6))
    bar: Any = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="demo training", unit="step")
    probe = attach(model=model, optimizer=opt, scaler=scaler, run_dir=run_dir, config=config)
    try:
        for i, (x, y) in enumerate(_batches(steps, 64, 64, 16, seed)):
            x, y = x.to(device), y.to(device)
            if "nan_input" in faults and i == steps // 4:
                x[0, 0] = float("nan")
            if "scaler_in_loop" in faults and i > 0 and i % 25 == 0:
                scaler = new_scaler()
            if "resume_without_scaler" in faults and i == steps // 2:
                state = {"model": model.state_dict(), "opt": opt.state_dict()}
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
                scaler = (
                    new_scaler()
                )  # the restored job builds a fresh scaler and never loads its state
            model.booster.factor = 1e6 if ("overflow" in faults and i in overflow_span) else 1.0
            with torch.autocast(device.type, dtype=dtype):
                logits = model(x)
                if "half_loss" not in faults:
                    loss = nn.functional.cross_entropy(logits.float(), y)
            if "half_loss" in faults:  # outside autocast, so nothing promotes it to fp32
                loss = nn.functional.cross_entropy(logits.half(), y)
            scaler.scale(loss).backward()
            if "clip_before_unscale" in faults:
                nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            else:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if bar is not None:
                bar.update(1)
    finally:
        probe.close()
        if bar is not None:
            bar.close()
    return DemoResult(run_dir=Path(run_dir), steps=steps, faults=faults)


def run_demo(out: str | Path = "amprobe-demo", steps: int = 300, progress: bool = True) -> Path:
    """Train with the default planted faults into ``out/run`` (replacing a previous demo run).

    ``amprobe demo`` then diagnoses the run and writes ``out/report.html``.

    Returns:
        The run directory.
    """
    out = Path(out)
    run_dir = out / "run"
    if (run_dir / "manifest.json").exists():
        shutil.rmtree(run_dir)  # the demo owns this folder: replace the previous demo run
    with contextlib.suppress(FileExistsError):
        out.mkdir(parents=True, exist_ok=True)
    # the default sampling periods exactly, not spaced by measured step times: the demo prints
    # the same findings on every machine (README shows them)
    train(run_dir, steps=steps, progress=progress, config=dict(DEMO_CONFIG))
    return run_dir
