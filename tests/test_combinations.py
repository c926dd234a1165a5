"""Every combination of settings works: the peer tool crashed when two of its modes met.

Each case attaches, trains a few fp16 + GradScaler steps with a planted overflow, closes, and
checks that nothing failed inside the probe, that every iteration is a step, and that the run
loads and diagnoses.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import amprobe
from tests.helpers import TinyNet, free_port, train_loop

COLLECTORS = ("scaler", "numerics", "compute", "runtime", "discovery")
SUBSETS = [
    subset
    for n in range(1, len(COLLECTORS) + 1)
    for subset in itertools.combinations(COLLECTORS, n)
]
FULL_DETAIL = {"numerics_every": 1, "shapes_every": 1, "shapes_captures": 0, "syncs_every": 1}


def _run(tmp_path, config, steps=6, dormant_window=None):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    probe = amprobe.attach(
        model=model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "run", config=config
    )
    try:
        if dormant_window is None:
            train_loop(model, opt, scaler, steps, inf_at=(2,), clip="after_unscale")
        else:
            before, during = dormant_window
            train_loop(model, opt, scaler, before, clip="after_unscale")
            probe.start_recording(during)
            train_loop(model, opt, scaler, steps - before, inf_at=(1,), clip="after_unscale")
    finally:
        probe.close()
    run = amprobe.load_run(tmp_path / "run")
    assert run.events_of("collector_error") == [], run.events_of("collector_error")
    assert not run.warnings, run.warnings
    amprobe.diagnose(run)  # every rule either runs or says why not
    return run


@pytest.mark.parametrize("collectors", SUBSETS, ids=["+".join(s) for s in SUBSETS])
def test_every_collector_subset(tmp_path, collectors):
    run = _run(tmp_path, {"collectors": collectors, "flush_every": 2})
    assert list(run.steps["step"]) == list(range(6)), "step boundaries need no particular collector"
    assert run.steps.set_index("step").loc[2, "skipped"]


@pytest.mark.parametrize(
    "detail, dormant, prometheus",
    list(itertools.product([False, True], repeat=3)),
    ids=lambda v: str(v),
)
def test_modes_together(tmp_path, detail, dormant, prometheus):
    config: dict = {"collectors": COLLECTORS, "flush_every": 2}
    if detail:
        config.update(FULL_DETAIL)
    if dormant:
        config["dormant"] = True
    if prometheus:
        config["prometheus_port"] = free_port()
    run = _run(tmp_path, config, steps=8, dormant_window=(3, 4) if dormant else None)
    steps = list(run.steps["step"])
    if dormant:
        # asked between iterations 2 and 3: applied when iteration 3 ends, so 4 steps from 4 on,
        # with the job's true step numbers (the planted overflow is iteration 4)
        assert steps == [4, 5, 6, 7]
        assert run.steps.set_index("step").loc[4, "skipped"]
    else:
        assert steps == list(range(8))
