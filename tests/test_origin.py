"""AMP-D04 rank-nonfinite-origin: the rank where a multi-rank job's non-finite value was produced.

Unit tests of the rule on hand-built runs (the ranks' step records, offenders and replay
events), then gloo jobs under ``amprobe run -- torchrun`` (tests/scripts/origin_gloo.py):
2-rank and 4-rank DDP and HSDP (FSDP2 on a 2x2 DeviceMesh) with a GradScaler and CPU autocast
fp16, a NaN in one rank's batch, an inf from one rank's layer and a backward-only overflow on
one rank, each on a rank other than 0; healthy runs; losses bit-identical with amprobe off.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import amprobe
from amprobe.report.evidence import evidence_lines
from amprobe.rules import diagnose
from tests.helpers import fake_run, run_gloo_job, run_jobs, torchrun_argv

ROOT = Path(__file__).resolve().parent.parent

ON = {"config": {"replay": "on", "replay_max": 3, "collectors": ["scaler", "replay"]}}


def _steps(rank: int, n: int = 10, skipped: tuple[int, ...] = (), scaler: bool = True, **per):
    """``rank``'s step rows; ``per`` maps a field to ``{step: value}``."""
    rows, scale = [], 256.0
    for i in range(n):
        skip = i in skipped
        after = scale / 2 if skip else scale
        row: dict[str, Any] = {"rank": rank, "step": i, "wall_s": 0.01, "input_nonfinite": 0}
        row["loss_nonfinite"] = False
        if scaler:
            row.update(
                scaler_enabled=True,
                scale_before=scale,
                scale_after=after,
                skipped=skip,
                found_inf=float(skip),
            )
        for key, at in per.items():
            if i in at:
                row[key] = at[i]
        rows.append(row)
        scale = after
    return rows


def _replay(rank: int, step: int, local_finite: bool | None, **more: Any) -> dict[str, Any]:
    forward = more.pop("forward_finite", True)
    grads = more.pop("grads_finite", True)
    first = more.pop("first", None)
    return {
        "kind": "replay",
        "rank": rank,
        "step": step,
        "replayed": True,
        "trigger": "skipped_update",
        "cause": more.pop("cause", "data-or-model" if local_finite is False else "not-reproduced"),
        "world_size": more.pop("world", 2),
        "local_finite": local_finite,
        "first_nonfinite": first,
        "experiments": [
            {
                "variant": "as it ran",
                "finite": bool(local_finite),
                "forward_finite": forward,
                "grads_finite": grads,
                "first_nonfinite": first,
            }
        ],
        **more,
    }


def _d04(run) -> tuple[list[Any], str | None]:
    d = diagnose(run)
    reasons = {n.id: n.reason for n in d.not_checked}
    return [f for f in d.findings if f.id == "AMP-D04"], reasons.get("AMP-D04")


def _manifest(**more: Any) -> dict[str, Any]:
    return {**ON, "hostname": "node-a", "local_rank": 0, **more}


# -- the rule on hand-built runs ---------------------------------------------------------------
def test_nan_input_on_rank_2_of_4_named_others_received():
    rows = [r for k in range(4) for r in _steps(k, skipped=(5,))]
    for r in rows:
        if r["rank"] == 2 and r["step"] == 5:
            r.update(input_nonfinite=3, loss_nonfinite=True)
    found, reason = _d04(fake_run(steps=rows, ranks=range(4), manifest=_manifest()))
    assert reason is None and len(found) == 1
    f = found[0]
    assert f.severity == "error" and f.name == "rank-nonfinite-origin"
    assert f.evidence["origin"] == {
        "rank": 2,
        "hostname": "node-a",
        "local_rank": 0,
        "device": "cpu",
        "step": 5,
        "what": "input",
        "layer": None,
    }
    assert f.evidence["received"] == [0, 1, 3]
    assert "rank 2 (node-a, local rank 0, cpu) produced the first non-finite value at step 5" in (
        f.title
    )
    assert "ranks 0-1, 3 received it through the all-reduce" in f.title
    text = "\n".join(evidence_lines(f))
    assert "produced it" in text and "received it through the all-reduce" in text
    assert "{" not in text  # words and a table, not dicts


def test_layer_from_the_replay_on_rank_1():
    rows = _steps(0, skipped=(4,)) + _steps(1, skipped=(4,), loss_nonfinite={4: True})
    events = [
        _replay(1, 4, False, forward_finite=False, first="booster", cause="precision"),
        _replay(0, 4, True),
    ]
    found, _ = _d04(fake_run(steps=rows, events=events, ranks=[0, 1], manifest=_manifest()))
    (f,) = found
    assert f.evidence["origin"]["rank"] == 1
    assert f.evidence["origin"]["what"] == "activation"
    assert f.evidence["origin"]["layer"] == "booster"
    assert f.evidence["received"] == [0]
    assert "`booster`" in f.title


def test_layer_from_sampled_numerics_is_n05s():
    rows = _steps(0, skipped=(3,)) + _steps(1, skipped=(3,), loss_nonfinite={3: True})
    offenders = [
        {
            "rank": 1,
            "step": 3,
            "kind": "forward",
            "module": "blocks.1.attn",
            "module_type": "Attention",
            "detail": "{}",
        }
    ]
    run = fake_run(
        steps=rows, ranks=[0, 1], manifest=_manifest(), tables={"offenders": offenders}
    )
    (f,) = _d04(run)[0]
    assert f.evidence["origin"]["layer"] == "blocks.1.attn"
    assert f.evidence["origin"]["what"] == "activation"
    assert any("AMP-N05" in n for n in f.evidence["notes"])


def test_backward_only_overflow_named_from_the_replay():
    rows = _steps(0, skipped=(6,)) + _steps(1, skipped=(6,))
    events = [_replay(1, 6, False, grads_finite=False), _replay(0, 6, True)]
    (f,) = _d04(fake_run(steps=rows, events=events, ranks=[0, 1], manifest=_manifest()))[0]
    assert f.evidence["origin"]["rank"] == 1 and f.evidence["origin"]["what"] == "gradient"
    assert f.evidence["received"] == [0]


def test_backward_only_overflow_without_a_replay_is_not_checked_with_the_reason():
    rows = _steps(0, skipped=(6,)) + _steps(1, skipped=(6,))
    events = [
        {"kind": "replay", "rank": r, "step": 6, "replayed": False, "reason": "replay_max (0)"}
        for r in (0, 1)
    ]
    found, reason = _d04(fake_run(steps=rows, events=events, ranks=[0, 1], manifest=_manifest()))
    assert not found
    assert reason is not None and "skipped for inf/NaN gradients (first: step 6)" in reason
    assert "step 6 was not replayed: replay_max (0)" in reason


def test_every_rank_at_once_is_not_told_and_no_lowest_rank_is_picked():
    # no scaler: the weights went non-finite with an update, every rank's loss at step 7
    rows = [
        r
        for k in range(3)
        for r in _steps(k, scaler=False, loss_nonfinite={s: True for s in range(7, 10)})
    ]
    found, reason = _d04(fake_run(steps=rows, ranks=range(3), manifest=_manifest()))
    assert not found
    assert reason is not None and reason.startswith("the origin cannot be told")
    assert "every rank's own values were non-finite at step 7" in reason


def test_no_scaler_origin_then_every_rank_received_and_n05_says_received():
    # rank 1's loss at step 3; the update spreads it: every rank's loss from step 4 on
    bad = {s: True for s in range(3, 8)}
    rows = _steps(0, scaler=False, loss_nonfinite={s: True for s in range(4, 8)}) + _steps(
        1, scaler=False, loss_nonfinite=bad
    )
    offenders = [
        {
            "rank": 0,
            "step": 5,
            "kind": "forward",
            "module": "fc1",
            "module_type": "Linear",
            "detail": '{"nan": 4, "inf": 0, "elements": 4, "order": 0}',
        }
    ]
    numerics = [
        {
            "rank": 0,
            "step": 5,
            "module": "fc1",
            "module_type": "Linear",
            "kind": "output",
            "dtype": "float16",
            "order": 0,
            "elements": 4,
            "nan": 4,
            "inf": 0,
        }
    ]
    run = fake_run(
        steps=rows,
        ranks=[0, 1],
        manifest=_manifest(),
        tables={"offenders": offenders, "numerics": numerics},
    )
    d = diagnose(run)
    (f,) = [f for f in d.findings if f.id == "AMP-D04"]
    assert f.evidence["origin"]["rank"] == 1 and f.evidence["origin"]["what"] == "loss"
    assert f.evidence["received"] == [0]
    n05 = [f for f in d.findings if f.id == "AMP-N05"]
    assert n05, [n.reason for n in d.not_checked if n.id == "AMP-N05"]
    assert all("received through the all-reduce" in x.title for x in n05)
    assert all("rank 1" in x.title and "AMP-D04" in x.title for x in n05)
    assert "AMP-D04" in n05[0].explained_by


def test_two_origins_at_one_step_each_named():
    rows = [r for k in range(4) for r in _steps(k, skipped=(2,))]
    for r in rows:
        if r["rank"] in (1, 3) and r["step"] == 2:
            r.update(input_nonfinite=1)
    found, _ = _d04(fake_run(steps=rows, ranks=range(4), manifest=_manifest()))
    assert sorted(f.evidence["origin"]["rank"] for f in found) == [1, 3]
    assert all(f.evidence["received"] == [0, 2] for f in found)


def test_loss_scale_replay_is_not_an_origin_and_healthy_has_no_finding():
    rows = _steps(0, skipped=(4,)) + _steps(1, skipped=(4,))
    events = [
        _replay(1, 4, False, grads_finite=False, cause="loss-scale"),
        _replay(0, 4, True, cause="not-reproduced"),
    ]
    found, reason = _d04(fake_run(steps=rows, events=events, ranks=[0, 1], manifest=_manifest()))
    assert not found and reason is None  # checked: the scaler's own job
    healthy = [r for k in range(2) for r in _steps(k)]
    found, reason = _d04(fake_run(steps=healthy, ranks=[0, 1], manifest=_manifest()))
    assert not found and reason is None


def test_nccl_nan_check_said_when_set_and_advised_when_not():
    rows = _steps(0, skipped=(2,)) + _steps(1, skipped=(2,), input_nonfinite={2: 1})
    (f,) = _d04(
        fake_run(steps=rows, ranks=[0, 1], manifest=_manifest(nccl_nan_check="1"))
    )[0]
    assert f.evidence["nccl_nan_check"] == "set: 1"
    assert any("TORCH_NCCL_NAN_CHECK was set" in n for n in f.evidence["notes"])
    (f,) = _d04(fake_run(steps=rows, ranks=[0, 1], manifest=_manifest(nccl_nan_check=None)))[0]
    assert f.evidence["nccl_nan_check"] == "not set"
    assert "TORCH_NCCL_NAN_CHECK=1" in f.fix
    (f,) = _d04(fake_run(steps=rows, ranks=[0, 1], manifest=_manifest()))[0]
    assert f.evidence["nccl_nan_check"] is None  # not recorded (an older run)


def test_single_rank_not_checked():
    found, reason = _d04(fake_run(steps=_steps(0, input_nonfinite={2: 1}), manifest=_manifest()))
    assert not found and reason is not None and "single-rank" in reason
