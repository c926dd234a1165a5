"""Run store: the run directory's layout and schema, its crash-safe writer and its loader.

The store imports nothing else of amprobe's (no config, no capture code): it raises its own
:class:`StoreError` (a ``ValueError``) for a run directory that cannot be written.

``import amprobe.store`` loads the layout only (the standard library). The names of the
loader (``load_run``, ``Run``, ``read_table``, ``RankInfo``: pandas), of the schema
(``SCHEMA_VERSION``, ``TABLES``: pyarrow) and of the writer (``RunWriter``) load with their
module on first use (PEP 562's module ``__getattr__``): the capture side, which imports the
writer and the fields of this package, never loads pandas, and a command that only looks at a
run directory's layout loads neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from amprobe.lazy import lazy_names
from amprobe.store.layout import (
    NotRegularFileError,
    RunLoadError,
    StoreError,
    check_writable,
    is_live,
    is_run_dir,
    list_ranks,
    list_runs,
    parse_rank_dirname,
)

if TYPE_CHECKING:
    from amprobe.store import derived as derived
    from amprobe.store.loader import RankInfo, Run, load_run, read_table
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

#: public names -> the module that defines them (imported on first access)
_LAZY = {
    "RankInfo": "amprobe.store.loader",
    "Run": "amprobe.store.loader",
    "load_run": "amprobe.store.loader",
    "read_table": "amprobe.store.loader",
    "SCHEMA_VERSION": "amprobe.store.schema",
    "TABLES": "amprobe.store.schema",
    "RunWriter": "amprobe.store.writer",
}
#: the package's modules, as attributes (``amprobe.store.schema`` once ``amprobe.store`` is
#: imported, as when this file imported them all)
_SUBMODULES = ("derived", "fields", "layout", "loader", "schema", "writer")


__getattr__, __dir__ = lazy_names(__name__, _LAZY, _SUBMODULES, globals())
