"""The runtime profile: data-loader wait, GPU utilization, host-device sync sites."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from amprobe.store.loader import Run

__all__ = [
    "column",
    "compute_data_wait",
    "compute_gpu_util",
    "compute_sync_sites",
    "gpu_unavailable_reason",
    "training_samples",
]


def column(frame: pd.DataFrame, name: str) -> pd.Series:
    return frame[name] if name in frame else pd.Series([], dtype="float64")


def gpu_unavailable_reason(run: Run) -> str | None:
    """Why the run has no GPU samples (from the sampler's events), or None if it has some."""
    gpu = run.table("gpu")
    if len(gpu) and column(gpu, "gpu_util").notna().any():
        return None
    notes = run.events_of("gpu_sampler")
    for note in notes:
        if note.get("status") in ("not available", "not sampled", "stopped") and note.get("reason"):
            return str(note["reason"])
    if notes:
        return "the GPU sampler recorded no utilization sample"
    return "the GPU sampler did not run (runtime collector off or gpu_sample_hz=0)"


def training_samples(gpu: pd.DataFrame, skip_steps: int) -> pd.DataFrame:
    """GPU samples taken while training ran, after the first ``skip_steps`` steps (warm-up)."""
    if gpu.empty:
        return gpu
    return gpu[gpu["step"] >= skip_steps]


def compute_data_wait(steps: pd.DataFrame, skip_steps: int) -> dict[str, Any] | None:
    """Data-wait share of one rank's steps: sum(data_wait_s) / sum(wall_s), warm-up skipped.

    Steps whose syncs were counted are left out (the dispatch mode inflates their time) unless
    no other step is left.
    """
    # the rows kept, as positions: three masked copies of the steps table cost more than the
    # arithmetic; the sums and medians are taken on the same values, in the same order
    rows = np.flatnonzero((steps["data_wait_s"].notna() & steps["wall_s"].notna()).to_numpy())
    if len(rows):
        step = steps["step"].iloc[rows]
        rows = rows[(step >= step.min() + skip_steps).to_numpy()]
    sampled = steps["syncs_sampled"].iloc[rows].fillna(False).astype(bool).to_numpy()
    if not sampled.all():
        rows = rows[~sampled]
    walls = steps["wall_s"].iloc[rows]
    wall = float(walls.sum())
    if not len(rows) or wall <= 0:
        return None
    waits = steps["data_wait_s"].iloc[rows]
    return {
        "data_wait_share": float(waits.sum()) / wall,
        "data_wait_s_median": float(waits.median()),
        "wall_s_median": float(walls.median()),
        "measured_step_count": int(len(rows)),
    }


def compute_gpu_util(gpu: pd.DataFrame, skip_steps: int) -> dict[str, Any] | None:
    """Median NVML GPU utilization of one rank's training-time samples."""
    samples = training_samples(gpu, skip_steps)
    util = column(samples, "gpu_util").dropna()
    if not len(util):
        return None
    return {"gpu_util_median": float(util.median()), "gpu_sample_count": int(len(util))}


def compute_sync_sites(syncs: pd.DataFrame, sampled_steps: int, kind: str = "user") -> pd.DataFrame:
    """Syncs per sampled step by source line and op, most frequent first."""
    rows = syncs[syncs["kind"] == kind] if len(syncs) else syncs
    if rows.empty or sampled_steps <= 0:
        return pd.DataFrame(columns=["site", "op", "per_step", "total"])
    grouped = rows.groupby(["site", "op"], as_index=False)["count"].sum()
    grouped = grouped.rename(columns={"count": "total"})
    grouped["per_step"] = grouped["total"] / sampled_steps
    return grouped.sort_values(["total", "site"], ascending=[False, True])[
        ["site", "op", "per_step", "total"]
    ].reset_index(drop=True)
