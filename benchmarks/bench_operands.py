"""Cost of the GEMM operands' block statistics on a sampled step (issue 36, item 5).

Run: ``python benchmarks/bench_operands.py``. The CPU TinyGPT of ``common`` (bf16 autocast, one
intra-op thread, thread CPU time per step, after the compiled kernels are built:
``numkernel.wait()``), with the numerics collector sampling every step (a budgeted sample each
time), block statistics on (``block_formats`` default) and off (``[]``), interleaved in blocks
after warm-up; prints both medians side by side and their ratio (goal: at most 1.5x), and
a third configuration whose ``blockstats.measure`` returns zeros at once: the collector's own
share (the operands' numerics rows, hooks, bookkeeping, flush) apart from the reduction.
Other steps: amprobe's bytecodes on an unsampled step, with block statistics on and off (the
hooks exist only on sampled steps: the two counts are equal).

Memory: each configuration runs again in a fresh process for a few sampled steps, and the
process's peak resident set size (Linux ``VmHWM``, which sees torch's CPU allocations, unlike
tracemalloc; not ``ru_maxrss``, which a child started from this process inherits) is printed
for both, with the ratio (goal: at most 1.10x). Peak RSS varies by a few percent between
identical processes: compare several runs.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import TinyGPT, make_batch, train_steps  # noqa: E402
from machine import cpu_model, opcodes_in  # noqa: E402

import amprobe  # noqa: E402
from amprobe.capture.collectors import blockstats, numkernel  # noqa: E402
from amprobe.store.blockformats import STAT_FIELDS, rows_for  # noqa: E402

CONFIGS = {
    "sampled step, block stats off": {"block_formats": []},
    "sampled step, block stats on": {},
}
STUBBED = "block stats on, measure() stubbed"


def _stub(x2d: torch.Tensor, operand: str, formats: tuple[str, ...], divisor: object = None):
    return torch.zeros(len(rows_for(operand, formats)), len(STAT_FIELDS), dtype=torch.float64)


def _config(extra: dict) -> dict:
    return {"collectors": ["scaler", "numerics"], "numerics_every": 1, **extra}


def _memory(name: str, steps: int) -> None:
    """One configuration in this (fresh) process: print its peak RSS as JSON."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    numkernel.wait()
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = make_batch()
    with tempfile.TemporaryDirectory() as tmp:
        probe = amprobe.attach(model, opt, None, run_dir=f"{tmp}/r", config=_config(CONFIGS[name]))
        try:
            train_steps(model, opt, None, torch.bfloat16, batch, steps)
        finally:
            probe.close()
    print(json.dumps({"peak_kib": _peak_rss_kib()}))


def _peak_rss_kib() -> int:
    """This process's peak resident set size in KiB (``VmHWM``; ``ru_maxrss`` off Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="steps per block")
    parser.add_argument("--memory-runs", type=int, default=3, help="fresh processes each")
    parser.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_of is not None:
        _memory(args.memory_of, args.steps)
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    kernel = numkernel.wait()
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = make_batch()
    train_steps(model, opt, None, torch.bfloat16, batch, 3)
    times: dict[str, list[float]] = {name: [] for name in (*CONFIGS, STUBBED)}
    measure = blockstats.measure
    runs = [*CONFIGS.items(), (STUBBED, {})]
    with tempfile.TemporaryDirectory() as tmp:
        for block in range(args.blocks):
            for index, (name, extra) in enumerate(runs):
                blockstats.measure = _stub if name == STUBBED else measure  # type: ignore[assignment]
                probe = amprobe.attach(
                    model, opt, None, run_dir=f"{tmp}/{block}-{index}", config=_config(extra)
                )
                try:
                    # the first step of an attach pays the set-up: not timed
                    times[name] += train_steps(
                        model, opt, None, torch.bfloat16, batch, args.steps + 1
                    )[1:]
                finally:
                    probe.close()
    blockstats.measure = measure  # type: ignore[assignment]
    off, on, stubbed = (statistics.median(times[name]) for name in (*CONFIGS, STUBBED))
    print(
        f"{cpu_model()}; TinyGPT bf16 autocast, one thread, {args.blocks} blocks x "
        f"{args.steps} sampled steps, "
        f"CPU kernel {'ready' if kernel is not None else 'NOT built: ' + numkernel.status()}"
    )
    print(
        f"sampled step without block stats {off * 1e3:.1f} ms | with block stats "
        f"{on * 1e3:.1f} ms | {on / off:.3f}x (goal <= 1.5x)"
    )
    print(
        f"  of which the collector's own share (measure() stubbed): {stubbed * 1e3:.1f} ms, "
        f"{stubbed / off:.3f}x; the block reductions: {(on - stubbed) * 1e3:.1f} ms"
    )
    # other steps: amprobe's Python work on an unsampled step (bytecodes executed in its
    # files), with block statistics on and off: the hooks exist only on sampled steps
    root = str(Path(amprobe.__file__).resolve().parent) + "/"
    per_step = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in CONFIGS.items():
            probe = amprobe.attach(
                model,
                opt,
                None,
                run_dir=f"{tmp}/{name}",
                config=_config({**extra, "numerics_every": 1000}),
            )
            try:
                train_steps(model, opt, None, torch.bfloat16, batch, 2)  # step 0 is sampled
                with opcodes_in(root) as (per, _lines):
                    train_steps(model, opt, None, torch.bfloat16, batch, 3)
                per_step[name] = sum(per.values()) / 3
            finally:
                probe.close()
    off_ops, on_ops = (per_step[name] for name in CONFIGS)
    print(
        f"unsampled step, amprobe bytecodes: without block stats {off_ops:.0f} | with "
        f"{on_ops:.0f} | {on_ops - off_ops:+.0f}"
    )
    rss: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(args.memory_runs):  # alternated, fresh processes: the median of each
        for name in CONFIGS:
            out = subprocess.run(
                [sys.executable, __file__, "--memory-of", name, "--steps", "3"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            rss[name].append(json.loads(out.strip().splitlines()[-1])["peak_kib"] / 1024)
    moff, mon = (statistics.median(rss[name]) for name in CONFIGS)
    print(
        f"peak RSS (fresh processes, 3 sampled steps, median of {args.memory_runs}) without "
        f"block stats {moff:.1f} MiB | with "
        f"{mon:.1f} MiB | {mon / moff:.3f}x (goal <= 1.10x)"
    )


if __name__ == "__main__":
    main()
