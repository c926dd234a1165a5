"""Test helpers: build runs from hand-written rows, and a tiny training loop."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
import torch
from torch import nn

from amprobe.store import schema
from amprobe.store import sections as _sections  # noqa: F401  (registers the summary sections)
from amprobe.store.loader import RankInfo, Run
from amprobe.store.summary import summarize_tables

__all__ = [
    "amprobe_cli",
    "amprobe_sites",
    "fake_run",
    "TinyNet",
    "train_loop",
    "free_port",
    "torchrun_argv",
    "JobResults",
    "job_failure",
    "run_jobs",
    "GLOO_EXIT_ABORT",
    "run_gloo_job",
    "component_texts",
    "recorded_rows",
]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


def amprobe_cli(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -m amprobe ARGS`` in a subprocess that imports this checkout's amprobe."""
    env = {**os.environ, "PYTHONPATH": PACKAGE_PARENT}
    return subprocess.run(
        [sys.executable, "-m", "amprobe", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def amprobe_sites(sites: Iterable[str]) -> list[str]:
    """The ``file:line`` sites that lie in amprobe's own package (by module file, not by a
    ``/amprobe/`` substring: a clone's folder is named ``amprobe`` too)."""
    import amprobe

    package = Path(amprobe.__file__).resolve().parent
    own = []
    for site in sites:
        filename = str(site).rsplit(":", 1)[0]
        try:
            inside = Path(filename).resolve().is_relative_to(package)
        except (OSError, ValueError):
            inside = False
        if inside:
            own.append(site)
    return own


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: torch's, not amprobe's: after ``destroy_process_group`` the gloo group that functional
#: collectives used stays alive, and now and then (on a loaded machine, plain jobs as well) a
#: gloo worker thread frees its last all-reduce's tensors while the interpreter is finalizing
#: and aborts the rank (``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` ->
#: ``decref_pyobject`` -> ``take_gil`` -> ``std::terminate``). Such a job is run again.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def run_gloo_job(
    cmd: list[str], out: Path | None = None, tries: int = 3, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)``, run again from
    scratch (``out`` removed) when a rank died of :data:`GLOO_EXIT_ABORT` at exit."""
    for _ in range(tries):
        proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
        if proc.returncode == 0 or GLOO_EXIT_ABORT not in proc.stderr:
            break
        if out is not None:
            shutil.rmtree(out, ignore_errors=True)
    return proc


def job_failure(job: str, exc: Exception) -> str:
    """What a test that reads ``job`` says when the subprocess job gave no result."""
    if isinstance(exc, subprocess.TimeoutExpired):
        err = exc.stderr or b""
        err = err.decode(errors="replace") if isinstance(err, bytes) else err
        return (
            f"compile job {job!r} ran past its {exc.timeout:g} s timeout and was killed; the "
            f"end of its stderr: {err[-2000:]!r}"
        )
    return f"compile job {job!r} failed: {type(exc).__name__}: {exc}"


class JobResults(Mapping[str, dict[str, Any]]):
    """Subprocess jobs' results by id. Reading a job that failed or ran out of time fails the
    reading test with that job's message: the tests that read other jobs still run."""

    def __init__(self, results: dict[str, dict[str, Any] | str]) -> None:
        self._results = results  # a str: why the job gave no result

    def __getitem__(self, job: str) -> dict[str, Any]:
        result = self._results[job]
        if isinstance(result, str):
            pytest.fail(result, pytrace=False)
        return result

    def __iter__(self) -> Iterator[str]:
        return iter(self._results)

    def __len__(self) -> int:
        return len(self._results)


def run_jobs(jobs: Iterable[str], run: Callable[[str], dict[str, Any]]) -> JobResults:
    """``run(job)`` for every job, two at a time (compiling is the slow part); a job that
    raises (a failed assertion, a timeout) is recorded as its :func:`job_failure`."""
    results: dict[str, dict[str, Any] | str] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {job: pool.submit(run, job) for job in jobs}
        for job, future in futures.items():
            try:
                results[job] = future.result()
            except Exception as exc:  # reported by each test that reads this job
                results[job] = job_failure(job, exc)
    return JobResults(results)


def torchrun_argv(script: str = "ddp_gloo.py", nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run`` of a script in tests/scripts/ on a free port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        str(SCRIPTS / script),
    ]


def _frame(table: str, rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    rows = [dict(r) for r in rows]
    columns = schema.TABLES[table]
    full = [{"rank": r.get("rank", 0), **{c: r.get(c) for c in columns}} for r in rows]
    arrow = pa.schema([("rank", pa.int64()), *columns.items()])
    return pa.Table.from_pylist(full, schema=arrow).to_pandas()


def fake_run(
    steps: Iterable[Mapping[str, Any]] = (),
    events: Iterable[Mapping[str, Any]] = (),
    manifest: Mapping[str, Any] | None = None,
    ranks: Iterable[int] = (0,),
    tables: Mapping[str, Iterable[Mapping[str, Any]]] | None = None,
) -> Run:
    """A :class:`Run` held in memory, for rule tests on hand-built frames.

    ``events`` rows take ``kind`` and any detail fields (``rank``/``step`` optional).
    """
    event_rows = []
    for e in events:
        e = dict(e)
        rank = e.pop("rank", 0)
        step = e.pop("step", 0)
        kind = e.pop("kind")
        event_rows.append(
            {"rank": rank, "step": step, "t": 0.0, "kind": kind, "detail": json.dumps(e)}
        )
    rank_manifest = {"device": "cpu", "bf16_supported": True, **(manifest or {})}
    infos = [
        RankInfo(
            rank=r,
            path=Path(f"/nonexistent/rank{r}"),
            manifest=dict(rank_manifest),
            end={},
            status="finished",
        )
        for r in ranks
    ]
    built = {"steps": _frame("steps", steps), "events": _frame("events", event_rows)}
    for name, rows in (tables or {}).items():
        built[name] = _frame(name, rows)
    run = Run(
        path=Path("/nonexistent"),
        manifest={},
        ranks=infos,
        status="finished",
        warnings=[],
        _tables=built,
    )
    # no record files: each rank's summary is made from the frames held in memory
    run.cached(
        "summaries",
        lambda _: {r: summarize_tables(_rank_rows(built, r)) for r in [i.rank for i in infos]},
    )
    return run


def _rank_rows(built: Mapping[str, pd.DataFrame], rank: int) -> Any:
    """``read(table)`` for :func:`summarize_tables`: one rank's rows of in-memory frames as
    plain dicts (missing values None, numpy scalars as Python ones)."""

    def plain(value: Any) -> Any:
        if isinstance(value, (list, dict, str)):
            return value
        if value is None or pd.isna(value):
            return None
        return value.item() if hasattr(value, "item") else value

    def read(table: str) -> list[dict[str, Any]]:
        frame = built.get(table)
        if frame is None or frame.empty:
            return []
        part = frame[frame["rank"] == rank] if "rank" in frame else frame
        return [{k: plain(v) for k, v in row.items()} for row in part.to_dict("records")]

    return read


class TinyNet(nn.Module):
    def __init__(self, d: int = 16, h: int = 32, out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(h, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def train_loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    steps: int,
    dtype: torch.dtype | None = torch.float16,
    inf_at: Iterable[int] = (),
    clip: str | None = None,
    seed: int = 0,
) -> list[float]:
    """A standard AMP loop; ``inf_at`` plants an inf in the input at those iterations.

    ``clip``: None, "after_unscale" (correct) or "before_unscale" (misuse).
    Returns the loss values (read after training, no effect on numerics).
    """
    g = torch.Generator().manual_seed(seed)
    inf_at = set(inf_at)
    losses = []
    for i in range(steps):
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        if i in inf_at:
            x[0, 0] = float("inf")
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            if clip == "before_unscale":
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            elif clip == "after_unscale":
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(v) for v in losses]


def component_texts(component: Any) -> list[str]:
    """Every string in a Dash component tree (children and labels, a DataTable's rows), depth
    first."""
    if component is None:
        return []
    if isinstance(component, str):
        return [component]
    if isinstance(component, (list, tuple)):
        return [t for c in component for t in component_texts(c)]
    out: list[str] = []
    for prop in ("children", "label"):
        out.extend(component_texts(getattr(component, prop, None)))
    data = getattr(component, "data", None)
    if isinstance(data, list):  # a DataTable's rows
        out.extend(v for row in data if isinstance(row, dict) for v in row.values())
    return out


def recorded_rows(run_dir: Path, table: str, rank: int = 0) -> list[dict[str, Any]]:
    """The rows one rank of a recorded run wrote to ``table`` (its JSON-lines file), as written."""
    text = (Path(run_dir) / f"rank{rank}" / f"{table}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def sampled_steps(run_dir: Path, rank: int) -> dict[str, list[int]]:
    """The steps each kind of sample was taken on, as ``rank`` of a recorded run wrote them:
    per-layer numerics and sync counting (flags in the step rows), shapes (their own step rows)
    and the replicas' fingerprints (one row per parameter and sampled step)."""
    steps = recorded_rows(run_dir, "steps", rank)
    return {
        "numerics": [r["step"] for r in steps if r.get("numerics_sampled")],
        "syncs": [r["step"] for r in steps if r.get("syncs_sampled")],
        "shapes": [r["step"] for r in recorded_rows(run_dir, "compute_steps", rank)],
        "replicas": sorted({r["step"] for r in recorded_rows(run_dir, "fingerprints", rank)}),
    }
