"""The probe never hurts the job: write failures, odd models, compiled models, eval loops."""

from __future__ import annotations

import copy
import errno
import json

import pytest
import torch
from torch import nn

import amprobe
import amprobe.store.writer as writer_module
from tests.helpers import TinyNet, train_loop


def _train(tmp_path, attach: bool, config=None, steps=12, dtype=torch.float16):
    torch.manual_seed(3)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    inf_at = (4,) if dtype == torch.float16 else ()
    if attach:
        with amprobe.attach(
            model=model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "run", config=config
        ):
            train_loop(model, opt, scaler, steps, dtype=dtype, inf_at=inf_at, clip="after_unscale")
    else:
        train_loop(model, opt, scaler, steps, dtype=dtype, inf_at=inf_at, clip="after_unscale")
    return copy.deepcopy(model.state_dict()), scaler.get_scale()


class _FullDisk:
    """Makes appends to record files fail with ENOSPC while ``full`` is set."""

    def __init__(self) -> None:
        self.full = True
        self.failures = 0

    def __call__(self, file, mode="r", *args, **kwargs):
        if self.full and "a" in mode:
            self.failures += 1
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return open(file, mode, *args, **kwargs)


def test_disk_full_mid_run_buffers_then_recovers(tmp_path, monkeypatch):
    plain, plain_scale = _train(tmp_path / "plain", attach=False)
    disk = _FullDisk()
    monkeypatch.setattr(writer_module, "open", disk, raising=False)
    torch.manual_seed(3)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    probe = amprobe.attach(
        model=model,
        optimizer=opt,
        scaler=scaler,
        run_dir=tmp_path / "run",
        config={"flush_every": 2},
    )
    train_loop(model, opt, scaler, 6, inf_at=(4,))
    assert disk.failures > 0, "the flushes met the full disk"
    disk.full = False  # space freed: buffered rows are written at the next flush
    train_loop(model, opt, scaler, 6, seed=1)
    probe.close()
    run = amprobe.load_run(tmp_path / "run")
    assert list(run.steps["step"]) == list(range(12)), "nothing was lost while the disk was full"
    assert not any("could not be written" in w for w in run.warnings)


def test_disk_full_beyond_budget_counts_what_was_lost(tmp_path, monkeypatch):
    disk = _FullDisk()
    monkeypatch.setattr(writer_module, "open", disk, raising=False)
    torch.manual_seed(3)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    probe = amprobe.attach(
        model=model,
        optimizer=opt,
        scaler=scaler,
        run_dir=tmp_path / "run",
        config={"flush_every": 1, "max_buffered_rows": 3},
    )
    train_loop(model, opt, scaler, 10)  # must not raise although nothing can be written
    disk.full = False
    probe.close()
    run = amprobe.load_run(tmp_path / "run")
    assert list(run.steps["step"]) == [7, 8, 9], "the newest rows within the budget survive"
    end = json.loads((tmp_path / "run" / "rank0" / "end.json").read_text())
    assert end["lost_rows"]["steps"] == 7 and end["lost_steps"] == [0, 6]
    assert any("7 steps record(s) could not be written (steps 0..6)" in w for w in run.warnings), (
        run.warnings
    )
    assert any("No space left" in e for e in end["write_errors"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_numerics_identical_with_every_collector_enabled(tmp_path, dtype):
    """fp16 with a planted overflow, and bf16: same weights and scale with every collector at
    full detail (per-layer statistics, shape capture and sync counting on every step)."""
    from amprobe.capture.collectors import REGISTRY

    every = tuple(name for name in REGISTRY if name != "prometheus")
    full = {
        "collectors": every,
        "flush_every": 3,
        "numerics_every": 1,
        "shapes_every": 1,
        "shapes_captures": 0,
        "syncs_every": 1,
    }
    plain, plain_scale = _train(tmp_path / "a", attach=False, dtype=dtype)
    probed, probed_scale = _train(tmp_path / "b", attach=True, config=full, dtype=dtype)
    assert plain_scale == probed_scale
    for name in plain:
        assert torch.equal(plain[name], probed[name]), name


class OddOutputs(nn.Module):
    """Returns a dict holding a tuple, None and a non-tensor, with a shared layer called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.shared(torch.relu(self.shared(x))))
        return {"pred": (self.out(h), None), "aux": None, "note": "text", "n": 3}


def test_odd_model_outputs_and_weight_sharing(tmp_path):
    from amprobe.capture.collectors import REGISTRY

    every = tuple(name for name in REGISTRY if name != "prometheus")
    torch.manual_seed(0)
    model = OddOutputs()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with amprobe.attach(
        model=model,
        optimizer=opt,
        scaler=scaler,
        run_dir=tmp_path / "r",
        config={"collectors": every},
    ):
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 16))["pred"][0].float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    run = amprobe.load_run(tmp_path / "r")
    assert len(run.steps) == 4
    assert run.events_of("collector_error") == []


def test_eval_loop_under_no_grad_does_not_count_as_steps(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "r"):
        train_loop(model, opt, scaler, 3)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            for _ in range(5):
                model(torch.randn(4, 16))
        train_loop(model, opt, scaler, 3)
    run = amprobe.load_run(tmp_path / "r")
    assert list(run.steps["step"]) == list(range(6))


def test_compiled_model_is_recorded_without_crash(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with amprobe.attach(model=compiled, optimizer=opt, scaler=scaler, run_dir=tmp_path / "r"):
        train_loop(compiled, opt, scaler, 3, dtype=torch.bfloat16)
    run = amprobe.load_run(tmp_path / "r")
    assert len(run.steps) == 3 and run.steps["loss"].notna().all()


@pytest.mark.parametrize("bad", ["not a dict", 5])
def test_bad_config_type(tmp_path, bad):
    with pytest.raises(amprobe.ConfigError):
        amprobe.attach(run_dir=tmp_path / "r", config=bad)


# -- how the program ended is recorded, never lost ---------------------------------------------
_CRASHING_SCRIPT = """
import os, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
if os.environ["MODE"] == "half":
    model = model.half()  # with a GradScaler: torch refuses to unscale fp16 gradients at step 0
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
dtype = torch.half if os.environ["MODE"] == "half" else torch.float
for i in range(10):
    if os.environ["MODE"] == "crash" and i == 3:
        raise RuntimeError("planted crash at 3")
    if os.environ["MODE"] == "ctrl-c" and i == 3:
        raise KeyboardInterrupt
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 8, dtype=dtype)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
"""


@pytest.mark.parametrize(
    ("mode", "code", "status", "steps", "reason"),
    [
        ("crash", 1, "failed", 3, "RuntimeError: planted crash at 3"),
        ("ctrl-c", 130, "interrupted", 3, "KeyboardInterrupt"),
        ("half", 1, "failed", 0, "ValueError: Attempting to unscale FP16 gradients."),
    ],
)
def test_zero_code_run_records_how_the_program_ended(tmp_path, mode, code, status, steps, reason):
    """A job that dies is not 'finished'; one that dies in its first step still leaves its run."""
    import os

    from tests.helpers import amprobe_cli

    (tmp_path / "train.py").write_text(_CRASHING_SCRIPT)
    os.environ["MODE"] = mode
    try:
        proc = amprobe_cli("run", "--out", "run", "--", "python", "train.py", cwd=tmp_path)
    finally:
        del os.environ["MODE"]
    assert proc.returncode == code, proc.stderr[-2000:]
    run = amprobe.load_run(tmp_path / "run")
    assert (run.status, run.end_reason, len(run.steps)) == (status, reason, steps)
    assert f"({status}: {reason})" in proc.stderr
    assert not [w for w in run.warnings if "abruptly" in w]
    if mode == "half":  # what the user most needs to hear: the fp16 master weights
        assert "AMP-N14" in amprobe.diagnose(run).ids()
        assert amprobe.diagnose(run).to_dict()["run"]["end_reason"] == reason


def test_context_manager_records_the_exception_that_left_it(tmp_path):
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ZeroDivisionError):
        with amprobe.attach(model, opt, scaler, run_dir=tmp_path / "run"):
            train_loop(model, opt, scaler, 2, dtype=torch.bfloat16)
            1 / 0  # noqa: B018
    run = amprobe.load_run(tmp_path / "run")
    assert (run.status, run.end_reason) == ("failed", "ZeroDivisionError: division by zero")
    with amprobe.attach(model, opt, scaler, run_dir=tmp_path / "ok"):
        train_loop(model, opt, scaler, 2, dtype=torch.bfloat16)
    assert (
        amprobe.load_run(tmp_path / "ok").status,
        amprobe.load_run(tmp_path / "ok").end_reason,
    ) == (
        "finished",
        None,
    )


def test_a_process_that_trains_nothing_still_leaves_no_run(tmp_path):
    from tests.helpers import amprobe_cli

    (tmp_path / "helper.py").write_text("import torch\nraise SystemExit(3)\n")
    proc = amprobe_cli("run", "--out", "run", "--", "python", "helper.py", cwd=tmp_path)
    assert proc.returncode == 3
    assert not (tmp_path / "run" / "rank0").exists()


@pytest.mark.parametrize(
    ("end", "status"),
    [
        ({"status": "finished"}, "finished"),
        ({"status": "failed", "reason": "RuntimeError: x"}, "failed"),
        ({"status": "interrupted", "reason": "SIGTERM"}, "interrupted"),
        ({"status": ["odd"]}, "finished"),  # a damaged field is not a status
        (None, "interrupted"),  # no end file and no live process: ended without closing
    ],
)
def test_status_of_a_rank(end, status):
    from amprobe.store.layout import status_of

    assert status_of({"hostname": "elsewhere-host"}, end) == status


def test_events_from_another_thread_are_never_lost_to_a_flush(tmp_path):
    """The control watcher records events from its own thread while the training thread
    flushes: an event appended while the flush hands over the list used to be dropped
    (5 of 20,000 here without the lock)."""
    import sys
    import threading

    probe = amprobe.attach(run_dir=tmp_path / "run", config={"collectors": ["scaler"]})
    n = 20_000

    def spam() -> None:
        for i in range(n):
            probe.event("tick", i=i)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        worker = threading.Thread(target=spam)
        worker.start()
        while worker.is_alive():
            probe.flush()
        worker.join()
    finally:
        sys.setswitchinterval(old)
        probe.close()
    ticks = amprobe.load_run(tmp_path / "run").events_of("tick")
    assert sorted(e["i"] for e in ticks) == list(range(n))
