"""amprobe on framework loops: plain, ``amprobe run`` and the native callback, side by side.

Run: ``python benchmarks/bench_frameworks.py [--reps 3] [--frameworks hf,lightning,accelerate]``.

Each framework's training script (``tests/scripts/train_{hf,lightning,accelerate}.py``, tiny
models built from configs, random data, CPU) runs in its own subprocess per repetition, in
three modes whose order alternates from one repetition to the next:

- plain: the script alone;
- amprobe run: ``amprobe run --out DIR -- python script.py`` (zero-code, nothing passed);
- callback: the framework's ``AmprobeCallback`` (Lightning, HF ``Trainer``); for accelerate,
  which needs no callback, ``amprobe.attach(run_dir=DIR)`` with nothing passed.

The time compared is the training call's process CPU time, printed by the script itself
(``train_time cpu_s=...``: ``trainer.fit`` / ``trainer.train()`` / the loop), so interpreter
start-up, imports, attach and the final flush and diagnosis are not counted; intra-op threads
are pinned to one (``OMP_NUM_THREADS=1``) so CPU time is not inflated by spinning threads.
Prints the CPU model, each mode's median over repetitions and its ratio to plain
(the target of issue 14: <= 1.05).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
MODES = ("plain", "amprobe run", "callback")

#: framework -> (script, its arguments for a few seconds of training)
WORKLOADS: dict[str, tuple[str, list[str]]] = {
    "hf": (
        "train_hf.py",
        ["--precision", "bf16", "--steps", "150", "--embd", "256", "--batch", "16"],
    ),
    "lightning": (
        "train_lightning.py",
        ["--precision", "bf16-mixed", "--steps", "200", "--width", "2048", "--batch", "128"],
    ),
    "accelerate": (
        "train_accelerate.py",
        ["--precision", "bf16", "--steps", "200", "--width", "2048", "--batch", "128", "--quiet"],
    ),
}


def run_once(framework: str, mode: str, tmp: Path) -> float:
    """One subprocess; returns the training call's CPU seconds."""
    script, args = WORKLOADS[framework]
    cmd = [sys.executable, str(SCRIPTS / script), *args]
    out = tmp / f"{framework}-{mode.replace(' ', '_')}-{os.urandom(4).hex()}"
    if framework == "hf":
        cmd += ["--out", str(out / "hf_out")]
    if framework == "lightning":
        cmd += ["--root", str(out)]
    if mode == "amprobe run":
        cmd = [sys.executable, "-m", "amprobe", "run", "--out", str(out / "run"), "--"]
        cmd += [sys.executable, str(SCRIPTS / script), *args]
        cmd += ["--out", str(out / "hf_out")] if framework == "hf" else []
        cmd += ["--root", str(out)] if framework == "lightning" else []
    elif mode == "callback":
        cmd += ["--attach" if framework == "accelerate" else "--callback", str(out / "run")]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=900)
    found = re.search(r"train_time cpu_s=([0-9.]+)", proc.stdout)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(
            f"{framework} / {mode} failed ({proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each mode")
    parser.add_argument("--frameworks", default="hf,lightning,accelerate")
    args = parser.parse_args()
    frameworks = [f for f in args.frameworks.split(",") if f]
    print(
        f"CPU: {cpu_model()} ({os.cpu_count()} logical cores), Python {platform.python_version()}"
    )
    versions = []
    for name in ("torch", "transformers", "accelerate", "lightning"):
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} not installed")
    print("; ".join(versions))
    print(f"training-call process CPU time, median of {args.reps} alternating repetitions\n")
    print(
        f"{'framework':<12}"
        + "".join(f"{m:>16}" for m in MODES)
        + f"{'run/plain':>12}{'callback/plain':>16}{'added ms/step (run, callback)':>32}"
    )
    with tempfile.TemporaryDirectory(prefix="bench_frameworks-") as tmpdir:
        tmp = Path(tmpdir)
        for framework in frameworks:
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for rep in range(args.reps):
                order = MODES if rep % 2 == 0 else tuple(reversed(MODES))
                for mode in order:
                    times[mode].append(run_once(framework, mode, tmp))
            med = {m: statistics.median(v) for m, v in times.items()}
            steps = int(WORKLOADS[framework][1][WORKLOADS[framework][1].index("--steps") + 1])

            def added(seconds: float, plain: float = med["plain"], steps: int = steps) -> float:
                return 1000 * (seconds - plain) / steps

            print(
                f"{framework:<12}"
                + "".join(f"{med[m]:>15.3f}s" for m in MODES)
                + f"{med['amprobe run'] / med['plain']:>11.3f}x"
                + f"{med['callback'] / med['plain']:>15.3f}x"
                + f"{added(med['amprobe run']):>16.2f}{added(med['callback']):>16.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
