"""Where the wall time of `amprobe diagnose RUN` goes, in fresh processes.

Each sample is one fresh interpreter per line below, run in alternation (a slow moment of the
shared machine hits every line alike); printed: the median and the spread over ``--repeat``
samples, and the CPU model.

* ``python -c pass``: interpreter startup and shutdown (the floor of any command);
* ``import pandas``: numpy, pyarrow and pandas (the store's tables are pandas frames);
* ``import amprobe.cli``: the CLI alone (each command imports what it needs when it runs);
* ``amprobe diagnose``: the command as a user runs it (``python -m amprobe diagnose RUN``).

The breakdown of the diagnose process comes from timers inside it (``time.perf_counter``
around each phase, the same clock): ``startup`` is the wall time before the first import
(interpreter start, ``site``), ``pandas`` the import of numpy, pyarrow and pandas, ``cli`` the
rest of ``import amprobe.cli``, ``read side`` the import of the modules the command imports
when it runs (:data:`DIAGNOSE_IMPORTS`, imported first here so that the next phase is the
work alone; the child says if the command imported more), ``run`` the command itself
(``amprobe.cli.main``: load, diagnose, render) and ``exit`` what remains of the wall time
(interpreter shutdown: module teardown and the final garbage collection).

    python benchmarks/bench_diagnose.py [--repeat 11] [--run sample_runs/overflow] [--json]
        [--baseline DIR]

``--baseline DIR`` times another checkout of amprobe (``git archive <commit> | tar -x -C DIR``)
in the same alternation: its ``amprobe diagnose`` and its breakdown, beside this one's. Every
child runs in the temporary directory, so that ``python -m amprobe`` imports the checkout its
``PYTHONPATH`` names.

Where no bytecode of amprobe is cached (``PYTHONDONTWRITEBYTECODE=1`` and an editable install,
as on this project's machine), every process compiles amprobe's modules from source: most of
the ``cli`` and ``read side`` phases is that compilation (about 0.05 s of 0.07 s; a
regular ``pip install`` or ``python -m compileall amprobe`` caches it).

``benchmarks/bench_readside.py`` measures the same command's peak memory and that it loads no
torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent

#: the modules `amprobe diagnose` imports when it runs (the CLI imports them in the command)
DIAGNOSE_IMPORTS = (
    "amprobe.store.loader",
    "amprobe.rules",
    "amprobe.report",
    "amprobe.report.render",
    "amprobe.report.summary",
    "amprobe.analysis.whatif",
)

#: runs in the child: times its own phases and prints them as JSON on stderr's last line. It
#: calls ``main()`` as ``python -m amprobe`` does (arguments from ``sys.argv``, then
#: ``sys.exit``), so the command takes the program's own path to the exit
_CHILD = """
import importlib, sys, time, json
t0 = time.perf_counter()
import numpy, pyarrow, pandas
t1 = time.perf_counter()
import amprobe.cli
t2 = time.perf_counter()
for name in IMPORTS:
    importlib.import_module(name)
t3 = time.perf_counter()
before = set(sys.modules)
code = amprobe.cli.main()
t4 = time.perf_counter()
sys.stdout.flush()
more = sorted(m for m in set(sys.modules) - before if m.startswith("amprobe"))
sys.stderr.write("\\n" + json.dumps({"t0": t0, "pandas": t1 - t0, "cli": t2 - t1,
                                     "read side": t3 - t2, "run": t4 - t3, "end": t4,
                                     "more": more}) + "\\n")
sys.exit(code)
""".replace("IMPORTS", repr(DIAGNOSE_IMPORTS), 1)


_CWD = tempfile.gettempdir()


def _wall(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Wall seconds of one fresh process, and its stderr."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        argv, env=env, cwd=_CWD, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} failed: {proc.stderr.decode()[-2000:]}")
    return wall, proc.stderr.decode()


def _phases(argv: list[str], env: dict[str, str]) -> dict[str, float]:
    """One diagnose process timed from inside: startup, pandas, cli, read side, run, exit (s)."""
    # the child's perf_counter and ours are the same monotonic clock (CLOCK_MONOTONIC)
    start = time.perf_counter()
    proc = subprocess.run(
        argv, env=env, cwd=_CWD, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    end = time.perf_counter()
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} failed: {proc.stderr.decode()[-2000:]}")
    inside = json.loads(proc.stderr.decode().strip().splitlines()[-1])
    if inside["more"]:
        print(f"note: the command imported more than DIAGNOSE_IMPORTS: {inside['more']}")
    return {
        "startup": inside["t0"] - start,
        "pandas": inside["pandas"],
        "cli": inside["cli"],
        "read side": inside["read side"],
        "run": inside["run"],
        "exit": end - inside["end"],
        "total": end - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=11)
    parser.add_argument("--run", default=str(ROOT / "sample_runs" / "overflow"))
    parser.add_argument("--json", action="store_true", help="time `diagnose --format json` too")
    parser.add_argument("--baseline", default=None, help="another amprobe checkout to time")
    args = parser.parse_args()
    run = str(Path(args.run).resolve())
    checkouts = {"": str(ROOT)}
    if args.baseline:
        checkouts[" (baseline)"] = str(Path(args.baseline).resolve())
    envs = {}
    for tag, path in checkouts.items():
        envs[tag] = {**os.environ, "PYTHONPATH": path}
        envs[tag].pop("AMPROBE_RUN_DIR", None)
    py = sys.executable
    commands: dict[str, tuple[str, list[str]]] = {
        "python -c pass": ("", [py, "-c", "pass"]),
        "import pandas": ("", [py, "-c", "import pandas"]),
    }
    for tag in checkouts:
        commands[f"import amprobe.cli{tag}"] = (tag, [py, "-c", "import amprobe.cli"])
        commands[f"amprobe diagnose{tag}"] = (tag, [py, "-m", "amprobe", "diagnose", run])
        if args.json:
            argv = [py, "-m", "amprobe", "diagnose", run, "--format", "json"]
            commands[f"amprobe diagnose --format json{tag}"] = (tag, argv)
    timed = [py, "-c", _CHILD, "diagnose", run]
    walls: dict[str, list[float]] = {name: [] for name in commands}
    phases: dict[str, list[dict[str, float]]] = {tag: [] for tag in checkouts}
    for _ in range(args.repeat):
        for name, (tag, argv) in commands.items():
            walls[name].append(_wall(argv, envs[tag])[0])
        for tag in checkouts:
            phases[tag].append(_phases(timed, envs[tag]))
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); Python {sys.version.split()[0]}")
    print(f"run: {run}; {args.repeat} fresh processes per line, alternating")
    for tag, path in checkouts.items():
        print(f"checkout{tag or ''}: {path}")
    print(f"{'command':<44} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, w in walls.items():
        print(f"{name:<44} {statistics.median(w):9.3f} {min(w):7.3f} {max(w):7.3f}")
    print("\n`amprobe diagnose` timed from inside (median s of each phase, min in brackets):")
    print(f"  {'phase':<10}" + "".join(f" {'this' + tag:>22}" for tag in checkouts))
    for key in ("startup", "pandas", "cli", "read side", "run", "exit", "total"):
        cells = []
        for tag in checkouts:
            values = [p[key] for p in phases[tag]]
            cells.append(f"{statistics.median(values):.3f} ({min(values):.3f})")
        print(f"  {key:<10}" + "".join(f" {c:>22}" for c in cells))


if __name__ == "__main__":
    main()
