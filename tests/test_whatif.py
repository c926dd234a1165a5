"""The precision what-if: validated against real casts, and rules AMP-P01..P03.

Validation: real tensors go through the numerics collector (a probe attached to a model whose
outputs and gradients are those tensors); the what-if computed from the recorded histograms is
compared with the same tensors really cast (with the same power-of-two scale) to
float16 / bfloat16 / float8_e4m3fn / float8_e5m2 on CPU.

Tolerance (see amprobe.analysis.whatif): every predicted count is within the row's ``edge``
count of the real one (values in the edge binades the exponent-only histogram cannot settle);
flush-to-zero and overflow are otherwise exact, so with per-tensor scaling the lost share
(overflow + flush) matches within 1e-4 for fp32 values and 1e-3 for values already rounded to
bf16 (exact ties at half the min subnormal); the subnormal count is an upper bound.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn

import amprobe
from amprobe.analysis.whatif import (
    FORMATS,
    WHATIF_COLUMNS,
    compute_exponent_shares,
    compute_fp16_gradient_fit,
    compute_whatif,
    compute_whatif_frame,
    compute_whatif_rows,
)
from amprobe.rules import diagnose
from tests.helpers import fake_run

N = 100_000


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = N
    return {
        "normal": torch.randn(n, generator=g),
        "heavy": torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g)),
        "outliers": torch.cat(
            [torch.randn(n - 20, generator=g), 1e4 * torch.randn(20, generator=g)]
        ),
        "tiny": torch.randn(n, generator=g) * 1e-7 * torch.exp(2 * torch.randn(n, generator=g)),
        "huge": torch.randn(n, generator=g) * 3e4,
        "sparse": torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.3),
        # values already rounded to bf16 (8 significant bits): exact ties at half the min
        # subnormal are frequent, the one case where flush-to-zero is not exact
        "bf16": (torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g)))
        .bfloat16()
        .float(),
        # issue 19 item 10: fp32 subnormals of every binade (2**-149 .. 2**-126) beside small
        # normal values; per-tensor scaling shifts them by ~2**110 into each format's range
        "subnormal": torch.exp2(-149 + 39 * torch.rand(n, generator=g, dtype=torch.float64))
        .float()
        .mul(torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)),
        # exact ties at half the min subnormal of fp16 (2**-25) and e5m2 (2**-17), as-is
        "ties": torch.cat(
            [
                torch.full((n // 10,), 2.0**-25),
                torch.full((n // 10,), -(2.0**-17)),
                torch.randn(n - 2 * (n // 10), generator=g),
            ]
        ),
    }


class _Emit(nn.Module):
    """Outputs its parameter (times a scalar 1): the output and both gradients are known tensors."""

    def __init__(self, t: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(t.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x


class _Root(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.m = nn.ModuleDict({k: _Emit(v) for k, v in tensors.items()})

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [mod(x) for mod in self.m.values()]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run whose ``m.<name>`` layers output tensor ``<name>`` and receive it as gradient.

    The loss is scaled by a GradScaler (2**16): the collector unscales the gradients it
    measures, so the recorded gradient histograms are those of the tensors themselves.
    """
    tensors = _tensors()
    root = _Root(tensors)
    opt = torch.optim.SGD(root.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    run_dir = tmp_path_factory.mktemp("whatif") / "run"
    probe = amprobe.attach(
        root,
        opt,
        scaler,
        run_dir=run_dir,
        config={"numerics_every": 1, "collectors": ("scaler", "numerics")},
    )
    try:
        outs = root(torch.ones(()))
        loss = sum((o * t).sum() for o, t in zip(outs, tensors.values(), strict=True))
        scaler.scale(loss).backward()  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
    finally:
        probe.close()
    return run_dir, tensors


def _real(t: torch.Tensor, fmt_name: str, k: int) -> tuple[int, int, int]:
    """(overflow or saturated, flushed, subnormal) of the nonzero values of ``t * 2**k`` cast."""
    fmt = FORMATS[fmt_name]
    y = t.double().abs() * 2.0**k  # exact: a power-of-two shift in double
    y = y[y != 0]
    cast = y.to(getattr(torch, fmt.dtype)).double()
    # inf, or (e4m3, which saturates) further from y than half a step of the top binade
    mantissa_bits = {"fp16": 10, "bf16": 7, "e4m3": 3, "e5m2": 2}[fmt_name]
    half_step = 2.0 ** (math.floor(math.log2(fmt.max)) - mantissa_bits - 1)
    over = int((~torch.isfinite(cast) | ((cast - y).abs() > half_step)).sum())
    flush = int((cast == 0).sum())
    sub = int(((cast != 0) & (cast.abs() < 2.0**fmt.min_normal_exp)).sum())
    return over, flush, sub


def test_predictions_match_real_casts(recorded: tuple[Path, dict[str, torch.Tensor]]) -> None:
    run_dir, tensors = recorded
    numerics = amprobe.load_run(run_dir).table("numerics")
    rows = compute_whatif_rows(numerics)
    assert set(rows["kind"]) == {"output", "grad_output", "grad_param"}
    assert len(rows) == len(tensors) * 3 * len(FORMATS) * 2
    checked = 0
    worst_lost = {"fp32": 0.0, "bf16": 0.0}
    for r in rows.itertuples():
        t = tensors[str(r.module).split(".")[-1]]
        assert r.nonzero == int((t != 0).sum())
        if r.scaling == "per-tensor":
            # the same scale the what-if used: amax maps just under the format's max
            amax = float(t.abs().max())
            assert r.scale_exp == math.floor(math.log2(FORMATS[r.format].max / amax))
            assert amax * 2.0**r.scale_exp <= FORMATS[r.format].max
        over, flush, sub = _real(t, r.format, int(r.scale_exp))
        where = f"{r.module} {r.kind} {r.format} {r.scaling}"
        assert abs(r.overflow - over) <= r.edge, where
        assert abs(r.flush - flush) <= r.edge, where
        # an upper bound, except for the lump of fp32 values below 2**-133 (in edge)
        lump = int(((t != 0) & (t.abs() < 2.0**-133)).sum())
        assert -lump <= r.subnormal - sub <= r.edge, where
        if r.scaling == "per-tensor":
            assert r.overflow == over == 0, where
            lost_error = abs((r.overflow + r.flush) - (over + flush)) / r.nonzero
            held = str(r.module).split(".")[-1]
            held = held if held in ("bf16", "subnormal", "ties") else "fp32"
            worst_lost[held] = max(worst_lost.get(held, 0.0), lost_error)
        checked += 1
    assert checked == len(rows)
    assert worst_lost["fp32"] <= 1e-4
    # bf16-held values: a value exactly at half the min subnormal (after scaling) is one of the
    # 128 bf16 values of its binade and flushes (round to even) though counted as subnormal
    assert 0 < worst_lost["bf16"] <= 1e-3


def test_fp32_subnormals_are_scaled_by_their_binade(
    recorded: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """Issue 19 item 10: under per-tensor scaling (k ~ +110) fp32 subnormals land in each
    format's flush and subnormal ranges; the prediction follows them within ``edge`` (checked
    for every row above) and is no longer "nothing lost"."""
    run_dir, tensors = recorded
    rows = compute_whatif_rows(amprobe.load_run(run_dir).table("numerics"))
    t = tensors["subnormal"]
    sel = rows[(rows["module"] == "m.subnormal") & (rows["scaling"] == "per-tensor")]
    lump = int(((t != 0) & (t.abs() < 2.0**-133)).sum())
    assert 0 < lump < len(t) / 2
    for fmt in ("fp16", "e5m2", "e4m3"):
        for r in sel[sel["format"] == fmt].itertuples():
            over, flush, sub = _real(t, fmt, int(r.scale_exp))
            assert flush + sub > 1000, (fmt, flush, sub)  # what the casts really do
            assert abs(r.flush - flush) <= r.edge and abs(r.subnormal - sub) <= r.edge
            assert r.edge < r.nonzero / 2  # the binades are resolved
            if fmt != "e4m3":  # the lump's scaled range crosses a boundary: open
                assert r.edge >= lump
    e4m3 = sel[sel["format"] == "e4m3"].iloc[0]  # k = 118: binades -133 .. -127 -> -15 .. -9
    _, flush, sub = _real(t, "e4m3", int(e4m3["scale_exp"]))
    assert e4m3["flush"] > 0.1 * len(t) and e4m3["subnormal"] > 0
    assert (sel["low_exp"] == -149).all()  # values below 2**-133: the bound, not -127


def test_p03_names_the_smallest_gradient_binade(
    recorded: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """Issue 19 item 11: the recorded fp32 subnormal gradients reach the 2**-149 binade; the
    text says so instead of 2^-127 (where every subnormal used to be placed)."""
    run_dir, tensors = recorded
    t = tensors["subnormal"].abs()
    assert math.floor(math.log2(float(t[t > 0].min()))) == -149  # ground truth
    rows = amprobe.load_run(run_dir).table("numerics")
    rows = rows[rows["module"].isin(["m.subnormal", "m.normal"])]
    records = rows.astype(object).where(rows.notna(), None).to_dict("records")
    run = fake_run(steps=[{"step": 0}], events=[BF16], tables={"numerics": records})
    (p03,) = diagnose(run, only=["AMP-P03"]).findings
    assert "gradients span 2^-149 … 2^" in p03.title, p03.title
    assert p03.evidence["gradient_range"].startswith("2^-149 … ")


def test_ties_at_half_the_min_subnormal_are_within_the_stated_bounds(
    recorded: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """Issue 19 item 11: a tie at exactly 2**(m-1) flushes (round to even) though counted as
    subnormal: flush is low and subnormal high by up to bin m-1's count, beyond bin emin-1."""
    run_dir, tensors = recorded
    rows = compute_whatif_rows(amprobe.load_run(run_dir).table("numerics"))
    t = tensors["ties"]
    for fmt in ("fp16", "e5m2"):
        r = rows[
            (rows["module"] == "m.ties")
            & (rows["kind"] == "output")
            & (rows["format"] == fmt)
            & (rows["scaling"] == "none")
        ].iloc[0]
        _, flush, sub = _real(t, fmt, 0)
        m, emin = FORMATS[fmt].min_subnormal_exp, FORMATS[fmt].min_normal_exp
        bin_m1 = int(((t.abs() >= 2.0 ** (m - 1)) & (t.abs() < 2.0**m)).sum())
        bin_emin1 = int(((t.abs() >= 2.0 ** (emin - 1)) & (t.abs() < 2.0**emin)).sum())
        assert flush - r.flush >= len(t) // 10  # every tie flushed, none predicted
        assert r.subnormal - sub > bin_emin1  # the old claim ("high by at most bin emin-1")
        assert 0 <= flush - r.flush <= bin_m1 <= r.edge  # the stated bound
        assert 0 <= r.subnormal - sub <= bin_m1 + bin_emin1 <= r.edge


def test_known_shares_of_real_tensors(recorded: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """Spot values a reader can check: the outliers push the bulk below e4m3's window."""
    run_dir, tensors = recorded
    frame = compute_whatif(amprobe.load_run(run_dir))
    assert list(frame.columns) == WHATIF_COLUMNS

    def get(module: str, kind: str, fmt: str, scaling: str) -> Any:
        sel = frame[
            (frame["module"] == module)
            & (frame["kind"] == kind)
            & (frame["format"] == fmt)
            & (frame["scaling"] == scaling)
        ]
        assert len(sel) == 1
        return sel.iloc[0]

    normal = get("m.normal", "output", "e4m3", "per-tensor")
    assert normal["lost_share"] < 1e-3  # a Gaussian fits e4m3 with a per-tensor scale
    outliers = get("m.outliers", "output", "e4m3", "per-tensor")
    _, flush, _ = _real(tensors["outliers"], "e4m3", int(outliers["scale_exp"]))
    assert outliers["flush_share"] == pytest.approx(flush / N, abs=1e-4)
    assert outliers["flush_share"] > 0.02  # 20 values of 1e4 make 2 % of the bulk flush
    huge = get("m.huge", "output", "fp16", "none")
    assert huge["overflow_share"] > 0.02 and huge["max_exp"] >= 16
    tiny = get("m.tiny", "grad_output", "fp16", "none")
    assert tiny["flush_share"] > 0.3  # unscaled tiny gradients flush in fp16
    assert get("m.tiny", "grad_output", "bf16", "none")["lost_share"] == 0.0
    sparse = get("m.sparse", "output", "bf16", "none")
    assert sparse["nonzero"] == int((tensors["sparse"] != 0).sum())


def _hist_row(
    module: str,
    kind: str,
    hist: dict[int, int],
    step: int = 0,
    amax: float | None = None,
    order: int = 0,
    dtype: str = "bfloat16",
    module_type: str = "Linear",
    zeros: int = 0,
    rank: int = 0,
) -> dict[str, Any]:
    elements = sum(hist.values()) + zeros
    if zeros:
        hist = {**hist, -127: hist.get(-127, 0) + zeros}
    top = max((e for e in hist if -127 < e < 128), default=-134)  # -134: only the lump
    return {
        "rank": rank,
        "step": step,
        "module": module,
        "module_type": module_type,
        "kind": kind,
        "dtype": dtype,
        "calls": 1,
        "order": order,
        "elements": elements,
        "zeros": zeros,
        "nan": 0,
        "inf": 0,
        "finite": elements,
        "amax": amax if amax is not None else 1.5 * 2.0**top,
        "exp_hist": json.dumps({str(e): n for e, n in hist.items()}),
    }


def test_edge_bins_by_hand() -> None:
    """Bin by bin: e4m3 as-is, m = -9, emin = -6, T = 8 (max 448)."""
    numerics = pd.DataFrame(
        [
            _hist_row(
                "a",
                "output",
                {-12: 1, -11: 2, -10: 3, -9: 4, -7: 5, -6: 6, 7: 7, 8: 8, 9: 9},
                amax=600.0,
                zeros=10,
            )
        ]
    )
    rows = compute_whatif_rows(numerics)
    r = rows[(rows["format"] == "e4m3") & (rows["scaling"] == "none")].iloc[0]
    assert r["nonzero"] == 45
    assert r["flush"] == 1 + 2  # bins <= m-2 = -11; zeros are not values that flush
    assert r["subnormal"] == 3 + 4 + 5  # bins m-1 .. emin-1 = -10 .. -7
    assert r["overflow"] == 9  # above the top binade [256, 512)
    assert r["edge"] == 3 + 5 + 8  # bin m-1, bin emin-1 and the top binade (amax is above it)
    scaled = rows[(rows["format"] == "e4m3") & (rows["scaling"] == "per-tensor")].iloc[0]
    assert scaled["scale_exp"] == -1  # 600 / 2 = 300 <= 448 < 600
    assert scaled["overflow"] == 0
    assert scaled["flush"] == 1 + 2 + 3  # every bin moved down by one
    # amax inside the top binade, past the overflow bound 464 (448 plus half its step of 32;
    # the tie 464 itself rounds to even, to 448): amax itself overflows, the rest of the bin is
    # open
    numerics = pd.DataFrame([_hist_row("a", "output", {0: 5, 8: 8}, amax=464.5)])
    rows = compute_whatif_rows(numerics)
    r = rows[(rows["format"] == "e4m3") & (rows["scaling"] == "none")].iloc[0]
    assert r["overflow"] == 1 and r["edge"] == 8 - 1
    # above the max but below the bound: the cast rounds it down to 448, nothing overflows
    numerics = pd.DataFrame([_hist_row("a", "output", {0: 5, 8: 8}, amax=460.0)])
    rows = compute_whatif_rows(numerics)
    r = rows[(rows["format"] == "e4m3") & (rows["scaling"] == "none")].iloc[0]
    assert r["overflow"] == 0 and r["edge"] == 0
    assert float(torch.tensor(460.0).to(torch.float8_e4m3fn)) == 448.0
    numerics = pd.DataFrame([_hist_row("a", "output", {0: 5, 15: 8}, amax=65519.0)])
    rows = compute_whatif_rows(numerics)
    r = rows[(rows["format"] == "fp16") & (rows["scaling"] == "none")].iloc[0]
    assert r["overflow"] == 0 and r["edge"] == 0
    assert float(torch.tensor(65519.0).half()) == 65504.0
    numerics = pd.DataFrame([_hist_row("a", "output", {0: 5, 8: 8}, amax=440.0)])
    rows = compute_whatif_rows(numerics)
    r = rows[(rows["format"] == "e4m3") & (rows["scaling"] == "none")].iloc[0]
    assert r["overflow"] == 0 and r["edge"] == 0  # amax fits: the whole top binade fits


def test_amax_unknown_uses_the_histogram_bound() -> None:
    row = _hist_row("a", "output", {3: 10, 5: 1})
    row["amax"] = None  # NaN present: the collector records no amax
    rows = compute_whatif_rows(pd.DataFrame([row]))
    r = rows[(rows["format"] == "e4m3") & (rows["scaling"] == "per-tensor")].iloc[0]
    assert r["scale_exp"] == 8 - 6  # values < 2**6 map under 2**8 <= 448
    assert r["overflow"] == 0


def test_frame_sums_steps_and_orders_layers() -> None:
    numerics = pd.DataFrame(
        [
            _hist_row("late", "output", {0: 10}, step=0, order=1),
            _hist_row("early", "output", {0: 10}, step=0, order=0),
            _hist_row("early", "output", {-20: 10}, step=1, order=0),
            _hist_row("early", "grad_output", {-30: 5}, step=1, order=1),
        ]
    )
    frame = compute_whatif_frame(numerics)
    assert list(dict.fromkeys(frame["module"])) == ["early", "late"]
    e = frame[
        (frame["module"] == "early")
        & (frame["kind"] == "output")
        & (frame["format"] == "e4m3")
        & (frame["scaling"] == "none")
    ].iloc[0]
    assert e["steps"] == 2 and e["nonzero"] == 20
    assert e["flush_share"] == 0.5 and e["min_exp"] == -20 and e["max_exp"] == 0
    shares = compute_exponent_shares(numerics, ["output"])
    early = shares[shares["module"] == "early"]
    assert list(early["exponent"]) == [-20, 0] and list(early["share"]) == [0.5, 0.5]
    assert compute_whatif_frame(numerics.iloc[0:0]).empty


def test_fp16_gradient_fit_uses_one_scale_per_step() -> None:
    numerics = pd.DataFrame(
        [
            _hist_row("a", "grad_output", {0: 10}, amax=1.5),  # largest: scale 2**15
            _hist_row("b", "grad_output", {-45: 4, -30: 6}),
        ]
    )
    fit = compute_fp16_gradient_fit(numerics)
    assert set(fit["loss_scale_exp"]) == {15}
    b = fit[fit["module"] == "b"].iloc[0]
    assert b["flush"] == 4  # -45 + 15 = -30 < -25 flushes, -30 + 15 = -15 is fp16 subnormal


# -- issue 36: four slips of the what-if, each checked against real casts ----------------------
#: fp32 subnormals, every one in the lump (nonzero, below 2**-133): i * 2**-149 for i = 1 .. 10
#: (amax 1.25 * 2**-146), and values straddling 2**-134, bf16's tie at half its min subnormal
LUMPS = {
    "low": torch.tensor([i * 2.0**-149 for i in range(1, 11)]),
    "straddle": torch.tensor([(2**15 + d) * 2.0**-149 for d in (-3, -1, 0, 0, 1, 2, 5, 9)]),
}


def _lump_rows(t: torch.Tensor) -> pd.DataFrame:
    """:func:`compute_whatif_rows` of one activation row that recorded ``t`` (the lump alone)."""
    assert bool(((t != 0) & (t.abs() < 2.0**-133)).all())
    row = _hist_row("a", "output", {-149: len(t)}, amax=float(t.abs().max()))
    return compute_whatif_rows(pd.DataFrame([row]))


@pytest.mark.parametrize("name", list(LUMPS))
def test_lump_is_counted_once_in_edge(name: str) -> None:
    """bf16 cast as-is: its bin m-1 is -134, the column where the histogram keeps the lump;
    ``edge`` counted the lump there and again as the open lump (20 for 10 values)."""
    t = LUMPS[name]
    rows = _lump_rows(t)
    r = rows[(rows["format"] == "bf16") & (rows["scaling"] == "none")].iloc[0]
    assert r["nonzero"] == len(t)
    assert r["edge"] == len(t)  # each value once (was twice)
    over, flush, sub = _real(t, "bf16", 0)
    assert (over, flush + sub) == (0, len(t))
    assert abs(r["flush"] - flush) <= r["edge"] and abs(r["subnormal"] - sub) <= r["edge"]
    # every format and scaling: within edge of the real cast, and edge never more than the values
    for row in rows.itertuples():
        over, flush, sub = _real(t, row.format, int(row.scale_exp))
        where = f"{row.format} {row.scaling}"
        assert row.edge <= row.nonzero, where
        assert abs(row.overflow - over) <= row.edge, where
        assert abs(row.flush - flush) <= row.edge, where
        assert abs(row.subnormal - sub) <= row.edge, where


def test_lump_is_counted_once_in_the_fp16_gradient_fit() -> None:
    """The same double count in the fp16 loss-scale fit: a step whose largest gradient sets the
    scale 2**109 moves the lump's top binade -134 to -25, fp16's bin m-1."""
    t = LUMPS["low"]
    numerics = pd.DataFrame(
        [
            _hist_row("big", "grad_output", {-94: 1}, amax=1.5 * 2.0**-94),
            _hist_row("a", "grad_output", {-149: len(t)}, amax=float(t.max())),
        ]
    )
    fit = compute_fp16_gradient_fit(numerics)
    assert set(fit["loss_scale_exp"]) == {109}
    a = fit[fit["module"] == "a"].iloc[0]
    assert a["nonzero"] == 10 and a["edge"] == 10  # was 20
    flushed = int((t.double() * 2.0**109).half().eq(0).sum())
    assert abs(a["flush"] - flushed) <= a["edge"]


def test_per_tensor_scale_of_a_lump_only_tensor_overflows_nothing() -> None:
    """The scale maps amax just under the max, so nothing overflows; the lump was counted at
    its top binade -134 shifted by that scale, past the max when amax lies far below 2**-134
    (10 of 10 overflowed). Placed at amax's binade, its 16 binades land in the normal range."""
    t = LUMPS["low"]
    rows = _lump_rows(t)
    scaled = rows[rows["scaling"] == "per-tensor"]
    assert len(scaled) == len(FORMATS)
    for r in scaled.itertuples():
        assert _real(t, r.format, int(r.scale_exp)) == (0, 0, 0), r.format  # all kept
        assert r.overflow == 0, r.format  # was 10
        assert (r.flush, r.subnormal, r.edge) == (0, 0, 0), r.format


def test_e4m3_tie_at_464_rounds_to_448() -> None:
    """e4m3's max 448 has an even mantissa: round-to-nearest-even takes the tie 464 (448 plus
    half its step of 32) to 448, so only values above 464 overflow (torch's cast saturates them
    to 448 too, further than half a step away). 464 lies inside the top binade [256, 512): the
    histogram cannot tell it from 464.01, only the recorded amax does."""
    above = float(torch.tensor(464.01))  # the fp32 value recorded
    cast = torch.tensor([464.0, above]).to(torch.float8_e4m3fn).float()
    assert cast.tolist() == [448.0, 448.0]
    assert _real(torch.tensor([464.0]), "e4m3", 0) == (0, 0, 0)  # a rounding: half a step
    assert _real(torch.tensor([above]), "e4m3", 0) == (1, 0, 0)  # past it: saturated
    for amax, over, edge in ((464.0, 0, 0), (above, 1, 8 - 1)):
        numerics = pd.DataFrame([_hist_row("a", "output", {0: 5, 8: 8}, amax=amax)])
        rows = compute_whatif_rows(numerics)
        r = rows[(rows["format"] == "e4m3") & (rows["scaling"] == "none")].iloc[0]
        assert (r["overflow"], r["edge"]) == (over, edge), amax
    # the summaries group rows by amax class: 464 and 464.01 must not share one
    run = fake_run(
        tables={
            "numerics": [
                _hist_row("a", "output", {0: 5, 8: 8}, step=0, amax=464.0),
                _hist_row("a", "output", {0: 5, 8: 8}, step=1, amax=above),
            ]
        }
    )
    summed = compute_whatif(run)
    pd.testing.assert_frame_equal(summed, compute_whatif_frame(run.table("numerics")))
    e4m3 = summed[(summed["format"] == "e4m3") & (summed["scaling"] == "none")].iloc[0]
    assert (e4m3["overflow"], e4m3["edge"]) == (1, 8 - 1)


def test_p03_docstring_states_the_bound_the_code_uses() -> None:
    """AMP-P03's text (docs/reference/findings.md) gives fp16's overflow bound as the code
    counts it: 65520, not "above 65504" (65504 < v < 65520 rounds down to 65504)."""
    from amprobe.rules.whatif import check_fp16_range

    doc = " ".join((check_fp16_range.__doc__ or "").split())
    assert "above 65504" not in doc
    assert "at or above 65520" in doc
    assert torch.tensor([65519.0, 65520.0]).half().tolist() == [65504.0, math.inf]
    for amax, over in ((65519.0, 0), (65520.0, 1)):
        numerics = pd.DataFrame([_hist_row("a", "output", {0: 5, 15: 8}, amax=amax)])
        rows = compute_whatif_rows(numerics)
        assert (
            rows[(rows["format"] == "fp16") & (rows["scaling"] == "none")].iloc[0]["overflow"]
            == over
        )


# -- rules on hand-built frames -------------------------------------------------------------------
BF16 = {"kind": "autocast_seen", "device": "cpu", "dtype": "bfloat16", "enabled": True}
FP16 = {"kind": "autocast_seen", "device": "cpu", "dtype": "float16", "enabled": True}
NARROW = {e: 100 for e in range(-6, 2)}  # 2^-6 .. 2^1: fits any format
WIDE = {**{e: 100 for e in range(-6, 2)}, -20: 50, 12: 1}  # 2^-20 .. 2^12: e4m3 flushes


def _ops(modules: dict[str, float]) -> list[dict[str, Any]]:
    return [
        {"step": 1, "module": m, "op": "addmm", "phase": "forward", "flops": f}
        for m, f in modules.items()
    ]


def _layers(spec: dict[str, tuple[dict[int, int], dict[int, int]]]) -> list[dict[str, Any]]:
    rows = []
    for i, (module, (act, grad)) in enumerate(spec.items()):
        rows.append(_hist_row(module, "output", act, order=i))
        rows.append(_hist_row(module, "grad_output", grad, order=len(spec) - 1 - i))
    return rows


def _ids(run: Any) -> set[str]:
    return set(diagnose(run).ids())


@pytest.mark.parametrize(
    ("spec", "ops", "fires"),
    [
        (
            {"fc1": (NARROW, NARROW), "fc2": (WIDE, NARROW)},
            {"fc1": 3.0, "fc2": 1.0},
            {"P01", "P02"},
        ),
        ({"fc1": (NARROW, NARROW)}, {"fc1": 1.0}, {"P01"}),
        ({"fc1": (WIDE, NARROW)}, {"fc1": 1.0}, {"P02"}),
        ({"fc1": (NARROW, {-60: 10, 0: 10})}, {"fc1": 1.0}, {"P02"}),  # e5m2 gradient too wide
        ({"fc1": (NARROW, NARROW)}, {}, {"P01"}),  # no compute_ops: Linear modules, no FLOPs
        ({"norm": (WIDE, WIDE)}, {"fc1": 1.0}, set()),  # not a matmul layer
    ],
)
def test_fp8_rules(spec: Any, ops: dict[str, float], fires: set[str]) -> None:
    tables: dict[str, Any] = {"numerics": _layers(spec)}
    if ops:
        tables["compute_ops"] = _ops(ops)
    run = fake_run(steps=[{"step": 0, "autocast_dtype": "bfloat16"}], events=[BF16], tables=tables)
    ids = {i.removeprefix("AMP-") for i in _ids(run)} & {"P01", "P02"}
    assert ids == fires


def test_p01_names_layers_and_flops_share() -> None:
    tables = {
        "numerics": _layers({"fc1": (NARROW, NARROW), "fc2": (WIDE, NARROW)}),
        "compute_ops": _ops({"fc1": 3.0, "fc2": 1.0}),
    }
    run = fake_run(steps=[{"step": 0}], events=[BF16], tables=tables)
    findings = {f.id: f for f in diagnose(run, only=["AMP-P01", "AMP-P02"]).findings}
    p01 = findings["AMP-P01"]
    assert "1 of 2 matmul layer(s)" in p01.title and "fc1" in p01.title
    assert "75 % of matmul FLOPs" in p01.title
    assert p01.evidence["candidate_flops_share"] == 0.75
    p02 = findings["AMP-P02"]
    assert p02.title.startswith("fc2 activations span 2^-20 … 2^12: ")
    assert "would flush to zero in fp8-e4m3 even with per-tensor scaling" in p02.title
    assert p02.evidence["layers"][0]["flush_share"] == pytest.approx(50 / 851, abs=1e-6)
    # without compute_ops the evidence says where the layers and FLOPs come from
    run = fake_run(steps=[{"step": 0}], events=[BF16], tables={"numerics": tables["numerics"]})
    p01 = next(f for f in diagnose(run, only=["AMP-P01"]).findings)
    assert "matmul FLOPs were not recorded" in p01.title
    assert "not recorded" in p01.evidence["flops_source"]


def test_p01_does_not_judge_layers_with_nonfinite_values() -> None:
    rows = _layers({"fc1": (NARROW, NARROW), "fc2": (NARROW, NARROW)})
    bad = rows[2]  # fc2's output: two NaN besides its finite values
    hist = {**json.loads(bad["exp_hist"]), "128": 2}
    rows[2] = {**bad, "nan": 2, "elements": bad["elements"] + 2, "exp_hist": json.dumps(hist)}
    tables = {"numerics": rows, "compute_ops": _ops({"fc1": 1.0, "fc2": 1.0})}
    run = fake_run(steps=[{"step": 0}], events=[BF16], tables=tables)
    p01 = next(f for f in diagnose(run, only=["AMP-P01"]).findings)
    assert [x["module"] for x in p01.evidence["layers"]] == ["fc1"]
    assert p01.evidence["not_judged_nonfinite"] == ["fc2"]
    whatif = compute_whatif(run)
    assert set(whatif.loc[whatif["module"] == "fc2", "nonfinite"]) == {0, 2}


def test_identical_ranks_give_one_finding() -> None:
    rows = [
        {**r, "rank": rank}
        for rank in (0, 1)
        for r in _layers({"fc1": (NARROW, NARROW), "fc2": (WIDE, NARROW)})
    ]
    ops = [{**o, "rank": rank} for rank in (0, 1) for o in _ops({"fc1": 1.0, "fc2": 1.0})]
    run = fake_run(
        steps=[{"step": 0, "rank": r} for r in (0, 1)],
        events=[BF16],
        ranks=(0, 1),
        tables={"numerics": rows, "compute_ops": ops},
    )
    findings = diagnose(run, only=["AMP-P01", "AMP-P02"]).findings
    assert sorted(f.id for f in findings) == ["AMP-P01", "AMP-P02"]
    assert all(f.evidence["ranks"] == [0, 1] for f in findings)
    assert set(compute_whatif(run)["rank"]) == {0, 1}


def test_thresholds_are_overridable() -> None:
    tables = {"numerics": _layers({"fc1": (WIDE, NARROW)}), "compute_ops": _ops({"fc1": 1.0})}
    run = fake_run(steps=[{"step": 0}], events=[BF16], tables=tables)
    assert "AMP-P02" in _ids(run)
    relaxed = diagnose(run, thresholds={"AMP-P02": {"max_lost_share": 0.2}})
    assert "AMP-P02" not in relaxed.ids()
    relaxed = diagnose(run, thresholds={"AMP-P01": {"min_representable_share": 0.9}})
    assert "AMP-P01" in relaxed.ids()


@pytest.mark.parametrize(
    ("event", "act", "grads", "fires"),
    [
        (BF16, {0: 10, 17: 1}, [{-3: 10}], True),  # an activation above 65504
        (BF16, {0: 10}, [{0: 10}, {-50: 10}], True),  # gradients span 2^-50 .. 2^0
        (BF16, {0: 10}, [{0: 10}, {-20: 10}], False),  # fits with a loss scale
        (FP16, {0: 10, 17: 1}, [{0: 10}, {-50: 10}], False),  # not a bf16 run
    ],
)
def test_fp16_range(event: Any, act: Any, grads: Any, fires: bool) -> None:
    rows = [_hist_row("fc", "output", act, amax=1.5 * 2.0 ** max(act))]
    rows += [_hist_row(f"g{i}", "grad_param", h) for i, h in enumerate(grads)]
    run = fake_run(steps=[{"step": 0}], events=[event], tables={"numerics": rows})
    findings = diagnose(run, only=["AMP-P03"]).findings
    assert bool(findings) is fires
    if findings and 17 in act:
        assert "fc activations reach 2^17" in findings[0].title
        assert findings[0].severity == "warning"
    if findings and len(grads) > 1:
        assert "gradients span 2^-50 … 2^0" in findings[0].title
        assert findings[0].evidence["best_loss_scale"] == 2.0**15


def test_not_checked_without_numerics() -> None:
    run = fake_run(steps=[{"step": 0}], events=[BF16])
    skipped = {n.id: n.reason for n in diagnose(run).not_checked}
    for rid in ("AMP-P01", "AMP-P02", "AMP-P03"):
        assert "no per-layer exponent histogram was recorded" in skipped[rid]
    only_inputs = fake_run(
        steps=[{"step": 0}],
        events=[BF16],
        tables={"numerics": [{**_hist_row("<input 0>[0]", "input", {0: 4})}]},
    )
    skipped = {n.id: n.reason for n in diagnose(only_inputs).not_checked}
    assert "only model inputs" in skipped["AMP-P01"]


# -- rules on recorded runs ------------------------------------------------------------------------
class _Mlp(nn.Module):
    def __init__(self, outlier: float = 1.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 8)
        with torch.no_grad():
            self.fc1.weight[0].mul_(outlier)
            self.fc1.bias[0].mul_(outlier)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _record(tmp_path: Path, outlier: float, steps: int = 3) -> Any:
    torch.manual_seed(0)
    model = _Mlp(outlier)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay as planted
    probe = amprobe.attach(
        model,
        opt,
        run_dir=tmp_path / "run",
        config={"numerics_every": 1, "collectors": ("numerics", "compute")},
    )
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(steps):
            x = torch.randn(64, 16, generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        probe.close()
    return amprobe.load_run(tmp_path / "run")


def test_recorded_run_without_outliers_is_all_candidates(tmp_path: Path) -> None:
    run = _record(tmp_path, outlier=1.0)
    findings = {f.id: f for f in diagnose(run).findings}
    assert "AMP-P02" not in findings and "AMP-P03" not in findings
    p01 = findings["AMP-P01"]
    assert [x["module"] for x in p01.evidence["layers"]] == ["fc1", "fc2"]
    ops = run.table("compute_ops")
    share = ops.loc[ops["module"].isin(["fc1", "fc2"]), "flops"].sum() / ops["flops"].sum()
    assert p01.evidence["candidate_flops_share"] == pytest.approx(share, abs=1e-4)


def test_recorded_run_with_outlier_channel_is_fp8_hostile(tmp_path: Path) -> None:
    run = _record(tmp_path, outlier=2.0**14)
    findings = {f.id: f for f in diagnose(run).findings}
    p02 = findings["AMP-P02"]
    assert p02.title.startswith("fc1 activations span")
    assert p02.evidence["layers"][0]["module"] == "fc1"
    assert p02.evidence["layers"][0]["lost_share"] > 0.001
    p01 = findings.get("AMP-P01")
    assert p01 is None or "fc1" not in [x["module"] for x in p01.evidence["layers"]]


def test_recorded_bf16_run_with_fp16_overflow(tmp_path: Path) -> None:
    run = _record(tmp_path, outlier=2.0**16)  # fc1's outlier channel reaches > 65504
    findings = {f.id: f for f in diagnose(run).findings}
    p03 = findings["AMP-P03"]
    assert "fc1 activations reach 2^" in p03.title
    assert p03.evidence["overflowing_layers"][0]["module"] == "fc1"


# -- outputs: diagnose --format json, the report section, the heatmap -------------------------------
SAMPLE = Path(__file__).resolve().parent.parent / "sample_runs" / "fp8-whatif"


def test_diagnose_json_carries_the_whatif_table(capsys: pytest.CaptureFixture[str]) -> None:
    from amprobe.cli import main

    assert main(["diagnose", str(SAMPLE), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"findings", "not_checked", "whatif"} <= set(data)
    records = data["whatif"]
    assert set(records[0]) == set(WHATIF_COLUMNS)
    proj = [
        r
        for r in records
        if r["module"] == "proj"
        and r["kind"] == "output"
        and r["format"] == "e4m3"
        and r["scaling"] == "per-tensor"
    ]
    assert len(proj) == 1 and proj[0]["flush_share"] > 0.01
    # the largest recorded value's binade (the sample's values depend on the CPU's bf16 kernels)
    numerics = amprobe.load_run(SAMPLE).table("numerics")
    amax = numerics[(numerics["module"] == "proj") & (numerics["kind"] == "output")]["amax"].max()
    assert proj[0]["max_exp"] == math.floor(math.log2(amax))
    assert isinstance(proj[0]["scale_exp"], int)
    # a user can script it: the same numbers the rules used
    p02 = next(f for f in data["findings"] if f["id"] == "AMP-P02")
    assert p02["evidence"]["layers"][0]["lost_share"] == pytest.approx(
        proj[0]["lost_share"], abs=1e-6
    )


def test_report_section_shows_heatmaps_and_table(tmp_path: Path) -> None:
    from amprobe.report import build_sections, render_html, render_markdown

    run = amprobe.load_run(SAMPLE)
    diagnosis = amprobe.diagnose(run)
    sections = {s.key: s for s in build_sections(run, diagnosis)}
    sec = sections["whatif"]
    assert sec.missing is None and len(sec.figures) == 2
    acts = sec.figures[0]
    heat = next(t for t in acts.data if t.type == "heatmap")
    assert list(heat.y) == ["embed", "act1", "booster", "proj", "norm", "act2", "head"]
    names = " ".join(str(t.name) for t in acts.data)
    for label in ("fp16", "bf16", "fp8-e4m3", "fp8-e5m2"):
        assert f"{label} as-is" in names
    assert len(acts.layout.shapes) >= 4  # the windows drawn over the heatmap
    page = render_html(run, diagnosis, list(sections.values()))
    assert "id='whatif'" in page and "Exponent range of activations" in page
    assert "Per layer: share of nonzero values lost" in render_markdown(
        diagnosis, list(sections.values())
    )
    empty = fake_run(steps=[{"step": 0}])
    sec = next(s for s in build_sections(empty, diagnose(empty)) if s.key == "whatif")
    assert sec.missing and "no per-layer exponent histogram" in sec.missing


def test_heatmap_escapes_layer_names() -> None:
    from amprobe.report.whatif import make_exponent_heatmap

    numerics = pd.DataFrame(
        [
            _hist_row("<b>x</b>", "output", {0: 3, -4: 1}),
            _hist_row("<b>x</b>", "grad_output", {-10: 4}),
        ]
    )
    fig = make_exponent_heatmap(numerics, "activations")
    heat = next(t for t in fig.data if t.type == "heatmap")
    assert list(heat.y) == ["&lt;b&gt;x&lt;/b&gt;"]
    assert all("<b>" not in str(t) for row in heat.text for t in row)
    z = heat.z[0]
    x = list(heat.x)
    assert z[x.index(0)] == pytest.approx(math.log10(0.75))
    grads = make_exponent_heatmap(numerics, "gradients")
    assert list(next(t for t in grads.data if t.type == "heatmap").y) == [
        "&lt;b&gt;x&lt;/b&gt; · output grad"
    ]
    none = make_exponent_heatmap(numerics.iloc[0:0], "activations")
    assert "not recorded" in none.layout.title.text
