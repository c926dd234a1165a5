"""The HTML report's first screen: what was not checked is said before the findings."""

from __future__ import annotations

from pathlib import Path

import amprobe
from amprobe.report import render_html

SAMPLE_RUNS = Path(__file__).resolve().parents[1] / "sample_runs"


def test_not_checked_list_comes_before_the_findings() -> None:
    run = amprobe.load_run(SAMPLE_RUNS / "healthy")
    diagnosis = amprobe.diagnose(run)
    assert diagnosis.not_checked, "the healthy sample run has checks it cannot run"
    page = render_html(run, diagnosis)
    block = page.index("id='not-checked'")
    assert block < page.index("<h2>Findings</h2>")
    for n in diagnosis.not_checked:  # each with its reason, once, in that block
        assert page.index(f"<b>{n.id}</b>", block) < page.index("<h2>Findings</h2>")
        assert page.count(f"<b>{n.id}</b> <code>{n.name}</code>") == 1
