"""AMP-S02/S04/S05, alignment helpers, MFU and the compute report section on hand-built frames."""

from __future__ import annotations

import pytest

import amprobe
from amprobe.analysis.compute import alignment_frame, compute_mfu, pad_to, required_multiple
from amprobe.analysis.peaks import PEAKS, lookup_peak, precision_of
from amprobe.report.compute import build_compute_section, make_op_table
from tests.helpers import fake_run


def op(
    module: str,
    m: int,
    n: int,
    k: int,
    dtype: str = "bfloat16",
    flops: float | None = None,
    phase: str = "forward",
    autocast: str = "enabled",
    opname: str = "addmm",
    **extra,
) -> dict:
    return {
        "step": 1,
        "module": module,
        "op": opname,
        "phase": phase,
        "m": m,
        "n": n,
        "k": k,
        "in_dtype": dtype,
        "out_dtype": dtype,
        "autocast": autocast,
        "count": 1,
        "flops": float(flops if flops is not None else 2 * m * n * k),
        **extra,
    }


def cstep(flops: float, other_bytes: float, tf32: bool = False) -> dict:
    return {
        "step": 1,
        "matmul_flops": flops,
        "matmul_ops": 1,
        "other_ops": 10,
        "other_bytes": other_bytes,
        "optimizer_bytes": 0.0,
        "tf32": tf32,
        "capture_s": 1.0,
    }


def run_with(
    ops: list[dict],
    flops: float | None = None,
    other_bytes: float = 1e6,
    params: int = 5_000_000,
    events: tuple = (),
    steps: tuple = (),
    manifest: dict | None = None,
    tf32: bool = False,
):
    total = flops if flops is not None else sum(o["flops"] for o in ops)
    return fake_run(
        steps=steps or [{"step": s, "wall_s": 0.1} for s in range(4)],
        events=[{"kind": "model_params", "trainable_params": params, "params": params}, *events],
        manifest={"config": {"collectors": ["scaler", "compute"]}, **(manifest or {})},
        tables={"compute_ops": ops, "compute_steps": [cstep(total, other_bytes, tf32)]},
    )


def ids(run) -> list[str]:
    return amprobe.diagnose(run, only=["AMP-S02", "AMP-S04", "AMP-S05"]).ids()


@pytest.mark.parametrize(
    ("size", "multiple", "padded"),
    [(100, 8, 104), (1003, 8, 1008), (256, 8, 256), (250, 4, 252), (100, 16, 112), (1, 8, 8)],
)
def test_pad_to(size, multiple, padded):
    assert pad_to(size, multiple) == padded


@pytest.mark.parametrize(
    ("dtype", "tf32", "multiple"),
    [
        ("float16", False, 8),
        ("bfloat16", False, 8),
        ("float32", True, 4),
        ("float32", False, None),
        ("float8_e4m3fn", False, 16),
        ("int8", False, 16),
        ("float64", False, None),
    ],
)
def test_required_multiple(dtype, tf32, multiple):
    assert required_multiple(dtype, tf32) == multiple


@pytest.mark.parametrize(
    ("ops", "expect"),
    [
        pytest.param(
            [op("fc", 64, 100, 64), op("head", 64, 1008, 104)], ["AMP-S04"], id="hidden-100"
        ),
        pytest.param([op("fc", 64, 128, 64), op("head", 64, 1024, 128)], [], id="aligned"),
        pytest.param([op("fc", 64, 100, 64, dtype="float32")], [], id="fp32-no-tc"),
        pytest.param(
            [op("fc", 64, 1000, 64, dtype="float8_e4m3fn", opname="_scaled_mm")],
            ["AMP-S04"],
            id="fp8-16",
        ),
        pytest.param([op("fc", 64, 1000, 64)], [], id="bf16-1000-ok"),
        pytest.param(
            [op("big", 4096, 4096, 4096), op("tiny", 8, 8, 3, flops=1.0)], [], id="below-share"
        ),
        pytest.param(
            [op("attn", 128, 128, 60, opname="_scaled_dot_product_flash_attention", batch=8)],
            ["AMP-S04"],
            id="head-dim-60",
        ),
        pytest.param(
            [op("conv", 2048, 30, 27, opname="convolution", cin=3, cout=30, kernel="3x3")],
            ["AMP-S04"],
            id="conv-channels",
        ),
    ],
)
def test_s04_cases(ops, expect):
    found = [i for i in ids(run_with(ops)) if i == "AMP-S04"]
    assert found == expect


def test_s04_tf32_uses_multiple_of_4():
    run = run_with([op("fc", 64, 250, 64, dtype="float32")], tf32=True)
    f = amprobe.diagnose(run, only=["AMP-S04"]).findings[0]
    assert f.evidence["layers"][0]["dims"] == {"250": 252}
    assert f.evidence["layers"][0]["multiple"] == 4


def test_s04_tile_waste_is_info():
    run = run_with([op("fc", 2048, 96, 512), op("head", 2048, 1024, 512)])
    findings = amprobe.diagnose(run, only=["AMP-S04"]).findings
    assert [f.severity for f in findings] == ["info"]
    assert findings[0].evidence["layers"] == [{"module": "fc", "dims": {"96": 128}}]


@pytest.mark.parametrize(("device", "gpu_note"), [("cpu", True), ("cuda:0", False)])
def test_s04_names_layers_not_the_root_and_says_gpu_on_cpu(device, gpu_note):
    """Issue 14 item 9: a root-booked op (the last layer's backward) is no layer to pad."""
    ops = [
        op("head", 2048, 100, 512),
        op("Net", 2048, 512, 100, phase="backward", opname="mm"),
        op("fc", 2048, 96, 512),
    ]
    events = ({"kind": "model_registered", "model_class": "Net"},)
    run = run_with(ops, events=events, manifest={"device": device})
    findings = amprobe.diagnose(run, only=["AMP-S04"]).findings
    warning = next(f for f in findings if f.severity == "warning")
    assert [x["module"] for x in warning.evidence["layers"]] == ["head"]
    assert "Net" not in warning.title
    assert ("(would waste Tensor Core tiles on a GPU)" in warning.title) is gpu_note
    info = next(f for f in findings if f.severity == "info")
    assert [x["module"] for x in info.evidence["layers"]] == ["fc"]
    verb = "would waste Tensor Core tiles on a GPU" if gpu_note else "waste Tensor Core tiles"
    assert info.title.startswith(f"aligned but small layer sizes {verb}: ")


def test_s04_names_a_root_that_is_itself_the_layer():
    """A bare nn.Linear as the model: its ops are booked under its class name, and are its own."""
    ops = [
        op("Linear", 4, 8, 8),
        op("Linear", 8, 8, 4, phase="backward", opname="mm"),
    ]
    events = ({"kind": "model_registered", "model_class": "Linear"},)
    findings = amprobe.diagnose(run_with(ops, events=events), only=["AMP-S04"]).findings
    assert findings, "the misaligned batch and the small layer are both reportable"
    for f in findings:
        assert [x["module"] for x in f.evidence["layers"]] == ["Linear"]
        assert not f.title.endswith(": ")
    info = next(f for f in findings if f.severity == "info")
    assert info.evidence["layers"] == [{"module": "Linear", "dims": {"8": 64}}]
    assert info.title.endswith(": Linear (8 -> 64)")


@pytest.mark.parametrize(
    ("framework", "autocast", "expect"),
    [
        ({"framework_amp_dtype": "float16"}, False, True),  # asked, none ran: trained in fp32
        ({"framework_amp_dtype": "float16"}, True, False),  # asked and active
        ({"framework_amp_dtype": None}, False, False),  # fp32 asked for
        ({}, False, False),  # no framework integration
    ],
)
def test_s05_framework_precision_without_autocast(framework, autocast, expect):
    """Issue 14 item 8: the framework's setting asks for mixed precision, none ran."""
    manifest = {}
    if framework:
        manifest = {
            "framework": "transformers",
            "framework_precision": "fp16",
            "framework_precision_setting": "TrainingArguments(fp16=True)",
            **framework,
        }
    events = ({"kind": "autocast_seen", "device": "cpu", "dtype": "float16", "enabled": True},)
    run = run_with(
        [op("fc", 64, 64, 64, dtype="float32", autocast="none")],
        events=events if autocast else (),
        manifest=manifest,
    )
    findings = amprobe.diagnose(run, only=["AMP-S05"]).findings
    framework_findings = [f for f in findings if "framework" in f.evidence]
    assert bool(framework_findings) is expect
    if expect:
        f = framework_findings[0]
        assert f.title.startswith("TrainingArguments(fp16=True) asks transformers for mixed")
        assert f.evidence["framework_amp_dtype"] == "float16"


@pytest.mark.parametrize(
    ("flops", "other_bytes", "params", "expect"),
    [
        (1e9, 1e10, 5_000_000, ["AMP-S02"]),  # 0.1 FLOP/byte
        (1e11, 1e9, 5_000_000, []),  # 100 FLOP/byte, big enough
        (1e11, 1e9, 50_000, ["AMP-S02"]),  # small model
        (1e11, 1e9, 0, []),  # params not recorded: intensity alone decides
    ],
)
def test_s02_cases(flops, other_bytes, params, expect):
    assert (
        ids(
            run_with([op("fc", 256, 256, 256, flops=flops)], other_bytes=other_bytes, params=params)
        )
        == expect
    )


AMP_EVENTS = ({"kind": "scaler_created", "enabled": True},)


@pytest.mark.parametrize(
    ("ops", "events", "expect"),
    [
        pytest.param(
            [op("fc", 64, 64, 64, dtype="float32", autocast="outside")],
            AMP_EVENTS,
            ["AMP-S05"],
            id="scaler-no-autocast",
        ),
        pytest.param(
            [op("fc", 64, 64, 64, dtype="float32", autocast="outside")], (), [], id="plain-fp32"
        ),
        pytest.param([op("fc", 64, 64, 64)], AMP_EVENTS, [], id="half"),
        pytest.param(
            [op("fc", 64, 64, 64, dtype="float32", autocast="outside")],
            ({"kind": "scaler_created", "enabled": False},),
            [],
            id="user-disabled-scaler",  # GradScaler(enabled=args.amp) with AMP off: fp32 run
        ),
        pytest.param(
            [
                op("fc", 64, 64, 64, flops=40.0),
                op("head", 64, 64, 64, dtype="float32", autocast="disabled", flops=60.0),
            ],
            ({"kind": "autocast_seen", "enabled": True, "dtype": "bfloat16"},),
            ["AMP-S05"],
            id="mostly-fp32",
        ),
    ],
)
def test_s05_cases(ops, events, expect):
    assert [i for i in ids(run_with(ops, events=events)) if i == "AMP-S05"] == expect


@pytest.mark.parametrize(
    "framework",
    [
        pytest.param({}, id="scaler-disabled-by-amprobe"),
        pytest.param(
            {
                "framework": "transformers",
                "framework_precision": "bf16",
                "framework_precision_setting": "TrainingArguments(bf16=True)",
                "framework_amp_dtype": "bfloat16",
            },
            id="framework-setting",
        ),
    ],
)
def test_s05_not_checked_on_the_forced_fp32_leg(framework):
    """`amprobe baseline`'s FP32 leg ran no autocast because amprobe turned it off: AMP-S05 is
    not checked there (it used to say AMP was ineffective, an error of amprobe's own making)."""
    ops = [op("fc", 64, 64, 64, dtype="float32", autocast="disabled")]
    events = ({"kind": "scaler_created", "enabled": False},)  # amprobe disabled it
    assert "AMP-S05" in ids(run_with(ops, events=AMP_EVENTS, manifest=framework))
    forced = run_with(ops, events=events, manifest={**framework, "forced_fp32": True})
    diagnosis = amprobe.diagnose(forced, only=["AMP-S05"])
    assert diagnosis.ids() == []
    assert [(n.id, n.reason) for n in diagnosis.not_checked] == [
        ("AMP-S05", "the FP32 leg of `amprobe baseline` (amprobe forced fp32)")
    ]


def test_s05_names_modules_and_reasons():
    ops = [
        op("enc", 64, 64, 64, flops=10.0),
        op("head", 64, 64, 64, dtype="float32", autocast="disabled", flops=60.0),
        op(
            "head",
            64,
            64,
            64,
            dtype="float32",
            autocast="backward",
            phase="backward",
            opname="mm",
            flops=60.0,
        ),
        op("loss", 64, 64, 64, dtype="float32", autocast="enabled", flops=30.0, opname="mm"),
    ]
    f = amprobe.diagnose(run_with(ops, events=AMP_EVENTS), only=["AMP-S05"]).findings[0]
    mods = {m["module"]: m for m in f.evidence["fp32_modules"]}
    assert mods["head"]["reason"].startswith("autocast disabled")
    assert mods["head"]["flop_share"] == pytest.approx(120 / 160)
    assert mods["loss"]["reason"].startswith("op on autocast's fp32 list")
    assert f.evidence["half_flop_share"] == pytest.approx(10 / 160)


def test_not_checked_without_compute_data():
    run = fake_run(
        steps=[{"step": 0, "wall_s": 0.1}], manifest={"config": {"collectors": ["scaler"]}}
    )
    reasons = {n.id: n.reason for n in amprobe.diagnose(run).not_checked}
    for rid in ("AMP-S02", "AMP-S04", "AMP-S05"):
        assert "compute collector was not enabled" in reasons[rid]


def test_peak_lookup_and_sources():
    assert lookup_peak("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert lookup_peak("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert lookup_peak("NVIDIA H200").name == "H200 SXM"
    assert lookup_peak("NVIDIA A100-SXM4-80GB").name == "A100"
    assert lookup_peak("NVIDIA A10").name == "A10"
    assert lookup_peak("NVIDIA L4").name == "L4"
    assert lookup_peak("NVIDIA L40S").name == "L40S"
    assert lookup_peak("Tesla V100-PCIE-16GB").name == "V100 PCIe"
    assert lookup_peak("Tesla T4").name == "T4"
    assert lookup_peak("NVIDIA GeForce RTX 4090").name == "GeForce RTX 4090"
    assert lookup_peak("NVIDIA GeForce RTX 3090 Ti").name == "GeForce RTX 3090 Ti"
    assert lookup_peak("cpu") is None and lookup_peak(None) is None
    assert all(p.source.startswith("NVIDIA") and "https://" in p.source for p in PEAKS)
    assert precision_of("float32", tf32=True) == "tf32" and precision_of("bfloat16") == "bf16"


def test_mfu_with_known_peak_excludes_captured_and_first_step():
    ops = [op("fc", 4096, 4096, 4096, flops=312e12 * 0.05)]  # 50 ms of ideal A100 bf16 time
    steps = [
        {"step": 0, "wall_s": 9.0},
        {"step": 1, "wall_s": 5.0},
        {"step": 2, "wall_s": 0.1},
        {"step": 3, "wall_s": 0.1},
    ]
    run = run_with(
        ops, steps=steps, manifest={"gpu_name": "NVIDIA A100-SXM4-40GB", "device": "cuda:0"}
    )
    mfu = compute_mfu(run)
    assert mfu["value"] == pytest.approx(0.5)
    assert mfu["step_s"] == pytest.approx(0.1)
    assert "A100" in mfu["peak_source"]
    health = amprobe.diagnose(run).health["mfu"]
    assert health["value"] == pytest.approx(0.5)


def test_mfu_unknown_device_reports_achieved():
    run = run_with([op("fc", 64, 64, 64, flops=1e9)])
    mfu = compute_mfu(run)
    assert mfu["value"] is None
    assert mfu["achieved_flops_per_s"] == pytest.approx(1e10)
    assert "MFU not available" in mfu["note"]


def test_alignment_frame_shares_and_suggestions():
    frame = alignment_frame(
        pd_ops([op("a", 64, 100, 64, flops=25.0), op("b", 64, 64, 64, flops=75.0)])
    )
    row = frame.set_index("module").loc["a"]
    assert row["misaligned"] == {"N": 100} and row["suggested"] == {"N": 104}
    assert row["flop_share"] == pytest.approx(0.25)
    assert bool(frame.set_index("module").loc["b", "aligned"])


def pd_ops(rows):
    return fake_run(tables={"compute_ops": rows}).table("compute_ops")


def test_op_table_sorted_by_share():
    table = make_op_table(
        pd_ops([op("a", 64, 100, 64, flops=25.0), op("b", 64, 64, 64, flops=75.0)])
    )
    assert list(table["module"]) == ["b", "a"]
    assert list(table["aligned?"]) == ["yes", "no"]
    assert table["suggested size"].iloc[1] == "100 -> 104"


def test_section_missing_and_present():
    empty = fake_run(steps=[{"step": 0}], manifest={"config": {"collectors": ["scaler"]}})
    sec = build_compute_section(empty, amprobe.diagnose(empty))
    assert sec.missing and "not enabled" in sec.missing
    run = run_with(
        [op("fc", 64, 100, 64), op("head", 64, 64, 64, dtype="float32", autocast="outside")]
    )
    sec = build_compute_section(run, amprobe.diagnose(run))
    assert sec.missing is None
    assert len(sec.figures) == 1 and {t.name for t in sec.figures[0].data} == {
        "bfloat16",
        "float32",
    }
    captions = [c for c, _ in sec.tables]
    assert captions[0].startswith("Executed") and "fp32" in captions[1]
    assert "MFU not available" in " ".join(sec.text)


def test_s04_judges_classes_of_equal_ranks_once_and_names_each_rank():
    """#33: AMP-S04 shares the findings of ranks with equal rows; a rank with other rows is
    judged on its own (rank 2 runs padded layers: aligned, no warning there)."""
    ops, steps = [], []
    for rank in range(4):
        fc, head = (100, 1008) if rank != 2 else (104, 1024)
        for row in (op("fc", 64, fc, 64), op("head", 64, head, 104)):
            ops.append({**row, "rank": rank})
        steps.append({**cstep(sum(o["flops"] for o in ops[-2:]), 1e6), "rank": rank})
    run = fake_run(
        steps=[{"step": s, "wall_s": 0.1, "rank": r} for r in range(4) for s in range(4)],
        events=[{"kind": "model_params", "trainable_params": 5_000_000, "params": 5_000_000}],
        manifest={"config": {"collectors": ["scaler", "compute"]}},
        ranks=range(4),
        tables={"compute_ops": ops, "compute_steps": steps},
    )
    warnings = [
        f
        for f in amprobe.diagnose(run, only=["AMP-S04"]).findings
        if f.id == "AMP-S04" and f.severity == "warning"
    ]
    (warning,) = warnings
    assert warning.evidence["ranks"] == [0, 1, 3]
    assert warning.title.endswith("fc (100 -> 104) on 3 of 4 ranks; not on rank 2")
