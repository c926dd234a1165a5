"""Framework loops recorded right: Lightning, the Hugging Face Trainer and accelerate (issue 14).

Real framework loops on tiny models built from configs, random data, CPU, nothing downloaded.
Each framework's tests skip when it is not installed. Runs are shared per module (one
training per scenario) to keep the file quick.

Issue 14's measured defects (loss with accumulation, the closure's phases, step 0 in zero-code
runs, the framework's precision setting, accelerate's state re-placement) each have a test here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import amprobe
from tests.helpers import amprobe_sites

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ROOT = SCRIPTS.parent.parent
FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning")


@pytest.fixture(autouse=True)
def _no_dispatch_mode_left():
    """Every framework test leaves torch's dispatch-mode stack as it found it (issue 13)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    before = len(_get_current_dispatch_mode_stack())
    yield
    assert len(_get_current_dispatch_mode_stack()) == before, "a dispatch mode was left active"


def _script(name: str):
    """Import a script of tests/scripts as a module (its main() runs the loop in-process)."""
    spec = importlib.util.spec_from_file_location(f"_amprobe_test_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _in_process(fn, *args, **kwargs) -> SimpleNamespace:
    """Run ``fn`` with stdout/stderr captured; the run's summary goes to stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = fn(*args, **kwargs)
    return SimpleNamespace(result=result, stdout=out.getvalue(), stderr=err.getvalue())


def _zero_code(tmp: Path, script: str, *args: str, sets: tuple[str, ...] = ()) -> SimpleNamespace:
    """``amprobe run --out tmp/run [--set KEY=VALUE ...] -- python tests/scripts/<script> ARGS``
    in a subprocess."""
    out = tmp / "run"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "amprobe", "run", "--out", str(out)]
        + [arg for kv in sets for arg in ("--set", kv)]
        + ["--", sys.executable]
        + [str(SCRIPTS / script), *args],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return SimpleNamespace(proc=proc, run=amprobe.load_run(out), out=out)


def _micro_losses(stdout: str) -> list[float]:
    return [
        float(line.split()[1]) for line in stdout.splitlines() if line.startswith("micro_loss ")
    ]


def _step_means(values: list[float], accum: int) -> list[float]:
    return [sum(values[i : i + accum]) / accum for i in range(0, len(values), accum)]


def _finding(run, rule_id: str):
    found = [f for f in amprobe.diagnose(run).findings if f.id == rule_id]
    assert found, f"{rule_id} not found"
    return found[0]


# -- import isolation ------------------------------------------------------------------------
def test_import_amprobe_never_imports_a_framework():
    code = (
        "import sys, amprobe, amprobe.integrations, amprobe.integrations._common\n"
        f"loaded = [m for m in {FRAMEWORKS!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "assert 'torch' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


# -- Lightning -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lightning_script():
    pytest.importorskip("lightning")
    return _script("train_lightning")


@pytest.fixture(scope="module")
def lightning_fp16(lightning_script, tmp_path_factory):
    """fp16 on the CPU (explicit MixedPrecision plugin), accumulation 2, overflow at step 3."""
    tmp = tmp_path_factory.mktemp("lightning_fp16")
    out = tmp / "run"
    argv = ["--precision", "fp16-cpu", "--steps", "6", "--accum", "2", "--plant", "blow"]
    argv += ["--plant-step", "3", "--callback", str(out), "--config", '{"numerics_every": 1}']
    argv += ["--root", str(tmp)]
    done = _in_process(lightning_script.main, argv)
    return SimpleNamespace(module=done.result, stdout=done.stdout, stderr=done.stderr, out=out)


def test_lightning_callback_end_to_end(lightning_fp16):
    assert amprobe.current_probe() is None, "teardown closed the probe"
    run = amprobe.load_run(lightning_fp16.out)
    assert run.status == "finished"
    manifest = run.rank_manifest
    assert manifest["framework"] == "lightning"
    assert manifest["framework_precision"] == "16-mixed"
    assert manifest["framework_amp_dtype"] == "float16"
    assert manifest["framework_step_offset"] == 0
    # the precision plugin's scaler was passed at attach, the module registered as the model
    assert [e["created_before_attach"] for e in run.events_of("scaler_created")] == [True]
    assert [e["model_class"] for e in run.events_of("model_registered")] == ["TinyModule"]
    assert run.steps["scaler_enabled"].all()
    # the planted fp16 overflow is found in the right layer, at the right step
    n05 = _finding(run, "AMP-N05")
    assert n05.evidence["module"] == "blow" and n05.evidence["step"] == 3
    assert list(run.steps.loc[run.steps["skipped"], "step"]) == [3]
    # the summary of `amprobe run`, printed at the end of training
    assert (
        f"amprobe: recorded 6 steps on 1 rank(s) in {lightning_fp16.out}" in lightning_fp16.stderr
    )
    assert "AMP-N05" in lightning_fp16.stderr


def test_lightning_gradient_accumulation_counts_optimizer_steps(lightning_fp16):
    run = amprobe.load_run(lightning_fp16.out)
    assert list(run.steps["step"]) == list(range(6)), "6 optimizer steps of 2 micro-batches"
    assert run.steps["opt_steps"].le(1).all()
    assert run.rank_manifest["framework_accumulate_grad_batches"] == 2
    assert not run.events_of("framework_step_mismatch"), "amprobe's step == trainer.global_step"


def test_lightning_callback_config_checked_in_setup(lightning_script, tmp_path):
    from amprobe.integrations.lightning import AmprobeCallback

    callback = AmprobeCallback(tmp_path / "run", config={"no_such_knob": 1})
    module = lightning_script.TinyModule()
    trainer = lightning_script.make_trainer("32-true", 2, 1, [callback], str(tmp_path))
    with pytest.raises(amprobe.ConfigError, match="no_such_knob"):
        trainer.fit(module, lightning_script.data(2, 1))
    assert not (tmp_path / "run").exists(), "nothing attached, nothing written"


def test_lightning_live_metrics_logged(lightning_script, tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from amprobe.integrations.lightning import AmprobeCallback

    callback = AmprobeCallback(tmp_path / "run", config={"syncs_every": 1}, summary=False)
    module = lightning_script.TinyModule("blow", 1)
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    trainer = lightning_script.make_trainer(
        "fp16-cpu", 3, 1, [callback], str(tmp_path), logger=logger
    )
    _in_process(trainer.fit, module, lightning_script.data(3, 1))
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("amprobe/loss_scale")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2], "one row per optimizer step (logging steps)"
    assert float(rows[-1]["amprobe/loss_scale"]) == 32768.0
    assert float(rows[-1]["amprobe/skipped_steps"]) == 1.0
    assert rows[-1]["amprobe/nonfinite_layers"] != ""
    # reading and logging amprobe's metrics is not the job's host-device sync (false AMP-S03)
    sites = set(amprobe.load_run(tmp_path / "run").table("syncs")["site"])
    assert amprobe_sites(sites) == [], sites


def test_amprobe_sites_are_spotted_by_module_not_by_path(tmp_path):
    """Issue 19 item 13: a clone in a folder named amprobe (`git clone .../amprobe`) holds the
    test scripts under `/amprobe/`; only files of the amprobe package are amprobe's sites."""
    package = Path(amprobe.__file__).resolve().parent
    clone_script = tmp_path / "amprobe" / "tests" / "scripts" / "lightning_train.py"
    sites = [f"{clone_script}:42", f"{package / 'probe.py'}:10", "?"]
    assert amprobe_sites(sites) == [f"{package / 'probe.py'}:10"]


def test_lightning_booster_overflow_names_producer_and_place(lightning_script, tmp_path):
    """Issue 14 item 3: fp32 `booster` output beyond fp16's range, cast to half in `head`."""
    out = tmp_path / "run"
    argv = ["--precision", "fp16-cpu", "--steps", "3", "--plant", "booster", "--callback"]
    argv += [str(out), "--config", '{"numerics_every": 1}', "--root", str(tmp_path)]
    _in_process(lightning_script.main, argv)
    n05 = _finding(amprobe.load_run(out), "AMP-N05")
    assert n05.evidence["module"] == "booster", "the producer is the origin"
    assert n05.evidence["overflow_module"] == "head", "the half-precision consumer is the place"
    assert n05.evidence["origin_over_fp16_count"] > 0 and n05.evidence["origin_amax"] > 65504
    assert n05.title.startswith("booster (PlantedLinear)") and "head (Linear)" in n05.title


def test_lightning_loss_matches_logged_loss_with_accumulation(lightning_fp16):
    run = amprobe.load_run(lightning_fp16.out)
    expected = _step_means(lightning_fp16.module.micro_losses, 2)
    recorded = run.steps.set_index("step")["loss"]
    for step in (0, 1, 2, 4, 5):  # step 3 overflowed
        assert recorded[step] == pytest.approx(expected[step], rel=0.01), step


def test_lightning_closure_not_counted_as_optimizer_time(lightning_script, tmp_path):
    out = tmp_path / "run"
    argv = ["--precision", "bf16-mixed", "--steps", "6", "--callback", str(out)]
    argv += ["--root", str(tmp_path), "--width", "1024", "--config", '{"details_every": 1}']
    _in_process(lightning_script.main, argv)
    steps = amprobe.load_run(out).steps.iloc[1:]
    assert steps["fwd_s"].sum() > 0 and steps["bwd_s"].sum() > 0
    # before: opt_s held the whole closure (0.285 s of a 0.286 s step); now only what is
    # neither forward nor backward (the optimizer update and Lightning's closure bookkeeping)
    assert steps["opt_s"].sum() < steps["fwd_s"].sum() + steps["bwd_s"].sum()
    assert steps["opt_s"].sum() < 0.5 * steps["wall_s"].sum()


def test_lightning_texts_on_cpu(lightning_fp16):
    """Issue 14 item 9: S04 names layers (not the root module), says "on a GPU" on a CPU run;
    N16 does not call a run with one scale cut unstable."""
    diagnosis = amprobe.diagnose(amprobe.load_run(lightning_fp16.out))
    s04 = [f for f in diagnosis.findings if f.id == "AMP-S04"]
    assert s04
    for f in s04:
        assert "TinyModule" not in f.title
        assert all(layer["module"] != "TinyModule" for layer in f.evidence["layers"])
    tiles = [f for f in s04 if "tiles" in f.title]
    assert tiles and all("on a GPU" in f.title for f in tiles)
    assert "AMP-N16" not in diagnosis.ids(), "one overflow cut is no instability"


def test_lightning_zero_code(lightning_script, tmp_path):
    done = _zero_code(tmp_path, "train_lightning.py", "--steps", "6", "--accum", "2")
    assert "trained 6 steps" in done.proc.stdout
    assert "amprobe: recorded 6 steps" in done.proc.stderr
    run = done.run
    assert list(run.steps["step"]) == list(range(6))
    assert set(run.steps["autocast_dtype"].dropna()) == {"bfloat16"}
    assert [e["model_class"] for e in run.events_of("model_registered")] == ["TinyModule"]


# -- Hugging Face Trainer --------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_script():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return _script("train_hf")


@pytest.fixture(scope="module")
def hf_bf16(hf_script, tmp_path_factory):
    """bf16, accumulation 2, an overflow planted at step 4 of 6."""
    tmp = tmp_path_factory.mktemp("hf_bf16")
    out = tmp / "run"
    argv = ["--precision", "bf16", "--steps", "6", "--accum", "2", "--plant-step", "4"]
    argv += ["--callback", str(out), "--config", '{"numerics_every": 1}', "--out", str(tmp / "o")]
    from transformers import TrainerCallback

    logs: list[dict] = []

    class Recorder(TrainerCallback):  # runs after amprobe's callback, as a tracker would
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs or {}))

    seen = logs
    done = _in_process(hf_script.main, argv, [Recorder()])
    return SimpleNamespace(
        trainer=done.result, stdout=done.stdout, stderr=done.stderr, out=out, logs=logs
    )


def test_hf_callback_end_to_end(hf_bf16):
    assert amprobe.current_probe() is None, "on_train_end closed the probe"
    run = amprobe.load_run(hf_bf16.out)
    assert run.status == "finished"
    manifest = run.rank_manifest
    assert manifest["framework"] == "transformers"
    assert manifest["framework_precision"] == "bf16"
    assert manifest["framework_amp_dtype"] == "bfloat16"
    assert [e["model_class"] for e in run.events_of("model_registered")] == ["GPT2LMHeadModel"]
    # the user's optimizer inside accelerate's wrapper
    assert {e["optimizer_class"] for e in run.events_of("optimizer_seen")} == {"AdamW"}
    assert set(run.steps["autocast_dtype"].dropna()) == {"bfloat16"}
    n05 = _finding(run, "AMP-N05")
    assert n05.evidence["module"] == "transformer.h.0.mlp.c_proj" and n05.evidence["step"] == 4
    assert f"amprobe: recorded 6 steps on 1 rank(s) in {hf_bf16.out}" in hf_bf16.stderr
    assert "AMP-N05" in hf_bf16.stderr


def test_hf_gradient_accumulation_counts_optimizer_steps(hf_bf16):
    run = amprobe.load_run(hf_bf16.out)
    assert list(run.steps["step"]) == list(range(6))
    assert hf_bf16.trainer.state.global_step == 6
    assert run.rank_manifest["framework_accumulate_grad_batches"] == 2
    assert not run.events_of("framework_step_mismatch"), "amprobe's step == global_step - 1"


def test_hf_integer_inputs_checked(hf_bf16):
    run = amprobe.load_run(hf_bf16.out)
    assert run.steps["input_nonfinite"].notna().all(), "token ids checked from step 0"
    assert "AMP-N04" not in {n.id for n in amprobe.diagnose(run).not_checked}


def test_hf_loss_matches_logged_loss_with_accumulation(hf_bf16):
    run = amprobe.load_run(hf_bf16.out)
    recorded = run.steps.set_index("step")["loss"]
    logged = {e["step"] - 1: e["loss"] for e in hf_bf16.trainer.state.log_history if "loss" in e}
    for step in range(4):  # the Trainer logs global step s + 1 for amprobe step s
        assert recorded[step] == pytest.approx(logged[step], rel=0.01), step


def test_hf_live_metrics_in_logs(hf_bf16):
    """The callback adds its keys to the `logs` that the callbacks after it receive.

    A bf16 run has no GradScaler: no loss scale and no skipped-step count are invented.
    """
    seen = [logs for logs in hf_bf16.logs if "loss" in logs]
    assert seen and all("amprobe/nonfinite_layers" in logs for logs in seen)
    assert not any("amprobe/loss_scale" in logs or "amprobe/skipped_steps" in logs for logs in seen)
    assert seen[-1]["amprobe/nonfinite_layers"] > 0


def test_hf_fp16_on_cpu_not_active_is_s05(hf_script, tmp_path):
    """Issue 14 item 8 through the callback: fp16=True on a CPU trains in fp32 silently."""
    out = tmp_path / "run"
    argv = ["--precision", "fp16", "--steps", "3", "--callback", str(out), "--out", str(tmp_path)]
    _in_process(hf_script.main, argv)
    run = amprobe.load_run(out)
    assert run.steps["autocast_dtype"].isna().all(), "the Trainer ran no autocast region"
    s05 = _finding(run, "AMP-S05")
    assert "TrainingArguments(fp16=True)" in s05.title
    assert s05.evidence["framework_precision_setting"] == "TrainingArguments(fp16=True)"


@pytest.fixture(scope="module")
def hf_zero_code(hf_script, tmp_path_factory):
    """`amprobe run` on the Trainer script, fp16=True on the CPU, accumulation 2."""
    tmp = tmp_path_factory.mktemp("hf_zero_code")
    # every step's phases timed: step 0's forward time shows the root model known at step 0
    return _zero_code(
        tmp,
        "train_hf.py",
        *("--precision", "fp16", "--steps", "5", "--accum", "2"),
        sets=("details_every=1",),
    )


def test_hf_zero_code(hf_zero_code):
    assert "trained 5 steps" in hf_zero_code.proc.stdout
    assert "amprobe: recorded 5 steps" in hf_zero_code.proc.stderr
    run = hf_zero_code.run
    assert list(run.steps["step"]) == list(range(5))
    assert [e["model_class"] for e in run.events_of("model_registered")] == ["GPT2LMHeadModel"]
    assert {e["optimizer_class"] for e in run.events_of("optimizer_seen")} == {"AdamW"}


def test_hf_zero_code_step_0_not_blind(hf_zero_code):
    first = hf_zero_code.run.steps.iloc[0]
    assert first["input_nonfinite"] == 0 and first["fwd_s"] > 0


def test_hf_zero_code_integer_inputs_checked(hf_zero_code):
    """Issue 14 item 6, second half: token ids are checked (not "inputs were not checked")."""
    steps = hf_zero_code.run.steps
    assert steps["input_nonfinite"].iloc[1:].eq(0).all()
    assert "AMP-N04" not in {n.id for n in amprobe.diagnose(hf_zero_code.run).not_checked}


def test_hf_zero_code_fp16_not_active_is_s05(hf_zero_code):
    s05 = _finding(hf_zero_code.run, "AMP-S05")
    assert "fp16=True" in s05.title


# -- accelerate ------------------------------------------------------------------------------
@pytest.fixture()
def accelerate_script():
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    # accelerate keeps one process-wide state; an earlier Trainer in this process set it
    AcceleratorState._reset_state(reset_partial_state=True)
    yield _script("train_accelerate")
    AcceleratorState._reset_state(reset_partial_state=True)


def test_accelerate_attach_with_nothing_passed(accelerate_script, tmp_path):
    """No callback needed: attach() finds the prepared optimizer and the loop's scaler."""
    out = tmp_path / "run"
    argv = ["--precision", "fp16-manual", "--steps", "5", "--accum", "2", "--attach", str(out)]
    _in_process(accelerate_script.main, argv)
    run = amprobe.load_run(out)
    assert list(run.steps["step"]) == list(range(5)), "one step per optimizer step"
    assert run.steps["scaler_enabled"].all() and run.steps["scale_before"].eq(1024.0).all()
    assert "SGD" in {e["optimizer_class"] for e in run.events_of("optimizer_seen")}
    assert set(run.steps["autocast_dtype"].dropna()) == {"float16"}
    # the prepared model is found at its first forward: per-layer numerics as if it were passed
    assert len(run.events_of("model_registered")) == 1
    assert not run.table("numerics").empty


def test_accelerate_prepare_is_no_restore(accelerate_script, tmp_path):
    out = tmp_path / "run"
    argv = ["--precision", "fp16-manual", "--steps", "4", "--attach", str(out)]
    _in_process(accelerate_script.main, argv)
    assert "AMP-N10" not in amprobe.diagnose(amprobe.load_run(out)).ids()


def test_accelerate_loss_matches_loop_loss_with_accumulation(accelerate_script, tmp_path):
    out = tmp_path / "run"
    argv = ["--precision", "bf16", "--steps", "4", "--accum", "2", "--attach", str(out)]
    done = _in_process(accelerate_script.main, argv)
    expected = _step_means(_micro_losses(done.stdout), 2)
    recorded = list(amprobe.load_run(out).steps["loss"])
    assert recorded == pytest.approx(expected, rel=0.01)


@pytest.fixture(scope="module")
def accelerate_zero_code(tmp_path_factory):
    """`amprobe run` on the accelerate script, mixed_precision="fp16" on the CPU."""
    pytest.importorskip("accelerate")
    tmp = tmp_path_factory.mktemp("accelerate_zero_code")
    return _zero_code(tmp, "train_accelerate.py", "--precision", "fp16", "--steps", "5")


def test_accelerate_zero_code(accelerate_zero_code):
    assert "trained 5 steps" in accelerate_zero_code.proc.stdout
    assert "amprobe: recorded 5 steps" in accelerate_zero_code.proc.stderr
    run = accelerate_zero_code.run
    assert list(run.steps["step"]) == list(range(5))
    assert [e["model_class"] for e in run.events_of("model_registered")] == ["Sequential"]


def test_accelerate_zero_code_fp16_not_active_is_s05(accelerate_zero_code):
    s05 = _finding(accelerate_zero_code.run, "AMP-S05")
    assert "mixed_precision" in s05.title
