"""Rule tests for AMP-N04/N05/N06/N16 and the per-layer evidence of N03/N11, on hand-built frames."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from amprobe.analysis.numerics import compute_scale_hint, compute_underflow, module_role
from amprobe.report.numerics import build_numerics_section
from amprobe.rules import diagnose
from tests.helpers import fake_run

FP16_AUTOCAST = {"kind": "autocast_seen", "device": "cpu", "dtype": "float16", "enabled": True}


def _steps(n: int, overrides: dict[int, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        row = {
            "step": i,
            "scaler_enabled": True,
            "scale_before": 1024.0,
            "scale_after": 1024.0,
            "skipped": False,
            "found_inf": 0.0,
            "input_nonfinite": 0,
            "loss_nonfinite": False,
            "autocast_dtype": "float16",
            "loss_dtype": "float32",
        }
        row.update((overrides or {}).get(i, {}))
        rows.append(row)
    return rows


def _row(
    step: int,
    module: str,
    kind: str,
    module_type: str = "Linear",
    dtype: str = "float16",
    order: int = 0,
    elements: int = 100,
    nan: int = 0,
    inf: int = 0,
    zeros: int = 0,
    hist: dict[int, int] | None = None,
    loss_scale: float | None = None,
    underflow: int = 0,
    amax: float | None = 1.0,
    in_nonfinite: int | None = 0,
) -> dict[str, Any]:
    hist = hist if hist is not None else {-1: elements - nan - inf - zeros}
    if zeros:
        hist = {**hist, -127: zeros}
    if nan + inf:
        hist = {**hist, 128: nan + inf}
    return {
        "step": step,
        "module": module,
        "module_type": module_type,
        "kind": kind,
        "dtype": dtype,
        "calls": 1,
        "order": order,
        "elements": elements,
        "zeros": zeros,
        "nan": nan,
        "inf": inf,
        "finite": elements - nan - inf,
        "over_fp16": 0,
        "below_normal": 0,
        "below_subnormal": underflow,
        "underflow_at_scale": underflow,
        "loss_scale": loss_scale,
        "amax": amax,
        "in_nonfinite": in_nonfinite if kind == "output" else None,
        "exp_hist": json.dumps({str(k): v for k, v in hist.items()}),
    }


def _offender(
    step: int, kind: str, module: str, module_type: str = "Linear", **detail: Any
) -> dict[str, Any]:
    return {
        "step": step,
        "kind": kind,
        "module": module,
        "module_type": module_type,
        "detail": json.dumps(detail),
    }


def _ids(run) -> set[str]:
    return set(diagnose(run).ids())


def _get(run, rule_id: str, **kw):
    found = [f for f in diagnose(run, **kw).findings if f.id == rule_id]
    return found[0] if found else None


# -- AMP-N04 -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("bad_steps", "expected"),
    [
        ({}, None),
        ({3: {"input_nonfinite": 5}}, [3]),
        ({1: {"input_nonfinite": 1}, 4: {"input_nonfinite": 2}}, [1, 4]),
    ],
)
def test_nonfinite_input(bad_steps: dict, expected: list[int] | None) -> None:
    run = fake_run(steps=_steps(6, bad_steps), events=[FP16_AUTOCAST])
    finding = _get(run, "AMP-N04")
    if expected is None:
        assert finding is None
    else:
        assert finding is not None and finding.evidence["nonfinite_steps"] == expected
        assert finding.evidence["nonfinite_elements"] == [
            bad_steps[s]["input_nonfinite"] for s in expected
        ]


def test_nonfinite_input_not_checked_without_collector() -> None:
    steps = [{k: v for k, v in r.items() if k != "input_nonfinite"} for r in _steps(3)]
    diagnosis = diagnose(fake_run(steps=steps))
    reasons = {n.id: n.reason for n in diagnosis.not_checked}
    assert "AMP-N04" in reasons and "AMP-N05" in reasons and "numerics" in reasons["AMP-N05"]


# -- AMP-N05 -------------------------------------------------------------------------------------
def _overflow_tables(step: int = 1, module: str = "head", mtype: str = "Linear") -> dict[str, list]:
    rows = [
        _row(step, "fc", "output", order=0),
        _row(step, module, "output", mtype, order=1, inf=7),
    ]
    return {
        "numerics": rows,
        "offenders": [_offender(step, "forward", module, mtype, nan=0, inf=7, elements=100)],
    }


@pytest.mark.parametrize(
    ("module", "mtype", "role"),
    [
        ("head", "Linear", "output projection"),
        ("norm", "LayerNorm", "normalization"),
        ("emb", "Embedding", "embedding"),
        ("sm", "Softmax", "softmax"),
        ("act", "GELU", None),
    ],
)
def test_forward_overflow_names_module_and_role(module: str, mtype: str, role: str | None) -> None:
    run = fake_run(
        steps=_steps(3), events=[FP16_AUTOCAST], tables=_overflow_tables(1, module, mtype)
    )
    finding = _get(run, "AMP-N05")
    assert finding is not None
    assert finding.evidence["module"] == module and finding.evidence["step"] == 1
    assert finding.evidence["role"] == role and finding.evidence["inf_count"] == 7


@pytest.mark.parametrize(
    ("booster_order", "over", "origin"),
    [
        (0, 258, "booster"),  # fp32 output beyond fp16's range, before the overflowing head
        (0, 0, None),  # in range: head alone
        (2, 258, None),  # after head in execution order: not the origin
    ],
)
def test_forward_overflow_names_out_of_range_producer(
    booster_order: int, over: int, origin: str | None
) -> None:
    """Issue 14 item 3: the producer of out-of-range fp32 values is the origin, the cast's
    consumer the place where it overflowed."""
    booster = _row(1, "booster", "output", dtype="float32", order=booster_order, amax=3.07e5)
    booster["over_fp16"] = over
    tables = _overflow_tables(1)
    tables["numerics"] = [booster, _row(1, "head", "output", order=1, inf=7)]
    finding = _get(fake_run(steps=_steps(3), events=[FP16_AUTOCAST], tables=tables), "AMP-N05")
    assert finding is not None
    if origin is None:
        assert finding.evidence["module"] == "head" and "overflow_module" not in finding.evidence
        return
    assert finding.evidence["module"] == origin
    assert finding.evidence["overflow_module"] == "head"
    assert finding.evidence["origin_over_fp16_count"] == 258
    assert finding.evidence["origin_amax"] == pytest.approx(3.07e5)
    assert finding.title.startswith("booster (Linear) outputs values beyond fp16's range")
    assert "overflow to inf in head (Linear)" in finding.title


@pytest.mark.parametrize(
    ("autocast", "head_dtype", "origin"),
    [
        ("float16", "float16", "conv2"),  # fp16 cast of 4.65e5: inf, conv2 is the origin
        ("bfloat16", "bfloat16", None),  # representable in bf16: calib made its own inf
        ("float16", "float32", None),  # calib's output is fp32: no half cast to blame on conv2
        ("float16", None, "conv2"),  # dtype not recorded: the run's autocast dtype decides
    ],
)
def test_forward_overflow_judges_range_against_the_cast_dtype(
    autocast: str, head_dtype: str | None, origin: str | None
) -> None:
    """Issue 19 item 12: a bf16 run does not blame fp16's range."""
    conv2 = _row(1, "conv2", "output", "Conv2d", dtype="float32", order=0, elements=65536)
    conv2.update(over_fp16=2094, amax=4.65e5)
    calib = _row(1, "calib", "output", "Calib", dtype=head_dtype, order=1, inf=7)
    tables = _overflow_tables(1, "calib", "Calib")
    tables["numerics"] = [conv2, calib]
    event = {**FP16_AUTOCAST, "dtype": autocast}
    finding = _get(fake_run(steps=_steps(3), events=[event], tables=tables), "AMP-N05")
    assert finding is not None
    # ground truth from plain torch: what each cast makes of conv2's largest value
    assert torch.isinf(torch.tensor(4.65e5).half()) and torch.isfinite(
        torch.tensor(4.65e5).bfloat16()
    )
    if origin is None:
        assert finding.evidence["module"] == "calib" and "overflow_module" not in finding.evidence
        assert "fp16's range" not in finding.title
        return
    assert finding.evidence["module"] == origin and finding.evidence["overflow_module"] == "calib"
    assert finding.evidence["cast_dtype"] == "float16"
    assert finding.title.startswith(
        "conv2 (Conv2d) outputs values beyond fp16's range (2094 of 65536"
    )


def test_forward_overflow_in_bf16_names_values_beyond_bf16() -> None:
    big = float.fromhex("0x1.ffp127")  # the first fp32 magnitude bf16's cast makes inf
    assert torch.isinf(torch.tensor(big).bfloat16())
    assert torch.isfinite(torch.tensor(float.fromhex("0x1.fefffep127")).bfloat16())
    conv2 = _row(1, "conv2", "output", "Conv2d", dtype="float32", order=0, amax=big)
    calib = _row(1, "calib", "output", "Calib", dtype="bfloat16", order=1, inf=7)
    tables = _overflow_tables(1, "calib", "Calib")
    tables["numerics"] = [conv2, calib]
    event = {**FP16_AUTOCAST, "dtype": "bfloat16"}
    finding = _get(fake_run(steps=_steps(3), events=[event], tables=tables), "AMP-N05")
    assert finding is not None and finding.evidence["module"] == "conv2"
    assert finding.evidence["origin_over_fp16_count"] is None
    assert finding.title.startswith(
        "conv2 (Conv2d) outputs values beyond bf16's range (max 3.4e+38)"
    )


_SKIP = {"scale_after": 512.0, "skipped": True, "found_inf": 1.0}


@pytest.mark.parametrize(
    ("overrides", "first", "where"),
    [
        # sampled at 0, overflow (skipped) at 20 and 21, the armed capture of 21 names the layer
        pytest.param(
            {20: _SKIP, 21: _SKIP},
            20,
            "; first overflow at step 20, layer named from the capture of step 21",
            id="capture-after-overflow",
        ),
        pytest.param({21: _SKIP}, 21, ", at step 21", id="overflow-on-the-captured-step"),
        pytest.param({}, None, ", at step 21", id="no-overflow-recorded"),
        # an overflow before the previous sampled step belongs to an earlier episode
        pytest.param({5: _SKIP}, None, ", at step 21", id="before-the-previous-sample"),
        pytest.param(
            {19: {"loss_nonfinite": True}, 21: _SKIP},
            19,
            "; first overflow at step 19, layer named from the capture of step 21",
            id="nonfinite-loss",
        ),
    ],
)
def test_forward_overflow_says_first_overflow_and_captured_step(
    overrides: dict[int, dict[str, Any]], first: int | None, where: str
) -> None:
    """Issue 19 item 4: the step of the capture that names the layer is not the first overflow."""
    tables = _overflow_tables(21, "booster", "Booster")
    tables["numerics"] += [_row(10, "fc", "output", order=0)]  # the previous sampled step
    run = fake_run(steps=_steps(25, overrides), events=[FP16_AUTOCAST], tables=tables)
    finding = _get(run, "AMP-N05")
    assert finding is not None
    assert finding.evidence["step"] == 21 and finding.evidence["first_overflow_step"] == first
    assert finding.title == (
        "booster (Booster) is the first module whose output is non-finite" + where
    )


def test_forward_overflow_not_blamed_on_bad_input_steps() -> None:
    run = fake_run(
        steps=_steps(3, {1: {"input_nonfinite": 3}}),
        events=[FP16_AUTOCAST],
        tables=_overflow_tables(1),
    )
    assert _get(run, "AMP-N05") is None
    assert _get(run, "AMP-N04") is not None


def test_forward_overflow_absent_without_offenders() -> None:
    run = fake_run(
        steps=_steps(3), events=[FP16_AUTOCAST], tables={"numerics": [_row(0, "fc", "output")]}
    )
    assert "AMP-N05" not in _ids(run)


# -- AMP-N06 -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "hist", "zeros", "underflow", "scale", "share"),
    [
        ("float32", {-30: 5, -10: 95}, 0, 5, 1.0, 0.05),  # 5 of 100 nonzero below 2**-24: flushed
        ("float32", {-30: 5, -10: 95}, 0, 0, 2.0**10, None),  # the scale lifts them into range
        ("float16", {-20: 20, -5: 60}, 20, 0, 1.0, 0.25),  # 20 of 80 surviving values subnormal
        ("float16", {-20: 20, -5: 60}, 20, 0, 2.0**10, None),  # scaled by 1024 they are normal
        ("float32", {-10: 100}, 0, 0, 1.0, None),
    ],
)
def test_grad_underflow(
    dtype: str, hist: dict, zeros: int, underflow: int, scale: float, share: float | None
) -> None:
    elements = sum(hist.values()) + zeros
    rows = [
        _row(
            0,
            "fc",
            "grad_param",
            dtype=dtype,
            elements=elements,
            zeros=zeros,
            hist=hist,
            loss_scale=scale,
            underflow=underflow,
            amax=2.0**-4,
        )
    ]
    run = fake_run(steps=_steps(1), events=[FP16_AUTOCAST], tables={"numerics": rows})
    finding = _get(run, "AMP-N06")
    if share is None:
        assert finding is None
    else:
        assert finding is not None
        (layer,) = finding.evidence["layers"]
        assert layer["module"] == "fc" and layer["share"] == pytest.approx(share)
        hint = finding.evidence["scale_hint"]
        assert hint["hint_scale"] == 2.0 ** math.floor(math.log2(65504 / 8 / 2.0**-4))


@pytest.mark.parametrize(
    ("dtype", "hist", "zeros", "underflow", "expect"),
    [
        (
            "float16",
            {-20: 20, -5: 60},
            20,
            0,
            "worst fc (grad_param, float16): 25.0% of its nonzero values are fp16 subnormals at "
            "loss scale 1 (values already flushed to zero cannot be counted); 0.0% at 65536, "
            "the largest scale keeping amax under 65504/8",
        ),
        (
            "float32",
            {-30: 5, -10: 95},
            0,
            5,
            "worst fc (grad_param, float32): 5.0% of its nonzero values flush to zero in fp16 at "
            "loss scale 1; 0.0% at 65536, the largest scale keeping amax under 65504/8",
        ),
    ],
)
def test_grad_underflow_title_names_one_measure(
    dtype: str, hist: dict, zeros: int, underflow: int, expect: str
) -> None:
    """Both numbers of the title are the same measure of the same layer, named as such."""
    row = _row(
        0,
        "fc",
        "grad_param",
        dtype=dtype,
        elements=sum(hist.values()) + zeros,
        zeros=zeros,
        hist=hist,
        loss_scale=1.0,
        underflow=underflow,
        amax=2.0**-4,
    )
    run = fake_run(steps=_steps(1), events=[FP16_AUTOCAST], tables={"numerics": [row]})
    finding = _get(run, "AMP-N06")
    assert finding is not None
    assert finding.title.endswith(expect), finding.title
    (layer,) = finding.evidence["layers"]
    assert layer["share_at_hint"] == 0.0 and layer["loss_scales"] == [1.0]
    hint = finding.evidence["scale_hint"]
    if dtype == "float16":  # flushed fp16 values are zeros: no share over every gradient kind
        assert hint["underflow_share_at_current"] is None
    else:
        assert hint["underflow_share_at_current"] == pytest.approx(layer["share"])


def test_grad_underflow_only_for_fp16_runs() -> None:
    rows = [
        _row(
            0,
            "fc",
            "grad_param",
            dtype="float32",
            hist={-30: 50, -10: 50},
            underflow=50,
            loss_scale=1.0,
        )
    ]
    bf16 = {**FP16_AUTOCAST, "dtype": "bfloat16"}
    run = fake_run(
        steps=_steps(1, {0: {"autocast_dtype": "bfloat16"}}),
        events=[bf16],
        tables={"numerics": rows},
    )
    assert "AMP-N06" not in _ids(run)


def test_scale_hint_values() -> None:
    import pandas as pd

    frame = pd.DataFrame(
        [
            {
                "kind": "grad_param",
                "step": 0,
                "amax": 3.0,
                "loss_scale": 4096.0,
                "exp_hist": json.dumps({"-40": 10, "-30": 30, "1": 60}),
            },
        ]
    )
    hint = compute_scale_hint(frame, margin=8.0)
    assert hint is not None
    assert hint["hint_scale"] == 2048.0  # 65504 / 8 / 3 = 2729 -> 2**11
    assert hint["underflow_share_at_current"] == pytest.approx(0.10)  # 2**-40 * 4096 < 2**-24
    assert hint["underflow_share_at_hint"] == pytest.approx(0.10)


@pytest.mark.parametrize("scale", [2.0**4, 2.0**5, 2.0**6, 2.0**20])
def test_underflow_at_another_scale_is_what_a_real_cast_flushes(scale: float) -> None:
    """Issue 19 item 9: one boundary, the real one. Gradients in the binade [2**-30, 2**-29)
    at scale 2**5 land in (2**-25, 2**-24), which an fp16 cast rounds up to 2**-24: kept, not
    lost (the histogram path used to count everything below 2**-24)."""
    import pandas as pd

    g = torch.Generator().manual_seed(0)
    u = (2.0**-30 * (1 + torch.rand(1000, generator=g))).clamp(max=2.0**-29 * (1 - 2.0**-23))
    u = torch.cat([u, 2.0**-8 * torch.ones(1000)])  # and values that never flush
    s = torch.tensor(scale, dtype=torch.float32)
    truth = float((((u * s).half() == 0) & (u != 0)).sum()) / len(u)
    row = _row(0, "fc", "grad_param", dtype="float32", elements=2000, hist={-30: 1000, -8: 1000})
    row.update(loss_scale=1.0, amax=2.0**-8)
    frame = pd.DataFrame([row])
    (share,) = compute_underflow(frame, scale=scale)["lost_share"]
    assert share == pytest.approx(truth)
    hint = compute_scale_hint(frame.assign(loss_scale=scale), margin=8.0)
    assert hint is not None and hint["underflow_share_at_current"] == pytest.approx(truth)


# -- AMP-N16 -------------------------------------------------------------------------------------
def _sensitive_rows(dtype: str) -> list[dict[str, Any]]:
    return [
        _row(0, "emb", "output", "Embedding", dtype="float32", order=0),
        _row(0, "fc", "output", "Linear", dtype=dtype, order=1),
        _row(0, "head", "output", "Linear", dtype=dtype, order=2),
    ]


_CUT = {"scale_after": 512.0, "skipped": True}


@pytest.mark.parametrize(
    ("dtype", "cuts", "expected"),
    [
        ("float16", {1: _CUT, 3: _CUT}, ["head"]),
        ("float16", {}, None),
        ("float32", {1: _CUT, 3: _CUT}, None),
        # one overflow the scaler absorbed, or the initial calibration: dynamic scaling working
        ("float16", {1: _CUT}, None),
        ("float16", {0: _CUT, 1: _CUT, 2: _CUT}, None),
    ],
)
def test_sensitive_layers_half(
    dtype: str, cuts: dict[int, dict[str, Any]], expected: list[str] | None
) -> None:
    steps = _steps(5, cuts)
    created = {"kind": "scaler_created", "init_scale": 1024.0, "enabled": True}
    run = fake_run(
        steps=steps, events=[FP16_AUTOCAST, created], tables={"numerics": _sensitive_rows(dtype)}
    )
    finding = _get(run, "AMP-N16")
    if expected is None:
        assert finding is None
    else:
        assert finding is not None
        assert [x["module"] for x in finding.evidence["layers"]] == expected
        assert finding.evidence["layers"][0]["role"] == "output projection"
        assert finding.evidence["instability"]["scale_cut_count"] == 2


def test_sensitive_layers_half_nonfinite_loss_not_skipped_is_unstable() -> None:
    steps = _steps(3, {2: {"loss_nonfinite": True}})
    run = fake_run(
        steps=steps, events=[FP16_AUTOCAST], tables={"numerics": _sensitive_rows("float16")}
    )
    finding = _get(run, "AMP-N16")
    assert finding is not None and finding.evidence["instability"] == {"nonfinite_loss_count": 1}


# -- AMP-N03 / AMP-N11 evidence --------------------------------------------------------------------
def _collapse_steps(n: int = 20) -> list[dict[str, Any]]:
    scale = 1024.0
    rows = []
    for i in range(n):
        rows.append(
            {
                "step": i,
                "scaler_enabled": True,
                "scale_before": scale,
                "scale_after": scale / 2,
                "skipped": True,
                "found_inf": 1.0,
                "input_nonfinite": 0,
                "autocast_dtype": "float16",
            }
        )
        scale /= 2
    return rows


def test_scale_collapse_names_offender() -> None:
    run = fake_run(
        steps=_collapse_steps(),
        events=[FP16_AUTOCAST],
        tables=_overflow_tables(2, "norm", "LayerNorm"),
    )
    finding = _get(run, "AMP-N03")
    assert finding is not None
    assert finding.evidence["first_forward_offender"] == {
        "module": "norm",
        "module_type": "LayerNorm",
        "step": 2,
    }
    plain = _get(fake_run(steps=_collapse_steps(), events=[FP16_AUTOCAST]), "AMP-N03")
    assert plain is not None and "first_forward_offender" not in plain.evidence


def test_prefer_bf16_per_layer_evidence_and_bad_data() -> None:
    run = fake_run(steps=_collapse_steps(4), events=[FP16_AUTOCAST], tables=_overflow_tables(1))
    finding = _get(run, "AMP-N11")
    assert finding is not None
    assert finding.evidence["overflowing_layers"][0]["module"] == "head"
    assert finding.evidence["overflowing_layers"][0]["nonfinite_count"] == 7
    bad_data = [{**r, "input_nonfinite": 1} for r in _collapse_steps(4)]
    assert _get(fake_run(steps=bad_data, events=[FP16_AUTOCAST]), "AMP-N11") is None


def test_prefer_bf16_names_the_layer_that_overflowed_not_the_propagated_nans() -> None:
    """The overflowing layer holds fewer non-finite values than the NaNs it spreads downstream."""
    rows = []
    for step in (1, 2):
        rows += [
            _row(step, "fc1", "output", order=0, elements=2048),
            _row(step, "booster", "output", "Booster", order=1, elements=2048, inf=500),
            _row(step, "norm", "output", "LayerNorm", order=2, elements=2048, nan=2048),
            _row(step, "fc2", "output", order=3, elements=2048, nan=2048),
            _row(step, "fc2", "grad_output", order=0, elements=2048, nan=2048),
            _row(step, "fc2", "grad_param", dtype="float32", order=0, elements=4096, nan=4096),
        ]
        rows[-4]["in_nonfinite"] = 500
        rows[-3]["in_nonfinite"] = 2048
    # a later step whose forward stayed finite: its non-finite gradient arose in backward
    rows += [
        _row(3, "fc2", "output", order=0),
        _row(3, "fc2", "grad_output", order=0, inf=3),
    ]
    run = fake_run(steps=_collapse_steps(4), events=[FP16_AUTOCAST], tables={"numerics": rows})
    finding = _get(run, "AMP-N11")
    assert finding is not None
    layers = finding.evidence["overflowing_layers"]
    assert [(x["module"], x["kind"], x["first_step"]) for x in layers] == [
        ("booster", "output", 1),
        ("fc2", "grad_output", 3),
    ]
    assert layers[0]["nonfinite_count"] == 1000 and layers[1]["nonfinite_count"] == 3
    assert finding.evidence["propagated_layer_count"] == 3  # norm, fc2 output, fc2 grad_param


# -- roles and report ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mtype", "last", "role"),
    [
        ("RMSNorm", False, "normalization"),
        ("BatchNorm2d", False, "normalization"),
        ("CrossEntropyLoss", False, "loss"),
        ("MultiheadAttention", False, "softmax"),
        ("Linear", True, "output projection"),
        ("Linear", False, None),
    ],
)
def test_module_role(mtype: str, last: bool, role: str | None) -> None:
    assert module_role(mtype, last) == role


def test_report_section() -> None:
    tables = _overflow_tables(1)
    tables["numerics"].append(
        _row(
            1,
            "head",
            "grad_output",
            hist={-30: 10, -3: 90},
            underflow=10,
            loss_scale=1.0,
            dtype="float32",
            amax=0.2,
        )
    )
    run = fake_run(steps=_steps(3), events=[FP16_AUTOCAST], tables=tables)
    sec = build_numerics_section(run, diagnose(run))
    assert sec.missing is None
    assert len(sec.figures) == 4  # three heatmaps and the exponent histogram
    caption, table = sec.tables[0]
    head = table[(table["module"] == "head") & (table["kind"] == "output")].iloc[0]
    assert head["nonfinite"] == 7
    assert any("Loss-scale hint" in t for t in sec.text)
    heat = sec.figures[0].data[0]
    assert list(heat.x) == [1]


def test_report_section_missing() -> None:
    run = fake_run(steps=_steps(2))
    sec = build_numerics_section(run, diagnose(run))
    assert sec.missing is not None and "numerics" in sec.missing and not sec.figures


def test_exponent_histogram_figure_leaves_out_zeros_keeps_subnormals() -> None:
    import pandas as pd

    from amprobe.report.numerics import make_exponent_histogram_figure

    row = _row(0, "fc", "output", elements=19, zeros=5)
    row["exp_hist"] = json.dumps({"-149": 2, "-130": 3, "-127": 4 + 5, "0": 5})  # 5 zeros
    fig = make_exponent_histogram_figure(pd.DataFrame([row]), [("fc", "output")])
    (bars,) = fig.data
    assert dict(zip(bars.x, bars.y, strict=True)) == {-149: 2, -130: 3, -127: 4, 0: 5}


def test_a_damaged_gradient_row_is_named_when_grad_underflow_cannot_run(tmp_path):
    """A gradient row of the numerics table missing a count (a record damaged on disk) leaves
    AMP-N06 not checked with a reason that names the row and the counts read, not a bare
    conversion error; the other rules still run."""
    import shutil
    from pathlib import Path

    import amprobe

    run_dir = tmp_path / "run"
    shutil.copytree(Path(__file__).resolve().parents[1] / "sample_runs" / "overflow", run_dir)
    table = run_dir / "rank0" / "numerics.jsonl"
    lines = table.read_text().splitlines()
    for i, line in enumerate(lines):
        row = json.loads(line)
        if row.get("kind") not in ("output", "input"):
            del row["zeros"]
            lines[i] = json.dumps(row)
            damaged = row
            break
    table.write_text("\n".join(lines) + "\n")
    result = amprobe.diagnose(amprobe.load_run(run_dir))
    reasons = [n.reason for n in result.not_checked if n.id == "AMP-N06"]
    assert len(reasons) == 1, reasons
    assert "damaged gradient row" in reasons[0]
    assert f"module {damaged['module']}, step {damaged['step']}" in reasons[0]
    assert "zeros" in reasons[0]
    assert {"AMP-N02", "AMP-N05"} <= {f.id for f in result.findings}


def test_a_layer_whose_inputs_were_not_read_is_not_an_overflow_origin() -> None:
    """``in_nonfinite`` null on an output row: an input could not be read (a wrapper tensor
    subclass). Its non-finite output is not counted as made there; a layer whose inputs were
    finite is."""
    from amprobe.analysis.numerics import layer_overflow_evidence

    def row(module: str, order: int, nan: int, in_bad: int | None) -> dict[str, Any]:
        return {
            "step": 3, "module": module, "module_type": "Linear", "kind": "output",
            "dtype": "float16", "order": order, "elements": 8, "nan": nan, "inf": 0,
            "over_fp16": 0, "in_nonfinite": in_bad,
        }  # fmt: skip

    unread = fake_run(tables={"numerics": [row("a", 0, 8, None), row("b", 1, 8, 8)]})
    assert layer_overflow_evidence(unread, 0).get("overflowing_layers", []) == []
    read = fake_run(tables={"numerics": [row("a", 0, 8, 0), row("b", 1, 8, 8)]})
    layers = layer_overflow_evidence(read, 0)["overflowing_layers"]
    assert [layer["module"] for layer in layers] == ["a"]
