"""Replica fingerprints (AMP-D05) on the 2-rank FSDP2 job: sampled and other steps, side by side.

Run: ``python benchmarks/bench_fingerprint.py [--pairs 4] [--block 100] [--width 512]``.

The job is ``bench_fsdp.py``'s (gloo on CPU, every Linear of an MLP and the root under
``fully_shard``, fp16 ``MixedPrecisionPolicy``, ``ShardedGradScaler``): each rank's local shards
are fp32. Both ranks train in blocks of ``--block`` steps with amprobe attached in three
configurations, in an order that rotates from one round to the next:

* ``base``: the scaler collector only, no fingerprint (what every configuration shares);
* ``every``: ``base`` plus the replicas collector with ``fingerprint_every=1``: every step is
  a sampled step (the fingerprints at the step's end, and their rows written at flush);
* ``rare``: ``base`` plus the replicas collector with a period longer than the block: its
  steps are the unsampled steps of a job that fingerprints (the first sample, at step 0, is
  in the untimed ``--settle`` steps).

Each block's time is the training thread's CPU time (where the fingerprints run) and the
process's (gloo's threads included), mean of the 2 ranks. Prints the CPU model, the median
block per configuration and, per round, the ratios ``every/base`` (the cost of a sampled step's
fingerprints, as a share of a step; goal of issue 35: <= 1.10) and ``rare/base`` (unsampled
steps; goal: <= 1.01), then their medians; and the fingerprint alone, timed in the job
(``fingerprint_ms``: every replicated parameter's fingerprint, stacked, on the training thread).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fsdp import _job  # noqa: E402
from machine import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "base": {"collectors": ("scaler",), "replay": "off", "fingerprint_every": 0},
    "every": {"collectors": ("scaler", "replicas"), "replay": "off", "fingerprint_every": 1},
    "rare": {
        "collectors": ("scaler", "replicas"),
        "replay": "off",
        "fingerprint_every": 1_000_000,
    },
}


def worker(
    pairs: int, block: int, warmup: int, width: int, batch: int, out: str, settle: int
) -> None:
    """One rank: blocks of each configuration, one JSON row per block in ``OUT/rank<R>.jsonl``."""
    import torch
    import torch.distributed as dist

    import amprobe.capture.probe
    from amprobe.capture.collectors.replicas import fingerprint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    train = _job(width, batch)
    train(warmup)
    names = list(CONFIGS)
    model_params = []
    for round_ in range(pairs):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            probe = amprobe.capture.probe.attach(
                run_dir=f"{out}/{name}{round_}-rank{rank}",
                config={**CONFIGS[name], "collectors": (*CONFIGS[name]["collectors"], "discovery")},
                adoptable=True,
                lazy=True,
            )
            train(settle)  # untimed: the model discovered, the first sample, the first flush
            probe.flush()
            start, start_main = time.process_time(), time.thread_time()
            train(block)
            spent, main = time.process_time() - start, time.thread_time() - start_main
            if not model_params:
                model_params = [m for ref in probe.models if (m := ref()) is not None]
            probe.close()
            row = {"config": name, "round": round_, "cpu_s": spent, "main_s": main}
            with open(Path(out, f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
    # the fingerprints alone: every parameter's local shard, stacked, as the collector does
    params = [p for m in model_params for p in m.parameters()]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    with torch.no_grad():
        torch.stack([fingerprint(t) for t in local])
        start = time.thread_time()
        for _ in range(50):
            torch.stack([fingerprint(t) for t in local])
        took = (time.thread_time() - start) / 50
    elements = sum(t.numel() for t in local)
    with open(Path(out, f"rank{rank}.jsonl"), "a") as f:
        f.write(
            json.dumps({"fingerprint_s": took, "elements": elements, "tensors": len(local)}) + "\n"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, default=4, help="rounds of the three configurations")
    parser.add_argument("--block", type=int, default=100, help="steps per block")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--settle", type=int, default=5, help="untimed steps per block")
    parser.add_argument("--port", type=int, default=29741)
    args = parser.parse_args()
    if args.worker:
        worker(args.pairs, args.block, args.warmup, args.width, args.batch, args.out, args.settle)
        return
    import torch

    print(
        f"CPU: {cpu_model()} ({os.cpu_count()} logical cores), Python "
        f"{platform.python_version()}, torch {torch.__version__}"
    )
    print(
        f"FSDP2, 2 ranks (gloo), MLP width {args.width}, batch {args.batch}, fp16 params "
        f"(fp32 shards), ShardedGradScaler; {args.pairs} rounds of {args.block}-step blocks\n"
    )
    with tempfile.TemporaryDirectory(prefix="bench_fingerprint-") as tmpdir:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(args.port),
            str(Path(__file__).resolve()),
            "--worker",
            "--out",
            tmpdir,
            *("--pairs", str(args.pairs), "--block", str(args.block)),
            *("--warmup", str(args.warmup), "--width", str(args.width)),
            *("--batch", str(args.batch), "--settle", str(args.settle)),
        ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
            ),
        }
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"the job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = [
            json.loads(line)
            for rank in (0, 1)
            for line in Path(tmpdir, f"rank{rank}.jsonl").read_text().splitlines()
        ]
    alone = [r for r in rows if "fingerprint_s" in r]
    blocks = [r for r in rows if "config" in r]
    for column, label in (("main_s", "training thread CPU"), ("cpu_s", "process CPU")):
        per: dict[tuple[str, int], list[float]] = {}
        for r in blocks:
            per.setdefault((r["config"], r["round"]), []).append(r[column])
        mean = {k: statistics.mean(v) for k, v in per.items()}
        print(f"{label} per block (mean of the 2 ranks):")
        for round_ in range(args.pairs):
            base = mean[("base", round_)]
            print(
                f"  round {round_}: base {base:.3f} s  every {mean[('every', round_)]:.3f} s  "
                f"rare {mean[('rare', round_)]:.3f} s  |  sampled/base "
                f"{mean[('every', round_)] / base:.3f}x  unsampled/base "
                f"{mean[('rare', round_)] / base:.3f}x"
            )
        sampled = statistics.median(
            mean[("every", r)] / mean[("base", r)] for r in range(args.pairs)
        )
        other = statistics.median(mean[("rare", r)] / mean[("base", r)] for r in range(args.pairs))
        step_ms = (
            1000 * statistics.median(mean[("base", r)] for r in range(args.pairs)) / args.block
        )
        print(
            f"  median: a step {step_ms:.2f} ms; sampled step / plain step {sampled:.3f}x "
            f"(goal <= 1.10); unsampled step / plain step {other:.3f}x (goal <= 1.01)\n"
        )
    for rank, r in enumerate(alone):
        print(
            f"fingerprints alone, rank {rank}: {1000 * r['fingerprint_s']:.3f} ms for "
            f"{r['tensors']} local tensors, {r['elements']:,} elements"
        )


if __name__ == "__main__":
    main()
