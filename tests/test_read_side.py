"""The read side works where torch is not installed (issue 20, item 2).

Each test runs a fresh interpreter whose ``sitecustomize`` makes ``import torch`` raise
ImportError, as on a laptop that reads a run copied from a cluster. The static twin of these
tests, which names the import chain that would load torch, is in tests/test_layering.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_runs"

BLOCK_TORCH = """\
import sys


class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None


sys.meta_path.insert(0, _NoTorch())
"""


def _python(tmp_path: Path, *args: str, block_torch: bool = True) -> subprocess.CompletedProcess:
    site = tmp_path / "no_torch_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCK_TORCH if block_torch else "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    env.pop("AMPROBE_RUN_DIR", None)
    return subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def test_torch_is_really_blocked(tmp_path: Path) -> None:
    proc = _python(tmp_path, "-c", "import torch")
    assert proc.returncode != 0
    assert "blocked by the test" in proc.stderr


def test_diagnose_without_torch(tmp_path: Path) -> None:
    proc = _python(tmp_path, "-m", "amprobe", "diagnose", str(SAMPLES / "overflow"))
    assert proc.returncode == 0, proc.stderr
    assert "AMP-N05" in proc.stdout  # the overflow run's first non-finite layer
    proc = _python(
        tmp_path, "-m", "amprobe", "diagnose", str(SAMPLES / "overflow"), "--format", "json"
    )
    assert proc.returncode == 0, proc.stderr
    ids = {f["id"] for f in json.loads(proc.stdout)["findings"]}
    assert {"AMP-N02", "AMP-N03", "AMP-N05"} <= ids


def test_report_without_torch(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    proc = _python(tmp_path, "-m", "amprobe", "report", str(SAMPLES / "overflow"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "AMP-N05" in out.read_text(encoding="utf-8")


def test_compare_and_rules_without_torch(tmp_path: Path) -> None:
    healthy, overflow = str(SAMPLES / "healthy"), str(SAMPLES / "overflow")
    proc = _python(tmp_path, "-m", "amprobe", "compare", healthy, overflow, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)
    proc = _python(tmp_path, "-m", "amprobe", "rules")
    assert proc.returncode == 0, proc.stderr
    assert "AMP-S01" in proc.stdout


def test_dashboard_app_factory_without_torch(tmp_path: Path) -> None:
    pytest.importorskip("dash", reason="the dashboard needs dash")
    code = (
        "import sys\n"
        "from dashboard.app import create_app\n"
        f"app = create_app({str(SAMPLES)!r})\n"
        "assert 'torch' not in sys.modules\n"
        "print(type(app).__name__)\n"
    )
    proc = _python(tmp_path, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "Dash"


def test_package_imports_without_torch_and_capture_fails_only_on_use(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "import amprobe\n"
        "assert 'torch' not in sys.modules\n"
        "amprobe.Config(flush_every=5)\n"
        f"run = amprobe.load_run({str(SAMPLES / 'overflow')!r})\n"
        "assert amprobe.diagnose(run).findings\n"
        "try:\n"
        "    amprobe.attach\n"
        "except ImportError as exc:\n"
        "    print('capture side:', exc)\n"
    )
    proc = _python(tmp_path, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert "capture side: No module named 'torch'" in proc.stdout


def test_capture_side_loads_on_first_use(tmp_path: Path) -> None:
    """With torch installed, ``amprobe.attach`` etc. are the very objects they always were."""
    code = (
        "import sys\n"
        "import amprobe\n"
        "assert 'torch' not in sys.modules, 'import amprobe alone loads no torch'\n"
        "from amprobe import attach, Probe\n"
        "import amprobe.api, amprobe.capture.probe\n"
        "assert attach is amprobe.api.attach and amprobe.attach is attach\n"
        "assert Probe is amprobe.capture.probe.Probe\n"
        "assert amprobe.current_probe is amprobe.capture.probe.current_probe\n"
        "assert amprobe.current_probe() is None\n"
        "assert {'attach', 'Probe', 'current_probe'} <= set(dir(amprobe))\n"
        "assert set(amprobe.__all__) <= set(dir(amprobe))\n"
        "try:\n"
        "    amprobe.no_such_name\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    proc = _python(tmp_path, "-c", code, block_torch=False)
    assert proc.returncode == 0, proc.stderr
    assert "module 'amprobe' has no attribute 'no_such_name'" in proc.stdout


def test_cli_capture_commands_still_report_user_errors(tmp_path: Path) -> None:
    """run/attach/detach import the capture side inside the command; their errors stay one line."""
    proc = _python(
        tmp_path, "-m", "amprobe", "detach", str(tmp_path / "nothing"), block_torch=False
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("amprobe: error:") and "Traceback" not in proc.stderr
    proc = _python(tmp_path, "-m", "amprobe", "run", "--", block_torch=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("amprobe: error: no command given")


def test_each_import_loads_only_what_it_needs(tmp_path: Path) -> None:
    """``import amprobe`` (a training script's), the store's writer (the capture side's) and the
    CLI (``amprobe --help``, ``amprobe run``'s launcher) load no pandas; the CLI nor ``import
    amprobe`` load pyarrow, the rules, the report or the control channel either."""
    code = (
        "import sys\n"
        "def loaded(*names):\n"
        "    return sorted(n for n in names if n in sys.modules)\n"
        "heavy = ('pandas', 'pyarrow', 'numpy', 'plotly', 'dash', 'torch')\n"
        "ours = ('amprobe.rules', 'amprobe.report', 'amprobe.analysis', 'amprobe.control',\n"
        "        'amprobe.store.loader', 'amprobe.store.writer')\n"
        "import amprobe\n"
        "print('amprobe', loaded(*heavy, *ours))\n"
        "import amprobe.cli\n"
        "print('cli', loaded(*heavy, *ours))\n"
        "import amprobe.store.writer, amprobe.store.fields\n"
        "print('writer', loaded('pandas', 'amprobe.store.loader', 'amprobe.rules'))\n"
    )
    proc = _python(tmp_path, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["amprobe []", "cli []", "writer []"]


def test_lazy_names_are_the_defining_modules_objects(tmp_path: Path) -> None:
    """The names ``amprobe`` and ``amprobe.store`` load on first use are the objects of the
    modules that define them, listed by ``dir()``; the subpackages and the store's modules are
    attributes as when the packages imported them at once."""
    code = (
        "import sys, amprobe, amprobe.store\n"
        "assert set(amprobe.__all__) <= set(dir(amprobe))\n"
        "assert set(amprobe.store.__all__) <= set(dir(amprobe.store))\n"
        "import amprobe.rules, amprobe.rules.engine, amprobe.store.loader as loader\n"
        "import amprobe.store.schema as schema, amprobe.store.writer as writer\n"
        "assert amprobe.diagnose is amprobe.rules.diagnose is amprobe.rules.engine.diagnose\n"
        "assert amprobe.Finding is amprobe.rules.engine.Finding\n"
        "assert amprobe.Diagnosis is amprobe.rules.engine.Diagnosis\n"
        "assert amprobe.load_run is amprobe.store.load_run is loader.load_run\n"
        "assert amprobe.Run is amprobe.store.Run is loader.Run\n"
        "assert amprobe.RunLoadError is amprobe.store.RunLoadError is loader.RunLoadError\n"
        "assert amprobe.store.read_table is loader.read_table\n"
        "assert amprobe.store.RankInfo is loader.RankInfo\n"
        "assert amprobe.store.TABLES is schema.TABLES\n"
        "assert amprobe.store.SCHEMA_VERSION == schema.SCHEMA_VERSION\n"
        "assert amprobe.store.RunWriter is writer.RunWriter\n"
        "assert amprobe.analysis.__name__ == 'amprobe.analysis'\n"
        "import amprobe.report.render as render\n"
        "assert not any(m in sys.modules for m in ('amprobe.report.sections', 'plotly'))\n"
        "import amprobe.report.document as document\n"
        "assert amprobe.report.render_text is render.render_text\n"
        "assert amprobe.report.render_html is document.render_html\n"
        "assert amprobe.report.write_report is document.write_report\n"
        "import amprobe.report.registry as registry\n"
        "assert amprobe.report.SECTIONS is amprobe.report.sections.SECTIONS is registry.SECTIONS\n"
        "assert amprobe.report.Section is registry.Section\n"
        "assert set(amprobe.report.__all__) <= set(dir(amprobe.report))\n"
        "assert amprobe.store.fields.STEP_FIELDS\n"
        "for module, name in ((amprobe, 'no_such_name'), (amprobe.store, 'load_runs')):\n"
        "    try:\n"
        "        getattr(module, name)\n"
        "    except AttributeError as exc:\n"
        "        print(exc)\n"
    )
    proc = _python(tmp_path, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "module 'amprobe' has no attribute 'no_such_name'",
        "module 'amprobe.store' has no attribute 'load_runs'",
    ]


def test_the_section_registry_is_complete_however_it_is_imported(tmp_path: Path) -> None:
    """The section builders register when :mod:`amprobe.report.sections` is imported, which
    every path that builds or lists sections goes through; rendering text loads none of them."""
    keys = "['scale', 'numerics', 'whatif', 'compute', 'runtime', 'ranks']"
    for first in (
        "from amprobe.report.sections import section_tabs",
        "from amprobe.report import build_sections",
        "from amprobe.report import render_html",
        "import amprobe.report.document",
    ):
        code = (
            f"{first}\n"
            "from amprobe.report.registry import SECTIONS\n"
            "from amprobe.report.sections import section_tabs\n"
            "print([key for key, _ in section_tabs()], sorted(SECTIONS) == sorted(dict(section_tabs())))\n"
        )
        proc = _python(tmp_path, "-c", code)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"{keys} True", first


def test_control_commands_load_no_torch(tmp_path: Path) -> None:
    """``amprobe run`` and ``attach``/``detach RUN`` import the launcher and the control channel
    inside the command (not at the CLI's import, where the layering test followed them): with
    torch blocked they still start and report a user error in one line."""
    proc = _python(tmp_path, "-m", "amprobe", "detach", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and proc.stderr.startswith("amprobe: error:"), proc.stderr
    proc = _python(tmp_path, "-m", "amprobe", "attach", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and proc.stderr.startswith("amprobe: error:"), proc.stderr
    proc = _python(tmp_path, "-m", "amprobe", "run", "--")
    assert proc.returncode == 2
    assert proc.stderr.startswith("amprobe: error: no command given"), proc.stderr
    code = "import amprobe.control.launcher, amprobe.control.sender, amprobe.control.watcher"
    proc = _python(tmp_path, "-c", code)
    assert proc.returncode == 0, proc.stderr


FIRST_AMPROBE_THEN_TORCH = """\
import sys

if sys.argv[1] == "submodule":
    import amprobe.capture.probe  # a capture module first: it imports torch while half-initialized
import amprobe
import torch
from torch import nn

model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
if sys.argv[1] == "attach":
    amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir="own")
for _ in range(5):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
"""


@pytest.mark.parametrize("mode", ["plain", "attach", "submodule"])
def test_amprobe_run_records_a_script_that_imports_amprobe_before_torch(
    tmp_path: Path, mode: str
) -> None:
    """Under `amprobe run`, a script that imports amprobe (or one of its capture modules) before
    torch is recorded by one automatic probe; a script's own attach joins it."""
    script = tmp_path / "first.py"
    script.write_text(FIRST_AMPROBE_THEN_TORCH)
    out = tmp_path / "out"
    proc = _python(
        tmp_path, "-m", "amprobe", "run", "--out", str(out), "--",
        sys.executable, str(script), mode, block_torch=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    check = f"import amprobe; print(len(amprobe.load_run({str(out)!r}).steps))"
    assert _python(tmp_path, "-c", check).stdout.strip() == "5"
    assert not (tmp_path / "own").exists(), "one probe: attach() joined the automatic one"
