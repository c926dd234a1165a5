"""The ``numerics`` and ``offenders`` summary sections: chunks merge to the whole, and the
what-if frame built from them equals the one built from the rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from amprobe.analysis.whatif import FORMATS, compute_whatif_frame, compute_whatif_summaries
from amprobe.store.loader import load_run
from amprobe.store.sections.numerics import (
    AMAX_OVERFLOW_EDGES,
    AMAX_SCALE_EDGES,
    NumericsSection,
    OffendersSection,
)

SAMPLES = Path(__file__).resolve().parent.parent / "sample_runs"
RANK_DIRS = [SAMPLES / name / "rank0" for name in ("overflow", "misuse", "fp8-whatif")]


def _rows(rank_dir: Path, table: str) -> list[dict]:
    path = rank_dir / f"{table}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _section(cls: type, data: list[tuple[str, dict]]) -> dict:
    sec = cls()
    for table, row in data:
        sec.add(table, row)
    return sec.to_json()


@pytest.mark.parametrize("cls", [NumericsSection, OffendersSection])
@pytest.mark.parametrize("rank_dir", RANK_DIRS, ids=lambda p: p.parent.name)
def test_chunks_merge_to_the_whole(cls: type, rank_dir: Path) -> None:
    data = [(t, r) for t in cls.tables for r in _rows(rank_dir, t)]
    assert data
    whole = json.dumps(_section(cls, data), sort_keys=True)
    n = len(data)
    for cuts in ([n // 3, 2 * n // 3], [1, n - 1], [n // 2 + 7]):
        bounds = [0, *cuts, n]
        parts = [_section(cls, data[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
        merged = parts[0]
        for part in parts[1:]:
            merged = cls.merge(merged, part)
        assert json.dumps(merged, sort_keys=True) == whole


def test_amax_edges_are_the_formats_bounds() -> None:
    def mantissa(x: float) -> float:
        return x / 2.0 ** math.floor(math.log2(x))

    assert AMAX_SCALE_EDGES == sorted(mantissa(f.max) for f in FORMATS.values())
    assert AMAX_OVERFLOW_EDGES == sorted(mantissa(f.overflows_from) for f in FORMATS.values())


@pytest.mark.parametrize("name", ["fp8-whatif", "overflow"])
def test_whatif_from_summaries_equals_the_rows(name: str) -> None:
    run = load_run(SAMPLES / name)
    rows = compute_whatif_frame(run.table("numerics"))
    summed = compute_whatif_summaries(run.summaries())
    assert len(rows) and rows["judged"].any()
    pd.testing.assert_frame_equal(rows.reset_index(drop=True), summed.reset_index(drop=True))


def test_capped_step_runs_merge_to_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    from amprobe.store.sections import numerics as sec

    monkeypatch.setattr(sec, "MAX_RUNS", 3)
    steps = [1, 2, 3, 5, 6, 9, 11, 12, 13, 20, 21]
    data = [("steps", {"step": s, "input_nonfinite": 1, "skipped": s % 2 == 0}) for s in steps]
    whole = _section(OffendersSection, data)
    assert whole["inputs"]["runs"]["runs"] == [[1, 3], [5, 6], [9, 9]]
    assert whole["inputs"]["runs"]["left_out"] == 2 and whole["inputs"]["count"] == len(steps)
    for cut in range(1, len(data)):
        merged = OffendersSection.merge(
            _section(OffendersSection, data[:cut]), _section(OffendersSection, data[cut:])
        )
        assert merged == whole, cut


def test_listed_runs_cover_the_evidence_lists() -> None:
    from amprobe.analysis.frames import MAX_LISTED_STEPS
    from amprobe.store.sections.numerics import MAX_LISTED

    assert MAX_LISTED >= MAX_LISTED_STEPS


def test_whatif_per_class_of_ranks_equals_each_rank_worked_out() -> None:
    """Ranks of two classes (equal sections, as copies): each rank's rows are those of its own
    section, in rank order, as when every rank is worked out on its own."""
    import copy

    from amprobe.analysis.whatif import _whatif_from_summaries

    a = load_run(SAMPLES / "fp8-whatif").summaries()
    b = load_run(SAMPLES / "overflow").summaries()
    one, two = a[min(a)], b[min(b)]
    summaries = {r: copy.deepcopy(one if r in (0, 2, 3) else two) for r in range(5)}
    per_class = compute_whatif_summaries(summaries)
    assert set(per_class["rank"]) == set(range(5))
    pd.testing.assert_frame_equal(per_class, _whatif_from_summaries(summaries))
