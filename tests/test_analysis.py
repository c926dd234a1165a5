"""The analysis layer and the rule vocabulary: baseline comparison and health, cached run
analyses, AMP-S06 without a nested diagnose, Severity, finding refs, loader error types."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import amprobe
from amprobe import cli
from amprobe.analysis import compare as compare_mod
from amprobe.analysis.compare import compute_comparison
from amprobe.analysis.health import compute_health
from amprobe.report import render_json, render_markdown, render_text
from amprobe.rules import REGISTRY, diagnose
from amprobe.rules import engine as engine_mod
from amprobe.rules.engine import Finding, Severity
from amprobe.rules.refs import CHECKLIST_TITLES, checklist_ref
from amprobe.store import schema
from amprobe.store.loader import NewerSchemaError, RunLoadError, load_run
from amprobe.store.writer import RunWriter
from tests.helpers import fake_run

SAMPLES = Path(__file__).resolve().parent.parent / "sample_runs"


def _write(root: Path, wall_s: list[float], manifest: dict | None = None, **extra) -> Path:
    """A run through the real writer: one step per ``wall_s`` entry."""
    writer = RunWriter(root, 0, 1, {"device": "cpu", **(manifest or {})}, max_buffered_rows=1000)
    rows = [
        {
            "step": i,
            "window": 0,
            "t": float(i),
            "wall_s": w,
            "loss": 2.0 - 0.01 * i,
            "scaler_enabled": False,
            "opt_steps": 1,
            **extra,
        }
        for i, w in enumerate(wall_s)
    ]
    writer.append("steps", rows)
    writer.close({"status": "finished", "steps": len(rows)})
    return root


def _health_line(run, key: str) -> str:
    text = render_text(diagnose(run))
    return next(line.strip() for line in text.splitlines() if HEALTH_LABELS[key] in line)


HEALTH_LABELS = {"speedup": "throughput speedup vs FP32 baseline"}


def test_speedup_health_line_shows_the_measured_speedup(tmp_path: Path):
    base = _write(tmp_path / "fp32", [0.02] * 20)
    amp = _write(tmp_path / "amp", [0.01] * 20, manifest={"baseline_run": str(base)})
    run = load_run(amp)
    comparison = compute_comparison(load_run(base), run)
    assert comparison["speedup"] == pytest.approx(2.0)
    health = diagnose(run).health
    assert health["speedup"]["value"] == pytest.approx(2.0)
    assert health["speedup"]["baseline"] == str(base)
    assert _health_line(run, "speedup").endswith(": 2.00x")


def test_speedup_health_line_says_why_when_not_measurable(tmp_path: Path):
    """The note of a comparison that cannot time the runs reaches the health line (it used to be
    looked up by the prefix "spee" and always read "not recorded")."""
    base = _write(tmp_path / "fp32", [0.0] * 20)  # no positive step time: nothing to time
    amp = _write(tmp_path / "amp", [0.01] * 20, manifest={"baseline_run": str(base)})
    line = _health_line(load_run(amp), "speedup")
    assert "one of the runs has no timed steps" in line
    assert "not recorded" not in line


def test_speedup_health_without_baseline_says_so():
    health = compute_health(amprobe.load_run(SAMPLES / "healthy"))
    assert health["speedup"]["value"] is None
    assert "no FP32 baseline recorded" in health["speedup"]["note"]


def test_unreadable_baseline_is_named(tmp_path: Path):
    amp = _write(tmp_path / "amp", [0.01] * 20, manifest={"baseline_run": str(tmp_path / "gone")})
    health = compute_health(load_run(amp))
    assert "cannot be read" in health["speedup"]["note"]


def test_comparison_is_computed_once_per_run(tmp_path: Path, monkeypatch):
    base = _write(tmp_path / "fp32", [0.02] * 20)
    amp = _write(tmp_path / "amp", [0.03] * 20, manifest={"baseline_run": str(base)})
    calls = []
    real = compare_mod.compute_comparison
    monkeypatch.setattr(
        compare_mod, "compute_comparison", lambda a, b: calls.append(1) or real(a, b)
    )
    run = load_run(amp)
    diagnosis = diagnose(run)  # AMP-S06 and the health metrics both need the comparison
    assert "AMP-S06" in diagnosis.ids()
    render_text(diagnosis)
    diagnose(run)
    assert len(calls) == 1


def test_no_speedup_lists_explaining_findings_without_calling_diagnose(tmp_path: Path, monkeypatch):
    base = _write(tmp_path / "fp32", [0.01] * 20)
    # an input-bound AMP run: half of each step waits for data (AMP-S01 explains the slowdown)
    amp = _write(
        tmp_path / "amp",
        [0.02] * 20,
        manifest={"baseline_run": str(base)},
        data_wait_s=0.01,
    )
    run = load_run(amp)
    real = engine_mod.diagnose
    depth = []

    def guarded(*args, **kwargs):
        assert not depth, "a rule called diagnose()"
        depth.append(1)
        try:
            return real(*args, **kwargs)
        finally:
            depth.pop()

    monkeypatch.setattr(engine_mod, "diagnose", guarded)
    diagnosis = engine_mod.diagnose(run)
    s06 = next(f for f in diagnosis.findings if f.id == "AMP-S06")
    assert s06.evidence["speedup"] == pytest.approx(0.5)
    assert s06.evidence["explained_by"] == ["AMP-S01"]
    assert "Start with AMP-S01" in s06.fix
    # asking for S06 alone still runs the speed rules it reads, without reporting them
    only = real(run, only=["AMP-S06"])
    assert only.ids() == ["AMP-S06"]
    assert only.findings[0].evidence["explained_by"] == ["AMP-S01"]


def test_cli_compare_names_explaining_findings(tmp_path: Path, capsys):
    base = _write(tmp_path / "fp32", [0.01] * 20)
    amp = _write(tmp_path / "amp", [0.02] * 20, data_wait_s=0.01)
    assert cli.main(["compare", str(base), str(amp), "--format", "json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["speedup"] == pytest.approx(0.5)
    assert "samples_per_s_baseline" not in payload
    (s06,) = payload["findings"]
    assert s06["evidence"]["explained_by"] == ["AMP-S01"]


# -- severity -------------------------------------------------------------------------------------


def test_severity_is_a_str_enum_that_serializes_and_sorts_as_before():
    f = Finding("AMP-N02", "skip-rate", "warning", "nan", "t", {}, "fix")
    assert f.severity is Severity.WARNING
    assert f.severity == "warning" and f"{f.severity}" == "warning" and str(f.severity) == "warning"
    assert json.loads(json.dumps(f.to_dict()))["severity"] == "warning"
    assert sorted(Severity, key=lambda s: s.rank) == [
        Severity.ERROR,
        Severity.WARNING,
        Severity.INFO,
    ]
    with pytest.raises(ValueError, match="unknown severity"):
        Finding("AMP-N02", "skip-rate", "fatal", "nan", "t", {}, "fix")
    assert all(isinstance(spec.severity, Severity) for spec in REGISTRY.values())


def test_diagnosis_orders_findings_by_severity():
    diagnosis = amprobe.diagnose(amprobe.load_run(SAMPLES / "overflow"))
    ranks = [f.severity.rank for f in diagnosis.findings]
    assert ranks == sorted(ranks) and len(set(ranks)) > 1
    payload = json.loads(render_json(diagnosis))
    assert {f["severity"] for f in payload["findings"]} <= {"error", "warning", "info"}


# -- refs -----------------------------------------------------------------------------------------


def test_every_rule_refs_its_checklist_item_first_and_no_internal_codes():
    assert set(CHECKLIST_TITLES) >= set(REGISTRY)
    for rid, spec in REGISTRY.items():
        first = spec.refs[0]
        assert first == checklist_ref(rid) and f"({rid})" in first and "#" in first
        for ref in spec.refs:
            assert "§" not in ref, f"{rid} still has an internal checklist code: {ref}"
        for ref in spec.refs[1:]:
            assert "https://" in ref, f"{rid}: a ref after the checklist item is a link: {ref}"


def test_checklist_ref_format():
    assert checklist_ref("AMP-N09") == "NaN checklist #9 (AMP-N09): unscale_ before clipping"
    assert checklist_ref("AMP-S04").startswith("Speed checklist #4 (AMP-S04): ")
    assert checklist_ref("AMP-D02").startswith("Distributed checklist #2 (AMP-D02): ")


def test_refs_link_to_the_pytorch_docs_where_they_exist():
    clip = REGISTRY["AMP-N09"].refs
    assert any(
        r.startswith("https://pytorch.org/docs/stable/notes/amp_examples.html") for r in clip
    )
    assert any(
        r.startswith("https://pytorch.org/docs/stable/amp.html") for r in REGISTRY["AMP-N12"].refs
    )


def test_renderers_show_followable_refs():
    diagnosis = amprobe.diagnose(amprobe.load_run(SAMPLES / "misuse"))
    n09 = next(f for f in diagnosis.findings if f.id == "AMP-N09")
    text = render_text(diagnosis, verbose=True)
    assert "NaN checklist #9 (AMP-N09): unscale_ before clipping" in text
    md = render_markdown(diagnosis)
    link = next(r for r in n09.refs if r.startswith("https://"))
    assert f"<{link}>" in md
    html = amprobe.report.render_html(diagnosis.run, diagnosis)
    assert f'href="{link}"' in html


def test_renderers_name_the_category_not_its_key():
    """The HTML report printed 'AMP-N02 skip-rate (nan)': a category key that reads as a value."""
    diagnosis = amprobe.diagnose(amprobe.load_run(SAMPLES / "misuse"))
    f = next(f for f in diagnosis.findings if f.category == "nan")
    note = f"({f.severity}, category: NaN / inf)"
    html = amprobe.report.render_html(diagnosis.run, diagnosis)
    assert f"<code>{f.name}</code> {note}</div>" in html
    assert "(nan)" not in html
    assert f"### {f.id} `{f.name}` {note}" in render_markdown(diagnosis)
    assert "    category: NaN / inf" in render_text(diagnosis, verbose=True)


# -- loader ---------------------------------------------------------------------------------------


def test_newer_schema_is_its_own_error_type(tmp_path: Path):
    root = _write(tmp_path / "run", [0.01] * 3)
    path = root / "rank0" / schema.RANK_MANIFEST
    manifest = json.loads(path.read_text())
    manifest["schema_version"] = schema.SCHEMA_VERSION + 1
    path.write_text(json.dumps(manifest))
    with pytest.raises(NewerSchemaError) as info:
        load_run(root)
    assert isinstance(info.value, RunLoadError)


def test_run_fake_has_no_baseline():
    run = fake_run(steps=[{"step": 0, "wall_s": 0.1}])
    assert compare_mod.baseline_comparison(run) is None


# -- evidence vocabulary (docs/evidence.md) -------------------------------------------------------


def _check_keys(where: str, evidence: object) -> None:
    if isinstance(evidence, dict):
        for key, value in evidence.items():
            key = str(key)
            assert key != "steps", f"{where}: a bare 'steps' key (list or count?)"
            if key.endswith("_steps"):
                assert isinstance(value, list) and all(
                    isinstance(s, int) and not isinstance(s, bool) for s in value
                ), f"{where}.{key} is not a list of step numbers: {value!r}"
                assert value == sorted(value) and len(value) <= 20, f"{where}.{key}"
            if key.endswith("_count"):
                assert value is None or (isinstance(value, int) and not isinstance(value, bool)), (
                    f"{where}.{key} is not a count: {value!r}"
                )
            _check_keys(f"{where}.{key}", value)
    elif isinstance(evidence, list):
        for i, item in enumerate(evidence):
            _check_keys(f"{where}[{i}]", item)


@pytest.mark.parametrize("name", ["healthy", "overflow", "misuse", "bf16"])
def test_evidence_keys_follow_the_vocabulary(name: str):
    diagnosis = amprobe.diagnose(amprobe.load_run(SAMPLES / name))
    assert diagnosis.findings
    for f in diagnosis.findings:
        _check_keys(f.id, dict(f.evidence))
    _check_keys("health", {k: dict(v) for k, v in diagnosis.health.items()})


def test_vocabulary_check_catches_a_count_named_steps():
    with pytest.raises(AssertionError, match="not a list of step numbers"):
        _check_keys("X", {"skipped_steps": 3})
    with pytest.raises(AssertionError, match="not a count"):
        _check_keys("X", {"layers": [{"cut_count": [1, 2]}]})
