"""``amprobe diagnose --format json`` at cluster scale (#33): bounded by the diverging ranks.

A 300-rank run is built from ``sample_runs/fp8-whatif`` by hard links (a real manifest per
rank, a real copy of the two diverging ranks' changed files), so it costs a few MB of
manifests, not 300 copies of the run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import amprobe
from amprobe.analysis.whatif import compute_whatif, whatif_records
from amprobe.report import render_json
from amprobe.report.whatif_json import PER_RANK_UP_TO, verdict_of, whatif_json

SOURCE = Path(__file__).resolve().parents[1] / "sample_runs" / "fp8-whatif"
RANKS = 300
#: rank whose ``head`` activations spread over 2^-20 .. 2^12 (fp8 flushes half, even scaled)
WIDE = 17
#: rank whose steps take 3x longer
SLOW = 250
#: bytes the JSON may grow over a one-rank run's: in all, per what-if record (its ranks), per
#: record a diverging rank changes (the spread over the ranks and that rank's row)
FEW_KB, RECORD_RANKS, PER_CHANGED = 4096, 60, 2000


def _rewrite(path: Path, change: Any) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        change(row)
    path.unlink()  # a hard link: write a copy of its own
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def build_cluster(dest: Path, n: int = RANKS) -> Path:
    """``n`` ranks of the sample run by hard links, ``WIDE`` and ``SLOW`` made to diverge."""
    dest.mkdir()
    top = json.loads((SOURCE / "manifest.json").read_text())
    (dest / "manifest.json").write_text(json.dumps({**top, "world_size": n}))
    base = SOURCE / "rank0"
    manifest = json.loads((base / "manifest.json").read_text())
    files = [p for p in base.iterdir() if p.name != "manifest.json"]
    for rank in range(n):
        folder = dest / f"rank{rank}"
        folder.mkdir()
        for p in files:
            os.link(p, folder / p.name)
        own = {**manifest, "rank": rank, "local_rank": rank % 8, "world_size": n}
        (folder / "manifest.json").write_text(json.dumps({**own, "hostname": f"node-{rank // 8}"}))

    def wide(row: dict[str, Any]) -> None:
        if row["module"] == "head" and row["kind"] == "output":
            half = (row["finite"] - row["zeros"]) // 2
            row["exp_hist"] = json.dumps({"-20": half, "12": half})
            row["amax"] = 5000.0

    def slow(row: dict[str, Any]) -> None:
        row["wall_s"] = row["wall_s"] * 3

    _rewrite(dest / f"rank{WIDE}" / "numerics.jsonl", wide)
    _rewrite(dest / f"rank{SLOW}" / "steps.jsonl", slow)
    return dest


#: rules cheap at 300 ranks (AMP-P01/P02 take ~30 ms per rank): a cross-rank one, a per-rank one
RULES = ["AMP-D02", "AMP-S04"]


def _json(path: Path) -> tuple[str, dict[str, Any]]:
    run = amprobe.load_run(path)
    diagnosis = amprobe.diagnose(run, only=RULES)
    text = render_json(
        diagnosis, {"whatif": whatif_json(compute_whatif(run), diagnosis.thresholds)}
    )
    return text, json.loads(text)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    return _json(build_cluster(tmp_path_factory.mktemp("cluster") / "run"))


def test_the_json_grows_with_the_diverging_ranks_not_the_rank_count(cluster: Any) -> None:
    """Before #33 the what-if alone held one set of records per rank (29 MB here).

    Over a one-rank run's JSON, each what-if record gains its ``ranks`` and ``rank_count``,
    each record a diverging rank changes its ``spread`` and row, and the rest a few KB."""
    text, data = cluster
    single, one = _json(SOURCE)
    records = len(one["whatif"])
    assert len(data["whatif"]) == records  # one record per layer, kind, format, scaling
    changed = sum("spread" in r for r in data["whatif"])
    assert changed == 8  # head's activations: 4 formats, 2 scalings
    bound = len(single) + FEW_KB + RECORD_RANKS * records + PER_CHANGED * changed
    assert len(text) < bound, (len(text), len(single))
    assert data["run"]["rank_count"] == RANKS and data["run"]["rank_ranges"] == [[0, RANKS - 1]]


def test_the_diverging_ranks_are_named(cluster: Any) -> None:
    _, data = cluster
    titles = {f["title"] for f in data["findings"]}
    assert any(t.startswith(f"rank {SLOW} ") for t in titles), titles  # AMP-D02
    (s04,) = [f for f in data["findings"] if f["id"] == "AMP-S04"]
    assert s04["title"].endswith(f" on ranks 0-{RANKS - 1}")
    assert s04["evidence"]["ranks"] == list(range(20))
    assert s04["evidence"]["rank_ranges"] == [[0, RANKS - 1]]
    (head,) = [
        r
        for r in data["whatif"]
        if (r["module"], r["kind"], r["format"], r["scaling"])
        == ("head", "output", "e4m3", "per-tensor")
    ]
    assert head["ranks"] == f"0-{RANKS - 1}" and head["rank_count"] == RANKS
    assert (
        head["verdict"] == "keeps"
        and head["verdict_ranks"] == f"0-{WIDE - 1}, {WIDE + 1}-{RANKS - 1}"
    )
    (row,) = head["rows"]
    assert row["rank"] == WIDE and row["verdict"] == "flushes" and row["flush_share"] > 0.4
    assert verdict_of(row, 0.001) == "flushes" and verdict_of({**row, "judged": False}, 0) == (
        "not judged"
    )
    assert head["spread"]["flush_share"]["max_ranks"] == str(WIDE)
    assert head["spread"]["amax"]["max"] == 5000.0


def test_records_equal_on_every_rank_are_one_record(cluster: Any) -> None:
    _, data = cluster
    _, one = _json(SOURCE)
    proj = [r for r in data["whatif"] if r["module"] == "proj"]
    single = [r for r in one["whatif"] if r["module"] == "proj"]
    assert proj and all("spread" not in r and r["ranks"] == f"0-{RANKS - 1}" for r in proj)
    assert [
        {k: v for k, v in r.items() if k not in ("ranks", "rank_ranges", "rank_count")}
        for r in proj
    ] == [{k: v for k, v in r.items() if k != "rank"} for r in single]


def test_a_run_of_one_node_keeps_its_records() -> None:
    """Up to 8 ranks the per-rank records are smaller than their summary: kept as they were."""
    frame = compute_whatif(amprobe.load_run(SOURCE))
    assert whatif_json(frame) == whatif_records(frame)
    other = frame.assign(rank=1, amax=frame["amax"] * 2)
    two = pd.concat([frame, other], ignore_index=True)
    assert whatif_json(two) == whatif_records(two)
    nine = pd.concat([frame.assign(rank=r) for r in range(PER_RANK_UP_TO + 1)], ignore_index=True)
    assert len(whatif_json(nine)) == len(frame)


def test_bounded_evidence_renders_as_words() -> None:
    """``rank_ranges``, ``by_rank_left_off`` and ``by_rank_range`` read as text, not JSON."""
    from amprobe.report.evidence import evidence_lines
    from amprobe.rules.engine import Finding, group_rank_findings

    def cut(rank: int) -> Finding:
        evidence = {"rank": rank, "cut_count": rank, "min_scale": 2048.0 if rank == 5 else 1024.0}
        return Finding("AMP-N01", "x", "info", "nan", f"cut {rank} time(s)", evidence, "fix")

    (merged,) = group_rank_findings([cut(r) for r in range(RANKS)], True, range(RANKS))
    lines = evidence_lines(merged)
    assert f"ranks: 0-{RANKS - 1} ({RANKS} ranks)" in lines
    assert f"  ({RANKS - 16} more sets of values, on {RANKS - 16} ranks, not shown)" in lines
    assert "  min scale | 1,024 | 0-4, 6-299 | 2,048 | 5" in lines
    assert not any("[" in line or "{" in line or "_" in line for line in lines), lines
