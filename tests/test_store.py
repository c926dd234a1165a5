"""The run store: writer/loader round trip, damaged run directories, SIGKILL, and a loader fuzz."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import amprobe
from amprobe.report import render_json, render_text
from amprobe.store import RunLoadError, StoreError, load_run, schema
from amprobe.store.loader import read_table
from amprobe.store.writer import RunWriter

REPO = Path(__file__).resolve().parents[1]


def _step_row(step: int, **extra) -> dict:
    return {
        "step": step,
        "window": 0,
        "t": step * 0.5,
        "wall_s": 0.01,
        "scaler_enabled": True,
        "scale_before": 1024.0,
        "scale_after": 1024.0,
        "skipped": step % 3 == 0,
        "opt_steps": 1,
        "loss": 1.0 / (step + 1),
        "loss_dtype": "float32",
        "autocast_dtype": "float16",
        **extra,
    }


def write_run(
    root: Path,
    steps: int = 12,
    rank: int = 0,
    world_size: int = 1,
    close: bool = True,
    manifest: dict | None = None,
) -> Path:
    """A run written through the real writer. No pid in the manifest: a missing end marker reads
    as interrupted, not live."""
    writer = RunWriter(
        root,
        rank,
        world_size,
        {"device": "cpu", "bf16_supported": True, **(manifest or {})},
        max_buffered_rows=10_000,
    )
    half = steps // 2
    writer.append("steps", [_step_row(s) for s in range(half)])
    writer.append(
        "events", [{"step": 0, "t": 0.0, "kind": "run_start", "detail": json.dumps({"x": 1})}]
    )
    writer.flush()
    writer.append("steps", [_step_row(s) for s in range(half, steps)])
    writer.flush()
    if close:
        writer.close({"status": "finished", "steps": steps})
    return root


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run")


# -- round trip -----------------------------------------------------------------------------------


def test_round_trip_types_and_order(run_dir: Path):
    run = load_run(run_dir)
    assert run.status == "finished" and run.warnings == []
    steps = run.steps
    assert list(steps["step"]) == list(range(12))  # both flushes, in order
    assert steps["step"].dtype == "int64" and steps["rank"].dtype == "int64"
    for column in ("t", "wall_s", "scale_before", "loss"):
        assert steps[column].dtype == "float64"
    assert list(steps["skipped"]) == [s % 3 == 0 for s in range(12)]
    assert set(steps["loss_dtype"]) == {"float32"}
    assert steps["loss"].tolist() == pytest.approx([1.0 / (s + 1) for s in range(12)])
    assert steps["found_inf"].isna().all()  # a column the writer did not emit reads as nulls
    assert set(schema.TABLES["steps"]) <= set(steps.columns)
    assert run.events_of("run_start") == [{"rank": 0, "step": 0, "t": 0.0, "x": 1}]
    assert run.manifest["format"] == schema.FORMAT
    assert run.manifest["schema_version"] == schema.SCHEMA_VERSION
    assert {"amprobe_version", "torch_version", "python_version", "argv"} <= set(run.manifest)
    assert run.rank_manifest["device"] == "cpu"
    assert run.last_step == 11


def test_append_after_close_flush_and_rows_flushed_at_close(tmp_path: Path):
    writer = RunWriter(tmp_path / "r", 0, 1, {}, max_buffered_rows=100)
    writer.append("steps", [_step_row(0)])
    writer.flush()
    writer.append("steps", [_step_row(1), _step_row(2)])
    writer.close({"status": "finished"})  # close flushes what is queued
    assert list(load_run(tmp_path / "r").steps["step"]) == [0, 1, 2]


def test_nonfinite_loss_round_trips(tmp_path: Path):
    writer = RunWriter(tmp_path / "r", 0, 1, {}, max_buffered_rows=100)
    values = [float("nan"), float("inf"), -float("inf"), 2.5]
    writer.append("steps", [_step_row(i, loss=v, scale_after=v) for i, v in enumerate(values)])
    writer.close({"status": "finished"})
    run = load_run(tmp_path / "r")
    assert run.warnings == []
    loss = run.steps["loss"].tolist()
    assert math.isnan(loss[0]) and loss[1] == math.inf and loss[2] == -math.inf and loss[3] == 2.5
    assert run.steps["scale_after"].tolist()[1:] == [math.inf, -math.inf, 2.5]


def test_two_ranks_and_incremental_read(tmp_path: Path):
    write_run(tmp_path / "r", steps=6, rank=0, world_size=2)
    write_run(tmp_path / "r", steps=4, rank=1, world_size=2)
    run = load_run(tmp_path / "r")
    assert [r.rank for r in run.ranks] == [0, 1]
    assert run.steps.groupby("rank").size().to_dict() == {0: 6, 1: 4}
    path = tmp_path / "r" / "rank0" / "steps.jsonl"
    first, offset, dropped = read_table(path, "steps")
    assert len(first) == 6 and offset == path.stat().st_size and dropped == 0
    with open(path, "a") as fh:
        fh.write(
            json.dumps(_step_row(6)) + "\n" + '{"step": 7, "lo'
        )  # a record still being written
    more, offset2, _ = read_table(path, "steps", offset)
    assert list(more["step"]) == [6]
    with open(path, "a") as fh:
        fh.write('ss": 1.0}\n')
    rest, _, _ = read_table(path, "steps", offset2)
    assert list(rest["step"]) == [7]


def test_writer_refuses_to_overwrite(run_dir: Path):
    with pytest.raises(StoreError, match="already holds"):
        RunWriter(run_dir, 0, 1, {}, max_buffered_rows=10)


# -- damaged run directories ----------------------------------------------------------------------


def test_missing_path(tmp_path: Path):
    with pytest.raises(RunLoadError, match="no such run directory"):
        load_run(tmp_path / "nope")


def test_file_instead_of_dir(tmp_path: Path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunLoadError, match="not a directory"):
        load_run(tmp_path / "f")


def test_empty_dir(tmp_path: Path):
    with pytest.raises(RunLoadError, match="not an amprobe run directory"):
        load_run(tmp_path)


def test_dir_of_unrelated_files(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "rankings").mkdir()
    with pytest.raises(RunLoadError, match="no manifest.json"):
        load_run(tmp_path)


def test_top_manifest_missing_is_a_partial_load_with_warning(run_dir: Path):
    (run_dir / "manifest.json").unlink()
    run = load_run(run_dir)
    assert len(run.steps) == 12 and run.manifest == {}
    assert any("run manifest is missing" in w for w in run.warnings)


def test_top_manifest_only(run_dir: Path):
    shutil.rmtree(run_dir / "rank0")
    with pytest.raises(RunLoadError, match="no rank data"):
        load_run(run_dir)


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        '{"format": "other", "schema_version": 1}',
        '{"format": "amprobe-run"}',
        "",
    ],
)
def test_corrupt_top_manifest_partial_load(run_dir: Path, content: str):
    (run_dir / "manifest.json").write_text(content)
    run = load_run(run_dir)
    assert len(run.steps) == 12
    assert run.manifest == {}
    assert any("reading the ranks without it" in w for w in run.warnings)


def test_corrupt_rank_manifest_skips_rank(tmp_path: Path):
    root = tmp_path / "r"
    write_run(root, steps=6, rank=0, world_size=2)
    write_run(root, steps=4, rank=1, world_size=2)
    (root / "rank1" / "manifest.json").write_text('{"format": "amprobe-run", "schema_')
    run = load_run(root)
    assert [r.rank for r in run.ranks] == [0]
    assert set(run.steps["rank"]) == {0}
    assert any(w.startswith("rank 1 skipped") for w in run.warnings)


def test_corrupt_rank_manifest_no_rank_left(run_dir: Path):
    (run_dir / "rank0" / "manifest.json").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(RunLoadError, match="no readable rank") as info:
        load_run(run_dir)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("which", ["manifest.json", "rank0/manifest.json"])
def test_future_schema_version(run_dir: Path, which: str):
    path = run_dir / which
    manifest = json.loads(path.read_text())
    manifest["schema_version"] = schema.SCHEMA_VERSION + 1
    path.write_text(json.dumps(manifest))
    with pytest.raises(RunLoadError, match="upgrade amprobe") as info:
        load_run(run_dir)
    assert f"schema version {schema.SCHEMA_VERSION + 1}" in str(info.value)


def test_truncated_last_line_is_ignored(run_dir: Path):
    path = run_dir / "rank0" / "steps.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 20])  # cut inside the last record
    run = load_run(run_dir)
    assert list(run.steps["step"]) == list(range(11))
    assert not any("unreadable" in w for w in run.warnings)


@pytest.mark.parametrize(
    "garbage",
    [
        b"{broken",
        b"\x00\x01\x02",
        b"[1,2,3]",
        b'{"step": "seven"}',
        b'{"step": 1e400}',
        b"\xff\xfe{}",
    ],
)
def test_garbage_line_in_middle_is_dropped_and_counted(run_dir: Path, garbage: bytes):
    path = run_dir / "rank0" / "steps.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:5]) + garbage + b"\n" + b"".join(lines[5:]))
    run = load_run(run_dir)
    kept = list(run.steps["step"].dropna().astype(int))
    assert [s for s in kept if s in range(12)] == list(range(12))  # every good record kept
    if garbage.startswith(b'{"step"'):
        # parses as an object, but a steps row without a valid step cannot be placed: dropped
        assert len(run.steps) == 12
        assert any("1 record(s) without a valid integer step dropped" in w for w in run.warnings)
    else:
        assert len(run.steps) == 12
        assert any("1 unreadable record(s) skipped in steps.jsonl" in w for w in run.warnings)


def test_missing_end_marker_is_interrupted_with_last_step(run_dir: Path):
    (run_dir / "rank0" / "end.json").unlink()
    run = load_run(run_dir)
    assert run.status == "interrupted"
    assert any("ended abruptly at step 11" in w for w in run.warnings)


def test_missing_end_marker_with_live_writer_is_live(tmp_path: Path):
    import socket

    root = write_run(
        tmp_path / "r", close=False, manifest={"pid": os.getpid(), "hostname": socket.gethostname()}
    )
    assert load_run(root).status == "live"


def test_interrupted_before_first_flush(tmp_path: Path):
    RunWriter(tmp_path / "r", 0, 1, {}, max_buffered_rows=10)
    run = load_run(tmp_path / "r")
    assert run.status == "interrupted" and len(run.steps) == 0
    assert any("before its first flushed step" in w for w in run.warnings)


def test_lost_rows_reported(tmp_path: Path):
    writer = RunWriter(tmp_path / "r", 0, 1, {}, max_buffered_rows=3)
    writer.append("steps", [_step_row(s) for s in range(5)])  # two oldest rows pushed out
    writer.close({"status": "finished"})
    run = load_run(tmp_path / "r")
    assert list(run.steps["step"]) == [2, 3, 4]
    assert any("2 steps record(s) could not be written (steps 0..1)" in w for w in run.warnings)


def test_corrupt_end_marker_warns(run_dir: Path):
    (run_dir / "rank0" / "end.json").write_text("{")
    run = load_run(run_dir)
    assert len(run.steps) == 12 and any("end marker" in w for w in run.warnings)


# -- SIGKILL --------------------------------------------------------------------------------------

# One process imports torch once and forks a fresh trainer per kill point (the import is what
# costs seconds); the trainer is killed with SIGKILL by the test and reaped by its parent, so the
# loader sees a dead writer pid, as after a real crash.
FORK_SERVER = textwrap.dedent(
    """
    import os, sys, time
    import torch
    torch.set_num_threads(1)
    import amprobe
    from tests.helpers import TinyNet

    def train(root, steps):
        torch.manual_seed(0)
        model = TinyNet()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        probe = amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=root,
                               config={"flush_every": 5})
        for i in range(steps):
            x = torch.randn(8, 16)
            if i % 7 == 3:
                x[0, 0] = float("inf")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), torch.zeros(8, 4))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if (i + 1) % 5 == 0:
                print("flushed", i, flush=True)
            time.sleep(0.002)
        return probe

    # warm up once (lazy imports and first-call costs), so each forked trainer starts at once
    train(sys.argv[1] + "-warmup", 2).close()
    for root in sys.argv[1:]:
        pid = os.fork()
        if pid == 0:
            train(root, 100000)
            os._exit(0)
        print("trainer", pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("reaped", pid, os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, flush=True)
    """
)


def _assert_every_file_readable(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_dir() or path.name.startswith("."):
            continue  # a leftover temp file of an atomic write is never read
        data = path.read_bytes()
        if path.suffix == ".json":
            assert isinstance(json.loads(data), dict), path
        elif path.suffix == ".jsonl":
            complete = data[: data.rfind(b"\n") + 1]
            for line in complete.splitlines():
                json.loads(line)  # every complete line parses


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_sigkill_keeps_every_flushed_step(tmp_path: Path):
    rng = random.Random(
        20240607
    )  # reproducible "random" kill points: (flush lines seen, extra delay s)
    kill_after = [(1, 0.0)] + [(rng.randint(1, 8), rng.uniform(0.0, 0.012)) for _ in range(7)]
    roots = [tmp_path / f"run{n}" for n in range(len(kill_after))]
    server = subprocess.Popen(
        [sys.executable, "-c", FORK_SERVER, *map(str, roots)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 90

    def next_line() -> str:
        line = server.stdout.readline()
        assert line, f"fork server ended early: {server.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "too slow"
        return line.split()

    try:
        for root, (flushes, delay) in zip(roots, kill_after, strict=True):
            word, pid = next_line()
            assert word == "trainer"
            seen, last_flushed = 0, None
            while seen < flushes:
                word, value = next_line()
                assert word == "flushed"
                seen, last_flushed = seen + 1, int(value)
            time.sleep(delay)
            os.kill(int(pid), signal.SIGKILL)
            line = next_line()
            while line[0] == "flushed":  # lines the trainer printed before the kill landed
                line = next_line()
            assert line == ["reaped", pid, str(int(signal.SIGKILL))]

            run = load_run(root)
            assert run.status == "interrupted"
            steps = list(run.steps["step"])
            assert steps == list(range(len(steps))), "flushed steps must load without a gap"
            assert steps[-1] >= last_flushed
            assert any(f"ended abruptly at step {steps[-1]}" in w for w in run.warnings)
            skipped = run.steps.set_index("step")["skipped"]
            assert all(bool(skipped[s]) == (s % 7 == 3) for s in steps)  # planted infs were skipped
            _assert_every_file_readable(root)
            ids = amprobe.diagnose(run).ids()
            assert "AMP-N01" in ids  # the cut at step 3 is always flushed
            assert ("AMP-N02" in ids) == (len(steps) >= 10)  # 1 in 7 skipped: below 90 %
        server.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


# -- fuzz -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_run() -> Path:
    import torch

    from tests.helpers import TinyNet, train_loop

    root = Path(tempfile.mkdtemp(prefix="amprobe-fuzz-")) / "run"
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with amprobe.attach(
        model=model, optimizer=opt, scaler=scaler, run_dir=root, config={"flush_every": 4}
    ):
        train_loop(model, opt, scaler, steps=14, inf_at=(2, 9), clip="before_unscale")
    yield root
    shutil.rmtree(root.parent, ignore_errors=True)


FILES = [
    "manifest.json",
    "rank0/manifest.json",
    "rank0/steps.jsonl",
    "rank0/events.jsonl",
    "rank0/end.json",
]

mutation = st.one_of(
    st.tuples(
        st.just("flip"),
        st.sampled_from(FILES),
        st.lists(
            st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
            min_size=1,
            max_size=8,
        ),
    ),
    st.tuples(st.just("truncate"), st.sampled_from(FILES), st.floats(0, 1)),
    st.tuples(st.just("delete"), st.sampled_from(FILES), st.none()),
    st.tuples(
        st.just("insert"),
        st.sampled_from(FILES),
        st.tuples(st.floats(0, 1), st.binary(min_size=1, max_size=12)),
    ),
)


def _mutate(root: Path, kind: str, name: str, arg) -> None:
    path = root / name
    if not path.exists():
        return
    data = bytearray(path.read_bytes())
    if kind == "flip" and data:
        for where, value in arg:
            data[int(where * len(data))] = value
    elif kind == "truncate":
        data = data[: int(arg * len(data))]
    elif kind == "delete":
        path.unlink()
        return
    elif kind == "insert":
        where, blob = arg
        at = int(where * len(data))
        data = data[:at] + blob + data[at:]
    path.write_bytes(bytes(data))


@settings(max_examples=60, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(mutations=st.lists(mutation, min_size=1, max_size=4))
def test_fuzzed_run_loads_or_raises_run_load_error(real_run: Path, mutations):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "run"
        shutil.copytree(real_run, root)
        for kind, name, arg in mutations:
            _mutate(root, kind, name, arg)
        with _hang_guard(10.0):
            try:
                run = load_run(root)
            except RunLoadError as exc:
                assert "\n" not in str(exc)
                return
            diagnosis = amprobe.diagnose(run)
            render_text(diagnosis)
            json.loads(render_json(diagnosis))
        assert all(isinstance(w, str) for w in run.warnings)


@contextlib.contextmanager
def _hang_guard(seconds: float):
    """Fail (instead of hanging forever) when the body runs longer than ``seconds``.

    Hypothesis' deadline only judges an example after it returns; this interrupts one that never does.
    """
    if not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise TimeoutError(f"load/diagnose ran longer than {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=8),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.floats(allow_nan=True, allow_infinity=True),
            st.text(max_size=12),
            st.lists(st.floats(allow_nan=True), max_size=3),
        ),
        max_size=8,
    )
)
def test_row_encoder_writes_what_json_writes(row: dict):
    """The writer's row encoder (the C encoder built once) writes the same text as the
    standard library's encoder with the same options, NaN and infinities included."""
    from amprobe.store.writer import _ENCODE

    row = {**row, "path": Path("a/b"), "tuple": (1, 2.5)}  # default=str; tuples as lists
    assert _ENCODE(row) == json.JSONEncoder(default=str, check_circular=False).encode(row)


def test_an_unclosed_rank_that_ends_early_is_named(tmp_path: Path):
    """#33: a truncated rank among many is reported as such, not only by its own findings."""
    root = tmp_path / "run"
    for rank, steps in [(0, 400), (1, 400), (2, 150), (3, 340)]:
        write_run(root, steps=steps, rank=rank, world_size=4, close=False)
    run = load_run(root)
    lagging = [w for w in run.warnings if "stopped early" in w]
    # rank 3 is 59 steps behind: within one flush of the others, not named
    assert lagging == [
        "rank 2: records end at step 149, 250 steps before the last step of the run (399), "
        "with no clean close: the rank stopped early or its files were cut"
    ]
    closed = tmp_path / "closed"
    for rank, steps in [(0, 400), (1, 150)]:
        write_run(closed, steps=steps, rank=rank, world_size=2, close=True)
    assert not [w for w in load_run(closed).warnings if "stopped early" in w]


def test_a_repeated_steps_row_is_counted_once_by_the_summaries_too(tmp_path: Path):
    """Review of #33: a copied steps row was counted twice by the summaries (201 steps, one
    repeated) while the loader dropped it and said so: both now keep the first of each."""
    from amprobe.analysis.scaler import compute_success_rate

    root = write_run(tmp_path / "run", steps=40)
    path = root / "rank0" / "steps.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    with open(path, "ab") as fh:
        fh.write(lines[5] + lines[6])
    run = load_run(root)
    assert run.summaries()[0]["steps"]["rows"] == 40
    assert compute_success_rate(run)["step_count"] == 40
    assert any(
        "rank 0: 2 repeated record(s) of the same (window, step) in steps.jsonl" in w
        for w in run.warnings
    )
    assert run.summary_sources() == {0: "files"}
    assert len(run.steps) == 40  # the loader keeps the first of each too
