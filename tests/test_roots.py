"""Root models: which module is the model, and layer names from the user's model (issue 31 §2).

A block compiled on its own is a part of the model, not a root: the root is the model the
optimizer's parameters and the module tree name (``layers.0.mlp.booster``, never
``TransformerBlock.mlp.booster``), its embedding and output projection are measured, and
"model input" is the root's input only (block 1's input, made non-finite by block 0, is no
AMP-N04). Wrappers add no prefix (DDP's ``module.``). Where the optimizer's parameters name no
module (Megatron's fp32 main parameters, flattened partitions), discovery falls back in a stated
order and says "root unknown" when all fail.

The ``amprobe run`` jobs (tests/scripts/train_roots.py, tests/scripts/train_megatron.py) start
together in a pool of two; the rest runs in process on tiny models.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import amprobe
from amprobe.analysis.compute import latest_capture
from amprobe.analysis.numerics import numerics_missing_reason
from amprobe.capture.collectors.sharded import (
    user_class_name,
    user_model,
    user_module_name,
    wrapper_classes,
)
from amprobe.capture.discovery import FOUND_BY, ROOT_UNKNOWN, root_of
from tests.helpers import PACKAGE_PARENT, fake_run, free_port, torchrun_argv

SCRIPTS = Path(__file__).resolve().parent / "scripts"
PLANT = "0,1,2"  # block 0's booster multiplies by 1e6 on these steps (fp16: an overflow)
BOOSTER = "layers.0.mlp.booster"

# (job id) -> the script's arguments (tests/scripts/train_roots.py), or "megatron"
JOBS: dict[str, tuple[str, ...]] = {
    "method": ("--how", "method", "--plant", PLANT, "--scaler"),  # block.compile()
    "module": ("--how", "module", "--plant", PLANT, "--scaler"),  # layers[i] = compile(block)
    "ddp": ("--how", "eager", "--ddp", "--plant", PLANT, "--scaler"),
    "megatron": (),
}


def _blocks_module() -> Any:
    spec = importlib.util.spec_from_file_location("train_roots", SCRIPTS / "train_roots.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: the layer names as the user's model writes them (``embedding``, ``layers.0.mlp.booster``)
USER_NAMES = {name for name, _ in _blocks_module().Transformer().named_modules() if name}


def _run_job(root: Path, job: str) -> Path:
    out = root / job
    env = {**os.environ, "PYTHONPATH": PACKAGE_PARENT, "MASTER_PORT": str(free_port())}
    if job == "megatron":
        command = torchrun_argv("train_megatron.py", nproc=1)
        env.update(ATTACH="0", CONFIGS="dynamic:scale_loss")
    else:
        command = [sys.executable, str(SCRIPTS / "train_roots.py"), *JOBS[job]]
    argv = [sys.executable, "-m", "amprobe", "run", "--out", str(out), "--", *command]
    proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{job}: {proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, amprobe.Run]:
    jobs = list(JOBS)
    if importlib.util.find_spec("megatron") is None:
        jobs.remove("megatron")
    root = tmp_path_factory.mktemp("roots")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {job: pool.submit(_run_job, root, job) for job in jobs}
        return {job: amprobe.load_run(future.result()) for job, future in futures.items()}


def _findings(run: amprobe.Run) -> dict[str, amprobe.Finding]:
    return {f.id: f for f in amprobe.diagnose(run).findings}


# -- each block compiled on its own ----------------------------------------------------------------
@pytest.mark.parametrize("job", ["method", "module"])
def test_a_compiled_block_is_a_part_of_the_model_not_a_root(runs, job):
    """`block.compile()` and `layers[i] = torch.compile(block)`: the outer model, never
    compiled, is the one root, found from the optimizer's parameters up the module tree."""
    run = runs[job]
    models = run.events_of("model_registered")
    assert [(m["model_class"], m["found_by"], m["wrappers"]) for m in models] == [
        ("Transformer", "optimizer", [])
    ]
    assert models[0]["trainable_parameters"] == sum(
        p.numel() for p in _blocks_module().Transformer().parameters()
    )
    compiled = {c["target"] for c in run.rank_manifest["compile"]}
    assert compiled == {"TransformerBlock"}, "the blocks were compiled, the model was not"
    assert not run.events_of("discovery_failed")


@pytest.mark.parametrize("job", ["method", "module"])
def test_layers_of_compiled_blocks_are_named_from_the_root(runs, job):
    """Names are the model's paths: no `TransformerBlock.`, `block.` or `_orig_mod.`; the
    embedding and the output projection, outside every block, are measured."""
    numerics = runs[job].table("numerics")
    names = set(numerics["module"])
    layers = {n for n in names if not n.startswith("<")}
    assert layers <= USER_NAMES, layers - USER_NAMES
    outputs = set(numerics[numerics["kind"] == "output"]["module"])
    assert {"embedding", "output"} <= outputs
    assert {n for n in names if n.startswith("<input")} <= {f"<input 0>[{i}]" for i in range(8)}


@pytest.mark.parametrize("job", ["method", "module"])
def test_a_blocks_nonfinite_input_is_no_model_input(runs, job):
    """Block 0 overflows on steps 0-2, so block 1's input is non-finite; the model's input
    (token ids) never is: no AMP-N04, and the input check ran on every step."""
    run = runs[job]
    steps = run.steps
    assert len(steps) == 6 and steps["input_nonfinite"].notna().all()
    assert (steps["input_nonfinite"] == 0).all()
    diagnosis = amprobe.diagnose(run)
    assert "AMP-N04" not in diagnosis.ids()
    assert "AMP-N04" not in {n.id for n in diagnosis.not_checked}, "checked, and clean"
    offenders = run.table("offenders")
    assert "input" not in set(offenders["kind"])
    assert set(offenders["module"]) - {"<loss>"} <= USER_NAMES


@pytest.mark.parametrize("job", ["method", "module"])
def test_the_planted_layer_in_a_compiled_block_is_amp_n05(runs, job):
    """AMP-N05 (not skipped for a non-finite model input any more) names block 0's booster.
    Its statistics come from inside the compiled block (collectors.graphstats)."""
    n05 = _findings(runs[job])["AMP-N05"]
    assert n05.evidence["module"] == BOOSTER
    assert n05.evidence["step"] == 0


# -- wrappers ----------------------------------------------------------------------------------
def test_a_ddp_models_layers_carry_no_module_prefix(runs):
    """DDP is the module the job calls (its hooks check the inputs) and the layers are named
    from the model inside it, as FSDP2 names them: numerics, offenders, compute and findings."""
    run = runs["ddp"]
    (model,) = run.events_of("model_registered")
    assert (model["model_class"], model["wrappers"]) == ("Transformer", ["DistributedDataParallel"])
    numerics = set(run.table("numerics")["module"])
    assert {n for n in numerics if not n.startswith("<")} <= USER_NAMES
    assert {"embedding", "output", BOOSTER} <= numerics
    ops, _ = latest_capture(run)
    assert set(ops["module"]) - {"Transformer"} <= USER_NAMES, set(ops["module"])
    findings = _findings(run)
    assert findings["AMP-N05"].evidence["module"] == BOOSTER
    for finding in findings.values():
        text = finding.title + json.dumps(finding.evidence, default=str)
        assert "module.layers" not in text and "module.embedding" not in text, finding.id


class _Wrapper(nn.Module):
    """A wrapper of the given class name holding ``inner`` as child ``attr``."""

    def __init__(self, inner: nn.Module, attr: str) -> None:
        super().__init__()
        self.add_module(attr, inner)


def _wrap(inner: nn.Module, cls: str, attr: str) -> nn.Module:
    return type(cls, (_Wrapper,), {})(inner, attr)


@pytest.mark.parametrize(
    "cls, attr",
    [
        ("DistributedDataParallel", "module"),
        ("DataParallel", "module"),
        ("Float16Module", "module"),
        ("DeepSpeedEngine", "module"),
        ("FullyShardedDataParallel", "_fsdp_wrapped_module"),
        ("CheckpointWrapper", "_checkpoint_wrapped_module"),
    ],
)
def test_wrappers_are_seen_through_by_name(cls, attr):
    net = nn.Sequential(nn.Linear(2, 2))
    wrapped = _wrap(net, cls, attr) if cls != "CheckpointWrapper" else _checkpointed(net)
    assert user_model(wrapped) is net
    assert wrapper_classes(wrapped) == [type(wrapped).__name__]
    assert user_class_name(wrapped) == "Sequential"


def _checkpointed(net: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(net)


def test_wrappers_around_wrappers_and_plain_modules():
    net = nn.Sequential(nn.Linear(2, 2))
    outer = _wrap(_wrap(net, "Float16Module", "module"), "DistributedDataParallel", "module")
    assert user_model(outer) is net
    assert wrapper_classes(outer) == ["DistributedDataParallel", "Float16Module"]
    compiled = torch.compile(net, backend="eager")  # nothing is compiled until it is called
    assert user_model(compiled) is net and wrapper_classes(compiled) == ["OptimizedModule"]
    assert user_model(net) is net and wrapper_classes(net) == []
    # a user's own child named `module` is no wrapper: its name stays
    own = nn.Module()
    own.module = nn.Linear(2, 2)
    assert user_model(own) is own
    assert user_module_name("layers.0._orig_mod.mlp") == "layers.0.mlp"


# -- finding the root up the module tree ----------------------------------------------------------
class _Trainer(nn.Module):
    """A module around the model that adds no parameter (a LightningModule, say)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def test_root_of_a_block_is_the_lowest_container_holding_every_trained_parameter():
    model = _blocks_module().Transformer()
    trainer = _Trainer(model)
    trained = {id(p) for p in model.parameters()}
    live = [trainer, *model.modules()]
    block = model.layers[0]
    assert root_of(block, lambda p: id(p) in trained, lambda: live) is model, "not the trainer"
    # only the blocks trained (the embedding and output frozen): the model holding both blocks
    only = {id(p) for p in model.layers.parameters()}
    assert root_of(block, lambda p: id(p) in only, lambda: live) is model.layers


def test_root_of_a_block_compiled_before_it_is_put_back():
    """`layers[i] = torch.compile(block)` with the optimizer made first: torch.compile is seen
    before the assignment, when nothing holds the wrapper yet and the block is still in place."""
    model = _blocks_module().Transformer()
    trained = {id(p) for p in model.parameters()}
    wrapper = torch.compile(model.layers[0], backend="eager")  # compiles nothing until called
    live = [wrapper, *model.modules()]
    assert root_of(wrapper, lambda p: id(p) in trained, lambda: live) is model
    model.layers[0] = wrapper  # then the assignment: the same root, through the wrapper
    live = [*model.modules()]
    assert root_of(wrapper, lambda p: id(p) in trained, lambda: live) is model


def test_root_of_a_module_holding_every_trained_parameter_costs_no_scan():
    model = _blocks_module().Transformer()
    trained = {id(p) for p in model.parameters()}
    total = sum(p.numel() for p in model.parameters())

    def no_scan() -> list[nn.Module]:
        raise AssertionError("scanned the live modules")

    assert root_of(model, lambda p: id(p) in trained, no_scan, total) is model
    assert root_of(model.layers[0], lambda p: True, no_scan) is model.layers[0], "never raises"


# -- fallbacks and "root unknown" -----------------------------------------------------------------
def _loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    before_step: Any = None,
    after_step: Any = None,
) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        if before_step is not None:
            before_step()
        opt.step()
        if after_step is not None:
            after_step()
        opt.zero_grad()
        model.zero_grad()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_fp32_main_parameters_find_their_model(tmp_path):
    """Megatron-style: the optimizer holds fp32 copies of the model's parameters, no module's.
    The module called at top level whose parameters they copy is the root."""
    model = _net()
    main = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.SGD(main, lr=0.01)

    def to_main() -> None:
        for m, p in zip(main, model.parameters(), strict=True):
            m.grad = p.grad.clone()

    def from_main() -> None:
        with torch.no_grad():
            for m, p in zip(main, model.parameters(), strict=True):
                p.copy_(m)

    with amprobe.attach(run_dir=tmp_path / "r", config={"numerics_every": 1}):
        _loop(model, opt, 4, to_main, from_main)
    run = amprobe.load_run(tmp_path / "r")
    models = run.events_of("model_registered")
    assert [(m["model_class"], m["found_by"]) for m in models] == [
        ("Sequential", "optimizer_copies")
    ]
    assert {"0", "2"} <= set(run.table("numerics")["module"])
    assert run.steps["input_nonfinite"].iloc[1:].notna().all()


def test_flattened_partitions_find_the_model_by_its_gradients(tmp_path):
    """ZeRO-style: the optimizer updates one flat fp32 buffer (no shape of the model's): the
    module called at top level whose parameters hold gradients at the step's end is the root."""
    model = _net()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).requires_grad_(True)
    opt = torch.optim.SGD([flat], lr=0.01)

    def to_flat() -> None:
        flat.grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    with amprobe.attach(run_dir=tmp_path / "r"):
        _loop(model, opt, 3, to_flat)
    models = amprobe.load_run(tmp_path / "r").events_of("model_registered")
    assert [(m["model_class"], m["found_by"]) for m in models] == [("Sequential", "gradients")]


def test_no_way_finds_a_root_says_root_unknown(tmp_path):
    """A frozen module called with gradients enabled while the optimizer trains a bare tensor:
    nothing is guessed; the reason starts with "root unknown" and reaches the diagnosis
    instead of "add 'numerics' to Config.collectors" (numerics is on by default)."""
    model = _net().requires_grad_(False)
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    with amprobe.attach(run_dir=tmp_path / "r"):
        for _ in range(4):
            loss = (model(torch.randn(2, 8)) - w).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    run = amprobe.load_run(tmp_path / "r")
    assert not run.events_of("model_registered")
    (failed,) = run.events_of("discovery_failed")
    assert failed["reason"].startswith(f"{ROOT_UNKNOWN}: 1 module(s) called at top level")
    reasons = {n.id: n.reason for n in amprobe.diagnose(run).not_checked}
    for rule in ("AMP-N05", "AMP-N04"):
        assert ROOT_UNKNOWN in reasons[rule] and "Config.collectors" not in reasons[rule], rule
    assert FOUND_BY == ("attach", "engine", "optimizer", "optimizer_copies", "gradients")


def test_the_megatron_job_under_amprobe_run_finds_its_root(runs):
    """fp16 parameters, fp32 main parameters in the optimizer, torch.compile in use (Megatron's
    fused functions): the model is found by the copies its optimizer holds, and measured."""
    if "megatron" not in runs:
        pytest.skip("megatron-core is not installed")
    run = runs["megatron"]
    models = run.events_of("model_registered")
    assert [(m["model_class"], m["found_by"]) for m in models] == [("BlowNet", "optimizer_copies")]
    assert {"embed", "head"} <= set(run.table("numerics")["module"])
    report = amprobe.diagnose(run)
    reasons = [n.reason for n in report.not_checked]
    assert not any("Config.collectors" in r or ROOT_UNKNOWN in r for r in reasons), reasons
    # BlowNet overflows in its own forward (h * 1e6 between embed and head): the root runs
    # eagerly (only Megatron's fused functions are compiled), so its own-code check names it
    (n05,) = [f for f in report.findings if f.id == "AMP-N05"]
    assert n05.title.startswith("<root> (BlowNet)") and "its own code" in n05.title


# -- what the diagnosis says when numerics are missing --------------------------------------------
@pytest.mark.parametrize(
    "config, events, expected",
    [
        ({"collectors": ["scaler"]}, [], "add 'numerics' to Config.collectors"),
        ({"collectors": ["numerics"], "numerics_every": 0}, [], "numerics_every=0"),
        (
            {"collectors": ["numerics"]},
            [{"kind": "discovery_failed", "reason": "root unknown: why"}],
            "no root model was known (root unknown: why)",
        ),
        ({}, [], "no root model was known (root unknown: no root model was registered)"),
        (
            {"collectors": ["numerics"]},
            [{"kind": "model_registered", "model_class": "Net"}],
            "no sampled step measured a layer",
        ),
    ],
)
def test_why_numerics_are_missing(config, events, expected):
    run = fake_run(steps=[{"step": 0}], events=events, manifest={"config": config})
    assert expected in numerics_missing_reason(run)


def test_older_runs_are_read_with_their_names_as_recorded():
    """A run recorded before names were taken from the user's model (DDP's `module.` kept) is
    read as it is: nothing renames its layers."""
    rows = [
        {"step": 0, "module": "module.blocks.1.mlp.booster", "module_type": "Booster"},
    ]
    offenders = [{**r, "kind": "forward", "detail": "{}"} for r in rows]
    numerics = [{**r, "kind": "output", "elements": 4, "inf": 4, "nan": 0} for r in rows]
    run = fake_run(
        steps=[{"step": 0}],
        events=[{"kind": "model_registered", "model_class": "DistributedDataParallel"}],
        tables={"offenders": offenders, "numerics": numerics},
    )
    n05 = _findings(run)["AMP-N05"]
    assert n05.evidence["module"] == "module.blocks.1.mlp.booster"
