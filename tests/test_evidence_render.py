"""Findings read as a person reads them, cause first (issue #32, items 7 and 8).

Every finding of the five sample runs and of the demo is rendered to the HTML report, the
dashboard's components, Markdown and text; the evidence must read as sentences and small tables
(no JSON, no ``null``/``None``/``true``, no ``\\u2026`` escapes, no 17-digit floats), a capped
step list says its true range and count, and the cause comes first, linked from its symptoms.
"""

from __future__ import annotations

import html as htmllib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import amprobe
from amprobe.demo import train
from amprobe.report.document import render_html
from amprobe.report.render import render_markdown, render_text
from amprobe.report.sections import build_sections

pytest.importorskip("dash")
from dashboard import ids, layout  # noqa: E402

SAMPLES = Path(__file__).resolve().parents[1] / "sample_runs"
SAMPLE_NAMES = ("healthy", "overflow", "misuse", "bf16", "fp8-whatif")

#: what raw JSON or a Python repr leaves in text a person reads
_RAW = [
    (re.compile(r"\bnull\b"), "null"),
    (re.compile(r"\bNone\b"), "None"),
    (re.compile(r"\b(?:true|false|True|False)\b"), "a JSON/Python boolean"),
    (re.compile(r"[{}]"), "a dict or JSON object"),
    (re.compile(r"\\u[0-9a-fA-F]{4}"), "a \\u escape"),
    (re.compile(r"\d\.\d{6,}"), "a long float repr"),
    (re.compile(r"(?<![\w.,^-])\d{5,}(?![\w,])"), "a large number without separators"),
    (re.compile(r"\b[a-z]+_[a-z_]+\b"), "a snake_case key"),
]

#: snake_case words that are the run's own names, not evidence keys
_NAMES = {"clip_grad_norm_", "grad_output", "grad_param", "compute_ops"}


def _raw_parts(text: str) -> list[str]:
    found = []
    for pattern, what in _RAW:
        for m in pattern.finditer(text):
            if m.group(0) in _NAMES or m.group(0).rstrip("_") + "_" in _NAMES:
                continue
            found.append(f"{what}: {text[max(0, m.start() - 40) : m.end() + 40]!r}")
    return found


def _texts(component: Any) -> Iterator[str]:
    """Every string a Dash component tree shows."""
    if isinstance(component, str):
        yield component
        return
    if isinstance(component, (list, tuple)):
        for c in component:
            yield from _texts(c)
        return
    children = getattr(component, "children", None)
    if children is not None:
        yield from _texts(children)


def _find(component: Any, class_name: str) -> list[Any]:
    out = []
    if isinstance(component, (list, tuple)):
        for c in component:
            out += _find(c, class_name)
        return out
    if class_name in str(getattr(component, "className", "") or "").split():
        out.append(component)
    children = getattr(component, "children", None)
    if children is not None and not isinstance(children, str):
        out += _find(children, class_name)
    return out


def _links(component: Any) -> list[tuple[str, str]]:
    out = []
    if isinstance(component, (list, tuple)):
        for c in component:
            out += _links(c)
        return out
    href = getattr(component, "href", None)
    if href is not None:
        out.append(("".join(_texts(component.children)), href))
    children = getattr(component, "children", None)
    if children is not None and not isinstance(children, str):
        out += _links(children)
    return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The demo as ``amprobe demo`` records it (300 steps, overflow and clip-before-unscale)."""
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    train(run_dir, steps=300)
    run = amprobe.load_run(run_dir)
    return run, amprobe.diagnose(run)


def _runs(demo: Any) -> list[tuple[str, Any, Any]]:
    out = [("demo", *demo)]
    for name in SAMPLE_NAMES:
        run = amprobe.load_run(SAMPLES / name)
        out.append((name, run, amprobe.diagnose(run)))
    return out


def _finding_html(page: str) -> list[str]:
    """The HTML report's findings, one string each."""
    body = page.split("<h2>Findings</h2>", 1)[1].split("<h2>Health</h2>", 1)[0]
    return [part for part in body.split("<div class='finding' ")[1:]]


def test_every_finding_reads_humanly_in_report_and_dashboard(demo: Any) -> None:
    """Issue #32 item 8: evidence was printed as JSON strings (null, \\u2026, snake_case keys,
    2.2737367544323206e-13, lists cut at 20 without saying so)."""
    problems: list[str] = []
    seen = 0
    for name, run, diagnosis in _runs(demo):
        page = render_html(run, diagnosis, sections=[])
        parts = _finding_html(page)
        assert len(parts) == len(diagnosis.findings), name
        components = layout.build_findings(diagnosis.findings)[1:]
        markdown = render_markdown(diagnosis)
        text = render_text(diagnosis, verbose=True)
        for f, part, component in zip(diagnosis.findings, parts, components, strict=True):
            seen += 1
            # the title and fix are the rule's prose (a fix may quote code: enabled=False)
            evidence_html = part.replace(htmllib.escape(f.title), "").replace(
                htmllib.escape(f.fix), ""
            )
            # a fix's code blocks render as <pre> (issue 34: AMP-N17's verified fix): code
            evidence_html = re.sub(r"<pre[^>]*>.*?</pre>", " ", evidence_html, flags=re.S)
            shown = htmllib.unescape(re.sub(r"<[^>]+>", " ", evidence_html))
            shown = re.sub(r"https?://\S+", "", shown)
            shown = shown.replace(f.name, "")  # the checklist slug, e.g. skip-rate
            problems += [f"{name} {f.id} html: {p}" for p in _raw_parts(shown)]
            (evidence,) = _find(component, "evidence")
            words = " ".join(_texts(evidence))
            assert words.strip(), f"{name} {f.id}: no evidence shown"
            problems += [f"{name} {f.id} dashboard: {p}" for p in _raw_parts(words)]
            assert "\\u" not in markdown and "\\u" not in text
    assert seen >= 30, seen
    assert not problems, "\n".join(problems)


def test_demo_skipped_steps_read_as_their_range_and_count(demo: Any) -> None:
    """Issue #32: ``skipped_steps`` showed 120-139 of the demo's 60 skipped steps, unsaid."""
    run, diagnosis = demo
    n02 = next(f for f in diagnosis.findings if f.id == "AMP-N02")
    skipped = run.steps[run.steps["skipped"].fillna(False).astype(bool)]["step"]
    first, last, count = int(skipped.min()), int(skipped.max()), len(skipped)
    assert count == last - first + 1  # the planted overflow skips one stretch of steps
    expected = f"{first}\u2013{last} ({count})"
    assert (first, last, count) == (120, 179, 60)
    (component,) = layout.build_findings([n02])[1:]
    assert any(expected in t for t in _texts(component))
    page = render_html(run, diagnosis, sections=[])
    assert expected in page
    assert expected in render_markdown(diagnosis)
    assert expected in render_text(diagnosis, verbose=True)
    # the scale: a power of two in words, never its 17-digit repr
    n03 = next(f for f in diagnosis.findings if f.id == "AMP-N03")
    text = " ".join(_texts(layout.build_findings([n03])))
    assert "2^-42 (2.27e-13)" in text and "2.2737367544323206e-13" not in text
    # a fraction is a percentage, once: not success_rate 0.8 beside "80.0 %"
    text = " ".join(_texts(layout.build_findings([n02])))
    assert "80.0 %" in text and "0.8 " not in text + " "


def test_demo_lists_the_cause_first_and_links_it(demo: Any) -> None:
    """Issue #32 item 7: AMP-N02 (the symptom) came first and AMP-N05 (the cause) third.

    The replay of step 120 (AMP-N17) measures a cause when its time budget (10x the step's
    time) lets it; it is then listed before AMP-N05, which it explains, and AMP-N02 names both.
    """
    run, diagnosis = demo
    order = diagnosis.ids()
    nan = [i for i in order if i in ("AMP-N17", "AMP-N05", "AMP-N02", "AMP-N03")]
    if "AMP-N17" in order:
        assert order[0] == "AMP-N17" and nan[0] == "AMP-N17", order
        assert "AMP-N17" in next(f for f in diagnosis.findings if f.id == "AMP-N05").explained_by
    else:
        assert order[0] == "AMP-N05", order
    assert order.index("AMP-N05") < order.index("AMP-N02") < order.index("AMP-N03")
    components = layout.build_findings(diagnosis.findings, run_name="demo run")
    by_id = {c.id: c for c in components[1:]}
    listed = list(by_id)
    assert listed.index(f"{ids.FINDING_PREFIX}AMP-N05") < listed.index(
        f"{ids.FINDING_PREFIX}AMP-N02"
    )
    n02 = by_id[f"{ids.FINDING_PREFIX}AMP-N02"]
    assert ("AMP-N05", f"#{ids.FINDING_PREFIX}AMP-N05") in _links(n02)
    assert "Explained by " in list(_texts(n02))
    n05 = by_id[f"{ids.FINDING_PREFIX}AMP-N05"]
    links = dict(_links(n05))
    assert links["step 120 on the loss-scale chart"] == "/run/demo%20run?tab=scale&step=120"
    assert links["layer booster in the numerics view"] == (
        "/run/demo%20run?tab=numerics&layer=booster"
    )
    # without the run's name (the filter callback), the links stay on the current run page
    n05_finding = next(f for f in diagnosis.findings if f.id == "AMP-N05")
    (plain,) = layout.build_findings([n05_finding])[1:]
    assert dict(_links(plain))["step 120 on the loss-scale chart"] == "?tab=scale&step=120"
    # the HTML report: the same anchors, and links to its own loss-scale and numerics sections
    page = render_html(run, diagnosis, build_sections(run, diagnosis))
    assert "id='finding-AMP-N05'" in page
    assert "Explained by " in page and "<a href='#finding-AMP-N05'>AMP-N05</a>" in page
    assert "<a href='#scale'>step 120 on the loss-scale chart</a>" in page
    assert "<a href='#numerics'>layer booster in the numerics view</a>" in page
    assert "<h2 id='scale'>" in page and "<h2 id='numerics'>" in page
    assert page.index("id='finding-AMP-N05'") < page.index("id='finding-AMP-N02'")
    # text and Markdown say the cause too
    text = render_text(diagnosis)
    assert any(
        line.startswith("    explained by ") and "AMP-N05" in line for line in text.splitlines()
    )
    assert "[AMP-N05](#finding-AMP-N05)" in render_markdown(diagnosis)
    n02_dict = next(f for f in diagnosis.to_dict()["findings"] if f["id"] == "AMP-N02")
    assert "AMP-N05" in n02_dict["explained_by"]


def test_worst_finding_is_the_most_severe_not_the_first(demo: Any) -> None:
    """Cause first is not severity first: the run's worst severity is still its most severe."""
    import dataclasses

    from amprobe.rules.engine import Diagnosis

    _, diagnosis = demo
    assert diagnosis.worst() == "error"
    # a warning root cause listed before the error it explains: the worst is the error
    run = amprobe.load_run(SAMPLES / "overflow")
    real = {f.id: f for f in amprobe.diagnose(run).findings}
    cause = dataclasses.replace(real["AMP-N01"], explains=("AMP-N02",), explained_by=())
    symptom = dataclasses.replace(real["AMP-N02"], explained_by=("AMP-N01",), explains=())
    hand = Diagnosis(run=run, findings=(cause, symptom), not_checked=(), health={})
    assert hand.findings[0].severity == "warning" and hand.worst() == "error"
    assert Diagnosis(run=run, findings=(), not_checked=(), health={}).worst() is None


def test_merged_rank_findings_render_their_differences_as_a_table(demo: Any) -> None:
    """``by_rank`` (a merged per-rank finding) is a table of ranks, not a dict repr."""
    import dataclasses

    from amprobe.rules.engine import group_rank_findings

    _, diagnosis = demo
    n01 = next(f for f in diagnosis.findings if f.id == "AMP-N01")
    other = dataclasses.replace(n01, evidence={**n01.evidence, "rank": 1, "cut_count": 61})
    (merged,) = group_rank_findings([n01, other])
    (evidence,) = _find(layout.build_findings([merged]), "evidence")
    words = "".join(_texts(evidence))
    assert "ranks: 0-1" in words and "values that differ by rank" in words
    assert not _raw_parts(" ".join(_texts(evidence))), words


@pytest.mark.parametrize(
    ("listed", "ranges", "count", "expected"),
    [
        (list(range(120, 140)), [[120, 179]], 60, "120\u2013179 (60)"),
        (list(range(120, 140)), [[120, 179]], None, "120\u2013179 (60)"),  # complete runs
        ([25, 50, 60], None, None, "25, 50, 60 (3)"),  # under the cap: the whole list
        (list(range(20)), None, 60, "0\u201319, \u2026 (60; first 20 shown)"),
        (list(range(20)), None, None, "0\u201319, \u2026 (first 20 shown)"),
        ([7], None, None, "7"),
        ([], None, None, "none"),
        (
            list(range(0, 40, 2)),
            [[s, s] for s in range(0, 40, 2)],
            None,
            ", ".join(str(s) for s in range(0, 40, 2)) + ", \u2026 (first 20 runs of steps shown)",
        ),
    ],
)
def test_step_lists_say_their_range_and_true_count(listed, ranges, count, expected) -> None:
    from amprobe.report.evidence import format_steps

    assert format_steps(listed, ranges, count) == expected


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("min_scale", 2.2737367544323206e-13, "2^-42 (2.27e-13)"),
        ("init_scale", 65536.0, "65,536"),
        ("skipped_share", 0.2, "20.0 %"),
        ("lost_share", 0.041321, "4.13 %"),
        ("wall_s_median", 0.031, "31 ms"),
        ("steps_per_s_fp32", 50.0, "50"),  # a rate, not seconds
        ("matmul_flops", 9175040.0, "9,175,040"),
        ("flops_per_byte", 9.132, "9.13"),
        ("inf_count", 6777, "6,777"),
        ("own_code", False, "no"),
        ("role", None, None),
        ("ranks", [0, 1, 2, 3, 7], "0-3, 7"),
        (
            "first_forward_offender",
            {"module": "booster", "module_type": "Booster", "step": 81},
            "booster (Booster), step 81",
        ),
    ],
)
def test_evidence_values_read_with_units(key, value, expected) -> None:
    from amprobe.report.evidence import format_value

    assert format_value(key, value) == expected


def test_overflow_counts_say_what_they_count_as_the_numerics_tab_does() -> None:
    """AMP-N11 on ``overflow``: booster's table showed "over fp16 count 0" beside "nonfinite
    264,340", read as "no overflow". Each count column is labelled by its one definition
    (over_fp16 counts finite values only), the same words as the numerics tab's notes."""
    from amprobe.analysis.numerics import COUNT_DEFINITIONS
    from amprobe.report.evidence import Table, render_evidence

    run = amprobe.load_run(SAMPLES / "overflow")
    diagnosis = amprobe.diagnose(run)
    (n11,) = [f for f in diagnosis.findings if f.id == "AMP-N11"]
    (table,) = [b for b in render_evidence(n11) if isinstance(b, Table)]
    over = f"over_fp16 ({COUNT_DEFINITIONS['over_fp16']})"
    nonfinite = f"nonfinite ({COUNT_DEFINITIONS['nonfinite']})"
    assert over in table.columns and nonfinite in table.columns
    assert "finite" in COUNT_DEFINITIONS["over_fp16"] and "65,520" in over
    rows = [dict(zip(table.columns, row, strict=True)) for row in table.rows]
    booster = next(r for r in rows if r["layer"] == "booster")
    assert booster[over] == "0" and booster[nonfinite] != "0"  # the numbers as recorded
    (numerics,) = [s for s in build_sections(run, diagnosis) if s.key == "numerics"]
    notes = " ".join(numerics.text)
    for column in ("nonfinite", "over_fp16", "fp16_inf"):
        assert f"{column} = {COUNT_DEFINITIONS[column]}" in notes  # the same words there


def test_one_step_range_writing_everywhere() -> None:
    """Steps as runs are written by one function, with an en dash: the comparison table wrote
    ``steps 5-9`` where every other view writes ``steps 5–9``; and one name means one thing
    (``format_value`` was two different functions)."""
    from amprobe.analysis.frames import range_text, steps_text
    from amprobe.report import evidence, render
    from amprobe.report.compare import comparison_rows

    assert steps_text([83, 0, 81, 82, 82]) == "0, 81–83"
    assert steps_text([1, 3, 5, 7], limit=2) == "1, 3, …"
    assert steps_text([4], word=True) == "step 4" and steps_text([4, 5], word=True) == "steps 4–5"
    assert range_text(5, 9, word=True) == "steps 5–9" and range_text(5, 5) == "5"
    metrics = {
        "speedup": 0.41,
        "steps_per_s_baseline": 10.0,
        "steps_per_s_candidate": 4.1,
        "timed_step_ranges": [[5, 9], [5, 5]],
        "timed_steps": [5, 1],
    }
    row = next(r for r in comparison_rows(metrics) if r[0].startswith("step time"))
    assert row[4] == "baseline steps 5–9 (5 timed), candidate step 5 (1 timed)"
    assert hasattr(evidence, "format_value") and not hasattr(render, "format_value")
