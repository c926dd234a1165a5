"""Precision set-up rules (AMP-N11 .. N15) in both directions, on hand-built runs."""

from __future__ import annotations

import pytest

from amprobe.rules import REGISTRY
from amprobe.rules import precision as precision_rules
from tests.helpers import fake_run
from tests.trajectories import (
    diag,
    findings_of,
    not_checked_ids,
    plain_steps,
    scaled_steps,
    scaler_event,
)

PRECISION_RULES = {"AMP-N11", "AMP-N12", "AMP-N13", "AMP-N14", "AMP-N15"}


def test_every_precision_rule_is_covered_here():
    registered = {
        rid for rid, spec in REGISTRY.items() if spec.fn.__module__ == precision_rules.__name__
    }
    assert registered == PRECISION_RULES


# -- AMP-N11 prefer-bf16 --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "bf16_supported", "cuts", "expected"),
    [
        pytest.param("float16", True, [], None, id="no-overflow"),
        pytest.param("float16", True, [10, 30], "info", id="few-cuts-info"),
        pytest.param("float16", True, range(5, 100, 20), "info", id="boundary-5pct-info"),
        pytest.param("float16", True, range(5, 100, 10), "warning", id="10pct-skipped-warning"),
        pytest.param("float16", False, range(5, 100, 10), None, id="no-bf16-hardware"),
        pytest.param("bfloat16", True, range(5, 100, 10), None, id="already-bf16"),
    ],
)
def test_n11_prefer_bf16(dtype, bf16_supported, cuts, expected):
    cuts = list(cuts)
    run = fake_run(
        steps=scaled_steps(100, cuts=cuts, dtype=dtype),
        events=[scaler_event()],
        manifest={"bf16_supported": bf16_supported, "device": "cpu"},
    )
    found = findings_of(diag(run), "AMP-N11")
    if expected is None:
        assert found == []
        return
    (f,) = found
    assert f.severity == expected
    assert f.evidence["scale_cut_count"] == len(cuts)
    assert f.evidence["skipped_share"] == pytest.approx(len(cuts) / 100, abs=1e-4)
    assert f.evidence["skipped_steps"] == cuts[:20]
    assert f.evidence["device"] == "cpu"


def test_n11_threshold_override_and_gpu_name():
    run = fake_run(
        steps=scaled_steps(100, cuts=[1, 2]),
        events=[scaler_event()],
        manifest={"gpu_name": "NVIDIA A100", "device": "cuda:0"},
    )
    (f,) = findings_of(diag(run), "AMP-N11")
    assert f.severity == "info" and "A100" in f.title and f.evidence["device"] == "NVIDIA A100"
    (f,) = findings_of(diag(run, {"AMP-N11": {"warn_skip_share": 0.01}}), "AMP-N11")
    assert f.severity == "warning"


def test_n11_not_checked_without_device_facts():
    run = fake_run(steps=scaled_steps(100, cuts=[1, 2]), events=[scaler_event()])
    run.ranks[0].manifest.pop("bf16_supported")
    reasons = not_checked_ids(diag(run))
    assert "device" in reasons["AMP-N11"]


def test_n11_not_checked_on_bf16_without_scaler():
    reasons = not_checked_ids(diag(fake_run(steps=plain_steps(30, dtype="bfloat16"))))
    assert "AMP-N11" in reasons


# -- AMP-N12 fp16-without-scaler ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "events", "expect", "disabled"),
    [
        pytest.param(plain_steps(20, dtype="float16"), [], True, 0, id="fp16-no-scaler"),
        pytest.param(
            plain_steps(20, dtype="float16"),
            [scaler_event(enabled=False)],
            True,
            1,
            id="fp16-disabled-scaler",
        ),
        pytest.param(
            scaled_steps(20, dtype="float16"), [scaler_event()], False, 0, id="fp16-with-scaler"
        ),
        pytest.param(plain_steps(20, dtype="bfloat16"), [], False, 0, id="bf16-no-scaler"),
        pytest.param(
            plain_steps(20, dtype=None),
            [{"kind": "autocast_seen", "dtype": "float16", "enabled": True}],
            True,
            0,
            id="fp16-from-autocast-event",
        ),
        pytest.param(
            plain_steps(20, dtype=None),
            [{"kind": "autocast_seen", "dtype": "float16", "enabled": False}],
            False,
            0,
            id="disabled-autocast-ignored",
        ),
    ],
)
def test_n12_fp16_without_scaler(steps, events, expect, disabled):
    d = diag(fake_run(steps=steps, events=events))
    found = findings_of(d, "AMP-N12")
    if not expect:
        assert found == []
        return
    (f,) = found
    assert f.severity == "warning"
    assert f.evidence["autocast_dtypes"] == ["float16"]
    assert f.evidence["scaler_count"] == len(events) - sum(
        e["kind"] != "scaler_created" for e in events
    )
    assert f.evidence["disabled_scaler_count"] == disabled
    assert f.evidence["step_count"] == 20
    assert ("disabled" in f.title) == bool(disabled)


def test_n12_not_checked_without_autocast():
    reasons = not_checked_ids(diag(fake_run(steps=plain_steps(20, dtype=None))))
    assert "autocast" in reasons["AMP-N12"]


# -- AMP-N13 half-loss ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss_dtypes", "expected_dtype"),
    [
        pytest.param(["float32"] * 20, None, id="fp32-loss"),
        pytest.param(["float16"] * 20, "float16", id="fp16-loss"),
        pytest.param(["bfloat16"] * 5 + ["float32"] * 15, "bfloat16", id="some-bf16-loss"),
        pytest.param(["float64"] * 20, None, id="fp64-loss"),
    ],
)
def test_n13_half_loss(loss_dtypes, expected_dtype):
    rows = scaled_steps(len(loss_dtypes))
    for row, dtype in zip(rows, loss_dtypes, strict=True):
        row["loss_dtype"] = dtype
    found = findings_of(diag(fake_run(steps=rows)), "AMP-N13")
    if expected_dtype is None:
        assert found == []
        return
    (f,) = found
    half = [i for i, d in enumerate(loss_dtypes) if d in ("float16", "bfloat16")]
    assert f.severity == "warning"
    assert f.evidence["loss_dtype"] == expected_dtype
    assert f.evidence["affected_step_count"] == len(half)
    assert f.evidence["step_count"] == len(loss_dtypes)
    assert f.evidence["half_loss_steps"] == half[:20]


def test_n13_not_checked_without_loss():
    reasons = not_checked_ids(diag(fake_run(steps=scaled_steps(20, loss_dtype=None))))
    assert "loss" in reasons["AMP-N13"]


# -- AMP-N14 half-master-weights ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("half", "total", "expect"),
    [
        pytest.param(0, 1000, False, id="fp32-master"),
        pytest.param(1000, 1000, True, id="model-half"),
        pytest.param(10, 1000, True, id="some-half"),
        pytest.param(None, 1000, False, id="field-missing"),
    ],
)
def test_n14_half_master_weights(half, total, expect):
    event = {
        "kind": "optimizer_seen",
        "optimizer_class": "SGD",
        "trainable_params": total,
        "trainable_half_params": half,
        "param_dtypes": {"float16": half or 0, "float32": total - (half or 0)},
    }
    found = findings_of(diag(fake_run(steps=plain_steps(10), events=[event])), "AMP-N14")
    if not expect:
        assert found == []
        return
    (f,) = found
    assert f.severity == "error"
    assert f.evidence["half_param_count"] == half
    assert f.evidence["trainable_param_count"] == total
    assert f.evidence["optimizer"] == "SGD"
    assert f.evidence["param_dtypes"] == event["param_dtypes"]


def test_n14_one_finding_per_optimizer():
    events = [
        {
            "kind": "optimizer_seen",
            "optimizer_class": c,
            "trainable_params": 10,
            "trainable_half_params": h,
        }
        for c, h in (("SGD", 10), ("Adam", 0), ("AdamW", 3))
    ]
    found = findings_of(diag(fake_run(steps=plain_steps(10), events=events)), "AMP-N14")
    assert sorted(f.evidence["optimizer"] for f in found) == ["AdamW", "SGD"]


def test_n14_not_checked_without_optimizer():
    assert "AMP-N14" in not_checked_ids(diag(fake_run(steps=plain_steps(10))))


# -- AMP-N15 bf16-needless-scaler -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtypes", "expect"),
    [
        pytest.param(["bfloat16"], True, id="bf16-with-scaler"),
        pytest.param(["float16"], False, id="fp16-with-scaler"),
        pytest.param(["bfloat16", "float16"], False, id="mixed-dtypes"),
    ],
)
def test_n15_bf16_needless_scaler(dtypes, expect):
    rows = []
    for i, dtype in enumerate(dtypes):
        part = scaled_steps(10, dtype=dtype)
        for row in part:
            row["step"] += 10 * i
        rows += part
    found = findings_of(diag(fake_run(steps=rows, events=[scaler_event()])), "AMP-N15")
    if not expect:
        assert found == []
        return
    (f,) = found
    assert f.severity == "info"
    assert f.evidence["autocast_dtypes"] == sorted(dtypes)
    assert f.evidence["scaled_step_count"] == len(rows)


def test_n15_not_checked_without_scaler():
    reasons = not_checked_ids(diag(fake_run(steps=plain_steps(20, dtype="bfloat16"))))
    assert "GradScaler" in reasons["AMP-N15"]


def test_disabled_scaler_rows_are_not_scaler_steps():
    rows = scaled_steps(20, cuts=range(10))
    for row in rows:
        row["scaler_enabled"] = False
    d = diag(fake_run(steps=rows))
    assert {"AMP-N01", "AMP-N02", "AMP-N15"} <= set(not_checked_ids(d))
    assert findings_of(d, "AMP-N12")  # fp16 with only a disabled scaler
