"""The capture core (issue 13): one hub, nothing left installed, collector order irrelevant."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import amprobe
from amprobe.capture.collectors import REGISTRY, Collector
from amprobe.store.fields import STEP_FIELDS, fields_of
from tests.helpers import amprobe_cli

SCRIPTS = Path(__file__).resolve().parent / "scripts"
PACKAGE_PARENT = str(Path(amprobe.__file__).resolve().parent.parent)
# columns that measure time or memory: they differ between any two runs
_TIMING = {"t", "wall_s", "probe_s", "data_wait_s", "fwd_s", "bwd_s", "opt_s", "rss_bytes"}


def _torch_state() -> dict[str, object]:
    """Every torch attribute and global hook table the hub touches, by identity and size."""
    import torch.nn.utils.clip_grad as clip_grad
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optimizer_mod
    from torch.utils.data import dataloader

    owners = {
        "GradScaler": torch.amp.GradScaler,
        "Optimizer": torch.optim.Optimizer,
        "autocast": torch.amp.autocast_mode.autocast,
        "DataLoaderIter": dataloader._BaseDataLoaderIter,
    }
    state: dict[str, object] = {}
    for name, owner in owners.items():
        for attr, value in vars(owner).items():
            if callable(value):
                state[f"{name}.{attr}"] = value
    state["autograd.backward"] = torch.autograd.backward
    state["clip_grad._group"] = clip_grad._group_tensors_by_device_and_dtype
    state["global_fwd_pre_hooks"] = len(module_mod._global_forward_pre_hooks)
    state["global_fwd_hooks"] = len(module_mod._global_forward_hooks)
    state["opt_pre_hooks"] = len(optimizer_mod._global_optimizer_pre_hooks)
    state["opt_post_hooks"] = len(optimizer_mod._global_optimizer_post_hooks)
    state["modes"] = len(_get_current_dispatch_mode_stack())
    return state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _train(model: nn.Module, opt, scaler, steps: int, stacks: list | None = None) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.item()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if stacks is not None:
            stacks.append([type(m).__name__ for m in _get_current_dispatch_mode_stack()])


@pytest.mark.parametrize("pass_model", [True, False], ids=["model-passed", "nothing-passed"])
def test_nothing_left_installed_after_close(tmp_path, pass_model):
    before = _torch_state()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    config = {
        "numerics_every": 2,
        "shapes_every": 2,
        "syncs_every": 3,
        "collectors": ("scaler", "numerics", "compute", "runtime", "discovery"),
    }
    stacks: list = []
    probe = amprobe.attach(
        model=model if pass_model else None, run_dir=tmp_path / "r", config=config
    )
    _train(model, opt, scaler, 8, stacks)
    probe.close()
    after = _torch_state()
    assert after == before, {
        k: (before.get(k), after.get(k)) for k in after if after[k] != before.get(k)
    }
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert all(not m._forward_hooks for m in model.modules())
    # the op mode is up only on the steps that asked for it: sampled steps are 1, 3, 4, 5, 7
    # (shapes: 1, 3, 5 (3 captures); syncs: 1, 4, 7); the stack is read just after each boundary
    asked = {1, 3, 4, 5, 7}
    for step, stack in enumerate(stacks):
        expected = ["_OpMux"] if step + 1 in asked else []
        assert stack == expected, (step, stack)
    run = amprobe.load_run(tmp_path / "r")
    assert run.events_of("model_registered"), "the model is known either way"
    assert not run.events_of("collector_error")
    assert not run.events_of("undeclared_field")


def test_nothing_passed_records_the_same_layers_as_model_passed(tmp_path):
    """attach() with no model (accelerate, a custom loop) finds the root at its first forward:
    per-layer numerics and compute rows name the same layers as when the model is passed."""
    runs = []
    for tag, pass_model in (("passed", True), ("found", False)):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        config = {"numerics_every": 1, "shapes_every": 1}  # default collectors: no discovery
        with amprobe.attach(model if pass_model else None, run_dir=tmp_path / tag, config=config):
            _train(model, opt, scaler, 3)
        runs.append(amprobe.load_run(tmp_path / tag))
    passed, found = runs
    assert [e["model_class"] for e in found.events_of("model_registered")] == ["Sequential"]
    layers = [set(run.table("numerics").query("step >= 1")["module"]) for run in runs]
    assert layers[0] == layers[1] and {"0", "1", "2"} <= layers[0], layers
    modules = [set(run.table("compute_ops")["module"]) for run in runs]
    assert modules[0] == modules[1] == {"0", "2"}, modules
    # the optimizer predates attach(), so the root is confirmed at the end of step 0
    assert set(found.table("numerics")["step"]) == {1, 2}


def test_nothing_written_onto_the_users_objects(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 16)), 8)
    it = iter(data)
    with amprobe.attach(model, opt, scaler, run_dir=tmp_path / "r"):
        for (x,) in it:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    for obj in (model, opt, scaler, it, *model.modules()):
        assert not [a for a in vars(obj) if "amprobe" in a], type(obj).__name__


def test_numerics_shapes_and_syncs_on_the_same_step_record_all_three(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    config = {"numerics_every": 1, "shapes_every": 1, "syncs_every": 1}
    with amprobe.attach(model, opt, scaler, run_dir=tmp_path / "r", config=config):
        _train(model, opt, scaler, 4)
    run = amprobe.load_run(tmp_path / "r")
    steps = run.steps.set_index("step")
    for step in (1, 2, 3):
        assert steps.loc[step, "numerics_sampled"], step
        assert steps.loc[step, "syncs_sampled"] and steps.loc[step, "syncs"] == 1, step
    compute = run.table("compute_steps")
    assert {1, 2, 3} <= set(compute["step"])
    assert set(run.table("numerics")["step"]) >= {1, 2, 3}
    assert not run.events_of("sync_counting_stopped")


def _record(tmp_path: Path, collectors: tuple[str, ...], tag: str) -> amprobe.Run:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    config = {"collectors": collectors, "numerics_every": 1, "shapes_every": 2, "syncs_every": 2}
    with amprobe.attach(model, opt, scaler, run_dir=tmp_path / tag, config=config):
        _train(model, opt, scaler, 4)
    return amprobe.load_run(tmp_path / tag)


def test_collector_order_does_not_change_the_records(tmp_path):
    runs = [
        _record(tmp_path, ("scaler", *perm), "-".join(perm))
        for perm in itertools.permutations(("numerics", "compute", "runtime"))
    ]
    reference = runs[0]
    keep = [c for c in reference.steps.columns if c not in _TIMING]
    assert reference.steps["loss_nonfinite"].notna().all()
    for run in runs[1:]:
        pd.testing.assert_frame_equal(run.steps[keep], reference.steps[keep])
        for table in ("numerics", "compute_ops"):
            a = reference.table(table).drop(columns=[], errors="ignore")
            b = run.table(table)
            pd.testing.assert_frame_equal(b.reset_index(drop=True), a.reset_index(drop=True))


class _Sloppy(Collector):
    name = "sloppy"

    def on_step_end(self, step, record, facts):
        record["my_private_column"] = 1


def test_an_undeclared_column_is_reported(tmp_path, monkeypatch):
    monkeypatch.setitem(REGISTRY, "sloppy", _Sloppy)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amprobe.attach(model, opt, run_dir=tmp_path / "r", config={"collectors": ("sloppy",)}):
        _train(model, opt, torch.amp.GradScaler("cpu"), 2)
    events = amprobe.load_run(tmp_path / "r").events_of("undeclared_field")
    assert [e["field"] for e in events] == ["my_private_column"]


def test_discovery_is_no_collector_but_its_name_is_accepted(tmp_path):
    """Root-model discovery belongs to the hub (amprobe.capture.discovery), not to the
    collectors; "discovery" is still accepted in Config.collectors and every manifest lists it."""
    assert "discovery" not in REGISTRY
    for tag, config in (("named", {"collectors": ("scaler", "discovery")}), ("default", {})):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        with amprobe.attach(run_dir=tmp_path / tag, config=config) as probe:
            assert [c.name for c in probe.collectors if c.name == "discovery"] == []
            _train(model, opt, scaler, 2)
        run = amprobe.load_run(tmp_path / tag)
        assert run.rank_manifest["config"]["collectors"].count("discovery") == 1, tag
        assert [e["model_class"] for e in run.events_of("model_registered")] == ["Sequential"]


def test_a_failing_discovery_is_switched_off_and_reported(tmp_path, monkeypatch):
    """A failure at a step boundary switches discovery off for the run, removes its global
    hooks and is reported like a collector's (the run summary lists it); training goes on."""
    from torch.nn.modules import module as module_mod

    from amprobe.capture.discovery import RootModelFinder
    from amprobe.report.summary import collector_errors

    def boom(self, step):
        raise RuntimeError("discovery broke")

    monkeypatch.setattr(RootModelFinder, "_check_candidates", boom)

    def finder_hooks(finder: RootModelFinder) -> int:
        tables = (module_mod._global_forward_pre_hooks, module_mod._global_forward_hooks)
        return sum(getattr(h, "__self__", None) is finder for t in tables for h in t.values())

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # seen only at its first step()
    scaler = torch.amp.GradScaler("cpu")
    with amprobe.attach(run_dir=tmp_path / "r") as probe:
        assert finder_hooks(probe.hub.discovery) == 2, "searching from the first step"
        _train(model, opt, scaler, 1)
        assert finder_hooks(probe.hub.discovery) == 0, "the global hooks went with the failure"
        _train(model, opt, scaler, 3)
    run = amprobe.load_run(tmp_path / "r")
    assert list(run.steps["step"]) == [0, 1, 2, 3]
    errors = run.events_of("collector_error")
    # discovery runs at the boundary after step 0: what it finds (or fails at) is step 1's
    assert [(e["collector"], e["step"]) for e in errors] == [("discovery", 1)]
    assert "RuntimeError: discovery broke" in errors[0]["error"]
    assert not run.events_of("model_registered"), "switched off: no root was claimed"
    assert "'discovery' was switched off" in collector_errors(run)[0]


def test_every_collector_declares_exactly_its_fields():
    declared = {f.name for f in STEP_FIELDS}
    assert len(declared) == len(STEP_FIELDS), "a steps column is declared twice"
    for name, cls in REGISTRY.items():
        assert tuple(cls.fields) == fields_of(name), name
    assert all(f.units is not None and f.meaning for f in STEP_FIELDS)


def test_comma_separated_lists_are_accepted(tmp_path):
    cfg = amprobe.Config(collectors="scaler,numerics, runtime", numerics_layers="0,2")
    # scaler and compile are always on (compile reads torch.compile's counters only if used);
    # so is replay (references kept per step) unless replay="off" or replay_max=0
    assert cfg.collectors == ("scaler", "compile", "numerics", "runtime", "replay")
    assert "replay" not in amprobe.Config(collectors="scaler", replay="off").collectors
    assert "replay" not in amprobe.Config(collectors="scaler", replay_max=0).collectors
    assert cfg.numerics_layers == ("0", "2")
    with pytest.raises(amprobe.ConfigError, match="unknown collector 'numeric'.*'numerics'"):
        amprobe.attach(run_dir=tmp_path / "r", config={"collectors": "scaler,numeric"})


def _amprobe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return amprobe_cli(*args, cwd=cwd, timeout=240)


@pytest.mark.parametrize("first", [False, True], ids=["torch-first", "amprobe-first"])
def test_zero_code_run_leaves_no_mode_and_counts_syncs(tmp_path, first):
    out = tmp_path / "run"
    extra = ["--import-amprobe-first"] if first else []
    proc = _amprobe(
        "run",
        "--out",
        str(out),
        "--",
        sys.executable,
        str(SCRIPTS / "capture_probe.py"),
        "6",
        *extra,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "not recording" not in proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 6
    # defaults: shapes and syncs both on step 1 (the mode is up from the boundary after step 0
    # to the one after step 1), nothing on any other step
    for line in lines:
        assert line["modes"] == (["_OpMux"] if line["step"] == 0 else []), line
    run = amprobe.load_run(out)
    steps = run.steps.set_index("step")
    assert steps.loc[1, "syncs_sampled"] and steps.loc[1, "syncs"] == 6
    assert 1 in set(run.table("compute_steps")["step"])
    assert steps.loc[0, "numerics_sampled"], "the root model is found at its first forward"
    assert not run.events_of("sync_counting_stopped")
    assert "AMP-S03" in amprobe.diagnose(run).ids()


def test_baseline_with_amprobe_imported_before_torch(tmp_path):
    out = tmp_path / "base"
    proc = _amprobe(
        "baseline",
        "--steps",
        "5",
        "--out",
        str(out),
        "--",
        sys.executable,
        str(SCRIPTS / "capture_probe.py"),
        "8",
        "--import-amprobe-first",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "not recording" not in proc.stderr
    fp32, amp = amprobe.load_run(out / "fp32"), amprobe.load_run(out / "amp")
    assert fp32.rank_manifest.get("forced_fp32") is True
    assert list(fp32.steps["step"]) == [0, 1, 2, 3, 4]
    assert not fp32.steps["autocast_dtype"].notna().any(), "the fp32 leg ran without autocast"
    assert not fp32.steps["scaler_enabled"].any()
    assert set(amp.steps["autocast_dtype"].dropna()) == {"bfloat16"}


def test_each_interception_is_installed_once(tmp_path):
    from torch.optim import optimizer as optimizer_mod

    from amprobe.capture import patching

    pre = len(optimizer_mod._global_optimizer_pre_hooks)
    post = len(optimizer_mod._global_optimizer_post_hooks)
    every = tuple(name for name in REGISTRY if name != "prometheus")
    with amprobe.attach(run_dir=tmp_path / "r", config={"collectors": every}):
        stacks = {key: len(stack) for key, stack in patching._STACKS.items()}
        assert stacks and set(stacks.values()) == {1}, stacks
        assert len(optimizer_mod._global_optimizer_pre_hooks) == pre + 1
        assert len(optimizer_mod._global_optimizer_post_hooks) == post + 1
    assert not patching._STACKS


def test_a_failing_hub_body_never_reaches_the_loop(tmp_path, monkeypatch):
    from amprobe.capture.boundary import StepBoundary

    def boom(self, *args):
        raise RuntimeError("torch internals changed")

    monkeypatch.setattr(StepBoundary, "before_update", boom)
    monkeypatch.setattr(StepBoundary, "on_backward_begin", boom)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with amprobe.attach(model, opt, scaler, run_dir=tmp_path / "r"):
        _train(model, opt, scaler, 4)
    run = amprobe.load_run(tmp_path / "r")
    assert list(run.steps["step"]) == [0, 1, 2, 3], "step boundaries survive"
    errors = run.events_of("hub_error")
    assert len(errors) == 1 and "torch internals changed" in errors[0]["error"]


def test_attach_under_amprobe_run_says_where_it_records(tmp_path, capsys):
    """A script's own attach(run_dir=X) joins the launcher's probe: say so, never silently."""
    from amprobe.capture.probe import attach as core_attach

    outer = core_attach(run_dir=tmp_path / "outer", adoptable=True)
    try:
        model = _model()
        joined = amprobe.attach(model, run_dir=tmp_path / "inner")
        assert joined is outer
        err = capsys.readouterr().err
        assert "joins the run `amprobe run` is recording in" in err and "inner" in err
        assert amprobe.attach(run_dir=tmp_path / "outer") is outer  # the same place: no message
        assert capsys.readouterr().err == ""
    finally:
        outer.close()
    assert not (tmp_path / "inner").exists()
    events = amprobe.load_run(tmp_path / "outer").events_of("attach_joined")
    assert [e["requested_run_dir"] for e in events] == [str(tmp_path / "inner")]


def test_model_passed_to_attach_and_a_second_trained_model_are_both_watched(tmp_path):
    """Issue 19 item 1: a model trained beside the one passed to attach is found too, and a
    wrapper called around the passed model (DataParallel-style) is no second root."""
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    second = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 4))
    wrapped = nn.Sequential(first)  # the job calls a wrapper holding the same parameters
    opt0 = torch.optim.SGD(first.parameters(), lr=1e-2)
    opt1 = torch.optim.SGD(second.parameters(), lr=1e-2)
    config = {"collectors": ("scaler", "numerics", "compute"), "numerics_every": 1}
    with amprobe.attach(first, opt0, run_dir=tmp_path / "run", config=config):
        for _ in range(3):
            x = torch.randn(4, 8)
            loss = (wrapped(x) - second(x)).pow(2).mean()
            loss.backward()
            opt0.step()
            opt1.step()
            opt0.zero_grad()
            opt1.zero_grad()
    run = amprobe.load_run(tmp_path / "run")
    models = run.events_of("model_registered")
    assert [(m["name"], m["parameters"]) for m in models] == [("first", 212), ("second", 160)]
    # opt1 predates attach: it is seen at its first step(), after step 0's boundary (opt0's),
    # so the second model is registered at step 1's end and hooked from step 2
    rows = run.table("numerics")
    last = set(rows.loc[(rows["step"] == 2) & (rows["kind"] == "output"), "module"])
    assert last == {"first.0", "first.1", "first.2", "second.0", "second.1", "second.2"}


def test_a_folding_collector_fills_step_records_at_flush_with_events_dated_to_the_step(
    tmp_path, monkeypatch
):
    """The scaler collector is not called at a step's end: its records are filled in at the
    next flush (``on_step_fold``), in step order, and its events carry their own step (here a
    new autocast setting first seen at step 3, and live metrics read before any flush)."""
    from amprobe.capture.collectors.scaler import ScalerCollector
    from amprobe.capture.protocol import Collector

    assert ScalerCollector.on_step_end is Collector.on_step_end  # nothing live
    called_at: list[tuple[int, int]] = []  # (step folded, probe's step when folded)
    real = ScalerCollector.on_step_fold

    def spy(self, step, record, facts):
        called_at.append((step, self.probe.step))
        return real(self, step, record, facts)

    monkeypatch.setattr(ScalerCollector, "on_step_fold", spy)
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    config = {"flush_every": 50, "details_every": 1, "collectors": ("scaler",)}
    losses = []
    with amprobe.attach(
        model=model, optimizer=opt, scaler=scaler, run_dir=tmp_path, config=config
    ) as probe:
        for step in range(6):
            dtype = torch.bfloat16 if step < 3 else torch.float16
            with torch.autocast("cpu", dtype=dtype):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            losses.append(loss.item())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if step == 4:
                assert called_at == []  # nothing at the step ends so far
                live = probe.live_metrics()  # a framework callback: folds what is pending
                assert live["steps"] == 5 and live["loss"] == pytest.approx(losses[4])
                assert [s for s, _ in called_at] == [0, 1, 2, 3, 4]
    assert [s for s, _ in called_at] == list(range(6))
    assert all(at > step for step, at in called_at), called_at
    run = amprobe.load_run(tmp_path)
    assert run.steps["loss"].tolist() == pytest.approx(losses)
    assert run.steps["autocast_dtype"].tolist() == ["bfloat16"] * 3 + ["float16"] * 3
    seen = {e["dtype"]: e["step"] for e in run.events_of("autocast_seen")}
    assert seen == {"bfloat16": 0, "float16": 3}
    assert [e["step"] for e in run.events_of("scaler_bound")] == [0]


def test_no_collector_runs_at_an_unsampled_cpu_step_end(tmp_path, monkeypatch):
    """With the collectors of every step (scaler, runtime, numerics) on CPU, a step's end
    calls no collector unless the step is sampled: the data wait, the inputs' non-finite count and the resident set size are step
    facts, folded into the records at flush with the rest (here through a DataLoader, with a
    NaN batch that must still arm the per-layer capture at once, not at the flush)."""
    from amprobe.capture.dispatch import Dispatcher

    ended: list[tuple[int, list[str]]] = []
    real = Dispatcher.deliver

    def spy(self, subs, args):
        if subs is self.subs["on_step_end"] and subs:
            ended.append((args[0], sorted(c.name for c, _ in subs)))
        return real(self, subs, args)

    monkeypatch.setattr(Dispatcher, "deliver", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    data = torch.randn(40, 8)
    data[4 * 7 + 1, 3] = float("nan")  # the batch of step 7
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)
    config = {
        "collectors": ["scaler", "runtime", "numerics"],
        "numerics_every": 5,
        "syncs_every": 0,
        "flush_every": 100,
    }
    with amprobe.attach(
        model=model, optimizer=opt, scaler=scaler, run_dir=tmp_path, config=config
    ) as probe:
        for step, (x,) in enumerate(loader):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if step == 7:  # armed at the step's end, before any flush
                assert [e["kind"] for e in probe._pending_events].count("numerics_armed") == 1
    run = amprobe.load_run(tmp_path)
    steps = run.steps.set_index("step")
    sampled = set(steps.index[steps["numerics_sampled"]])
    assert {0, 5, 8, 9}.issubset(sampled) and 7 not in sampled, sampled
    # a step's end reached a collector on the sampled steps only, and only numerics there
    assert {s for s, _ in ended} == sampled
    assert all(names == ["numerics"] for _, names in ended), ended
    assert steps["input_nonfinite"].tolist() == [0] * 7 + [1] + [0] * 2
    assert steps["loss_nonfinite"].tolist() == [False] * 7 + [True] + [False] * 2
    assert steps["batches"].tolist() == [1] * 10
    assert (steps["data_wait_s"] > 0).all()
    assert steps["rss_bytes"].notna().all() and steps["rss_bytes"].iloc[0] > 0


@pytest.mark.parametrize("first_removed", ["gated", "plain"])
def test_gated_and_plain_patches_stack_and_come_off_in_any_order(first_removed):
    """A gated wrapper (no frame around it: it checks its own patch) stacks with a plain one;
    whichever is removed first passes straight through at once, inner calls named in its
    ``inner_calls`` pass through, and the original is back once both are gone."""
    from amprobe.capture.patching import gated, patch

    class Owner:
        def f(self, x):
            return [x]

    original = Owner.__dict__["f"]
    inner: set[tuple[int, str]] = set()

    @gated
    def make_gated(orig, gate):
        def f(self, x):
            if not gate.alive or (gate.inner_calls and (id(self), "f") in gate.inner_calls):
                return orig(self, x)
            return ["gated", *orig(self, x)]

        return f

    def make_plain(orig):
        def f(self, x):
            return ["plain", *orig(self, x)]

        return f

    handles = {"gated": patch(Owner, "f", make_gated, inner_calls=inner)}
    handles["plain"] = patch(Owner, "f", make_plain)
    obj = Owner()
    assert obj.f(1) == ["plain", "gated", 1]
    inner.add((id(obj), "f"))
    assert obj.f(1) == ["plain", 1]  # an inner call on this object: the gated one passes
    inner.clear()
    handles[first_removed].remove()
    other = "plain" if first_removed == "gated" else "gated"
    assert obj.f(2) == [other, 2]
    handles[other].remove()
    assert obj.f(3) == [3]
    assert Owner.__dict__["f"] is original


def test_step_facts_start_at_their_declared_defaults_with_lists_of_their_own():
    """StepFacts' own constructor (one is made at every step boundary) gives each field its
    declared default, and each instance its own lists."""
    import dataclasses

    from amprobe.capture.protocol import StepFacts

    a, b = StepFacts(), StepFacts()
    for f in dataclasses.fields(StepFacts):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        assert getattr(a, f.name) == default, f.name
        if isinstance(default, list):
            assert getattr(a, f.name) is not getattr(b, f.name), f.name
    a.loss_count += 1
    a.scaled.append(1)
    assert (b.loss_count, b.scaled, StepFacts().loss_count) == (0, [], 0)
    assert a != b  # (the dataclass's comparison, field by field)


@pytest.mark.parametrize(
    "field, value, bad",
    [
        ("found_inf", 1.0, True),
        ("found_inf", 2, True),  # an engine's integer found-inf count, read on the host
        ("found_inf", 0, False),
        ("found_inf", True, False),  # a bool is not a count
        ("loss", float("nan"), True),
        ("loss", 3, False),
        ("input_nonfinite", 4, True),
        ("found_inf", torch.tensor(1.0), False),  # on a device: not read here
    ],
)
def test_host_nonfinite_reads_host_floats_and_ints(field, value, bad):
    from amprobe.capture.protocol import StepFacts

    facts = StepFacts()
    setattr(facts, field, value)
    assert facts.host_nonfinite() is bad


def test_scaler_first_met_at_its_update_is_announced_once(tmp_path):
    """attach() between a step's scale() and its update(), with a GradScaler made before and
    not passed: the scaler is announced once (found among the live objects at attach, seen
    again when it claims the boundary at update(), which scale() now relies on), and the later
    steps record its scale."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    probe = None
    for i in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(2, 4)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        if i == 0:
            probe = amprobe.attach(model=model, optimizer=opt, run_dir=tmp_path / "run")
        scaler.update()
        opt.zero_grad(set_to_none=True)
    assert probe is not None
    probe.close()
    run = amprobe.load_run(tmp_path / "run")
    created = run.events_of("scaler_created")
    assert len(created) == 1 and created[0]["created_before_attach"] is True
    steps = run.steps
    assert list(steps["scale_before"].dropna())[-2:] == [256.0, 256.0]
    assert steps["loss"].notna().sum() >= 3


def test_the_op_mode_runs_higher_order_operators_as_they_are():
    """A compiled graph runs higher-order operators (inductor's ``run_and_save_rng_state``
    under activation checkpointing, ``auto_functionalized``): with amprobe's mode pushed they
    run as without it, where torch raised NotImplementedError into the user's step."""
    from torch._prims.rng_prims import run_and_save_rng_state

    from amprobe.capture.opmode import _OpMux

    class _Dispatch:
        busy = False
        observing = False

    mux = _OpMux(_Dispatch())  # type: ignore[arg-type]
    seen: list[object] = []
    mux.observers = [(None, lambda *a: seen.append(a))]  # type: ignore[list-item]
    torch.manual_seed(0)
    _, want = run_and_save_rng_state(torch.ops.aten.rand.default, [3], device=torch.device("cpu"))
    torch.manual_seed(0)
    with mux:
        _, got = run_and_save_rng_state(
            torch.ops.aten.rand.default, [3], device=torch.device("cpu")
        )
    assert torch.equal(got, want) and mux.delivered == 0
