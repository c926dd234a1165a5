"""Loading and diagnosing a big multi-rank run: 256 ranks x 10,000 steps by default.

Run: ``python benchmarks/bench_many_ranks.py [--ranks 256] [--steps 10000] [--keep DIR]``.
Synthesizes the run directory (JSON Lines in the schema of :mod:`amprobe.store.schema`, as the
probe writes them), then prints the time of ``load_run`` + reading the steps and events tables,
and of ``diagnose``. The run has realistic content: a synchronized overflow every 2000 steps on
every rank (as DDP produces), one rank with a different ``init_scale`` (AMP-D01) and one slow
rank (AMP-D02), so the cross-rank rules and the per-rank grouping have work to do.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

import amprobe
from amprobe.store import schema

DIVERGENT_RANK = 3  # starts with init_scale 2**17 instead of 2**16
SLOW_RANK = 7  # 3x slower steps


def _steps_frame(rank: int, steps: int, rng: np.random.Generator) -> pd.DataFrame:
    """One rank's steps: scale trajectory of GradScaler with overflows every ~500 steps."""
    overflow = np.zeros(steps, dtype=bool)
    overflow[np.arange(1500, steps, 2000)] = True  # same steps on every rank: synchronized
    init = 2.0**17 if rank == DIVERGENT_RANK else 2.0**16
    before = np.empty(steps)
    after = np.empty(steps)
    scale, tracker = init, 0
    for i in range(steps):  # the GradScaler update rule, growth_interval 2000
        before[i] = scale
        if overflow[i]:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == 2000:
                scale, tracker = scale * 2.0, 0
        after[i] = scale
    wall = rng.normal(0.100, 0.004, steps).clip(0.05) * (3.0 if rank == SLOW_RANK else 1.0)
    return pd.DataFrame(
        {
            "step": np.arange(steps),
            "window": 0,
            "t": np.cumsum(wall),
            "wall_s": wall,
            "probe_s": 0.0,
            "scaler_enabled": True,
            "scale_before": before,
            "scale_after": after,
            "growth_tracker": 0.0,
            "found_inf": overflow.astype(float),
            "skipped": overflow,
            "opt_steps": (~overflow).astype(int),
            "unscale_calls": 0,
            "clip_calls": 0,
            "clip_scaled": 0,
            "loss": rng.normal(2.0, 0.1, steps),
            "loss_dtype": "float32",
            "autocast_device": "cuda",
            "autocast_dtype": "float16",
        }
    )


def _events(rank: int, steps: int) -> list[dict]:
    rows = [
        ("run_start", 0, {"recording": True}),
        ("model_registered", 0, {"model_class": "GPT", "parameters": 124_000_000}),
        (
            "scaler_created",
            0,
            {
                "init_scale": 2.0**17 if rank == DIVERGENT_RANK else 2.0**16,
                "growth_interval": 2000,
                "enabled": True,
                "site": "train.py:80",
            },
        ),
        (
            "optimizer_seen",
            0,
            {
                "optimizer_class": "AdamW",
                "trainable_params": 124_000_000,
                "trainable_half_params": 0,
            },
        ),
    ]
    rows += [("checkpoint_saved", s, {"path": f"ckpt/{s}.pt"}) for s in range(0, steps, 1000)]
    rows.append(("run_end", steps, {"steps": steps}))
    return [
        {"step": s, "t": float(s) * 0.1, "kind": k, "detail": json.dumps(d, sort_keys=True)}
        for k, s, d in rows
    ]


def synthesize(root: Path, ranks: int, steps: int) -> None:
    """Write a finished run of ``ranks`` x ``steps`` into ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": schema.FORMAT,
        "schema_version": schema.SCHEMA_VERSION,
        "world_size": ranks,
    }
    (root / schema.RUN_MANIFEST).write_text(json.dumps(manifest))
    rng = np.random.default_rng(0)
    for rank in range(ranks):
        d = root / schema.rank_dirname(rank)
        d.mkdir()
        (d / schema.RANK_MANIFEST).write_text(
            json.dumps(
                {
                    **manifest,
                    "rank": rank,
                    "world_size": ranks,
                    "local_rank": rank % 8,
                    "hostname": f"node{rank // 8:03d}",
                    "pid": 1000 + rank,
                    "device": f"cuda:{rank % 8}",
                }
            )
        )
        _steps_frame(rank, steps, rng).to_json(d / "steps.jsonl", orient="records", lines=True)
        with open(d / "events.jsonl", "w") as fh:
            fh.writelines(json.dumps(e) + "\n" for e in _events(rank, steps))
        (d / schema.END_MARKER).write_text(json.dumps({"status": "finished", "steps": steps}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--keep", default=None, help="write the run here and keep it")
    args = parser.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="amprobe-ranks-")) / "run"
    try:
        if not (root / schema.RUN_MANIFEST).exists():
            t = time.perf_counter()
            synthesize(root, args.ranks, args.steps)
            size = sum(f.stat().st_size for f in root.rglob("*.jsonl"))
            print(
                f"synthesized {args.ranks} ranks x {args.steps} steps ({size / 1e6:.0f} MB) "
                f"in {time.perf_counter() - t:.1f} s"
            )
        t = time.perf_counter()
        run = amprobe.load_run(root)
        n_steps, n_events = len(run.steps), len(run.events)
        load_s = time.perf_counter() - t
        print(f"load_run + steps ({n_steps:,} rows) + events ({n_events:,} rows): {load_s:.2f} s")
        t = time.perf_counter()
        diagnosis = amprobe.diagnose(run)
        diagnose_s = time.perf_counter() - t
        print(f"diagnose: {diagnose_s:.2f} s, {len(diagnosis.findings)} findings")
        for f in diagnosis.findings:
            print(f"  [{f.severity}] {f.id}: {f.title[:150]}")
        for nc in diagnosis.not_checked:
            if nc.reason.startswith("rule failed"):
                print(f"  {nc.id}: {nc.reason}")
    finally:
        if not args.keep:
            shutil.rmtree(root.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
