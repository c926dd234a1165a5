"""The overhead budget (amprobe.capture.budget): sampled steps spaced by their measured cost."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

import amprobe
from amprobe.capture.budget import SampleBudget
from amprobe.config import Config, ConfigError
from amprobe.report import render_text


def _drive(
    budget: SampleBudget, kind: str, steps: int, step_s: float, sample_s: float
) -> list[int]:
    """Run ``steps`` steps of ``step_s`` seconds; a sampled one takes ``sample_s`` more."""
    taken = []
    for step in range(steps):
        sampled = budget.due(kind, step)
        if sampled:
            taken.append(step)
        budget.end_step(step_s + (sample_s if sampled else 0.0))
    return taken


def test_samples_are_spaced_so_their_cost_stays_within_the_budget():
    budget = SampleBudget(0.01)
    budget.register("numerics", 100, fixed=False)
    # a sample costs 50 steps' time: 1 % allows one every 5,000 steps, not every 100
    taken = _drive(budget, "numerics", 20_000, step_s=0.001, sample_s=0.05)
    assert taken[0] == 0  # the first sample is always taken (it measures the cost)
    gaps = [b - a for a, b in zip(taken, taken[1:], strict=False)]
    assert gaps and min(gaps) >= 4_900, gaps
    assert len(taken) <= 5
    share = budget.spent_s / budget.trained_s
    assert share <= 0.0126, share  # the first sample's debt is paid back, then within 1 %
    summary = budget.summary()
    assert summary["kinds"]["numerics"]["mode"] == "budget"
    assert summary["kinds"]["numerics"]["samples"] == len(taken)
    assert summary["kinds"]["numerics"]["period"] >= 5_000


def test_a_cheap_sample_keeps_its_minimum_period():
    budget = SampleBudget(0.01)
    budget.register("syncs", 50, fixed=False, first=1)
    # a sample costing 0.1 % of a step: the budget never holds it back
    taken = _drive(budget, "syncs", 1_000, step_s=0.1, sample_s=0.0001)
    assert taken == list(range(1, 1_000, 50))


def test_a_fixed_period_is_followed_whatever_it_costs():
    budget = SampleBudget(0.01)
    budget.register("numerics", 1, fixed=True)
    assert _drive(budget, "numerics", 30, step_s=0.001, sample_s=1.0) == list(range(30))
    off = SampleBudget(0.0)  # no budget: the default period, exactly
    off.register("numerics", 10, fixed=False)
    assert _drive(off, "numerics", 35, step_s=0.001, sample_s=1.0) == [0, 10, 20, 30]


def test_the_answer_for_a_step_does_not_change_when_asked_again():
    budget = SampleBudget(0.01)
    budget.register("shapes", 200, fixed=False, first=1)
    assert not budget.due("shapes", 0)
    assert budget.due("shapes", 1) and budget.due("shapes", 1)
    budget.end_step(0.2)
    assert budget.summary()["kinds"]["shapes"]["samples"] == 1


def test_an_armed_sample_is_charged_and_the_deferral_recorded():
    events = []
    budget = SampleBudget(0.01, lambda kind, **detail: events.append((kind, detail)))
    budget.register("numerics", 100, fixed=False)
    _drive(budget, "numerics", 150, step_s=0.001, sample_s=0.05)
    credit = budget.credit
    budget.take("numerics", 150)  # armed by a non-finite loss: taken at once
    budget.end_step(0.051)
    assert budget.credit == pytest.approx(credit - 0.05, abs=1e-9)
    assert [kind for kind, _ in events] == ["sample_deferred"]
    detail = events[0][1]
    assert detail["sample"] == "numerics" and detail["budget"] == 0.01
    assert detail["cost_ms"] == pytest.approx(50.0, rel=0.01)
    assert detail["next_period"] >= 5_000


@pytest.mark.parametrize("bad", [-0.1, 1.5, "1%", True])
def test_overhead_budget_is_validated(bad):
    with pytest.raises(ConfigError, match="overhead_budget"):
        Config(overhead_budget=bad)


def test_default_periods_are_budgeted_and_explicit_ones_fixed():
    assert Config().sample_period("numerics_every") == (100, False)
    assert Config(numerics_every=1).sample_period("numerics_every") == (1, True)
    assert Config(syncs_every=0).sample_period("syncs_every") == (0, True)
    assert Config().sample_period("shapes_every") == (200, False)


def test_a_recorded_run_says_what_the_budget_chose():
    """A real attach with the default configuration: the schedule lands in end.json."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        with amprobe.attach(model=model, optimizer=opt, run_dir=run_dir):
            for _ in range(40):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        end = json.loads((run_dir / "rank0" / "end.json").read_text())
        diagnosis = amprobe.diagnose(amprobe.load_run(run_dir))
    text = render_text(diagnosis)
    line = next(line for line in text.splitlines() if "sampled steps:" in line)
    assert "numerics 1 " in line or "numerics 2 " in line, line
    assert "[budget 1%" in line
    assert diagnosis.to_dict()["run"]["sampling"]["budget"] == 0.01
    sampling = end["sampling"]
    assert sampling["budget"] == 0.01
    assert set(sampling["kinds"]) == {"numerics", "shapes", "syncs"}
    assert sampling["kinds"]["numerics"]["samples"] >= 1  # step 0
    assert sampling["kinds"]["numerics"]["mode"] == "budget"
    assert sampling["typical_step_ms"] > 0


def test_armed_samples_are_declined_once_the_debt_is_deep():
    events = []
    budget = SampleBudget(0.01, lambda kind, **detail: events.append(kind))
    budget.register("numerics", 100, fixed=False)
    _drive(budget, "numerics", 1_000, step_s=0.001, sample_s=0.01)  # cost 10 ms measured
    taken = 0
    for step in range(1_000, 1_200):  # a problem on every step: each one arms a sample
        if budget.take_armed("numerics", step):
            taken += 1
            assert budget.take_armed("numerics", step)  # the same answer when asked again
            budget.end_step(0.011)
        else:
            budget.end_step(0.001)
    # about ten samples' debt, plus what 200 steps of credit repay; never one per step
    assert 10 <= taken <= 13, taken
    assert budget.summary()["kinds"]["numerics"]["armed_declined"] == 200 - taken
    assert events.count("armed_sample_declined") == 1
    fixed = SampleBudget(0.01)
    fixed.register("numerics", 1, fixed=True)
    assert all(fixed.take_armed("numerics", s) for s in range(50))
