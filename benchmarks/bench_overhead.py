"""Probe overhead side by side with the peers a user would otherwise reach for.

Run: ``python benchmarks/bench_overhead.py [--blocks 2] [--steps 100]``. TinyGPT (4 layers,
d=256, batch 16x128, AdamW) trained with CPU bf16 autocast; every configuration runs in this one
process, alternating in blocks, timed in per-thread CPU time. Prints, per configuration, the
median step time, the mean over whole blocks (which includes amprobe's sampled steps: numerics
every 100 steps, 3 shape captures, sync counting every 50), and both as ratios to plain training.

Configurations:
- off: plain training.
- amprobe default: scaler, numerics, compute and runtime collectors at their default sampling,
  the model, optimizer and scaler passed to ``attach``.
- amprobe zero-code: the same, with nothing passed (what ``amprobe run`` does: the root model is
  discovered at its first forward).
- amprobe dormant: instrumented, recording nothing (``amprobe run --dormant``).
- amprobe full detail: numerics, shape capture and sync counting on every step.
- detect_anomaly: ``torch.autograd.set_detect_anomaly(True)`` (PyTorch's own NaN hunter).
- DebugUnderflowOverflow: ``transformers.debug_utils.DebugUnderflowOverflow`` (when installed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import compare_stats  # noqa: E402
from machine import cpu_model  # noqa: E402

import amprobe  # noqa: E402
import amprobe.capture.probe  # noqa: E402

FULL = {"numerics_every": 1, "shapes_every": 1, "shapes_captures": 0, "syncs_every": 1}


def attach_with(config: dict | None = None):
    def start(model, opt, scaler, run_dir):
        return amprobe.attach(
            model=model, optimizer=opt, scaler=scaler, run_dir=run_dir, config=config
        )

    return start


def zero_code(model, opt, scaler, run_dir):
    """What `amprobe run` attaches in the job: nothing passed, root models discovered."""
    config = {"collectors": (*amprobe.Config().collectors, "discovery")}
    return amprobe.capture.probe.attach(run_dir=run_dir, config=config, adoptable=True, lazy=True)


class _Anomaly:
    def __init__(self, *args):
        torch.autograd.set_detect_anomaly(True)

    def close(self):
        torch.autograd.set_detect_anomaly(False)


class _Underflow:
    """transformers' DebugUnderflowOverflow has no detach: remove its forward hooks by hand."""

    def __init__(self, model, *args):
        from transformers.debug_utils import DebugUnderflowOverflow

        self.model = model
        self.debug = DebugUnderflowOverflow(model)

    def close(self):
        for module in self.model.modules():
            for key, hook in list(module._forward_hooks.items()):
                if getattr(hook, "__self__", None) is self.debug:
                    del module._forward_hooks[key]


def fixed_cost(steps: int = 2000, rounds: int = 3) -> dict[str, float]:
    """Probe CPU added per step on a tiny model, where the step itself costs ~1 ms.

    The scaler collector's work is a constant per step (a few wrapper calls and 0-d clones),
    independent of model size, so this measures it precisely where side-by-side ratios on a
    400 ms step drown in +-2 % noise. Returns microseconds per step per configuration.
    """
    import tempfile

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(8, 32)

    def run(n: int) -> float:
        t = time.thread_time()
        for _ in range(n):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        return (time.thread_time() - t) / n

    run(100)
    added: dict[str, list[float]] = {"scaler collector": [], "scaler + runtime": []}
    configs = {"scaler collector": ("scaler",), "scaler + runtime": ("scaler", "runtime")}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for name, collectors in configs.items():
                plain = run(steps)
                probe = amprobe.attach(
                    model=model,
                    optimizer=opt,
                    scaler=scaler,
                    run_dir=f"{tmp}/{i}-{len(collectors)}",
                    config={"collectors": collectors},
                )
                try:
                    probed = run(steps)
                finally:
                    probe.close()
                added[name].append(probed - plain)
    return {name: sorted(v)[len(v) // 2] * 1e6 for name, v in added.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument(
        "--steps", type=int, default=100, help="steps per block (>= 100 to include sampling)"
    )
    parser.add_argument(
        "--scaler", action="store_true", help="also use a GradScaler (bf16 needs none)"
    )
    parser.add_argument(
        "--foundation",
        action="store_true",
        help="only off vs the scaler collector alone vs the default, with a GradScaler",
    )
    parser.add_argument(
        "--core",
        action="store_true",
        help="only off vs default (model passed) vs zero-code (nothing passed) vs dormant",
    )
    parser.add_argument(
        "--fixed-cost",
        action="store_true",
        help="only measure the per-step CPU the scaler/runtime collectors add (tiny model)",
    )
    args = parser.parse_args()
    if args.fixed_cost:
        for name, micros in fixed_cost().items():
            print(f"{name}: {micros:.1f} us of CPU added per step")
        return
    if args.core:
        stats = compare_stats(
            {
                "off": None,
                "amprobe default": attach_with(),
                "amprobe zero-code": zero_code,
                "amprobe dormant": attach_with({"dormant": True}),
            },
            dtype=torch.bfloat16,
            use_scaler=args.scaler,
            blocks=args.blocks,
            steps_per_block=args.steps,
        )
        _print(stats, args)
        return
    if args.foundation:
        stats = compare_stats(
            {
                "off": None,
                "amprobe scaler only": attach_with({"collectors": ("scaler",)}),
                "amprobe default": attach_with(),
            },
            dtype=torch.bfloat16,
            use_scaler=True,
            blocks=args.blocks,
            steps_per_block=args.steps,
        )
        _print(stats, args)
        return
    configs = {
        "off": None,
        "amprobe default": attach_with(),
        "amprobe zero-code": zero_code,
        "amprobe full detail": attach_with(FULL),
        "detect_anomaly": lambda model, opt, scaler, run_dir: _Anomaly(),
    }
    try:
        import transformers.debug_utils  # noqa: F401

        configs["DebugUnderflowOverflow"] = lambda model, opt, scaler, run_dir: _Underflow(model)
    except ImportError:
        print("transformers is not installed: DebugUnderflowOverflow not measured")
    stats = compare_stats(
        configs,
        dtype=torch.bfloat16,
        use_scaler=args.scaler,
        blocks=args.blocks,
        steps_per_block=args.steps,
    )
    _print(stats, args)


def _print(stats: dict[str, tuple[float, float]], args: argparse.Namespace) -> None:
    base_median, base_mean = stats["off"]
    print(
        f"\n{time.strftime('%Y-%m-%d')} on {cpu_model()}, "
        f"torch {torch.__version__}, {args.blocks}x{args.steps} steps per configuration"
    )
    print(f"| {'configuration':<24} | median step (ms CPU) | median ratio | mean ratio |")
    print(f"|{'-' * 26}|---------------------|--------------|------------|")
    for name, (median, mean) in stats.items():
        print(
            f"| {name:<24} | {median * 1e3:>19.1f} | {median / base_median:>12.3f} | {mean / base_mean:>10.3f} |"
        )


if __name__ == "__main__":
    main()
