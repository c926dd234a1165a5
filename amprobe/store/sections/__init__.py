"""The per-rank summary's sections (:mod:`amprobe.store.summary`), one module per kind of fact.

Importing this package registers them all; the writer and the reader import it before they
build an :class:`~amprobe.store.summary.Accumulator`.
"""

from __future__ import annotations

from amprobe.store.sections import (
    numerics,  # noqa: F401
    runtime,  # noqa: F401
    scaler,  # noqa: F401
    tables,  # noqa: F401
)
