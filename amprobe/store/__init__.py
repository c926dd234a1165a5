"""Run store: the run directory's layout and schema, its crash-safe writer and its loader.

The store imports nothing else of amprobe's (no config, no capture code): it raises its own
:class:`StoreError` (a ``ValueError``) for a run directory that cannot be written.
"""

from amprobe.store.layout import (
    NotRegularFileError,
    StoreError,
    check_writable,
    is_live,
    is_run_dir,
    list_ranks,
    list_runs,
    parse_rank_dirname,
)
from amprobe.store.loader import RankInfo, Run, RunLoadError, load_run, read_table
from amprobe.store.schema import SCHEMA_VERSION, TABLES
from amprobe.store.writer import RunWriter

__all__ = [
    "SCHEMA_VERSION",
    "TABLES",
    "NotRegularFileError",
    "RankInfo",
    "Run",
    "RunLoadError",
    "RunWriter",
    "StoreError",
    "check_writable",
    "is_live",
    "is_run_dir",
    "list_ranks",
    "list_runs",
    "load_run",
    "parse_rank_dirname",
    "read_table",
]
