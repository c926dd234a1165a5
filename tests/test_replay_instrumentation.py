"""amprobe never blames the user for its own NaN (issue 34, Precisions): a bad step that only
amprobe's statistics variant of the compiled graphs makes non-finite is replayed with and
without that variant and recorded with cause ``instrumentation``.

The fault is planted at the narrowest seam: the model's forward reads the flag amprobe's in-graph
hooks read (:data:`amprobe.capture.collectors.graphstats.GRAPH_SAMPLE`), as those hooks do, and
on the sampled variant multiplies by NaN where a global tensor says so (a tensor: no recompile
when it changes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

import amprobe
from amprobe.capture.collectors.graphstats import GRAPH_SAMPLE

FAULT = torch.zeros((), dtype=torch.bool)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if GRAPH_SAMPLE.on:  # amprobe's sampled variant (two graphs, as amprobe's own hooks)
            h = torch.where(FAULT, torch.full_like(h, float("nan")), h)
        return self.b(h)


def _train(tmp_path, replay_on: str) -> tuple[list[float], list[dict]]:
    torch.manual_seed(0)
    net = Net()
    model = torch.compile(net, backend="aot_eager")
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    run_dir = tmp_path / f"r-{replay_on}"
    probe = amprobe.attach(
        model, opt, scaler, run_dir=run_dir, config={"numerics_every": 5, "replay": replay_on}
    )
    losses = []
    try:
        for step in range(8):
            FAULT.fill_(step == 5)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = out.float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(float(loss.detach()))
    finally:
        FAULT.fill_(False)
        probe.close()
    return losses, amprobe.load_run(run_dir).events_of("replay")


def _train_apart(tmp_path: Path, replay_on: str) -> tuple[list[str], list[dict]]:
    """One job per process: a second ``torch.compile`` in a process that compiled already counts
    as compiled before attach, which gets no in-graph statistics (no sampled variant)."""
    root = Path(__file__).resolve().parents[1]
    code = (
        "import json, sys; from pathlib import Path\n"
        "import amprobe.capture.collectors.replay as replay\n"
        "replay.TIME_FACTOR = 1e4\n"
        "from tests.test_replay_instrumentation import _train\n"
        f"losses, events = _train(Path({str(tmp_path)!r}), {replay_on!r})\n"
        "print(json.dumps([[repr(v) for v in losses], events]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses, events = json.loads(proc.stdout.strip().splitlines()[-1])
    return losses, events


def test_a_nan_only_amprobes_sampled_variant_makes_is_instrumentation(tmp_path):
    losses, events = _train_apart(tmp_path, "on")
    assert [e["step"] for e in events] == [5]
    event = events[0]
    assert event["cause"] == "instrumentation", event
    variants = [x["variant"] for x in event["experiments"]]
    assert variants == ["as it ran", "as it ran, with amprobe's statistics"]
    assert event["experiments"][0]["finite"] and not event["experiments"][1]["finite"]
    off, none = _train_apart(tmp_path, "off")
    assert none == []
    assert losses[5] == off[5] == "nan", "the fault fires on the sampled step, replay or not"
    assert losses == off
