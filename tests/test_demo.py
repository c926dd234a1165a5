"""The embedded demo: planted faults become findings, the report holds the loss-scale chart, and
README shows what `amprobe demo` prints."""

from __future__ import annotations

import re
from pathlib import Path

import amprobe
from amprobe.cli import main

REPO = Path(__file__).resolve().parent.parent

#: a finding's one-line summary in `amprobe diagnose`'s text: "[E] AMP-N02 skip-rate (error): ..."
_FINDING_LINE = re.compile(r"^\[[EWI]\] AMP-[A-Z]\d\d ", flags=re.MULTILINE)


# demo_run: tests/conftest.py (one demo run for the session: test_figures_truth reads it too)


def test_demo_command_finds_planted_faults(demo_run: tuple[Path, str]) -> None:
    out_dir, out = demo_run
    for finding in ("AMP-N03", "AMP-N09", "AMP-N02", "AMP-N05"):
        assert finding in out
    report = (out_dir / "report.html").read_text()
    assert "loss scale (log)" in report and "plotly" in report.lower()
    assert "AMP-N03" in report and "AMP-N09" in report
    run = amprobe.load_run(out_dir / "run")
    assert len(run.steps) == 300 and run.status == "finished"


def _finding_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if _FINDING_LINE.match(line)]


def _fenced_blocks(markdown: str) -> list[str]:
    """The text of each fenced code block, fences paired in order."""
    blocks: list[str] = []
    current: list[str] | None = None
    for line in markdown.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_readme_shows_what_the_demo_prints(demo_run: tuple[Path, str]) -> None:
    """README's demo block holds exactly the finding lines `amprobe demo` prints, in its order
    (cause first), on a CPU with bf16, as README says. The demo samples at fixed periods, so
    every count is the same on every machine."""
    out_dir, out = demo_run
    readme = (REPO / "README.md").read_text()
    shown = [line for block in _fenced_blocks(readme) for line in _finding_lines(block)]
    assert shown, "README shows no demo output"
    printed = _finding_lines(out)
    manifest = amprobe.load_run(out_dir / "run").ranks[0].manifest
    if not manifest.get(
        "bf16_supported"
    ):  # README: "On a CPU without bf16, AMP-N11 is not reported."
        shown = [line for line in shown if not line.startswith("[W] AMP-N11 ")]
    assert shown == printed


def test_demo_rerun_replaces_previous_run(tmp_path):
    for _ in range(2):
        assert main(["demo", "--out", str(tmp_path / "d"), "--steps", "20"]) == 0
    assert len(amprobe.load_run(tmp_path / "d" / "run").steps) == 20
