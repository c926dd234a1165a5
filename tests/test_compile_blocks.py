"""Large-model compile shapes: a transformer whose blocks are compiled one by one
(``fullgraph=True``, as torchtitan does, after activation checkpointing), at depth, and the
fp16 inductor job whose sampled steps once computed different numbers (issue 31).

Every job runs tests/scripts/train_blocks.py in a fresh process, plain and under
``amprobe run`` (or ``attach``), with a backend wrapped to count compiled graphs and their
calls; each probed job is compared with its plain twin on graph calls per step, graphs compiled
(plain's plus at most one sampled variant each), graph breaks and every step's loss, bit for
bit, sampled and armed steps included. A job that fails or runs past its deadline fails the
tests that read it, with its own message, not the whole module.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import amprobe
from tests.helpers import run_gloo_job, run_jobs, torchrun_argv

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_blocks.py"
TIMEOUT_S = 420

# job -> (how amprobe is attached: plain | run | attach, script arguments)
_SHAPES: dict[str, tuple[str, ...]] = {
    "deep10": ("--blocks", "10", "--fullgraph", "--dtype", "fp16", "--plant", "2"),
    "deep32": ("--blocks", "32", "--fullgraph", "--dtype", "bf16", "--steps", "4"),
    "ac-fp16-inductor": ("--blocks", "2", "--fullgraph", "--ac", "--backend", "inductor"),
    "bf16-inductor": ("--blocks", "2", "--fullgraph", "--dtype", "bf16", "--backend", "inductor"),
    # issue 31 section 5: fp16, a LayerNorm between two Linear layers, inductor, an overflow
    # at step 20 arming the next steps' samples
    "mlp-fp16-inductor": (
        "--model", "mlp", "--backend", "inductor", "--steps", "26", "--overflow-at", "20",
    ),
    # torchtitan's order on 2 gloo ranks: activation checkpointing, each block compiled
    # (fullgraph), then fully_shard of each block and the root; fp16 params with a
    # ShardedGradScaler and a planted overflow, and bf16
    "titan-fp16": (
        "--fsdp", "--ac", "--blocks", "2", "--fullgraph", "--dtype", "fp16", "--plant", "2",
        "--steps", "6",
    ),
    "titan-bf16": ("--fsdp", "--ac", "--blocks", "2", "--fullgraph", "--dtype", "bf16"),
}  # fmt: skip
JOBS: dict[str, tuple[str, tuple[str, ...]]] = {}
for _shape, _args in _SHAPES.items():
    JOBS[f"{_shape}-plain"] = ("plain", _args)
    JOBS[f"{_shape}-run"] = ("run", _args)
JOBS["deep10-attach"] = ("attach", _SHAPES["deep10"])
# block statistics of the GEMM operands off (issue 36): the probed jobs above have them on
NO_BLOCKS = ("deep10", "bf16-inductor")
for _shape in NO_BLOCKS:
    JOBS[f"{_shape}-noblocks"] = ("run-noblocks", _SHAPES[_shape])


def _run_job(root: Path, job: str) -> dict[str, Any]:
    how, args = JOBS[job]
    out = root / f"{job}.json"
    run_dir = root / f"{job}-run"
    script = [sys.executable, str(SCRIPT), str(out), *args]
    if "--fsdp" in args:  # two ranks; each writes its own file
        script = [*torchrun_argv(SCRIPT.name), str(out), *args]
    if how.startswith("run"):
        off = ["--set", "block_formats=[]"] if how == "run-noblocks" else []
        argv = [sys.executable, "-m", "amprobe", "run", "--out", str(run_dir), *off, "--", *script]
    elif how == "attach":
        argv = [*script, "--attach", "--run-dir", str(run_dir)]
    else:
        argv = script
    proc = run_gloo_job(argv, run_dir, cwd=root, timeout=TIMEOUT_S)  # (torch's exit abort)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    if "--fsdp" in args:
        ranks = [json.loads(out.with_name(f"{job}-r{r}.json").read_text()) for r in (0, 1)]
        result = dict(ranks[0], steps=ranks[0]["steps"] + ranks[1]["steps"])
    else:
        result = json.loads(out.read_text())
    result["stderr"] = proc.stderr
    result["run_dir"] = run_dir
    return result


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Mapping[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("blocks")
    return run_jobs(JOBS, lambda job: _run_job(root, job))


def _losses(result: dict[str, Any]) -> list[str]:
    return [s["loss"] for s in result["steps"]]


PAIRS = [(f"{shape}-run", f"{shape}-plain") for shape in _SHAPES]
PAIRS.append(("deep10-attach", "deep10-plain"))


@pytest.mark.parametrize("job, plain", PAIRS)
def test_probed_job_computes_and_compiles_what_the_plain_job_does(jobs, job, plain):
    probed, base = jobs[job], jobs[plain]
    assert len(probed["steps"]) == len(base["steps"]), "every step ran"
    assert _losses(probed) == _losses(base), "per-step losses, bit for bit"
    assert [s["scale"] for s in probed["steps"]] == [s["scale"] for s in base["steps"]]
    calls = [s["graph_calls"] for s in probed["steps"]]
    expected = [s["graph_calls"] for s in base["steps"]]
    # a bad step replayed as it ran (issue 34) calls each compiled graph of its forward once
    # more, at the step's end; no other step's calls change, and no graph is added (below)
    replayed = {
        e["step"]
        for e in amprobe.load_run(probed["run_dir"]).events_of("replay")
        if e.get("replayed") and e.get("compiled")
    }
    for step in replayed:
        expected[step] *= 2
    assert calls == expected, "compiled-graph calls per step"
    assert probed["graph_breaks"] == base["graph_breaks"] == 0
    # plain's graphs plus at most one sampled variant of each, at any depth
    assert base["graphs_compiled"] <= probed["graphs_compiled"] <= 2 * base["graphs_compiled"]
    for phrase in ("recompile_limit", "Graph break", "torch._dynamo hit"):
        assert phrase not in probed["stderr"], (phrase, probed["stderr"][-2000:])


@pytest.mark.parametrize(
    "shape", ["deep10", "deep32", "ac-fp16-inductor", "mlp-fp16-inductor", "titan-fp16"]
)
def test_every_compiled_matmul_layer_has_rows_on_sampled_steps(jobs, shape):
    result = jobs[f"{shape}-run"]
    run = amprobe.load_run(result["run_dir"])
    rows = run.table("numerics")
    out = rows[rows["kind"] == "output"]
    assert not out.empty
    first = out[out["step"] == out["step"].min()]
    if shape == "mlp-fp16-inductor":
        assert sorted(first["module"]) == ["fc1", "fc2"]
    else:
        args = _SHAPES[shape]
        blocks = int(args[args.index("--blocks") + 1])
        per_block = ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2", "mlp.booster")
        assert len(first) >= blocks * len(per_block)
        for i in range(blocks):
            for layer in per_block:
                assert f"layers.{i}.{layer}" in set(first["module"]), (i, layer)
        assert "output" in set(first["module"]), "the root's own layers, outside the blocks"
    grads = rows[(rows["kind"] == "grad_output") & (rows["step"] == out["step"].min())]
    assert len(grads) == len(first), "output gradients of the same layers (gradtap)"
    # every layer's three GEMM operands, on the first (budgeted) sample (issue 36)
    step = out["step"].min()
    linear = {"qkv", "proj", "fc1", "fc2", "booster", "output"}  # the scripts' nn.Linear layers
    matmuls = {m for m in first["module"] if m.rsplit(".", 1)[-1] in linear}
    gemm = rows[rows["step"] == step]
    for kind in ("gemm_input", "gemm_weight"):
        assert set(gemm.loc[gemm["kind"] == kind, "module"]) == matmuls
    blocks = run.table("blockstats")
    blocks = blocks[blocks["step"] == step]
    for operand in ("x", "w", "dy"):
        assert set(blocks.loc[blocks["operand"] == operand, "layer"]) == matmuls, operand


@pytest.mark.parametrize("shape", NO_BLOCKS)
def test_block_statistics_change_no_compiled_graph(jobs, shape):
    """Block statistics on (the probed job) and off: the same graphs, called as often."""
    on, off = jobs[f"{shape}-run"], jobs[f"{shape}-noblocks"]
    assert on["graphs_compiled"] == off["graphs_compiled"]
    assert [s["graph_calls"] for s in on["steps"]] == [s["graph_calls"] for s in off["steps"]]
    assert _losses(on) == _losses(off) == _losses(jobs[f"{shape}-plain"])
    assert not amprobe.load_run(off["run_dir"]).table("blockstats").shape[0]
    assert amprobe.load_run(on["run_dir"]).table("blockstats").shape[0]


def test_layers_inductor_fuses_are_said_to_be_not_checked(jobs):
    result = jobs["mlp-fp16-inductor-run"]
    run = amprobe.load_run(result["run_dir"])
    events = run.events
    fused = events[events["kind"] == "numerics_not_checked"]
    details = [json.loads(d) for d in fused["detail"]]
    (event,) = [d for d in details if d.get("what") == "fused_activations"]
    assert "not checked under inductor" in event["reason"]
    assert event["first_at"] == "norm" and event["layers"] == 1


def test_armed_steps_after_an_overflow_are_sampled_and_compute_the_plain_numbers(jobs):
    """The fp16 inductor job overflows at step 20: the next steps are sampled (armed), and
    their losses are plain's (once NaN where plain's was finite)."""
    probed, base = jobs["mlp-fp16-inductor-run"], jobs["mlp-fp16-inductor-plain"]
    run = amprobe.load_run(probed["run_dir"])
    steps = set(run.table("numerics")["step"])
    assert 0 in steps and {21, 22} <= steps
    assert _losses(probed)[21:23] == _losses(base)[21:23]
    assert all(loss != "nan" for loss in _losses(probed)[21:])


@pytest.mark.parametrize("shape", ["deep10", "titan-fp16"])
def test_planted_overflow_in_a_compiled_block_is_named(jobs, shape):
    result = jobs[f"{shape}-run"]
    run = amprobe.load_run(result["run_dir"])
    report = amprobe.diagnose(run)
    n05 = [f for f in report.findings if f.id == "AMP-N05"]
    assert n05, [f.id for f in report.findings]
    assert "layers.0.mlp.booster" in n05[0].title
    offenders = run.table("offenders")
    forward = offenders[offenders["kind"] == "forward"]
    assert set(forward["step"]) >= {3, 4}  # armed by the overflow at step 2
    assert set(forward["module"]) == {"layers.0.mlp.booster"}  # the user's model path
    assert set(forward["rank"]) == {0, 1} if shape.startswith("titan") else {0}
    assert not [f for f in report.findings if f.id == "AMP-N04"], "no false non-finite input"
