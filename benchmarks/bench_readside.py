"""Cost of the read side: `amprobe diagnose` of a sample run, in fresh processes.

Each command runs REPEAT times in a fresh interpreter (alternating commands, so a slow moment of
the shared machine hits all of them alike); printed: the median wall time, the median peak RSS
(the child's ru_maxrss) and whether torch was loaded. The floors (a bare interpreter, `import
pandas`: the store's tables are pandas frames) say how much of a diagnose is not amprobe's.

    python benchmarks/bench_readside.py [--repeat 7] [--run sample_runs/overflow]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent


def _wall(argv: list[str], env: dict[str, str]) -> float:
    """Wall seconds of one fresh process."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} failed: {proc.stderr.decode()[-2000:]}")
    return wall


def _peak_rss_mb(argv: list[str], env: dict[str, str]) -> float:
    """Peak RSS of one process, measured alone (ru_maxrss of children is a running maximum)."""
    code = (
        "import resource, subprocess, sys\n"
        "subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True)
    return int(out.stdout) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--run", default=str(ROOT / "sample_runs" / "overflow"))
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("AMPROBE_RUN_DIR", None)
    py = sys.executable
    commands = {
        "python -c pass (floor)": [py, "-c", "pass"],
        "import pandas (floor)": [py, "-c", "import pandas"],
        "import amprobe.cli": [py, "-c", "import amprobe.cli"],
        "amprobe diagnose": [py, "-m", "amprobe", "diagnose", args.run],
        "amprobe diagnose --format json": [py, "-m", "amprobe", "diagnose", args.run, "--format", "json"],
    }  # fmt: skip
    torch_check = "import sys, amprobe.cli; print('torch' in sys.modules)"
    loaded = subprocess.run([py, "-c", torch_check], env=env, capture_output=True, text=True)
    walls: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeat):
        for name, argv in commands.items():
            walls[name].append(_wall(argv, env))
    print(f"CPU: {cpu_model()}; Python {sys.version.split()[0]}; run {args.run}")
    print(f"torch loaded by `import amprobe.cli`: {loaded.stdout.strip()}")
    print(f"{'command':<34} {'median s':>9} {'min s':>7} {'max s':>7} {'peak RSS MB':>12}")
    for name, argv in commands.items():
        w = walls[name]
        rss = _peak_rss_mb(argv, env)
        print(f"{name:<34} {statistics.median(w):9.3f} {min(w):7.3f} {max(w):7.3f} {rss:12.0f}")


if __name__ == "__main__":
    main()
