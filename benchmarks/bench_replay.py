"""What the replay of bad steps (issue #34, AMP-N17) costs: per step, and at a bad step.

Run: ``python benchmarks/bench_replay.py [--blocks 4] [--steps 10] [--keep DIR]``. TinyGPT (4
layers, d=256, vocab 1024, batch 16x128, AdamW) trained with CPU fp16 autocast and
``GradScaler("cpu")``, one intra-op thread. Prints, beside the CPU model:

1. **Step time**: plain training, amprobe with ``replay="off"`` and amprobe with ``replay="on"``
   (everything else equal: the default collectors), in this one process, alternating in blocks
   (the order reversed every other block), per-thread CPU time; the median step, its spread
   over blocks, and ratios. A few microseconds drown in a 500 ms step's noise, so the added
   cost is also measured on a tiny MLP (~1 ms steps): amprobe attached with ``replay="on"`` vs
   ``replay="off"``, interleaved rounds of 2000 steps, microseconds a step.
2. **What is kept per step**: the bytes of the output gradient held by the kept references (the
   logits' gradient: batch x seq x vocab x its dtype's size) and how long it is held; the time
   of the CPU generator-state copy (``torch.get_rng_state()``); the resident set size between
   steps and its peak, ``replay="on"`` vs ``"off"``, each in a fresh process, on a TinyGPT with
   a 32k vocabulary (a 64 MiB logits' gradient, large enough for RSS to show it); and the
   formula's figure for a language model (a computation, not a measurement).
3. **A bad step**: an fp16 overflow planted at one step (``blocks.layers.3.linear2``'s weight
   multiplied by 1e6 for that step only, as ``tests/scripts/train_blocks.py`` does with its
   booster: the forward overflows), with one micro-batch a step and with two (gradient
   accumulation: the last micro-batch is replayed); and a gradient-only overflow (the loss
   scale set to 2**24 for that step: the backward variants at lower scales run). For each, the
   replay's recorded ``seconds``, its variants and their times, its cause, and the bad step's
   own time (the budget is ``TIME_FACTOR`` x that time).

Timings are not asserted. ``--keep DIR`` keeps the bad steps' recordings (``amprobe diagnose
DIR/...`` reads them); by default they go to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import TinyGPT, compare_stats, make_batch, train_steps  # noqa: E402
from machine import cpu_model, opcodes_in  # noqa: E402

import amprobe  # noqa: E402
from amprobe.capture.collectors.replay import TIME_FACTOR  # noqa: E402

FP16 = torch.float16
PLANTED = "blocks.layers.3.linear2"


def attach_with(config: dict[str, Any] | None = None):
    def start(model, opt, scaler, run_dir):
        return amprobe.attach(
            model=model, optimizer=opt, scaler=scaler, run_dir=run_dir, config=config
        )

    return start


def _replay_collector(probe: Any) -> Any:
    for c in probe.collectors:
        if c.name == "replay":
            return c
    return None


# -- 1. step time ----------------------------------------------------------------------------
def step_time(blocks: int, steps: int) -> dict[str, tuple[float, float, list[float]]]:
    per_block: dict[str, list[float]] = {}
    stats = compare_stats(
        {
            "plain": None,
            'amprobe replay="off"': attach_with({"replay": "off"}),
            'amprobe replay="on"': attach_with({"replay": "on"}),
        },
        dtype=FP16,
        use_scaler=True,
        blocks=blocks,
        steps_per_block=steps,
        warmup=3,
        skip_first=True,
        alternate=True,
        per_block=per_block,
    )
    return {name: (med, mean, per_block[name]) for name, (med, mean) in stats.items()}


def fixed_cost(steps: int = 2000, rounds: int = 5) -> dict[str, list[float]]:
    """Microseconds of CPU a step, on a tiny MLP: plain, and amprobe with replay off / on
    (each probed block right after a plain block of its own; the order of off/on alternates)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(16, 64)

    def run(n: int) -> float:
        t = time.thread_time()
        for _ in range(n):
            with torch.autocast("cpu", dtype=FP16):
                out = model(x)
                loss = out.float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        return (time.thread_time() - t) / n

    run(300)
    out: dict[str, list[float]] = {"plain": [], "off": [], "on": [], "on - off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            order = ["off", "on"] if i % 2 == 0 else ["on", "off"]
            got: dict[str, float] = {}
            for mode in order:
                probe = amprobe.attach(
                    model=model,
                    optimizer=opt,
                    scaler=scaler,
                    run_dir=f"{tmp}/{i}-{mode}",
                    config={"replay": mode},
                )
                try:
                    run(20)  # the first steps after attach (discovery, first detail steps)
                    got[mode] = run(steps)
                finally:
                    probe.close()
                out["plain"].append(run(steps) * 1e6)
            out["off"].append(got["off"] * 1e6)
            out["on"].append(got["on"] * 1e6)
            out["on - off"].append((got["on"] - got["off"]) * 1e6)
    return out


def _tiny() -> tuple[Any, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(16, 64)

    def step() -> None:
        with torch.autocast("cpu", dtype=FP16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return (model, opt, scaler), step


def where(steps: int = 3000) -> dict[str, Any]:
    """Where replay="on"'s per-step cost goes, on the tiny MLP: bytecodes a step in all frames
    and in amprobe's, replay on vs off (load-independent), the functions that differ most; and
    the thread CPU of the replay collector's calls in the training loop (each wrapped)."""
    import amprobe.capture.collectors.replay as replay_mod
    import amprobe.capture.collectors.replay_run as run_mod

    root = str(Path(amprobe.__file__).resolve().parent.parent)
    (model, opt, scaler), step = _tiny()
    ops: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("off", "on"):
            probe = amprobe.attach(
                model=model, optimizer=opt, scaler=scaler, run_dir=f"{tmp}/{mode}",
                config={"replay": mode},
            )  # fmt: skip
            try:
                for _ in range(30):
                    step()
                total: dict[str, int] = {}
                for _ in range(10):
                    with opcodes_in(None) as (per, _lines):
                        step()
                    for k, v in per.items():
                        total[k] = total.get(k, 0) + v
                ops[mode] = total
            finally:
                probe.close()
        spent: dict[str, int] = {}
        undo = []

        def timed(owner: Any, name: str, label: str) -> None:
            f = getattr(owner, name)

            def wrapper(*a: Any, **k: Any) -> Any:
                t = time.thread_time_ns()
                try:
                    return f(*a, **k)
                finally:
                    spent[label] = spent.get(label, 0) + time.thread_time_ns() - t

            setattr(owner, name, wrapper)
            undo.append((owner, name, f))

        collector = replay_mod.ReplayCollector
        timed(collector, "on_forward_begin", "on_forward_begin (Kept.take)")
        timed(collector, "on_forward_output", "on_forward_output (watch_output)")
        timed(collector, "on_optimizer_step_begin", "on_optimizer_step_begin")
        timed(torch, "get_rng_state", "  of which torch.get_rng_state()")
        timed(torch.Tensor, "register_hook", "  of which Tensor.register_hook")
        keeper = run_mod._keeper

        def timed_keeper(ref: Any, index: int) -> Any:
            keep = keeper(ref, index)

            def hook(grad: Any) -> None:
                t = time.thread_time_ns()
                keep(grad)
                spent["the gradient hook (backward)"] = (
                    spent.get("the gradient hook (backward)", 0) + time.thread_time_ns() - t
                )

            return hook

        run_mod._keeper = timed_keeper
        probe = amprobe.attach(
            model=model, optimizer=opt, scaler=scaler, run_dir=f"{tmp}/timed"
        )  # fmt: skip
        try:
            for _ in range(200):
                step()
            spent.clear()
            for _ in range(steps):
                step()
        finally:
            probe.close()
            run_mod._keeper = keeper
            for owner, name, f in reversed(undo):
                setattr(owner, name, f)
    diff = {k: ops["on"].get(k, 0) - ops["off"].get(k, 0) for k in set(ops["on"]) | set(ops["off"])}
    torch_root = str(Path(torch.__file__).resolve().parent.parent)
    top = sorted(
        ((v / 10, k.replace(root, "").replace(torch_root, "")) for k, v in diff.items() if v),
        reverse=True,
    )
    return {
        "all": {m: sum(v.values()) / 10 for m, v in ops.items()},
        "amprobe": {
            m: sum(n for k, n in v.items() if k.startswith(root + "/amprobe")) / 10
            for m, v in ops.items()
        },
        "top": top[:12],
        "us": {k: v / steps / 1e3 for k, v in spent.items()},
    }


# -- 2. what is kept -------------------------------------------------------------------------
def kept_bytes() -> dict[str, Any]:
    """The gradient the kept references hold after one step of TinyGPT (vocab 1024)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    batch = make_batch()
    with tempfile.TemporaryDirectory() as tmp:
        probe = amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=tmp)
        try:
            train_steps(model, opt, scaler, FP16, batch, 2)
            kept = _replay_collector(probe)._kept
            grads = list(kept.grads.values())
            inputs = [t for t, _ in kept.versions]
            result = {
                "grads": [(tuple(g.shape), str(g.dtype).replace("torch.", "")) for g in grads],
                "grad_bytes": sum(g.numel() * g.element_size() for g in grads),
                "input_bytes": sum(t.numel() * t.element_size() for t in inputs),
                "rng_bytes": kept.rng.numel() * kept.rng.element_size(),
            }
        finally:
            probe.close()
    rng_s = min(timeit.repeat(torch.get_rng_state, number=2000, repeat=5)) / 2000
    result["rng_copy_us"] = rng_s * 1e6
    return result


def memory_worker(mode: str, vocab: int, batch: int, steps: int) -> dict[str, Any]:
    """In a fresh process: RSS between steps (after ``zero_grad``, before the next forward) and
    the peak RSS, with amprobe attached with ``replay=mode`` (or not attached: ``plain``)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(vocab=vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    data = make_batch(batch=batch, vocab=vocab)
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    between: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        probe = (
            amprobe.attach(
                model=model, optimizer=opt, scaler=scaler, run_dir=tmp, config={"replay": mode}
            )
            if mode != "plain"
            else None
        )
        try:
            for _ in range(steps):
                train_steps(model, opt, scaler, FP16, data, 1)
                between.append(rss())
            kept_grad = 0
            if probe is not None and mode == "on":
                kept = _replay_collector(probe)._kept
                kept_grad = sum(g.numel() * g.element_size() for g in kept.grads.values())
        finally:
            if probe is not None:
                probe.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"between": statistics.median(between[1:]), "peak": peak, "kept_grad": kept_grad}


def memory(vocab: int, batch: int, steps: int, rounds: int) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {"plain": [], "off": [], "on": []}
    for i in range(rounds):
        modes = ["plain", "off", "on"] if i % 2 == 0 else ["on", "off", "plain"]
        for mode in modes:
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--memory-worker",
                    mode,
                    "--vocab",
                    str(vocab),
                    "--batch",
                    str(batch),
                    "--mem-steps",
                    str(steps),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            out[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


# -- 3. a bad step ---------------------------------------------------------------------------
def bad_step(
    run_dir: str, micro_batches: int, plant: str = "weight", bad: int = 6, steps: int = 9
) -> dict[str, Any]:
    """Train TinyGPT with an fp16 overflow planted at step ``bad`` (``weight``: the forward
    overflows; ``scaleK``: the loss scale set to 2**K, the gradients overflow, the forward is
    finite); return the replay events, the steps' wall times and thread CPU times."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    x, y = make_batch()
    chunks = list(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True))
    weight = model.get_submodule(PLANTED).weight
    walls: list[float] = []
    cpus: list[float] = []
    probe = amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=run_dir)
    try:
        for step in range(steps):
            saved = None
            if step == bad and plant.startswith("scale"):
                scaler._scale.fill_(2.0 ** int(plant[5:]))  # type: ignore[union-attr]
            elif step == bad:
                saved = weight.detach().clone()
                with torch.no_grad():
                    weight.mul_(1e6)
            w0, c0 = time.perf_counter(), time.thread_time()
            for xb, yb in chunks:
                with torch.autocast("cpu", dtype=FP16):
                    logits = model(xb)
                    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), yb.flatten())
                scaler.scale(loss / micro_batches).backward()
            scaler.step(opt)
            scaler.update()  # a skipped update: the replay runs here, at the step's end
            opt.zero_grad(set_to_none=True)
            walls.append(time.perf_counter() - w0)
            cpus.append(time.thread_time() - c0)
            if saved is not None:
                with torch.no_grad():
                    weight.copy_(saved)
    finally:
        probe.close()
    events = [e for e in amprobe.load_run(run_dir).events_of("replay")]
    return {"events": events, "walls": walls, "cpus": cpus, "bad": bad}


def _detail(event: Any) -> dict[str, Any]:
    detail = event.get("detail") if isinstance(event, dict) else None
    if isinstance(detail, str):
        detail = json.loads(detail)
    if isinstance(detail, dict):
        return {**event, **detail}
    return dict(event)


# -- printing --------------------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=4, help="TinyGPT: blocks per config")
    parser.add_argument("--steps", type=int, default=10, help="TinyGPT: steps per block")
    parser.add_argument("--rounds", type=int, default=5, help="tiny MLP: rounds of 2000 steps")
    parser.add_argument("--mem-rounds", type=int, default=2, help="memory: processes per mode")
    parser.add_argument("--vocab", type=int, default=32768, help="memory: TinyGPT's vocabulary")
    parser.add_argument("--batch", type=int, default=8, help="memory: batch (x 128 tokens)")
    parser.add_argument("--mem-steps", type=int, default=4, help="memory: steps per process")
    parser.add_argument("--keep", default=None, help="keep the bad steps' recordings here")
    parser.add_argument(
        "--only", default="time,fixed,where,memory,bad", help="sections to run, comma-separated"
    )
    parser.add_argument("--memory-worker", choices=("plain", "off", "on"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker:
        print(json.dumps(memory_worker(args.memory_worker, args.vocab, args.batch, args.mem_steps)))
        return
    only = {s.strip() for s in args.only.split(",")}
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')} on {cpu_model()} ({os.cpu_count()} cores), "
        f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}"
    )

    if "time" in only:
        stats = step_time(args.blocks, args.steps)
        base = stats["plain"][0]
        print(
            f"\nTinyGPT, fp16 autocast + GradScaler('cpu'), {args.blocks}x{args.steps} steps "
            "per configuration, alternating blocks, thread CPU time"
        )
        print("| configuration | median step (ms CPU) | block medians (ms) | median ratio |")
        print("|---|---|---|---|")
        for name, (med, _mean, blocks) in stats.items():
            spread = ", ".join(f"{b * 1e3:.0f}" for b in blocks)
            print(f"| {name} | {med * 1e3:.1f} | {spread} | {med / base:.3f} |")
        on = stats['amprobe replay="on"'][2]
        off = stats['amprobe replay="off"'][2]
        pairs = [a / b for a, b in zip(on, off, strict=True)]
        print(
            f'replay="on" / replay="off", block by block: '
            f"{', '.join(f'{p:.3f}' for p in pairs)} (median {statistics.median(pairs):.3f})"
        )

    if "fixed" in only:
        fc = fixed_cost(rounds=args.rounds)
        print(
            f"\nTiny MLP (64-64-64, batch 16), fp16 autocast + GradScaler('cpu'), "
            f"{args.rounds} rounds x 2000 steps, thread CPU time a step"
        )
        print("| | per block (µs; plain: one after each probed block) | median (µs) |")
        print("|---|---|---|")
        for name, values in fc.items():
            label = {"off": 'amprobe replay="off"', "on": 'amprobe replay="on"'}.get(name, name)
            row = ", ".join(f"{v:.1f}" for v in values)
            print(f"| {label} | {row} | {statistics.median(values):.1f} |")

    if "where" in only:
        w = where()
        print(
            "\nWhere it goes (tiny MLP): bytecodes a step, all frames "
            f"off {w['all']['off']:.0f} -> on {w['all']['on']:.0f} "
            f"({w['all']['on'] - w['all']['off']:+.0f}); amprobe's frames "
            f"{w['amprobe']['off']:.0f} -> {w['amprobe']['on']:.0f}; most added:"
        )
        for n, k in w["top"]:
            print(f"  {n:+6.0f}  {k}")
        print("Thread CPU of the replay's calls in the loop (µs a step, each call wrapped):")
        order = [
            "on_forward_begin (Kept.take)",
            "  of which torch.get_rng_state()",
            "on_forward_output (watch_output)",
            "  of which Tensor.register_hook",
            "the gradient hook (backward)",
            "on_optimizer_step_begin",
        ]
        for k in order:
            if k in w["us"]:
                print(f"  {w['us'][k]:6.1f}  {k}")

    if "memory" in only:
        kb = kept_bytes()
        print("\nWhat is kept per step (TinyGPT, vocab 1024, batch 16x128):")
        print(
            f"- output gradient: {kb['grads']} = {_mib(kb['grad_bytes'])} "
            "(16 x 128 x 1024 x 2 bytes), from the backward's first op until the next "
            "step's forward begins (it replaces what was kept)"
        )
        print(f"- inputs: references, no copy ({kb['input_bytes']:,} bytes they hold)")
        print(
            f"- CPU generator state: {kb['rng_bytes']:,} bytes copied, "
            f"torch.get_rng_state() {kb['rng_copy_us']:.2f} µs (best of 5 x 2000 calls)"
        )
        mem = memory(args.vocab, args.batch, args.mem_steps, args.mem_rounds)
        expect = args.batch * 128 * args.vocab * 2
        print(
            f"\nResident memory, TinyGPT with vocab {args.vocab}, batch {args.batch}x128 "
            f"(logits' gradient {args.batch} x 128 x {args.vocab} x 2 bytes = {_mib(expect)}), "
            f"fresh process per row, {args.mem_steps} steps each"
        )
        print("| mode | RSS between steps | peak RSS | kept output gradient |")
        print("|---|---|---|---|")
        for mode, rows in mem.items():
            for r in rows:
                kept = _mib(r["kept_grad"]) if mode == "on" else "-"
                print(f"| {mode} | {_mib(r['between'])} | {_mib(r['peak'])} | {kept} |")
        for what in ("between", "peak"):
            d = statistics.median(r[what] for r in mem["on"]) - statistics.median(
                r[what] for r in mem["off"]
            )
            print(f'{what}: replay="on" - replay="off" = {d / 2**20:+.1f} MiB (medians)')
        llm = 8 * 2048 * 128256 * 2
        print(
            f"A language model's logits' gradient (a computation, not a measurement): "
            f"8 x 2048 x 128,256 x 2 bytes (bf16) = {llm / 2**30:.2f} GiB"
        )

    if "bad" in only:
        keep = args.keep
        tmp = None
        if keep is None:
            tmp = tempfile.TemporaryDirectory()
            keep = tmp.name
        try:
            for plant, mb in (("weight", 1), ("weight", 2), ("scale24", 1)):
                got = bad_step(f"{keep}/bad-{plant}-{mb}mb", micro_batches=mb, plant=plant)
                bad = got["bad"]
                events = [_detail(e) for e in got["events"]]
                normal = statistics.median(
                    w for i, w in enumerate(got["walls"]) if i not in (0, bad)
                )
                what = (
                    f"{PLANTED}.weight x 1e6"
                    if plant == "weight"
                    else f"the loss scale set to 2**{plant[5:]}"
                )
                print(
                    f"\nA bad step: {what} at step {bad}, "
                    f"{mb} micro-batch{'es' if mb > 1 else ''} a step"
                )
                print(
                    f"steps' wall time: ordinary {normal * 1e3:.0f} ms (median), "
                    f"the bad step {got['walls'][bad] * 1e3:.0f} ms with its replay"
                )
                for e in events:
                    if not e.get("replayed"):
                        print(f"not replayed (step {e.get('step')}): {e.get('reason')}")
                        continue
                    seconds = e["seconds"]
                    budget = e["budget_s"]
                    own = budget / TIME_FACTOR
                    print(
                        f"step {e.get('step')}: cause {e.get('cause')}, verified fix "
                        f"{e.get('verified_fix')}, micro-batch {e.get('micro_batch', 1)} of "
                        f"{e.get('micro_batches', 1)}; replay {seconds * 1e3:.0f} ms = "
                        f"{seconds / own:.1f}x the bad step's own {own * 1e3:.0f} ms "
                        f"(budget {budget * 1e3:.0f} ms = {TIME_FACTOR:g}x)"
                        + (f"; incomplete: {e['incomplete']}" if e.get("incomplete") else "")
                    )
                    print(
                        "| variant | loss scale | finite | forward | grads | first non-finite | ms |"
                    )
                    print("|---|---|---|---|---|---|---|")
                    for x in e.get("experiments", []):
                        print(
                            f"| {x['variant']} | {x.get('scale', '-')} | {x['finite']} | "
                            f"{x['forward_finite']} | "
                            f"{x['grads_finite']} | {x['first_nonfinite']} | "
                            f"{x['seconds'] * 1e3:.0f} |"
                        )
        finally:
            if tmp is not None:
                tmp.cleanup()


if __name__ == "__main__":
    main()
