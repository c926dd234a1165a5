"""AMP-N03, AMP-N11 and the run's step count read the per-rank summaries, not the merged
``steps`` frame of every rank (issue #33): a run written by the real writer, and the summary
measures checked against the same measures of the rows."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

import amprobe
from amprobe.analysis.scaler import rank_scaler, rank_scaler_rows, scaled_before
from amprobe.rules import precision, scaler
from amprobe.store.writer import RunWriter
from tests.helpers import fake_run
from tests.trajectories import scaled_steps, scaler_event

#: rank -> the steps whose update cut the scale (60 steps each)
CUTS = {0: (30,), 1: tuple(range(10, 30)), 2: (5, 40)}


def _write_ranks(root: Path, steps: int = 60) -> Path:
    for rank, cuts in CUTS.items():
        writer = RunWriter(
            root,
            rank,
            len(CUTS),
            {"device": "cpu", "bf16_supported": True},
            max_buffered_rows=10_000,
        )
        rows = scaled_steps(steps, cuts=cuts, init=65536.0)
        for row in rows:
            row.pop("rank")
            row.update(window=0, t=row["step"] * 0.1, wall_s=0.01)
        detail = {k: v for k, v in scaler_event().items() if k != "kind"}
        writer.append(
            "events",
            [{"step": 0, "t": 0.0, "kind": "scaler_created", "detail": json.dumps(detail)}],
        )
        writer.append("steps", rows[: steps // 2])
        writer.flush()
        writer.append("steps", rows[steps // 2 :])
        writer.close({"status": "finished", "steps": steps})
    return root


def test_diagnose_of_a_multi_rank_run_reads_no_merged_steps(tmp_path: Path) -> None:
    run = amprobe.load_run(_write_ranks(tmp_path / "run"))
    diagnosis = amprobe.diagnose(run)
    out = diagnosis.to_dict()
    found = {f.id: f for f in diagnosis.findings}
    assert found["AMP-N03"].evidence["rank"] == 1
    assert {
        k: found["AMP-N03"].evidence[k]
        for k in ("min_scale", "consecutive_cut_count", "cut_run_starts_at_step")
    } == {"min_scale": 65536.0 / 2**20, "consecutive_cut_count": 20, "cut_run_starts_at_step": 10}
    assert found["AMP-N03"].evidence["first_step_below_min"] == 26  # 65536 / 2**17 < 1
    n11 = found["AMP-N11"].evidence
    assert (n11["rank"], n11["scale_cut_count"], n11["skipped_steps"]) == (0, 1, [30])
    assert n11["skipped_share"] == round(1 / 60, 4)
    assert out["run"]["steps"] == 60
    assert (scaled_before(run, 2, 0), scaled_before(run, 2, 1)) == (False, True)  # for AMP-N05
    assert "steps" not in run._tables  # no rule, requirement, health metric or count read it
    assert "numerics" not in run._tables


def _trajectory(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """A scaler trajectory with cuts, growth, resets, NaN scales, gaps and skipped steps."""
    rows, scale, step = [], 2.0 ** rng.randint(0, 16), 0
    for _ in range(n):
        step += 1 if rng.random() < 0.9 else rng.randint(2, 4)
        if rng.random() < 0.05:
            scale = 65536.0  # a new scaler
        roll = rng.random()
        after = scale / 2 if roll < 0.3 else scale * 2 if roll < 0.4 else scale
        if rng.random() < 0.02:
            after = math.nan
        rows.append(
            {
                "step": step,
                "scaler_enabled": True,
                "scale_before": scale,
                "scale_after": after,
                "skipped": roll < 0.3 or rng.random() < 0.05,
                "autocast_dtype": "float16",
            }
        )
        scale = 65536.0 if math.isnan(after) else after
    return rows


@pytest.mark.parametrize("seed", range(12))
def test_summary_measures_equal_the_rows_measures(seed: int) -> None:
    rng = random.Random(seed)
    rows = _trajectory(rng, rng.randint(1, 120))
    run = fake_run(steps=rows, events=[scaler_event()])
    facts, frame = rank_scaler(run, 0), rank_scaler_rows(run, 0)
    assert facts["ordered"] and facts["complete"]
    for threshold in (1.0, 2.0**10, 2.0**15):
        got = scaler._collapse_facts(facts, threshold)
        want = scaler._collapse_rows(frame, threshold)
        assert got[1:] == want[1:]
        assert got[0] == want[0] or (math.isnan(got[0]) and math.isnan(want[0]))
    steps = [r["step"] for r in rows]
    for left_out in (set(), set(rng.sample(steps, min(len(steps), 5))), set(steps)):
        assert precision._overflow_facts(facts, left_out) == precision._overflow_rows(
            frame, left_out
        )


def test_a_rank_whose_steps_repeat_is_judged_from_its_rows() -> None:
    # two windows counting steps from 0: the runs of steps cannot place the rows, so N03 and
    # N11 read the rank's rows in step order (stable), as per_rank(scaler_steps) gave them
    rows = scaled_steps(20, cuts=range(20), window=0) + scaled_steps(20, window=1)
    run = fake_run(steps=rows, events=[scaler_event()])
    assert not rank_scaler(run, 0)["ordered"]
    found = {f.id: f.evidence for f in amprobe.diagnose(run).findings}
    n03 = found["AMP-N03"]
    assert (n03["min_scale"], n03["consecutive_cut_count"], n03["first_step_below_min"]) == (
        65536.0 / 2**20,
        1,  # window 1's uncut step 0 follows window 0's cut step 0
        16,
    )
    n11 = found["AMP-N11"]  # step 0 is the calibration: both its rows left out
    assert (n11["scale_cut_count"], n11["skipped_share"]) == (19, 0.5)
    assert n11["skipped_step_ranges"] == [[1, 19]]
