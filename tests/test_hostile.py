"""Hostile input never hurts the job or lies: control file, signals, disk faults, corrupt runs.

One test (or a few) per item of issue 16; each reproduces the case that was wrong before.
Tests that spawn processes are bounded in time and kill what they started.
"""

from __future__ import annotations

import json
import os
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
    from amprobe.store import load_run, loader

    monkeypatch.setattr(loader, "MAX_RECORD_BYTES", 1000)
    monkeypatch.setattr(loader, "READ_CHUNK_BYTES", 4096)
    run_dir = _write_run(tmp_path / "run")
    path = run_dir / "rank0" / "steps.jsonl"
    good = path.read_bytes()
    huge = b'{"step": 99, "pad": "' + b"x" * 50_000 + b'"}\n'
    path.write_bytes(good + huge + good.replace(b'"window": 0', b'"window": 1'))
    run = load_run(run_dir)
    assert len(run.steps) == 24
    assert any("1 record(s) longer than 1000 bytes skipped" in w for w in run.warnings)


def test_unterminated_oversize_tail_is_not_reread(tmp_path, monkeypatch):
    from amprobe.store import loader, read_table

    monkeypatch.setattr(loader, "MAX_RECORD_BYTES", 1000)
    monkeypatch.setattr(loader, "READ_CHUNK_BYTES", 4096)
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
