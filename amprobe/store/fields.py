"""The columns of the ``steps`` table, declared once as data: name, type, units, meaning, owner.

Each collector points its ``fields`` class attribute at its own rows of this table
(:func:`fields_of`); the store's schema (:data:`amprobe.store.schema.TABLES`) and the
documentation in README.md are derived from it. A column a collector writes that is not declared
here is reported by the probe (``undeclared_field`` event) and fails the test suite.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

__all__ = ["Field", "STEP_FIELDS", "fields_of", "steps_schema"]


@dataclass(frozen=True)
class Field:
    """One column of the ``steps`` table.

    Attributes:
        name: column name.
        type: arrow type the loader reads it as.
        units: unit of the value ("s", "bytes", "count", "" for flags and labels).
        meaning: one line for the documentation.
        owner: the collector that writes it (``probe`` for the probe's own columns).
    """

    name: str
    type: pa.DataType
    units: str
    meaning: str
    owner: str


def _f(owner: str, rows: list[tuple[str, pa.DataType, str, str]]) -> tuple[Field, ...]:
    return tuple(Field(name, typ, units, meaning, owner) for name, typ, units, meaning in rows)


STEP_FIELDS: tuple[Field, ...] = (
    *_f(
        "probe",
        [
            ("step", pa.int64(), "count", "iteration index from 0; skipped iterations count"),
            ("window", pa.int64(), "count", "recording window (attach/detach); 0 in a plain run"),
            ("t", pa.float64(), "s", "seconds since the rank's start, at the end of the step"),
            ("wall_s", pa.float64(), "s", "user time of the step, the probe's own time excluded"),
            ("probe_s", pa.float64(), "s", "time the probe itself spent during the step"),
        ],
    ),
    *_f(
        "scaler",
        [
            ("scaler_enabled", pa.bool_(), "", "a GradScaler owned the step and was enabled"),
            ("scale_before", pa.float64(), "", "loss scale used for this step's backward"),
            ("scale_after", pa.float64(), "", "loss scale after update()"),
            ("growth_tracker", pa.float64(), "count", "consecutive unskipped steps after update()"),
            (
                "found_inf",
                pa.float64(),
                "count",
                "inf/NaN checks that fired (optimizers x devices)",
            ),
            ("skipped", pa.bool_(), "", "the optimizer update was not applied"),
            ("opt_steps", pa.int64(), "count", "optimizer.step() calls that actually ran"),
            ("unscale_calls", pa.int64(), "count", "GradScaler.unscale_ calls"),
            ("clip_calls", pa.int64(), "count", "clip_grad_norm_/clip_grad_value_ calls"),
            ("clip_scaled", pa.int64(), "count", "clip calls on gradients still scaled"),
            ("loss", pa.float64(), "", "sum of the scalar losses backpropagated in the step"),
            ("loss_dtype", pa.string(), "", "dtype of the loss"),
            ("autocast_device", pa.string(), "", "device type of the last autocast region"),
            ("autocast_dtype", pa.string(), "", "dtype of the last enabled autocast region"),
        ],
    ),
    *_f(
        "numerics",
        [
            ("input_nonfinite", pa.int64(), "count", "non-finite elements in root model inputs"),
            ("loss_nonfinite", pa.bool_(), "", "the loss was inf/NaN"),
            ("numerics_sampled", pa.bool_(), "", "per-layer numerics were captured on this step"),
        ],
    ),
    *_f(
        "runtime",
        [
            ("data_wait_s", pa.float64(), "s", "time inside DataLoader __next__ (probe excluded)"),
            ("batches", pa.int64(), "count", "batches fetched during the step"),
            ("fwd_s", pa.float64(), "s", "root models' forward, host time"),
            ("bwd_s", pa.float64(), "s", "backward, host time"),
            (
                "opt_s",
                pa.float64(),
                "s",
                "optimizer.step, host time, nested forward/backward excluded",
            ),
            (
                "peak_mem_bytes",
                pa.int64(),
                "bytes",
                "CUDA peak allocated memory (see reset_peak_memory)",
            ),
            ("rss_bytes", pa.int64(), "bytes", "host resident set size at the end of the step"),
            ("syncs_sampled", pa.bool_(), "", "host-device syncs were counted on this step"),
            ("syncs", pa.int64(), "count", "synchronizing ops issued by user code (sampled steps)"),
        ],
    ),
    *_f(
        "compile",
        [
            (
                "compile_frames",
                pa.int64(),
                "count",
                "frames torch.compile compiled during the step",
            ),
            ("compile_graphs", pa.int64(), "count", "new compiled graphs during the step"),
            ("graph_breaks", pa.int64(), "count", "graph breaks met while compiling in the step"),
            ("recompiles", pa.int64(), "count", "recompilations of already compiled frames"),
        ],
    ),
)


def fields_of(owner: str) -> tuple[Field, ...]:
    """The ``steps`` columns written by ``owner``."""
    return tuple(f for f in STEP_FIELDS if f.owner == owner)


def steps_schema() -> dict[str, pa.DataType]:
    """Column name -> arrow type of the ``steps`` table."""
    return {f.name: f.type for f in STEP_FIELDS}
