"""The ``steps`` and ``runtime`` summary sections (amprobe.store.sections.runtime): chunk merges
equal the whole, the histogram's quantile bound, and AMP-D02 judged from the summaries."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import amprobe
from amprobe.store.jsonl import _read_rank_table
from amprobe.store.sections.runtime import (
    QUANTILE_REL_ERROR,
    RANGES_KEPT,
    Ranges,
    RuntimeSection,
    StepsSection,
    hist_add,
    hist_median,
    new_hist,
)
from tests.helpers import fake_run

ROOT = Path(__file__).resolve().parent.parent
RANKS = [
    ROOT / "sample_runs" / "healthy" / "rank0",
    ROOT / "sample_runs" / "misuse" / "rank0",
    ROOT / "sample_runs" / "overflow" / "rank0",
]


def _rows(rank_dir: Path) -> list[dict[str, Any]]:
    read = _read_rank_table(rank_dir / "steps.jsonl", "steps")
    return read.table.to_pylist()  # type: ignore[union-attr]


def _section(cls: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    sec = cls()
    for row in rows:
        sec.add("steps", row)
    return sec.to_json()


def _same(a: Any, b: Any) -> bool:
    """Equal, floats to 12 significant digits (sums add in another order across chunks)."""

    def norm(x: Any) -> Any:
        if isinstance(x, float):
            return float(f"{x:.12g}")
        if isinstance(x, dict):
            return {k: norm(v) for k, v in x.items()}
        if isinstance(x, list):
            return [norm(v) for v in x]
        return x

    return norm(json.loads(json.dumps(a))) == norm(json.loads(json.dumps(b)))


@pytest.mark.parametrize("rank_dir", RANKS, ids=lambda p: str(p))
@pytest.mark.parametrize("cls", [StepsSection, RuntimeSection])
def test_chunk_merges_equal_the_whole(rank_dir: Path, cls: Any):
    if not rank_dir.exists():
        pytest.skip(f"{rank_dir} not present")
    rows = _rows(rank_dir)
    whole = _section(cls, rows)
    rng = random.Random(33)
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(rows)), 2))
        # cuts inside the head (row 3) and after it, as a writer's flushes fall
        for a, b in ((cuts[0], cuts[1]), (3, cuts[1]), (1, 2)):
            parts = [_section(cls, rows[:a]), _section(cls, rows[a:b]), _section(cls, rows[b:])]
            left = cls.merge(cls.merge(parts[0], parts[1]), parts[2])
            right = cls.merge(parts[0], cls.merge(parts[1], parts[2]))
            assert _same(left, whole) and _same(right, whole)
    assert len(json.dumps(whole)) < 20_000  # bounded, whatever the number of steps


def test_ranges_merge_is_exact_past_the_cap():
    steps = [s for k in range(3 * RANGES_KEPT) for s in (3 * k, 3 * k + 1)]  # runs of 2
    steps += [10_000, 10_000]  # a repeated step starts a run of its own
    whole = Ranges()
    for s in steps:
        whole.add(s)
    for cut in (1, 5, 2 * RANGES_KEPT + 1, len(steps) - 1):
        a, b = Ranges(), Ranges()
        for s in steps[:cut]:
            a.add(s)
        for s in steps[cut:]:
            b.add(s)
        assert Ranges.merge(a.to_json(), b.to_json()) == whole.to_json()
    got = whole.to_json()
    assert got["n"] == len(steps) and len(got["head"]) == RANGES_KEPT
    assert got["left"] == 3 * RANGES_KEPT + 2 - RANGES_KEPT - 1 and got["last"] == [10_000, 10_000]


def test_histogram_median_within_the_stated_bound():
    rng = np.random.default_rng(0)
    for values in (rng.lognormal(-6, 0.5, 1001), rng.lognormal(-2, 1.5, 2000), [0.0] * 3 + [1e-3]):
        hist = new_hist()
        for v in values:
            hist_add(hist, float(v))
        exact = float(np.median(values))
        got = hist_median(hist)
        assert got is not None
        assert math.isclose(got, exact, rel_tol=2 * QUANTILE_REL_ERROR, abs_tol=1e-12)
    assert QUANTILE_REL_ERROR < 0.003


def test_d02_names_the_slow_rank_of_three_from_summaries():
    rng = np.random.default_rng(1)
    base = rng.lognormal(np.log(0.02), 0.3, 60)  # steps spread as a real loop's do
    rows = []
    for rank, factor in ((0, 1.0), (1, 1.02), (2, 2.5)):
        rows += [
            {"rank": rank, "step": i, "wall_s": float(b * factor * rng.uniform(0.97, 1.03))}
            for i, b in enumerate(base)
        ]
    run = fake_run(ranks=[0, 1, 2], steps=rows)
    (f,) = [f for f in amprobe.diagnose(run, only=["AMP-D02"]).findings if f.id == "AMP-D02"]
    ev = f.evidence
    assert (ev["metric"], ev["ranks"], ev["slowest_rank"]) == ("wall_s", [2], 2)
    assert ev["slower_step_share"] == 1.0 and ev["compared_step_count"] == 58
    assert set(ev["rank_medians_s"]) == {2}  # only the ranks it names
    exact = float(np.median([r["wall_s"] for r in rows if r["rank"] == 2 and r["step"] >= 2]))
    assert math.isclose(ev["rank_medians_s"][2], exact, rel_tol=QUANTILE_REL_ERROR + 1e-6)
    # rank 1 alone 2 % slower: nothing named
    quiet = fake_run(ranks=[0, 1], steps=[r for r in rows if r["rank"] < 2])
    assert "AMP-D02" not in amprobe.diagnose(quiet, only=["AMP-D02"]).ids()
