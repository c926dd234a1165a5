"""The block-scaled what-if's read side: pooled statistics, the fit per layer and format, and
rules AMP-P04 / AMP-P05, on hand-built ``blockstats`` frames (the spec's columns)."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd
import pytest

from amprobe.analysis.blockfit import (
    FIT_THRESHOLDS,
    block_fit_missing_reason,
    compute_block_fit,
    compute_block_stats,
    format_order,
    narrowest_fit,
)
from amprobe.rules import diagnose
from amprobe.store.blockformats import DEFAULT_FORMATS, FORMATS, STAT_FIELDS, rows_for
from tests.helpers import fake_run

CONV_APPROX = "conv: blocks along input channels at each position, not the im2col patch"


def _row(
    layer: str,
    operand: str,
    orientation: str,
    fmt: str,
    *,
    step: int = 0,
    rank: int = 0,
    nonzero: int = 1000,
    flushed: int = 0,
    clipped: int = 0,
    blocks: int = 32,
    scale_under: int = 0,
    sqnr: float = 40.0,
    approx: str = "",
    layer_type: str = "Linear",
) -> dict[str, Any]:
    signal = float(nonzero)
    return {
        "rank": rank,
        "step": step,
        "layer": layer,
        "layer_type": layer_type,
        "operand": operand,
        "orientation": orientation,
        "format": fmt,
        "dtype": "float32",
        "rows": 32,
        "cols": 32,
        "calls": 1,
        "approx": approx,
        "elements": 1024,
        "nonzero": nonzero,
        "nonfinite": 0,
        "flushed": flushed,
        "clipped": clipped,
        "blocks": blocks,
        "scale_under": scale_under,
        "scale_sat": 0,
        "signal": signal if nonzero else 0.0,
        "noise": signal / 10 ** (sqnr / 10) if nonzero and math.isfinite(sqnr) else 0.0,
    }


def _benign(fmt: str) -> dict[str, Any]:
    """Statistics of a Gaussian-like operand: 8-bit formats at 35 dB, 4-bit ones at 18 dB with
    5 % flushed."""
    if FORMATS[fmt].element == "e2m1":
        return {"sqnr": 18.0, "flushed": 50}
    return {"sqnr": 35.0, "flushed": 1}


def _layer(layer: str, special: Any = None, **kw: Any) -> list[dict[str, Any]]:
    """Every (operand, orientation, format) row of one layer, benign unless ``special(operand,
    orientation, format)`` returns other statistics."""
    rows = []
    for op in ("x", "w", "dy"):
        for orient, fmt in rows_for(op, DEFAULT_FORMATS):
            stats = _benign(fmt)
            if special is not None:
                stats = {**stats, **(special(op, orient, fmt) or {})}
            rows.append(_row(layer, op, orient, fmt, **stats, **kw))
    return rows


def _outlier(op: str, orient: str, fmt: str) -> dict[str, Any] | None:
    """An outlier channel in X: one large value per block flushes a third of the others in the
    4-bit formats (MXFP4, NVFP4); 8-bit formats keep them."""
    if op == "x" and FORMATS[fmt].element == "e2m1":
        return {"flushed": 350, "sqnr": 12.0}
    return None


def _tiny(op: str, orient: str, fmt: str) -> dict[str, Any] | None:
    """Tiny gradients: the MX formats' e8m0 block scales underflow below 2^-127, so dY's blocks
    flush; NVFP4 (tensor scale) and fp32-scaled fp8 keep them."""
    if op == "dy" and FORMATS[fmt].scale == "e8m0":
        return {"flushed": 400, "scale_under": 12, "sqnr": 22.0}
    return None


def _zero_dy(op: str, orient: str, fmt: str) -> dict[str, Any] | None:
    return {"nonzero": 0, "flushed": 0, "sqnr": math.nan} if op == "dy" else None


def _all_zero(op: str, orient: str, fmt: str) -> dict[str, Any]:
    return {"nonzero": 0, "flushed": 0, "sqnr": math.nan}


def _run(rows: list[dict[str, Any]], ranks: tuple[int, ...] = (0,)) -> Any:
    run = fake_run(steps=[{"step": 0, "rank": r} for r in ranks], ranks=ranks)
    frame = pd.DataFrame(rows)
    for c in STAT_FIELDS[:-2]:
        frame[c] = frame[c].astype(np.int64)
    run._tables["blockstats"] = frame
    return run


def _model(**planted: Any) -> list[dict[str, Any]]:
    rows = []
    for name in ("embed_proj", "attn.qkv", "attn.out", "mlp.fc1", "mlp.fc2", "lm_head"):
        rows += _layer(name, planted.get(name))
    return rows


def _findings(run: Any, rid: str, **overrides: float) -> list[Any]:
    d = diagnose(run, thresholds={rid: overrides} if overrides else None, only=[rid])
    assert not d.not_checked, d.not_checked
    return [f for f in d.findings if f.id == rid]


# -- pooled statistics ---------------------------------------------------------------------------
def test_stats_pool_steps_and_mark_zero_and_lossless_rows() -> None:
    rows = [
        _row("fc", "x", "fwd", "mxfp4", step=0, nonzero=100, flushed=10, sqnr=20.0),
        _row("fc", "x", "fwd", "mxfp4", step=1, nonzero=300, flushed=50, clipped=4, sqnr=10.0),
        _row("fc", "w", "fwd", "mxfp4", sqnr=math.inf),
        _row("fc", "dy", "dgrad", "mxfp4", nonzero=0, sqnr=math.nan),
    ]
    stats = compute_block_stats(pd.DataFrame(rows)).set_index(["operand", "orientation"])
    x = stats.loc[("x", "fwd")]
    assert x["steps"] == 2 and x["nonzero"] == 400
    assert x["flushed_share"] == pytest.approx(60 / 400)
    assert x["clipped_share"] == pytest.approx(4 / 400)
    assert x["lost_share"] == pytest.approx(64 / 400)
    # sums first: (100 + 300) / (1 + 30), not the mean of 20 and 10 dB
    assert x["sqnr_db"] == pytest.approx(10 * math.log10(400 / (100 / 100 + 300 / 10)))
    assert stats.loc[("w", "fwd"), "sqnr_db"] == math.inf
    dy = stats.loc[("dy", "dgrad")]
    assert math.isnan(dy["sqnr_db"]) and dy["status"] == "all zero"


def test_formats_ordered_by_bits() -> None:
    assert format_order(["mxfp8", "fp8_tensor", "nvfp4", "fp8_block", "mxfp4"]) == [
        "mxfp4",
        "nvfp4",
        "fp8_tensor",
        "fp8_block",
        "mxfp8",
    ]


# -- the fit per layer ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("special", "narrowest", "limit", "failing"),
    [
        (None, "mxfp4", "X fwd", {}),
        (_outlier, "mxfp8", None, {"mxfp4": ["X fwd", "X wgrad"], "nvfp4": ["X fwd", "X wgrad"]}),
        (
            _tiny,
            "nvfp4",
            "X fwd",
            {"mxfp4": ["dY dgrad", "dY wgrad"], "mxfp8": ["dY dgrad", "dY wgrad"]},
        ),
        (_zero_dy, "mxfp4", "X fwd", {}),  # all-zero dY rows never fail
    ],
)
def test_layer_fit(special: Any, narrowest: str, limit: str | None, failing: dict) -> None:
    fit = compute_block_fit(compute_block_stats(pd.DataFrame(_layer("fc", special))))
    by_fmt = fit.set_index("format")
    for fmt, labels in failing.items():
        assert by_fmt.loc[fmt, "fits"] is False or not by_fmt.loc[fmt, "fits"]
        assert by_fmt.loc[fmt, "failing"] == labels
    best = narrowest_fit(fit).iloc[0]
    assert best["narrowest"] == narrowest
    if limit is not None:
        assert best["limit"] == limit


def test_all_zero_layer_is_not_judged() -> None:
    fit = compute_block_fit(compute_block_stats(pd.DataFrame(_layer("fc", _all_zero))))
    assert (fit["status"] == "all zero").all() and fit["fits"].isna().all()
    assert not narrowest_fit(fit).iloc[0]["judged"]


# -- AMP-P04 / AMP-P05 ---------------------------------------------------------------------------
def test_p04_counts_layers_per_narrowest_format() -> None:
    run = _run(_model(**{"mlp.fc2": _outlier, "lm_head": _tiny}))
    (p04,) = _findings(run, "AMP-P04")
    assert p04.title.startswith(
        "4 of 6 matmul layer(s) fit MXFP4 (4.25 bits per element); 1 need NVFP4; 1 need MXFP8"
    )
    assert "per-tensor fp8 (shown beside, not a candidate)" in p04.title
    narrowest = {r["module"]: r["narrowest"] for r in p04.evidence["layers"]}
    assert narrowest["mlp.fc2"] == "MXFP8" and narrowest["lm_head"] == "NVFP4"
    assert narrowest["attn.qkv"] == "MXFP4"
    assert "Blackwell" in p04.fix and "software recipe" in p04.fix
    assert "Hopper added" not in p04.fix + p04.title
    json.dumps(p04.to_dict(), allow_nan=False)  # no inf/NaN in the JSON


@pytest.mark.parametrize(
    ("planted", "expected"),
    [
        ({}, {}),  # benign: nothing hostile
        (
            {"mlp.fc2": _outlier},
            {"mlp.fc2": ("MXFP4 flushes 35 % of `mlp.fc2`'s X (fwd)", "outlier")},
        ),
        (
            {"lm_head": _tiny},
            {"lm_head": ("MXFP4 flushes 40 % of `lm_head`'s dY (dgrad)", "underflow")},
        ),
        ({"attn.out": _zero_dy}, {}),  # all-zero rows are never counted as failing
    ],
)
def test_p05_names_the_failing_operand(planted: dict, expected: dict) -> None:
    run = _run(_model(**planted))
    found = {f.evidence["module"]: f for f in _findings(run, "AMP-P05")}
    assert set(found) == set(expected)
    for layer, (title, cause) in expected.items():
        f = found[layer]
        assert f.title.startswith(title), f.title
        assert "keep it in bf16" in f.title
        assert cause in f.fix
        assert {r["verdict"] for r in f.evidence["rows"]} >= {"fails"}
        json.dumps(f.to_dict(), allow_nan=False)


def test_p05_layer_fitting_no_block_format() -> None:
    def hopeless(op: str, orient: str, fmt: str) -> dict[str, Any] | None:
        return {"flushed": 600, "sqnr": 3.0} if op == "w" and fmt != "fp8_tensor" else None

    (f,) = _findings(_run(_model(**{"mlp.fc1": hopeless})), "AMP-P05")
    assert f.evidence["module"] == "mlp.fc1" and "fits no block format" in f.title


def test_threshold_override_moves_the_verdict() -> None:
    run = _run(_model(**{"mlp.fc2": _outlier}))
    assert _findings(run, "AMP-P05")
    assert not _findings(run, "AMP-P05", e2m1_max_flushed_share=0.5, e2m1_min_sqnr_db=8.0)
    (p04,) = _findings(run, "AMP-P04", e2m1_max_flushed_share=0.5, e2m1_min_sqnr_db=8.0)
    assert p04.title.startswith("6 of 6 matmul layer(s) fit MXFP4")
    assert FIT_THRESHOLDS["e2m1"].max_flushed_share == 0.2  # the table itself is unchanged


def test_approx_rows_are_said_so() -> None:
    rows = _model() + _layer("conv", approx=CONV_APPROX, layer_type="Conv2d")
    (p04,) = _findings(_run(rows), "AMP-P04")
    assert p04.evidence["approx_modules"] == ["conv"]
    conv = next(r for r in p04.evidence["layers"] if r["module"] == "conv")
    assert conv["approx"] == CONV_APPROX


def test_ranks_are_named() -> None:
    rows = [{**r, "rank": rank} for rank in (0, 1) for r in _model(**{"mlp.fc2": _outlier})]
    run = _run(rows, ranks=(0, 1))
    (p04,) = _findings(run, "AMP-P04")
    assert p04.evidence["ranks"] == [0, 1] and p04.title.endswith("on ranks 0-1")
    (p05,) = _findings(run, "AMP-P05")
    assert p05.evidence["ranks"] == [0, 1]


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (None, "no blockstats table was recorded"),
        ({"collectors": ["numerics"]}, "amprobe without block statistics"),
        ({"collectors": ["numerics"], "block_formats": []}, "block_formats=[]"),
    ],
)
def test_not_checked_without_blockstats(config: dict | None, reason: str) -> None:
    run = fake_run(steps=[{"step": 0}], manifest={"config": config} if config else None)
    d = diagnose(run, only=["AMP-P04", "AMP-P05"])
    reasons = {n.id: n.reason for n in d.not_checked}
    assert set(reasons) == {"AMP-P04", "AMP-P05"} and reason in reasons["AMP-P04"]
    assert block_fit_missing_reason(run) == reasons["AMP-P05"]
