"""amprobe's host cost per training step, in microseconds, on a loop too small to hide it.

Run: ``python benchmarks/bench_perstep.py [--processes 4] [--rounds 6] [--pairs 3] [--steps 2000]``.

The loop is issue #20's: a tiny MLP under CPU fp16 autocast with ``GradScaler("cpu")`` (a step
is about a millisecond), so what amprobe adds per step is not hidden by the model's own work, as
on a launch-bound job on a fast GPU. amprobe is attached as ``attach(model, optimizer, scaler)``
with the default configuration, or ``dormant=True``. Two measurements:

1. The always-on path (what every step pays). Separate processes differ in speed by up to 10 %
   on this loop (memory layout), which hides tens of microseconds, so each fresh process
   alternates plain and probed blocks itself: a plain block, ``attach``, a few untimed steps
   (the attach's one-time first samples), a probed block and a flush of its rows, ``close``;
   the figure is the median
   over all rounds of all processes of (probed - plain) per step, in the training thread's CPU
   time.
2. Amortized over the default schedule: what the sampled steps (per-layer numerics, shape
   captures, sync counting) add on top of the always-on path, as the overhead budget measures
   it (their time beyond a typical step, as a share of training time), in long probed blocks
   (``--steps`` steps from ``--warmup`` steps after attach, attach's first samples included in
   the share); amortized = always-on + share x probed step time. The long blocks' own
   difference from their plain block is printed too: on a noisy machine it moves by +-150 us
   from one 2000-step block to the next (the machine's speed drifts over seconds), which is
   why it is not the figure.

3. ``--opcodes``: the Python bytecode instructions amprobe's own frames execute per recorded
   step (``sys.settrace`` with opcode events, 10 steps after 250), the distinct source lines
   they touch, and what a step adds in every frame over the plain loop (torch's slower path for
   a hooked module, generated code such as a dataclass's ``__init__``): counts that do not
   depend on the machine or its load, for comparing versions of the always-on path where
   timings differ by less than this machine's noise. (What such code costs inside a training
   loop is mostly its cold-cache footprint, several times its cost in a tight loop of its own.)

Targets (issue #20): <= 100 us per step amortized with the default configuration, <= 20 us for a
dormant probe. The CPU model is printed beside the figures.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model, opcodes_in  # noqa: E402

MODES = {
    "plain": None,
    "default": {},
    "dormant": {"dormant": True},
}


def worker_ab(mode: str, rounds: int, block: int, settle: int, run_dir: str) -> dict[str, Any]:
    """Plain and probed blocks alternating in this one process (the same memory layout, so a
    process's own speed, which differs by up to 10 % between processes, cancels): per round, a
    plain block, then ``attach``, ``settle`` untimed steps (an attach's one-time first samples)
    and an untimed flush of their rows, a probed block ending in a timed flush of its own rows,
    ``close``. Thread-CPU microseconds per step of each block."""
    import amprobe

    step, model, opt, scaler = _loop()
    for _ in range(300):
        step()

    def timed(n: int, then: Any = None) -> float:
        cpu = time.thread_time()
        for _ in range(n):
            step()
        if then is not None:
            then()
        return (time.thread_time() - cpu) / n * 1e6

    plain, probed, sampling = [], [], None
    for i in range(rounds):
        plain.append(timed(block))
        probe = amprobe.attach(
            model=model, optimizer=opt, scaler=scaler, run_dir=f"{run_dir}-{i}", config=MODES[mode]
        )
        for _ in range(settle):
            step()
        probe.flush()  # the settling steps' rows, untimed
        # the block's rows written within it: a flush is due only every 0.5 s on steps this
        # short, so the block's own rows would otherwise be encoded at close, untimed (this
        # charges a flush per block, more often than the schedule's)
        probed.append(timed(block, probe.flush))
        probe.close()
        sampling = probe.budget.summary()
    return {"plain": plain, "probed": probed, "sampling": sampling}


def opcodes(mode: str | None, warmup: int = 250, steps: int = 10) -> tuple[int, int, int]:
    """Bytecode instructions per step executed in amprobe's frames, the distinct lines they
    touch, and the instructions per step in every frame (torch's own included: what amprobe
    makes torch run, such as a hooked module's slower call path, counts too). ``mode`` None:
    the plain loop (every frame only)."""
    import amprobe

    step, model, opt, scaler = _loop()
    with tempfile.TemporaryDirectory() as tmp:
        probe = None
        if mode is not None:
            probe = amprobe.attach(
                model=model, optimizer=opt, scaler=scaler, run_dir=tmp, config=MODES[mode]
            )
        for _ in range(warmup):
            step()
        with opcodes_in(None) as (every, lines):  # one pass: every frame, amprobe's among them
            for _ in range(steps):
                step()
        if probe is not None:
            probe.close()
    root = os.path.dirname(amprobe.__file__) + os.sep
    ours = sum(n for key, n in every.items() if key.startswith(root))
    ours_lines = sum(1 for filename, _ in lines if filename.startswith(root))
    return ours // steps, ours_lines, sum(every.values()) // steps


def _loop() -> tuple[Any, Any, Any, Any]:
    """The training step of issue #20's loop (seeded, one intra-op thread) and its objects."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(16, 32), torch.randn(16, 1)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step, model, opt, scaler


def _run(args: list[str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, *args], check=True, capture_output=True, text=True
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=4, help="in-process A/B: processes")
    parser.add_argument("--rounds", type=int, default=6, help="in-process A/B: rounds each")
    parser.add_argument("--block", type=int, default=300, help="in-process A/B: steps a block")
    parser.add_argument("--settle", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=3, help="long blocks: fresh processes")
    parser.add_argument("--steps", type=int, default=2000, help="long blocks: steps a block")
    parser.add_argument("--warmup", type=int, default=300, help="long blocks: untimed steps")
    parser.add_argument("--modes", default="default,dormant", help="probed modes, comma-separated")
    parser.add_argument(
        "--opcodes", action="store_true", help="only count bytecodes per step (amprobe's, all)"
    )
    parser.add_argument("--worker", choices=sorted(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--ab", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker and args.ab:
        result = worker_ab(args.worker, args.rounds, args.block, args.settle, args.run_dir)
        print(json.dumps(result))
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); python {sys.version.split()[0]}")
    if args.opcodes:
        plain_ops = opcodes(None)[2]
        print(f"   {'plain':>8}: {plain_ops} bytecodes a step in all frames")
        for mode in modes:
            ops, lines, every = opcodes(mode)
            print(
                f"   {mode:>8}: {ops} bytecodes a step in amprobe's frames, {lines} lines; "
                f"{every} in all frames ({every - plain_ops:+d} on the plain loop)"
            )
        return
    print("tiny MLP, fp16 autocast + GradScaler('cpu'), one intra-op thread, thread CPU time\n")
    with tempfile.TemporaryDirectory() as tmp:
        if args.processes < 1 or args.rounds < 1:
            parser.error("--processes and --rounds must be at least 1")
        print(
            f"1. always-on path: {args.processes} fresh processes x {args.rounds} rounds of a "
            f"plain and a probed {args.block}-step block ({args.settle} untimed steps after each "
            "attach); added = probed - plain per round; median over all rounds"
        )
        always_on: dict[str, float] = {}
        for mode in modes:
            added, plain = [], []
            for i in range(args.processes):
                got = _run(
                    ["--worker", mode, "--ab", "--rounds", str(args.rounds)]
                    + ["--block", str(args.block), "--settle", str(args.settle)]
                    + ["--run-dir", os.path.join(tmp, f"ab-{mode}-{i}")]
                )
                plain += got["plain"]
                added += [b - a for a, b in zip(got["plain"], got["probed"], strict=True)]
            q = statistics.quantiles(added, n=4) if len(added) > 1 else [added[0]] * 3
            always_on[mode] = statistics.median(added)
            print(
                f"   {mode:>8}: plain {statistics.median(plain):7.1f} us/step; added "
                f"{statistics.median(added):+7.1f} us/step (quartiles {q[0]:+.1f} .. {q[2]:+.1f}, "
                f"{len(added)} rounds)"
            )
        if args.pairs < 1:
            return
        print(
            f"\n2. amortized: {args.pairs} fresh processes x a plain and a probed "
            f"{args.steps}-step block (the probed one from {args.warmup} steps after its "
            "attach); amortized = always-on + sampled share x probed step"
        )
        for mode in modes:
            direct, share, probed = [], [], []
            for i in range(args.pairs):
                got = _run(
                    ["--worker", mode, "--ab", "--rounds", "1", "--block", str(args.steps)]
                    + ["--settle", str(args.warmup)]
                    + ["--run-dir", os.path.join(tmp, f"long-{mode}-{i}")]
                )
                direct += [b - a for a, b in zip(got["plain"], got["probed"], strict=True)]
                probed += got["probed"]
                sampling = got.get("sampling") or {}
                share.append(sampling.get("sampled_share") or 0.0)
            sampled = statistics.median(share) * statistics.median(probed)
            print(
                f"   {mode:>8}: sampled steps {statistics.median(share):.2%} of training time "
                f"= {sampled:+.1f} us/step; amortized {always_on[mode] + sampled:+7.1f} us/step "
                f"(long blocks' own difference: " + ", ".join(f"{c:+.0f}" for c in direct) + ")"
            )


if __name__ == "__main__":
    main()
