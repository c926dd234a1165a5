"""Percentages never round a share to what it is not: below 100 % never "100.0 %", above zero
never "0.0 %" (seen: a 64-rank run that skipped 5 of 10,000 steps read "100.0 %" applied)."""

from __future__ import annotations

import pytest

from amprobe.analysis.frames import percent_text
from amprobe.report.evidence import _percent
from amprobe.report.render import _health_line


@pytest.mark.parametrize(
    ("fraction", "text"),
    [
        (0.9995, "99.95 %"),
        (0.99999999999, "99.99999999 %"),
        (1.0, "100.0 %"),
        (0.5, "50.0 %"),
        (0.123456, "12.3 %"),
        (0.00004, "0.004 %"),
        (0.0, "0.0 %"),
    ],
)
def test_percent_text(fraction: float, text: str) -> None:
    assert percent_text(fraction) == text
    assert percent_text(fraction, space=False) == text.replace(" %", "%")


def test_health_lines_and_evidence_say_a_skipped_step_is_not_none() -> None:
    metric = {"label": "loss-scale success rate", "value": 0.9995, "unit": "%"}
    assert _health_line("rate", metric) == "loss-scale success rate: 99.95%"
    assert _percent(0.9995) == "99.95 %"
    pytest.importorskip("dash")
    from dashboard.layout import format_health_value

    assert format_health_value(metric) == "99.95 %"
