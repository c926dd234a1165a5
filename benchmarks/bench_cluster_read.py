"""The read side at cluster scale, on runs built from a real recording (issue #33).

Run: ``nice -n 19 python benchmarks/bench_cluster_read.py [--ranks 64,256,1024,4096]
[--steps 2000] [--source RUN] [--work DIR] [--keep]``.

1. Records a real 2-rank DDP fp16 job on CPU (gloo) with the default collectors through
   ``amprobe run -- torchrun`` (a small MLP, ``GradScaler("cpu")``, an overflow planted on
   every rank for four steps from the middle one), or reuses ``--source``. The lowest rank whose
   record files are all there and non-empty (steps, events, numerics, offenders, compute and
   syncs) is the template; none such stops the benchmark.
2. For each N, builds an N-rank run from that template rank: every rank's files are hard
   links to the template's (the loader refuses symlinks), except each rank's ``manifest.json``,
   a real copy naming the rank, its local rank and a host per 8 ranks; the run manifest says
   ``world_size`` N. About 1 % of the
   ranks (at least 3) are real copies made to diverge, in turn: a doubled ``init_scale`` (its
   whole scale trajectory and its ``scaler_created`` event), a rank-local overflow three
   quarters in (the step skipped, the scale halved from there, the offender rows and events
   of the template's first offending step copied to that step), and a 3x slower rank (every step time and the clock scaled).
3. Times ``amprobe diagnose --format json`` and ``amprobe report -o x.html`` in a child
   process each and prints, side by side: wall seconds, CPU seconds (user + system) and peak
   RSS of the child (``os.wait4``'s rusage of that one child), per rank, the output size, and
   which planted ranks AMP-D01 and AMP-D02 named.

The disk a run needs is one copy of the template rank, a manifest per rank and the diverging
copies; the benchmark prints it, measured by inode, and skips an N the free disk cannot hold.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
GLOO_EXIT_ABORT = "terminate called without an active exception"  # torch's exit race, retried
KINDS = ("scale", "overflow", "slow")
SLOW_FACTOR = 3.0

TRAIN_SCRIPT = '''"""2-rank DDP fp16 on CPU (gloo); an overflow planted on every rank at steps PLANT_AT to
PLANT_AT + 3 (several steps, so that the numerics capture armed by the first catches the offender
on every rank, whether or not the first was a sampled step)."""
import os

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = nn.Sequential(
    nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)
)
model = nn.parallel.DistributedDataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
steps = int(os.environ["STEPS"])
plant = int(os.environ["PLANT_AT"])
g = torch.Generator().manual_seed(rank)
for i in range(steps):
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
    if plant <= i < plant + 4:
        x = x * 1e6
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def record(work: Path, steps: int) -> Path:
    """Record the 2-rank source run into ``work/source`` and return its path."""
    script = work / "train_ddp_fp16.py"
    script.write_text(TRAIN_SCRIPT)
    out = work / "source"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STEPS": str(steps), "PLANT_AT": str(steps // 2)}
    for _ in range(3):
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "amprobe", "run", "--out", str(out), "--", sys.executable]
        cmd += ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
        cmd += ["--master_port", str(_free_port()), str(script)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)
        if proc.returncode == 0:
            print(f"recorded {steps} steps on 2 ranks in {time.perf_counter() - t0:.1f} s: {out}")
            return out
        if GLOO_EXIT_ABORT not in proc.stderr:
            break
    raise SystemExit(f"recording failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _diverge(rank_dir: Path, kind: str) -> None:
    """Edit a real copy of rank 0's records so that the rank diverges as ``kind`` says."""
    steps = _rows(rank_dir / "steps.jsonl")
    events = _rows(rank_dir / "events.jsonl")
    if kind == "scale":  # built with init_scale x2: every scale of its trajectory is doubled
        for r in steps:
            for key in ("scale_before", "scale_after"):
                if isinstance(r.get(key), (int, float)):
                    r[key] *= 2.0
        for e in events:
            if e["kind"] == "scaler_created":
                detail = json.loads(e["detail"])
                detail["init_scale"] *= 2.0
                e["detail"] = json.dumps(detail)
    elif kind == "overflow":  # a non-finite on this rank alone, three quarters in
        at = (3 * len(steps)) // 4
        for r in steps:
            if r["step"] == at:
                r.update(opt_steps=0, loss=float("nan"), loss_nonfinite=True, found_inf=1.0)
                r.update(skipped=True, scale_after=r["scale_before"] / 2, growth_tracker=0)
            elif r["step"] > at:
                r["scale_before"] /= 2
                r["scale_after"] /= 2
                r["growth_tracker"] = r["step"] - at
        offenders = _rows(rank_dir / "offenders.jsonl")
        first = offenders[0]["step"] if offenders else None
        extra = [{**o, "step": at} for o in offenders if o["step"] == first]
        _write_rows(rank_dir / "offenders.jsonl", offenders + extra)
        for e in [e for e in events if e["kind"] == "numerics_offender" and e["step"] == first]:
            events.append({**e, "step": at})
    elif kind == "slow":  # every step SLOW_FACTOR x slower, and its clock with it
        t0 = steps[0]["t"] - steps[0]["wall_s"]
        for r in steps:
            r["t"] = t0 + SLOW_FACTOR * (r["t"] - t0)
            for key in ("wall_s", "fwd_s", "bwd_s", "opt_s"):
                if isinstance(r.get(key), (int, float)):
                    r[key] *= SLOW_FACTOR
    _write_rows(rank_dir / "steps.jsonl", steps)
    _write_rows(rank_dir / "events.jsonl", events)


def planted(n: int) -> dict[int, str]:
    """About 1 % of ``n`` ranks (at least 3), spread evenly, never rank 0: rank -> kind."""
    count = max(3, round(n / 100))
    ranks = sorted({1 + (i * (n - 1)) // count for i in range(count)})
    return {r: KINDS[i % len(KINDS)] for i, r in enumerate(ranks)}


def _unique_bytes(root: Path) -> int:
    """Bytes on disk under ``root``, each inode counted once (hard links share theirs)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in [*files, "."]:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


RECORD_FILES = (
    "steps.jsonl",
    "events.jsonl",
    "numerics.jsonl",
    "offenders.jsonl",
    "compute_ops.jsonl",
    "compute_steps.jsonl",
    "syncs.jsonl",
    "manifest.json",
    "end.json",
)


def template_rank(source: Path) -> Path:
    """The lowest rank folder of ``source`` whose record files are all present and non-empty."""
    for rank_dir in sorted(source.glob("rank*"), key=lambda p: int(p.name[4:])):
        if all((rank_dir / f).is_file() and (rank_dir / f).stat().st_size for f in RECORD_FILES):
            return rank_dir
    raise SystemExit(f"no rank of {source} has every record file non-empty: {RECORD_FILES}")


def build(source: Path, n: int, dest: Path) -> dict[int, str]:
    """An ``n``-rank run in ``dest`` from ``source``'s template rank (see the module docstring)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    top = json.loads((source / "manifest.json").read_text())
    top["world_size"] = n
    (dest / "manifest.json").write_text(json.dumps(top, indent=2))
    base = template_rank(source)
    base_manifest = json.loads((base / "manifest.json").read_text())
    files = [p for p in sorted(base.iterdir()) if p.is_file() and p.name != "manifest.json"]
    divergent = planted(n)
    for r in range(n):
        rank_dir = dest / f"rank{r}"
        rank_dir.mkdir()
        for p in files:
            if r in divergent:
                shutil.copyfile(p, rank_dir / p.name)
            else:
                os.link(p, rank_dir / p.name)
        manifest = {**base_manifest, "rank": r, "local_rank": r % 8, "world_size": n}
        manifest["hostname"] = f"{base_manifest.get('hostname', 'node')}-{r // 8}"
        (rank_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
        if r in divergent:
            _diverge(rank_dir, divergent[r])
    return divergent


def timed(cmd: list[str], stdout: Path) -> dict[str, float]:
    """Run ``cmd`` as a child, stdout to a file: wall s, CPU s and peak RSS of that child."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with stdout.open("wb") as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        tail = err.read()[-2000:].decode(errors="replace")
    if proc.returncode not in (0, 1):  # 1: findings at --fail-on severity (not used here)
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "rss_mb": usage.ru_maxrss / 1024,  # KiB on Linux
    }


def _named(findings: list[dict[str, Any]], rule: str) -> set[int]:
    ranks: set[int] = set()
    for f in findings:
        if f["id"] == rule:
            ev = f.get("evidence") or {}
            ranks.update(int(r) for r in ev.get("ranks") or [])
    return ranks


def measure(run: Path, n: int, divergent: dict[int, str], work: Path) -> Iterator[list[str]]:
    """Time diagnose and report on one run; yield table rows."""
    py = sys.executable
    out = work / f"diagnose{n}.json"
    d = timed([py, "-m", "amprobe", "diagnose", "--format", "json", str(run)], out)
    html = work / f"report{n}.html"
    r = timed([py, "-m", "amprobe", "report", str(run), "-o", str(html)], work / f"report{n}.log")
    for label, t, size in (
        ("diagnose --format json", d, out.stat().st_size),
        ("report -o x.html", r, html.stat().st_size),
    ):
        yield [
            str(n),
            label,
            f"{t['wall_s']:.1f}",
            f"{t['cpu_s']:.1f}",
            f"{t['rss_mb']:.0f}",
            f"{1000 * t['cpu_s'] / n:.0f}",
            f"{t['rss_mb'] / n:.2f}",
            f"{size / 1e6:.1f}",
        ]
    findings = json.loads(out.read_text())["findings"]
    ids = sorted({f["id"] for f in findings})
    print(f"  {n} ranks: findings {', '.join(ids)}")
    for rule, kinds in (("AMP-D01", ("scale", "overflow")), ("AMP-D02", ("slow",))):
        want = {r for r, k in divergent.items() if k in kinds}
        got = _named(findings, rule)
        print(
            f"  {rule}: planted {sorted(want)} ({'/'.join(kinds)}); named {sorted(got) or 'none'}"
            f"{'' if want <= got else '  <- MISSED ' + str(sorted(want - got))}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="64,256,1024,4096", help="comma-separated rank counts")
    p.add_argument("--steps", type=int, default=2000, help="steps of the recording")
    p.add_argument("--source", type=Path, default=None, help="reuse this 2-rank recording")
    p.add_argument("--work", type=Path, default=None, help="folder for the runs (default: temp)")
    p.add_argument("--keep", action="store_true", help="keep the built runs")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="amprobe-cluster-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); work folder {work}")
    source = args.source or record(work, args.steps)
    base = template_rank(source)
    per_rank = _unique_bytes(base)
    print(
        f"source: {source}, template {base.name} holds {per_rank / 1e6:.2f} MB in "
        f"{', '.join(p.name for p in sorted(base.iterdir()))}"
    )
    header = ["ranks", "command", "wall s", "CPU s", "peak RSS MB", "CPU ms/rank"]
    header += ["MB RSS/rank", "output MB"]
    rows: list[list[str]] = []
    for n in (int(x) for x in args.ranks.split(",")):
        dest = work / f"ranks{n}"
        need = per_rank * (1 + len(planted(n))) + 8192 * n
        free = shutil.disk_usage(work).free
        if need > free:
            print(f"{n} ranks: needs ~{need / 1e6:.0f} MB, {free / 1e6:.0f} MB free; skipped")
            continue
        divergent = build(source, n, dest)
        used = _unique_bytes(dest)
        kinds = {k: sorted(r for r, v in divergent.items() if v == k) for k in KINDS}
        print(f"{n} ranks: {used / 1e6:.1f} MB on disk; diverging {kinds}")
        rows.extend(measure(dest, n, divergent, work))
        if not args.keep:
            shutil.rmtree(dest)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    if not args.keep and args.work is None and args.source is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
