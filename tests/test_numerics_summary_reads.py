"""AMP-N05 and the what-if rules read per-rank summaries, not every rank's files: the forward
offender's detail comes from the ``numerics`` and ``offenders`` sections (the same as from the
rank's files), and ``diagnose`` of a multi-rank run reads no rank's numerics, offenders or
compute-ops rows one rank at a time."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from amprobe.rules import numerics as rules_numerics
from amprobe.rules.engine import REGISTRY, RuleContext, diagnose
from amprobe.store.loader import Run, load_run
from amprobe.store.sections.numerics import NumericsSection

#: the rules of this module's files
MINE = {
    "check_forward_overflow",
    "check_grad_underflow",
    "check_sensitive_layers_half",
    "check_fp8_candidates",
    "check_fp8_hostile",
}
SAMPLES = Path(__file__).resolve().parent.parent / "sample_runs"


def _rows(rank_dir: Path, table: str) -> list[dict[str, Any]]:
    path = rank_dir / f"{table}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _facts(rows: list[dict[str, Any]]) -> Any:
    sec = NumericsSection()
    for row in rows:
        sec.add("numerics", row)
    return sec.to_json()["step_facts"]


def test_step_facts_merge_at_every_cut_around_the_overflow() -> None:
    rows = _rows(SAMPLES / "overflow" / "rank0", "numerics")
    whole = _facts(rows)
    assert whole["ordered"] and whole["kept"], "the sample has steps with a non-finite output"
    first_bad = next(i for i, r in enumerate(rows) if r["kind"] == "output" and r["nan"] + r["inf"])
    for cut in range(max(first_bad - 30, 1), min(first_bad + 30, len(rows))):
        merged = NumericsSection.merge(
            {
                "rows": 0,
                "layers": [],
                "outputs": [],
                "grad_scale": None,
                "last_linear": {"half": [], "edges": []},
                "step_facts": _facts(rows[:cut]),
            },
            {
                "rows": 0,
                "layers": [],
                "outputs": [],
                "grad_scale": None,
                "last_linear": {"half": [], "edges": []},
                "step_facts": _facts(rows[cut:]),
            },
        )["step_facts"]
        assert merged == whole, cut


def _normal(found: Any) -> str:
    first, steps, facts = found
    origin = {
        k: None if v is None else {c: v[c] for c in ("module", "module_type", "amax", "elements")}
        for k, v in facts["origin"].items()
    }
    first = {k: int(v) if k == "step" else v for k, v in first.items()}
    return json.dumps([first, steps, {**facts, "origin": origin}], sort_keys=True, default=str)


def test_forward_offender_from_summaries_equals_the_files() -> None:
    run = load_run(SAMPLES / "overflow")
    ctx = RuleContext(run=run, spec=REGISTRY["AMP-N05"], thresholds=MappingProxyType({}), prior=())
    fast = rules_numerics._offender_from_summaries(run, 0)
    assert fast is not None, "the sample's detail is in its summary"
    assert _normal(fast) == _normal(rules_numerics._offender_from_files(ctx, 0, None))


def _multi_rank(tmp_path: Path) -> Path:
    """Ranks 0 and 1: the overflow sample (a forward offender each); rank 2: the healthy one."""
    top = json.loads((SAMPLES / "overflow" / "manifest.json").read_text())
    top["world_size"] = 3
    (tmp_path / "manifest.json").write_text(json.dumps(top))
    for rank, source in enumerate(("overflow", "overflow", "healthy")):
        dest = tmp_path / f"rank{rank}"
        shutil.copytree(SAMPLES / source / "rank0", dest)
        manifest = json.loads((dest / "manifest.json").read_text())
        manifest.update(rank=rank, world_size=3)
        (dest / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path


def test_diagnose_reads_no_rank_rows_of_numerics_offenders_compute_ops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tables: list[str] = []
    rank_tables: list[tuple[str, int]] = []
    by_mine: list[tuple[str, str, int]] = []
    table, rank_table = Run.table, Run.rank_table

    def spy_table(self: Run, name: str, *args: Any, **kwargs: Any) -> Any:
        caller = Path(sys._getframe(1).f_code.co_filename)
        tables.append(f"{name} from {caller.parent.name}/{caller.name}")
        return table(self, name, *args, **kwargs)

    def spy_rank_table(self: Run, name: str, rank: int, *args: Any, **kwargs: Any) -> Any:
        rank_tables.append((name, rank))
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name in MINE:
                by_mine.append((frame.f_code.co_name, name, rank))
            frame = frame.f_back
        return rank_table(self, name, rank, *args, **kwargs)

    monkeypatch.setattr(Run, "table", spy_table)
    monkeypatch.setattr(Run, "rank_table", spy_rank_table)
    diagnosis = diagnose(load_run(_multi_rank(tmp_path)))
    assert any(f.id == "AMP-N05" for f in diagnosis.findings)
    named = {f.evidence["rank"] for f in diagnosis.findings if "rank" in f.evidence}
    named |= {r for f in diagnosis.findings for r in f.evidence.get("ranks", [])}
    watched = ("numerics", "offenders", "compute_ops")
    # never every rank's numerics or offenders rows; the compute ops (a few rows per rank) once
    assert not [t for t in tables if t.startswith(("numerics ", "offenders "))]
    assert tables.count("compute_ops from rules/whatif.py") <= 1
    # a rank's own rows only for a rank a finding names (AMP-N11 names rank 0 and reads its
    # numerics), and these rules not even those: the summaries hold N05's detail
    assert all(rank in named for name, rank in rank_tables if name in watched)
    assert not by_mine
