"""The per-rank view marks the ranks the findings single out (issue 35, item 4).

Synthetic diagnoses hold AMP-D04 (the origin rank of the first non-finite value and the ranks
that received it), AMP-D05 (a divergent replica; two replicas whose faulty copy cannot be
told) and AMP-D06 (a faulty device), their evidence shaped as the rules write it. The report's
Ranks section (its text, figures and tables, rendered to HTML) and the dashboard's Ranks tab
mark those ranks and no other; without the findings nothing is marked; a 4,096-rank run drawn
as bands keeps the marked rank on a line and a heatmap row of its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest

from amprobe.report.document import render_html
from amprobe.report.rankmarks import RankMarks, compute_rank_marks
from amprobe.report.ranks import (
    HEATMAP_ROWS,
    build_ranks_section,
    make_rank_heatmap_figure,
    make_ranks_figure,
)
from amprobe.rules.engine import Diagnosis, Finding
from tests.helpers import fake_run

RANKS, STEPS, BAD = 4, 20, 12
ORIGIN = 2  # not rank 0: the lowest rank with a NaN loss is not an answer


def _rows(ranks: int, steps: int = STEPS) -> list[dict[str, Any]]:
    """Every rank alike (as after an all-reduce): scale 1024 halved at BAD on every rank."""
    rows = []
    for rank in range(ranks):
        for step in range(steps):
            scale = 1024.0 if step <= BAD else 512.0
            rows.append(
                {
                    "rank": rank,
                    "step": step,
                    "wall_s": 0.05,
                    "scaler_enabled": True,
                    "scale_before": scale,
                    "scale_after": 512.0 if step >= BAD else 1024.0,
                    "skipped": step == BAD,
                    "loss": float("nan") if step == BAD else 1.0,
                    "loss_nonfinite": step == BAD,
                }
            )
    return rows


def _d04(origin: int = ORIGIN, received: list[int] | None = None, what: str = "input") -> Finding:
    received = [r for r in range(RANKS) if r != origin] if received is None else received
    return Finding(
        "AMP-D04",
        "rank-nonfinite-origin",
        "error",
        "distributed",
        f"the first non-finite value came from rank {origin}",
        {
            "origin": {
                "rank": origin,
                "hostname": "node-b",
                "local_rank": origin % 2,
                "device": f"cuda:{origin % 2}",
                "step": BAD,
                "what": what,
                "layer": "blocks.1.fc2" if what in ("activation", "gradient") else None,
            },
            "received": received,
        },
        "look at that rank",
    )


def _d05(ranks: list[int], group: list[int], majority: bool, groups: bool = False) -> Finding:
    one = {
        "step": 7,
        "ranks": ranks,
        "majority": majority,
        "params": ["fc1.weight"],
        "group": group,
    }
    evidence = {"groups": [one]} if groups else {"divergent": one}
    return Finding(
        "AMP-D05", "replica-divergence", "error", "distributed", "replicas differ", evidence, "x"
    )


def _d06(rank: int) -> Finding:
    fault = {
        "rank": rank,
        "hostname": "node-c",
        "device": "cuda:1",
        "uuid": "GPU-1234",
        "pci_bus_id": "0000:3b:00.0",
        "step": 15,
        "mismatches": 3,
    }
    return Finding(
        "AMP-D06", "device-fault", "error", "distributed", "wrong answer", {"faults": [fault]}, "x"
    )


def _diagnosis(run: Any, *findings: Finding) -> Diagnosis:
    return Diagnosis(run=run, findings=findings, not_checked=(), health={})


@pytest.fixture(scope="module")
def run() -> Any:
    return fake_run(ranks=range(RANKS), steps=_rows(RANKS))


def _marker_traces(fig: Any) -> list[Any]:
    """The figure's mark markers: black, named after a marked rank and its finding."""
    return [t for t in fig.data if t.marker is not None and t.marker.color == "#000000"]


def test_origin_rank_is_marked_with_what_and_where(run: Any) -> None:
    section = build_ranks_section(run, _diagnosis(run, _d04()))
    line = next(t for t in section.text if t.startswith("AMP-D04"))
    assert f"rank {ORIGIN} (host node-b, local rank 0, cuda:0)" in line
    assert f"at step {BAD}: its input batch" in line and "Ranks 0-1, 3 received it" in line
    marks_table = dict(section.tables)["ranks marked by findings"]
    assert marks_table["rank"].tolist() == [str(ORIGIN), "0-1, 3"]
    assert marks_table["mark"].tolist() == ["NaN/inf origin: input", f"received from rank {ORIGIN}"]
    summary = dict(section.tables)["per-rank summary"]
    assert summary.loc[summary["rank"] == ORIGIN, "marked"].item() == (
        "NaN/inf origin: input (AMP-D04)"
    )
    assert summary.loc[summary["rank"] == 0, "marked"].item().startswith("received from rank 2")
    # the figure: the origin's marker at its step, on its loss scale; the others' open circles
    fig = section.figures[0]
    (origin, received) = _marker_traces(fig)
    assert origin.name == f"rank {ORIGIN}: NaN/inf origin: input (AMP-D04)"
    assert (list(origin.x), list(origin.y), origin.marker.symbol) == ([BAD], [512.0], "x")
    assert "node-b" in origin.hovertext[0] and f"step {BAD}" in origin.hovertext[0]
    assert received.name.startswith("received from rank 2") and len(received.x) == RANKS - 1
    # and in the HTML report
    html = render_html(run, _diagnosis(run, _d04()), [section])
    assert "ranks marked by findings" in html and "NaN/inf origin: input" in html
    # the finding links to the ranks view, naming the origin only (not the receivers)
    assert f"<a href='#ranks'>rank {ORIGIN} in the ranks view</a>" in html


@pytest.mark.parametrize(
    ("what", "label", "said"),
    [
        ("loss", "NaN/inf origin: loss", "its local loss"),
        (
            "activation",
            "NaN/inf origin: layer blocks.1.fc2",
            "the activation of layer blocks.1.fc2",
        ),
        ("gradient", "NaN/inf origin: gradient of blocks.1.fc2", "before the reduction"),
    ],
)
def test_origin_says_what_it_was(run: Any, what: str, label: str, said: str) -> None:
    marks = compute_rank_marks(_diagnosis(run, _d04(what=what)), run)
    (mark,) = marks.marks
    assert (mark.rank, mark.step, mark.label) == (ORIGIN, BAD, label)
    assert said in mark.text and said in marks.lines[0]


def test_two_replicas_both_marked_and_the_copy_cannot_be_told(run: Any) -> None:
    section = build_ranks_section(run, _diagnosis(run, _d05([1, 3], [1, 3], majority=False)))
    line = next(t for t in section.text if t.startswith("AMP-D05"))
    assert (
        "Ranks 1 and 3 (the two replicas of their group) hold different" in line
        and "cannot be told" in line
        and "fc1.weight" in line
    )
    marked = dict(section.tables)["per-rank summary"].set_index("rank")["marked"]
    assert [bool(marked[r]) for r in range(RANKS)] == [False, True, False, True]
    names = [t.name for t in _marker_traces(section.figures[0])]
    assert names == [
        f"rank {r}: replica differs (which copy cannot be told) (AMP-D05)" for r in (1, 3)
    ]


def test_divergent_minority_and_groups_list(run: Any) -> None:
    """A list under ``groups`` (one finding for several replica groups) marks each group's
    minority rank; the majority ranks stay unmarked."""
    finding = _d05([2], [0, 1, 2], majority=True, groups=True)
    marks = compute_rank_marks(_diagnosis(run, finding), run)
    assert [(m.rank, m.kind, m.step) for m in marks.marks] == [(2, "divergent", 7)]
    assert marks.lines == (
        "AMP-D05: Rank 2 differs from the majority of replica group 0-2 at step 7: fc1.weight.",
    )
    assert marks.column(range(RANKS)) == ["", "", "divergent replica (AMP-D05)", ""]


def test_faulty_device_is_marked(run: Any) -> None:
    section = build_ranks_section(run, _diagnosis(run, _d06(1)))
    line = next(t for t in section.text if t.startswith("AMP-D06"))
    assert "rank 1 on host node-c" in line and "GPU-1234" in line and "0000:3b:00.0" in line
    (marker,) = _marker_traces(section.figures[0])
    assert marker.name == "rank 1: device fault (AMP-D06)" and list(marker.x) == [15]


def test_no_finding_no_mark(run: Any) -> None:
    """Without the findings (or with other findings that name ranks) no rank is marked."""
    other = Finding(
        "AMP-D02", "rank-straggler", "info", "distributed", "slow", {"ranks": [1], "rank": 1}, "x"
    )
    # a finding of those IDs whose evidence lacks the rules' keys marks nothing either
    empty = Finding("AMP-D04", "rank-nonfinite-origin", "error", "distributed", "t", {}, "x")
    for diagnosis in (_diagnosis(run), _diagnosis(run, other, empty)):
        marks = compute_rank_marks(diagnosis, run)
        assert not marks and not marks.lines
        section = build_ranks_section(run, diagnosis)
        assert [c for c, _ in section.tables] == ["per-rank summary"]
        assert "marked" not in section.tables[0][1].columns
        assert not _marker_traces(section.figures[0])
        assert not any("marked" in (t.name or "") for t in section.figures[0].data)
        html = render_html(run, diagnosis, [section])
        assert "NaN/inf origin" not in html and "received from" not in html
        assert "ranks marked" not in html


def test_dashboard_ranks_tab_marks_the_origin(run: Any) -> None:
    pytest.importorskip("dash")
    from dashboard.layout import build_finding, build_section_tab
    from dashboard.runs import LoadedRun

    def tab_text(diagnosis: Diagnosis) -> tuple[str, list[str]]:
        tab = build_section_tab(LoadedRun("r", run, diagnosis), "ranks", "Ranks")
        texts, names = [], []

        def walk(node: Any) -> None:
            if isinstance(node, str | int | float):
                texts.append(str(node))
                return
            if getattr(node, "className", None) == "rank-mark":
                texts.append(f"[set apart: {node.children}]")
            figure = getattr(node, "figure", None)
            if figure is not None:
                names.extend(t.name or "" for t in figure.data)
            children = getattr(node, "children", None)
            for child in children if isinstance(children, list) else [children]:
                if child is not None:
                    walk(child)

        walk(tab)
        return " ".join(texts), names

    text, names = tab_text(_diagnosis(run, _d04()))
    assert f"[set apart: AMP-D04: rank {ORIGIN} (host node-b" in text
    assert "ranks marked by findings" in text
    assert f"rank {ORIGIN}: NaN/inf origin: input (AMP-D04)" in names
    card = str(build_finding(0, _d05([1, 3], [1, 3], majority=False), run_name="r"))
    assert "ranks 1, 3 on the Ranks tab" in card and "/run/r?tab=ranks" in card
    other = Finding("AMP-N05", "forward-overflow", "error", "nan", "t", {"rank": 1}, "x")
    assert "Ranks tab" not in str(build_finding(0, other, run_name="r"))
    text, names = tab_text(_diagnosis(run))
    assert "origin" not in text and "set apart" not in text
    assert not any("AMP-D04" in n for n in names)


def test_a_marked_rank_of_4096_stays_visible_in_the_bands() -> None:
    """4,096 ranks are drawn as bands and a bucketed heatmap; the origin (an ordinary rank:
    its values equal everyone's, so no outlier rule would name it) keeps a line, a marker
    and a heatmap row of its own, and the divergent pair theirs."""
    n, origin = 4096, 2749
    rank = np.repeat(np.arange(n), STEPS)
    step = np.tile(np.arange(STEPS), n)
    steps = pd.DataFrame(
        {
            "rank": rank,
            "step": step,
            "wall_s": 0.05 + 1e-4 * (rank % 7),
            "scaler_enabled": True,
            "scale_before": np.where(step <= BAD, 1024.0, 512.0),
            "scale_after": np.where(step >= BAD, 512.0, 1024.0),
            "skipped": step == BAD,
        }
    )
    findings = (
        _d04(origin=origin, received=[r for r in range(n) if r != origin]),
        _d05([1234, 1235], [1234, 1235], majority=False),
    )
    run = fake_run(ranks=[0])  # the marks read only the findings here
    marks = compute_rank_marks(_diagnosis(run, *findings), run)
    assert marks.ranks() == [origin, 1234, 1235]
    assert "Ranks 0-2748, 2750-4095 received it" in marks.lines[0]
    fig = make_ranks_figure(steps, marks)
    names = [t.name or "" for t in fig.data]
    assert len(names) < 40  # still bands, not a trace per rank
    assert f"rank {origin} loss scale (marked: NaN/inf origin: input)" in names
    assert f"rank {origin} step time (ms) (marked: NaN/inf origin: input)" in names
    (marker,) = [t for t in _marker_traces(fig) if t.name.startswith(f"rank {origin}")]
    assert (list(marker.x), list(marker.y)) == ([BAD], [512.0])
    heat = make_rank_heatmap_figure(steps, "wall_s", marks)
    labels = list(heat.data[0].y)
    assert len(labels) <= HEATMAP_ROWS + 2 * 3 and heat.layout.yaxis.type == "category"
    assert f"r{origin} \u00b7 NaN origin" in labels
    assert {"r1234 \u00b7 replica differs", "r1235 \u00b7 replica differs"} <= set(labels)
    # its row is its own values, not a bucket's most deviating rank
    row = labels.index(f"r{origin} \u00b7 NaN origin")
    assert (heat.data[0].customdata[row] == origin).all()
    spots = {(t.y[0], t.x[0]) for t in heat.data[1:]}
    assert (f"r{origin} \u00b7 NaN origin", BAD) in spots
    # without marks: bucketed, the rank folded into its row of 16
    plain = make_rank_heatmap_figure(steps, "wall_s", RankMarks())
    assert not any("origin" in y for y in plain.data[0].y) and len(plain.data) == 1


def test_a_run_of_many_ranks_read_through_its_derived_store_marks_the_origin(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 ranks written by amprobe's writer: the section reads them through the derived store
    (DuckDB bands, as at cluster scale); the origin rank 9 gets its own lines and rows."""
    import amprobe
    from amprobe.store.writer import RunWriter

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ranks, origin = 12, 9
    for rank in range(ranks):
        manifest = {"device": "cpu", "hostname": f"n{rank // 4}"}
        writer = RunWriter(tmp_path / "run", rank, ranks, manifest, max_buffered_rows=1000)
        writer.append("steps", [{k: v for k, v in row.items() if k != "rank"} for row in _rows(1)])
        writer.close({"status": "finished", "steps": STEPS})
    run = amprobe.load_run(tmp_path / "run")
    d04 = _d04(origin=origin, received=[r for r in range(ranks) if r != origin])
    section = build_ranks_section(run, _diagnosis(run, d04))
    assert "A rank a finding marks is drawn on its own" in " ".join(section.text)
    names = [t.name or "" for t in section.figures[0].data]
    assert f"rank {origin} loss scale (marked: NaN/inf origin: input)" in names
    for heat in section.figures[1:]:
        assert f"r{origin} \u00b7 NaN origin" in list(heat.data[0].y)
    marks_table = dict(section.tables)["ranks marked by findings"]
    assert marks_table["rank"].tolist() == [str(origin), "0-8, 10-11"]
    plain = build_ranks_section(run, _diagnosis(run))
    assert not any("marked" in (t.name or "") for t in plain.figures[0].data)


def test_marks_read_numpy_values_and_survive_the_cached_diagnosis(run: Any) -> None:
    """A rule may write NumPy integers (values of a frame); the cached diagnosis gives the
    evidence back as written: the same marks either way."""
    from amprobe.rules.cache import decode_diagnosis, encode_diagnosis

    d04 = _d04()
    origin = {**d04.evidence["origin"], "rank": np.int64(ORIGIN), "step": np.int64(BAD)}
    numpy_d04 = Finding(
        d04.id,
        d04.name,
        d04.severity,
        d04.category,
        d04.title,
        {"origin": origin, "received": list(np.array([0, 1, 3]))},
        d04.fix,
    )
    diagnosis = _diagnosis(run, numpy_d04, _d05([1, 3], [1, 3], majority=False), _d06(1))
    marks = compute_rank_marks(diagnosis, run)
    assert [(m.rank, m.kind, m.step) for m in marks.marks] == [
        (ORIGIN, "origin", BAD),
        (1, "replica-pair", 7),
        (3, "replica-pair", 7),
        (1, "fault", 15),
    ]
    assert marks.received == {ORIGIN: (0, 1, 3)}
    facts = {
        "steps": STEPS,
        "last_step": STEPS - 1,
        "dtype": "float16",
        "compiled": [],
        "lost_steps": [],
    }
    cached = decode_diagnosis(encode_diagnosis(diagnosis, facts, []), run)
    assert compute_rank_marks(cached, run) == marks


def test_marks_past_the_drawn_limit_are_listed_not_dropped(run: Any) -> None:
    from amprobe.report.rankmarks import MAX_MARKED_RANKS

    faults = [{**_d06(r).evidence["faults"][0], "rank": r} for r in range(MAX_MARKED_RANKS + 4)]
    finding = Finding(
        "AMP-D06", "device-fault", "error", "distributed", "t", {"faults": faults}, "x"
    )
    marks = compute_rank_marks(_diagnosis(run, finding), run)
    assert marks.ranks() == list(range(MAX_MARKED_RANKS))  # drawn on their own
    assert len(marks.table()) == len(faults) and len(marks.lines) == len(faults)


def test_unknown_places_are_left_out_not_printed(run: Any) -> None:
    """AMP-D06 writes "unknown host"/"unknown device" and a local rank may be -1: the marks
    then say nothing of them (the rank's manifest has none either)."""
    fault = {**_d06(1).evidence["faults"][0], "hostname": "unknown host"}
    fault.update(device="unknown device", uuid=None, pci_bus_id=None)
    finding = Finding(
        "AMP-D06", "device-fault", "error", "distributed", "t", {"faults": [fault]}, "x"
    )
    d04 = _d04()
    origin = {**d04.evidence["origin"], "local_rank": -1, "hostname": None, "device": None}
    d04 = Finding(d04.id, d04.name, d04.severity, d04.category, d04.title, {"origin": origin}, "x")
    marks = compute_rank_marks(_diagnosis(run, finding, d04), run)
    assert (
        marks.lines[0]
        == "AMP-D06: rank 1: its device cpu gave a wrong known answer at step 15 (3 wrong values)."
    )
    assert marks.lines[1] == (
        f"AMP-D04: rank {ORIGIN} (cpu) produced the non-finite value at step {BAD}: its input batch."
    )  # the device from the rank's manifest
    assert "unknown" not in " ".join(marks.table().astype(str).to_numpy().ravel())


def test_two_episodes_of_one_origin_keep_their_own_receivers(run: Any) -> None:
    """AMP-D04 writes a finding per episode: each origin mark keeps its own receivers."""
    first, later = _d04(received=[0, 1]), _d04(received=[3])
    marks = compute_rank_marks(_diagnosis(run, first, later), run)
    assert [m.received for m in marks.marks] == [(0, 1), (3,)]
    assert marks.received == {ORIGIN: (0, 1, 3)}
    assert marks.table()["rank"].tolist() == [str(ORIGIN), "0-1", str(ORIGIN), "3"]
    assert marks.column(range(RANKS))[ORIGIN] == "NaN/inf origin: input (AMP-D04)"
