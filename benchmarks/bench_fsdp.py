"""amprobe on a 2-rank FSDP2 job: probe on and off, alternating, side by side.

Run: ``python benchmarks/bench_fsdp.py [--pairs 4] [--block 100] [--width 512]``.

The job (this file with ``--worker``, launched by ``torchrun --nproc_per_node 2``, gloo on
CPU) is the one of issue 21: every Linear of an MLP and the root under ``fully_shard`` with
``MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)``, ``ShardedGradScaler``.
Both ranks train in blocks of ``--block`` steps, alternately with amprobe off and on (the
order flips from one pair of blocks to the next); "on" is what ``amprobe run`` attaches in the
job (nothing passed, the root model discovered at its first forward, default collectors and
sampling: per-layer numerics on the DTensor shards at each block's step 0, i.e. once per 100
steps, sync counting every 50 steps, one shape capture per block, which is more than a long
run's 3; since the overhead budget, those default periods are minimums). Each block's time is the rank's CPU time over the block (attach before and close
after it are not counted; the probe's flushes inside it are); one intra-op thread. Two clocks:
the process (all threads: gloo's communication threads burn CPU while a rank waits for the
other, so a delay on one rank is counted on both) and the training thread alone (where every
amprobe hook runs).

``--settle N`` (default 5) leaves the first N steps of every block untimed, in both modes: with
a fresh probe per block, they hold its one-time first samples (per-layer numerics at step 0,
shape capture and sync counting at step 1), which a long job pays once and the overhead
budget then spaces out; ``--settle 0`` counts them in every block.

Prints the CPU model, the median block time per mode (mean of the 2 ranks), and the on/off
ratio as the median of the per-pair ratios (the target of issue 21: <= 1.02) and as the
ratio of the medians.
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODES = ("off", "on")


def worker(
    pairs: int, block: int, warmup: int, width: int, batch: int, out: str, settle: int = 0
) -> None:
    """One rank of the FSDP2 job; prints ``block rank=R mode=M cpu_s=X`` per block."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    import amprobe
    import amprobe.capture.probe

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 16),
    )
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ShardedGradScaler("cpu", init_scale=1024.0)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, 16, generator=g)

    def train(n: int) -> None:
        for _ in range(n):
            loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    train(warmup)
    config = {"collectors": (*amprobe.Config().collectors, "discovery")}
    # one untimed attached block first: amprobe's one-time imports are not a block's cost
    probe = amprobe.capture.probe.attach(
        run_dir=f"{out}/warmup-rank{rank}", config=config, adoptable=True, lazy=True
    )
    train(warmup)
    probe.close()
    for pair in range(pairs):
        for mode in MODES if pair % 2 == 0 else tuple(reversed(MODES)):
            probe = None
            if mode == "on":  # what `amprobe run` attaches: nothing passed
                probe = amprobe.capture.probe.attach(
                    run_dir=f"{out}/pair{pair}-rank{rank}", config=config, adoptable=True, lazy=True
                )
            train(settle)  # untimed, both modes: an attach's one-time first samples (below)
            start, start_main = time.process_time(), time.thread_time()
            train(block)
            spent, main = time.process_time() - start, time.thread_time() - start_main
            if probe is not None:
                probe.close()
            print(
                f"block rank={rank} mode={mode} pair={pair} cpu_s={spent:.6f} main_s={main:.6f}",
                flush=True,
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, default=4, help="pairs of on/off blocks")
    parser.add_argument("--block", type=int, default=100, help="steps per block")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument(
        "--settle",
        type=int,
        default=5,
        help="untimed steps at the start of each block (0 counts an attach's first samples)",
    )
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
        f"FSDP2, 2 ranks (gloo), MLP width {args.width}, batch {args.batch}, fp16 params, "
        f"ShardedGradScaler; {args.pairs} pairs of alternating {args.block}-step blocks; "
        "per-rank process CPU time, mean of the 2 ranks\n"
    )
    with tempfile.TemporaryDirectory(prefix="bench_fsdp-") as tmpdir:
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
    found = re.findall(
        r"block rank=(\d) mode=(\w+) pair=(\d+) cpu_s=([0-9.]+) main_s=([0-9.]+)", proc.stdout
    )
    if proc.returncode != 0 or len(found) != 4 * args.pairs:
        raise RuntimeError(f"the job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    for column, label in ((3, "process CPU (all threads)"), (4, "training thread CPU")):
        blocks: dict[tuple[str, int], list[float]] = {}
        for row in found:
            blocks.setdefault((row[1], int(row[2])), []).append(float(row[column]))
        per = {k: statistics.mean(v) for k, v in blocks.items()}
        print(f"{label}:")
        for pair in range(args.pairs):
            off, on = per[("off", pair)], per[("on", pair)]
            print(f"  pair {pair}: off {off:.3f} s  on {on:.3f} s  ratio {on / off:.3f}x")
        med = {m: statistics.median(per[(m, p)] for p in range(args.pairs)) for m in MODES}
        ratio = statistics.median(per[("on", p)] / per[("off", p)] for p in range(args.pairs))
        print(
            f"  median block: off {med['off']:.3f} s  on {med['on']:.3f} s; on/off: median of "
            f"pair ratios {ratio:.3f}x, ratio of medians {med['on'] / med['off']:.3f}x, added "
            f"{1000 * (med['on'] - med['off']) / args.block:.2f} ms/step\n"
        )


if __name__ == "__main__":
    main()
