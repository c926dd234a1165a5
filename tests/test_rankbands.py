"""Many ranks are drawn as server-side bands, not a trace per rank (issue #33).

A synthetic 100-rank run with one slow rank (3x) and one rank whose loss scale halves for a
single step: the bands name both, the one-step drop survives the binning, the figures' JSON is
bounded whatever the rank count, the numerics heatmap buckets ranks without summing them, and
a run of few ranks is drawn as before (one trace per rank, as recorded).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from amprobe.analysis.rankbands import (
    bucket_ranks,
    compute_rank_bands,
    compute_rank_matrix,
    compute_step_bins,
)
from amprobe.report.downsample import MAX_POINTS
from amprobe.report.numerics import MAX_HEATMAP_ROWS, make_numerics_heatmap_figure
from amprobe.report.ranks import make_ranks_figure
from amprobe.report.runtime import make_runtime_figure
from amprobe.report.scale import MAX_RANK_LINES, make_loss_scale_figure, thin_series
from dashboard.figures import make_step_time_figure

SLOW, DROP, DROP_STEP = 37, 71, 1203


def _steps(ranks: int = 100, steps: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Every rank 10 ms a step (5 % noise), scale 65536; rank SLOW 3x slower, rank DROP's scale
    halved at DROP_STEP only (a backoff, a growth back at the next step)."""
    rng = np.random.default_rng(seed)
    rank = np.repeat(np.arange(ranks), steps)
    step = np.tile(np.arange(steps), ranks)
    wall = 0.010 * (1 + 0.05 * rng.standard_normal(len(rank)))
    wall[rank == SLOW] *= 3
    scale = np.full(len(rank), 65536.0)
    scale[(rank == DROP) & (step == DROP_STEP)] = 32768.0
    after = scale.copy()
    after[(rank == DROP) & (step == DROP_STEP - 1)] = 32768.0
    after[(rank == DROP) & (step == DROP_STEP)] = 65536.0
    return pd.DataFrame(
        {
            "rank": rank,
            "step": step,
            "wall_s": wall,
            "probe_s": np.full(len(rank), 1e-4),
            "data_wait_s": np.full(len(rank), 2e-4),
            "scaler_enabled": True,
            "scale_before": scale,
            "scale_after": after,
            "skipped": False,
            "loss": 2.0 - step / steps + 0.05 * rng.standard_normal(len(rank)),
            "loss_nonfinite": False,
        }
    )


@pytest.fixture(scope="module")
def many() -> pd.DataFrame:
    return _steps()


def test_the_slow_rank_is_named_and_its_line_is_its_own(many: pd.DataFrame) -> None:
    bands = compute_rank_bands(many, "wall_s")
    assert len(bands.bins) == 1000 and bands.bins.width() == 2
    assert [o.rank for o in bands.outliers] == [SLOW]
    assert bands.outliers[0].share == 1.0
    # the band spans every rank (the slow one is its top edge), the median the others'
    assert (bands.max_rank == SLOW).all()
    assert np.allclose(bands.median, 0.010, rtol=0.05)
    assert np.allclose(bands.series(SLOW), 0.030, rtol=0.2)


def test_a_scale_drop_of_one_step_survives_binning(many: pd.DataFrame) -> None:
    bands = compute_rank_bands(many, "scale_before")
    assert [o.rank for o in bands.outliers] == [DROP]
    at = int(bands.bins.of(np.array([DROP_STEP]))[0])
    assert bands.bins.first[at] <= DROP_STEP <= bands.bins.last[at] and bands.bins.width() > 1
    assert bands.low[at] == 32768.0 and bands.min_rank[at] == DROP
    assert (np.delete(bands.low, at) == 65536.0).all()
    assert bands.outliers[0].worst == -0.5
    # the heatmap matrix keeps the one diverging rank in full, even 8 ranks to a row
    matrix = compute_rank_matrix(bands, max_rows=13)
    row = next(i for i, b in enumerate(matrix.buckets) if DROP in b)
    assert matrix.bucketed and len(matrix.buckets) <= 13
    assert matrix.z[row, at] == -0.5 and matrix.rank_at[row, at] == DROP


def test_bins_and_buckets_cover_everything_once() -> None:
    bins = compute_step_bins(np.r_[np.arange(0, 50), np.arange(900, 2000)], max_bins=100)
    assert len(bins) <= 100 and bins.first[0] == 0 and bins.last[-1] == 1999
    assert (bins.first[1:] > bins.last[:-1]).all()
    # 20 steps a bin: 0-19, 20-39, 40-49, then nothing until 900-919 (empty bins dropped)
    assert len(bins) == 3 + 55 and bins.of(np.array([49, 900])).tolist() == [2, 3]
    assert (bins.first[2], bins.last[2], bins.first[3]) == (40, 49, 900)
    buckets = bucket_ranks(range(1000), 512)
    assert len(buckets) <= 512 and np.concatenate(buckets).tolist() == list(range(1000))
    assert bucket_ranks([3, 1], 512) == [np.array([1]), np.array([3])]


def _figures(steps: pd.DataFrame) -> dict[str, object]:
    return {
        "loss scale": make_loss_scale_figure(steps),
        "step time": make_step_time_figure(steps),
        "runtime": make_runtime_figure(steps, pd.DataFrame()),
        "ranks": make_ranks_figure(steps),
    }


def test_many_rank_figures_are_bounded_and_name_the_outliers(many: pd.DataFrame) -> None:
    sizes = {}
    for name, fig in _figures(many).items():
        names = [t.name for t in fig.data]
        assert len(names) < 30, (name, len(names))  # not a trace per rank
        sizes[name] = len(fig.to_json())
        assert sizes[name] < 400_000, (name, sizes[name])
        assert any(str(SLOW) in n for n in names if "time" in n) or name == "loss scale"
    scale = _figures(many)["loss scale"]
    assert {t.name for t in scale.data} >= {"scale (rank 71)", "growth", "backoff"}
    assert (
        f"rank {DROP}" in scale.layout.title.text
        and "rank's min in a bin" in scale.layout.title.text
    )
    # twice the ranks, the same payload (within the outliers' lines and the legend's words)
    double = _steps(ranks=200)
    for name, fig in (
        ("loss scale", make_loss_scale_figure(double)),
        ("step time", make_step_time_figure(double)),
    ):
        assert len(fig.to_json()) < sizes[name] * 1.1, name


@pytest.mark.parametrize("ranks", [2, MAX_RANK_LINES])
def test_few_ranks_are_drawn_one_trace_each_as_recorded(ranks: int) -> None:
    steps = _steps(ranks=ranks, steps=5000)
    fig = make_step_time_figure(steps)
    lines = {t.name: t for t in fig.data}
    assert sorted(lines) == sorted(
        f"{what} time (rank {r})" for r in range(ranks) for what in ("step", "probe")
    )
    for rank, part in steps.groupby("rank"):
        x, y = thin_series(part, "wall_s", MAX_POINTS)
        trace = lines[f"step time (rank {rank})"]
        assert np.array_equal(trace.x, x) and np.allclose(trace.y, y * 1e3)
    scale = make_loss_scale_figure(steps)
    assert {f"scale (rank {r})" for r in range(ranks)} <= {t.name for t in scale.data}
    assert not [t for t in scale.data if "median" in (t.name or "")]


def test_many_rank_heatmap_rows_take_the_largest_rank_never_the_sum() -> None:
    rows = []
    for rank in range(100):
        for module in ("a", "b", "c"):
            for step in (0, 10):
                nan = 5 if (rank, module, step) == (DROP, "b", 10) else 0
                nan = 1 if (rank, module, step) == (DROP - 1, "b", 10) else nan
                rows.append(
                    {"rank": rank, "step": step, "module": module, "kind": "output"}
                    | {"nan": nan, "inf": 0, "elements": 10, "over_fp16": 0}
                )
    frame = pd.DataFrame(rows)
    fig = make_numerics_heatmap_figure(frame, "nonfinite")
    trace = next(t for t in fig.data if t.name == "nonfinite")
    assert len(trace.y) <= MAX_HEATMAP_ROWS
    z = np.asarray(trace.z, dtype=float)
    hot = [(trace.y[i], trace.x[j], z[i, j]) for i, j in zip(*np.nonzero(z > 0), strict=True)]
    (label, step, value) = hot[0]
    assert len(hot) == 1 and step == 10 and value == 5  # rank 70's 1 is not added
    first, _, last = label.split(" · ")[0][1:].partition("\u2013")
    assert int(first) <= DROP - 1 < DROP <= int(last) and label.endswith(" · b · output")
    i, j = trace.y.index(label), list(trace.x).index(10)
    assert list(np.asarray(trace.customdata)[i][j]) == [DROP, int(last) - int(first) + 1]
    assert "never a sum" in fig.layout.title.text
    assert len(json.loads(fig.to_json())["data"]) <= 3


def test_rank_heatmap_shows_each_rank_against_the_median(many: pd.DataFrame) -> None:
    from amprobe.report.ranks import make_rank_heatmap_figure

    (time,) = make_rank_heatmap_figure(many, "wall_s").data
    z = np.asarray(time.z, dtype=float)
    assert len(time.y) == 100 and z.shape[1] <= 200
    assert time.y[SLOW] == f"r{SLOW}" and (z[SLOW] > 150).all()  # 3x: +200 %, noise aside
    assert (np.abs(np.delete(z, SLOW, axis=0)) < 50).all() and time.zmid == 0
    (scale,) = make_rank_heatmap_figure(many, "scale_before").data
    z = np.asarray(scale.z, dtype=float)
    (hot,) = zip(*np.nonzero(z != 0), strict=True)
    assert hot[0] == DROP and z[hot] == -50.0
    assert scale.x[hot[1]] <= DROP_STEP < scale.x[hot[1] + 1]


@pytest.mark.parametrize("reduce", ["median", "mean", "min", "max"])
def test_the_dense_fast_path_reduces_as_the_grouped_one(
    reduce: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks with missing steps, NaN values, a gap in the steps (bins of several widths)."""
    import amprobe.analysis.rankbands as rankbands

    rng = np.random.default_rng(3)
    rank, step = np.repeat(np.arange(30), 2500), np.tile(np.arange(2500), 30)
    value = rng.random(len(rank))
    value[rng.random(len(rank)) < 0.1] = np.nan
    keep = rng.random(len(rank)) > 0.05
    frame = pd.DataFrame(
        {"rank": rank[keep] * 3, "step": step[keep] + (step[keep] > 1200) * 300, "x": value[keep]}
    )
    finite = frame[np.isfinite(frame["x"])]
    bins = compute_step_bins(finite["step"], 700)
    assert len(set((bins.last - bins.first).tolist())) > 1
    ranks, fast = rankbands._rank_bin_matrix(finite, "x", bins, reduce)
    monkeypatch.setattr(rankbands, "_DENSE_CELLS", 0)
    same, grouped = rankbands._rank_bin_matrix(finite, "x", bins, reduce)
    assert ranks.tolist() == same.tolist() == list(range(0, 90, 3))
    assert np.allclose(fast, grouped, equal_nan=True)
