"""Run store: the run directory's schema, its crash-safe writer and its loader."""

from amprobe.store.loader import RankInfo, Run, RunLoadError, load_run, read_table
from amprobe.store.schema import SCHEMA_VERSION, TABLES
from amprobe.store.writer import RunWriter

__all__ = [
    "SCHEMA_VERSION",
    "TABLES",
    "RankInfo",
    "Run",
    "RunLoadError",
    "RunWriter",
    "load_run",
    "read_table",
]
