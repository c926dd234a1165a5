"""Reading per-rank summaries at cluster scale: ``load_run`` + ``Run.summaries()`` (issue #33).

Run: ``nice -n 19 python benchmarks/bench_summary_read.py [--ranks 4096] [--source RUN]
[--work DIR] [--repeat 3] [--profile]``.

1. Copies rank 0 of ``--source`` (default ``/work/bench33/source``, a real 2-rank DDP fp16 run
   of 10,000 steps; never written) into ``WORK/src`` and writes its ``summary.json`` with
   :func:`amprobe.store.run.write_rank_summary`, with a stand-in section registered (no real
   section may be registered yet): it reads steps, events, numerics, offenders and syncs (so the
   reader checks five files a rank, as real sections will) and keeps what a real
   one would (counts, sums, a 64-bucket step-time histogram, capped scale change points,
   per (module, kind) counters and a 16-bucket exponent histogram), about 3-4 kB of JSON.
2. Builds an N-rank run in ``WORK/run``: every rank's files are hard links to that copy's
   (``summary.json`` included), except each rank's ``manifest.json``, a real copy naming the
   rank (and ``end.json`` with ``--crashed``: a run killed before any rank closed); the run
   manifest says ``world_size`` N.
3. In a fresh child process per repetition (page cache warm: the files were just written),
   times ``load_run`` and then ``summaries()``, each wall and CPU seconds, and prints the peak
   RSS after the imports and after ``summaries()`` (``ru_maxrss``). ``--profile`` prints the top of a
   cProfile of each.
4. For scale: the same child summarizes a few ranks from their record files alone (no record),
   the path of a rank whose record is missing or damaged.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SECTION_CODE = '''
import math
from amprobe.store.summary import SECTIONS, Section


class StandIn(Section):
    """A stand-in of the size and shape of a real section (see bench_summary_read.py)."""

    name = "_bench"
    tables = ("steps", "events", "numerics", "offenders", "syncs")

    def __init__(self):
        self.n = 0
        self.wall = 0.0
        self.wall_min = None
        self.wall_max = None
        self.hist = [0] * 64
        self.changes = []
        self.changes_left = 0
        self.last_scale = None
        self.kinds = {}
        self.num = {}

    def add(self, table, row):
        if table == "steps":
            self.n += 1
            w = row.get("wall_s")
            if isinstance(w, float) and w > 0:
                self.wall += w
                self.wall_min = w if self.wall_min is None else min(self.wall_min, w)
                self.wall_max = w if self.wall_max is None else max(self.wall_max, w)
                self.hist[min(63, max(0, int(32 + 4 * math.log2(w))))] += 1
            s = row.get("scale_after")
            if s is not None and s != self.last_scale:
                if len(self.changes) < 32:
                    self.changes.append([row.get("step"), self.last_scale, s])
                else:
                    self.changes_left += 1
                self.last_scale = s
        elif table == "events":
            k = row.get("kind")
            self.kinds[k] = self.kinds.get(k, 0) + 1
        elif table != "numerics":
            self.kinds[table] = self.kinds.get(table, 0) + 1
        else:
            key = f"{row.get('module')}|{row.get('kind')}"
            c = self.num.get(key)
            if c is None:
                c = self.num[key] = {"rows": 0, "nan": 0, "inf": 0, "amax": None, "exp": [0] * 16}
            c["rows"] += 1
            c["nan"] += row.get("nan") or 0
            c["inf"] += row.get("inf") or 0
            a = row.get("amax")
            if isinstance(a, float) and a > 0 and math.isfinite(a):
                c["amax"] = a if c["amax"] is None else max(c["amax"], a)
                c["exp"][min(15, max(0, int(math.log2(a)) + 8))] += 1

    def to_json(self):
        return {
            "n": self.n, "wall": self.wall, "wall_min": self.wall_min,
            "wall_max": self.wall_max, "hist": self.hist, "changes": self.changes,
            "changes_left": self.changes_left, "last_scale": self.last_scale,
            "kinds": self.kinds, "num": self.num,
        }

    @classmethod
    def merge(cls, a, b):
        raise NotImplementedError  # not needed: every rank is read from its record


SECTIONS.append(StandIn)
'''

CHILD = """
import cProfile, pstats, resource, sys, time
t0 = time.perf_counter(); c0 = time.process_time()
from amprobe.store import run as run_mod
exec(compile(SECTION, "standin", "exec"))
imports = (time.perf_counter() - t0, time.process_time() - c0)
rss_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
profile = PROFILE and cProfile.Profile()

def timed(fn):
    if profile:
        profile.enable()
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    t, c = time.perf_counter() - t, time.process_time() - c
    if profile:
        profile.disable()
        pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(18)
        profile.clear()
    return out, t, c

run, load_wall, load_cpu = timed(lambda: run_mod.load_run(RUN))
summaries, sum_wall, sum_cpu = timed(run.summaries)
sources = run.summary_sources()
rss_summaries = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
assert len(summaries) == len(run.ranks) and set(sources.values()) == {"records"}, set(sources.values())
assert all(s["_bench"]["n"] == summaries[0]["_bench"]["n"] for s in summaries.values())
rebuilt = []
NAMES = [cls.name for cls in run_mod.SECTIONS]
FILES = [(t, run_mod.table_filename(t)) for t in sorted(run_mod.summary_tables())]
for info in run.ranks[:REBUILD]:
    t = time.process_time()
    (info.path / "summary.json").rename(info.path / "summary.json.off")
    try:
        part = run_mod._summarize_rank(info, NAMES, FILES)
    finally:
        (info.path / "summary.json.off").rename(info.path / "summary.json")
    assert part.source == "files" and part.summary == summaries[info.rank], part.source
    rebuilt.append(time.process_time() - t)
print(json.dumps({
    "ranks": len(run.ranks), "imports_s": imports, "load_run_wall_s": load_wall,
    "load_run_cpu_s": load_cpu, "summaries_wall_s": sum_wall, "summaries_cpu_s": sum_cpu,
    "rss_after_imports_mb": rss_imports,
    "rss_peak_mb": rss_summaries,
    "rebuild_cpu_s_per_rank": sum(rebuilt) / len(rebuilt) if rebuilt else None,
    "warnings": len(run.warnings),
}))
"""


def build(source: Path, n: int, work: Path, crashed: bool = False) -> tuple[Path, int]:
    """``work/src`` (a copy of ``source``'s rank 0 with its summary) and the ``n``-rank
    ``work/run`` of hard links to it (without ``end.json`` when ``crashed``: no rank closed);
    returns the run and the size of one summary.json."""
    src = work / "src"
    shutil.rmtree(src, ignore_errors=True)
    (src).mkdir(parents=True)
    shutil.copyfile(source / "manifest.json", src / "manifest.json")
    shutil.copytree(source / "rank0", src / "rank0")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = (
        "from amprobe.store.run import write_rank_summary\n"
        + SECTION_CODE
        + f"write_rank_summary({str(src / 'rank0')!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    base = src / "rank0"
    summary_bytes = (base / "summary.json").stat().st_size
    dest = work / "run"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    top = json.loads((src / "manifest.json").read_text())
    top["world_size"] = n
    (dest / "manifest.json").write_text(json.dumps(top, indent=2))
    base_manifest = json.loads((base / "manifest.json").read_text())
    skip = {"manifest.json", "end.json"} if crashed else {"manifest.json"}
    files = [p for p in sorted(base.iterdir()) if p.is_file() and p.name not in skip]
    for r in range(n):
        rank_dir = dest / f"rank{r}"
        rank_dir.mkdir()
        for p in files:
            os.link(p, rank_dir / p.name)
        manifest = {**base_manifest, "rank": r, "local_rank": r % 8, "world_size": n}
        manifest["hostname"] = f"{base_manifest.get('hostname', 'node')}-{r // 8}"
        (rank_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return dest, summary_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--source", type=Path, default=Path("/work/bench33/source"))
    ap.add_argument("--work", type=Path, default=Path("/work/core-src"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rebuild", type=int, default=4, help="ranks also summarized from files")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--crashed", action="store_true", help="no rank has end.json")
    ap.add_argument("--no-build", action="store_true", help="reuse WORK/run as it is")
    args = ap.parse_args()
    if args.work.resolve().is_relative_to(args.source.resolve()):
        raise SystemExit("--work must not be inside --source (the source is never written)")
    t0 = time.perf_counter()
    if args.no_build:
        run = args.work / "run"
        size = (run / "rank0" / "summary.json").stat().st_size
    else:
        run, size = build(args.source, args.ranks, args.work, args.crashed)
    print(f"{args.ranks} ranks in {run} ({time.perf_counter() - t0:.1f} s); summary.json {size} B")
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    prelude = (
        f"import json\nRUN = {str(run)!r}\nPROFILE = {args.profile}\n"
        f"REBUILD = {args.rebuild}\nSECTION = {SECTION_CODE!r}\n"
    )
    for _ in range(args.repeat):
        out = subprocess.run(
            [sys.executable, "-c", prelude + CHILD],
            capture_output=True, text=True, env=env, check=False,
        )  # fmt: skip
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        if args.profile:
            print(out.stderr[-8000:])
        print(out.stdout.strip(), f"(load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
