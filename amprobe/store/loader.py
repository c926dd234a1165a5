"""Load a run directory into typed pandas frames.

The code lives in :mod:`amprobe.store.run` (:func:`load_run`, :class:`Run`) and
:mod:`amprobe.store.jsonl` (:func:`read_table`); this module re-exports both for the callers
that import it, for one release.
"""

from __future__ import annotations

from amprobe.store.jsonl import empty_frame, read_table
from amprobe.store.run import NewerSchemaError, RankInfo, Run, RunLoadError, load_run

__all__ = [
    "Run",
    "RankInfo",
    "RunLoadError",
    "NewerSchemaError",
    "load_run",
    "read_table",
    "empty_frame",
]
