"""The ``scaler`` summary section (amprobe.store.sections.scaler): chunks merge into the section
of the whole, and AMP-D01 read from it names the diverging rank with the frame grid's evidence."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

import amprobe
from amprobe.store.sections import scaler as scaler_section
from amprobe.store.sections.scaler import ScalerSection
from tests.helpers import fake_run
from tests.trajectories import scaled_steps, scaler_event

ROOT = Path(__file__).resolve().parents[1]
RANK_DIRS = [
    ROOT / "sample_runs" / "overflow" / "rank0",
    ROOT / "sample_runs" / "healthy" / "rank0",
    ROOT / "sample_runs" / "misuse" / "rank0",
    ROOT / "sample_runs" / "bf16" / "rank0",
]


def _rows(folder: Path, table: str) -> list[dict[str, Any]]:
    path = folder / f"{table}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _section(events: list[dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, Any]:
    sec = ScalerSection()
    for row in events:
        sec.add("events", row)
    for row in steps:
        sec.add("steps", row)
    return sec.to_json()


def _split(rows: list[dict[str, Any]], cuts: list[int]) -> list[list[dict[str, Any]]]:
    bounds = [0, *sorted(cuts), len(rows)]
    return [rows[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _merged(events, steps, rng: random.Random, parts: int) -> dict[str, Any]:
    chunks_e = _split(events, [rng.randint(0, len(events)) for _ in range(parts - 1)])
    chunks_s = _split(steps, [rng.randint(0, len(steps)) for _ in range(parts - 1)])
    out = None
    for e, s in zip(chunks_e, chunks_s, strict=True):
        part = _section(e, s)
        out = part if out is None else ScalerSection.merge(out, part)
    assert out is not None
    return out


@pytest.mark.parametrize("cap", [scaler_section.CAP, 3])
@pytest.mark.parametrize("folder", RANK_DIRS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_chunks_merge_into_the_whole(folder: Path, cap: int, monkeypatch) -> None:
    monkeypatch.setattr(scaler_section, "CAP", cap)
    events, steps = _rows(folder, "events"), _rows(folder, "steps")
    whole = _section(events, steps)
    assert whole["n"] > 0
    rng = random.Random(33)
    for parts in (2, 3, 3, 3):
        assert _merged(events, steps, rng, parts) == whole
    # associativity: (a+b)+c == a+(b+c)
    a, b, c = (_section([], part) for part in _split(steps, [len(steps) // 3, len(steps) // 2]))
    assert ScalerSection.merge(ScalerSection.merge(a, b), c) == ScalerSection.merge(
        a, ScalerSection.merge(b, c)
    )


def test_out_of_order_steps_merge_and_are_flagged() -> None:
    steps = scaled_steps(30, cuts=(4, 5), growth=(12,))
    steps = steps[10:] + steps[:10]  # a window that restarts the step count
    whole = _section([], steps)
    assert not whole["ordered"]
    for cut in (1, 10, 11, 29):
        first, second = _section([], steps[:cut]), _section([], steps[cut:])
        assert ScalerSection.merge(first, second) == whole


def test_section_facts_of_the_overflow_sample() -> None:
    facts = _section(*(_rows(RANK_DIRS[0], t) for t in ("events", "steps")))
    assert (facts["n"], facts["skipped"]) == (200, 40)
    assert facts["skipped_runs"] == [[80, 119]]
    assert facts["updates"][0] == [49, 65536.0, 131072.0]
    assert facts["autocast_dtypes"] == ["float16"] and facts["growth_interval"] == 50


# -- AMP-D01 on summaries: same evidence as the step x rank grid (main 9717a67) ---------------
D01_EVIDENCE = {
    "compared_rank_count": 3,
    "compared_step_count": 40,
    "found_inf_note": "found-inf is NOT synchronized: ranks skipped different steps at 1 step(s)",
    "found_inf_synchronized": False,
    "median_scale_at_first_divergence": 4096.0,
    "min_divergent_steps": 1,
    "ranks": [2],
    "scale_divergent_step_count": 9,
    "scale_divergent_step_ranges": [[31, 39]],
    "scale_divergent_steps": [31, 32, 33, 34, 35, 36, 37, 38, 39],
    "scales_at_first_divergence": {2: 2048.0},
    "skip_divergent_step_count": 1,
    "skip_divergent_step_ranges": [[30, 30]],
    "skip_divergent_steps": [30],
    "skipped_at_first_divergence": {0: False, 1: False, 2: True},
}


@pytest.mark.parametrize("cap", [scaler_section.CAP, 1], ids=["summaries", "capped-rows"])
def test_d01_names_the_diverging_rank_with_the_grid_evidence(cap: int, monkeypatch) -> None:
    # cap 1: every rank's lists overflow, so D01 reads each rank's rows (Run.rank_table)
    monkeypatch.setattr(scaler_section, "CAP", cap)
    rows = []
    for rank in range(3):
        cuts = (5, 30) if rank == 2 else (5,)
        rows += scaled_steps(40, cuts=cuts, growth=(20,), init=4096.0, rank=rank)
    events = [{**scaler_event(init_scale=4096.0), "rank": r} for r in range(3)]
    run = fake_run(ranks=range(3), steps=rows, events=events)
    facts = run.summaries()
    assert all(facts[r]["scaler"]["complete"] == (cap > 1) for r in range(3))
    (found,) = [f for f in amprobe.diagnose(run).findings if f.id == "AMP-D01"]
    assert {k: found.evidence[k] for k in found.evidence} == D01_EVIDENCE
    assert found.title.startswith("rank 2 disagrees with the other ranks on the loss scale at 9")


def test_odd_rows_are_skipped_not_raised() -> None:
    # the section runs inside the training process: a damaged or odd row must not raise
    sec = ScalerSection()
    for row in (
        {"kind": "scaler_created", "detail": '{"growth_interval": Infinity, "site": 3}'},
        {"kind": "scaler_created", "detail": "[1]"},
        {"kind": "autocast_seen", "detail": "not json"},
        {"kind": None},
    ):
        sec.add("events", row)
    for row in (
        {"step": 1.5},
        {"step": None},
        {"step": "x"},
        {"step": 2, "scaler_enabled": True, "scale_before": "a"},
        {"step": 3, "scaler_enabled": True, "scale_before": 8.0, "skipped": float("nan")},
        {"step": 4, "scaler_enabled": float("nan"), "scale_before": 8.0},
    ):
        sec.add("steps", row)
    facts = sec.to_json()
    assert (facts["rows"], facts["n"], facts["skipped"]) == (3, 1, 0)
    assert facts["created"] == 2 and facts["growth_interval"] is None
    assert facts["sites"] == {"3": 1}
