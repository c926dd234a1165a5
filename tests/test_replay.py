"""The replay of a bad step (issue 34), capture side: the measured cause, and a training left
exactly as it would have been without it.

Tiny fp16 CPU jobs (tests/scripts/train_replay.py and small loops written here). Where a test is
about the cause, the replay's time budget is made large (``TIME_FACTOR``) so that the cause does
not depend on the machine's load. Runs are shared per module.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import amprobe
import amprobe.capture.collectors.replay as replay_mod

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ROOT = SCRIPTS.parent.parent


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_amprobe_test_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tr = _script("train_replay")


@contextlib.contextmanager
def _time_factor(value: float):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replay_mod, "TIME_FACTOR", value)
        yield


def _events(run_dir: Path | str) -> list[dict[str, Any]]:
    return amprobe.load_run(run_dir).events_of("replay")


def _digest(net: nn.Module) -> str:
    h = hashlib.sha256()
    for p in net.state_dict().values():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def _bits(values: list[float]) -> list[str]:
    return [v.hex() for v in values]  # NaN == NaN, -0.0 != 0.0: bit for bit


# -- 1. every case of train_replay.py, attached in-process -------------------------------------
#: case -> (steps, cause, verified fix)
CASES = {
    "layer": (8, "precision", ["big"]),
    "elsewhere": (8, "precision", ["proj"]),
    "cosine": (8, "precision", ["cos"]),
    "nan_batch": (8, "data-or-model", []),
    "loss": (8, "loss-computation", []),
    "oneoff": (8, "not-reproduced", []),
    "scale": (12, "loss-scale", []),
    "startup": (20, "loss-scale", []),
}
#: compiled jobs: (case, backend name); "buggy" is the script's miscompiling backend
COMPILED = [("layer", "aot_eager"), ("nan_batch", "aot_eager"), ("compiler", "buggy")]
COMPILED_CAUSE = {"layer": "precision", "nan_batch": "data-or-model", "compiler": "compiler"}


def _counting(name: str, calls: Counter) -> Any:
    """``name``'s backend (or the script's buggy one), counting the graphs it compiles and each
    call of one, per training step (the probe's step: a replay runs inside its bad step)."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = tr._buggy_backend() if name == "buggy" else lookup_backend(name)

    def backend(gm: Any, example_inputs: Any) -> Any:
        compiled = inner(gm, example_inputs)
        calls["graphs"] += 1

        def run(*args: Any) -> Any:
            probe = amprobe.current_probe()
            calls[probe.step if probe is not None else -1] += 1
            return compiled(*args)

        return run

    return backend


def _train(tmp: Path, case: str, replay: str, backend: str | None = None, **kw: Any) -> Any:
    from torch._dynamo.utils import counters

    run_dir = tmp / f"{case}-{backend or 'eager'}-{replay}"
    calls: Counter = Counter()
    if backend is not None:
        torch._dynamo.reset()
        counters.clear()
    losses, digest, _ = tr.train(
        case,
        kw.pop("steps", CASES.get(case, (8,))[0]),
        compiled=backend is not None,
        attach=str(run_dir),
        replay=replay,
        backend=None if backend is None else _counting(backend, calls),
        **kw,
    )
    dynamo = {}
    if backend is not None:
        dynamo = {
            "unique_graphs": counters["stats"]["unique_graphs"],
            "frames_total": counters["frames"]["total"],
            "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
        }
    return SimpleNamespace(
        losses=losses, digest=digest, events=_events(run_dir), calls=calls, dynamo=dynamo
    )


@pytest.fixture(scope="module")
def eager_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("replay_eager")
    with _time_factor(1e4):
        return {(case, r): _train(tmp, case, r) for case in CASES for r in ("on", "off")}


@pytest.fixture(scope="module")
def compiled_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("replay_compiled")
    with _time_factor(1e4):
        jobs = {
            (case, r): _train(tmp, case, r, backend)
            for case, backend in COMPILED
            for r in ("on", "off")
        }
    torch._dynamo.reset()
    return jobs


def _one(events: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(events) == 1, events
    return events[0]


@pytest.mark.parametrize("case", list(CASES))
def test_each_case_gives_its_cause_and_fix(eager_jobs, case):
    steps, cause, fix = CASES[case]
    event = _one(eager_jobs[case, "on"].events)
    assert event["replayed"] is True, event
    assert event["trigger"] == "skipped_update"
    assert event["cause"] == cause, event
    assert event["verified_fix"] == fix, event
    assert event["device_type"] == "cpu" and event["autocast_dtype"] == "float16"
    assert event["experiments"] and all(e["seconds"] >= 0 for e in event["experiments"])
    assert event["step"] == {"scale": 9, "startup": 15}.get(case, 5)


@pytest.mark.parametrize("case", list(CASES))
def test_each_case_trains_bit_for_bit_as_without_replay(eager_jobs, case):
    on, off = eager_jobs[case, "on"], eager_jobs[case, "off"]
    assert off.events == [], "replay='off' records nothing"
    assert _bits(on.losses) == _bits(off.losses)
    assert on.digest == off.digest


def test_layer_named_first_is_not_the_fix(tmp_path):
    """AMP-N05 names ``inv`` (its output is the first non-finite one, in the recorded numerics
    too); only pinning ``proj`` makes the step finite: the fix comes from the measured
    variants, never from the other findings."""
    run_dir = tmp_path / "elsewhere"
    with _time_factor(1e4):
        tr.train("elsewhere", 8, attach=str(run_dir), config={"numerics_every": 1})
    run = amprobe.load_run(run_dir)
    event = _one(run.events_of("replay"))
    assert event["first_nonfinite"] == "inv"
    assert event["verified_fix"] == ["proj"]
    tried = [e["variant"] for e in event["experiments"]]
    assert tried.index("fp32 inv") < tried.index("fp32 proj")
    rows = run.table("numerics")
    out = rows[(rows["step"] == 5) & (rows["kind"] == "output")].sort_values("order")
    bad = out[(out["nan"] + out["inf"]) > 0]
    assert list(bad["module"])[:1] == ["inv"], out
    n05 = [f for f in amprobe.diagnose(run).findings if f.id == "AMP-N05"]
    assert n05 and n05[0].evidence["module"] == "inv"


@pytest.mark.parametrize("case, backend", COMPILED)
def test_compiled_case_gives_its_cause(compiled_jobs, case, backend):
    event = _one(compiled_jobs[case, "on"].events)
    assert event["replayed"] is True and event["compiled"] is True, event
    assert event["cause"] == COMPILED_CAUSE[case], event
    assert event["verified_fix"] == (["big"] if case == "layer" else [])
    variants = [e["variant"] for e in event["experiments"]]
    assert variants[:2] == ["as it ran", "eager"]


@pytest.mark.parametrize("case, backend", COMPILED)
def test_compiled_case_trains_bit_for_bit_and_compiles_nothing_more(compiled_jobs, case, backend):
    on, off = compiled_jobs[case, "on"], compiled_jobs[case, "off"]
    assert _bits(on.losses) == _bits(off.losses)
    assert on.digest == off.digest
    # no recompile, no new graph because of the replay
    assert on.calls["graphs"] == off.calls["graphs"]
    assert on.dynamo == off.dynamo
    assert on.dynamo["recompiles"] == 0
    # the compiled graphs' calls per step: the same, but for the replayed step's "as it ran"
    steps = range(len(on.losses))
    expected = [off.calls[s] for s in steps]
    for event in on.events:
        expected[event["step"]] += off.calls[event["step"]]  # its forward once more
    assert [on.calls[s] for s in steps] == expected
    assert all(off.calls[s] > 0 for s in steps)


@pytest.mark.slow
def test_inductor_case_gives_its_cause_bit_for_bit(tmp_path):
    """One case under inductor (compiles C++ on this CPU: the slowest test here)."""
    with _time_factor(1e4):
        on = _train(tmp_path, "layer", "on", "inductor")
        off = _train(tmp_path, "layer", "off", "inductor")
    torch._dynamo.reset()
    event = _one(on.events)
    assert event["cause"] == "precision" and event["verified_fix"] == ["big"], event
    assert _bits(on.losses) == _bits(off.losses) and on.digest == off.digest
    assert on.calls["graphs"] == off.calls["graphs"] and on.dynamo == off.dynamo


# -- 2. under amprobe run ----------------------------------------------------------------------
#: every job of train_replay.py under ``amprobe run``: (case, its extra arguments, the bad step
#: replayed, the cause, the verified fix)
ZERO_CODE = [
    ("layer", (), 5, "precision", ["big"]),
    ("elsewhere", (), 5, "precision", ["proj"]),
    ("cosine", (), 5, "precision", ["cos"]),
    ("nan_batch", (), 5, "data-or-model", []),
    ("loss", (), 5, "loss-computation", []),
    ("oneoff", (), 5, "not-reproduced", []),
    ("scale", ("--steps", "12"), 9, "loss-scale", []),
    ("startup", ("--steps", "20"), 15, "loss-scale", []),
    ("compiler", ("--compile",), 5, "compiler", []),
]


@pytest.mark.parametrize("case, extra, step, cause, fix", ZERO_CODE, ids=[c[0] for c in ZERO_CODE])
def test_zero_code_run_records_the_cause(tmp_path, case, extra, step, cause, fix):
    out = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    script = [str(SCRIPTS / "train_replay.py"), "--case", case, "--time-factor", "1e4", *extra]
    proc = subprocess.run(
        [sys.executable, "-m", "amprobe", "run", "--out", str(out), "--", sys.executable, *script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    event = _one(_events(out))
    assert event["replayed"] is True and event["step"] == step, event
    assert event["cause"] == cause, event
    assert event["verified_fix"] == fix


# -- a small loop for the state, bounds and trigger tests --------------------------------------
class Count(nn.Module):
    """Counts its calls in a plain Python int, and its output depends on the count."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * (1.0 + 1e-3 * self.calls)


class StateNet(nn.Module):
    """Dropout (the CPU generator), BatchNorm (running statistics, num_batches_tracked), a call
    counter; ``big``'s output overflows fp16 on a batch times 1000, the BatchNorm's does not."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.count = Count()
        self.big = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        with torch.no_grad():
            self.big.weight.mul_(100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.count(self.drop(self.bn(self.inp(x))))
        return self.head(h) + self.big(x).sum(-1, keepdim=True) * 1e-4


def _batch(step: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + micro))


def loop(
    run_dir: Path | None,
    *,
    steps: int = 8,
    big: tuple[int, ...] = (),
    nan: tuple[tuple[int, int], ...] = (),
    replay: str = "on",
    config: dict[str, Any] | None = None,
    scaler: bool = True,
    dtype: torch.dtype | None = torch.float16,
    accum: int = 1,
    net: nn.Module | None = None,
    opt: str = "adam",
    before_update: Callable[..., None] | None = None,
    after_update: Callable[..., None] | None = None,
) -> SimpleNamespace:
    """Train ``StateNet``: the batches of the steps in ``big`` times 1000 (``big`` overflows
    fp16), a NaN in micro-batch m of step s for each (s, m) in ``nan``."""
    torch.manual_seed(0)
    net = net or StateNet()
    if opt == "adam":
        optimizer: torch.optim.Optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(net.parameters(), lr=1e-2)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000) if scaler else None
    probe = None
    if run_dir is not None:
        probe = amprobe.attach(
            net,
            optimizer,
            gs,
            run_dir=str(run_dir),
            config={"replay": replay, "numerics_every": 0, **(config or {})},
        )
    losses: list[float] = []
    seen: dict[str, Any] = {}
    try:
        for step in range(steps):
            total = 0.0
            for micro in range(accum):
                x = _batch(step, micro)
                if step in big:
                    x = x * 1000.0
                if (step, micro) in nan:
                    x[0, 0] = float("nan")
                with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                    out = net(x)
                seen.setdefault("out_hooks", bool(getattr(out, "_backward_hooks", None)))
                loss = out.float().pow(2).mean() / accum
                (gs.scale(loss) if gs is not None else loss).backward()
                total += float(loss.detach())
            torch.rand(3)  # the job draws from the CPU generator after its forward too
            if before_update is not None:
                before_update(step, x, net, seen)
            if gs is not None:
                gs.step(optimizer)
                gs.update()
            else:
                optimizer.step()
            if after_update is not None:
                after_update(step, x, net, optimizer, seen)
            optimizer.zero_grad()
            losses.append(total)
    finally:
        if probe is not None:
            probe.close()
    return SimpleNamespace(
        losses=losses,
        digest=_digest(net),
        events=_events(run_dir) if run_dir is not None else [],
        probe=probe,
        seen=seen,
        net=net,
    )


def _snapshot(bad: int) -> Callable[..., None]:
    """Right after the bad step's update (the replay ran at its end): what a replay must not
    have touched."""

    def snap(step: int, x: torch.Tensor, net: nn.Module, opt: Any, seen: dict[str, Any]) -> None:
        if step != bad:
            return
        seen["grads"] = [
            None if p.grad is None else p.grad.numpy().tobytes() for p in net.parameters()
        ]
        seen["opt"] = [{k: v.numpy().tobytes() for k, v in s.items()} for s in opt.state.values()]
        seen["rng"] = torch.get_rng_state().numpy().tobytes()
        seen["x"] = x.numpy().tobytes()
        seen["buffers"] = [b.numpy().tobytes() for b in net.buffers()]
        seen["calls"] = net.count.calls

    return snap


# -- 4. state restored -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def state_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("replay_state")
    with _time_factor(1e4):
        return {
            r: loop(tmp / r, steps=8, big=(3,), replay=r, after_update=_snapshot(3))
            for r in ("on", "off")
        }


def test_state_job_is_replayed_with_several_forwards(state_jobs):
    event = _one(state_jobs["on"].events)
    assert event["replayed"] is True and event["step"] == 3
    assert event["cause"] == "precision" and event["verified_fix"] == ["big"], event
    assert len(event["experiments"]) >= 3  # the forwards that would have moved the state


@pytest.mark.parametrize("what", ["grads", "opt", "rng", "x", "buffers", "calls"])
def test_replay_leaves_the_bad_steps_state_alone(state_jobs, what):
    on, off = state_jobs["on"].seen, state_jobs["off"].seen
    assert on[what] == off[what]


def test_next_steps_train_as_without_replay(state_jobs):
    on, off = state_jobs["on"], state_jobs["off"]
    assert _bits(on.losses) == _bits(off.losses)
    assert on.digest == off.digest
    assert on.net.count.calls == off.net.count.calls == 8


# -- 5. bounds and reasons ---------------------------------------------------------------------
def test_replay_max_three_then_one_reason(tmp_path):
    with _time_factor(1e4):
        job = loop(tmp_path / "on", steps=12, big=(2, 4, 6, 8, 10), opt="sgd")
    done = [e for e in job.events if e["replayed"]]
    assert [e["step"] for e in done] == [2, 4, 6]
    refused = [e for e in job.events if not e["replayed"]]
    assert len(refused) == 1 and refused[0]["step"] == 8
    assert "replay_max (3)" in refused[0]["reason"]


def test_replay_off_keeps_nothing(tmp_path):
    job = loop(tmp_path / "off", steps=6, big=(2, 4), replay="off")
    assert job.events == []
    assert not any(isinstance(c, replay_mod.ReplayCollector) for c in job.probe.collectors)
    assert job.seen["out_hooks"] is False, "no tensor hook on the model's output"
    kept = loop(tmp_path / "on", steps=1)
    assert kept.seen["out_hooks"] is True  # (what the check above would see)


def test_calibration_skips_are_not_replayed(tmp_path):
    """ScaleNet at a start-up scale of 2**24: a few leading skips, each halving the scale."""
    torch.manual_seed(0)
    net = tr.ScaleNet()
    opt = torch.optim.SGD(net.parameters(), lr=1e-5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    run_dir = tmp_path / "run"
    probe = amprobe.attach(net, opt, scaler, run_dir=str(run_dir), config={"numerics_every": 0})
    try:
        for step in range(10):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = net(_batch(step)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    finally:
        probe.close()
    steps = amprobe.load_run(run_dir).steps
    skipped = list(steps[steps["skipped"].astype(bool)]["step"])
    assert skipped and skipped == list(range(len(skipped))) and len(skipped) < 16, skipped
    assert _events(run_dir) == []


def test_consecutive_bad_steps_replay_their_first(tmp_path):
    with _time_factor(1e4):
        job = loop(tmp_path / "on", steps=8, big=(3, 4, 5))
    event = _one(job.events)
    assert event["step"] == 3 and event["replayed"] is True


def test_time_budget_spent_says_incomplete_and_trains_alike(tmp_path):
    with _time_factor(1e-9):
        on = loop(tmp_path / "on", steps=6, big=(3,))
    off = loop(tmp_path / "off", steps=6, big=(3,), replay="off")
    event = _one(on.events)
    assert event["replayed"] is True and event["cause"] is None
    assert "budget" in event["incomplete"]
    assert len(event["experiments"]) == 1  # the first variant runs, then the budget stops it
    assert _bits(on.losses) == _bits(off.losses) and on.digest == off.digest


def test_input_modified_in_place_is_not_replayed(tmp_path):
    def modify(step: int, x: torch.Tensor, net: nn.Module, seen: dict[str, Any]) -> None:
        if step == 3:
            x.mul_(1.0)  # the same values, a new version: the replay cannot know

    job = loop(tmp_path / "on", steps=6, big=(3,), before_update=modify)
    event = _one(job.events)
    assert event["replayed"] is False and "modified in place" in event["reason"]


def test_out_of_memory_is_recorded_and_training_unaffected(tmp_path):
    """The replay's own forward runs out of memory (the model's forward raises, from the end of
    the bad step's backward until its update is done: only the replay calls it then)."""

    def oom(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CPU out of memory (faked)")

    def arm(step: int, x: torch.Tensor, net: nn.Module, seen: dict[str, Any]) -> None:
        if step == 3:
            net.forward = oom  # type: ignore[method-assign]

    def disarm(step: int, x: torch.Tensor, net: nn.Module, opt: Any, seen: dict[str, Any]) -> None:
        net.__dict__.pop("forward", None)

    with _time_factor(1e4):
        on = loop(tmp_path / "on", steps=6, big=(3,), before_update=arm, after_update=disarm)
    off = loop(tmp_path / "off", steps=6, big=(3,), replay="off")
    event = _one(on.events)
    assert event["replayed"] is False and event["reason"] == "out of memory"
    assert _bits(on.losses) == _bits(off.losses) and on.digest == off.digest


@pytest.mark.slow
def test_engine_that_owns_backward_is_not_replayed(tmp_path):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    from tests.helpers import torchrun_argv

    out = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DS_ACCELERATOR": "cpu",
        "AMPROBE_OUT": str(out),
        "CONFIGS": "fp16:0",
        "STEPS": "6",
    }
    proc = subprocess.run(
        torchrun_argv("train_deepspeed.py", nproc=1),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    event = _one(_events(out / "fp16-z0"))
    assert event["replayed"] is False and event["step"] == 3
    assert "engine owns backward (DeepSpeedSource)" in event["reason"]


# -- 6. without a GradScaler -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, None], ids=["bf16", "fp32"])
def test_nonfinite_host_loss_is_replayed_before_the_update(tmp_path, dtype):
    """NaN in the batch of step 3 (not a detail step: the hub's optimizer pre-hook reaches no
    collector there); the weights go NaN at its update, so every later loss is NaN too: one episode,
    one replay."""
    with _time_factor(1e4):
        on = loop(tmp_path / "on", steps=6, nan=((3, 0),), scaler=False, dtype=dtype, opt="sgd")
    off = loop(tmp_path / "off", steps=6, nan=((3, 0),), scaler=False, dtype=dtype, opt="sgd")
    event = _one(on.events)
    assert event["step"] == 3 and event["replayed"] is True, event
    assert event["trigger"] == "nonfinite_loss"
    assert event["cause"] == "data-or-model", event
    assert event["autocast_dtype"] == ("bfloat16" if dtype else None)
    assert _bits(on.losses) == _bits(off.losses) and on.digest == off.digest


def test_device_loss_says_weights_already_updated(tmp_path, monkeypatch):
    """A loss not read on the host (a device's: faked by keeping the CPU loss as a tensor) is
    known non-finite only at flush, after the update."""
    import amprobe.capture.boundary as boundary

    monkeypatch.setattr(boundary, "_host_scalar", lambda t: t.detach().clone())
    job = loop(tmp_path / "on", steps=6, nan=((3, 0),), scaler=False, dtype=None, opt="sgd")
    event = _one(job.events)
    assert event["replayed"] is False and event["step"] == 3
    assert event["reason"].startswith("weights already updated")


# -- 7. gradient accumulation ------------------------------------------------------------------
@pytest.mark.parametrize("micro, cause", [(0, "not-reproduced"), (1, "data-or-model")])
def test_accumulation_says_which_micro_batch_was_replayed(tmp_path, micro, cause):
    with _time_factor(1e4):
        on = loop(tmp_path / "on", steps=6, nan=((3, micro),), accum=2)
    off = loop(tmp_path / "off", steps=6, nan=((3, micro),), accum=2, replay="off")
    event = _one(on.events)
    assert event["replayed"] is True and event["step"] == 3
    assert (event["micro_batch"], event["micro_batches"]) == (2, 2)
    assert event["cause"] == cause, event
    if micro == 0:  # the NaN was in a micro-batch not kept: nothing measured says why
        assert event["confirmed"] is False
        assert any("micro-batches" in note for note in event["notes"])
    assert _bits(on.losses) == _bits(off.losses) and on.digest == off.digest


# -- 8. the Hugging Face Trainer ---------------------------------------------------------------
def test_hf_trainer_nonfinite_loss_is_replayed(tmp_path):
    """bf16 on the CPU (the Trainer refuses fp16 there: no scaler, the non-finite-loss path);
    the planted layer overflows on one call only (a call count), so a replay does not see it."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    hf = _script("train_hf")
    out = tmp_path / "run"
    argv = ["--precision", "bf16", "--steps", "6", "--plant-step", "3"]
    argv += ["--callback", str(out), "--out", str(tmp_path / "o")]
    from accelerate.state import AcceleratorState

    try:
        with _time_factor(1e4), contextlib.redirect_stdout(io.StringIO()):
            with contextlib.redirect_stderr(io.StringIO()):
                hf.main(argv)
    finally:
        # accelerate keeps one process-wide state (its mixed precision): a later test's run
        # would read it as its framework setting
        AcceleratorState._reset_state(reset_partial_state=True)
    event = _one(_events(out))  # steps 4 and 5 (NaN weights) are the same episode
    assert event["step"] == 3 and event["replayed"] is True, event
    assert event["trigger"] == "nonfinite_loss"
    assert event["cause"] == "not-reproduced", event
    assert event["autocast_dtype"] == "bfloat16"  # entered inside accelerate's wrapped forward


def test_autocast_entered_inside_the_forward_is_turned_off_too(tmp_path):
    """accelerate (the HF Trainer's, ``Accelerator.prepare_model``) enters autocast inside the
    model's forward: ``model.forward`` becomes an autocast-wrapped copy, the original kept as
    ``model._original_forward``. The "autocast off" variant must run without it, or a precision
    overflow reads as "data-or-model"."""
    from types import MethodType

    net, scaler = tr.build("layer", 5)
    net._original_forward = net.forward
    net.forward = MethodType(torch.autocast("cpu", dtype=torch.float16)(type(net).forward), net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    run_dir = tmp_path / "run"
    with _time_factor(1e4):
        probe = amprobe.attach(net, opt, scaler, run_dir=str(run_dir), config={"numerics_every": 0})
        try:
            for step in range(8):
                loss = net(tr.batch("layer", step, 5)).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        finally:
            probe.close()
    event = _one(_events(run_dir))
    assert event["replayed"] is True and event["step"] == 5
    assert event["cause"] == "precision", event
    assert event["verified_fix"] == ["big"]
    assert event["autocast_dtype"] == "float16"


def test_accumulation_without_scaler_replays_the_micro_batch_whose_loss_went_nonfinite(tmp_path):
    """Without a GradScaler the non-finite loss is judged at the end of its backward: the
    micro-batch that made it is the one kept, whichever of the step's it is."""
    with _time_factor(1e4):
        on = loop(tmp_path / "on", steps=6, nan=((3, 0),), accum=2, scaler=False, opt="sgd")
    off = loop(tmp_path / "off", steps=6, nan=((3, 0),), accum=2, scaler=False, opt="sgd")
    event = _one(on.events)
    assert event["replayed"] is True and event["step"] == 3
    assert event["trigger"] == "nonfinite_loss"
    assert event["cause"] == "data-or-model", event
    assert _bits(on.losses) == _bits(off.losses) and on.digest == off.digest
