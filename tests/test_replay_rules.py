"""AMP-N17 nonfinite-cause: the rule on hand-built ``replay`` events, and end to end over tiny
runs of ``tests/scripts/train_replay.py`` (diagnose JSON, advice that follows the cause, the
report's and the dashboard's loss-scale view)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import amprobe
from amprobe.cli import main as cli_main
from amprobe.rules import diagnose
from tests.helpers import fake_run

SCRIPTS = Path(__file__).resolve().parent / "scripts"

ON = {"config": {"replay": "on", "replay_max": 3, "collectors": ["scaler", "replay"]}}


def _x(variant: str, finite: bool, first: str | None = None, **more: Any) -> dict[str, Any]:
    return {
        "variant": variant,
        "finite": finite,
        "forward_finite": finite if first is None else False,
        "grads_finite": None,
        "first_nonfinite": first,
        "max_abs": 12.5,
        "seconds": 0.002,
        "scale": 256.0,
        **more,
    }


def _replay(step: int = 5, rank: int = 0, **detail: Any) -> dict[str, Any]:
    base = {
        "kind": "replay",
        "rank": rank,
        "step": step,
        "replayed": True,
        "trigger": "skipped_update",
        "device_type": "cuda",
        "autocast_dtype": "float16",
        "scale": 256.0,
        "verified_fix": [],
        "notes": [],
        "experiments": [_x("as it ran", False, "big")],
    }
    base.update(detail)
    return base


def _n17(events: list[dict[str, Any]], ranks: tuple[int, ...] = (0,), manifest=ON):
    d = diagnose(fake_run(events=events, ranks=ranks, manifest=manifest), only=["AMP-N17"])
    found = [f for f in d.findings if f.id == "AMP-N17"]
    reasons = {n.id: n.reason for n in d.not_checked}
    return (found[0] if found else None), reasons.get("AMP-N17")


PRECISION = _replay(
    cause="precision",
    first_nonfinite="big",
    verified_fix=["big"],
    experiments=[
        _x("as it ran", False, "big"),
        _x("autocast off", True),
        _x("fp32 big", True, pins=["big"]),
    ],
)

# cause -> (event, severity, words the title says, words the fix says, words it must not say)
CASES: dict[str, tuple[dict[str, Any], str, str, str, str]] = {
    "precision": (
        PRECISION,
        "error",
        "fp16 overflow in `big`: pinning it to fp32 made step 5 finite",
        '_fp32(model.get_submodule("big"))',
        "bf16",
    ),
    "data-or-model": (
        _replay(
            cause="data-or-model",
            first_nonfinite="inp",
            experiments=[_x("as it ran", False, "inp"), _x("autocast off", False, "inp")],
        ),
        "error",
        "non-finite in fp32 too",
        "not AMP: fp32 breaks too",
        "_fp32(",
    ),
    "compiler": (
        _replay(cause="compiler", compiled=True, confirmed=False, first_nonfinite="blocks.0"),
        "error",
        "only compiled",
        "Not confirmed",
        "_fp32(",
    ),
    "loss-scale": (
        _replay(
            cause="loss-scale",
            finite_at_scale=128.0,
            finite_at_scale_divisor=2.0,
            experiments=[_x("as it ran", False), _x("lower loss scale", True, scale=128.0)],
        ),
        "warning",
        "the loss scale 256 was too high at step 5: the step is finite at 128 (scale/2)",
        "Benign",
        "_fp32(",
    ),
    "loss-computation": (
        _replay(cause="loss-computation", output_finite=True),
        "error",
        "the loss computation made step 5 non-finite",
        "in fp32 outside autocast",
        "_fp32(",
    ),
    "not-reproduced": (
        _replay(cause="not-reproduced", micro_batch=3, micro_batches=4),
        "error",
        "did not recur on replay",
        "another device",
        "_fp32(",
    ),
}


@pytest.mark.parametrize("cause", list(CASES))
def test_each_cause_is_worded_with_its_severity(cause: str) -> None:
    event, severity, title, fix, never = CASES[cause]
    finding, reason = _n17([event])
    assert reason is None and finding is not None
    assert finding.evidence["cause"] == cause
    assert finding.severity == severity
    assert title in finding.title
    assert fix.lower() in finding.fix.lower()
    assert never not in finding.fix  # no fp32 pin advised where precision is not the cause
    assert finding.evidence["step"] == 5 and finding.evidence["rank"] == 0
    rows = finding.evidence["experiments"]
    assert [r["variant"] for r in rows] == [x["variant"] for x in event["experiments"]]
    assert all("wall_s" in r for r in rows)


def test_precision_fix_is_code_for_the_recorded_device_and_names_only_the_verified_pin() -> None:
    """The verified fix comes from the measured pins, never from the first non-finite layer."""
    event = _replay(
        cause="precision",
        first_nonfinite="inv",
        verified_fix=["proj"],
        device_type="cpu",
        autocast_dtype="bfloat16",
        experiments=[
            _x("as it ran", False, "inv"),
            _x("autocast off", True),
            _x("fp32 inv", False, "inv"),
            _x("fp32 proj", True),
        ],
    )
    finding, _ = _n17([event])
    assert finding is not None
    assert finding.evidence["verified_fix"] == ["proj"]
    assert finding.title.startswith("bf16 overflow at step 5: non-finite first in `inv`")
    assert '_fp32(model.get_submodule("proj"))' in finding.fix
    assert 'get_submodule("inv")' not in finding.fix
    assert 'torch.autocast("cpu", enabled=False)' in finding.fix
    assert "def _fp32(module):" in finding.fix
    assert "compiler" not in finding.title


def test_not_reproduced_without_the_output_does_not_rule_out_the_loss() -> None:
    """The forward is finite on replay, the output gradient was not, the output was not held:
    the loss computation is not ruled out, so the title says both."""
    event = _replay(
        cause="not-reproduced",
        output_finite=None,
        output_grad_finite=False,
        experiments=[_x("as it ran", True)],
    )
    finding, _ = _n17([event])
    assert finding is not None and "the loss computation or a fault" in finding.title
    assert finding.fix.startswith("Check the loss computation")


def test_compiler_confirmed_says_no_doubt() -> None:
    finding, _ = _n17([_replay(cause="compiler", compiled=True, confirmed=True)])
    assert finding is not None and "not confirmed" not in finding.title


def test_first_step_is_the_finding_and_the_others_are_listed() -> None:
    events = [
        _replay(step=40, cause="loss-scale", finite_at_scale=128.0, finite_at_scale_divisor=2.0),
        dict(PRECISION, step=9),
        _replay(step=70, replayed=False, reason="replay_max (3) replays already made"),
        _replay(step=60, cause="precision", verified_fix=["big"]),
        _replay(step=80, replayed=False, reason="replay_max (3) replays already made"),
    ]
    finding, _ = _n17(events)
    assert finding is not None
    assert finding.evidence["step"] == 9 and finding.evidence["cause"] == "precision"
    rows = finding.evidence["replays"]
    assert [r["step"] for r in rows] == [9, 40, 60, 70]  # the first, then up to 3 others
    assert [r["cause"] for r in rows] == ["precision", "loss-scale", "precision", None]
    assert rows[3]["outcome"].startswith("not replayed: replay_max")
    assert finding.evidence["replayed_step_count"] == 3


def test_two_ranks_one_reproduced_the_other_received_it() -> None:
    """Rank 1's batch held the NaN; rank 0 got it through the all-reduce: its replay is
    finite (not-reproduced), which is not a cause of its own."""
    events = [
        _replay(rank=0, cause="not-reproduced"),
        _replay(
            rank=1,
            cause="data-or-model",
            first_nonfinite="inp",
            experiments=[_x("as it ran", False, "inp"), _x("autocast off", False, "inp")],
        ),
    ]
    finding, _ = _n17(events, ranks=(0, 1))
    assert finding is not None
    ev = finding.evidence
    assert ev["cause"] == "data-or-model" and ev["ranks"] == [1] and ev["received_ranks"] == [0]
    assert finding.title.endswith("on rank 1 (received by rank 0 through the gradient all-reduce)")
    assert "rank" not in ev  # merged by the rule: the engine does not append a rank again
    # neither rank reproduced it: then it is not-reproduced on both
    both, _ = _n17(
        [_replay(rank=0, cause="not-reproduced"), _replay(rank=1, cause="not-reproduced")], (0, 1)
    )
    assert both is not None and both.evidence["cause"] == "not-reproduced"
    assert both.evidence["ranks"] == [0, 1] and both.evidence["received_ranks"] is None


def test_incomplete_replay_claims_no_cause() -> None:
    """No finding (it would explain AMP-N02/N05): not checked, with the variants that ran."""
    event = _replay(
        cause=None,
        incomplete="the replay's time budget was spent",
        experiments=[_x("as it ran", False, "booster"), _x("autocast off", True)],
    )
    finding, reason = _n17([event])
    assert finding is None
    assert reason == (
        "the bad step 5 was replayed, but no cause was measured: the replay's time budget was "
        "spent (variants run: as it ran: non-finite in `booster`; autocast off: finite)"
    )


@pytest.mark.parametrize(
    ("events", "manifest", "reason"),
    [
        (
            [
                _replay(
                    replayed=False, reason="the engine owns backward (DeepSpeed)", experiments=None
                )
            ],
            ON,
            "the bad step 5 was not replayed: the engine owns backward (DeepSpeed)",
        ),
        ([], {"config": {}}, "did not replay bad steps"),
        ([], {"config": {"replay": "off", "replay_max": 3}}, "replay was off"),
        ([], {"config": {"replay": "on", "replay_max": 0}}, "replay was off"),
        ([], ON, "no bad step to replay"),
    ],
)
def test_not_checked_with_the_true_reason(events, manifest, reason) -> None:
    finding, not_checked = _n17(events, manifest=manifest)
    assert finding is None
    assert not_checked is not None and reason in not_checked


def test_skipped_steps_without_replay_events_are_not_called_clean() -> None:
    steps = [
        {
            "step": s,
            "scaler_enabled": True,
            "scale_before": 256.0,
            "scale_after": 256.0,
            "skipped": False,
        }
        for s in range(20)
    ]
    steps[12].update(scale_after=128.0, skipped=True, found_inf=1.0)
    d = diagnose(fake_run(steps=steps, manifest=ON), only=["AMP-N17"])
    reason = {n.id: n.reason for n in d.not_checked}["AMP-N17"]
    assert reason.startswith("1 step(s) were skipped for inf/NaN gradients outside")


# -- end to end over tiny real runs ----------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    sys.path.insert(0, str(SCRIPTS))
    try:
        import train_replay  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(SCRIPTS))
    root = tmp_path_factory.mktemp("replay_runs")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("amprobe.capture.collectors.replay.TIME_FACTOR", 1e4)
        for case in ("layer", "nan_batch", "loss"):
            train_replay.train(case, attach=str(root / case))
            out[case] = root / case
    return out


def _diagnose_json(run: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    cli_main(["diagnose", str(run), "--format", "json"])
    return json.loads(capsys.readouterr().out)


def test_diagnose_json_carries_cause_experiments_and_fix(runs, capsys) -> None:
    doc = _diagnose_json(runs["layer"], capsys)
    ids = [f["id"] for f in doc["findings"]]
    n17 = doc["findings"][ids.index("AMP-N17")]
    ev = n17["evidence"]
    assert ev["cause"] == "precision" and ev["verified_fix"] == ["big"] and ev["step"] == 5
    variants = [x["variant"] for x in ev["experiments"]]
    assert variants[:2] == ["as it ran", "autocast off"] and "fp32 big" in variants
    assert ev["experiments"][0]["finite"] is False and ev["experiments"][1]["finite"] is True
    assert '_fp32(model.get_submodule("big"))' in n17["fix"]
    # the precision cause keeps AMP-N11 (bf16 would fix an fp16 overflow)
    assert "AMP-N11" in ids


@pytest.mark.parametrize(
    ("case", "cause"), [("nan_batch", "data-or-model"), ("loss", "loss-computation")]
)
def test_no_precision_advice_where_the_cause_is_not_precision(runs, capsys, case, cause) -> None:
    doc = _diagnose_json(runs[case], capsys)
    by_id = {f["id"]: f for f in doc["findings"]}
    assert by_id["AMP-N17"]["evidence"]["cause"] == cause
    assert "AMP-N11" not in by_id  # "prefer bf16" would not help
    for f in doc["findings"]:
        assert "move to bf16" not in f["fix"] and "bfloat16" not in f["fix"], f["id"]


def test_symptoms_point_to_the_cause() -> None:
    """AMP-N02 (skipped steps) and AMP-N05 (the overflowing layer) are explained by N17."""
    from amprobe.rules.engine import REGISTRY, Finding, order_cause_first

    assert "AMP-N17" in REGISTRY["AMP-N02"].explained_by
    assert "AMP-N17" in REGISTRY["AMP-N05"].explained_by
    made = [
        Finding(i, "x", "error", "nan", "t", {}, "f") for i in ("AMP-N02", "AMP-N05", "AMP-N17")
    ]
    ordered = order_cause_first(made)
    assert ordered[0].id == "AMP-N17" and set(ordered[0].explains) == {"AMP-N02", "AMP-N05"}
    assert all("AMP-N17" in f.explained_by for f in ordered[1:])


def test_report_shows_the_experiments_beside_the_loss_scale(runs, tmp_path) -> None:
    from amprobe.report.scale import build_scale_section, replay_marks

    run = amprobe.load_run(runs["layer"])
    d = diagnose(run)
    section = build_scale_section(run, d)
    (marker,) = [t for t in section.figures[0].data if t.name == "replayed step"]
    assert list(marker.x) == [5] and marker.mode == "markers"
    assert "precision" in marker.text[0]
    ((caption, table),) = section.tables
    assert caption == "replay of step 5: experiments (cause: precision)"
    assert list(table["variant"])[:2] == ["as it ran", "autocast off"]
    assert replay_marks(d)[0].cause == "precision"
    out = tmp_path / "r.html"
    cli_main(["report", str(runs["layer"]), "-o", str(out)])
    html = out.read_text()
    assert "replay of step 5: experiments (cause: precision)" in html
    assert "<caption>experiments</caption>" in html  # the finding's evidence: a table
    assert "<th>first non-finite layer</th>" in html
    assert "<pre><code>import torch" in html  # the verified fix as code


def test_dashboard_loss_scale_tab_marks_the_replay(runs) -> None:
    pytest.importorskip("dash")
    from amprobe.report.scale import build_scale_section, replay_marks, steps_of
    from dashboard import layout

    run = amprobe.load_run(runs["nan_batch"])
    d = diagnose(run)
    tab = layout.build_loss_scale(
        steps_of(run), build_scale_section(run, d), replays=replay_marks(d)
    )
    figures = [c.figure for c in tab.children if hasattr(c, "figure")]
    (fig,) = figures
    (marker,) = [t for t in fig.data if t.name == "replayed step"]
    assert list(marker.x) == [5] and "data-or-model" in marker.text[0]
    from tests.helpers import component_texts

    words = " ".join(component_texts(tab))
    assert "replay of step 5: experiments (cause: data-or-model)" in words
    assert "autocast off" in words


def test_dashboard_shows_the_verified_fix_as_code(runs) -> None:
    pytest.importorskip("dash")
    from dash import html

    from dashboard import layout

    d = diagnose(amprobe.load_run(runs["layer"]))
    n17 = next(f for f in d.findings if f.id == "AMP-N17")
    card = layout.build_findings([n17])[1]

    def walk(c: Any) -> list[Any]:
        kids = getattr(c, "children", None)
        kids = kids if isinstance(kids, list) else [kids] if kids is not None else []
        return [c, *(x for k in kids for x in walk(k))]

    (pre,) = [c for c in walk(card) if isinstance(c, html.Pre)]
    assert '_fp32(model.get_submodule("big"))' in pre.children.children
