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
    block_fit,
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


def _run(rows: list[dict[str, Any]], ranks: tuple[int, ...] = (0,), events: tuple = ()) -> Any:
    run = fake_run(steps=[{"step": 0, "rank": r} for r in ranks], ranks=ranks, events=events)
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
        # it fits a narrower or wider format: the title names the narrowest it fits (as
        # AMP-P04 does), never "keep it in bf16" alone
        fits = block_fit(run)
        own = fits[(fits["layer"] == layer) & (fits["fits"] == True)]  # noqa: E712
        named = f.title.split("(it fits ", 1)[1].split(",", 1)[0]
        assert "keep it out of" in f.title and named in set(own["label"]), f.title
        assert cause in f.fix
        assert {r["verdict"] for r in f.evidence["rows"]} >= {"fails"}
        json.dumps(f.to_dict(), allow_nan=False)


def test_p05_layer_fitting_no_block_format() -> None:
    def hopeless(op: str, orient: str, fmt: str) -> dict[str, Any] | None:
        return {"flushed": 600, "sqnr": 3.0} if op == "w" and fmt != "fp8_tensor" else None

    (f,) = _findings(_run(_model(**{"mlp.fc1": hopeless})), "AMP-P05")
    assert f.evidence["module"] == "mlp.fc1"
    assert "keep it in bf16; it fits none of the block formats measured" in f.title


def test_p05_names_only_measured_formats_it_fits() -> None:
    """With NVFP4 not measured, a layer failing MXFP4 is not said to fit NVFP4 (it was said
    to: the unmeasured format counted as fitting)."""
    rows = [r for r in _model(lm_head=_tiny) if r["format"] in ("mxfp4", "mxfp8", "fp8_tensor")]
    (f,) = _findings(_run(rows), "AMP-P05")
    assert f.evidence["module"] == "lm_head" and "NVFP4" not in f.title + f.fix
    assert "keep it in bf16; it fits none of the block formats measured" in f.title


def test_no_block_scaled_format_measured_is_not_checked() -> None:
    rows = [r for r in _model() if r["format"] == "fp8_tensor"]
    for rid in ("AMP-P04", "AMP-P05"):
        d = diagnose(_run(rows), only=[rid])
        assert not [f for f in d.findings if f.id == rid]
        (reason,) = [n.reason for n in d.not_checked if n.id == rid]
        assert "no block-scaled format was measured" in reason and "fp8_tensor" in reason


def test_rows_with_no_finite_value_are_not_called_all_zero() -> None:
    def inf_dy(op: str, orient: str, fmt: str) -> dict[str, Any] | None:
        return {"nonzero": 0, "flushed": 0, "sqnr": math.nan} if op == "dy" else None

    rows = _layer("bad", inf_dy) + _layer("fine")
    for r in rows:
        if r["layer"] == "bad" and r["operand"] == "dy":
            r["nonfinite"] = r["elements"]
    stats = compute_block_stats(_run(rows).table("blockstats"))
    bad = stats[(stats["layer"] == "bad") & (stats["operand"] == "dy")]
    assert set(bad["status"]) == {"no finite value"}
    assert set(stats[stats["layer"] == "fine"]["status"]) == {"measured"}


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


# -- where users look: the matrix, the what-if section, the JSON, the dashboard ------------------
def _numerics(layers: list[str]) -> list[dict[str, Any]]:
    return [
        {
            "step": 0,
            "module": name,
            "module_type": "Linear",
            "kind": kind,
            "dtype": "float32",
            "calls": 1,
            "order": i,
            "elements": 100,
            "zeros": 0,
            "nan": 0,
            "inf": 0,
            "finite": 100,
            "over_fp16": 0,
            "loss_scale": 1.0,
            "amax": 1.0,
            "in_nonfinite": 0,
            "exp_hist": json.dumps({"-1": 100}),
        }
        for i, name in enumerate(layers)
        for kind in ("output", "grad_output")
    ]


def test_matrix_figure_cells() -> None:
    from amprobe.report.blockfit import make_block_fit_figure, run_block_fit

    rows = _model(**{"mlp.fc2": _outlier}) + _layer("zero", _all_zero)
    rows = [r for r in rows if not (r["layer"] == "lm_head" and r["format"] == "nvfp4")]
    fit = run_block_fit(_run(rows))
    fig = make_block_fit_figure(fit)
    heat = fig.data[0]
    assert list(heat.x) == [
        "MXFP4 (4.25)",
        "NVFP4 (4.5)",
        "fp8 per-tensor (8)",
        "fp8 1x128 blockwise (8.25)",
        "MXFP8 (8.25)",
    ]
    assert list(heat.y)[-1] == "zero" and (heat.zmin, heat.zmax) == (-1.5, 1.0)
    cell = {
        (y, x): (heat.z[i][j], heat.text[i][j], "<br>".join(heat.customdata[i][j]))
        for i, y in enumerate(heat.y)
        for j, x in enumerate(heat.x)
    }
    z, text, hover = cell[("mlp.fc2", "MXFP4 (4.25)")]
    score = fit[(fit["layer"] == "mlp.fc2") & (fit["format"] == "mxfp4")]["score"].iloc[0]
    assert z == pytest.approx(math.log10(score)) and z > 0  # over the threshold: the red side
    assert text.startswith("X fwd ✗ · ") and text.endswith(" · 35 % lost") and "lost 35 %" in hover
    # colour and verdict agree in every cell: over the threshold (z > 0) exactly where it fails
    for i, y in enumerate(heat.y):
        for j, x in enumerate(heat.x):
            if not math.isnan(heat.z[i][j]):
                assert (heat.z[i][j] > 0) == ("✗" in heat.text[i][j]), (y, x)
    z, text, hover = cell[("lm_head", "NVFP4 (4.5)")]  # not measured: blank, and said so
    assert math.isnan(z) and text == "" and "not measured" in hover
    assert "1 blank cell(s)" in fig.layout.title.text
    assert math.isnan(cell[("zero", "MXFP8 (8.25)")][0]) and "all zero" in fig.data[1].text[-1]


def test_whatif_section_and_json_carry_the_block_fit() -> None:
    from amprobe.report.blockfit import FIGURE_META, block_fit_json, run_block_fit
    from amprobe.report.whatif import build_whatif_section

    layers = ["embed_proj", "attn.qkv", "attn.out", "mlp.fc1", "mlp.fc2", "lm_head"]
    run = _run(_model(**{"mlp.fc2": _outlier}))
    run._tables["numerics"] = fake_run(tables={"numerics": _numerics(layers)}).table("numerics")
    run._derived.pop("summaries", None)
    run.cached("summaries", lambda _: fake_run(tables={"numerics": _numerics(layers)}).summaries())
    d = diagnose(
        run, thresholds={"AMP-P04": {"e2m1_max_flushed_share": 0.5, "e2m1_min_sqnr_db": 10}}
    )
    section = build_whatif_section(run, d)
    block = [f for f in section.figures if f.layout.meta == FIGURE_META]
    assert len(block) == 1
    assert not any("✗" in t for row in block[0].data[0].text for t in row)  # the override
    assert any(t.startswith("Block formats (matmul layers that fit") for t in section.text)
    records = block_fit_json(run_block_fit(run, d))
    assert len(records) == 6 * 5 and {"layer", "format", "limit", "sqnr_db"} <= set(records[0])
    json.dumps(records, allow_nan=False)


def test_json_merges_ranks_that_agree() -> None:
    from amprobe.report.blockfit import block_fit_json, run_block_fit

    ranks = tuple(range(12))
    rows = [
        {**r, "rank": rank}
        for rank in ranks
        for r in _model(**({"mlp.fc2": _outlier} if rank == 7 else {}))
    ]
    records = block_fit_json(run_block_fit(_run(rows, ranks=ranks)))
    # 30 (layer, format) records agreeing on every rank, and rank 7's own mlp.fc2 for the
    # two 4-bit formats its outlier changes
    assert len(records) == 30 + 2
    fc2 = [r for r in records if r["layer"] == "mlp.fc2" and r["format"] == "mxfp4"]
    assert sorted(r["ranks"] for r in fc2) == ["0-6, 8-11", "7"]


def test_dashboard_whatif_tab_shows_the_matrix() -> None:
    pytest.importorskip("dash", reason="the dashboard needs dash")
    from amprobe.report.blockfit import make_block_fit_figure, run_block_fit
    from amprobe.report.registry import Section
    from dashboard import ids, layout

    fig = make_block_fit_figure(run_block_fit(_run(_model())))
    section = Section(key="whatif", title="what-if", figures=(fig,), text=("t",))
    page = layout.build_whatif(section, None, "activations", ["activations"])

    def find(c: Any) -> Any:
        if getattr(c, "id", None) == ids.BLOCK_FIT_MATRIX:
            return c
        kids = getattr(c, "children", None)
        for k in kids if isinstance(kids, list) else [kids] if kids is not None else []:
            if (hit := find(k)) is not None:
                return hit
        return None

    assert find(page).figure is fig


def test_whatif_doc_formats_table_matches_the_data() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "whatif.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in doc.splitlines() if line.startswith("| `")}
    for key, fmt in FORMATS.items():
        cells = [c.strip() for c in rows[f"`{key}`"].split("|")]
        assert cells[2] == fmt.label and cells[3].startswith(fmt.element), key
        assert cells[8] == f"{fmt.bits:g}" and cells[7].startswith(fmt.scale_rounding), key


def test_matrix_run_text_is_data_not_markup() -> None:
    from amprobe.report.blockfit import make_block_fit_figure, run_block_fit
    from amprobe.report.escape import escape_figure_text

    fig = escape_figure_text(make_block_fit_figure(run_block_fit(_run(_layer("<b>x</b>")))))
    heat = fig.data[0]
    assert list(heat.y) == ["&lt;b&gt;x&lt;/b&gt;"]
    assert heat.customdata[0][0][0].startswith("&lt;b&gt;x")
    assert "<br>" in heat.hovertemplate and "<b>" not in heat.hovertemplate


def test_not_checked_when_no_matmul_layer_was_sampled() -> None:
    config = {"collectors": ["numerics"], "block_formats": list(DEFAULT_FORMATS)}
    run = fake_run(
        steps=[{"step": 0}],
        manifest={"config": config},
        tables={"numerics": _numerics(["norm"])},
    )
    d = diagnose(run, only=["AMP-P04"])
    assert [n.reason for n in d.not_checked] == [
        "no matmul layer was sampled (the blockstats table holds no rows)"
    ]


def test_evidence_renders_as_words_and_tables() -> None:
    from amprobe.report.evidence import Table, evidence_lines, render_evidence

    run = _run(_model(**{"mlp.fc2": _outlier, "lm_head": _tiny}) + _layer("zero", _all_zero))
    for f in diagnose(run, only=["AMP-P04", "AMP-P05"]).findings:
        text = "\n".join(evidence_lines(f))
        for word in ("None", "nan", "inf ", "True", "False", "{"):
            assert word not in text, (f.id, word)
        tables = [b for b in render_evidence(f) if isinstance(b, Table)]
        assert tables and "SQNR (dB)" in tables[0].columns


def test_what_the_capture_side_left_unmeasured_is_said() -> None:
    """nn.MultiheadAttention's projections (no module call to hook) and sampled steps a CPU
    without the block kernel skipped: P04's title and evidence, the missing-table reason."""
    mha = {
        "kind": "blockstats_not_measured",
        "reason": "nn.MultiheadAttention runs its projections inside F.multi_head_attention_forward",
        "modules": [f"blocks.layers.{i}.self_attn" for i in range(8)],
    }
    (f,) = _findings(_run(_model(), events=(mha, mha)), "AMP-P04")
    assert "some matmul layers not measured" in f.title
    (line,) = f.evidence["not_measured"]
    assert "`blocks.layers.0.self_attn`" in line and line.endswith(" and 2 more")
    no_kernel = {"kind": "blockstats_not_measured", "reason": "the CPU block kernel is unavailable"}
    run = fake_run(steps=[{"step": 0, "rank": 0}], events=(no_kernel,))
    assert (
        block_fit_missing_reason(run) == "no blockstats rows: the CPU block kernel is unavailable"
    )
