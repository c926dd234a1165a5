"""Golden tests over the recorded runs in sample_runs/ (regenerate with sample_runs/generate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import amprobe

SAMPLES = Path(__file__).resolve().parent.parent / "sample_runs"

# scenario -> (IDs that must be found, IDs that must not be found)
EXPECTED = {
    "healthy": (
        set(),
        {"AMP-N01", "AMP-N02", "AMP-N03", "AMP-N08", "AMP-N09", "AMP-N10", "AMP-N13"},
    ),
    "overflow": (
        {"AMP-N01", "AMP-N02", "AMP-N03", "AMP-N05", "AMP-N11"},
        {"AMP-N04", "AMP-N08", "AMP-N09", "AMP-N10", "AMP-N13"},
    ),
    "misuse": ({"AMP-N08", "AMP-N09", "AMP-N10", "AMP-N13"}, {"AMP-N03", "AMP-N15"}),
    "bf16": ({"AMP-N15"}, {"AMP-N01", "AMP-N02", "AMP-N03", "AMP-N11", "AMP-N12"}),
    "fp8-whatif": ({"AMP-P01", "AMP-P02"}, {"AMP-P03", "AMP-N15", "AMP-N01", "AMP-N05"}),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_run_findings(name):
    run = amprobe.load_run(SAMPLES / name)
    assert run.status == "finished" and not run.warnings
    ids = set(amprobe.diagnose(run).ids())
    must, must_not = EXPECTED[name]
    assert must <= ids, f"missing {must - ids}"
    assert not (must_not & ids), f"unexpected {must_not & ids}"


def test_healthy_sample_has_no_warning_or_error():
    diagnosis = amprobe.diagnose(amprobe.load_run(SAMPLES / "healthy"))
    assert [f.id for f in diagnosis.findings if f.severity != "info"] == []
    assert diagnosis.health["scaler_success_rate"]["value"] == 1.0


def test_overflow_sample_numbers():
    run = amprobe.load_run(SAMPLES / "overflow")
    steps = run.steps
    assert len(steps) == 200
    skipped = steps[steps["skipped"]]
    assert list(skipped["step"]) == list(range(80, 120)), "the planted overflow spans steps 80..119"
    n03 = next(f for f in amprobe.diagnose(run).findings if f.id == "AMP-N03")
    assert n03.evidence["consecutive_cut_count"] == 40
    assert n03.evidence["cut_run_starts_at_step"] == 80
    start_scale = float(steps.set_index("step").loc[80, "scale_before"])
    assert n03.evidence["min_scale"] == pytest.approx(start_scale / 2**40)


def test_overflow_sample_names_the_planted_layer():
    findings = amprobe.diagnose(amprobe.load_run(SAMPLES / "overflow")).findings
    n05 = next(f for f in findings if f.id == "AMP-N05")
    assert "booster" in n05.title, "the planted Booster layer is the first module to overflow"
    n03 = next(f for f in findings if f.id == "AMP-N03")
    assert "booster" in str(dict(n03.evidence)), "the collapse names the offending layer"


def test_fp8_whatif_sample_names_candidates_and_the_outlier_layer():
    run = amprobe.load_run(SAMPLES / "fp8-whatif")
    findings = {f.id: f for f in amprobe.diagnose(run).findings}
    p01, p02 = findings["AMP-P01"], findings["AMP-P02"]
    assert [x["module"] for x in p01.evidence["layers"]] == ["embed", "head"]
    assert p01.evidence["flops_source"].startswith("compute_ops")
    assert 0 < p01.evidence["candidate_flops_share"] < 1
    # the planted outlier channel of proj (2**12 times the others) widens its range
    assert p02.title.startswith("proj activations span 2^")
    assert "would flush to zero in fp8-e4m3 even with per-tensor scaling" in p02.title
    hostile = p02.evidence["layers"][0]
    assert hostile["module"] == "proj" and hostile["lost_share"] > 0.01
    assert int(run.steps["numerics_sampled"].sum()) == 6


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_no_sample_run_carries_a_collector_error(name):
    """The shipped runs are recorded with the current code: a newcomer's first dashboard must
    not show a capture failure that was fixed long ago (regenerate with sample_runs/generate.py)."""
    run = amprobe.load_run(SAMPLES / name)
    for kind in ("collector_error", "hub_error", "compute_capture_error", "undeclared_field"):
        assert run.events_of(kind) == [], (kind, run.events_of(kind)[:1])
