"""The command line: positive paths on demo runs, and one-line errors for every kind of bad input."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from amprobe.cli import main
from amprobe.demo import train
from amprobe.rules import REGISTRY

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Three short demo runs: planted errors, a warning-only run, and a clean run."""
    root = tmp_path_factory.mktemp("cli-runs")
    made = {}
    for name, faults, steps in (
        ("faulty", ("overflow", "clip_before_unscale"), 40),
        ("half", ("half_loss",), 20),
        ("clean", (), 20),
    ):
        made[name] = train(root / name, faults=faults, steps=steps).run_dir
    return made


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``amprobe.cli.main`` in process; argparse's SystemExit is turned into the exit code."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, match: str) -> None:
    assert code not in (0, None, 1, 3), code  # 1 = findings gate, 3 = internal error
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    assert re.search(match, err), err


# -- bad input ------------------------------------------------------------------------------------


@pytest.fixture
def corrupt_run(tmp_path: Path, runs) -> Path:
    import shutil

    target = tmp_path / "corrupt"
    shutil.copytree(runs["clean"], target)
    (target / "rank0" / "manifest.json").write_text("{ not json")
    return target


@pytest.fixture
def future_run(tmp_path: Path, runs) -> Path:
    import shutil

    target = tmp_path / "future"
    shutil.copytree(runs["clean"], target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def test_missing_path(capsys, tmp_path):
    assert_one_line_error(
        *run_cli(capsys, "diagnose", str(tmp_path / "nope"))[::2], "no such run directory"
    )


def test_file_path(capsys, tmp_path):
    (tmp_path / "f.txt").write_text("x")
    code, _, err = run_cli(
        capsys, "report", str(tmp_path / "f.txt"), "-o", str(tmp_path / "r.html")
    )
    assert_one_line_error(code, err, "not a directory")


def test_empty_dir(capsys, tmp_path):
    code, _, err = run_cli(capsys, "diagnose", str(tmp_path))
    assert_one_line_error(code, err, "not an amprobe run directory")


def test_corrupt_run(capsys, corrupt_run):
    code, out, err = run_cli(capsys, "diagnose", str(corrupt_run))
    assert_one_line_error(code, err, "no readable rank")
    assert out == ""


def test_future_schema(capsys, future_run):
    code, _, err = run_cli(capsys, "diagnose", str(future_run), "--format", "json")
    assert_one_line_error(code, err, "upgrade amprobe")


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        pytest.param(
            ["diagnose", "{run}", "--bogus"], "unrecognized arguments: --bogus", id="unknown-option"
        ),
        pytest.param(["frobnicate"], "invalid choice: 'frobnicate'", id="unknown-subcommand"),
        pytest.param([], "required", id="no-subcommand"),
        pytest.param(["diagnose"], "required", id="no-run"),
        pytest.param(
            ["diagnose", "{run}", "--format", "yaml"], "invalid choice: 'yaml'", id="bad-format"
        ),
        pytest.param(
            ["diagnose", "{run}", "--fail-on", "info"], "invalid choice: 'info'", id="bad-fail-on"
        ),
        pytest.param(
            ["diagnose", "{run}", "--threshold", "garbage"],
            "RULE.NAME=VALUE",
            id="threshold-syntax",
        ),
        pytest.param(
            ["diagnose", "{run}", "--threshold", "AMP-N02.warn_below=abc"],
            "RULE.NAME=VALUE",
            id="threshold-value",
        ),
        pytest.param(
            ["diagnose", "{run}", "--threshold", "AMP-N99.warn_below=0.5"],
            "unknown rule 'AMP-N99'",
            id="threshold-unknown-rule",
        ),
        pytest.param(
            ["diagnose", "{run}", "--threshold", "AMP-N02.nope=0.5"],
            "has no threshold 'nope'",
            id="threshold-unknown-name",
        ),
        pytest.param(["report", "{run}"], "required: -o", id="report-without-output"),
        pytest.param(
            ["report", "{run}", "-o", "{tmp}/r.txt"],
            "unknown report format '.txt'",
            id="bad-extension",
        ),
        pytest.param(
            ["report", "{run}", "-o", "{tmp}/r"], "unknown report format", id="no-extension"
        ),
        pytest.param(
            ["report", "{run}", "-o", "{tmp}/afile/r.html"], "afile", id="unwritable-output"
        ),
        pytest.param(
            ["demo", "--steps", "3", "--out", "{tmp}/d"], "at least 10", id="demo-too-few-steps"
        ),
    ],
)
def test_bad_arguments_give_one_line(capsys, tmp_path, runs, argv, match):
    (tmp_path / "afile").write_text("a file where a folder is needed")
    argv = [a.format(run=runs["clean"], tmp=tmp_path) for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert_one_line_error(code, err, match)
    assert not (tmp_path / "r.txt").exists() and not (tmp_path / "d").exists()


def test_bad_input_via_subprocess_has_no_traceback(tmp_path, runs):
    """The real entry points, end to end: ``python -m amprobe`` and ``python -m amprobe.cli``."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("AMPROBE_DEBUG", None)
    bad = tmp_path / "nope"
    calls = (
        ("amprobe", ["diagnose", str(bad)]),
        ("amprobe.cli", ["report", str(runs["clean"]), "-o", str(tmp_path / "x.pdf")]),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, *argv],
            cwd=REPO,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for module, argv in calls
    ]
    for proc in procs:  # started together: the torch import dominates, and it overlaps
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err
        assert err.count("\n") == 1 and err.startswith("amprobe: error: "), err
        assert "Traceback" not in err and out == ""


# -- positive paths -------------------------------------------------------------------------------


def test_diagnose_json(capsys, runs):
    code, out, err = run_cli(capsys, "diagnose", str(runs["faulty"]), "--format", "json")
    assert code == 0 and err == ""
    payload = json.loads(out)
    ids = [f["id"] for f in payload["findings"]]
    assert {"AMP-N02", "AMP-N09"} <= set(ids)
    assert all(
        set(f) >= {"id", "severity", "title", "evidence", "fix", "refs"}
        for f in payload["findings"]
    )
    assert payload["run"]["status"] == "finished" and payload["run"]["steps"] == 40
    assert isinstance(payload["not_checked"], list)
    assert payload["health"]["scaler_success_rate"]["value"] < 0.9


def test_diagnose_text_and_markdown(capsys, runs):
    code, text, _ = run_cli(capsys, "diagnose", str(runs["faulty"]))
    assert code == 0 and "AMP-N09" in text and "AMP-N02" in text
    code, md, _ = run_cli(capsys, "diagnose", str(runs["faulty"]), "--format", "markdown")
    assert code == 0 and md.lstrip().startswith("#") and "AMP-N09" in md and "AMP-N02" in md


@pytest.mark.parametrize(
    ("run", "fail_on", "expected"),
    [
        ("faulty", "error", 1),
        ("faulty", "warning", 1),
        ("half", "error", 0),  # only warnings and infos
        ("half", "warning", 1),
        ("clean", "warning", 0),
        ("clean", "error", 0),
        ("faulty", None, 0),  # without --fail-on findings never change the exit code
    ],
)
def test_fail_on_exit_codes(capsys, runs, run, fail_on, expected):
    argv = ["diagnose", str(runs[run]), "--format", "json"] + (
        ["--fail-on", fail_on] if fail_on else []
    )
    code, out, _ = run_cli(capsys, *argv)
    severities = {f["severity"] for f in json.loads(out)["findings"]}
    assert code == expected
    if run == "half":
        assert "warning" in severities and "error" not in severities  # the premise of the case


def test_threshold_override_changes_findings(capsys, runs):
    _, out, _ = run_cli(capsys, "diagnose", str(runs["faulty"]), "--format", "json")
    assert "AMP-N02" in {f["id"] for f in json.loads(out)["findings"]}
    code, out, _ = run_cli(
        capsys,
        "diagnose",
        str(runs["faulty"]),
        "--format",
        "json",
        "--threshold",
        "AMP-N02.warn_below=0",
        "--threshold",
        "AMP-N02.error_below=0",
    )
    assert code == 0 and "AMP-N02" not in {f["id"] for f in json.loads(out)["findings"]}


def test_report_html_is_self_contained(capsys, runs, tmp_path):
    target = tmp_path / "out" / "x.html"
    code, out, err = run_cli(capsys, "report", str(runs["faulty"]), "-o", str(target))
    assert code == 0 and str(target) in out and err == ""
    html = target.read_text()
    assert "Plotly.newPlot" in html or "plotly" in html.lower()
    assert len(html) > 1_000_000  # plotly.js is embedded, not linked
    assert not re.search(r"<script[^>]+src=[\"']https?://", html)
    for fid in ("AMP-N02", "AMP-N09", "AMP-N01"):
        assert fid in html


def test_report_markdown(capsys, runs, tmp_path):
    target = tmp_path / "x.md"
    code, _, _ = run_cli(capsys, "report", str(runs["faulty"]), "-o", str(target))
    md = target.read_text()
    assert code == 0 and md.lstrip().startswith("#") and "AMP-N09" in md


def test_partial_load_warns_on_stderr_and_still_reports(capsys, runs, tmp_path):
    import shutil

    target = tmp_path / "partial"
    shutil.copytree(runs["faulty"], target)
    (target / "rank0" / "end.json").unlink()
    manifest_path = target / "rank0" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["pid"] = None  # recorded by this (live) test process: make the writer a dead one
    manifest_path.write_text(json.dumps(manifest))
    code, out, err = run_cli(capsys, "diagnose", str(target), "--format", "json")
    assert code == 0 and "Traceback" not in err
    assert "amprobe: warning: run ended abruptly at step 39" in err
    assert json.loads(out)["run"]["status"] == "interrupted"


def test_rules_lists_every_id(capsys):
    code, out, _ = run_cli(capsys, "rules")
    assert code == 0
    listed = re.findall(r"^(AMP-[A-Z]\d\d)\b", out, re.M)
    assert sorted(listed) == sorted(REGISTRY)
    assert "warn_below=0.95" in out


def test_only_the_program_freezes_its_objects_before_exit(capsys, monkeypatch):
    """``main()`` as the program (argv from ``sys.argv``) freezes what it made out of the
    garbage collector, so the shutdown collection skips them; called with arguments (from
    Python, as here and in the dashboard's tests) it leaves the collector alone."""
    gc.unfreeze()
    try:
        assert run_cli(capsys, "rules")[0] == 0
        assert gc.get_freeze_count() == 0
        monkeypatch.setattr(sys, "argv", ["amprobe", "rules"])
        assert main() == 0
        assert gc.get_freeze_count() > 0
        assert "AMP-N01" in capsys.readouterr().out
    finally:
        gc.unfreeze()


# -- baseline and compare -------------------------------------------------------------------------


def write_leg(run_dir: Path, wall_s: float, manifest: dict, steps: int = 20, **extra) -> Path:
    """A recorded run (through the real writer) of ``steps`` steps of ``wall_s`` seconds each."""
    from amprobe.store.writer import RunWriter

    writer = RunWriter(run_dir, 0, 1, {"device": "cpu", **manifest}, max_buffered_rows=1000)
    rows = [
        {
            "step": i,
            "window": 0,
            "t": float(i),
            "wall_s": wall_s,
            "loss": 2.0 - 0.01 * i,
            "scaler_enabled": False,
            "opt_steps": 1,
            **extra,
        }
        for i in range(steps)
    ]
    writer.append("steps", rows)
    writer.close({"status": "finished", "steps": steps})
    return run_dir


@pytest.fixture
def fake_baseline(monkeypatch):
    """`amprobe baseline` whose two launches record runs directly: the FP32 leg forced to fp32,
    the AMP leg (bf16 autocast, no scaler) half as fast, so AMP-S06 fires."""
    from amprobe.control import launcher

    def launch(command, run_dir, config=None, force_fp32=False, baseline=None, **kwargs):
        if force_fp32:
            write_leg(run_dir, 0.01, {"forced_fp32": True, "argv": list(command[1:])})
        else:
            manifest = {"baseline_run": str(baseline), "argv": list(command[1:])}
            write_leg(run_dir, 0.02, manifest, autocast_dtype="bfloat16")
        return 0

    monkeypatch.setattr(launcher, "launch", launch)


def test_baseline_prints_what_compare_prints(capsys, tmp_path, fake_baseline):
    """`amprobe baseline` used to print the speedup but not AMP-S06, which `amprobe compare`
    printed for the same pair; and the success rate of a run without a scaler read "not
    recorded" there but "not applicable" in diagnose."""
    out = tmp_path / "ab"
    code, base_out, _ = run_cli(
        capsys, "baseline", "--steps", "20", "--out", str(out), "--", "python", "train.py"
    )
    assert code == 0
    code, cmp_out, _ = run_cli(capsys, "compare", str(out / "fp32"), str(out / "amp"))
    assert code == 0
    assert "[warning] AMP-S06 no-speedup: AMP is 0.50x the FP32 baseline's throughput" in cmp_out
    assert cmp_out in base_out
    code, json_out, _ = run_cli(
        capsys, "compare", str(out / "fp32"), str(out / "amp"), "--format", "json"
    )
    assert json.loads((out / "comparison.json").read_text()) == json.loads(json_out)
    assert json.loads(json_out)["warnings"] == [], "the two legs are an FP32/AMP pair"
    code, diag_out, _ = run_cli(capsys, "diagnose", str(out / "amp"))
    applicable = "not applicable: no enabled GradScaler (every step applied its update)"
    assert f"loss-scale success rate (steps applied / all steps): {applicable}" in diag_out
    assert f"scaler success rate: {applicable} -> {applicable}" in cmp_out


def test_compare_warns_when_the_pair_is_not_fp32_vs_amp(capsys, tmp_path):
    """RUN_A was called the "FP32 baseline" unchecked: a baseline that ran autocast, or two runs
    of different commands, give a one-line warning each (and in the JSON); they are compared."""
    fp32 = write_leg(tmp_path / "fp32", 0.01, {"argv": ["train.py", "--lr", "1e-3"]})
    amp = write_leg(
        tmp_path / "amp", 0.02, {"argv": ["train.py", "--lr", "1e-3"]}, autocast_dtype="bfloat16"
    )
    other = write_leg(tmp_path / "other", 0.02, {"argv": ["other.py"]}, autocast_dtype="bfloat16")
    code, out, err = run_cli(capsys, "compare", str(fp32), str(amp))
    assert code == 0 and err == "", "a true FP32/AMP pair of one command: no warning"

    code, out, err = run_cli(capsys, "compare", str(amp), str(fp32))
    assert code == 0 and "speedup 2.00x" in out, "still compared"
    assert err == (
        f"amprobe: warning: the baseline {amp} is not an FP32 run (it ran autocast with "
        "bfloat16); it is compared as the FP32 baseline anyway\n"
    )
    code, out, err = run_cli(capsys, "compare", str(fp32), str(other), "--format", "json")
    assert code == 0
    (warning,) = json.loads(out)["warnings"]
    assert warning == (
        "the two runs' commands differ (train.py --lr 1e-3 vs other.py); "
        "the comparison may not be like for like"
    )
    assert err == f"amprobe: warning: {warning}\n"


def test_diagnose_on_a_baseline_folder_names_its_two_runs(capsys, tmp_path):
    """The folder `amprobe baseline --out X` writes holds X/fp32 and X/amp; `diagnose X` used to
    say only "not an amprobe run directory"."""
    root = tmp_path / "ab"
    write_leg(root / "fp32", 0.01, {"forced_fp32": True})
    code, _, err = run_cli(capsys, "diagnose", str(root))
    assert_one_line_error(code, err, "holds one run of `amprobe baseline`")
    assert f"diagnose {root / 'fp32'}" in err
    write_leg(root / "amp", 0.02, {"baseline_run": str(root / "fp32")})
    code, _, err = run_cli(capsys, "diagnose", str(root))
    assert_one_line_error(code, err, "holds an amprobe baseline pair, not one run")
    assert f"diagnose {root / 'amp'} (or {root / 'fp32'})" in err
    assert f"`amprobe compare {root / 'fp32'} {root / 'amp'}`" in err
