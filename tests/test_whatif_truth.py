"""The precision what-if never contradicts what was recorded (issue 32, item 5 and the heatmap).

A layer and tensor kind that held inf/NaN at a sampled step is "not judged": no share, left out
of the headline's count and of the AMP-P01..P03 verdicts, and named with those steps in the
table, the headline, the findings and the heatmap. The demo (its ``booster`` overflows fp16 for
a stretch of steps) and the sample runs are the evidence; the truth each test compares with is
read from the recorded ``numerics`` table itself.
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
from amprobe.analysis.frames import steps_text
from amprobe.analysis.whatif import compute_exponent_shares, compute_whatif
from amprobe.report import build_sections
from amprobe.report.whatif import HEATMAP_GROUPS, make_exponent_heatmap, whatif_table

SAMPLES = Path(__file__).resolve().parent.parent / "sample_runs"
DEMO_STEPS = 40  # the booster multiplies by 1e6 at steps 16..23


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from amprobe.demo import train

    run_dir = tmp_path_factory.mktemp("demo") / "run"
    train(run_dir, steps=DEMO_STEPS, device=torch.device("cpu"))
    return amprobe.load_run(run_dir)


def _held(numerics: pd.DataFrame, module: str, kind: str) -> list[int]:
    """The sampled steps at which ``module``'s ``kind`` held inf/NaN, from the recorded table."""
    rows = numerics[(numerics["module"] == module) & (numerics["kind"] == kind)]
    bad = rows[rows["nan"].fillna(0) + rows["inf"].fillna(0) > 0]
    return sorted(int(s) for s in bad["step"].unique())


def _section_text(run: Any) -> tuple[str, ...]:
    section = next(s for s in build_sections(run, amprobe.diagnose(run)) if s.key == "whatif")
    return section.text


def _heat(fig: Any, name: str | None = None) -> Any:
    traces = [t for t in fig.data if t.type == "heatmap"]
    return traces[0] if name is None else next(t for t in traces if t.name == name)


# -- the what-if frame ------------------------------------------------------------------------
def test_layer_that_held_inf_is_not_judged(demo: Any) -> None:
    numerics = demo.table("numerics")
    steps = _held(numerics, "booster", "output")
    assert steps and 16 <= steps[0] and steps[-1] <= 23, "the planted overflow was recorded"
    whatif = compute_whatif(demo)
    booster = whatif[(whatif["module"] == "booster") & (whatif["kind"] == "output")]
    assert len(booster) == 8  # 4 formats x 2 scalings
    assert not booster["judged"].any()
    assert all(list(s) == steps for s in booster["nonfinite_steps"])
    assert booster["lost_share"].isna().all() and booster["overflow_share"].isna().all()
    # judged exactly where nothing non-finite was recorded, with a share
    for (module, kind), part in whatif.groupby(["module", "kind"]):
        held = _held(numerics, str(module), str(kind))
        assert bool(part["judged"].iloc[0]) == (not held)
        assert list(part["nonfinite_steps"].iloc[0]) == held
        assert bool(part["lost_share"].notna().all()) == (not held)


def test_diagnose_json_says_not_judged(capsys: pytest.CaptureFixture[str]) -> None:
    from amprobe.cli import main

    assert main(["diagnose", str(SAMPLES / "overflow"), "--format", "json"]) == 0
    records = json.loads(capsys.readouterr().out)["whatif"]
    numerics = amprobe.load_run(SAMPLES / "overflow").table("numerics")
    booster = [r for r in records if r["module"] == "booster" and r["kind"] == "output"]
    assert booster and all(r["judged"] is False for r in booster)
    assert all(r["lost_share"] is None for r in booster), "no share for a range not known"
    assert booster[0]["nonfinite_steps"] == _held(numerics, "booster", "output")
    assert booster[0]["nonfinite_steps"][0] == 81


# -- the report section: headline and table ---------------------------------------------------
def test_headline_leaves_out_and_names_layers_that_held_inf(demo: Any) -> None:
    numerics = demo.table("numerics")
    steps = steps_text(_held(numerics, "booster", "output"))
    text = _section_text(demo)
    line = next(t for t in text if "activations in fp8-e4m3" in t)
    outputs = numerics[numerics["kind"] == "output"]
    modules = list(dict.fromkeys(outputs["module"]))
    judged = [m for m in modules if not _held(numerics, m, "output")]
    assert judged and len(judged) < len(modules)
    assert line.startswith(f"{len(judged)} of {len(judged)} judged layers keep ≥ 99.9 %")
    assert f"of {len(modules)} layers" not in line, "every layer is not claimed"
    assert f"booster, proj, norm, act2 and head: not judged, held inf/NaN at steps {steps}" in line
    # the gradients: every layer held NaN, so none is claimed to keep anything
    grads = next(t for t in text if "output gradients" in t)
    assert "keep" not in grads and "can be judged" in grads and "not judged" in grads


def test_table_says_not_judged_with_the_steps(demo: Any) -> None:
    numerics = demo.table("numerics")
    table = whatif_table(compute_whatif(demo)).set_index(["module", "kind"])
    row = table.loc[("booster", "activation")]
    lost = [c for c in table.columns if c.endswith("lost %")]
    assert len(lost) == 8 and all(row[c] == "not judged" for c in lost)
    rows = numerics[(numerics["module"] == "booster") & (numerics["kind"] == "output")]
    count = int(rows["nan"].sum() + rows["inf"].sum())
    steps = steps_text(_held(numerics, "booster", "output"))
    assert row["inf/NaN"] == f"{count:,} at steps {steps}: not judged"
    assert table.loc[("embed", "activation"), "fp16 none lost %"] == 0.0


@pytest.mark.parametrize("name", ["healthy", "fp8-whatif"])
def test_clean_runs_judge_every_layer(name: str) -> None:
    run = amprobe.load_run(SAMPLES / name)
    whatif = compute_whatif(run)
    assert whatif["judged"].all() and whatif["lost_share"].notna().all()
    table = whatif_table(whatif)
    assert (table["inf/NaN"] == "0").all()
    assert not (table == "not judged").any().any()
    assert all("not judged" not in t for t in _section_text(run))


# -- the rules ----------------------------------------------------------------------------------
class _Net(nn.Module):
    """fc1 -> GELU -> fc2 is the loss; fc3 is a side branch whose inf is masked out of the loss
    (its output gradient stays finite); ``pre`` has no parameters and sees the input, so no
    gradient reaches its output."""

    def __init__(self, outlier: float) -> None:
        super().__init__()
        self.pre = nn.ReLU()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 8)
        self.fc3 = nn.Linear(16, 8)
        with torch.no_grad():
            self.fc1.weight[0].mul_(outlier)
            self.fc1.bias[0].mul_(outlier)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        side = self.fc3(x)
        side = torch.where(torch.isfinite(side), side, torch.zeros_like(side))
        main = self.fc2(self.act(self.fc1(x))).float().pow(2).mean()
        return main + 1e-3 * side.float().pow(2).mean()


def _record_spike(run_dir: Path, dtype: torch.dtype, outlier: float) -> Any:
    """Three steps; at step 1 fc3's bias holds inf, so fc3's output does (and nothing else)."""
    torch.manual_seed(0)
    model = _Net(outlier)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    probe = amprobe.attach(
        model,
        opt,
        run_dir=run_dir,
        config={"numerics_every": 1, "collectors": ("numerics", "compute")},
    )
    g = torch.Generator().manual_seed(1)
    try:
        for i in range(3):
            with torch.no_grad():
                model.fc3.bias[0] = math.inf if i == 1 else 0.0
            with torch.autocast("cpu", dtype=dtype):
                loss = model(torch.randn(64, 16, generator=g))
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        probe.close()
    run = amprobe.load_run(run_dir)
    assert _held(run.table("numerics"), "fc3", "output") == [1]
    assert _held(run.table("numerics"), "fc3", "grad_output") == []
    return run


@pytest.mark.parametrize(
    ("dtype", "outlier", "rule", "title"),
    [
        (torch.float16, 1.0, "AMP-P01", "2 of 2 judged matmul layer(s) keep ≥ 99.9 %"),
        (torch.float16, 2.0**14, "AMP-P02", "fc1 activations span"),
        (torch.bfloat16, 2.0**16, "AMP-P03", "this bf16 run would not fit fp16: fc1 activations"),
    ],
)
def test_rules_name_the_layer_they_did_not_judge(
    tmp_path: Path, dtype: torch.dtype, outlier: float, rule: str, title: str
) -> None:
    run = _record_spike(tmp_path / "run", dtype, outlier)
    finding = next(f for f in amprobe.diagnose(run).findings if f.id == rule)
    assert finding.title.startswith(title)
    said = "fc3: not judged" if rule == "AMP-P01" else "fc3 activations: not judged"
    assert f"{said}, held inf/NaN at step 1" in finding.title
    assert finding.evidence["not_judged"] == [f"{said}, held inf/NaN at step 1"]
    judged = json.dumps(finding.evidence.get("layers", finding.evidence.get("overflowing_layers")))
    if rule == "AMP-P02":
        assert all(x["module"] != "fc3" or x["tensor"] != "activation" for x in json.loads(judged))
    else:
        assert "fc3" not in judged


# -- the heatmap --------------------------------------------------------------------------------
def test_heatmap_draws_a_layer_that_held_inf_as_not_judged(demo: Any) -> None:
    numerics = demo.table("numerics")
    fig = make_exponent_heatmap(numerics, "activations", compute_whatif(demo))
    main = _heat(fig)
    rows = list(main.y)
    assert rows == ["embed", "act1", "booster", "proj", "norm", "act2", "head"]
    held = {m: _held(numerics, m, "output") for m in rows}
    z = pd.DataFrame(list(main.z), index=rows, columns=list(main.x))
    for module, steps in held.items():
        assert bool(z.loc[module].isna().all()) == bool(steps), f"{module}: not judged, no share"
    # its finite values in grey, the steps on hover
    grey = _heat(fig, "not judged (held inf/NaN) or not measured")
    g = pd.DataFrame(list(grey.z), index=rows, columns=list(grey.x))
    assert g.loc["booster"].notna().any() and g.loc["embed"].isna().all()
    text = pd.DataFrame(list(grey.text), index=rows, columns=list(grey.x))
    hover = text.loc["booster"][g.loc["booster"].notna()].iloc[0]
    assert f"booster: not judged, held inf/NaN at steps {steps_text(held['booster'])}" in hover
    # the inf/NaN column is red exactly for the rows that held inf/NaN
    column = _heat(fig, "held inf/NaN")
    assert [not math.isnan(v[0]) for v in column.z] == [bool(s) for s in held.values()]
    assert fig.layout.xaxis.ticktext[-1] == "inf/NaN"
    # a judged cell equals the recorded share: embed's output, bin 0, over every sampled step
    rows_ = numerics[(numerics["module"] == "embed") & (numerics["kind"] == "output")]
    hists = [json.loads(h) for h in rows_["exp_hist"]]
    total = sum(sum(h.values()) for h in hists) - int(rows_["zeros"].sum())
    in_bin = sum(h.get("0", 0) for h in hists)
    assert z.loc["embed", 0] == pytest.approx(math.log10(in_bin / total))
    sampled = steps_text(sorted(int(s) for s in numerics["step"].unique()))
    assert f"summed over sampled steps {sampled}" in fig.layout.title.text


@pytest.mark.parametrize("name", ["healthy", "fp8-whatif"])
def test_heatmap_of_a_clean_run_has_no_grey_or_red_cell(name: str) -> None:
    run = amprobe.load_run(SAMPLES / name)
    for group in ("activations", "gradients"):
        fig = make_exponent_heatmap(run.table("numerics"), group, compute_whatif(run))
        assert fig.layout.plot_bgcolor == "white", "a cell with no values is white"
        main = _heat(fig)
        assert (main.zmin, main.zmax) == (-6.0, 0)
        assert all(t.name != "not judged (held inf/NaN) or not measured" for t in fig.data)
        assert all(math.isnan(v[0]) for v in _heat(fig, "held inf/NaN").z)
        # one column per binade, none left out, and a share drawn exactly in the binades that
        # hold recorded values
        x = [int(v) for v in main.x]
        assert x == list(range(x[0], x[-1] + 1))
        recorded = set(
            compute_exponent_shares(run.table("numerics"), HEATMAP_GROUPS[group][1])["exponent"]
        )
        drawn = {x[j] for row in main.z for j, v in enumerate(row) if not math.isnan(v)}
        assert recorded and drawn == recorded


def test_heatmap_draws_a_kind_not_recorded_as_not_measured(tmp_path: Path) -> None:
    run = _record_spike(tmp_path / "run", torch.float16, 1.0)
    numerics = run.table("numerics")
    assert "pre" in set(numerics.loc[numerics["kind"] == "output", "module"])
    assert "pre" not in set(numerics.loc[numerics["kind"] == "grad_output", "module"])
    fig = make_exponent_heatmap(numerics, "gradients", compute_whatif(run))
    grey = _heat(fig, "not judged (held inf/NaN) or not measured")
    rows = list(grey.y)
    assert "pre · output grad" in rows, "drawn, not left out"
    g = pd.DataFrame(list(grey.z), index=rows, columns=list(grey.x))
    assert (g.loc["pre · output grad"] == 0.0).all()  # a light grey row
    hover = grey.text[rows.index("pre · output grad")][0]
    assert hover.startswith("pre · output grad: not measured, no output-gradient histogram")
    assert all(math.isnan(v) for v in _heat(fig).z[rows.index("pre · output grad")])


def test_headline_judges_by_the_threshold_the_diagnosis_ran_with() -> None:
    """ "Keeps its values" in the headline is AMP-P01's ``min_representable_share``: a configured
    threshold changes the finding and the headline alike (the headline kept 99.9 %)."""
    run = amprobe.load_run(SAMPLES / "fp8-whatif")
    for share, words in ((None, "≥ 99.9 %"), (0.9, "≥ 90 %")):
        thresholds = {} if share is None else {"AMP-P01": {"min_representable_share": share}}
        diagnosis = amprobe.diagnose(run, thresholds=thresholds)
        (p01,) = [f for f in diagnosis.findings if f.id == "AMP-P01"]
        assert words in p01.title
        (section,) = [s for s in build_sections(run, diagnosis) if s.key == "whatif"]
        headline = [t for t in section.text if "layers keep" in t]
        assert len(headline) == 2 and all(words in t for t in headline), headline
