"""`amprobe run` / `baseline` / `compare` on plain scripts, in real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import amprobe
from amprobe.analysis.compute import latest_capture
from tests.helpers import amprobe_cli, torchrun_argv

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def run_script(
    tmp_path: Path, mode: str, steps: int = 8, *extra: str
) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / f"run-{mode}"
    proc = amprobe_cli(
        "run",
        "--out",
        str(out),
        "--",
        sys.executable,
        str(SCRIPTS / "train_amp.py"),
        mode,
        str(steps),
        *extra,
        cwd=tmp_path,
    )
    return proc, out


def test_fp16_script_recorded_like_attach(tmp_path):
    proc, out = run_script(tmp_path, "fp16")
    assert proc.returncode == 0, proc.stderr
    assert "trained 8 steps" in proc.stdout, "the child's output passes through"
    assert "amprobe: recorded 8 steps" in proc.stderr
    run = amprobe.load_run(out)
    assert run.status == "finished"
    assert list(run.steps["step"]) == list(range(8))
    assert run.steps.set_index("step").loc[3, "skipped"]
    assert run.rank_manifest["launched_by"] == "amprobe run"
    models = run.events_of("model_registered")
    assert len(models) == 1 and models[0]["model_class"] == "Sequential"
    # the same findings as attaching in code: one cut, fp16 on a bf16-capable CPU
    assert "AMP-N01" in amprobe.diagnose(run).ids()


@pytest.mark.parametrize("mode, dtype", [("bf16", "bfloat16"), ("fp32", None)])
def test_scripts_without_scaler(tmp_path, mode, dtype):
    proc, out = run_script(tmp_path, mode, 6)
    assert proc.returncode == 0, proc.stderr
    run = amprobe.load_run(out)
    assert len(run.steps) == 6
    assert not run.steps["scaler_enabled"].any()
    seen = set(run.steps["autocast_dtype"].dropna())
    assert seen == ({dtype} if dtype else set())


def test_script_without_model_or_scaler_is_recorded(tmp_path):
    proc, out = run_script(tmp_path, "nomodel", 5)
    assert proc.returncode == 0, proc.stderr
    run = amprobe.load_run(out)
    assert list(run.steps["step"]) == list(range(5))
    assert run.steps["loss"].notna().all()
    assert run.events_of("discovery_failed"), "no root module: said so, not guessed"
    diagnosis = amprobe.diagnose(run)
    assert "AMP-N02" in {n.id for n in diagnosis.not_checked}


def test_several_models_are_all_watched_and_named_apart(tmp_path):
    """Issue 19 item 1: the AMP examples' two models, two losses, two optimizers, one scaler,
    with an overflow planted in the second model (unnamed Sequentials both)."""
    out = tmp_path / "run"
    proc = amprobe_cli(
        "run",
        "--out",
        str(out),
        "--",
        sys.executable,
        str(SCRIPTS / "train_two_models.py"),
        "8",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    run = amprobe.load_run(out)
    models = run.events_of("model_registered")
    assert [(m["name"], m["trainable_parameters"]) for m in models] == [
        ("model0", 676),
        ("model1", 508),
    ], "both roots, named as the script names them"
    # layers are named apart: the second model's widths are filed under its own names
    ops, _ = latest_capture(run)
    forward = ops[ops["phase"] == "forward"].set_index("module")
    assert sorted(forward.index) == ["model0.0", "model0.2", "model1.0", "model1.2"]
    assert forward.loc["model0.0", "n"] == 32 and forward.loc["model1.0", "n"] == 24
    numerics = run.table("numerics")
    assert {"model0.0", "model1.0"} <= set(numerics["module"])
    findings = {f.id: f for f in amprobe.diagnose(run).findings}
    n05 = findings["AMP-N05"]
    assert n05.evidence["module"] == "model1.0", "the overflow is in the second model"
    assert findings["AMP-S02"].evidence["trainable_param_count"] == 676 + 508


def test_crashing_script_keeps_exit_code_and_is_recorded(tmp_path):
    proc, out = run_script(tmp_path, "crash", 10)
    assert proc.returncode == 1
    assert "planted crash" in proc.stderr
    run = amprobe.load_run(out)
    assert list(run.steps["step"]) == [0, 1, 2, 3]


def test_script_that_attaches_itself_is_not_instrumented_twice(tmp_path):
    own = tmp_path / "own"
    proc, out = run_script(tmp_path, "attach", 5, str(own))
    assert proc.returncode == 0, proc.stderr
    run = amprobe.load_run(out)
    assert len(run.steps) == 5, "one probe, one record per step"
    assert not own.exists(), "attach() joined the automatic probe instead of starting a second one"


def test_dataloader_workers_do_not_write(tmp_path):
    proc, out = run_script(tmp_path, "dataloader", 6)
    assert proc.returncode == 0, proc.stderr
    run = amprobe.load_run(out)
    assert len(run.ranks) == 1 and len(run.steps) == 6 and not run.warnings


def test_non_python_command_and_missing_command(tmp_path):
    proc = amprobe_cli(
        "run", "--out", str(tmp_path / "x"), "--", "sh", "-c", "exit 7", cwd=tmp_path
    )
    assert proc.returncode == 7
    assert "nothing to diagnose" in proc.stderr
    proc = amprobe_cli(
        "run", "--out", str(tmp_path / "y"), "--", "no-such-command-xyz", cwd=tmp_path
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "amprobe: error: command not found: no-such-command-xyz"
    )
    proc = amprobe_cli("run", "--out", str(tmp_path / "z"), cwd=tmp_path)
    assert proc.returncode == 2 and "no command given" in proc.stderr


@pytest.mark.slow
def test_torchrun_two_gloo_ranks(tmp_path):
    out = tmp_path / "ddp"
    proc = amprobe_cli(
        "run",
        "--out",
        str(out),
        "--",
        *torchrun_argv(),
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    run = amprobe.load_run(out)
    assert [r.rank for r in run.ranks] == [0, 1]
    assert run.steps.groupby("rank").size().to_dict() == {0: 12, 1: 12}
    assert {r.manifest["world_size"] for r in run.ranks} == {2}


def test_baseline_and_compare(tmp_path):
    out = tmp_path / "ab"
    proc = amprobe_cli(
        "baseline",
        "--steps",
        "12",
        "--out",
        str(out),
        "--",
        sys.executable,
        str(SCRIPTS / "train_amp.py"),
        "fp16",
        "40",
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert "speedup" in proc.stdout
    baseline_stdout = proc.stdout
    fp32, amp = amprobe.load_run(out / "fp32"), amprobe.load_run(out / "amp")
    assert len(fp32.steps) == 12 and len(amp.steps) == 12, "each run stops cleanly after --steps"
    assert fp32.steps["autocast_dtype"].isna().all() and not fp32.steps["scaler_enabled"].any()
    assert set(amp.steps["autocast_dtype"].dropna()) == {"float16"}
    comparison = json.loads((out / "comparison.json").read_text())
    # throughput = 1 / median step time after the 2 warm-up steps, computed here independently
    expected = fp32.steps["wall_s"].iloc[2:].median() / amp.steps["wall_s"].iloc[2:].median()
    assert comparison["speedup"] == pytest.approx(expected)
    # memory: host RSS on a CPU run (the runtime collector records it every step)
    assert comparison["memory_kind"] == "host RSS"
    assert comparison["memory_ratio"] == pytest.approx(
        amp.steps["rss_bytes"].max() / fp32.steps["rss_bytes"].max()
    )
    health = amprobe.diagnose(amp).health
    assert health["speedup"]["value"] == pytest.approx(comparison["speedup"])
    # amprobe turned the script's autocast and GradScaler off on the FP32 leg: no AMP-S05
    # "autocast-ineffective" error of its own making, only "not checked" with the reason
    fp32_diagnosis = amprobe.diagnose(fp32)
    assert "AMP-S05" not in fp32_diagnosis.ids()
    reasons = {n.id: n.reason for n in fp32_diagnosis.not_checked}
    assert reasons["AMP-S05"] == "the FP32 leg of `amprobe baseline` (amprobe forced fp32)"
    proc = amprobe_cli(
        "compare", str(out / "fp32"), str(out / "amp"), "--format", "json", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["speedup"] == pytest.approx(comparison["speedup"])
    text = amprobe_cli("compare", str(out / "fp32"), str(out / "amp"), cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert text.stdout in baseline_stdout, "baseline prints what compare prints"
