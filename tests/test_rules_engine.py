"""The rule table itself: what registration checks (import time, not when rules run)."""

from __future__ import annotations

from pathlib import Path

import pytest

import amprobe
import amprobe.rules  # noqa: F401  (registers every rule)
from amprobe.rules.engine import (
    REGISTRY,
    REQUIREMENTS,
    Finding,
    RuleContext,
    order_cause_first,
    requirement,
    rule,
)


def _no_findings(ctx: RuleContext) -> list:
    return []


def test_a_rule_requiring_an_unknown_name_fails_at_registration():
    """Issue #20: a misspelt requirement was only noticed when diagnose ran (as "not checked")."""
    before = dict(REGISTRY)
    with pytest.raises(ValueError, match=r"AMP-T99 requires 'numerix', not a registered"):
        rule("AMP-T99", "test-rule", "info", "nan", requires=("steps", "numerix"))(_no_findings)
    assert REGISTRY == before


def test_a_requirement_is_registered_once():
    before = dict(REQUIREMENTS)
    with pytest.raises(ValueError, match="requirement 'steps' registered twice"):
        requirement("steps")(lambda run: None)
    assert REQUIREMENTS == before


def test_every_registered_rule_lists_registered_requirements():
    assert all(set(spec.requires) <= set(REQUIREMENTS) for spec in REGISTRY.values())
    assert {"steps", "numerics", "amp_as_written"} <= set(REQUIREMENTS)


# -- cause first (issue #32 item 7) ------------------------------------------------------------

SAMPLES = Path(__file__).resolve().parents[1] / "sample_runs"


def _finding(rid: str, severity: str) -> Finding:
    spec = REGISTRY[rid]
    return Finding(rid, spec.name, severity, spec.category, f"{rid} title", {}, "fix")


def test_every_explained_by_names_another_registered_rule():
    for rid, spec in REGISTRY.items():
        assert set(spec.explained_by) <= set(REGISTRY) - {rid}, rid
    # the relations the checklist states in prose are declared as data
    assert "AMP-N05" in REGISTRY["AMP-N02"].explained_by
    assert {"AMP-N05", "AMP-N04"} <= set(REGISTRY["AMP-N03"].explained_by)
    assert {"AMP-S04", "AMP-S05"} <= set(REGISTRY["AMP-S07"].explained_by)


def test_a_rule_cannot_explain_itself():
    before = dict(REGISTRY)
    with pytest.raises(ValueError, match="AMP-T98 names itself in explained_by"):
        rule("AMP-T98", "test-rule", "info", "nan", explained_by=("AMP-T98",))(_no_findings)
    assert REGISTRY == before


def test_order_cause_first_puts_each_root_above_its_symptoms():
    findings = [
        _finding("AMP-N02", "error"),
        _finding("AMP-N09", "error"),
        _finding("AMP-N01", "warning"),
        _finding("AMP-S02", "info"),
        _finding("AMP-N05", "error"),
        _finding("AMP-N03", "error"),
    ]
    ordered = order_cause_first(findings)
    assert [f.id for f in ordered] == [
        "AMP-N05",  # a root, its symptoms below it in severity order
        "AMP-N02",
        "AMP-N03",
        "AMP-N01",
        "AMP-N09",  # the next root
        "AMP-S02",
    ]
    by_id = {f.id: f for f in ordered}
    assert by_id["AMP-N05"].explains == ("AMP-N02", "AMP-N03", "AMP-N01")
    assert by_id["AMP-N02"].explained_by == ("AMP-N05",)
    assert by_id["AMP-N09"].explained_by == () and by_id["AMP-N09"].explains == ()
    assert by_id["AMP-N02"].to_dict()["explained_by"] == ["AMP-N05"]
    assert by_id["AMP-N05"].to_dict()["explains"] == ["AMP-N02", "AMP-N03", "AMP-N01"]


def test_a_root_with_symptoms_comes_before_a_lone_root_of_its_severity():
    """AMP-N17 (the replay's measured cause) explains AMP-N05 and AMP-N02: it comes before
    AMP-N09, an error of its own, although N09 sorts first by ID."""
    findings = [
        _finding("AMP-N09", "error"),
        _finding("AMP-N02", "error"),
        _finding("AMP-N05", "error"),
        _finding("AMP-N17", "error"),
        _finding("AMP-S02", "info"),
    ]
    ordered = order_cause_first(findings)
    assert [f.id for f in ordered] == ["AMP-N17", "AMP-N05", "AMP-N02", "AMP-N09", "AMP-S02"]


def test_a_symptom_of_several_causes_comes_after_the_last_of_them():
    findings = [
        _finding("AMP-N02", "error"),
        _finding("AMP-N10", "warning"),
        _finding("AMP-N05", "error"),
        _finding("AMP-N03", "error"),
    ]
    ordered = order_cause_first(findings)
    # N02 is explained by N05 and N10: both stand above it; N03 only by N05
    assert [f.id for f in ordered] == ["AMP-N05", "AMP-N03", "AMP-N10", "AMP-N02"]
    assert ordered[-1].explained_by == ("AMP-N05", "AMP-N10")


def test_a_symptom_without_its_cause_stays_in_severity_order():
    ordered = order_cause_first([_finding("AMP-N01", "warning"), _finding("AMP-N02", "error")])
    assert [f.id for f in ordered] == ["AMP-N02", "AMP-N01"]
    assert all(f.explained_by == () for f in ordered)


def test_overflow_run_lists_the_overflowing_layer_first():
    """Issue #32: severity order put AMP-N02 (the symptom) first and AMP-N05 (the cause) third."""
    diagnosis = amprobe.diagnose(amprobe.load_run(SAMPLES / "overflow"))
    ids = diagnosis.ids()
    assert ids[0] == "AMP-N05", ids
    assert ids.index("AMP-N05") < ids.index("AMP-N02") < ids.index("AMP-N01")
    n02 = next(f for f in diagnosis.findings if f.id == "AMP-N02")
    assert n02.explained_by == ("AMP-N05",)
    data = diagnosis.to_dict()["findings"]
    assert data[0]["id"] == "AMP-N05" and "AMP-N02" in data[0]["explains"]
