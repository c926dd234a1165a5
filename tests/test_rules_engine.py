"""The rule table itself: what registration checks (import time, not when rules run)."""

from __future__ import annotations

import pytest

import amprobe.rules  # noqa: F401  (registers every rule)
from amprobe.rules.engine import REGISTRY, REQUIREMENTS, RuleContext, requirement, rule


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
