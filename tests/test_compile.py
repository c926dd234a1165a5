"""torch.compile: amprobe never changes what the compiler runs, and still sees inside.

Every job runs tests/scripts/train_compiled.py (a 2-block transformer, bf16 autocast) in a fresh
process, whose backend wrapper counts how often a compiled graph runs; plain and probed jobs are
compared on graph calls per step, the compiler's own counters and the exact per-step losses.
The jobs are started together in a small pool (compiling is the slow part).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import amprobe
from amprobe.config import ConfigError
from tests.helpers import JobResults, job_failure, run_jobs

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_compiled.py"
STEPS = 8
LONG = 210
#: How long one job may run (inductor builds C++; minutes on a slow CPU).
JOB_TIMEOUT_S = 600

# (job id) -> (how the model is compiled, how amprobe is attached, extra script args)
JOBS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "module-plain": ("module", "plain", ()),
    "module-run": ("module", "run", ()),
    "module-attach-compiled": ("module", "compiled", ()),
    "module-attach-original": ("module", "original", ()),
    "method-plain": ("method", "plain", ()),
    "method-run": ("method", "run", ()),
    "method-attach": ("method", "compiled", ()),
    "function-plain": ("function", "plain", ()),
    "function-run": ("function", "run", ()),
    "function-attach": ("function", "compiled", ()),
    "eager-run": ("eager", "run", ()),  # the same model and steps, not compiled
    "switch-run": ("module", "run", ("--switch-dtype-at", "5")),
    "plant-run": ("module", "run", ("--plant", "0", "--scaler")),
    "nonum-run": ("module", "run", ("--numerics-off",)),
    "inductor-plain": ("module", "plain", ("--backend", "inductor")),
    "inductor-run": ("module", "run", ("--backend", "inductor")),
    "inductor-nonum-run": ("module", "run", ("--backend", "inductor", "--numerics-off")),
    # long enough for a second per-layer sample (one minimum period, 100 steps, after step 0)
    "long-plain": ("module", "plain", ("--steps", str(LONG))),
    "long-run": ("module", "run", ("--steps", str(LONG))),
}


def _run_job(root: Path, job: str) -> dict[str, Any]:
    how, attach, extra = JOBS[job]
    out = root / f"{job}.json"
    run_dir = root / f"{job}-run"
    sets = ["--set", "numerics_every=0"] if "--numerics-off" in extra else []
    extra = tuple(e for e in extra if e != "--numerics-off")
    script = [sys.executable, str(SCRIPT), str(out), "--how", how, "--steps", str(STEPS), *extra]
    if attach == "run":
        argv = [sys.executable, "-m", "amprobe", "run", "--out", str(run_dir), *sets]
        argv += ["--", *script]
    elif attach == "plain":
        argv = script
    else:
        config = json.dumps({"collectors": ["scaler", "numerics", "compute", "runtime"]})
        argv = [*script, "--attach", attach, "--config", config]
    proc = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, f"{job}: {proc.stderr[-3000:]}"
    result = json.loads(out.read_text())
    result["stderr"] = proc.stderr
    result["run_dir"] = run_dir
    return result


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Mapping[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("compile")
    return run_jobs(JOBS, lambda job: _run_job(root, job))


def test_a_job_that_failed_fails_only_the_tests_that_read_it():
    timed_out = subprocess.TimeoutExpired(["python", "job.py"], JOB_TIMEOUT_S, stderr=b"inductor")
    jobs = JobResults(
        {
            "inductor-plain": job_failure("inductor-plain", timed_out),
            "module-plain": {"steps": []},
            "broken": job_failure("broken", AssertionError("broken: Traceback")),
        }
    )
    assert jobs["module-plain"] == {"steps": []}
    timeout = f"compile job 'inductor-plain' ran past its {JOB_TIMEOUT_S} s timeout"
    with pytest.raises(pytest.fail.Exception, match=timeout) as info:
        jobs["inductor-plain"]
    assert "'inductor'" in str(info.value)
    with pytest.raises(pytest.fail.Exception, match="compile job 'broken' failed: Assertion"):
        jobs["broken"]


def _calls(result: dict[str, Any]) -> list[int]:
    return [s["graph_calls"] for s in result["steps"]]


def _losses(result: dict[str, Any]) -> list[str]:
    return [s["loss"] for s in result["steps"]]


@pytest.mark.parametrize(
    "job, plain",
    [
        ("module-run", "module-plain"),
        ("module-attach-compiled", "module-plain"),
        ("module-attach-original", "module-plain"),
        ("method-run", "method-plain"),
        ("method-attach", "method-plain"),
        ("function-run", "function-plain"),
        ("inductor-run", "inductor-plain"),
    ],
)
def test_probed_job_runs_the_same_graphs_with_the_same_losses(jobs, job, plain):
    """Default configuration: per-layer numerics sample step 0 inside the graph (its own graph
    variant, compiled once: one more frame and graph than plain, then none)."""
    probed, base = jobs[job], jobs[plain]
    assert _calls(base) == [1] * STEPS, "the plain job runs one compiled graph per step"
    assert _calls(probed) == _calls(base), "compiled-graph calls per step"
    assert probed["graph_breaks"] == base["graph_breaks"] == 0
    for counter in ("unique_graphs", "frames_total"):
        assert base[counter] <= probed[counter] <= base[counter] + 1, counter
    # inductor too: the sampled variant's reductions read what the graph already computes
    assert _losses(probed) == _losses(base), "per-step losses, bit for bit"


@pytest.mark.parametrize(
    "job, plain", [("nonum-run", "module-plain"), ("inductor-nonum-run", "inductor-plain")]
)
def test_without_per_layer_samples_everything_is_the_plain_jobs(jobs, job, plain):
    probed, base = jobs[job], jobs[plain]
    assert _calls(probed) == _calls(base) == [1] * STEPS
    for counter in ("unique_graphs", "graph_breaks", "frames_total"):
        assert probed[counter] == base[counter], counter
    assert _losses(probed) == _losses(base), "per-step losses, bit for bit"


def test_train_step_compiled_before_attach_compiles_one_variant_only(jobs):
    """A compiled function made before attach() is only known once it ran: step 0's sampled
    hooks return at once inside the graph; removing them compiles one variant, then no step
    recompiles (README: torch.compile)."""
    probed, base = jobs["function-attach"], jobs["function-plain"]
    assert _calls(probed) == _calls(base) == [1] * STEPS
    assert probed["graph_breaks"] == 0
    assert probed["unique_graphs"] <= base["unique_graphs"] + 1
    assert _losses(probed) == _losses(base)


@pytest.mark.parametrize("job", ["module-run", "method-run", "function-run", "inductor-run"])
def test_nothing_printed_by_torch_because_of_amprobe(jobs, job):
    err = jobs[job]["stderr"]
    for phrase in ("global hooks", "Graph break", "recompil", "torch._dynamo hit"):
        assert phrase not in err, (phrase, err[-2000:])
    plain_err = jobs[job.replace("-run", "-plain")]["stderr"]
    assert "Warning" not in err.replace(plain_err, "")


def test_compiled_run_names_layers_as_written_and_records_compiled_shapes(jobs):
    run = amprobe.load_run(jobs["module-run"]["run_dir"])
    ops = run.table("compute_ops")
    assert not ops.empty
    modules = set(ops["module"])
    assert not any("_orig_mod" in m for m in modules)
    assert {"blocks.0.qkv", "blocks.1.out", "head"} <= modules
    qkv = ops[(ops["module"] == "blocks.0.qkv") & (ops["phase"] == "forward")].iloc[0]
    # x [4, 16, 32] @ W[96, 32]^T in bf16: the GEMM that ran, named from the compiled graph
    assert (qkv["m"], qkv["n"], qkv["k"]) == (64, 96, 32)
    assert qkv["in_dtype"] == "bfloat16"
    assert set(ops[ops["module"] == "blocks.0.qkv"]["phase"]) == {"forward", "backward"}
    numerics = run.table("numerics")
    assert not numerics.empty and not numerics["module"].str.contains("_orig_mod").any()
    # parameter gradients measured outside the graph, outputs by the in-graph statistics of
    # step 0, output gradients by their taps in the compiled backward; the matmul layers' GEMM
    # operands (issue 36) from the same in-graph hand-over
    assert set(numerics["kind"]) == {
        "grad_param", "grad_output", "output", "gemm_input", "gemm_weight"
    }  # fmt: skip
    outputs = numerics[numerics["kind"] == "output"]
    assert set(outputs["step"]) == {0} and "blocks.0.qkv" in set(outputs["module"])
    assert "TinyGPT" not in set(outputs["module_type"]), "the root's own hooks are not in it"
    diagnosis = amprobe.diagnose(run)
    text = json.dumps([f.title + f.fix for f in diagnosis.findings])
    assert "_orig_mod" not in text
    assert "(torch.compile)" not in text, "no advice to compile a compiled model"
    assert "AMP-S08" not in diagnosis.ids()


def test_a_compiled_job_is_sampled_again_without_recompiling(jobs):
    """The first per-layer sample builds the sampled graph variant (seconds: a warm-up, not
    charged to the overhead budget); the second comes one minimum period later, runs the
    variant already built, and is charged what it really costs. Charged the build, the first
    sample spaced the next one hundreds of thousands of steps away."""
    probed, base = jobs["long-run"], jobs["long-plain"]
    assert _calls(probed) == _calls(base) == [1] * LONG
    assert probed["graph_breaks"] == 0
    assert probed["unique_graphs"] <= base["unique_graphs"] + 1
    assert _losses(probed) == _losses(base), "per-step losses, bit for bit"
    run = amprobe.load_run(probed["run_dir"])
    steps = run.steps
    sampled = [int(s) for s in steps.loc[steps["numerics_sampled"].astype(bool), "step"]]
    assert sampled[:2] == [0, 100], sampled
    # the variants were compiled at steps 0 and 1; no later step compiles anything
    assert steps.loc[steps["step"] >= 2, "compile_frames"].sum() == 0
    assert steps["recompiles"].sum() == 0
    outputs = run.table("numerics")
    outputs = outputs[outputs["kind"] == "output"]
    assert {0, 100} <= set(outputs["step"]), "the in-graph statistics of both samples"
    numerics = run.ranks[0].end["sampling"]["kinds"]["numerics"]
    # charged (not None), and at most the warm-up; the steady cost of a sample may be within
    # the step time's noise (the op hands a few small layers to the eager measurement)
    assert numerics["warmup_ms"] > numerics["mean_cost_ms"] >= 0


def test_compile_is_a_recorded_fact(jobs):
    run = amprobe.load_run(jobs["module-run"]["run_dir"])
    facts = run.rank_manifest["compile"]
    assert facts == [
        {
            "target": "TinyGPT",
            "kind": "module",
            "backend": "aot_eager",  # the counting wrapper names what it wraps
            "mode": None,
            "dynamic": None,
            "fullgraph": False,
        }
    ]
    from amprobe.report.render import render_text

    assert "  compiled: TinyGPT (module, aot_eager)\n" in render_text(amprobe.diagnose(run))
    steps = run.steps
    assert steps.loc[0, "compile_frames"] == 1 and steps.loc[0, "compile_graphs"] == 1
    # step 1 compiles the variant without the sampled statistics: amprobe's, not a recompile
    assert list(steps["compile_frames"]) == [1, 1] + [0] * (STEPS - 2)
    assert [e["step"] for e in run.events_of("compiled_variant")] == [1]
    assert steps["recompiles"].sum() == 0 and steps["graph_breaks"].sum() == 0
    method = amprobe.load_run(jobs["method-run"]["run_dir"])
    assert [f["kind"] for f in method.rank_manifest["compile"]] == ["method"]
    function = amprobe.load_run(jobs["function-run"]["run_dir"])
    (fact,) = function.rank_manifest["compile"]
    assert fact["kind"] == "function" and "forward_loss" in fact["target"]
    # autocast inside the compiled function runs in the graph: still the step's precision
    # (a detail: recorded on step 0 and the detail steps)
    assert set(function.steps["autocast_dtype"].dropna()) == {"bfloat16"}
    assert function.steps["autocast_dtype"].iloc[0] == "bfloat16"
    assert "AMP-S05" not in amprobe.diagnose(function).ids()


#: the numerics columns that the eager hooks and the compiled-region statistics share
_ROW_COLUMNS = [
    "module",
    "module_type",
    "dtype",
    "calls",
    "elements",
    "zeros",
    "nan",
    "inf",
    "finite",
    "over_fp16",
    "below_normal",
    "below_subnormal",
    "underflow_at_scale",
    "loss_scale",
    "amax",
    "in_nonfinite",
    "exp_hist",
]


@pytest.mark.parametrize("kind", ["output", "grad_output"])
def test_compiled_layers_record_the_rows_eager_layers_record(jobs, kind):
    """aot_eager runs the eager kernels: step 0's rows of the compiled model's layers (outputs
    from the in-graph statistics, output gradients from their taps in the compiled backward)
    equal the eager hooks' rows of the same model uncompiled, in the same execution order (the
    root's own rows aside: its hooks run outside the compiled frame)."""
    assert _losses(jobs["module-run"]) == _losses(jobs["eager-run"])

    def rows(job: str) -> Any:
        numerics = amprobe.load_run(jobs[job]["run_dir"]).table("numerics")
        part = numerics[(numerics["kind"] == kind) & (numerics["step"] == 0)]
        return part[part["module"] != "<root>"].sort_values("order")

    compiled, eager = rows("module-run"), rows("eager-run")
    assert len(compiled) == 17 and compiled["exp_hist"].notna().all()
    assert list(compiled["module"]) == list(eager["module"]), "execution order"
    assert set(compiled["dtype"]) == {"bfloat16", "float32"}  # autocast: Linear bf16, LN fp32
    assert (compiled["order"].diff().dropna() > 0).all()
    ordered = [part[_ROW_COLUMNS].reset_index(drop=True) for part in (compiled, eager)]
    pd.testing.assert_frame_equal(*ordered)  # (null where eager writes null)


@pytest.mark.parametrize("job", ["module-run", "inductor-run"])
def test_what_if_reads_the_compiled_layers_activations(jobs, job):
    from amprobe.analysis.whatif import compute_whatif

    run = amprobe.load_run(jobs[job]["run_dir"])
    outputs = run.table("numerics").query("kind == 'output'")
    counted = outputs["exp_hist"].map(lambda text: sum(json.loads(text).values()))
    assert (counted == outputs["elements"]).all(), "every element in one bin"
    whatif = compute_whatif(run)
    acts = whatif[(whatif["kind"] == "output") & (whatif["format"] == "e4m3")]
    assert {"blocks.0.qkv", "blocks.1.out", "head"} <= set(acts["module"])
    assert (acts["nonzero"] > 0).all() and acts["max_exp"].notna().all()


def test_first_nonfinite_layer_inside_a_compiled_model_is_named(jobs):
    """fp16, the booster of block 0 multiplies by 1e6 on step 0: AMP-N05 names it from the
    statistics computed inside the compiled graph, with no graph break."""
    result = jobs["plant-run"]
    assert _calls(result) == [1] * STEPS and result["graph_breaks"] == 0
    run = amprobe.load_run(result["run_dir"])
    offenders = run.table("offenders").set_index("kind")
    assert list(offenders.index) == ["forward", "backward"]
    assert offenders.loc["forward", "module"] == "blocks.0.booster"
    # the loss is inf: the gradient reaching the last layer is non-finite already (as eager)
    assert offenders.loc["backward", "module"] == "<loss>"
    assert json.loads(offenders.loc["backward", "detail"])["first_nonfinite_grad_output"] == "head"
    n05 = [f for f in amprobe.diagnose(run).findings if f.id == "AMP-N05"]
    assert n05 and n05[0].title.startswith("blocks.0.booster (Booster) is the first module")
    numerics = run.table("numerics")
    out = numerics[(numerics["kind"] == "output") & (numerics["step"] == 0)].set_index("module")
    assert out.loc["blocks.0.out", "inf"] == 0 and out.loc["blocks.0.booster", "inf"] > 0
    assert out.loc["blocks.1.ln1", "in_nonfinite"] > 0, "downstream layers saw it coming in"
    assert list(out["order"]) == sorted(out["order"]), "rows in execution order"
    # output gradients from the compiled backward, unscaled by the GradScaler's scale
    grads = numerics[(numerics["kind"] == "grad_output") & (numerics["step"] == 0)]
    assert set(grads["loss_scale"]) == {2.0**16} and len(grads) == len(out)
    head = grads.set_index("module").loc["head"]
    assert head["nan"] == head["elements"] > 0 and head["order"] == 0


def test_recompile_after_warmup_is_amp_s08_with_the_guard(jobs):
    result = jobs["switch-run"]
    assert result["frames_total"] == 3, "the sampling variant and the dtype switch"
    run = amprobe.load_run(result["run_dir"])
    assert int(run.steps.set_index("step").loc[5, "recompiles"]) == 1
    (event,) = run.events_of("recompile")
    assert event["step"] == 5 and "train_compiled.py" in event["where"]
    (finding,) = [f for f in amprobe.diagnose(run).findings if f.id == "AMP-S08"]
    assert "1 recompile(s) after the first 3 steps (steps 5)" in finding.title
    assert "autocast(cpu)_dtype" in event["reason"]
    assert event["reason"].splitlines()[0] in finding.title
    assert "autocast" in finding.fix


def test_numerics_every_zero_is_the_off_switch(tmp_path):
    assert amprobe.Config(numerics_every=0).numerics_every == 0
    with pytest.raises(ConfigError, match="non-negative"):
        amprobe.Config(numerics_every=-1)


def test_a_job_that_compiles_nothing_pays_no_compiler_read_per_step(tmp_path, monkeypatch):
    """The compile collector is not called at step ends until torch.compile is in use: its
    columns are null (not zeros) in a job that compiles nothing."""
    import torch

    from amprobe.capture.collectors import compiled

    calls = []
    real = compiled.CompileCollector.on_step_end
    monkeypatch.setattr(
        compiled.CompileCollector,
        "on_step_end",
        lambda self, *a: (calls.append(a[0]), real(self, *a))[1],
    )
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amprobe.attach(model=model, optimizer=opt, run_dir=tmp_path / "r"):
        for _ in range(5):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    steps = amprobe.load_run(tmp_path / "r").steps
    assert len(steps) == 5 and calls == []
    for col in ("compile_frames", "compile_graphs", "graph_breaks", "recompiles"):
        assert steps[col].isna().all(), col


# -- rule and graph reading on hand-built inputs (no compile) -----------------------------------

COMPILED = {"compile": [{"target": "TinyGPT", "kind": "module", "backend": "inductor"}]}


def _steps(recompiles: dict[int, int], breaks: dict[int, int] | None = None, n: int = 10):
    breaks = breaks or {}
    return [
        {
            "step": s,
            "compile_frames": int(s == 0) + recompiles.get(s, 0),
            "compile_graphs": int(s == 0) + recompiles.get(s, 0),
            "recompiles": recompiles.get(s, 0),
            "graph_breaks": breaks.get(s, 0),
        }
        for s in range(n)
    ]


@pytest.mark.parametrize(
    "recompiles, breaks, manifest, fires",
    [
        ({}, {}, COMPILED, False),  # compiled once, stable
        ({1: 1, 2: 1}, {}, COMPILED, False),  # warm-up recompiles (automatic dynamic shapes)
        ({4: 1, 7: 1}, {}, COMPILED, True),  # recompiles after warm-up
        ({}, {0: 2}, COMPILED, True),  # graph breaks split the model
        ({4: 1}, {}, {}, False),  # nothing compiled: not checked
    ],
)
def test_s08_table(recompiles, breaks, manifest, fires):
    from tests.helpers import fake_run

    events = [
        {
            "kind": "recompile",
            "step": s,
            "function": "forward",
            "where": "model.py:12",
            "reason": "___check_global_state()",
        }
        for s in recompiles
    ] + [{"kind": "graph_break", "step": s, "reason": "Tensor.item"} for s in breaks]
    run = fake_run(steps=_steps(recompiles, breaks), events=events, manifest=manifest)
    diagnosis = amprobe.diagnose(run)
    found = [f for f in diagnosis.findings if f.id == "AMP-S08"]
    assert bool(found) == fires
    if found and recompiles:
        assert "guard failed in forward (model.py:12): ___check_global_state()" in found[0].title
        assert found[0].evidence["recompile_steps"] == sorted(recompiles)
    if not manifest:
        assert "AMP-S08" in {n.id for n in diagnosis.not_checked}


def test_dynamo_module_paths_read_as_written():
    from amprobe.capture.collectors.compiled import stack_module_name, user_module_name

    assert stack_module_name("L['self'].blocks[0]._orig_mod.qkv") == "blocks.0.qkv"
    assert stack_module_name("L['self']._modules['blocks']._modules['0']._modules['fc']") == (
        "blocks.0.fc"
    )
    assert stack_module_name("L['model'].head") == "head"
    assert stack_module_name("L['self']") == ""
    assert user_module_name("_orig_mod.blocks.0") == "blocks.0"
