"""What amprobe adds to the compile of a model whose blocks are compiled one by one.

Usage: ``python benchmarks/bench_compile_blocks.py [--depths 2,10,32] [--backend inductor]
[--steps 3]``.

For each depth, tests/scripts/train_blocks.py (a transformer whose blocks are each compiled
with ``fullgraph=True``, bf16 autocast) runs in fresh processes, plain and under ``amprobe run``
in its default configuration (per-layer numerics sample step 0: the sampled variant is
compiled at step 0, the plain graph at step 1; an fp16 job's initial scale calibration would
arm samples on every early step and compile the sampled variant only),
first with an empty inductor cache (a new ``TORCHINDUCTOR_CACHE_DIR`` per job), then warm (the
same directory again). It prints, side by side: the first step's wall time, dynamo's total
compile time (``_compile.compile_inner``: every frame's tracing and backend compile, the whole
job), the graphs the backend compiled, and the probed/plain ratios; the CPU model beside them.
Issue 31's goals: first step at most 1.3x plain, total compile at most 2.3x plain.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "train_blocks.py"


def job(probed: bool, depth: int, backend: str, steps: int, cache: str, work: Path) -> dict:
    out = work / f"{'probed' if probed else 'plain'}-{depth}-{len(os.listdir(work))}.json"
    script = [sys.executable, str(SCRIPT), str(out), "--blocks", str(depth), "--fullgraph"]
    script += ["--backend", backend, "--steps", str(steps), "--dtype", "bf16"]
    argv = script
    if probed:
        run_dir = work / f"run-{out.stem}"
        argv = [sys.executable, "-m", "amprobe", "run", "--out", str(run_dir), "--", *script]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({' '.join(argv[-12:])}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="2,10,32")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}; backend {args.backend}; {args.steps} steps; bf16 autocast")
    head = (
        f"{'blocks':>6} {'cache':>5} | {'first step s':>21} {'ratio':>5} | "
        f"{'dynamo compile s':>21} {'ratio':>5} | {'graphs':>7} | losses equal"
    )
    print(head)
    print(f"{'':>12} | {'plain':>10} {'amprobe':>10} {'':>5} | {'plain':>10} {'amprobe':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for depth in (int(d) for d in args.depths.split(",")):
            caches = {p: tempfile.mkdtemp(dir=tmp) for p in (False, True)}
            for state in ("cold", "warm"):
                res = {
                    p: job(p, depth, args.backend, args.steps, caches[p], work)
                    for p in (False, True)
                }
                plain, probed = res[False], res[True]
                first = (plain["steps"][0]["t"], probed["steps"][0]["t"])
                comp = (plain["dynamo_compile_s"], probed["dynamo_compile_s"])
                same = [s["loss"] for s in plain["steps"]] == [s["loss"] for s in probed["steps"]]
                print(
                    f"{depth:>6} {state:>5} | {first[0]:>10.2f} {first[1]:>10.2f} "
                    f"{first[1] / first[0]:>5.2f} | {comp[0]:>10.2f} {comp[1]:>10.2f} "
                    f"{comp[1] / comp[0]:>5.2f} | {plain['graphs_compiled']:>3}/"
                    f"{probed['graphs_compiled']:<3} | {same}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
