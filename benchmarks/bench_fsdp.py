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
the process (all threads, gloo's included) and the training thread alone (where every amprobe
hook runs). Each block also takes every thread's CPU time by thread name
(``/proc/self/task/*/schedstat``, Linux): amprobe starts no thread of its own on this job (the
control watcher runs only in a dormant probe), and gloo's two threads (``gloo_tcp_loop``,
``pt_gloo_runloop``, about a third of the process's CPU here) vary by tens of percent from block
to block; a rank waiting for the other costs them no CPU (a blocking wait: measured, a 1 s wait
in an all-reduce costs about 2 ms of process CPU). So the process clock's ratio carries gloo's
noise, and the training thread's is where amprobe's hooks cost.

``--settle N`` (default 5) leaves the first N steps of every block untimed, in both modes: with
a fresh probe per block, they hold its one-time first samples (per-layer numerics at step 0,
shape capture and sync counting at step 1), which a long job pays once and the overhead
budget then spaces out; the probe's first flush, which makes the run directory (measured on
this job: 3.0-4.4 ms of CPU and 7-16 ms wall with its fsyncs, against 1.6-3.0 ms of CPU for a
later flush of 100 steps), is taken there too, so a timed block holds one ordinary flush, as
100 steps of a long job do (the default flushes every 100 steps once 0.5 s have passed since
the last flush: this job's 100 steps take longer; a block of shorter steps holds fewer). ``--settle 0`` counts all of them in every block.

``--opcodes`` instead counts the Python bytecodes amprobe's own frames execute per recorded
step of this job (``sys.settrace`` with opcode events, ``--opcode-steps`` unsampled steps after
the first samples and flush), per function: a figure that does not depend on the machine's
load, for comparing versions of the per-step path on the FSDP2 job.

Prints the CPU model, the median block time per mode (mean of the 2 ranks), and the on/off
ratio as the median of the per-pair ratios (the target of issue 21: <= 1.02) and as the
ratio of the medians, then the CPU each thread took (by name) per mode.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model, opcodes_in  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODES = ("off", "on")


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far, summed per thread name (Linux ``/proc``;
    empty elsewhere). ``schedstat``'s first field is the thread's time on a CPU in ns. A Python
    thread is named by its ``threading`` name (``MainThread``, ``amprobe-control``: the OS name
    of every Python thread is the program's before Python 3.14), any other by its OS name."""
    import threading

    python = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name = python.get(int(tid)) or Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        out[name] = out.get(name, 0.0) + ns / 1e9
    return out


def _since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each thread name's CPU seconds between two :func:`thread_cpu` readings (a thread that
    started in between counts from zero; one that ended is lost with its time)."""
    return {k: round(v - before.get(k, 0.0), 6) for k, v in after.items()}


def _job(width: int, batch: int, mesh: Any = None) -> Any:
    """The FSDP2 job of this rank: ``train(n)`` runs n steps (on ``mesh``, a DeviceMesh; None:
    FSDP2's default, one dimension over every rank)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

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
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
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

    return train


def worker(
    pairs: int, block: int, warmup: int, width: int, batch: int, out: str, settle: int = 0
) -> None:
    """One rank of the FSDP2 job; appends one JSON row per block to ``OUT/blocks-rankR.jsonl``
    (``mode``, ``pair``, ``cpu_s``: process CPU, ``main_s``: training thread CPU, ``threads``:
    CPU per thread name)."""
    import torch.distributed as dist

    import amprobe
    import amprobe.capture.probe

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    train = _job(width, batch)
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
            if probe is not None and settle:
                probe.flush()  # the first flush makes the run directory: once per run
            threads = thread_cpu()
            start, start_main = time.process_time(), time.thread_time()
            train(block)
            spent, main = time.process_time() - start, time.thread_time() - start_main
            threads = _since(threads, thread_cpu())
            if probe is not None:
                probe.close()
            row = {"mode": mode, "pair": pair, "cpu_s": spent, "main_s": main, "threads": threads}
            with open(Path(out, f"blocks-rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


def worker_opcodes(warmup: int, steps: int, width: int, batch: int, out: str) -> None:
    """One rank: amprobe attached as in the blocks; after ``warmup`` steps (the first samples
    and the first flush), the bytecodes amprobe's frames execute over ``steps`` steps, per
    function, written to ``OUT/opcodes-rankR.json``."""
    import torch.distributed as dist

    import amprobe
    import amprobe.capture.probe

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    train = _job(width, batch)
    config = {"collectors": (*amprobe.Config().collectors, "discovery")}
    probe = amprobe.capture.probe.attach(
        run_dir=f"{out}/opcodes-rank{rank}", config=config, adoptable=True, lazy=True
    )
    train(warmup)
    root = os.path.dirname(amprobe.__file__) + os.sep
    first = probe.step
    with opcodes_in(root) as (per, lines):
        train(steps)
    counted = probe.step - first
    probe.close()
    result = {
        "per_step": sum(per.values()) // max(1, counted),
        "lines": len(lines),
        "functions": {k: v / max(1, counted) for k, v in per.items()},
    }
    Path(out, f"opcodes-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _torchrun(
    args: argparse.Namespace, tmpdir: str, extra: list[str], script: str = __file__
) -> None:
    """Run ``script``'s worker (this file's by default) on 2 ranks, each writing its results
    under ``tmpdir``; ``args`` holds the options every such worker takes."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(args.port),
        str(Path(script).resolve()),
        "--worker",
        "--out",
        tmpdir,
        *("--pairs", str(args.pairs), "--block", str(args.block)),
        *("--warmup", str(args.warmup), "--width", str(args.width)),
        *("--batch", str(args.batch), "--settle", str(args.settle)),
        *extra,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def _print_threads(rows: list[tuple[str, int, dict[str, float]]], pairs: int, block: int) -> None:
    """Per thread name: the median over pairs of the block's CPU (mean of the ranks) per mode."""
    names = sorted({name for _, _, threads in rows for name in threads})
    print("CPU per thread (by name), median block, mean of the 2 ranks:")
    for name in names:
        per: dict[tuple[str, int], list[float]] = {}
        for mode, pair, threads in rows:
            per.setdefault((mode, pair), []).append(threads.get(name, 0.0))
        med = {
            m: statistics.median(statistics.mean(per.get((m, p), [0.0])) for p in range(pairs))
            for m in MODES
        }
        spread = {
            m: (
                min(statistics.mean(per.get((m, p), [0.0])) for p in range(pairs)),
                max(statistics.mean(per.get((m, p), [0.0])) for p in range(pairs)),
            )
            for m in MODES
        }
        print(
            f"  {name:<18} off {med['off']:.3f} s ({spread['off'][0]:.3f}-{spread['off'][1]:.3f})"
            f"  on {med['on']:.3f} s ({spread['on'][0]:.3f}-{spread['on'][1]:.3f})  added "
            f"{1000 * (med['on'] - med['off']) / block:+.2f} ms/step"
        )
    own = [n for n in names if n.startswith("amprobe")]
    print(f"  amprobe's own threads: {', '.join(own) if own else 'none'}\n")


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
    parser.add_argument(
        "--opcodes", action="store_true", help="only count amprobe's bytecodes per step"
    )
    parser.add_argument("--opcode-steps", type=int, default=10, help="steps traced by --opcodes")
    args = parser.parse_args()
    if args.worker and args.opcodes:
        worker_opcodes(max(args.block, 120), args.opcode_steps, args.width, args.batch, args.out)
        return
    if args.worker:
        worker(args.pairs, args.block, args.warmup, args.width, args.batch, args.out, args.settle)
        return
    import torch

    print(
        f"CPU: {cpu_model()} ({os.cpu_count()} logical cores), Python "
        f"{platform.python_version()}, torch {torch.__version__}"
    )
    if args.opcodes:
        print(
            f"FSDP2, 2 ranks (gloo), MLP width {args.width}: bytecodes amprobe's frames execute "
            f"per recorded step ({args.opcode_steps} unsampled steps after the first samples)"
        )
        with tempfile.TemporaryDirectory(prefix="bench_fsdp-") as tmpdir:
            _torchrun(args, tmpdir, ["--opcodes", "--opcode-steps", str(args.opcode_steps)])
            results = [
                json.loads(Path(tmpdir, f"opcodes-rank{r}.json").read_text()) for r in (0, 1)
            ]
        for rank, result in enumerate(results):
            print(f"  rank {rank}: {result['per_step']} bytecodes a step, {result['lines']} lines")
        print("  rank 0, by function:")
        top = sorted(results[0]["functions"].items(), key=lambda kv: -kv[1])[:20]
        for name, n in top:
            print(f"    {n:8.1f}  {name}")
        return
    print(
        f"FSDP2, 2 ranks (gloo), MLP width {args.width}, batch {args.batch}, fp16 params, "
        f"ShardedGradScaler; {args.pairs} pairs of alternating {args.block}-step blocks; "
        "per-rank process CPU time, mean of the 2 ranks\n"
    )
    with tempfile.TemporaryDirectory(prefix="bench_fsdp-") as tmpdir:
        _torchrun(args, tmpdir, [])
        found = [
            json.loads(line)
            for rank in (0, 1)
            for line in Path(tmpdir, f"blocks-rank{rank}.jsonl").read_text().splitlines()
        ]
    if len(found) != 4 * args.pairs:
        raise RuntimeError(f"expected {4 * args.pairs} blocks, got {len(found)}")
    for column, label in (
        ("cpu_s", "process CPU (all threads)"),
        ("main_s", "training thread CPU"),
    ):
        blocks: dict[tuple[str, int], list[float]] = {}
        for row in found:
            blocks.setdefault((row["mode"], row["pair"]), []).append(row[column])
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
    _print_threads([(r["mode"], r["pair"], r["threads"]) for r in found], args.pairs, args.block)


if __name__ == "__main__":
    main()
