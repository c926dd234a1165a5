"""Per-layer numerics on every step: v2 statistics side by side with plain training, v1 and peers.

Run: ``python benchmarks/bench_numerics_v2.py [--blocks 3] [--steps 6] [--skip-e2e]``.

Part 1, end to end. ``bench_overhead.py``'s TinyGPT (4 layers, d=256, batch 16x128, AdamW)
under CPU bf16 autocast, without and with a GradScaler (the scaler makes every gradient go
through the unscaling path, as fp16 training does). Every configuration runs in this one
process, alternating in blocks, timed in per-thread CPU time with one intra-op thread; the first
step after each attach is left untimed; medians are quoted. Configurations:

- off: plain training.
- numerics v1, every step: the original reduction (``StepStatsV1`` of
  ``tests/numstats_reference.py``) in the collector.
- v2 eager reduction: the collector with the eager torch reduction (``StepStats`` with
  ``kernel=False``): what runs before the compiled kernel is built or without a C compiler.
- numerics v2, every step: the collector as shipped, ``numerics_every=1`` (the compiled CPU
  kernel of ``numkernel``, built before anything is timed).
- v2, Dropout not hooked: as above, but ``numerics_layers`` leaves out the ``nn.Dropout``
  modules (p=0 here: their output is their input); a prototype of a hook-layer policy.
- hooks only, every step: the collector's hooks and bookkeeping with a no-op reduction; what the
  hook layer costs by itself.
- always-on only: ``numerics_every`` so large no step after the first is sampled; what every
  unsampled step pays.
- detect_anomaly: ``torch.autograd.set_detect_anomaly(True)``.
- DebugUnderflowOverflow: ``transformers.debug_utils.DebugUnderflowOverflow`` (when installed).

Measured 2026-12-02 on an Intel Xeon with AMX and native bf16 (2 cores shared, load about 2),
6x5 steps alternating: off 328 ms; v2 eager 1.56x, v2 with the compiled kernel 1.15x, v2 with
Dropout not hooked 1.09x, hooks only 1.01x (bf16); with a GradScaler 1.55x, 1.15x, 1.14x,
1.01x (three runs: kernel 1.13x to 1.16x bf16, 1.15x with the scaler; the kernel before its
rework, side by side with it in one process, five runs: 1.28x to 1.37x). Replayed reductions,
one bf16 step: v2 eager 165 ms (145 ms tensors, 13 ms inputs, 7 ms fold), kernel 53 ms (41,
12, 1); fp16 with scaled gradients 168 ms against 59 ms. (The replay's tensors are clones: a
tensor measured twice in a training step, a Dropout(p=0) output, costs a second pass here, not
in training.) ``--configs`` selects end-to-end configurations by name (``off`` always runs).

Part 2, reductions only. The tensors the collector measured in one sampled step are kept and
replayed through v1 and v2 outside training, as bf16 and as fp16 with scaled gradients (CPU fp16
autocast emulates its matmuls, about 12 s a step here, which would hide any overhead): the cost
of the statistics per step, split into per-tensor work, module-input checks and the once-a-step
fold, as milliseconds and as a share of the plain bf16 step. (The replay counts every module
input with ``count_nonfinite``; in the collector most inputs are other modules' outputs and
their count comes free from the histogram already taken.)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import TinyGPT, compare_stats, make_batch, train_steps  # noqa: E402
from machine import cpu_model  # noqa: E402

import amprobe  # noqa: E402
import amprobe.capture.boundary as boundary  # noqa: E402
import amprobe.capture.collectors.numerics as numerics  # noqa: E402
from amprobe.capture.collectors import numkernel, numstats  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package: v1 lives there
from tests import numstats_reference  # noqa: E402


class _NoStats:
    """StepStats' interface doing nothing: leaves only the hook layer's own cost."""

    def __init__(self, slots: int, device: torch.device, sync_free: bool | None = None) -> None:
        self.slots, self.device = slots, device
        self.sync_free = device.type != "cpu" if sync_free is None else sync_free

    def reset(self) -> _NoStats:
        return self

    def add(self, *args: Any, **kwargs: Any) -> None:
        return None

    def add_in_bad(self, *args: Any) -> None:
        return None

    def count_nonfinite(self, x: torch.Tensor) -> int:
        return 0

    def table(self) -> torch.Tensor:
        return torch.zeros(self.slots, numstats.K, dtype=torch.int64)


@contextlib.contextmanager
def _kernel(stats_cls: Any, nonfinite: Callable[..., Any]) -> Iterator[None]:
    # the collector's statistics and its input counts, and the hub's input check of every step
    saved = numerics.StepStats, numerics.count_nonfinite, boundary.count_nonfinite
    numerics.StepStats, numerics.count_nonfinite = stats_cls, nonfinite  # type: ignore[misc]
    boundary.count_nonfinite = nonfinite  # type: ignore[assignment]
    try:
        yield
    finally:
        numerics.StepStats, numerics.count_nonfinite, boundary.count_nonfinite = saved  # type: ignore[misc]


class _Probe:
    """amprobe with the numerics collector on a given reduction."""

    def __init__(self, model, opt, scaler, run_dir, every, stats_cls, nonfinite, skip=()) -> None:  # type: ignore[no-untyped-def]
        self.ctx = _kernel(stats_cls, nonfinite)
        self.ctx.__enter__()
        config: dict[str, Any] = {"collectors": ["scaler", "numerics"], "numerics_every": every}
        if skip:  # prototype of a hook-layer policy: leave these module types unhooked
            config["numerics_layers"] = [
                name or "<root>" for name, m in model.named_modules() if not isinstance(m, skip)
            ]
        self.probe = amprobe.attach(
            model=model, optimizer=opt, scaler=scaler, run_dir=run_dir, config=config
        )

    def close(self) -> None:
        try:
            self.probe.close()
        finally:
            self.ctx.__exit__(None, None, None)


class _Anomaly:
    def __init__(self) -> None:
        torch.autograd.set_detect_anomaly(True)

    def close(self) -> None:
        torch.autograd.set_detect_anomaly(False)


class _Underflow:
    def __init__(self, model: torch.nn.Module) -> None:
        from transformers.debug_utils import DebugUnderflowOverflow

        self.model = model
        self.debug = DebugUnderflowOverflow(model)

    def close(self) -> None:
        for module in self.model.modules():
            for key, hook in list(module._forward_hooks.items()):
                if getattr(hook, "__self__", None) is self.debug:
                    del module._forward_hooks[key]


def _configs() -> dict[str, Callable[..., Any] | None]:
    v2 = (numstats.StepStats, numstats.count_nonfinite)
    eager = (functools.partial(numstats.StepStats, kernel=False), numstats.count_nonfinite)
    v1 = (numstats_reference.StepStatsV1, numstats_reference.count_nonfinite_v1)
    hooks = (_NoStats, lambda x, sync_free=None: 0)
    configs: dict[str, Callable[..., Any] | None] = {
        "off": None,
        "numerics v1, every step": lambda m, o, s, d: _Probe(m, o, s, d, 1, *v1),
        "v2 eager reduction": lambda m, o, s, d: _Probe(m, o, s, d, 1, *eager),
        "numerics v2, every step": lambda m, o, s, d: _Probe(m, o, s, d, 1, *v2),
        "v2, Dropout not hooked": lambda m, o, s, d: _Probe(
            m, o, s, d, 1, *v2, skip=(torch.nn.Dropout,)
        ),
        "hooks only, every step": lambda m, o, s, d: _Probe(m, o, s, d, 1, *hooks),
        "always-on only": lambda m, o, s, d: _Probe(m, o, s, d, 10**9, *v2),
        "detect_anomaly": lambda m, o, s, d: _Anomaly(),
    }
    try:
        import transformers.debug_utils  # noqa: F401

        configs["DebugUnderflowOverflow"] = lambda m, o, s, d: _Underflow(m)
    except ImportError:
        print("note: transformers is not installed, DebugUnderflowOverflow not measured")
    return configs


def end_to_end(
    use_scaler: bool, blocks: int, steps: int, only: list[str] | None = None
) -> dict[str, tuple[float, float]]:
    """Per configuration: the median step thread-CPU seconds over all blocks, and the median
    over blocks of its block's median divided by the same block's ``off`` median (blocks
    interleaved, so a pair runs seconds apart: the figure this machine's drift leaves)."""
    configs = _configs()
    if only:
        configs = {k: v for k, v in configs.items() if k == "off" or any(o in k for o in only)}
    per_block: dict[str, list[float]] = {}
    stats = compare_stats(
        configs,
        dtype=torch.bfloat16,
        use_scaler=use_scaler,
        blocks=blocks,
        steps_per_block=steps,
        warmup=2,
        skip_first=True,
        alternate=True,
        per_block=per_block,
    )
    off = per_block["off"]
    return {
        name: (median, statistics.median(b / o for b, o in zip(per_block[name], off, strict=True)))
        for name, (median, _) in stats.items()
    }


class _Recorder:
    """StepStats that keeps (slot, tensor, scale) of every call for the replay."""

    calls: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
    inputs: list[torch.Tensor] = []

    def __init__(self, slots: int, device: torch.device, sync_free: bool | None = None) -> None:
        self.inner = numstats.StepStats(slots, device, sync_free)
        self.slots, self.device, self.sync_free = slots, device, self.inner.sync_free

    def reset(self) -> _Recorder:
        self.inner.reset()
        return self

    def add(self, slot, x, scale=None, in_bad=None) -> None:  # type: ignore[no-untyped-def]
        _Recorder.calls.append((slot, x.detach().clone(), scale))

    def add_in_bad(self, slot: int, in_bad: Any) -> None:
        return None

    def count_nonfinite(self, x: torch.Tensor) -> int:
        _Recorder.inputs.append(x.detach().clone())
        return 0

    def table(self) -> torch.Tensor:
        return self.inner.table()


def _record_step() -> tuple[int, list[tuple[int, torch.Tensor, torch.Tensor | None]], list]:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = make_batch()
    train_steps(model, opt, None, torch.bfloat16, batch, 2)

    def keep_input(x: torch.Tensor, sync_free: bool | None = None) -> int:
        _Recorder.inputs.append(x.detach().clone())
        return 0

    with tempfile.TemporaryDirectory() as tmp, _kernel(_Recorder, keep_input):
        probe = amprobe.attach(
            model, opt, None, run_dir=f"{tmp}/r", config={"collectors": ["numerics"]}
        )
        try:
            train_steps(model, opt, None, torch.bfloat16, batch, 1)
        finally:
            probe.close()
        slots = len(next(c for c in probe.collectors if c.name == "numerics")._slots)
    return slots, _Recorder.calls, _Recorder.inputs


def replay(rounds: int = 3) -> dict[str, dict[str, float]]:
    """Thread-CPU ms per step of the reductions alone, median of ``rounds``."""
    torch.set_num_threads(1)
    slots, calls, inputs = _record_step()
    scale = torch.tensor(2.0**16)
    fp16_calls = []
    for slot, x, s in calls:
        if x.dtype == torch.bfloat16:  # fp16 training: gradients are held scaled
            x = (x.float() * (scale if s is not None else 1.0)).to(torch.float16)
        fp16_calls.append((slot, x, scale if s is not None else None))
    fp16_inputs = [x.half() if x.dtype == torch.bfloat16 else x for x in inputs]
    cpu = torch.device("cpu")
    results: dict[str, dict[str, float]] = {}
    for label, work, ins in (
        ("bf16", calls, inputs),
        ("fp16 + loss scale 2^16", fp16_calls, fp16_inputs),
    ):
        for name, cls, nonfinite in (
            ("v1", numstats_reference.StepStatsV1, numstats_reference.count_nonfinite_v1),
            (
                "v2 eager",
                functools.partial(numstats.StepStats, kernel=False),
                numstats.count_nonfinite,
            ),
            (
                "v2 kernel",
                functools.partial(numstats.StepStats, kernel=True),
                numstats.count_nonfinite,
            ),
        ):
            stats = cls(slots, cpu)
            parts: dict[str, list[float]] = {"tensors": [], "inputs": [], "fold": []}
            for _ in range(rounds):
                stats.reset()
                t0 = time.thread_time()
                for slot, x, s in work:
                    stats.add(slot, x, scale=s)
                t1 = time.thread_time()
                for x in ins:
                    nonfinite(x, False)
                t2 = time.thread_time()
                stats.table()
                t3 = time.thread_time()
                parts["tensors"].append(t1 - t0)
                parts["inputs"].append(t2 - t1)
                parts["fold"].append(t3 - t2)
            results[f"{label} {name}"] = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
    n_elem = sum(x.numel() for _, x, _ in calls)
    print(
        f"replayed one step: {len(calls)} tensors, {n_elem / 1e6:.1f} M elements, "
        f"{len(inputs)} module inputs ({sum(x.numel() for x in inputs) / 1e6:.1f} M elements)"
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per block")
    parser.add_argument("--skip-e2e", action="store_true", help="only the reduction replay")
    parser.add_argument("--skip-replay", action="store_true", help="only the end-to-end part")
    parser.add_argument(
        "--configs", nargs="*", help="end to end: only the configurations naming one of these"
    )
    args = parser.parse_args()
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')} on {cpu_model()}, torch {torch.__version__}, "
        "1 intra-op thread, thread CPU time"
    )
    numkernel.wait()  # built (or loaded from the cache) before anything is timed
    print(f"compiled statistics kernel: {numkernel.status()}")
    base = None
    if not args.skip_e2e:
        for use_scaler in (False, True):
            results = end_to_end(use_scaler, args.blocks, args.steps, args.configs)
            base = base or results["off"][0]
            title = "bf16 autocast" + (" + GradScaler" if use_scaler else "")
            print(f"\nTinyGPT {title}, {args.blocks}x{args.steps} steps per configuration")
            print(
                f"| {'configuration':<26} | median step (ms CPU) | ratio of medians "
                "| median of block ratios |"
            )
            print(f"|{'-' * 28}|---------------------|------------------|------------------------|")
            off = results["off"][0]
            for name, (value, pair) in results.items():
                print(
                    f"| {name:<26} | {value * 1e3:>19.1f} | {value / off:>16.3f} | {pair:>22.3f} |"
                )
    if not args.skip_replay:
        results = replay()
        print("\nReductions alone, ms CPU per step (median of 3 replays)")
        head = "| kernel" + " " * 26 + "| tensors | module inputs | fold | total |"
        if base:
            head += " share of plain step |"
        print(head)
        for name, parts in results.items():
            total = sum(parts.values())
            line = (
                f"| {name:<31} | {parts['tensors']:>7.1f} | {parts['inputs']:>13.1f} "
                f"| {parts['fold']:>4.1f} | {total:>5.1f} |"
            )
            if base:
                line += f" {total / (base * 1e3):>19.3f} |"
            print(line)


if __name__ == "__main__":
    main()
