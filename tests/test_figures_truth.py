"""The report's and the dashboard's figures show only what the run recorded (issue #32).

Figure-level checks on the sample runs, the demo and a run with an unmeasured layer: a healthy
run has no coloured cell; a heatmap cell is the recorded count at that sampled step; what was
not measured is grey, never 0; a NaN loss is a labelled gap; the totals table and the heatmaps
count the same thing; a scale says which step it is from; two ranks are two colours.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

import amprobe
from amprobe.analysis.numerics import COUNT_COLUMNS
from amprobe.report.downsample import thin_figure
from amprobe.report.numerics import HEATMAP_METRICS, build_numerics_section
from amprobe.report.scale import build_scale_section, make_loss_scale_figure
from amprobe.store.writer import RunWriter
from tests.helpers import recorded_rows

SAMPLES = Path(__file__).resolve().parent.parent / "sample_runs"


def _load(name: str) -> Any:
    return amprobe.load_run(SAMPLES / name)


def _heatmaps(run: Any) -> dict[str, Any]:
    """The numerics section's heatmap figures by :data:`HEATMAP_METRICS` key."""
    figures = build_numerics_section(run, None).figures
    return dict(zip(HEATMAP_METRICS, figures, strict=False))


def _trace(fig: Any, name: str) -> Any:
    return next(t for t in fig.data if t.name == name)


def _value_trace(fig: Any, metric: str) -> Any:
    return _trace(fig, HEATMAP_METRICS[metric])


def _array(value: Any) -> Any:
    """A trace array as the browser gets it: plotly's binary ``{"dtype", "bdata"}`` form (a
    copied figure's arrays) decoded, anything else as it is."""
    if isinstance(value, dict) and "bdata" in value:
        data = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
        if value.get("shape"):
            data = data.reshape([int(n) for n in str(value["shape"]).split(",")])
        return data
    return value


def _cells(trace: Any) -> list[list[float | None]]:
    """A heatmap's z with ``None`` where no cell is drawn (plotly draws NaN and null as none)."""
    return [[None if v is None or v != v else float(v) for v in row] for row in _array(trace.z)]


def _grey_cells(fig: Any) -> list[tuple[str, Any, str]]:
    """(layer, step, reason) of every cell drawn as not measured."""
    grey = [t for t in fig.data if t.name == "not measured"]
    if not grey:
        return []
    t = grey[0]
    return [
        (t.y[i], t.x[j], t.text[i][j])
        for i, row in enumerate(_cells(t))
        for j, v in enumerate(row)
        if v is not None
    ]


def _color_at(trace: Any, value: float) -> str:
    """The colour a heatmap trace gives ``value`` (at a colour-scale stop; enough for 0)."""
    low, high = trace.zmin, trace.zmax
    assert low is not None and high is not None and high > low, "the colour scale has no range"
    at = (value - low) / (high - low)
    stops = [(float(p), c) for p, c in trace.colorscale]
    match = [c for p, c in stops if abs(p - at) < 1e-12]
    assert match, f"{value} falls between colour-scale stops {stops}"
    return match[0]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The demo (default faults) recorded once, 200 steps: the loss is NaN at steps 80-119."""
    from amprobe.demo import train

    run_dir = tmp_path_factory.mktemp("demo") / "run"
    train(run_dir, steps=200, device=torch.device("cpu"))
    return amprobe.load_run(run_dir)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``sample_runs/overflow``'s steps and numerics written by amprobe's writer as ranks 0
    and 1 of one 2-rank run: rank 1's loss 0.25 higher (so that the two lines differ), its
    counts doubled, and its step 0 not sampled."""
    root = tmp_path_factory.mktemp("ranks") / "run"

    steps = recorded_rows(SAMPLES / "overflow", "steps")
    numerics = recorded_rows(SAMPLES / "overflow", "numerics")
    for rank in (0, 1):
        writer = RunWriter(root, rank, 2, {"device": "cpu"}, max_buffered_rows=100_000)
        mine = [
            {**r, "loss": r["loss"] + 0.25 * rank if r.get("loss") is not None else None}
            for r in steps
        ]
        writer.append("steps", mine)
        counts = ("nan", "inf", "over_fp16", "below_subnormal")
        writer.append(
            "numerics",
            [
                {**r, **{c: r[c] * (1 + rank) for c in counts}}
                for r in numerics
                if not (rank == 1 and r["step"] == 0)
            ],
        )
        writer.close({"status": "finished", "steps": len(mine)})
    return amprobe.load_run(root)


# -- (1) a colour scale from 0 -------------------------------------------------------------


def test_healthy_run_has_no_coloured_cell() -> None:
    """On ``healthy`` every measured non-finite / fp16-inf count is 0, and 0 is white: no cell
    is coloured (the scale was centred on 0, painting the whole grid red-orange)."""
    run = _load("healthy")
    figures = _heatmaps(run)
    for metric in ("nonfinite", "overflow"):
        trace = _value_trace(figures[metric], metric)
        cells = [v for row in _cells(trace) for v in row if v is not None]
        assert cells and all(v == 0 for v in cells)
        assert trace.zmin == 0 and trace.zmax > 0
        assert _color_at(trace, 0).lower() in ("#ffffff", "#fff", "white", "rgb(255,255,255)")
        assert _grey_cells(figures[metric]) == []  # every layer was measured at every sample


# -- (3) one cell per sampled step, at its step ---------------------------------------------


@pytest.mark.parametrize("name", ["overflow", "misuse", "healthy"])
def test_heatmap_cells_are_the_recorded_counts_at_the_sampled_steps(name: str) -> None:
    run = _load(name)
    numerics = run.table("numerics")
    sampled = sorted(int(s) for s in numerics["step"].unique())
    figures = _heatmaps(run)
    for metric, fig in figures.items():
        trace = _value_trace(fig, metric)
        assert [int(s) for s in trace.x] == sampled  # the columns are the sampled steps
        assert fig.layout.xaxis.type == "category"  # no cell stretched towards the next
        count = COUNT_COLUMNS[HEATMAP_METRICS[metric]][1]
        recorded = numerics.assign(
            layer=numerics["module"] + " · " + numerics["kind"], value=count(numerics)
        )
        z = _cells(trace)
        assert len(recorded) == sum(v is not None for row in z for v in row)
        rows = {layer: i for i, layer in enumerate(trace.y)}
        cols = {step: j for j, step in enumerate(sampled)}
        for layer, step, value in zip(
            recorded["layer"], recorded["step"], recorded["value"], strict=True
        ):
            assert z[rows[layer]][cols[int(step)]] == value, (metric, layer, step)
        # the dashboard's thinning leaves the columns as they are
        thinned = _value_trace(thin_figure(copy.deepcopy(fig)), metric)
        assert list(_array(thinned.x)) == list(trace.x)
        assert _cells(thinned) == z


def test_overflow_is_drawn_at_the_step_it_was_recorded() -> None:
    """``overflow``: the loss is NaN from step 80; the numerics sampled next, at step 81, hold
    the first non-finite values. The first coloured cell covers step 81 and nothing before it
    (drawn on a continuous axis it began at step 40.5, and the axis at a negative step)."""
    run = _load("overflow")
    numerics = run.table("numerics")
    first_bad = int(numerics.loc[(numerics["nan"] + numerics["inf"]) > 0, "step"].min())
    assert first_bad == 81
    fig = _heatmaps(run)["nonfinite"]
    trace = _value_trace(fig, "nonfinite")
    z = _cells(trace)
    coloured = [j for j in range(len(trace.x)) if any((row[j] or 0) > 0 for row in z)]
    assert int(trace.x[coloured[0]]) == first_bad
    # a cell covers its own step only: the axis holds the sampled steps as categories, in
    # order, and nothing else (a numeric axis stretched each cell halfway to the next sample,
    # and began at a negative step)
    assert fig.layout.xaxis.type == "category"
    sampled = sorted(int(s) for s in numerics["step"].unique())
    assert [int(s) for s in trace.x] == sampled and sampled[0] >= 0
    assert int(trace.x[coloured[0] - 1]) < first_bad  # the column before is an earlier sample


def test_heatmap_says_which_steps_were_not_sampled(demo: Any) -> None:
    """The demo samples nothing after the first steps of the overflow: the figure says so and
    marks each unsampled stretch, the one after the last sample included."""
    sampled = sorted(int(s) for s in demo.table("numerics")["step"].unique())
    last_step = int(demo.steps["step"].max())
    assert sampled[-1] < last_step
    fig = _heatmaps(demo)["nonfinite"]
    assert f"nothing sampled after step {sampled[-1]} (last step {last_step})" in (
        fig.layout.title.text
    )
    labels = {a.text for a in fig.layout.annotations}
    assert f"{sampled[-1] + 1}–{last_step}" in labels
    gaps = [(a + 1, b - 1) for a, b in zip(sampled, sampled[1:], strict=False) if b - a > 1]
    assert {f"{a}–{b}" if a != b else f"{a}" for a, b in gaps} <= labels
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    assert len(lines) == len(gaps) + 1


# -- not measured is not healthy ------------------------------------------------------------


@pytest.fixture(scope="module")
def unmeasured(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real recorded run whose second layer outputs a wrapper tensor subclass (as float8
    and NF4 training tensors are): the collector cannot read it, records a
    ``numerics_not_checked`` event, and the layer after it has its inputs unread."""
    from torch.testing._internal.two_tensor import TwoTensor

    class Pair(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return TwoTensor(x, x * 2)

    class Unpair(torch.nn.Module):
        def forward(self, x: Any) -> torch.Tensor:
            return x.a + x.b

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), Pair(), torch.nn.Linear(4, 4), Unpair(), torch.nn.Linear(4, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run_dir = tmp_path_factory.mktemp("subclass") / "run"
    probe = amprobe.attach(model, opt, run_dir=run_dir, config={"numerics_every": 1})
    try:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        probe.close()
    return amprobe.load_run(run_dir)


def test_a_layer_not_measured_is_grey_with_its_reason_never_zero(unmeasured: Any) -> None:
    (event,) = unmeasured.events_of("numerics_not_checked")
    layer = event["first_at"]
    assert layer not in set(unmeasured.table("numerics")["module"])
    for metric, fig in _heatmaps(unmeasured).items():
        grey = _grey_cells(fig)
        rows = {cell[0] for cell in grey}
        assert rows == {f"{layer} · (not measured)"}, metric
        assert len(grey) == 3 and all("subclass_tensors: see the note" in c[2] for c in grey)
        trace = _value_trace(fig, metric)
        row = list(trace.y).index(f"{layer} · (not measured)")
        assert all(v is None for v in _cells(trace)[row])  # no count drawn, not even 0
        (note,) = [a for a in fig.layout.annotations if "not measured: " in a.text]
        assert "subclass_tensors" in note.text and "wrapper tensor subclass" in note.hovertext


def test_unread_inputs_are_said_on_hover(unmeasured: Any) -> None:
    """The layer taking the subclass (``3``, Unpair) has its inputs unread (``in_nonfinite``
    null): its cells say "not checked", the others give the count."""
    trace = _value_trace(_heatmaps(unmeasured)["nonfinite"], "nonfinite")
    texts = dict(zip(trace.y, trace.text, strict=True))
    assert all("inputs not read" in t for t in texts["3 · output"])
    assert all("inputs: 0 non-finite" in t for t in texts["0 · output"])


# -- (4) a NaN loss is a labelled gap -------------------------------------------------------


def _loss_points(fig: Any, name: str = "loss", axis: str = "y2") -> dict[int, float | None]:
    """The loss trace (named ``name`` on y axis ``axis``) as the browser receives it (the
    figure's JSON)."""
    data = json.loads(fig.to_json())["data"]
    trace = next(t for t in data if t.get("name") == name and t.get("yaxis") == axis)
    xs = _array(trace["x"])
    assert isinstance(trace["y"], list), "the loss must carry explicit nulls, not a binary array"
    return dict(zip((int(x) for x in xs), trace["y"], strict=True))


def _bands(fig: Any) -> list[tuple[float, float, str]]:
    """(x0, x1, label) of each labelled band: a rect shape and the annotation that names it."""
    rects = [s for s in fig.layout.shapes if s.type == "rect"]
    labels = [a.text for a in fig.layout.annotations if "loss" in (a.text or "")]
    out = []
    for text in labels:
        m = re.search(r"steps (\d+)–(\d+)", text)
        if m:
            a, b = int(m.group(1)), int(m.group(2))
            covering = [r for r in rects if r.x0 <= a and r.x1 >= b]
            if covering:
                out.append((covering[0].x0, covering[0].x1, text))
    return out


def _nan_steps(steps: pd.DataFrame) -> list[int]:
    return sorted(int(s) for s in steps.loc[steps["loss_nonfinite"].astype(bool), "step"])


@pytest.mark.parametrize("max_points", [2000, 40])
def test_nan_loss_is_a_labelled_gap_in_the_loss_scale_figure(max_points: int) -> None:
    run = _load("overflow")
    nan = _nan_steps(run.steps)
    assert nan == list(range(80, 120))
    fig = make_loss_scale_figure(run.steps, max_points=max_points)
    points = _loss_points(fig)
    assert all(points[s] is None for s in nan if s in points)
    assert any(s in points for s in nan)  # a gap drawn, not steps left out
    finite = [s for s, v in points.items() if v is not None]
    assert not set(finite) & set(nan)
    bands = _bands(fig)
    assert any(x0 <= 80 and x1 >= 119 and "loss NaN, steps 80–119" in t for x0, x1, t in bands)


def test_nan_loss_gap_survives_the_dashboard_thinning(demo: Any) -> None:
    """The report's figure is thinned by the dashboard (:func:`thin_figure`): the NaN steps
    stay gaps, and the band stays."""
    nan = _nan_steps(demo.steps)
    assert nan and nan[0] == 80 and nan[-1] == 119
    section = build_scale_section(demo, None)
    fig = thin_figure(copy.deepcopy(section.figures[0]), max_points=30)
    loss = next(t for t in fig.data if t.name == "loss")
    kept = dict(zip((int(x) for x in _array(loss.x)), loss.y, strict=True))
    assert len(kept) <= 30  # thinned (a copied figure's binary arrays were left whole)
    recorded = demo.steps.set_index("step")["loss"]
    for step, value in kept.items():  # each kept point is still at its own step
        assert value is None if step in nan else value == pytest.approx(recorded[step])
    assert any(s in kept for s in nan) and all(kept[s] is None for s in nan if s in kept)
    assert any("loss NaN, steps 80–119" in t for _, _, t in _bands(fig))


def test_nan_loss_is_a_labelled_gap_in_the_compare_figure() -> None:
    from dashboard.figures import make_compare_figure

    overflow, healthy = _load("overflow"), _load("healthy")
    fig = make_compare_figure(overflow.steps, healthy.steps, ("overflow", "healthy"))
    points = _loss_points(fig, "overflow")
    nan = _nan_steps(overflow.steps)
    assert all(points[s] is None for s in nan) and points[79] is not None
    labels = [t for _, _, t in _bands(fig)]
    assert labels == ["overflow: loss NaN, steps 80–119"]  # the healthy run has no band


# -- (6) one definition per column; which step a scale is from ------------------------------


def test_totals_table_and_heatmaps_count_the_same(demo: Any) -> None:
    """The demo's ``booster`` output holds inf (fp16 overflow): the heatmap of "values an fp16
    cast makes inf" and the totals table's column of the same name give the same total (the
    table's ``over_fp16`` alone was 0 beside a heatmap of ~6,800 per step)."""
    section = build_numerics_section(demo, None)
    table = section.tables[0][1].set_index(["module", "kind"])
    figures = dict(zip(HEATMAP_METRICS, section.figures, strict=False))
    booster = table.loc[("booster", "output")]
    assert booster["fp16_inf"] > 0 and booster["over_fp16"] == 0
    for metric, column in HEATMAP_METRICS.items():
        trace = _value_trace(figures[metric], metric)
        for layer, row in zip(trace.y, _cells(trace), strict=True):
            module, kind = layer.split(" · ")
            assert sum(v for v in row if v is not None) == table.loc[(module, kind), column]
        assert column in figures[metric].layout.title.text  # the heatmap names its column
    assert any("fp16_inf = over_fp16 + inf" in t for t in section.text)


def test_scale_hint_says_which_step_its_scale_is_from(demo: Any) -> None:
    numerics = demo.table("numerics")
    grads = numerics[numerics["loss_scale"].notna()].sort_values("step")
    step, scale = int(grads["step"].iloc[-1]), float(grads["loss_scale"].iloc[-1])
    final = float(demo.steps.sort_values("step")["scale_after"].dropna().iloc[-1])
    assert final != scale  # the demo's scale collapsed after its last sampled step
    (hint,) = [t for t in build_numerics_section(demo, None).text if "Loss-scale hint" in t]
    assert f"at step {step}'s scale {scale:g} (the last sampled step with gradients" in hint
    assert f"is {final:g}" in hint and "current scale" not in hint


# -- (11) ranks: a colour each; steps counted as steps --------------------------------------


def test_two_ranks_have_two_colours_and_steps_are_not_doubled(two_ranks: Any) -> None:
    steps = two_ranks.steps
    assert sorted(steps["rank"].unique()) == [0, 1] and steps["step"].nunique() == 200
    fig = make_loss_scale_figure(steps)
    colours = {t.name: t.line.color for t in fig.data if t.name.startswith(("loss", "scale"))}
    assert colours["loss (rank 0)"] != colours["loss (rank 1)"]
    assert colours["scale (rank 0)"] == colours["loss (rank 0)"]  # a rank keeps its colour
    assert colours["scale (rank 1)"] == colours["loss (rank 1)"]
    (text,) = build_scale_section(two_ranks, None).text
    assert text.startswith("200 scaled steps on each of 2 ranks: 40 skipped")
    assert "400" not in text


def test_two_ranks_heatmap_rows_are_per_rank_never_summed(two_ranks: Any) -> None:
    """Each rank has its own rows, each cell that rank's recorded count (the ranks' counts
    were added up in one row); the step rank 1 did not sample is grey, not 0."""
    numerics = two_ranks.table("numerics")
    fig = _heatmaps(two_ranks)["nonfinite"]
    trace = _value_trace(fig, "nonfinite")
    z = _cells(trace)
    rows = {layer: i for i, layer in enumerate(trace.y)}
    cols = {int(s): j for j, s in enumerate(trace.x)}
    for rank, module, kind, step, nan, inf in zip(
        *(numerics[c] for c in ("rank", "module", "kind", "step", "nan", "inf")), strict=True
    ):
        assert z[rows[f"r{rank} · {module} · {kind}"]][cols[int(step)]] == nan + inf
    grey = _grey_cells(fig)
    assert grey and {(cell[1], cell[2]) for cell in grey} == {(0, "rank 1 did not sample step 0")}
    assert {cell[0].split(" · ")[0] for cell in grey} == {"r1"}


def _rank_colours(fig: Any, prefix: str) -> dict[int, str]:
    """rank -> line colour of the traces named ``<prefix> (rank r)`` / ``rank r <prefix>``."""
    out: dict[int, str] = {}
    for t in fig.data:
        m = re.fullmatch(rf"{prefix} \(rank (\d+)\)|rank (\d+) {prefix}", t.name or "")
        if m:
            out[int(m.group(1) or m.group(2))] = t.line.color
    return out


@pytest.mark.parametrize("relabel", [{}, {1: 10}], ids=["ranks-0-1", "ranks-0-10"])
def test_a_rank_has_one_colour_of_its_own_on_every_tab(two_ranks: Any, relabel: Any) -> None:
    """Ranks 0 and 10 of a two-rank run have two colours (the palette was indexed by rank % 10);
    a rank's colour is the same on the loss-scale, step-time and Ranks tabs (the Ranks tab had
    a palette of its own: rank 1 purple on one tab, orange on the other), and no rank is drawn
    in the colour of a marker (skipped step, growth, backoff, loss NaN band)."""
    from amprobe.report.ranks import make_ranks_figure
    from dashboard.figures import make_step_time_figure

    steps = two_ranks.steps.assign(rank=two_ranks.steps["rank"].replace(relabel))
    ranks = sorted(int(r) for r in steps["rank"].unique())
    scale = make_loss_scale_figure(steps)
    tabs = {
        "loss": _rank_colours(scale, "loss"),
        "scale": _rank_colours(scale, "scale"),
        "step time": _rank_colours(make_step_time_figure(steps), "step time"),
        "ranks: loss scale": _rank_colours(make_ranks_figure(steps), "loss scale"),
        "ranks: step time": _rank_colours(make_ranks_figure(steps), r"step time \(ms\)"),
    }
    for tab, colours in tabs.items():
        assert sorted(colours) == ranks, tab
        assert colours == tabs["loss"], tab  # the same colour per rank everywhere
    assert len(set(tabs["loss"].values())) == len(ranks)  # each rank its own
    markers = {t.marker.color for t in scale.data if t.mode == "markers"}
    markers |= {s.fillcolor for s in scale.layout.shapes}
    drawn = {t.name.split(" (rank")[0] for t in scale.data if t.mode == "markers"}
    assert drawn == {"skipped step", "growth", "backoff"}
    assert markers and not markers & set(tabs["loss"].values())


def test_ranks_loss_scale_spread_holds_its_value_until_the_step_it_changes(
    two_ranks: Any,
) -> None:
    """The Ranks tab's loss-scale median and min-max band are steps, as each rank's line is:
    a straight segment from the scale at step 39 to the one at step 40 drew scales no rank
    had (a diagonal median between two steps, under the ranks' vertical drop)."""
    from amprobe.report.ranks import make_ranks_figure

    fig = make_ranks_figure(two_ranks.steps)
    scale = [t for t in fig.data if t.name and "loss scale" in t.name]
    spread = [t for t in scale if "across ranks" in t.name or "median of ranks" in t.name]
    assert len(spread) == 3  # max, min, median
    assert all(t.line.shape == "hv" for t in scale), [(t.name, t.line.shape) for t in scale]
    times = [t for t in fig.data if t.name and "step time" in t.name]
    assert times and all(t.line.shape != "hv" for t in times)  # a time is a per-step value


@pytest.fixture(scope="module")
def all_loss_nan(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``sample_runs/fp8-whatif`` (bf16, no GradScaler) written again by amprobe's writer with
    every step's loss NaN, as the collector records it (NaN, ``loss_nonfinite``)."""
    root = tmp_path_factory.mktemp("nanloss") / "run"
    text = (SAMPLES / "fp8-whatif" / "rank0" / "steps.jsonl").read_text()
    steps = [json.loads(line) for line in text.splitlines() if line.strip()]
    writer = RunWriter(root, 0, 1, {"device": "cpu"}, max_buffered_rows=100_000)
    writer.append("steps", [{**r, "loss": float("nan"), "loss_nonfinite": True} for r in steps])
    writer.close({"status": "finished", "steps": len(steps)})
    return amprobe.load_run(root)


def test_a_run_whose_every_loss_was_nan_shows_the_nan_not_no_loss(all_loss_nan: Any) -> None:
    """No GradScaler and a NaN loss at every step: the loss was recorded (as NaN), so the
    section draws the gap and its band instead of saying no loss tensor was seen."""
    steps = all_loss_nan.steps
    assert steps["loss"].isna().all() and steps["loss_nonfinite"].all()
    assert steps["scale_after"].isna().all() if "scale_after" in steps else True
    section = build_scale_section(all_loss_nan, None)
    assert not section.missing
    (fig,) = section.figures
    points = _loss_points(fig)
    assert sorted(points) == sorted(int(s) for s in steps["step"])
    assert all(v is None for v in points.values())
    first, last = int(steps["step"].min()), int(steps["step"].max())
    assert any(f"loss NaN, steps {first}–{last}" in t for _, _, t in _bands(fig))
    assert any("only the loss is shown" in t for t in section.text)


def test_a_pooled_column_with_unmeasured_samples_says_so(tmp_path: Path) -> None:
    """Over 1,000 sampled steps are pooled into columns: a column of a layer whose samples were
    partly not measured says how many on hover and is marked (it was drawn as its measured
    samples alone: white for measured zeros), and one with none measured is grey."""
    from amprobe.report.numerics import make_numerics_heatmap_figure

    healthy = _load("healthy").table("numerics")
    first = healthy[healthy["step"] == healthy["step"].min()]
    frame = pd.concat([first.assign(step=s) for s in range(1100)], ignore_index=True)
    layer = (str(first["module"].iloc[0]), str(first["kind"].iloc[0]))
    gone = (frame["module"] == layer[0]) & (frame["kind"] == layer[1])
    frame = frame[~(gone & frame["step"].isin([11, 20, 21]))]  # step 11 alone; 20 and 21 both
    fig = make_numerics_heatmap_figure(frame, "nonfinite")
    trace = _value_trace(fig, "nonfinite")
    x = list(trace.x)
    assert len(x) == 550 and x[5] == "10–11" and x[10] == "20–21"  # two samples a column
    row = list(trace.y).index(f"{layer[0]} · {layer[1]}")
    z = _cells(trace)
    assert z[row][5] == 0  # step 10 measured 0
    assert "1 of its 2 samples not measured" in trace.text[row][5]
    assert all("not measured" not in t for j, t in enumerate(trace.text[row]) if j not in (5, 10))
    from amprobe.report.numerics import PARTLY_NOT_MEASURED

    (marks,) = [t for t in fig.data if t.name == PARTLY_NOT_MEASURED]
    assert list(zip(marks.x, marks.y, strict=True)) == [("10–11", f"{layer[0]} · {layer[1]}")]
    assert z[row][10] is None  # none measured: no count drawn ...
    grey = {(cell[0], cell[1]): cell[2] for cell in _grey_cells(fig)}
    assert set(grey) == {(f"{layer[0]} · {layer[1]}", "20–21")}  # ... but grey
    assert "none of its 2 samples" in grey[(f"{layer[0]} · {layer[1]}", "20–21")]


def test_unsampled_stretch_labels_are_not_drawn_over_each_other(
    demo_run: tuple[Path, str],
) -> None:
    """Two close unsampled stretches ("1-99" and "101-120" on `amprobe demo`'s run, which
    samples steps 0, 100 and 121-182) had their labels drawn on one row, one over the other:
    close labels take alternate rows."""
    from amprobe.report.numerics import make_numerics_heatmap_figure

    demo = amprobe.load_run(demo_run[0] / "run")  # the session's `amprobe demo` run
    fig = make_numerics_heatmap_figure(demo.table("numerics"), "nonfinite", steps=demo.steps)
    columns = len(fig.data[0].x)
    labels = [a for a in fig.layout.annotations if a.hovertext and "not sampled" in a.hovertext]
    assert len(labels) >= 2
    width = 5.5 * columns / 1000  # a 9 px character's width in columns of a 1,000 px plot
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            if (a.yshift or 0) == (b.yshift or 0):
                assert abs(a.x - b.x) >= (len(a.text) + len(b.text)) / 2 * width, (a.text, b.text)
