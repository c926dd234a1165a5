"""The dashboard's run page on a run of many ranks, server side: the callbacks that draw its first
paint (the page, then the tab callback the page's mount fires), then each tab opened.

Calls the callbacks as Dash would (``dashboard.callbacks``, as the tests do), in one process,
and prints per callback its wall time, the CPU time of the thread that ran it and of the whole
process (DuckDB's threads reduce a tab's figures; the run page starts reading the run for its
tabs in a background thread once the findings are drawn, which the process time then counts). ``--cold`` removes the run's cached diagnosis first (the page
then loads and diagnoses the run, and keeps the diagnosis); without it the page reads the
cached one if fresh. ``--wait`` waits for the background read before opening the tabs (a user
reading the findings first); without it the first tab waits for it. Asserts nothing.

The run is written to (the cached diagnosis, the derived Parquet files): use a copy made of
hard links (``cp -al RUN COPY``) of a run you cannot lose.

    python benchmarks/bench_run_page.py RUN [--cold] [--wait] [--tabs compute,ranks]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--cold", action="store_true", help="remove the cached diagnosis first")
    parser.add_argument("--wait", action="store_true", help="open the tabs once the run is read")
    parser.add_argument("--tabs", default="", help="tabs to open, comma-separated (none)")
    args = parser.parse_args()

    from amprobe.store.artifacts import DERIVED_DIR, cache_dir

    run_dir = args.run.resolve()
    if args.cold:
        folders = [run_dir / DERIVED_DIR, *(cache_dir() / DERIVED_DIR).glob("*")]
        for folder in folders:
            for path in folder.glob("diagnosis-*.json"):
                path.unlink()

    t0 = time.process_time()
    from dashboard import callbacks, layout

    print(f"{cpu_model()}, load average {os.getloadavg()[0]:.1f}")
    print(f"imports {time.process_time() - t0:.2f} s CPU")
    ctx = callbacks.Context(root=run_dir.parent)
    name = run_dir.name

    def timed(label: str, fn):  # type: ignore[no-untyped-def]
        cpu, every, wall = time.thread_time(), time.process_time(), time.perf_counter()
        out = fn()
        print(
            f"{label:<24} {time.perf_counter() - wall:6.2f} s wall "
            f"{time.thread_time() - cpu:6.2f} s CPU this thread, "
            f"{time.process_time() - every:6.2f} s all threads  peak RSS {_rss_gb():.2f} GB",
            flush=True,
        )
        return out

    start = time.perf_counter()
    timed("page", lambda: callbacks.render_page(ctx, f"/run/{name}", ""))
    loaded = ctx.cache.get(name)
    shown = {"tab": "overview", "version": loaded.version}
    timed(
        "tab callback (mount)", lambda: callbacks.render_tab(ctx, name, "overview", {}, "", shown)
    )
    print(
        f"first paint: {time.perf_counter() - start:.2f} s wall; diagnosis "
        f"{'from the cache' if getattr(loaded.diagnosis, 'from_cache', False) else 'computed'}"
    )
    prepare = [t for t in threading.enumerate() if t.name == "amprobe-prepare"]
    if args.wait:
        for thread in prepare:
            thread.join()
        print(f"run read for the tabs {time.perf_counter() - start:.2f} s wall after the page")
    for tab in [t for t in args.tabs.split(",") if t]:
        query = layout.RunQuery(tab=tab)
        body, _ = timed(
            f"tab {tab}",
            lambda q=query: callbacks.render_tab(ctx, name, q.tab, q.focus(), "", None),
        )
        text = str(body)
        if "amprobe failed" in text:
            print("   ", text[text.index("amprobe failed") :][:300])
    print(f"process: {time.process_time() - t0:.2f} s CPU, peak RSS {_rss_gb():.2f} GB")


if __name__ == "__main__":
    main()
