"""Hostile input never hurts the job or lies: control file, signals, disk faults, corrupt runs.

One test (or a few) per item of issue 16; each reproduces the case that was wrong before.
Tests that spawn processes are bounded in time and kill what they started.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from amprobe.store import layout
from amprobe.store.layout import (
    FORMAT,
    StoreError,
    check_writable,
    is_run_dir,
    list_ranks,
    parse_rank_dirname,
)


def _manifest(path: Path, **extra: object) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text(
        json.dumps({"format": FORMAT, "schema_version": 1, **extra}), encoding="utf-8"
    )


# -- the run directory's vocabulary (issue 13, store part) --------------------------------------
@pytest.mark.parametrize(
    ("name", "rank"),
    [
        ("rank0", 0),
        ("rank12", 12),
        ("rank007", 7),
        ("rank", None),
        ("rank-1", None),
        ("ranking", None),
        ("rank\u0661", None),  # Arabic-Indic digit one
        ("rank\u00b2", None),  # superscript two
        ("rank1\u00b2", None),
        ("Rank1", None),
    ],
)
def test_rank_folder_names_are_ascii_digits_only(name, rank):
    assert parse_rank_dirname(name) == rank


def test_list_ranks_warns_about_lookalikes_and_double_spellings(tmp_path):
    for name in ("rank0", "rank00", "rank2", "rank\u0661", "rank\u00b2", "ranking"):
        (tmp_path / name).mkdir()
    (tmp_path / "rank5").write_text("a file, not a folder")
    listing = list_ranks(tmp_path)
    assert [(r.rank, r.path.name) for r in listing] == [(0, "rank0"), (2, "rank2")]
    text = " | ".join(listing.warnings)
    assert "'rank\u0661'" in text and "'rank\u00b2'" in text and "ASCII" in text
    assert "'rank00'" in text and "only 'rank0' is read" in text
    assert "'rank5' is not a folder" in text
    assert "ranking" not in text


def test_is_run_dir_needs_the_format_marker(tmp_path):
    foreign = tmp_path / "extension"
    foreign.mkdir()
    (foreign / "manifest.json").write_text(json.dumps({"manifest_version": 3, "name": "ext"}))
    assert not is_run_dir(foreign)
    run = tmp_path / "run"
    _manifest(run)
    assert is_run_dir(run)
    headless = tmp_path / "headless"  # top manifest lost, a rank manifest still says it
    _manifest(headless / "rank0")
    assert is_run_dir(headless)
    assert layout.list_runs(tmp_path) == [headless.resolve(), run.resolve()]


def test_is_live_follows_the_writing_process(tmp_path):
    import socket

    run = tmp_path / "run"
    _manifest(run)
    _manifest(run / "rank0", pid=os.getpid(), hostname=socket.gethostname())
    assert layout.is_live(run)
    (run / "rank0" / "end.json").write_text("{}")
    assert not layout.is_live(run)


def test_check_writable_raises_one_line_and_leaves_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="cannot write the run directory") as info:
        check_writable(blocker / "sub" / "run")
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)
    fresh = tmp_path / "a" / "b" / "run"
    check_writable(fresh)
    assert not (tmp_path / "a").exists()  # the check left nothing behind


def test_store_does_not_import_config():
    import ast

    package = Path(layout.__file__).parent
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "amprobe.config", path.name
            if isinstance(node, ast.Import):
                assert all(a.name != "amprobe.config" for a in node.names), path.name


# -- the loader: one row per step, anomalies as warnings, bounded memory (items 6, 8, 9) --------
def _write_run(root: Path, steps: int = 12, close: bool = True, world_size: int = 1) -> Path:
    from tests.test_store import write_run

    return write_run(root, steps=steps, close=close, world_size=world_size)


def test_repeated_step_rows_are_kept_once_with_a_count(tmp_path):
    from amprobe.store import load_run

    run_dir = _write_run(tmp_path / "run", steps=200)
    path = run_dir / "rank0" / "steps.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    skipped = [line for line in lines if json.loads(line)["skipped"]][:40]
    with open(path, "ab") as fh:
        fh.write(b"".join(skipped))
    run = load_run(run_dir)
    assert len(run.steps) == 200
    assert run.steps["step"].is_unique
    assert any("40 repeated record(s) of the same (rank, window, step)" in w for w in run.warnings)


@pytest.mark.parametrize("bad", ["10**30", "1.5", '"7"'])
def test_steps_that_are_not_integers_are_dropped_with_a_warning(tmp_path, bad):
    from amprobe.store import load_run

    run_dir = _write_run(tmp_path / "run")
    value = str(10**30) if bad == "10**30" else bad
    with open(run_dir / "rank0" / "steps.jsonl", "a") as fh:
        fh.write('{"step": ' + value + ', "window": 0}\n')
    run = load_run(run_dir)
    assert list(run.steps["step"]) == list(range(12))
    assert any("without a valid integer step dropped" in w for w in run.warnings)


def test_rank_folders_with_odd_names_are_warnings_not_errors(tmp_path):
    import shutil

    from amprobe.store import load_run

    run_dir = _write_run(tmp_path / "run", world_size=4)
    shutil.copytree(run_dir / "rank0", run_dir / "rank\u00b2")
    shutil.copytree(run_dir / "rank0", run_dir / "rank\u0661")
    shutil.copytree(run_dir / "rank0", run_dir / "rank00")
    run = load_run(run_dir)
    assert [r.rank for r in run.ranks] == [0]
    text = " | ".join(run.warnings)
    assert "'rank\u00b2'" in text and "'rank\u0661'" in text and "'rank00'" in text
    assert "world_size 4 but no readable data for rank(s) 1, 2, 3" in text


def test_only_rank2_of_four_is_a_warning(tmp_path):
    from amprobe.store import load_run

    run_dir = _write_run(tmp_path / "run", world_size=4)
    (run_dir / "rank0").rename(run_dir / "rank2")
    run = load_run(run_dir)
    assert [r.rank for r in run.ranks] == [2]
    assert any("rank(s) 0, 1, 3" in w for w in run.warnings)


@pytest.mark.parametrize(
    ("where", "field", "value"),
    [
        ("end", "lost_rows", [1, 2]),
        ("end", "lost_steps", 5),
        ("end", "write_errors", "disk full"),
        ("end", "write_errors", [1]),
        ("rank", "gpu_name", {"a": 1}),
        ("top", "world_size", "four"),
    ],
)
def test_wrong_types_in_manifests_are_damaged_fields(tmp_path, where, field, value):
    import amprobe
    from amprobe.report import render_text

    run_dir = _write_run(tmp_path / "run")
    path = {
        "end": run_dir / "rank0" / "end.json",
        "rank": run_dir / "rank0" / "manifest.json",
        "top": run_dir / "manifest.json",
    }[where]
    obj = json.loads(path.read_text())
    obj[field] = value
    path.write_text(json.dumps(obj))
    run = amprobe.load_run(run_dir)
    assert any(f"field {field!r} is damaged" in w for w in run.warnings)
    render_text(amprobe.diagnose(run))  # no internal error downstream


def test_cut_last_line_of_a_cleanly_closed_run_is_reported(tmp_path):
    from amprobe.store import load_run

    run_dir = _write_run(tmp_path / "run")
    with open(run_dir / "rank0" / "steps.jsonl", "a") as fh:
        fh.write('{"step": 12, "window": 0')
    run = load_run(run_dir)
    assert len(run.steps) == 12
    assert any("ends in a cut record" in w for w in run.warnings)


def test_oversize_line_is_skipped_without_holding_it(tmp_path, monkeypatch):
    from amprobe.store import jsonl, load_run

    monkeypatch.setattr(jsonl, "MAX_RECORD_BYTES", 1000)
    monkeypatch.setattr(jsonl, "READ_CHUNK_BYTES", 4096)
    run_dir = _write_run(tmp_path / "run")
    path = run_dir / "rank0" / "steps.jsonl"
    good = path.read_bytes()
    huge = b'{"step": 99, "pad": "' + b"x" * 50_000 + b'"}\n'
    path.write_bytes(good + huge + good.replace(b'"window": 0', b'"window": 1'))
    run = load_run(run_dir)
    assert len(run.steps) == 24
    assert any("1 record(s) longer than 1000 bytes skipped" in w for w in run.warnings)


def test_unterminated_oversize_tail_is_not_reread(tmp_path, monkeypatch):
    from amprobe.store import jsonl, read_table

    monkeypatch.setattr(jsonl, "MAX_RECORD_BYTES", 1000)
    monkeypatch.setattr(jsonl, "READ_CHUNK_BYTES", 4096)
    path = tmp_path / "steps.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2, "pad": "' + b"x" * 20_000)
    frame, offset, dropped = read_table(path, "steps")
    assert list(frame["step"]) == [1] and dropped == 1
    assert offset == path.stat().st_size  # the live reader does not come back for the tail
    with open(path, "ab") as fh:
        fh.write(b'x"}\n{"step": 3}\n')
    frame, offset2, dropped = read_table(path, "steps", offset)
    assert list(frame["step"]) == [3] and dropped == 0  # the rest of the oversize line skipped
    assert offset2 == path.stat().st_size


#: Loads a clean run (allocators and imports warm), then the hostile one; prints the peak RSS
#: growth the second load caused, in bytes, and the warnings it gave.
_PEAK_RSS_SCRIPT = """
import json, resource, sys
from amprobe.store import load_run

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

def load(path):
    run = load_run(path)
    return len(run.steps), run.warnings

load(sys.argv[1])
before = peak()
rows, warnings = load(sys.argv[2])
print(json.dumps({"growth": peak() - before, "rows": rows, "warnings": warnings}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB, sparse files")
@pytest.mark.parametrize("length", [200_000_000, 1_000_000_000])
def test_a_complete_oversize_line_costs_no_more_memory_than_the_cap(tmp_path, length):
    import subprocess

    from amprobe.store import jsonl

    clean = _write_run(tmp_path / "clean")
    hostile = _write_run(tmp_path / "hostile")
    path = hostile / "rank0" / "steps.jsonl"
    good = path.read_bytes()
    head = b'{"step": 99, "pad": "'
    with open(path, "wb") as fh:  # the long run of the line is a hole: no disk, read as NULs
        fh.write(good + head)
        fh.truncate(len(good) + len(head) + length)
        fh.seek(0, os.SEEK_END)
        fh.write(b'"}\n' + good.replace(b'"window": 0', b'"window": 1'))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PEAK_RSS_SCRIPT, str(clean), str(hostile)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
            timeout=300,
        )
    finally:
        path.unlink()
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["rows"] == 24
    cap = jsonl.MAX_RECORD_BYTES
    assert any(f"1 record(s) longer than {cap} bytes skipped" in w for w in result["warnings"])
    # a few buffers of the cap's size at once (the chunk read, the chunk joined to the rest of
    # the line before it), never the line: 198 MB for either line before the fix
    assert result["growth"] <= 4 * cap, result


def test_unterminated_small_tail_is_left_for_the_next_read(tmp_path):
    from amprobe.store import read_table

    path = tmp_path / "steps.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2')
    frame, offset, _ = read_table(path, "steps")
    assert list(frame["step"]) == [1] and offset == len(b'{"step": 1}\n')


def test_fifo_in_place_of_a_table_is_refused_at_once(tmp_path):
    from amprobe.store import load_run

    run_dir = _write_run(tmp_path / "run")
    (run_dir / "rank0" / "steps.jsonl").unlink()
    os.mkfifo(run_dir / "rank0" / "steps.jsonl")
    run = load_run(run_dir)  # would block forever in open() before
    assert run.steps.empty
    assert any("steps.jsonl not read" in w and "FIFO" in w for w in run.warnings)


def test_fifo_and_device_in_place_of_a_manifest_are_refused(tmp_path):
    from amprobe.store import RunLoadError, load_run

    run_dir = _write_run(tmp_path / "run")
    (run_dir / "rank0" / "end.json").unlink()
    os.mkfifo(run_dir / "rank0" / "end.json")
    (run_dir / "manifest.json").unlink()
    (run_dir / "manifest.json").symlink_to("/dev/zero")
    run = load_run(run_dir)
    text = " | ".join(run.warnings)
    assert "a device, not a regular file" in text and "a FIFO, not a regular file" in text
    with pytest.raises(RunLoadError):
        load_run(tmp_path / "nothing")


# -- the control file (items 1 and 4) ------------------------------------------------------------
class _FakeProbe:
    """What ControlWatcher uses of a probe; applies requests at once, like a step boundary."""

    def __init__(self, run_dir: Path) -> None:
        import socket
        import time
        import types

        self.run_dir = run_dir
        rank_dir = run_dir / "rank0"
        _manifest(run_dir, world_size=1)
        _manifest(
            rank_dir,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            control={"file": "control.json", "poll_s": 0.02},
        )
        self.writer = types.SimpleNamespace(rank_dir=rank_dir)
        self.config = types.SimpleNamespace(control_poll_s=0.02)
        self.rank = 0
        self.created_unix = time.time()
        self.closed = False
        self.recording = False
        self.window = 0
        self.control_state: dict = {"seq": 0, "result": None, "step": 0}
        self.actions: list[str] = []
        self.events: list[tuple[str, dict]] = []

    def start_recording(self, steps=None, source="api", seq=0):
        self.actions.append("attach")
        result = "already recording" if self.recording else "recording"
        if not self.recording:
            self.window += 1
        self.recording = True
        self.control_state = {"seq": seq, "result": result, "step": 5}

    def stop_recording(self, source="api", seq=0):
        self.actions.append("detach")
        result = "stopped" if self.recording else "not recording"
        self.recording = False
        self.control_state = {"seq": seq, "result": result, "step": 6}

    def event(self, kind, /, **detail):
        self.events.append((kind, detail))


@pytest.fixture
def watched(tmp_path):
    from amprobe.control.watcher import ControlWatcher

    probe = _FakeProbe(tmp_path / "run")
    watcher = ControlWatcher(probe)
    watcher.start()
    yield probe
    probe.closed = True
    watcher.stop()
    watcher.join(timeout=5)
    assert not watcher.is_alive()


def _ack(probe: _FakeProbe) -> dict:
    try:
        return json.loads((probe.run_dir / "rank0" / "control_ack.json").read_text())
    except (OSError, ValueError):
        return {}


def _wait(predicate, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("how", ["delete", "empty"])
def test_request_after_the_control_file_was_deleted_or_emptied_is_applied(watched, how):
    from amprobe.control.sender import send_control

    assert send_control(watched.run_dir, "attach", wait_s=5).acknowledged
    control = watched.run_dir / "control.json"
    if how == "delete":
        control.unlink()
    else:
        control.write_text("")
    reply = send_control(watched.run_dir, "detach", wait_s=5)
    assert reply.acknowledged, reply.lines
    assert watched.actions == ["attach", "detach"]
    assert "stopped recording" in reply.lines[0]


def test_two_requests_at_once_are_both_applied(watched):
    import threading

    from amprobe.control.sender import send_control

    replies: list = []
    threads = [
        threading.Thread(
            target=lambda c=c: replies.append(send_control(watched.run_dir, c, wait_s=10))
        )
        for c in ("attach", "detach")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(replies) == 2 and all(r.acknowledged for r in replies), replies
    assert sorted(watched.actions) == ["attach", "detach"]


def test_cli_exits_non_zero_when_its_request_is_not_acknowledged(tmp_path, capsys):
    from amprobe.cli import main

    probe = _FakeProbe(tmp_path / "run")  # live (this pid) but nobody watches the control file
    (probe.run_dir / "rank0" / "control_ack.json").write_text(
        json.dumps({"seen": 3, "applied": 3, "result": "recording", "window": 1})
    )  # a stale acknowledgement from an earlier request
    code = main(["attach", str(probe.run_dir), "--wait", "0.3"])
    out = capsys.readouterr()
    assert code != 0
    assert "NOT acknowledged" in out.out and "did not acknowledge" in out.err
    assert json.loads((probe.run_dir / "control.json").read_text())["seq"] == 4


@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "big", "symlink_out"])
def test_control_file_that_is_not_a_small_regular_file_is_ignored(watched, tmp_path, kind):
    import resource

    from amprobe.control.sender import send_control

    control = watched.run_dir / "control.json"
    assert _wait(lambda: _ack(watched).get("pid"))
    if kind == "dev_zero":
        control.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(control)
    elif kind == "big":
        control.write_bytes(b" " * (10 << 20))
    else:
        outside = tmp_path / "outside.json"
        outside.write_text(json.dumps({"seq": 9, "id": "x", "command": "attach"}))
        control.symlink_to(outside)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert _wait(lambda: "control.json ignored" in (_ack(watched).get("ignored") or ""))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 50_000  # KiB
    assert watched.actions == []
    ignored = [e for e in watched.events if e[0] == "control_file_ignored"]
    assert len(ignored) == 1
    # the watcher is not stuck: a proper request (written atomically over it) is applied
    reply = send_control(watched.run_dir, "attach", wait_s=5)
    assert reply.acknowledged, reply.lines
    assert watched.actions == ["attach"]


def _request(seq: int, command: str = "attach") -> str:
    import time

    return json.dumps(
        {"seq": seq, "id": f"req-{seq}", "command": command, "issued_unix": time.time()}
    )


def test_half_written_control_file_is_read_again_not_reported(watched):
    """A writer that is not atomic (`echo ... > control.json`) is seen half-way: not an error."""
    import time

    control = watched.run_dir / "control.json"
    assert _wait(lambda: _ack(watched).get("pid"))
    text = _request(7)
    with open(control, "w") as fh:
        fh.write(text[:10])
        fh.flush()
        time.sleep(0.3)  # ~15 polls see the half-written file
        fh.write(text[10:])
    assert _wait(lambda: watched.actions == ["attach"])
    assert [e for e in watched.events if e[0] == "control_file_ignored"] == []
    assert _wait(lambda: _ack(watched).get("seen") == 7)
    assert _ack(watched)["ignored"] is None


def test_control_file_that_stays_invalid_is_reported_once(watched):
    import time

    from amprobe.control.watcher import SETTLE_S

    control = watched.run_dir / "control.json"
    assert _wait(lambda: _ack(watched).get("pid"))
    control.write_text('{"seq": 3, "comm')
    assert _wait(lambda: "not valid JSON" in (_ack(watched).get("ignored") or ""))
    time.sleep(0.2)  # more polls of the same file: still one event
    ignored = [e for e in watched.events if e[0] == "control_file_ignored"]
    assert ignored == [("control_file_ignored", {"reason": "not valid JSON"})]
    # reported only after it settled: the acknowledgement came no sooner than SETTLE_S later
    assert (
        os.stat(watched.run_dir / "rank0" / "control_ack.json").st_mtime - os.stat(control).st_mtime
        >= SETTLE_S - 0.05
    )


def test_control_file_growing_past_the_limit_is_one_problem(watched):
    control = watched.run_dir / "control.json"
    assert _wait(lambda: _ack(watched).get("pid"))
    for size in (100_000, 200_000, 300_000):
        control.write_bytes(b" " * size)
        assert _wait(lambda s=size: f"({s})" in (_ack(watched).get("ignored") or ""))
    ignored = [e for e in watched.events if e[0] == "control_file_ignored"]
    assert len(ignored) == 1 and ignored[0][1]["reason"].startswith("larger than"), ignored


# -- disk full: appends are idempotent, the clean close survives (item 5) ------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 400 KB tmpfs (needs mount rights: root in a container, skipped elsewhere)."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mount)],
        capture_output=True,
        timeout=30,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def _fill(path: Path) -> None:
    """Fill the file system of ``path`` (a ballast file) until writes fail with ENOSPC."""
    with open(path, "wb", buffering=0) as fh:
        block = b"\0" * 4096
        try:
            while True:
                fh.write(block)
        except OSError:
            pass
        try:
            while True:
                fh.write(b"\0")
        except OSError:
            pass


def _row(step: int) -> dict:
    return {
        "step": step,
        "window": 0,
        "t": step * 0.1,
        "wall_s": 0.01,
        "loss": 1.0,
        "pad": "x" * 200,
    }


def test_disk_full_then_freed_keeps_each_step_once(small_disk):
    from amprobe.store import RunWriter, load_run

    writer = RunWriter(small_disk / "run", 0, 1, {}, max_buffered_rows=10_000)
    ballast = small_disk / "ballast"
    for step in range(600):
        writer.append("steps", [_row(step)])
        if step % 25 == 24:
            writer.flush()
        if step == 200:
            _fill(ballast)  # disk full mid-run: flushes fail, partly written
        if step == 400:
            ballast.unlink()  # freed: the buffered rows are written again
    writer.close({"status": "finished", "steps": 600})
    run = load_run(small_disk / "run")
    assert list(run.steps["step"]) == list(range(600))
    assert not any("unreadable" in w or "repeated" in w for w in run.warnings), run.warnings


def test_disk_full_partial_write_is_truncated_back(tmp_path, monkeypatch):
    """The same without a mount: a write that stops part-way is undone before the retry."""
    import errno
    import io

    import amprobe.store.writer as writer_module
    from amprobe.store import RunWriter, load_run

    state = {"full": False}

    class _Half(io.FileIO):
        def write(self, data):
            if state["full"]:
                if len(data) > 10:
                    return super().write(bytes(data[: len(data) // 2]))
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(data)

    def fake_open(file, mode="r", *args, **kwargs):
        if "a" in mode:
            return _Half(file, mode.replace("b", ""))
        return open(file, mode, *args, **kwargs)

    monkeypatch.setattr(writer_module, "open", fake_open, raising=False)
    writer = RunWriter(tmp_path / "run", 0, 1, {}, max_buffered_rows=10_000)
    for step in range(90):
        writer.append("steps", [_row(step)])
        if step % 10 == 9:
            state["full"] = 30 <= step < 60
            writer.flush()
    state["full"] = False
    writer.close({"status": "finished", "steps": 90})
    run = load_run(tmp_path / "run")
    assert list(run.steps["step"]) == list(range(90))
    assert run.warnings == []


def test_disk_that_stays_full_keeps_the_events_tail_and_the_clean_close(small_disk):
    import amprobe
    from amprobe.store import RunWriter, load_run

    writer = RunWriter(small_disk / "run", 0, 1, {}, max_buffered_rows=500)
    writer.append("steps", [_row(s) for s in range(10)])
    writer.flush()
    _fill(small_disk / "ballast")
    for step in range(10, 1000):
        writer.append("steps", [_row(step)])
        writer.append("events", [{"step": step, "t": 0.0, "kind": "tick", "detail": "{}"}])
        writer.flush()
    writer.append("events", [{"step": 999, "t": 0.0, "kind": "run_end", "detail": "{}"}])
    writer.close({"status": "finished", "steps": 1000})
    run = load_run(small_disk / "run")
    assert run.status == "finished"  # end.json reached the disk
    assert run.events_of("run_end"), "the last event was lost"
    text = " | ".join(run.warnings)
    assert "could not be written" in text and "No space left on device" in text
    lost = run.ranks[0].end["lost_rows"]
    assert lost["steps"] > 900 and lost["steps"] + len(run.steps) == 1000
    assert run.steps["step"].is_unique
    shown = amprobe.diagnose(run).to_dict()["run"]["warnings"]
    assert any(f"{lost['steps']} steps record(s) could not be written" in w for w in shown)


# -- amprobe run: signals, exit statuses, orphans (items 2, 3) -----------------------------------
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

PACKAGE_PARENT = str(Path(__file__).resolve().parents[1])

#: The signals the tests below send to amprobe run and its job, by a terminal or by kill.
_SENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGTSTP)

#: The first lines of a job script: the job prints which of the signals the tests send it it was
#: started with ignored or blocked; the tests below expect none.
_REPORT_DISPOSITIONS = f"""
import signal as _signal
_sent = [_signal.Signals(n) for n in {[int(s) for s in _SENT_SIGNALS]}]
_ignored = [s.name for s in _sent if _signal.getsignal(s) == _signal.SIG_IGN]
_blocked = [s.name for s in _sent if s in _signal.pthread_sigmask(_signal.SIG_BLOCK, [])]
print(f"job started with ignored={{_ignored}} blocked={{_blocked}}", flush=True)
"""
_DEFAULT_DISPOSITIONS = "job started with ignored=[] blocked=[]"

#: A training job that saves a checkpoint on Ctrl-C: a second SIGINT during the save breaks it.
CHECKPOINT_SCRIPT = f"""{_REPORT_DISPOSITIONS}
import sys, time
try:
    print("ready", flush=True)
    time.sleep(30)
except KeyboardInterrupt:
    print("saving", flush=True)
    time.sleep(1.0)
    print("checkpoint saved", flush=True)
    sys.exit(0)
"""

SLEEPER_SCRIPT = f"""{_REPORT_DISPOSITIONS}
import os, signal, sys, time
if len(sys.argv) > 2 and sys.argv[2] == "hup-handler":
    signal.signal(signal.SIGHUP, lambda *a: (print("got SIGHUP", flush=True), sys.exit(0)))
if len(sys.argv) > 1 and sys.argv[1] != "-":
    open(sys.argv[1], "w").write(str(os.getpid()))
print("ready", flush=True)
time.sleep(30)
"""


def _amprobe_run_argv(out: Path, *command: str) -> list[str]:
    return [sys.executable, "-m", "amprobe", "run", "--out", str(out), "--", *command]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": PACKAGE_PARENT}


def _default_signals() -> None:
    """Run in a child before it execs amprobe run: give it, and so the job, which inherits them,
    the default disposition of each signal the tests send, unblocked.

    A test runner started under ``nohup`` or as a non-interactive shell's ``cmd &`` (as some CI
    runners are) ignores SIGHUP or SIGINT, and an ignored signal stays ignored through exec, on
    through amprobe run to the job, as it would without amprobe: the job would then sleep through
    the signal a test sends it. The tests must not depend on how their runner was started."""
    for sig in _SENT_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SENT_SIGNALS)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.wait(timeout=10)


def _read_until(stream, text: str, timeout: float = 60.0) -> str:
    import selectors

    seen = ""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        while text not in seen:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise AssertionError(f"timed out waiting for {text!r}; got {seen!r}")
            chunk = os.read(stream.fileno() if hasattr(stream, "fileno") else stream, 4096)
            if not chunk:
                raise AssertionError(f"stream closed before {text!r}; got {seen!r}")
            seen += chunk.decode(errors="replace")
    return seen


class _Fd:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


def _in_pty(argv: list[str], env: dict[str, str]) -> tuple[int, int]:
    """Start ``argv`` in a new session whose controlling terminal is a new pty: (pid, master)."""
    import pty

    pid, master = pty.fork()
    if pid == 0:
        try:
            _default_signals()
            os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)
    return pid, master


def _close_pty(pid: int, master: int) -> None:
    """Kill what is left of the pty's session and close its master side."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    os.close(master)


def _run_in_terminal(tmp_path: Path, script: str) -> tuple[int, str]:
    """Run ``amprobe run -- python script`` in a pseudo-terminal, press Ctrl-C once when the
    script is ready; return (exit status, everything printed)."""

    script_path = tmp_path / "job.py"
    script_path.write_text(script)
    argv = _amprobe_run_argv(tmp_path / "run", sys.executable, str(script_path))
    pid, master = _in_pty(argv, _env())  # a new session whose controlling terminal is the pty
    out = ""
    try:
        out += _read_until(_Fd(master), "ready", timeout=120)
        os.write(master, b"\x03")  # Ctrl-C: the line discipline signals the foreground group
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            try:
                import select

                if select.select([master], [], [], 0.1)[0]:
                    out += os.read(master, 4096).decode(errors="replace")
            except OSError:
                pass
            if done:
                return os.waitstatus_to_exitcode(status), out
        raise AssertionError(f"amprobe run did not exit; output {out!r}")
    finally:
        _close_pty(pid, master)


def test_ctrl_c_arrives_once(tmp_path):
    code, out = _run_in_terminal(tmp_path, CHECKPOINT_SCRIPT)
    assert _DEFAULT_DISPOSITIONS in out, out
    assert "checkpoint saved" in out, out
    assert code == 0, out


def test_uncaught_keyboard_interrupt_exits_130(tmp_path):
    code, out = _run_in_terminal(tmp_path, SLEEPER_SCRIPT)
    assert _DEFAULT_DISPOSITIONS in out, out
    assert code == 130, out


@pytest.mark.parametrize(("sig", "expected"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_signals_to_amprobe_run_reach_the_child_and_its_status_passes_through(
    tmp_path, sig, expected
):
    script = tmp_path / "job.py"
    script.write_text(SLEEPER_SCRIPT)
    proc = subprocess.Popen(
        _amprobe_run_argv(tmp_path / "run", sys.executable, str(script)),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_env(),
        start_new_session=True,
        preexec_fn=_default_signals,
    )
    try:
        out = _read_until(proc.stdout, "ready", timeout=120)
        assert _DEFAULT_DISPOSITIONS in out, out
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == expected
    finally:
        _kill_group(proc)
        proc.stdout.close()


def test_sighup_is_delivered_to_a_child_that_handles_it(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SLEEPER_SCRIPT)
    proc = subprocess.Popen(
        _amprobe_run_argv(tmp_path / "run", sys.executable, str(script), "-", "hup-handler"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_env(),
        start_new_session=True,
        preexec_fn=_default_signals,
    )
    try:
        out = _read_until(proc.stdout, "ready", timeout=120)
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=60) == 0
        out += proc.stdout.read().decode()
        assert out.count("got SIGHUP") == 1
    finally:
        _kill_group(proc)
        proc.stdout.close()


def _ignore_sigint_and_sighup() -> None:
    """What ``nohup`` (SIGHUP) and a non-interactive shell's ``cmd &`` (SIGINT) do to a command
    before they exec it, as some CI runners are started."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def test_amprobe_run_passes_ignored_signals_on_to_the_job_as_a_plain_launch_does(tmp_path):
    """An ignored disposition is the launcher's choice (``nohup``): the job inherits it through
    amprobe run as it would were it started without amprobe."""
    job = _REPORT_DISPOSITIONS
    done = subprocess.run(
        _amprobe_run_argv(tmp_path / "run", sys.executable, "-c", job),
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        start_new_session=True,
        preexec_fn=_ignore_sigint_and_sighup,
    )
    assert done.returncode == 0, done.stderr
    plain = subprocess.run(
        [sys.executable, "-c", job],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_ignore_sigint_and_sighup,
    )
    expected = "job started with ignored=['SIGINT', 'SIGHUP'] blocked=[]"
    assert expected in plain.stdout, plain.stdout
    assert expected in done.stdout, done.stdout


#: The tests above that send a signal the job leaves at its default disposition.
_DEFAULT_DISPOSITION_TESTS = (
    "test_ctrl_c_arrives_once",
    "test_uncaught_keyboard_interrupt_exits_130",
    "test_signals_to_amprobe_run_reach_the_child_and_its_status_passes_through",
)


@pytest.mark.slow
def test_signal_tests_pass_when_pytest_starts_with_sigint_and_sighup_ignored(tmp_path):
    """The signal tests do not depend on how their runner was started: run under ``nohup`` or as
    a non-interactive shell's ``cmd &``, they still pass (the job slept through the signal)."""
    here = Path(__file__).resolve()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--basetemp",
            str(tmp_path / "inner"),  # not the outer run's numbered folders
            *(f"{here}::{name}" for name in _DEFAULT_DISPOSITION_TESTS),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=PACKAGE_PARENT,
        env=_env(),
        start_new_session=True,
        preexec_fn=_ignore_sigint_and_sighup,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "4 passed" in done.stdout, done.stdout[-6000:]


#: A job whose handler for the signal named in argv[1] counts deliveries and takes a while, as a
#: checkpoint save would; it prints the count once a second delivery has had time to arrive.
COUNTING_SCRIPT = """
import signal, sys, time
count = 0
def save(signum, frame):
    global count
    count += 1
    time.sleep(0.5)
signal.signal(getattr(signal, sys.argv[1]), save)
print("ready", flush=True)
for _ in range(600):
    if count:
        break
    time.sleep(0.05)
time.sleep(1.0)
print(f"deliveries {count}", flush=True)
"""


def _deliveries(tmp_path: Path, sig: signal.Signals, how: str) -> tuple[int, str]:
    """Run ``amprobe run -- python COUNTING_SCRIPT``, send ``sig`` once the job is ready, the way
    ``how`` says; return (exit status, everything printed).

    ``how``: "ctrl-c" (a pseudo-terminal's Ctrl-C), "terminal-group" (the signal sent to the
    process group of amprobe run, the terminal's foreground job, as ``kill -INT %1`` does),
    "group" (to amprobe's process group with no terminal: CI runners, scancel), "timeout" (to
    amprobe's process, then at once to its group, as ``timeout -s SIG`` does) or "alone" (to
    amprobe's process only)."""
    script = tmp_path / "job.py"
    script.write_text(COUNTING_SCRIPT)
    argv = _amprobe_run_argv(tmp_path / "run", sys.executable, str(script), sig.name)
    if how in ("ctrl-c", "terminal-group"):
        pid, master = _in_pty(argv, _env())  # a new session; its foreground is the pty's
        out = ""
        try:
            out += _read_until(_Fd(master), "ready", timeout=120)
            if how == "ctrl-c":
                os.write(master, b"\x03")  # the line discipline signals the foreground group
            else:
                os.killpg(pid, sig)
            out += _read_until(_Fd(master), "deliveries", timeout=60)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status), out
        finally:
            _close_pty(pid, master)
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_env(),
        start_new_session=True,  # no controlling terminal
        preexec_fn=_default_signals,
    )
    try:
        out = _read_until(proc.stdout, "ready", timeout=120)
        if how == "group":
            os.killpg(proc.pid, sig)
        elif how == "timeout":  # what `timeout -s SIG` does: to its child, then to its group
            proc.send_signal(sig)
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        code = proc.wait(timeout=60)
        return code, out + proc.stdout.read().decode()
    finally:
        _kill_group(proc)
        proc.stdout.close()


@pytest.mark.parametrize(
    ("sig", "how"),
    [
        (signal.SIGINT, "ctrl-c"),
        (signal.SIGINT, "terminal-group"),
        (signal.SIGINT, "group"),
        (signal.SIGINT, "timeout"),
        (signal.SIGINT, "alone"),
        (signal.SIGTERM, "terminal-group"),
        (signal.SIGTERM, "group"),
        (signal.SIGTERM, "timeout"),
        (signal.SIGTERM, "alone"),
    ],
)
def test_a_signal_reaches_the_job_exactly_once(tmp_path, sig, how):
    code, out = _deliveries(tmp_path, sig, how)
    assert "deliveries 1" in out, out
    assert code == 0, out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash for its job control")
def test_ctrl_z_stops_the_job_and_fg_resumes_it(tmp_path):
    """The job in a process group of its own still stops with Ctrl-Z and resumes with `fg`, as in
    an interactive shell without amprobe; the Ctrl-C after it reaches the job once."""

    script = tmp_path / "job.py"
    script.write_text(COUNTING_SCRIPT)
    argv = _amprobe_run_argv(tmp_path / "run", sys.executable, str(script), "SIGINT")
    env = {**_env(), "PS1": "prompt$ ", "TERM": "dumb"}
    pid, master = _in_pty(["bash", "--norc", "--noprofile", "-i"], env)
    try:

        def until(after: str, text: str) -> str:  # read to `text` printed after `after`
            seen = _read_until(_Fd(master), after, timeout=60)
            if text not in seen.split(after, 1)[1]:
                seen += _read_until(_Fd(master), text, timeout=60)
            return seen

        _read_until(_Fd(master), "prompt$ ", timeout=30)
        command = " ".join(f"'{arg}'" for arg in argv)
        os.write(master, f"{command}\r".encode())
        _read_until(_Fd(master), "ready", timeout=120)
        os.write(master, b"\x1a")  # Ctrl-Z
        until("Stopped", "prompt$ ")
        os.write(master, b"fg\r")
        time.sleep(0.5)  # let the job run on before it is interrupted
        os.write(master, b"\x03")  # Ctrl-C
        out = until("deliveries", "prompt$ ")
        os.write(master, b"echo status=$?\r")
        out += until("status=", "prompt$ ")
        assert "deliveries 1" in out, out
        assert "status=0" in out, out
    finally:
        _close_pty(pid, master)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_child_does_not_outlive_a_killed_amprobe_run(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SLEEPER_SCRIPT)
    pid_file = tmp_path / "child.pid"
    proc = subprocess.Popen(
        _amprobe_run_argv(tmp_path / "run", sys.executable, str(script), str(pid_file)),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_env(),
        start_new_session=True,
        preexec_fn=_default_signals,
    )
    child = None
    try:
        _read_until(proc.stdout, "ready", timeout=120)
        child = int(pid_file.read_text())
        proc.kill()  # SIGKILL: amprobe run cannot forward anything
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child), "the job kept running as an orphan"
    finally:
        _kill_group(proc)
        if child is not None and not _gone(child):
            os.kill(child, signal.SIGKILL)
        proc.stdout.close()


# -- --out, --overwrite, a command that cannot start, a busy port (items 7, 10, 11) --------------
def test_overwrite_never_empties_a_folder_that_is_not_an_amprobe_run(tmp_path, capsys):
    from amprobe.cli import main

    foreign = tmp_path / "extension"
    foreign.mkdir()
    (foreign / "manifest.json").write_text(json.dumps({"manifest_version": 3}))
    (foreign / "background.js").write_text("// keep me")
    code = main(["run", "--overwrite", "--out", str(foreign), "--", sys.executable, "-c", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "not an amprobe run" in err and len(err.strip().splitlines()) == 1
    assert (foreign / "background.js").read_text() == "// keep me"
    assert (foreign / "manifest.json").exists()


def test_in_process_writer_never_overwrites_a_foreign_manifest(tmp_path):
    from amprobe.store import RunWriter

    foreign = tmp_path / "app"
    (foreign / "rank0").mkdir(parents=True)
    (foreign / "rank0" / "manifest.json").write_text("{}")
    (foreign / "rank0" / "data.bin").write_text("keep")
    with pytest.raises(StoreError, match="not an amprobe run"):
        RunWriter(foreign, 0, 1, {}, max_buffered_rows=10, overwrite=True)
    assert (foreign / "rank0" / "data.bin").read_text() == "keep"


def test_overwrite_replaces_an_amprobe_run(tmp_path):
    from amprobe.control.launcher import prepare_run_dir

    old = _write_run(tmp_path / "run")
    prepare_run_dir(old, overwrite=True)
    assert old.is_dir() and not any(old.iterdir())


def test_command_that_cannot_start_leaves_no_run_directory(tmp_path, capsys):
    from amprobe.cli import main

    out = tmp_path / "runs" / "today" / "run"
    code = main(["run", "--out", str(out), "--", str(tmp_path / "no-such-command")])
    assert code == 2 and "command not found" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.fixture
def read_only_dir(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)],
        capture_output=True,
        timeout=30,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def test_read_only_out_fails_at_start_before_the_child(read_only_dir, tmp_path, capsys):
    from amprobe.cli import main

    marker = tmp_path / "child-ran"
    code = main(
        [
            "run",
            "--out",
            str(read_only_dir),
            "--",
            sys.executable,
            "-c",
            f"open({str(marker)!r}, 'w')",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Read-only file system" in err
    assert not marker.exists()
    with pytest.raises(StoreError, match="Read-only file system"):
        check_writable(read_only_dir / "run")


def test_unwritable_out_below_a_file_fails_at_start(tmp_path, capsys):
    from amprobe.cli import main

    (tmp_path / "file").write_text("x")
    code = main(["run", "--out", str(tmp_path / "file" / "run"), "--", sys.executable, "-c", "0"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--out" in err


def test_busy_prometheus_port_is_said_at_start(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "amprobe",
                "run",
                "--prometheus-port",
                str(port),
                "--out",
                str(tmp_path / "run"),
                "--",
                sys.executable,
                "-c",
                "print('child ran')",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=_env(),
        )
    assert "child ran" in done.stdout
    first = done.stderr.strip().splitlines()[0]
    assert f"cannot serve Prometheus metrics on 127.0.0.1:{port}" in first


def test_diagnose_shows_a_collector_that_was_switched_off(tmp_path, capsys):
    from amprobe.cli import main
    from amprobe.store import RunWriter

    writer = RunWriter(tmp_path / "run", 0, 1, {}, max_buffered_rows=100)
    writer.append("steps", [_row(s) for s in range(5)])
    detail = {
        "collector": "prometheus",
        "error": "ConfigError: cannot serve Prometheus metrics on 127.0.0.1:9400: "
        "Address already in use",
        "where": "prometheus.py:140",
    }
    writer.append(
        "events", [{"step": 0, "t": 0.0, "kind": "collector_error", "detail": json.dumps(detail)}]
    )
    writer.close({"status": "finished", "steps": 5})
    assert main(["diagnose", str(tmp_path / "run"), "--format", "json"]) == 0
    out = capsys.readouterr()
    assert "collector 'prometheus' was switched off" in out.err
    warnings = json.loads(out.out)["run"]["warnings"]
    assert any("Address already in use" in w for w in warnings)
