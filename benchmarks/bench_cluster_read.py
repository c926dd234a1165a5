"""The read side at cluster scale, on runs built from a real recording (issue #33).

Run: ``nice -n 19 python benchmarks/bench_cluster_read.py [--ranks 64,256,1024,4096]
[--steps 10000] [--source RUN] [--work DIR] [--keep] [--plan] [--every-rank-differs]``.

1. Records a real 2-rank DDP fp16 job on CPU (gloo) with the default collectors through
   ``amprobe run -- torchrun`` (a small MLP, ``GradScaler("cpu")``, an overflow planted on
   every rank for four steps from the middle one), or reuses ``--source``. The lowest rank whose
   record files are all there and non-empty (steps, events, numerics, offenders, compute and
   syncs) is the template; none such stops the benchmark.
2. For each N, builds an N-rank run from that template rank: every rank's files are hard
   links to the template's (the loader refuses symlinks), except each rank's ``manifest.json``,
   a real copy naming the rank, its local rank and a host per 8 ranks; the run manifest says
   ``world_size`` N. About 1 % of the ranks (at least 3) are real copies made to diverge, in
   turn: a doubled ``init_scale`` (its whole scale trajectory and its ``scaler_created``
   event), a rank-local overflow three quarters in (the step skipped, the scale halved from
   there, the offender rows and events of the template's first offending step copied to that
   step), and a 3x slower rank (every step time and the clock scaled). Two more real copies
   are damaged: a truncated rank (``steps.jsonl`` cut in the middle of the record after its
   half, ``end.json`` removed) and a corrupt rank (lines of ``steps.jsonl`` and
   ``numerics.jsonl`` overwritten in place by garbage bytes of the same length, as a damaged
   disk leaves them: the files keep their sizes and line ends). A diverging copy gets a
   ``summary.json`` consistent with its files, written by
   ``amprobe.store.run.write_rank_summary(rank_dir)`` (a new file renamed over the copy's,
   never written through a hard link); the damaged copies keep the recorded ``summary.json``,
   as a crashed job or a damaged disk leaves it: the truncated rank's offsets point past its
   cut file (the reader rebuilds it from its files), the corrupt rank's still fall on line ends
   of files of the same size (the reader takes the rank's facts from it) but its ``checksums``
   (the CRC-32 of the bytes its writer summarized) no longer match them, which the reader
   reports. A source recorded before the writer kept checksums has records without them: then
   the corrupt rank cannot be found, and the benchmark says so.
   The hard-linked ranks hold byte-equal summaries, and the rules and report sections that
   judge once per class of equal sections (``rules.engine.data_key``,
   ``analysis.frames.section_keys``) then compute a few classes, not N. With
   ``--every-rank-differs`` every rank's ``summary.json`` is then replaced by a new file whose
   ``runtime`` section (step times a few % slower or faster, a slightly heavier tail) and
   ``numerics`` section (a few values one binade apart) differ from every other rank's
   (:func:`differ`; the planted ranks keep what sets them apart), as a real cluster's do; the
   table files stay shared, so what the derived store and the figures read from the rows is
   the recorded values. It prints how many distinct sections it made (N of each at up to
   4,096 ranks), and needs a summary.json of disk per rank more. Measured on the 4,096-rank
   run of 10,000 steps (2026-12-05, 2-core Xeon, shared): ``diagnose`` 12.3 s CPU and 1.65 GB
   peak against 6.4 s and 1.60 GB with the linked summaries (the what-if and AMP-N06 per
   numerics class, the step-time rules per runtime class), ``report`` warm 17.6 s and 2.16 GB
   against 10.5 s and 2.15 GB.
3. Times, each in a child process: ``amprobe diagnose --format json`` cold (no ``RUN/derived``
   folder), warm (a second run, with whatever derived files the first left), ``amprobe report
   -o x.html`` twice: first (it builds the derived store and keeps its figures' results) and
   warm (it reads them, and the diagnosis the first one kept), and ``diagnose`` cold on the crashed variant of the run (every rank's
   ``end.json`` removed and its ``summary.json`` replaced by a new file saying ``final:
   false``: no rank closed). It prints, side by side: wall seconds, CPU seconds (user +
   system) and peak RSS of the child (``os.wait4``'s rusage of that one child), per rank, and
   the output size; and, from another child after each cold diagnosis, where each rank's
   summary came from (``Run.summary_sources()``: records, records+tail, files, unreadable),
   counted, with the source of each edited rank.
4. Checks that each diagnosis names the planted ranks apart from the agreeing group (a finding
   on at most half the ranks: AMP-D01 for the init scale, AMP-D02 for the slow rank, AMP-D01,
   N01, N05 or N11 for the overflow rank): ``named: yes/no`` per planted kind; and that a load
   warning names the truncated and the corrupt rank (the JSON's ``run.warnings``, which the CLI
   also prints on stderr; stderr is read when the JSON carries none): ``reported: yes/no``,
   with the findings that name a damaged rank apart; the corrupt rank counts as reported only
   by a warning that its files fail their checksum (``checksum mismatch``), the truncated one
   by any warning naming it.

The disk a run needs is one copy of the template rank, a folder and a manifest per rank and the
real copies (measured by inode after the build), plus the derived folder and the outputs; the
benchmark prints them (``--plan`` prints them alone and builds nothing) and skips an N the free
disk cannot hold.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's amprobe, as the timed children get it
from amprobe.store.run import write_rank_summary  # noqa: E402
from amprobe.store.sections.numerics import decode_bins, encode_bins  # noqa: E402
from amprobe.store.sections.runtime import BUCKETS_PER_OCTAVE, hist_buckets  # noqa: E402
from amprobe.store.summary import SUMMARY_FILE  # noqa: E402

GLOO_EXIT_ABORT = "terminate called without an active exception"  # torch's exit race, retried
KINDS = ("scale", "overflow", "slow")
DAMAGES = ("truncated", "corrupt")
SLOW_FACTOR = 3.0
#: A corrupt line: every byte value but the line breaks (NUL, invalid UTF-8, stray braces).
GARBAGE = bytes(b for b in range(256) if b not in (10, 13))
GARBAGE_LINES = 3  # per corrupted file
#: What a load warning about a damaged rank must say to count as reporting it: the corrupt
#: rank's damage lies inside bytes its summary record covers, seen only by their checksum.
REPORTED_BY = {"truncated": "", "corrupt": "(checksum mismatch)"}
SUMMARY = SUMMARY_FILE
DERIVED = "derived"

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


def _write_own(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file at ``path``: an existing file is unlinked first, so that a
    hard link's inode (shared with the source recording) is never written."""
    path.unlink(missing_ok=True)
    path.write_bytes(data)


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    _write_own(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def _diverge(rank_dir: Path, kind: str) -> None:
    """Edit a real copy of the template's records so that the rank diverges as ``kind`` says."""
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


def _truncate(rank_dir: Path) -> None:
    """A rank whose writer died mid-record: ``steps.jsonl`` cut 17 bytes into the record after
    its half, no ``end.json``."""
    path = rank_dir / "steps.jsonl"
    data = path.read_bytes()
    start = data.index(b"\n", len(data) // 2) + 1
    cut = start + 17
    if b"\n" in data[start:cut]:
        raise SystemExit(f"cannot cut {path} mid-record: records shorter than 17 bytes")
    _write_own(path, data[:cut])
    (rank_dir / "end.json").unlink(missing_ok=True)


def _corrupt(rank_dir: Path) -> None:
    """A rank whose disk damaged records: :data:`GARBAGE_LINES` records of ``steps.jsonl`` and
    ``numerics.jsonl``, spread over each file, overwritten in place by garbage bytes of the
    same length. Sizes and line ends stay, so the recorded ``summary.json``'s offsets still fall
    on line ends: the damage lies inside the summarized bytes, which only the record's
    checksums tell."""
    for name in ("steps.jsonl", "numerics.jsonl"):
        path = rank_dir / name
        lines = path.read_bytes().split(b"\n")
        for i in range(1, GARBAGE_LINES + 1):
            at = (i * (len(lines) - 1)) // (GARBAGE_LINES + 1)
            size = len(lines[at])
            lines[at] = (GARBAGE * (size // len(GARBAGE) + 1))[:size]
        _write_own(path, b"\n".join(lines))


def planted(n: int) -> dict[int, str]:
    """About 1 % of ``n`` ranks (at least 3), spread evenly, never rank 0: rank -> kind."""
    count = max(3, round(n / 100))
    ranks = sorted({1 + (i * (n - 1)) // count for i in range(count)})
    return {r: KINDS[i % len(KINDS)] for i, r in enumerate(ranks)}


def damaged(n: int, divergent: dict[int, str]) -> dict[int, str]:
    """The truncated and the corrupt rank: the highest ranks not planted, never rank 0."""
    free = [r for r in range(n - 1, 0, -1) if r not in divergent]
    return dict(zip(free, DAMAGES, strict=False))


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


def _resummarize(edited: list[Path]) -> str:
    """Make the diverging copies' ``summary.json`` agree with their files; say how.
    ``write_rank_summary`` writes a temporary file and renames it over the old one, so the
    copy's file (a real copy already) is replaced, never written through."""
    with_summary = [d for d in edited if (d / SUMMARY).exists()]
    if not with_summary:
        return f"the template rank has no {SUMMARY}: every rank is summarized from its files"
    for d in with_summary:
        write_rank_summary(d)
    return (
        f"{SUMMARY} of the {len(with_summary)} diverging copies rewritten by "
        "amprobe.store.run.write_rank_summary; every other rank, the damaged ones included, "
        "keeps the recorded one"
    )


def _record_of(rank_dir: Path) -> dict[str, Any]:
    """A rank's summary record, or an empty dict when it has none that parses."""
    try:
        record = json.loads((rank_dir / SUMMARY).read_bytes())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def build(source: Path, n: int, dest: Path) -> tuple[dict[int, str], dict[int, str], str]:
    """An ``n``-rank run in ``dest`` from ``source``'s template rank (see the module docstring):
    the planted ranks (rank -> kind), the damaged ranks (rank -> damage) and how the edited
    copies' summaries were made consistent."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    top = json.loads((source / "manifest.json").read_text())
    top["world_size"] = n
    (dest / "manifest.json").write_text(json.dumps(top, indent=2))
    base = template_rank(source)
    base_manifest = json.loads((base / "manifest.json").read_text())
    files = [p for p in sorted(base.iterdir()) if p.is_file() and p.name != "manifest.json"]
    divergent = planted(n)
    broken = damaged(n, divergent)
    for r in range(n):
        rank_dir = dest / f"rank{r}"
        rank_dir.mkdir()
        for p in files:
            if r in divergent or r in broken:
                shutil.copyfile(p, rank_dir / p.name)
            else:
                os.link(p, rank_dir / p.name)
        manifest = {**base_manifest, "rank": r, "local_rank": r % 8, "world_size": n}
        manifest["hostname"] = f"{base_manifest.get('hostname', 'node')}-{r // 8}"
        (rank_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
        if r in divergent:
            _diverge(rank_dir, divergent[r])
        elif broken.get(r) == "truncated":
            _truncate(rank_dir)
        elif broken.get(r) == "corrupt":
            _corrupt(rank_dir)
    how = _resummarize([dest / f"rank{r}" for r in sorted(divergent)])
    if (base / SUMMARY).exists() and "checksums" not in _record_of(base):
        how += (
            f"; the source's {SUMMARY} has no checksums (recorded by an older amprobe): the "
            "corrupt rank's damage cannot be seen, record the source again"
        )
    return divergent, broken, how


def crash(dest: Path) -> str:
    """Make ``dest`` a run no rank closed: every ``end.json`` removed, and every rank's
    ``summary.json`` replaced by a new file saying ``final: false`` (as the writer's last
    flush before a kill leaves it). The ranks sharing one inode (hard links to the template's
    record) get one new file, linked to each of them: the recorded inode is never written."""
    ends = finals = 0
    made: dict[tuple[int, int], Path] = {}  # recorded inode -> its final: false replacement
    for rank_dir in sorted(dest.glob("rank*")):
        if (rank_dir / "end.json").exists():
            (rank_dir / "end.json").unlink()
            ends += 1
        path = rank_dir / SUMMARY
        if not path.exists():
            continue
        st = path.stat()
        done = made.get((st.st_dev, st.st_ino))
        if done is not None:
            path.unlink()
            os.link(done, path)
        else:
            try:
                record = json.loads(path.read_bytes())
            except ValueError:
                continue  # not a record: the reader rebuilds that rank anyway
            if not isinstance(record, dict) or record.get("final") is not True:
                continue
            _write_own(path, (json.dumps({**record, "final": False}) + "\n").encode())
            if st.st_nlink > 1:
                made[(st.st_dev, st.st_ino)] = path
        finals += 1
    return f"{ends} end.json removed, {finals} summary.json rewritten with final: false"


def _shift_wall(hist: dict[str, Any], k: int) -> None:
    """A step-time histogram of values ``2**(k/128)`` times the recorded ones: its buckets
    moved by ``k``, its sum, min and max scaled (n and zero kept)."""
    f = 2 ** (k / BUCKETS_PER_OCTAVE)
    items = sorted(hist_buckets(hist).items())
    hist["b"] = [[i + k if i != 1 << 30 else i for i, _ in items], [c for _, c in items]]
    hist["sum"] *= f
    for key in ("min", "max"):
        if isinstance(hist[key], (int, float)) and hist[key] > 0:
            hist[key] *= f


def _tail_up(hist: dict[str, Any], j: int) -> None:
    """Move ``j`` values of a step-time histogram one bucket up, from its fullest buckets
    (never its min's or max's bucket, nor into the max's), the sum raised by the buckets'
    midpoint difference: a slightly heavier tail. Fewer when the histogram holds fewer."""
    b = dict(hist_buckets(hist))
    if j <= 0 or not b or not hist["min"] or not hist["max"]:
        return
    low = math.floor(math.log2(hist["min"]) * BUCKETS_PER_OCTAVE)
    top = math.floor(math.log2(hist["max"]) * BUCKETS_PER_OCTAVE)
    for i, c in sorted(b.items(), key=lambda kv: (-kv[1], kv[0])):
        if j == 0:
            break
        if i == low or i + 1 >= top or c < 2:
            continue
        t = min(j, c - 1)
        b[i] -= t
        b[i + 1] = b.get(i + 1, 0) + t
        mid = [2 ** ((x + 0.5) / BUCKETS_PER_OCTAVE) for x in (i, i + 1)]
        hist["sum"] += t * (mid[1] - mid[0])
        j -= t
    items = sorted(b.items())
    hist["b"] = [[i for i, _ in items], [c for _, c in items]]


def _move_binade(layer: dict[str, Any], d: int) -> None:
    """In a numerics layer's histogram group of most rows, move ``d`` values from its fullest
    binade to an existing neighbour, both fp16-normal (>= -13) and below the group's top
    binade: every count, the group's key and the lost values stay (equal shapes, other
    values). Nothing when no binade fits."""
    if not layer.get("hist"):
        return
    key, group = max(layer["hist"].items(), key=lambda kv: kv[1]["rows"])
    try:
        top = int(key.rsplit("|", 1)[1])
    except ValueError:
        return
    bins = decode_bins(group["bins"])
    for _, e in sorted(((n, e) for e, n in bins.items() if -13 <= e < top), reverse=True):
        for dst in (e - 1, e + 1):
            if dst in bins and -13 <= dst < top and bins[e] > d:
                bins[e] -= d
                bins[dst] += d
                group["bins"] = encode_bins(bins)
                return


def differ(record: dict[str, Any], r: int) -> None:
    """Make rank ``r``'s summary record differ from every other rank's (``--every-rank-differs``)
    in place, as ranks of one job differ: with ``17 * j + (k + 8) = r`` (unique per rank below
    4,097), its step times ``2**(k/128)`` times the recorded ones (k in -8..8: -4.2 % to
    +4.4 %; the wall histograms, the head rows' ``wall_s``, the fwd/bwd/opt sums) and ``j``
    (0..240) of them one bucket slower; and in its first numerics layer ``1 + r % 64``, in
    its last gradient layer ``1 + r // 64`` values one binade apart (see :func:`_move_binade`).
    Only the ``runtime`` and ``numerics`` sections change: the table files, ``offsets`` and
    ``checksums`` stay, so the tables' rows (the derived store, the figures drawn from them)
    still hold the recorded values."""
    sections = record.get("sections") or {}
    k, j = r % 17 - 8, r // 17
    runtime = sections.get("runtime")
    if runtime:
        times = runtime["times"]
        for hist in (times["both"]["plain"]["wall"], times["both"]["sampled"]["wall"]):
            _shift_wall(hist, k)
        _shift_wall(times["wall_only"], k)
        _tail_up(times["both"]["plain"]["wall"], j)
        f = 2 ** (k / BUCKETS_PER_OCTAVE)
        for row in runtime["head"]:
            if isinstance(row[1], (int, float)):
                row[1] *= f
        for phase in ("fwd_s", "bwd_s", "opt_s"):
            runtime["phases"][phase][1] *= f
    layers = (sections.get("numerics") or {}).get("layers") or []
    if layers:
        grads = [x for x in layers if str(x.get("kind")).startswith("grad")] or layers
        _move_binade(layers[0], 1 + r % 64)
        _move_binade(grads[-1], 1 + r // 64)


def every_rank_differs(dest: Path) -> str:
    """Rewrite every rank's ``summary.json`` by :func:`differ` (a new file per rank, never
    written through a hard link); say how many ``runtime`` and ``numerics`` sections are now
    distinct."""
    seen: dict[str, set[str]] = {"runtime": set(), "numerics": set()}
    n = 0
    for rank_dir in sorted(dest.glob("rank*"), key=lambda p: int(p.name[4:])):
        path = rank_dir / SUMMARY
        record = _record_of(rank_dir)
        if not record.get("sections"):
            continue
        differ(record, int(rank_dir.name[4:]))
        _write_own(path, (json.dumps(record, separators=(",", ":")) + "\n").encode())
        n += 1
        for name, classes in seen.items():
            classes.add(json.dumps(record["sections"].get(name), sort_keys=True))
    distinct = ", ".join(f"{len(v)} {k}" for k, v in seen.items())
    return f"every rank differs: {n} summary.json rewritten; distinct sections: {distinct}"


#: Bytes of output per rank (three diagnoses' JSON and one report's HTML), a bound: measured
#: 7.7 MB in all at 256 ranks of a 10,000-step recording (31 KB per rank; the JSON is bounded,
#: 0.1 MB at 64 and 256 ranks alike, the HTML 6.7 and 7.4 MB) on 2026-12-05.
OUTPUT_BYTES_PER_RANK = 100_000


def _copied(n: int) -> set[int]:
    """The ranks built as real copies: the planted and the damaged ones."""
    divergent = planted(n)
    return {*divergent, *damaged(n, divergent)}


def disk_needed(n: int, per_rank: int) -> tuple[int, int, int]:
    """Bytes an ``n``-rank run needs from a template rank of ``per_rank`` bytes on disk: its
    records (one rank, the real copies, a folder and a manifest of 4 KiB blocks per rank), a
    bound on its derived folder (the Parquet of the same rows is smaller than their JSON text,
    ``n`` ranks of it) and its outputs."""
    records = per_rank * (1 + len(_copied(n))) + 8192 * n
    return records, per_rank * n, OUTPUT_BYTES_PER_RANK * n


def timed(cmd: list[str], stdout: Path, stderr: Path, cache: Path) -> dict[str, float]:
    """Run ``cmd`` as a child, stdout and stderr to files, ``cache`` as its user cache
    (``XDG_CACHE_HOME``, where derived files of a read-only run would go): wall s, CPU s and
    peak RSS of that child."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(cache)}
    with stdout.open("wb") as out, stderr.open("wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1):  # 1: findings at --fail-on severity (not used here)
        tail = stderr.read_bytes()[-2000:].decode(errors="replace")
        raise SystemExit(f"{' '.join(cmd)} exited {code}:\n{tail}")
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "rss_mb": usage.ru_maxrss / 1024,  # KiB on Linux
    }


#: The child that says where each rank's summary came from (rank -> source, as JSON).
_SOURCES_CHILD = (
    "import json, sys; from amprobe.store.run import load_run; "
    "print(json.dumps(load_run(sys.argv[1]).summary_sources()))"
)


def summary_sources(run: Path, edited: dict[int, str]) -> str:
    """Where each rank's summary came from (``Run.summary_sources()``, read in a child, after
    the timed runs): the count of each source, and the source of each rank in ``edited``
    (rank -> what was done to it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", _SOURCES_CHILD, str(run)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return f"not known (the child exited {proc.returncode}: {proc.stderr.strip()[-300:]})"
    sources = {int(r): s for r, s in json.loads(proc.stdout).items()}
    counts: dict[str, int] = {}
    for s in sources.values():
        counts[s] = counts.get(s, 0) + 1
    order = ("records", "records+tail", "files", "unreadable")
    rank_of = {k: i for i, k in enumerate(order)}
    said = [f"{k} {counts[k]}" for k in sorted(counts, key=lambda k: (rank_of.get(k, 9), k))]
    ranks = [f"{r} ({what}): {sources.get(r, 'absent')}" for r, what in sorted(edited.items())]
    return f"{', '.join(said)}; " + "; ".join(ranks)


_RANKS_TEXT = re.compile(r"\branks? ((?:\d+(?:-\d+)?)(?:, \d+(?:-\d+)?)*)")


def _ranks_in(text: str) -> set[int]:
    """The ranks a text names as ``rank 5`` or ``ranks 0-2, 4, 9-12``."""
    out: set[int] = set()
    for match in _RANKS_TEXT.finditer(text):
        for part in match.group(1).split(", "):
            a, _, b = part.partition("-")
            out.update(range(int(a), int(b or a) + 1))
    return out


def _ranks_of(finding: dict[str, Any]) -> set[int]:
    """The ranks a finding holds on: its evidence's ``ranks`` (a group's members) or else its
    ``rank``, and the ranks its title names."""
    ev = finding.get("evidence") or {}
    ranks = {r for r in ev.get("ranks") or [] if isinstance(r, int)}
    if not ranks and isinstance(ev.get("rank"), int):
        ranks.add(ev["rank"])
    return ranks | _ranks_in(finding.get("title") or "")


def _singled(
    findings: list[dict[str, Any]], rules: tuple[str, ...] | None, n: int
) -> dict[int, set[str]]:
    """Rank -> the rules (among ``rules``; all when None) with a finding that names it apart
    from the majority: a finding on at most half the ranks (not the group that agrees)."""
    named: dict[int, set[str]] = {}
    for f in findings:
        if rules is not None and f["id"] not in rules:
            continue
        ranks = _ranks_of(f)
        if len(ranks) <= n // 2:
            for r in ranks:
                named.setdefault(r, set()).add(f["id"])
    return named


#: The rules whose findings name a planted rank of each kind (the overflow rank: its own scale
#: cuts, its non-finite, or D01's skip divergence).
NAMING = {
    "scale": ("AMP-D01",),
    "overflow": ("AMP-D01", "AMP-N01", "AMP-N05", "AMP-N11"),
    "slow": ("AMP-D02",),
}


def check(
    doc: dict[str, Any], stderr: str, n: int, divergent: dict[int, str], broken: dict[int, str]
) -> list[str]:
    """Lines saying whether a diagnosis names every planted rank (a finding of the kind's rules
    on that rank apart from the majority) and reports the damaged ones (a load warning naming
    the rank: in the JSON's ``run.warnings``, or on stderr when the JSON carries none)."""
    findings = doc["findings"]
    lines = [f"findings {', '.join(sorted({f['id'] for f in findings}))}"]
    for kind in KINDS:
        want = sorted(r for r, k in divergent.items() if k == kind)
        named = _singled(findings, NAMING[kind], n)
        missed = [r for r in want if r not in named]
        by = sorted({rule for r in want for rule in named.get(r, ())})
        lines.append(
            f"{kind} {want}: named: {'no' if missed else 'yes'}"
            + (f" (by {', '.join(by)})" if by else "")
            + (f"; missed {missed}" if missed and len(missed) < len(want) else "")
        )
    warnings = list(doc["run"].get("warnings") or [])
    source = "run.warnings"
    if not warnings and stderr.strip():
        warnings, source = stderr.strip().splitlines(), "stderr"
    alone = _singled(findings, None, n)
    for rank, damage in sorted(broken.items()):
        said = [w for w in warnings if rank in _ranks_in(w) and REPORTED_BY[damage] in w]
        lines.append(
            f"{damage} rank {rank}: reported: {'yes' if said else 'no'}"
            + (f" ({source}: {'; '.join(said)})" if said else "")
            + (
                f"; findings naming it apart: {', '.join(sorted(alone[rank]))}"
                if rank in alone
                else ""
            )
        )
    general = [w for w in warnings if not _ranks_in(w)]
    if general:
        lines.append(f"run warnings naming no rank: {'; '.join(general)}")
    return lines


def _row(n: int, case: str, command: str, t: dict[str, float], size: int) -> list[str]:
    return [
        str(n),
        case,
        command,
        f"{t['wall_s']:.1f}",
        f"{t['cpu_s']:.1f}",
        f"{t['rss_mb']:.0f}",
        f"{1000 * t['cpu_s'] / n:.0f}",
        f"{t['rss_mb'] / n:.2f}",
        f"{size / 1e6:.1f}",
    ]


def measure(
    run: Path, n: int, divergent: dict[int, str], broken: dict[int, str], work: Path
) -> list[list[str]]:
    """Time diagnose (cold, warm, cold with no rank closed) and report; print the checks; return
    the table rows."""
    py = sys.executable
    diagnose = [py, "-m", "amprobe", "diagnose", "--format", "json", str(run)]
    derived = run / DERIVED
    cache = work / "xdg-cache"  # the children's user cache, emptied with derived/ when cold

    def cold() -> None:
        shutil.rmtree(derived, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir()

    rows = []
    docs: dict[str, dict[str, Any]] = {}

    checks: dict[str, list[str]] = {}

    def one(case: str, cmd: list[str], out: Path, label: str, size_of: Path) -> None:
        err = out.with_suffix(".err")
        t = timed(cmd, out, err, cache)
        rows.append(_row(n, case, label, t, size_of.stat().st_size))
        if not label.startswith("diagnose"):
            return
        docs[case] = json.loads(out.read_text())
        checks[case] = check(docs[case], err.read_text(errors="replace"), n, divergent, broken)
        if case != "cold" and checks[case] == checks["cold"]:
            print(f"  {n} ranks, {case}: the same checks as cold")
            return
        for line in checks[case]:
            print(f"  {n} ranks, {case}: {line}")

    def derived_size(after: str) -> bool:
        """Print what the runs derived so far (in ``RUN/derived`` or the user cache); whether
        there is any."""
        cached = any(cache.iterdir())
        print(
            f"  {n} ranks: {DERIVED}/ after the {after} run: "
            + (f"{_unique_bytes(derived) / 1e6:.1f} MB" if derived.exists() else "none")
            + (f"; user cache {_unique_bytes(cache) / 1e6:.1f} MB" if cached else "")
        )
        return derived.exists() or cached

    edited = {**divergent, **broken}
    cold()
    out = work / f"diagnose{n}-cold.json"
    one("cold", diagnose, out, "diagnose --format json", out)
    print(f"  {n} ranks, cold: summary sources: {summary_sources(run, edited)}")
    if not derived_size("cold"):
        print(f"  {n} ranks: nothing derived (no derived store yet): warm runs as cold did")
    out = work / f"diagnose{n}-warm.json"
    one("warm", diagnose, out, "diagnose --format json", out)
    same = docs["cold"]["findings"] == docs["warm"]["findings"]
    print(f"  {n} ranks: cold and warm findings the same: {'yes' if same else 'NO'}")
    html = work / f"report{n}.html"
    report = [py, "-m", "amprobe", "report", str(run), "-o", str(html)]
    # the first report builds the derived store and keeps the figures' results; the second
    # reads them (and the diagnosis the first one kept): the report's warm case
    one("first (builds derived/)", report, work / f"report{n}-first.log", "report -o x.html", html)
    derived_size("first report")
    one("warm", report, work / f"report{n}.log", "report -o x.html", html)
    print(f"  {n} ranks: crashed variant: {crash(run)}")
    cold()
    out = work / f"diagnose{n}-crashed.json"
    one("cold, no rank closed", diagnose, out, "diagnose --format json", out)
    print(f"  {n} ranks, no rank closed: summary sources: {summary_sources(run, edited)}")
    before = {(f["id"], f["title"]) for f in docs["cold"]["findings"]}
    after = {(f["id"], f["title"]) for f in docs["cold, no rank closed"]["findings"]}
    for sign, diff in (("-", before - after), ("+", after - before)):
        for rule, title in sorted(diff):
            print(f"  {n} ranks, no rank closed vs cold: {sign} {rule}: {title}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--ranks", default="64,256,1024,4096", help="comma-separated rank counts")
    p.add_argument("--steps", type=int, default=10000, help="steps of the recording")
    p.add_argument("--source", type=Path, default=None, help="reuse this 2-rank recording")
    p.add_argument("--work", type=Path, default=None, help="folder for the runs (default: temp)")
    p.add_argument("--keep", action="store_true", help="keep the built runs")
    p.add_argument("--plan", action="store_true", help="print the disk each N needs; build none")
    p.add_argument(
        "--every-rank-differs",
        action="store_true",
        help="make every rank's runtime and numerics summary sections differ (see differ)",
    )
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="amprobe-cluster-"))
    work.mkdir(parents=True, exist_ok=True)
    cpu = f"{cpu_model()} ({os.cpu_count()} cores)"
    print(f"CPU: {cpu}; load average {os.getloadavg()[0]:.1f}; work folder {work}")
    source = args.source or record(work, args.steps)
    base = template_rank(source)
    per_rank = _unique_bytes(base)
    steps = sum(1 for _ in (base / "steps.jsonl").open("rb"))
    print(
        f"source: {source}, template {base.name}: {steps} steps, {per_rank / 1e6:.2f} MB in "
        f"{', '.join(p.name for p in sorted(base.iterdir()))}"
    )
    header = ["ranks", "case", "command", "wall s", "CPU s", "peak RSS MB", "CPU ms/rank"]
    header += ["MB RSS/rank", "output MB"]
    rows: list[list[str]] = []
    for n in (int(x) for x in args.ranks.split(",")):
        dest = work / f"ranks{n}"
        records, derived, outputs = disk_needed(n, per_rank)
        if args.every_rank_differs and (base / SUMMARY).exists():
            records += n * (base / SUMMARY).stat().st_size  # a summary.json of its own per rank
        free = shutil.disk_usage(work).free
        print(
            f"{n} ranks: needs ~{records / 1e6:.0f} MB of records (one rank, "
            f"{len(_copied(n))} real copies, a folder and a manifest per rank) + up to "
            f"{derived / 1e6:.0f} MB for {DERIVED}/ (n x a rank's JSON text, a bound) + "
            f"~{outputs / 1e6:.0f} MB of outputs; {free / 1e6:.0f} MB free"
        )
        if args.plan:
            continue
        if records + derived + outputs > free:
            print(f"{n} ranks: skipped (the disk cannot hold it)")
            continue
        divergent, broken, how = build(source, n, dest)
        kinds = {k: sorted(r for r, v in divergent.items() if v == k) for k in KINDS}
        print(f"{n} ranks: {_unique_bytes(dest) / 1e6:.1f} MB on disk; diverging {kinds}")
        print(f"  damaged {broken}; summaries: {how}")
        if args.every_rank_differs:
            print(f"  {every_rank_differs(dest)}")
        rows.extend(measure(dest, n, divergent, broken, work))
        if not args.keep:
            shutil.rmtree(dest)
    if args.plan:
        return
    print(f"CPU: {cpu}; load average {os.getloadavg()[0]:.1f} at the end")
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    if not args.keep and args.work is None and args.source is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
