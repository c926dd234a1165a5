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
