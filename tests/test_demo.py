"""The embedded demo: planted faults become findings, and the report holds the loss-scale chart."""

from __future__ import annotations

import amprobe
from amprobe.cli import main


def test_demo_command_finds_planted_faults(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "demo"), "--steps", "100"]) == 0
    out = capsys.readouterr().out
    for finding in ("AMP-N03", "AMP-N09", "AMP-N02"):
        assert finding in out
    report = (tmp_path / "demo" / "report.html").read_text()
    assert "loss scale (log)" in report and "plotly" in report.lower()
    assert "AMP-N03" in report and "AMP-N09" in report
    run = amprobe.load_run(tmp_path / "demo" / "run")
    assert len(run.steps) == 100 and run.status == "finished"


def test_demo_rerun_replaces_previous_run(tmp_path):
    for _ in range(2):
        assert main(["demo", "--out", str(tmp_path / "d"), "--steps", "20"]) == 0
    assert len(amprobe.load_run(tmp_path / "d" / "run").steps) == 20
