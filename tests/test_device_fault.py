"""AMP-D06 device-fault: the known-answer GEMM (capture) and the rule that names the device.

The device is faked at the narrowest seams: :func:`devicecheck.run_gemm` (the one call that
runs the GEMM) returns a result with one wrong element, :func:`devicecheck.device_identity`
(NVML) returns a made-up UUID and PCI bus id, and ``devicecheck._now`` is a fake clock. The
known answer's exactness is computed for real on the CPU.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import amprobe
from amprobe.capture.collectors import devicecheck as dc
from amprobe.report.evidence import evidence_lines
from amprobe.rules.devicefault import HEALTHY_NOTE, device_check_note
from tests.helpers import TinyNet, fake_run, run_gloo_job, torchrun_argv, train_loop

ROOT = Path(__file__).resolve().parent.parent

FAKE_ID = {
    "device": "cuda:3",
    "gpu_name": "Fake GPU",
    "uuid": "GPU-0badc0de-0000-4000-8000-000000000003",
    "pci_bus_id": "00000000:3B:00.0",
    "serial": "1320221000003",
    "source": "nvml",
    "note": None,
}


def _wrong(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A device that gets one element of the product wrong."""
    out = torch.mm(a, b).clone()
    out[5, 7] += 1
    return out


@pytest.fixture
def fake_nvml(monkeypatch):
    monkeypatch.setattr(dc, "device_identity", lambda device: dict(FAKE_ID))


def _train(tmp_path: Path, steps: int = 4, name: str = "r", **config: Any) -> amprobe.Run:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    cfg = {"collectors": "scaler", "replay": "off", **config}
    with amprobe.attach(model, opt, scaler, run_dir=tmp_path / name, config=cfg):
        train_loop(model, opt, scaler, steps)
    return amprobe.load_run(tmp_path / name)


def _d06(run: amprobe.Run) -> list[amprobe.Finding]:
    return [f for f in amprobe.diagnose(run, only=["AMP-D06"]).findings if f.id == "AMP-D06"]


def _not_checked(run: amprobe.Run) -> str | None:
    return next((n.reason for n in amprobe.diagnose(run, only=["AMP-D06"]).not_checked), None)


# -- the known answer ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_known_answer_is_exact_in_the_dtype(dtype, device):
    known = dc.build_known_answer(device, dtype)
    a64, b64 = known.a.double(), known.b.double()
    assert set(a64.unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert set(b64.unique().tolist()) <= {-1.0, 0.0, 1.0}
    # every partial sum of the K products, in any order, is at most K in magnitude, and K is
    # within the integers the dtype holds exactly
    assert known.shape[1] == dc.K_DIM <= dc.EXACT_BOUND[dtype]
    partial = (a64[: dc.TILE, :, None] * b64[None, :, : dc.TILE]).cumsum(1).abs().max()
    assert partial <= dc.K_DIM
    exact = a64 @ b64
    with _fastest_cuda_math():  # TF32 and reduced-precision reductions allowed: still exact
        result = dc.run_gemm(known.a, known.b)  # computed for real, in the dtype
    assert result.dtype == dtype
    assert torch.equal(result.double(), exact)  # bit for bit the exact product
    assert int(known.mismatches(result)) == 0
    assert len(known.answer.unique()) > 20  # a varied answer, not a constant block
    wrong = _wrong(known.a, known.b)
    assert int(known.mismatches(wrong)) == 1
    assert int(known.mismatches(result[:-1])) == result.numel()  # a wrong shape: all wrong


@contextlib.contextmanager
def _fastest_cuda_math():
    matmul = torch.backends.cuda.matmul
    saved = (
        matmul.allow_tf32,
        matmul.allow_fp16_reduced_precision_reduction,
        matmul.allow_bf16_reduced_precision_reduction,
    )
    matmul.allow_tf32 = True
    matmul.allow_fp16_reduced_precision_reduction = True
    matmul.allow_bf16_reduced_precision_reduction = True
    try:
        yield
    finally:
        (
            matmul.allow_tf32,
            matmul.allow_fp16_reduced_precision_reduction,
            matmul.allow_bf16_reduced_precision_reduction,
        ) = saved


# -- capture ------------------------------------------------------------------------------------
def test_checks_every_n_minutes_on_a_faked_clock(tmp_path, fake_nvml, monkeypatch):
    # one clock read per step boundary, 20 s apart: every 1 min = steps 0, 3, 6, 9
    monkeypatch.setattr(dc, "_now", itertools.count(0.0, 20.0).__next__)
    run = _train(tmp_path, steps=10, device_check_minutes=1.0)
    checks = run.events_of("device_check")
    assert [e["step"] for e in checks] == [0, 3, 6, 9]
    assert {e["mismatches"] for e in checks} == {0}
    assert {e["dtype"] for e in checks} == {"float16"}  # the job's autocast dtype
    assert {e["precision"] for e in checks} == {"autocast"}
    assert checks[0]["shape"] == [256, dc.K_DIM, 256]
    (identity,) = run.events_of("device_identity")  # once per rank
    assert identity["uuid"] == FAKE_ID["uuid"]
    assert "devicecheck" in run.rank_manifest["config"]["collectors"]  # added by its period


def test_wrong_answer_names_the_rank_and_device(tmp_path, fake_nvml, monkeypatch):
    calls = itertools.count()
    # the device answers right at the first check (step 0) and wrong from the second (step 2)
    monkeypatch.setattr(
        dc, "run_gemm", lambda a, b: torch.mm(a, b) if next(calls) == 0 else _wrong(a, b)
    )
    monkeypatch.setattr(dc, "_now", itertools.count(0.0, 30.0).__next__)
    run = _train(tmp_path, steps=6, device_check_minutes=1.0)
    assert [e["mismatches"] for e in run.events_of("device_check")] == [0, 1, 1]
    (finding,) = _d06(run)
    assert finding.severity == "error" and finding.name == "device-fault"
    host = socket.gethostname()
    assert finding.evidence["faults"] == [
        {
            "rank": 0,
            "hostname": host,
            "device": "cuda:3",
            "uuid": FAKE_ID["uuid"],
            "pci_bus_id": FAKE_ID["pci_bus_id"],
            "step": 2,
            "mismatches": 1,
        }
    ]
    for word in ("rank 0", host, "cuda:3", FAKE_ID["uuid"], FAKE_ID["pci_bus_id"], "step 2"):
        assert word in finding.title, word
    assert "1 of 65,536 elements" in finding.title
    assert "Drain" in finding.fix and FAKE_ID["uuid"] in finding.fix
    assert HEALTHY_NOTE in finding.evidence["checked"]
    lines = evidence_lines(finding)
    assert "faults:" in lines  # a small table, not a dict
    assert any(FAKE_ID["pci_bus_id"] in line and "|" in line for line in lines)
    assert not any("{" in line for line in lines)
    assert any(HEALTHY_NOTE in line for line in lines)  # shown whole, not cut


def test_right_answer_gives_no_d06_and_counts_as_checked(tmp_path, fake_nvml):
    run = _train(tmp_path, steps=3, device_check_minutes=1e-9)  # every boundary
    assert [e["step"] for e in run.events_of("device_check")] == [0, 1, 2]
    assert _d06(run) == []
    assert _not_checked(run) is None
    note = device_check_note(run) or ""  # what a pass covered, and what it does not prove
    assert note.startswith("3 known-answer fp16 GEMM(s) (256 x 256 x 256, every 1e-09 min)")
    assert note.endswith(HEALTHY_NOTE)


def test_the_check_makes_no_host_device_sync_and_is_read_at_flush(tmp_path, fake_nvml, monkeypatch):
    """On the CPU the count stays a tensor until the flush: no ``.item()`` (the op every
    read of a device value to the host goes through) in the check."""
    seen: list[str] = []
    pending: list[list[Any]] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    check = dc.DeviceCheckCollector._check

    def observed(self, step, device):
        with Ops():
            check(self, step, device)
        pending.append([type(count) for _, _, count in self._pending])

    monkeypatch.setattr(dc.DeviceCheckCollector, "_check", observed)
    run = _train(tmp_path, steps=3, device_check_minutes=1e-9, flush_every=100)
    assert "aten.mm.default" in seen  # the mode saw the check's ops
    syncs = {"aten._local_scalar_dense.default", "aten.item.default", "aten.equal.default"}
    assert not syncs & set(seen)
    assert pending == [[torch.Tensor], [torch.Tensor] * 2, [torch.Tensor] * 3]
    assert [e["mismatches"] for e in run.events_of("device_check")] == [0, 0, 0]


def test_losses_bit_identical_with_the_check_on_and_off(tmp_path, fake_nvml):
    results = []
    for minutes in (1e-9, 0):
        torch.manual_seed(0)
        model = TinyNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        cfg = {"collectors": "scaler", "replay": "off", "device_check_minutes": minutes}
        with amprobe.attach(model, opt, scaler, run_dir=tmp_path / f"m{minutes}", config=cfg):
            losses = train_loop(model, opt, scaler, 6)
        rng = torch.get_rng_state()
        results.append((losses, [p.detach().clone() for p in model.parameters()], rng))
        checks = amprobe.load_run(tmp_path / f"m{minutes}").events_of("device_check")
        assert len(checks) == (6 if minutes else 0)
    (on_loss, on_params, on_rng), (off_loss, off_params, off_rng) = results
    assert on_loss == off_loss
    assert all(torch.equal(a, b) for a, b in zip(on_params, off_params, strict=True))
    assert torch.equal(on_rng, off_rng)  # the check draws no random numbers


def test_runs_outside_autocast_and_restores_it(tmp_path, fake_nvml, monkeypatch):
    states: list[bool] = []

    def gemm(a, b):
        states.append(torch.is_autocast_enabled("cpu"))
        return torch.mm(a, b)

    monkeypatch.setattr(dc, "run_gemm", gemm)
    model = TinyNet().to(torch.bfloat16)  # no autocast: the parameters' dtype is the job's
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = {
        "collectors": "scaler",
        "replay": "off",
        "device_check_minutes": 1e-9,
        "details_every": 1,  # (autocast regions are seen on detail steps)
    }
    after: list[bool] = []
    with amprobe.attach(model, opt, run_dir=tmp_path / "r", config=cfg):
        for inside in (False, True):
            loss = model(torch.randn(8, 16, dtype=torch.bfloat16)).float().pow(2).mean()
            loss.backward()
            # the second boundary inside an fp16 autocast region (the job's, from then on)
            with torch.autocast("cpu", dtype=torch.float16, enabled=inside):
                opt.step()
                after.append(torch.is_autocast_enabled("cpu"))
            opt.zero_grad()
    assert states == [False, False] and after == [False, True]
    assert torch.is_grad_enabled()  # its no_grad ended with it
    checks = amprobe.load_run(tmp_path / "r").events_of("device_check")
    assert [(e["dtype"], e["precision"]) for e in checks] == [
        ("bfloat16", "parameters"),  # no autocast yet: the parameters' dtype
        ("float16", "autocast"),
    ]


def test_waits_for_a_boundary_outside_compiled_regions_and_graph_captures(
    tmp_path, fake_nvml, monkeypatch
):
    waits = iter([True, True, False, False])  # the first two boundaries are inside one
    monkeypatch.setattr(dc, "_must_wait", lambda device: next(waits))
    run = _train(tmp_path, steps=4, device_check_minutes=1e-9)
    assert [e["step"] for e in run.events_of("device_check")] == [2, 3]


def test_a_failing_check_is_one_event_and_never_reaches_the_loop(tmp_path, fake_nvml, monkeypatch):
    def broken(a, b):
        raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")

    monkeypatch.setattr(dc, "run_gemm", broken)
    run = _train(tmp_path, steps=4, device_check_minutes=1e-9)
    (error,) = run.events_of("device_check_error")
    assert "CUBLAS_STATUS_EXECUTION_FAILED" in error["error"]
    assert len(run.table("steps")) == 4  # training went on
    reason = _not_checked(run)
    assert reason is not None and "the check failed" in reason and "CUBLAS" in reason


# -- not checked, with the true reason ------------------------------------------------------------
def test_off_on_the_cpu_by_default_and_when_asked(tmp_path, fake_nvml):
    default = _train(tmp_path, steps=2, name="default", collectors="scaler,devicecheck")
    assert default.events_of("device_check") == []
    assert "runs on the CPU" in (_not_checked(default) or "")
    off = _train(
        tmp_path, steps=2, name="off", collectors="scaler,devicecheck", device_check_minutes=0
    )
    assert "device_check_minutes=0" in (_not_checked(off) or "")
    absent = _train(tmp_path, steps=2, name="absent")
    assert "not among the run's collectors" in (_not_checked(absent) or "")


def test_rule_reasons_and_several_faulty_ranks_on_hand_built_runs():
    config = {"config": {"device_check_minutes": None, "collectors": ["scaler", "devicecheck"]}}
    never = fake_run(manifest=config)
    assert "never ran" in (_not_checked(never) or "")
    old = fake_run(manifest={"config": {"collectors": ["scaler"]}})
    assert "without the known-answer device check" in (_not_checked(old) or "")
    check = {"kind": "device_check", "dtype": "bfloat16", "shape": [2048, 256, 2048]}
    events = [
        {**check, "rank": r, "step": s, "mismatches": n, "elements": 2048 * 2048}
        for r, s, n in [(0, 0, 0), (1, 0, 0), (2, 0, 3), (3, 0, 0), (0, 9, 0), (1, 9, 7), (2, 9, 0)]
    ]
    events += [
        {"kind": "device_identity", "rank": r, "device": f"cuda:{r}", "uuid": f"GPU-{r}"}
        for r in range(3)
    ]
    run = fake_run(events=events, manifest=config, ranks=range(4))
    (finding,) = _d06(run)
    faults = finding.evidence["faults"]
    assert [(f["rank"], f["step"], f["mismatches"]) for f in faults] == [(1, 9, 7), (2, 0, 3)]
    assert faults[0]["pci_bus_id"] is None  # not recorded: said, never guessed
    assert faults[0]["device"] == "cuda:1" and faults[1]["uuid"] == "GPU-2"
    assert finding.evidence["ranks"] == [1, 2]
    assert "2 ranks' devices" in finding.title and "PCI bus id not recorded" in finding.title
    assert finding.evidence["failed_check_count"] == 2 and finding.evidence["check_count"] == 7
    assert "7 known-answer bf16 GEMM(s)" in finding.evidence["checked"]
    # a rank that ran no check is never counted as fine: with no fault elsewhere, not checked
    partial = [
        {**check, "rank": 0, "step": 0, "mismatches": 0, "elements": 4},
        {"kind": "device_check_error", "rank": 1, "error": "RuntimeError: CUDA error"},
    ]
    reason = _not_checked(fake_run(events=partial, manifest=config, ranks=[0, 1])) or ""
    assert reason.startswith("checked and answered right on rank 0 only; not on rank 1:")
    assert "the check failed on rank 1: RuntimeError: CUDA error" in reason
    # a fault found on one rank is reported even though another rank was not checked
    partial[0]["mismatches"] = 2
    (finding,) = _d06(fake_run(events=partial, manifest=config, ranks=[0, 1]))
    assert "not checked on rank 1" in finding.evidence["checked"]


# -- configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, "30", True, float("nan"), float("inf")])
def test_config_rejects_a_bad_period_in_one_line(bad):
    with pytest.raises(amprobe.ConfigError, match="device_check_minutes") as err:
        amprobe.Config(device_check_minutes=bad)
    assert "\n" not in str(err.value)


def test_config_period_values():
    assert "devicecheck" in amprobe.Config().collectors  # on by default (off on the CPU)
    assert "devicecheck" not in amprobe.Config(collectors="scaler").collectors
    assert "devicecheck" in amprobe.Config(collectors="scaler", device_check_minutes=5).collectors
    assert (
        "devicecheck" not in amprobe.Config(collectors="scaler", device_check_minutes=0).collectors
    )
    assert amprobe.Config(device_check_minutes=0.5).device_check_minutes == 0.5


# -- two ranks ------------------------------------------------------------------------------------
def test_two_gloo_ranks_name_the_faulty_rank_not_rank_0(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(out), "FAULTY_RANK": "1"}
    proc = run_gloo_job(
        torchrun_argv("devicefault_gloo.py"), out, cwd=tmp_path, env=env, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = amprobe.load_run(out)
    by_rank = {
        r: [e["mismatches"] for e in run.events_of("device_check") if e["rank"] == r]
        for r in (0, 1)
    }
    assert by_rank == {0: [0, 0, 0, 0], 1: [1, 1, 1, 1]}
    (finding,) = _d06(run)
    assert [f["rank"] for f in finding.evidence["faults"]] == [1]
    fault = finding.evidence["faults"][0]
    assert (fault["uuid"], fault["pci_bus_id"], fault["step"]) == (
        "GPU-fake-1",
        "00000000:3C:00.0",
        0,
    )
    assert "rank 1 (" in finding.title and "GPU-fake-1" in finding.title
    assert "rank 0" not in finding.title and "GPU-fake-0" not in finding.title


# -- on a GPU, as it runs (skipped without CUDA) ---------------------------------------------------
@pytest.mark.cuda
def test_on_cuda_the_default_checks_with_the_real_identity(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    results = []
    for minutes in (None, 0):  # None: on by default on an accelerator
        torch.manual_seed(0)
        model = TinyNet().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cuda")
        cfg = {"collectors": "scaler,devicecheck", "device_check_minutes": minutes}
        losses = []
        with amprobe.attach(model, opt, scaler, run_dir=tmp_path / f"m{minutes}", config=cfg):
            g = torch.Generator(device="cuda").manual_seed(0)
            for _ in range(4):
                x = torch.randn(8, 16, device="cuda", generator=g)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                losses.append(loss.detach())
        results.append(torch.stack(losses).cpu())
        run = amprobe.load_run(tmp_path / f"m{minutes}")
        checks = run.events_of("device_check")
        if minutes is None:
            assert [(e["step"], e["mismatches"], e["dtype"]) for e in checks] == [
                (0, 0, "bfloat16")
            ]
            assert checks[0]["shape"] == [2048, dc.K_DIM, 2048]
            (identity,) = run.events_of("device_identity")
            assert str(identity["uuid"]).startswith(("GPU-", "MIG-")), identity
            assert identity["pci_bus_id"], identity
            assert _d06(run) == [] and _not_checked(run) is None
        else:
            assert checks == [] and "device_check_minutes=0" in (_not_checked(run) or "")
    assert torch.equal(results[0], results[1])  # bit-identical with the check on and off


# -- the device's identity (NVML faked as a module; torch's device properties faked) ----------------
class _Props:
    name = "NVIDIA H100 80GB HBM3"
    uuid = "5e1c1a2b-77d1-4c1e-9a61-0d2f3c4b5a61"
    pci_domain_id = 0
    pci_bus_id = 0x3B
    pci_device_id = 0


def _fake_pynvml(calls: list[str]) -> Any:
    import types

    def handle_by_uuid(uuid: str) -> str:
        calls.append(f"uuid {uuid}")
        return "h"

    return types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByUUID=handle_by_uuid,
        nvmlDeviceGetHandleByIndex=lambda i: "h",
        nvmlDeviceGetUUID=lambda h: b"GPU-5e1c1a2b-77d1-4c1e-9a61-0d2f3c4b5a61",
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=b"00000000:3B:00.0"),
        nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetSerial=lambda h: b"1320221000003",
    )


def test_identity_from_nvml_and_from_torch_without_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _Props())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(calls))
    got = dc.device_identity(torch.device("cuda", 0))
    assert got == {
        "device": "cuda:0",
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "uuid": "GPU-5e1c1a2b-77d1-4c1e-9a61-0d2f3c4b5a61",
        "pci_bus_id": "00000000:3B:00.0",
        "serial": "1320221000003",
        "source": "nvml",
        "note": None,
    }
    # the handle found by the CUDA UUID (not by an index that CUDA_VISIBLE_DEVICES renumbers)
    assert calls == ["init", "uuid GPU-5e1c1a2b-77d1-4c1e-9a61-0d2f3c4b5a61", "shutdown"]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: torch's properties
    got = dc.device_identity(torch.device("cuda"))
    assert (got["uuid"], got["pci_bus_id"], got["source"]) == (
        "GPU-5e1c1a2b-77d1-4c1e-9a61-0d2f3c4b5a61",
        "00000000:3B:00.0",  # torch's PCI ids written as NVML writes them
        "torch",
    )
    assert got["note"].startswith("NVML not read: pynvml cannot be imported")
