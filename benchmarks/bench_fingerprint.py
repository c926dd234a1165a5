"""Replica fingerprints (AMP-D05) on the 2-rank FSDP2 job: sampled and other steps, side by side.

Run: ``python benchmarks/bench_fingerprint.py [--pairs 4] [--block 100] [--width 512]``.

The job is ``bench_fsdp.py``'s (gloo on CPU, every Linear of an MLP and the root under
``fully_shard``, fp16 ``MixedPrecisionPolicy``, ``ShardedGradScaler``) on a 2 x 1 DeviceMesh
(replicate x shard): the 2 ranks are replicas, each fingerprints every parameter (fp32). On
``bench_fsdp.py``'s 1-D mesh (pure sharding) no parameter has a replica and the collector
takes no sample at all. Both ranks train blocks of ``--block`` steps with amprobe attached, alternately:

* ``base``: the scaler collector only, no fingerprint;
* ``every2``: ``base`` plus the replicas collector with ``fingerprint_every=2``: sampled and
  unsampled steps alternate inside the block, so their difference is measured step by step on
  the same machine state (a loaded machine moves whole blocks by tens of percent);
* ``num2`` and ``both2``: amprobe's sampled step (per-layer numerics, ``numerics_every=2``)
  without and with the fingerprints on the same steps: what the fingerprints add to a sampled
  step (goal of issue 35: <= 1.10).

Each step's training-thread CPU time (where the fingerprints run) and wall time are taken; per
block the median over its sampled steps and over its unsampled ones. Printed per round: the
plain step (``base``), ``every2``'s sampled and unsampled steps, the cost of a sampled step as
``1 + (sampled - unsampled) / plain`` (goal of issue 35: <= 1.10) and ``unsampled / plain``
(goal: <= 1.01; across blocks, so load noise shows there). Then the collector's own work at a
sampled step's end (thread CPU; the rest of a sampled step's difference is the hub's: a sampled
step is a detail step), and two figures the load cannot move: the bytecodes amprobe's frames run per unsampled step with and without the replicas
collector (``rare``: a period longer than the run, after its first sample), and the
fingerprints alone (every local shard, stacked, as the collector does; thread CPU, mean of 50).
The flush that writes a sample's rows is not in a median step (one flush per 100 steps or
0.5 s); its rows are one per parameter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fsdp import _job as fsdp_job  # noqa: E402
from bench_fsdp import _torchrun  # noqa: E402
from machine import cpu_model, opcodes_in  # noqa: E402

CONFIGS = {
    "base": {"collectors": ("scaler",), "replay": "off", "fingerprint_every": 0},
    "every2": {"collectors": ("scaler", "replicas"), "replay": "off", "fingerprint_every": 2},
    "rare": {
        "collectors": ("scaler", "replicas"),
        "replay": "off",
        "fingerprint_every": 1_000_000,
    },
    # an amprobe sampled step (per-layer numerics) on every other step, with and without the
    # fingerprints on the same steps: what they add to a sampled step
    "num2": {
        "collectors": ("scaler", "numerics"),
        "replay": "off",
        "fingerprint_every": 0,
        "numerics_every": 2,
    },
    "both2": {
        "collectors": ("scaler", "numerics", "replicas"),
        "replay": "off",
        "fingerprint_every": 2,
        "numerics_every": 2,
    },
}
#: the pairs of configurations timed block by block: (without, with) the fingerprints
PAIRS = (("base", "every2"), ("num2", "both2"))


def _job(width: int, batch: int) -> Any:
    """``bench_fsdp.py``'s FSDP2 job on a 2 x 1 mesh (replicate x shard): FSDP2's replicate
    dimension, so each of the 2 ranks holds a replica of every parameter (on a 1-D mesh, pure
    sharding, there is nothing to compare and the collector fingerprints nothing)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    return fsdp_job(width, batch, mesh)


def _attach(name: str, out: str) -> Any:
    import amprobe.capture.probe

    config = {**CONFIGS[name], "collectors": (*CONFIGS[name]["collectors"], "discovery")}
    return amprobe.capture.probe.attach(run_dir=out, config=config, adoptable=True, lazy=True)


def worker(
    pairs: int, block: int, warmup: int, width: int, batch: int, out: str, settle: int
) -> None:
    """One rank: per round a block of ``base`` and one of ``every2`` (order alternating), each
    step's training-thread CPU and wall time, then the bytecodes amprobe runs per unsampled
    step (``rare`` and ``base``) and the fingerprints alone; JSON rows in ``OUT/rank<R>.jsonl``."""
    import torch
    import torch.distributed as dist

    import amprobe
    from amprobe.capture.collectors.replicas import ReplicasCollector, fingerprint

    own = {"s": 0.0, "n": 0}  # the collector's step-end work on sampled steps, thread CPU
    step_end = ReplicasCollector.on_step_end

    def timed_step_end(self: Any, step: int, record: dict[str, Any], facts: Any) -> None:
        sampled = self._sampled_now
        start = time.thread_time()
        step_end(self, step, record, facts)
        if sampled:
            own["s"] += time.thread_time() - start
            own["n"] += 1

    ReplicasCollector.on_step_end = timed_step_end  # type: ignore[method-assign]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    train = _job(width, batch)
    train(warmup)
    rows: list[dict[str, Any]] = []
    model: Any = None
    for round_ in range(pairs):
        names = [n for pair in PAIRS for n in pair]
        for name in names if round_ % 2 == 0 else names[::-1]:
            probe = _attach(name, f"{out}/{name}{round_}-rank{rank}")
            train(settle)  # untimed: the model discovered, the first sample, the first flush
            probe.flush()
            first = probe.step
            cpu, wall = [], []
            for _ in range(block):
                c, w = time.thread_time(), time.perf_counter()
                train(1)
                cpu.append(time.thread_time() - c)
                wall.append(time.perf_counter() - w)
            model = model or next(m for ref in probe.models if (m := ref()) is not None)
            probe.close()
            rows.append({"config": name, "round": round_, "first": first, "cpu": cpu, "wall": wall})
    rows.append({"own_s": own["s"] / max(1, own["n"]), "own_n": own["n"]})
    for name in ("base", "rare"):  # bytecodes of amprobe's frames per unsampled step
        probe = _attach(name, f"{out}/opcodes-{name}-rank{rank}")
        train(settle)
        probe.flush()
        root = os.path.dirname(amprobe.__file__) + os.sep
        with opcodes_in(root) as (per, _lines):
            train(20)
        probe.close()
        rows.append({"opcodes": name, "per_step": sum(per.values()) / 20})
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    with torch.no_grad():
        torch.stack([fingerprint(t) for t in local])
        start = time.thread_time()
        for _ in range(50):
            torch.stack([fingerprint(t) for t in local])
        took = (time.thread_time() - start) / 50
    rows.append(
        {"fingerprint_s": took, "elements": sum(t.numel() for t in local), "tensors": len(local)}
    )
    Path(out, f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
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
        f"FSDP2 on a 2 x 1 mesh (2 replicas), 2 ranks (gloo), MLP width {args.width}, batch "
        f"{args.batch}, fp16 params (fp32 shards), ShardedGradScaler; {args.pairs} rounds of {args.block}-step blocks\n"
    )
    with tempfile.TemporaryDirectory(prefix="bench_fingerprint-") as tmpdir:
        _torchrun(args, tmpdir, [], script=__file__)
        rows = [
            json.loads(line)
            for rank in (0, 1)
            for line in Path(tmpdir, f"rank{rank}.jsonl").read_text().splitlines()
        ]
    alone = [r for r in rows if "fingerprint_s" in r]
    blocks = [r for r in rows if "config" in r]
    codes = [r for r in rows if "opcodes" in r]
    for column, label in (("cpu", "training thread CPU"), ("wall", "wall time")):
        print(f"{label} per step, median over a block (mean of the 2 ranks):")
        ratios_s, ratios_u = [], []
        for round_ in range(args.pairs):
            med: dict[tuple[str, bool], float] = {}
            for name in ("base", "every2"):
                mine = [r for r in blocks if r["config"] == name and r["round"] == round_]
                for sampled in (True, False):
                    med[(name, sampled)] = statistics.mean(
                        statistics.median(
                            v
                            for i, v in enumerate(r[column])
                            if ((r["first"] + i) % 2 == 0) == sampled
                        )
                        for r in mine
                    )
            plain = med[("base", False)]
            added = med[("every2", True)] - med[("every2", False)]
            ratios_s.append(1 + added / plain)
            ratios_u.append(med[("every2", False)] / plain)
            print(
                f"  round {round_}: plain step {1000 * plain:.2f} ms; with fingerprints: "
                f"sampled {1000 * med[('every2', True)]:.2f} ms, unsampled "
                f"{1000 * med[('every2', False)]:.2f} ms  |  sampled step {ratios_s[-1]:.3f}x "
                f"(sampled - unsampled, same block), unsampled/plain {ratios_u[-1]:.3f}x"
            )
        print(
            f"  median of rounds: a step sampled for fingerprints alone "
            f"{statistics.median(ratios_s):.3f}x of a plain step; unsampled step "
            f"{statistics.median(ratios_u):.3f}x (goal <= 1.01)"
        )
        ratios_n = []
        for round_ in range(args.pairs):
            sampled_med = {
                name: statistics.mean(
                    statistics.median(
                        v for i, v in enumerate(r[column]) if (r["first"] + i) % 2 == 0
                    )
                    for r in blocks
                    if r["config"] == name and r["round"] == round_
                )
                for name in ("num2", "both2")
            }
            ratios_n.append(sampled_med["both2"] / sampled_med["num2"])
            print(
                f"  round {round_}: a sampled step (per-layer numerics) "
                f"{1000 * sampled_med['num2']:.2f} ms, with the fingerprints too "
                f"{1000 * sampled_med['both2']:.2f} ms  |  {ratios_n[-1]:.3f}x"
            )
        print(
            f"  median of rounds: fingerprints on a sampled step {statistics.median(ratios_n):.3f}x"
            " (goal <= 1.10)\n"
        )
    per = {
        name: statistics.mean(r["per_step"] for r in codes if r["opcodes"] == name)
        for name in ("base", "rare")
    }
    print(
        f"bytecodes of amprobe's frames per unsampled step (load-independent): scaler only "
        f"{per['base']:.0f}, with the replicas collector {per['rare']:.0f} "
        f"({per['rare'] - per['base']:+.0f})"
    )
    for rank, r in enumerate(r for r in rows if "own_s" in r):
        print(
            f"the collector's step-end work per sampled step, rank {rank}: "
            f"{1000 * r['own_s']:.3f} ms (thread CPU, mean of {r['own_n']} samples)"
        )
    for rank, r in enumerate(alone):
        print(
            f"fingerprints alone, rank {rank}: {1000 * r['fingerprint_s']:.3f} ms for "
            f"{r['tensors']} local tensors, {r['elements']:,} elements"
        )


if __name__ == "__main__":
    main()
