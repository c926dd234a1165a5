"""Dormant probes, recording windows, `amprobe attach`/`detach` and attaching to a live process."""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import amprobe
from amprobe.capture.collectors import REGISTRY, Collector
from amprobe.capture.discovery import find_live_training_objects, find_root_modules
from amprobe.cli import main as cli_main
from amprobe.control.remote import (
    build_remote_script,
    remote_exec_disabled,
    remote_exec_unsupported,
)
from amprobe.control.sender import ControlError, send_control
from tests.helpers import amprobe_cli

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_dormant.py"
PACKAGE_PARENT = str(Path(amprobe.__file__).resolve().parent.parent)
#: The subprocess job's own bound (it trains until the test's stop file appears): longer than
#: the test's deadlines add up to, so a loaded machine does not end the job before its detach.
TRAIN_FOR_S = 900


def _train_module():
    spec = importlib.util.spec_from_file_location("train_dormant", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cli(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return amprobe_cli(*args, cwd=cwd, timeout=timeout)


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


#: Deadlines of the subprocess job's conditions: generous, as a loaded machine (load 7-10 on 2
#: cores) delays the job's start (importing torch), its steps and the CLI alike.
JOB_WAIT_S = 120


def _windows_recorded(run_dir: Path) -> set[int]:
    """The recording windows of the step records on disk so far (a line being written is
    skipped)."""
    windows = set()
    try:
        lines = (run_dir / "rank0" / "steps.jsonl").read_text().splitlines()
    except OSError:
        return windows
    for line in lines:
        try:
            windows.add(json.loads(line).get("window"))
        except ValueError:
            continue
    return windows


def _ack(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "rank0" / "control_ack.json").read_text())
    except (OSError, ValueError):
        return {}


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the uninstrumented run"


def test_dormant_job_attach_window_detach(tmp_path, capsys):
    run_dir, weights, stop = tmp_path / "run", tmp_path / "w.pt", tmp_path / "stop"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "amprobe",
            "run",
            "--dormant",
            "--set",
            "control_poll_s=0.1",
            "--set",
            "flush_every=1",  # each step on disk at once, for the wait on window 2
            "--out",
            str(run_dir),
            "--",
            sys.executable,
            str(SCRIPT),
            str(weights),
            str(stop),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": PACKAGE_PARENT,
            "TRAIN_DORMANT_MAX_S": str(TRAIN_FOR_S),
        },
    )
    try:
        _wait_for(
            lambda: _ack(run_dir).get("pid"), JOB_WAIT_S, "the dormant rank to announce itself"
        )
        assert not (run_dir / "rank0" / "steps.jsonl").exists(), "a dormant probe recorded steps"

        wait = str(JOB_WAIT_S)
        first = _cli(
            "attach", str(run_dir), "--steps", "10", "--wait", wait, cwd=tmp_path, timeout=300
        )
        assert first.returncode == 0, first.stderr
        assert "recording from step" in first.stdout and "window 1" in first.stdout
        _wait_for(
            lambda: _ack(run_dir).get("window") == 1 and not _ack(run_dir).get("recording"),
            JOB_WAIT_S,
            "the 10-step window to close",
        )

        assert cli_main(["attach", str(run_dir), "--wait", wait]) == 0  # the same, in-process
        assert "window 2" in capsys.readouterr().out
        _wait_for(lambda: 2 in _windows_recorded(run_dir), JOB_WAIT_S, "window 2's first step")
        assert cli_main(["detach", str(run_dir), "--wait", wait]) == 0
        assert "stopped recording" in capsys.readouterr().out
        stop.touch()
        job.wait(timeout=JOB_WAIT_S)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, job.stderr

    run = amprobe.load_run(run_dir)
    assert run.status == "finished"
    steps = run.steps
    assert set(steps["window"]) == {1, 2}
    w1, w2 = steps[steps["window"] == 1], steps[steps["window"] == 2]
    assert len(w1) == 10
    assert list(w1["step"]) == list(range(int(w1["step"].min()), int(w1["step"].min()) + 10))
    assert int(w1["step"].min()) > 0 and int(w2["step"].min()) > int(w1["step"].max())
    assert list(w2["step"]) == list(range(int(w2["step"].min()), int(w2["step"].max()) + 1))
    # scaler data, and true iteration numbers: the script plants an inf when i % 7 == 3
    assert (
        steps["scale_before"].notna().all() and steps.loc[~steps["skipped"], "loss"].notna().all()
    )
    assert set(steps.loc[steps["skipped"], "step"] % 7) == {3}
    assert (steps["skipped"] == (steps["step"] % 7 == 3)).all()
    starts, ends = run.events_of("window_start"), run.events_of("window_end")
    assert [e["window"] for e in starts] == [1, 2] and [e["window"] for e in ends] == [1, 2]
    assert ends[0]["reason"] == "steps" and ends[0]["steps"] == 10 and ends[1]["reason"] == "detach"
    assert starts[0]["first_step"] == int(w1["step"].min())
    assert run.events_of("model_registered"), "the live model was found when recording started"
    assert not run.events_of("collector_error")
    # diagnosed like any other run: the planted overflows are found
    assert "AMP-N01" in amprobe.diagnose(run).ids()

    saved = torch.load(weights)
    reference = tmp_path / "ref.pt"
    _train_module().main(str(reference), str(stop), saved["steps"])
    _assert_same_weights(saved["state"], torch.load(reference)["state"])


def test_live_attach_to_a_loop_running_in_a_thread(tmp_path):
    """The in-process part of `attach --pid`: the generated script, run while training runs."""
    train = _train_module()
    weights, stop, run_dir = tmp_path / "w.pt", tmp_path / "stop", tmp_path / "live"
    worker = threading.Thread(target=train.main, args=(str(weights), str(stop)))
    worker.start()
    try:
        _wait_for(
            lambda: any(
                isinstance(o, torch.amp.GradScaler) for o in find_live_training_objects().scalers
            ),
            20,
            "the training thread to build its scaler",
        )
        time.sleep(0.2)  # a few steps in
        status = tmp_path / "status.json"
        script = tmp_path / "attach.py"
        script.write_text(build_remote_script(run_dir, 6, status))
        runpy.run_path(str(script))  # what sys.remote_exec runs in the target's main thread
        outcome = json.loads(status.read_text())
        assert outcome["ok"], outcome
        # objects left alive by earlier tests in this process may be found too: the training
        # thread's own model, optimizer and scaler must be among them
        assert (
            any(m.startswith("Sequential") for m in outcome["models"])
            and "SGD" in outcome["optimizers"]
        )
        assert outcome["scalers"] >= 1
        probe = amprobe.current_probe()
        _wait_for(
            lambda: probe.window == 1 and not probe.recording, 20, "the 6-step window to close"
        )
    finally:
        stop.touch()
        worker.join(timeout=60)
    amprobe.current_probe().close()
    run = amprobe.load_run(run_dir)
    assert run.rank_manifest["attached_live"] is True
    assert len(run.steps) == 6 and set(run.steps["window"]) == {1}
    assert int(run.steps["step"].min()) >= 1, "recording starts at the step after the attach"
    assert run.steps["scale_before"].notna().all()
    assert (run.steps["opt_steps"] == (~run.steps["skipped"]).astype(int)).all()
    assert run.rank_manifest["steps_counted_from"] == "attach"
    # every live root is registered (objects earlier tests left alive may come first)
    assert "Sequential" in {e["model_class"] for e in run.events_of("model_registered")}
    saved = torch.load(weights)
    reference = tmp_path / "ref.pt"
    train.main(str(reference), str(stop), saved["steps"])
    _assert_same_weights(saved["state"], torch.load(reference)["state"])


def test_failed_live_attach_leaves_the_program_untouched(tmp_path):
    status, script = tmp_path / "status.json", tmp_path / "attach.py"
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the run directory should go")
    code = f"""
import json, runpy, sys, torch
update = torch.amp.GradScaler.update
runpy.run_path({str(script)!r})  # nothing is trained yet
first = json.load(open({str(status)!r}))
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
script = open({str(script)!r}).read().replace({str(tmp_path / "out")!r}, {str(blocked)!r})
exec(compile(script, "attach", "exec"), {{}})  # an unusable run directory
second = json.load(open({str(status)!r}))
import amprobe
assert amprobe.current_probe() is None and torch.amp.GradScaler.update is update
print(json.dumps([first, second]))
sys.exit(7)
"""
    script.write_text(build_remote_script(tmp_path / "out", None, status))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": PACKAGE_PARENT},
    )
    assert proc.returncode == 7, proc.stderr
    first, second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not first["ok"] and "no torch.optim.Optimizer" in first["error"]
    assert not second["ok"] and "not a directory" in second["error"]


class _Recorder(Collector):
    name = "recorder"
    calls: list = []

    def on_recording(self, active):
        _Recorder.calls.append(("recording", active, self.probe.step))

    def on_step_end(self, step, record, facts):
        _Recorder.calls.append(("step", step))


def _loop(model, opt, n):
    for _ in range(n):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_windows_through_the_api_and_collector_contract(tmp_path, monkeypatch):
    monkeypatch.setitem(REGISTRY, "recorder", _Recorder)
    _Recorder.calls = []
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = amprobe.attach(
        model=model,
        optimizer=opt,
        run_dir=tmp_path / "r",
        config={"dormant": True, "collectors": ("scaler", "recorder")},
    )
    _loop(model, opt, 3)
    assert probe.step == 3 and not probe.recording and _Recorder.calls == []
    probe.start_recording(steps=2)
    assert not probe.recording, "requests wait for a step boundary"
    _loop(model, opt, 4)  # the boundary after step 3 starts; 4 and 5 are recorded
    probe.start_recording()
    _loop(model, opt, 2)  # step 7 ends and starts window 2; 8 is recorded
    probe.stop_recording()
    _loop(model, opt, 2)  # the step in progress (9) is recorded, then recording stops
    probe.close()
    assert _Recorder.calls == [
        ("recording", True, 4),
        ("step", 4),
        ("step", 5),
        ("recording", False, 6),
        ("recording", True, 8),
        ("step", 8),
        ("step", 9),
        ("recording", False, 10),
    ]
    run = amprobe.load_run(tmp_path / "r")
    assert list(run.steps["step"]) == [4, 5, 8, 9] and list(run.steps["window"]) == [1, 1, 2, 2]
    assert run.steps["opt_steps"].eq(1).all()
    with pytest.raises(amprobe.ConfigError, match="steps"):
        probe.start_recording(steps=0)


def test_find_root_modules_prefers_the_trained_container():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
            self.frozen = nn.Linear(4, 4)

    model, ema, other = Wrapper(), nn.Linear(4, 2), nn.Linear(3, 3)
    opt = torch.optim.SGD(model.body.parameters(), lr=0.1)
    modules = [other, ema, *model.modules()]
    assert find_root_modules([opt], modules) == [model]
    assert find_root_modules([], modules) == []
    live = find_live_training_objects()
    assert opt in live.optimizers and model in live.models and ema not in live.models


def test_cli_errors_are_one_line(tmp_path, capsys):
    def error(*args):
        assert cli_main(list(args)) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err
        return err

    assert "no such run directory" in error("attach", str(tmp_path / "missing"))
    recorded = tmp_path / "recorded"
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amprobe.attach(model=model, optimizer=opt, run_dir=recorded):
        _loop(model, opt, 2)
    assert "not started with --dormant" in error("attach", str(recorded))
    dormant = tmp_path / "dormant"
    with amprobe.attach(model=model, optimizer=opt, run_dir=dormant, config={"dormant": True}):
        _loop(model, opt, 2)
    assert "not live: its process finished" in error("detach", str(dormant))
    with pytest.raises(ControlError, match="not live"):
        send_control(dormant, "attach")
    assert "--out" in error("attach", "--pid", str(os.getpid()))
    if remote_exec_unsupported():
        err = error("attach", "--pid", str(os.getpid()), "--out", str(tmp_path / "x"))
        assert "3.14" in err and "amprobe run --dormant" in err


@pytest.mark.parametrize("how", ["env", "xoption"])
def test_remote_exec_disabled_is_detected(how):
    env = dict(os.environ)
    args = [sys.executable]
    if how == "env":
        env["PYTHON_DISABLE_REMOTE_DEBUG"] = "1"
    else:
        args += ["-X", "disable-remote-debug"]
    target = subprocess.Popen([*args, "-c", "import time; time.sleep(30)"], env=env)
    try:
        reason = _wait_for(lambda: remote_exec_disabled(target.pid), 5, "the reason")
        assert "disabled remote execution" in reason and "amprobe run --dormant" in reason
    finally:
        target.kill()
        target.wait()
    assert remote_exec_disabled(os.getpid()) is None


def _python314() -> str | None:
    candidates = [shutil.which(f"python3.{minor}") for minor in range(14, 20)]
    root = Path("/root/.pyenv/versions")
    if root.is_dir():
        candidates += [
            str(p / "bin" / "python")
            for p in sorted(root.iterdir())
            if p.name.split(".")[:2] >= ["3", "14"]
            and p.name.split(".")[1].isdigit()
            and int(p.name.split(".")[1]) >= 14
        ]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            probe = subprocess.run(
                [candidate, "-c", "import sys, torch; print(hasattr(sys, 'remote_exec'))"],
                capture_output=True,
                text=True,
            )
            if probe.stdout.strip() == "True":
                return candidate
    return None


def test_remote_attach_needs_python_314(tmp_path):
    python = _python314()
    if python is None:
        pytest.skip(
            "no CPython >= 3.14 with torch installed on this machine: sys.remote_exec (PEP 768) "
            "cannot be exercised; the in-process part is tested above"
        )
    weights, stop, out = tmp_path / "w.pt", tmp_path / "stop", tmp_path / "rescue"
    target = subprocess.Popen(
        [python, str(SCRIPT), str(weights), str(stop)],
        env={**os.environ, "PYTHONPATH": PACKAGE_PARENT},
    )
    try:
        time.sleep(2)
        attached = subprocess.run(
            [
                python,
                "-m",
                "amprobe",
                "attach",
                "--pid",
                str(target.pid),
                "--out",
                str(out),
                "--steps",
                "5",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": PACKAGE_PARENT},
        )
        assert attached.returncode == 0, attached.stderr
        _wait_for(lambda: (out / "rank0" / "steps.jsonl").exists(), 20, "the window to flush")
    finally:
        stop.touch()
        target.wait(timeout=60)
    assert target.returncode == 0
    assert len(amprobe.load_run(out).steps) == 5


class _OwnScaler(torch.amp.GradScaler):
    """A subclass with its own scale/update (as ShardedGradScaler), not passed to attach."""

    def scale(self, outputs):
        return super().scale(outputs)

    def update(self, new_scale=None):
        return super().update(new_scale)


def test_dormant_installs_only_the_step_boundary(tmp_path):
    from torch.amp.autocast_mode import autocast

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = _OwnScaler("cpu")  # created before attach, seen at its first step
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    torch_own = {
        "autocast.__enter__": autocast.__dict__["__enter__"],
        "autocast.__exit__": autocast.__dict__["__exit__"],
        "backward": torch.autograd.backward,
        "GradScaler.scale": torch.amp.GradScaler.__dict__["scale"],
        "_OwnScaler.scale": _OwnScaler.__dict__["scale"],
    }
    own_update = torch.amp.GradScaler.__dict__["update"], _OwnScaler.__dict__["update"]

    def current():
        return {
            "autocast.__enter__": autocast.__dict__["__enter__"],
            "autocast.__exit__": autocast.__dict__["__exit__"],
            "backward": torch.autograd.backward,
            "GradScaler.scale": torch.amp.GradScaler.__dict__["scale"],
            "_OwnScaler.scale": _OwnScaler.__dict__["scale"],
        }

    def loop(n):
        for _ in range(n):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

    probe = amprobe.attach(model=model, run_dir=tmp_path / "r", config={"dormant": True})
    try:
        assert current() == torch_own
        assert not model._forward_pre_hooks and not model._forward_hooks
        boundary = torch.amp.GradScaler.__dict__["update"]
        loop(3)
        assert probe.step == 3, "dormant steps are counted at the scaler's update()"
        assert torch.amp.GradScaler.__dict__["update"] is boundary
        assert _OwnScaler.__dict__["update"] is not boundary, "the subclass's update is hooked"
        assert current() == torch_own, "nothing per-step is installed while dormant"
        for window in (1, 2):
            probe.start_recording(steps=2)
            loop(1)  # the boundary that opens the window
            assert probe.recording
            wrapped = current()
            assert all(wrapped[k] is not torch_own[k] for k in torch_own), wrapped
            assert model._forward_pre_hooks and model._forward_hooks
            loop(2)
            assert not probe.recording
            assert current() == torch_own, f"window {window}: removed when it closed"
            assert not model._forward_pre_hooks and not model._forward_hooks
        loop(2)
        assert probe.step == 3 + 2 * 3 + 2
    finally:
        probe.close()
    assert current() == torch_own
    assert (torch.amp.GradScaler.__dict__["update"], _OwnScaler.__dict__["update"]) == own_update
    run = amprobe.load_run(tmp_path / "r")
    assert list(run.steps["step"]) == [4, 5, 7, 8]
    assert list(run.steps["window"]) == [1, 1, 2, 2]
    # the first step of each window is complete: its loss and its scale
    assert run.steps["loss"].notna().all() and run.steps["scale_after"].notna().all()
    assert run.steps["loss"].gt(0).all()
