"""Where amprobe keeps files it derives from a run: ``RUN/derived/`` when the run folder can
be written, else a folder of the user cache keyed by the run (issue #33).

The standard library only: the loader asks here for its small caches (the checksum
verdicts of :mod:`amprobe.store.integrity`) without loading the derived store's engine;
:mod:`amprobe.store.derived` puts its Parquet files in the same folder.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["DERIVED_DIR", "cache_dir", "cache_key", "writable", "derived_folder"]

#: The folder of the derived files in a run directory (never read as a rank: not ``rank<N>``).
DERIVED_DIR = "derived"


def cache_dir() -> Path:
    """The user cache of amprobe: ``$XDG_CACHE_HOME/amprobe`` (``~/.cache/amprobe``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "amprobe"


def cache_key(run_path: Path, manifest: Mapping[str, Any]) -> str:
    """The user cache's name for a run: a hash of its resolved path and its run manifest's
    ``created_unix``."""
    created = manifest.get("created_unix")
    text = f"{run_path.resolve()}\0{created!r}"
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:24]


def writable(folder: Path) -> bool:
    """Whether derived files can be written in ``folder`` (created if missing): tried, not
    guessed from permission bits (root ignores them; a read-only mount does not)."""
    try:
        folder.mkdir(exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError:
        return False
    return True


def derived_folder(run_path: Path, manifest: Mapping[str, Any]) -> Path:
    """``RUN/derived/`` if it can be written, else the run's folder in the user cache
    (``$XDG_CACHE_HOME/amprobe/derived/<key>``, not created here)."""
    folder = run_path / DERIVED_DIR
    if writable(folder):
        return folder
    return cache_dir() / DERIVED_DIR / cache_key(run_path, manifest)
