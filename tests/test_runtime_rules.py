"""AMP-S01 / S03 / S07 on small hand-built frames: positive and negative cases."""

from __future__ import annotations

import pytest

import amprobe
from tests.helpers import fake_run


def _steps(n, wait, wall=0.1, syncs=None, sampled_every=0):
    rows = []
    for i in range(n):
        row = {"step": i, "wall_s": wall, "data_wait_s": wait}
        if sampled_every and i % sampled_every == 1 % sampled_every:
            row.update(syncs_sampled=True, syncs=syncs)
        rows.append(row)
    return rows


def _gpu(n, util, tensor=None):
    return [
        {"t": i * 0.1, "step": i, "gpu": 0, "gpu_util": util, "tensor_any": tensor}
        for i in range(n)
    ]


NO_DRIVER = [{"kind": "gpu_sampler", "status": "not available", "reason": "no NVIDIA driver"}]


def ids(run):
    return set(amprobe.diagnose(run).ids())


@pytest.mark.parametrize(
    "wait, gpu_util, fires",
    [
        (0.05, None, True),  # 50 % waiting, no GPU data
        (0.01, None, False),  # 10 %
        (0.01, 40.0, True),  # GPU idle although the host does not wait
        (0.01, 95.0, False),
        (0.03, 95.0, True),
    ],
)
def test_input_bound_cases(wait, gpu_util, fires):
    tables = {"gpu": _gpu(10, gpu_util)} if gpu_util is not None else None
    run = fake_run(_steps(10, wait), events=[] if tables else NO_DRIVER, tables=tables)
    assert ("AMP-S01" in ids(run)) is fires


def test_input_bound_evidence():
    run = fake_run(_steps(6, 0.05), events=NO_DRIVER)
    f = next(f for f in amprobe.diagnose(run).findings if f.id == "AMP-S01")
    assert f.evidence["data_wait_share"] == pytest.approx(0.5)
    assert f.evidence["gpu_util"] == "not checked: no NVIDIA driver"
    assert f.evidence["measured_step_count"] == 5
    run = fake_run(_steps(6, 0.0), tables={"gpu": _gpu(6, 30.0)})
    f = next(f for f in amprobe.diagnose(run).findings if f.id == "AMP-S01")
    assert f.evidence["gpu_util_median"] == 30.0 and "median GPU utilization 30%" in f.title


def test_input_bound_skips_first_step_and_needs_steps():
    rows = _steps(6, 0.0)
    rows[0]["data_wait_s"] = 0.1  # a multi-worker loader's first batch
    assert "AMP-S01" not in ids(fake_run(rows, events=NO_DRIVER))
    assert "AMP-S01" not in ids(fake_run(_steps(3, 0.09), events=NO_DRIVER))


def test_runtime_rules_not_checked_without_runtime_data():
    run = fake_run([{"step": i, "wall_s": 0.1} for i in range(5)])
    reasons = {n.id: n.reason for n in amprobe.diagnose(run).not_checked}
    assert "runtime collector off" in reasons["AMP-S01"]
    assert "not counted" in reasons["AMP-S03"]
    assert "AMP-S07" in reasons


@pytest.mark.parametrize("per_step, fires", [(0, False), (3, False), (4, True), (10, True)])
def test_host_sync_threshold(per_step, fires):
    steps = _steps(10, 0.0, syncs=per_step, sampled_every=3)
    syncs = [
        {
            "step": s["step"],
            "site": "train.py:12",
            "op": "item",
            "kind": "user",
            "count": per_step,
            "device": "cuda",
        }
        for s in steps
        if s.get("syncs_sampled")
    ]
    run = fake_run(steps, events=NO_DRIVER, tables={"syncs": syncs})
    assert ("AMP-S03" in ids(run)) is fires


def test_host_sync_top_sites_order():
    steps = _steps(4, 0.0, syncs=6, sampled_every=1)
    syncs = []
    for s in steps:
        syncs += [
            {
                "step": s["step"],
                "site": "a.py:1",
                "op": "item",
                "kind": "user",
                "count": 1,
                "device": "cuda",
            },
            {
                "step": s["step"],
                "site": "b.py:9",
                "op": "to-cpu",
                "kind": "user",
                "count": 5,
                "device": "cuda",
            },
            {
                "step": s["step"],
                "site": "a.py:7",
                "op": "item",
                "kind": "scaler",
                "count": 1,
                "device": "cuda",
            },
        ]
    f = next(
        f
        for f in amprobe.diagnose(fake_run(steps, tables={"syncs": syncs})).findings
        if f.id == "AMP-S03"
    )
    assert f.evidence["top_sites"] == ["b.py:9 (to-cpu, 5/step)", "a.py:1 (item, 1/step)"]
    assert f.evidence["counted_on"] == "cuda" and "would synchronize" not in f.title
    assert f.evidence["gradscaler_checks_per_step"] == 1.0


@pytest.mark.parametrize(
    "tensor, util, dtype, fires",
    [
        (0.2, 90.0, "bfloat16", True),
        (35.0, 90.0, "bfloat16", False),
        (0.2, 10.0, "bfloat16", False),
        (0.2, 90.0, None, False),
    ],
)
def test_tensor_core_idle(tensor, util, dtype, fires):
    steps = [
        {**s, "autocast_dtype": dtype, "autocast_device": "cuda" if dtype else None}
        for s in _steps(8, 0.0)
    ]
    run = fake_run(steps, tables={"gpu": _gpu(8, util, tensor)})
    assert ("AMP-S07" in ids(run)) is fires


def test_tensor_core_idle_not_checked_without_gpm():
    steps = [{**s, "autocast_dtype": "float16"} for s in _steps(8, 0.0)]
    run = fake_run(
        steps,
        events=[
            {"kind": "gpu_sampler", "status": "sampling"},
            {
                "kind": "gpu_sampler",
                "status": "gpm not available",
                "reason": "GPM is not supported on this GPU (needs Hopper or newer)",
            },
        ],
        tables={"gpu": _gpu(8, 90.0)},
    )
    reasons = {n.id: n.reason for n in amprobe.diagnose(run).not_checked}
    assert reasons["AMP-S07"] == "GPM is not supported on this GPU (needs Hopper or newer)"


def test_runtime_section_missing_and_present():
    from amprobe.report import build_sections

    run = fake_run([{"step": 0, "wall_s": 0.1}])
    sec = next(s for s in build_sections(run, amprobe.diagnose(run)) if s.key == "runtime")
    assert sec.missing and "runtime" in sec.missing
    run = fake_run(_steps(5, 0.02), events=NO_DRIVER, tables={"gpu": []})
    sec = next(s for s in build_sections(run, amprobe.diagnose(run)) if s.key == "runtime")
    assert sec.missing is None and sec.figures
    assert "GPU utilization not recorded: no NVIDIA driver." in sec.text
    run = fake_run(_steps(5, 0.02), tables={"gpu": _gpu(5, 80.0, 20.0)})
    sec = next(s for s in build_sections(run, amprobe.diagnose(run)) if s.key == "runtime")
    names = [t.name for t in sec.figures[0].data]
    assert names == ["step time", "data wait", "GPU util", "Tensor Core activity"]
