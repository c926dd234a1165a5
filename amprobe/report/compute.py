"""Compute section: the executed GEMM/conv/attention ops with Tensor Core alignment, and autocast coverage."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from amprobe.analysis.compute import (
    alignment_frame,
    autocast_coverage,
    fp32_modules,
    latest_alignment,
    latest_capture,
)
from amprobe.report.registry import Section, section

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from amprobe.rules.engine import Diagnosis
    from amprobe.store.loader import Run


__all__ = ["make_op_table", "make_coverage_figure"]

MAX_ROWS = 200  # display only; the run keeps every op


def _shape(row: dict) -> str:
    if row.get("cin") is not None and not pd.isna(row.get("cin")):
        return f"N={row['batch']} Cin={row['cin']} Cout={row['cout']} k={row['kernel']}"
    text = f"M={row['m']} N={row['n']} K={row['k']}"
    if row.get("batch") is not None and not pd.isna(row.get("batch")):
        text = f"B={row['batch']} " + text
    return text


def make_op_table(ops: pd.DataFrame, tf32: bool = False) -> pd.DataFrame:
    """One row per op of a captured step, sorted by FLOP share (largest first).

    ``ops`` may already carry the columns of :func:`~amprobe.analysis.compute.alignment_frame`
    (as :func:`~amprobe.analysis.compute.latest_alignment` returns them); else they are added.

    Columns: module, op, phase, shapes, dtype (in -> out), calls, FLOP share, aligned?
    (yes / no / n/a when Tensor Cores do not apply), suggested size (padded dims, and tile
    rounding for small dims).
    """
    if ops.empty:
        return pd.DataFrame(
            columns=[
                "module",
                "op",
                "phase",
                "shapes",
                "dtype",
                "calls",
                "FLOP share",
                "aligned?",
                "suggested size",
            ]
        )
    aligned = ops if "aligned" in ops.columns else alignment_frame(ops, tf32=tf32)
    frame = aligned.sort_values("flop_share", ascending=False)
    rows = []
    for row in frame.to_dict("records"):
        suggestion = ", ".join(
            f"{row['misaligned'][d]} -> {v}" for d, v in row["suggested"].items()
        )
        if row["tile_waste"]:
            tiles = ", ".join(f"{v} -> {p} (tile)" for v, p in row["tile_waste"].items())
            suggestion = f"{suggestion}; {tiles}" if suggestion else tiles
        rows.append(
            {
                "module": row["module"],
                "op": row["op"],
                "phase": row["phase"],
                "shapes": _shape(row),
                "dtype": f"{row['in_dtype']} -> {row['out_dtype']}",
                "calls": int(row["count"]),
                "FLOP share": round(float(row["flop_share"]), 4),
                "aligned?": "n/a"
                if row["aligned"] is None
                else ("yes" if row["aligned"] else "no"),
                "suggested size": suggestion,
            }
        )
    return pd.DataFrame(rows)


def make_coverage_figure(coverage: pd.DataFrame) -> go.Figure:
    """Share of matmul/conv/attention FLOPs per operand dtype, one bar per rank.

    Args:
        coverage: from :func:`amprobe.analysis.compute.autocast_coverage` (``rank``, ``in_dtype``,
            ``share``).
    """
    import plotly.graph_objects as go  # plotly loads only when a figure is made

    fig = go.Figure()
    for dtype, part in coverage.groupby("in_dtype", sort=False):
        fig.add_trace(
            go.Bar(x=[f"rank {r}" for r in part["rank"]], y=part["share"] * 100, name=str(dtype))
        )
    fig.update_layout(
        barmode="stack",
        height=320,
        yaxis_title="% of matmul FLOPs",
        title="autocast coverage: matmul FLOPs by operand dtype",
        margin={"l": 50, "r": 20, "t": 50, "b": 40},
    )
    return fig


@section("compute", order=40, tab="Tensor Cores")
def build_compute_section(run: Run, diagnosis: Diagnosis) -> Section:
    title = "Compute: GEMM shapes, Tensor Core alignment, autocast coverage"
    ops, steps = latest_capture(run)
    if steps.empty:
        collectors = (run.rank_manifest.get("config") or {}).get("collectors") or []
        why = (
            'the compute collector was not enabled (add "compute" to Config.collectors)'
            if "compute" not in collectors
            else "no step was captured (first capture is at step 1)"
        )
        return Section("compute", title, missing=why)
    tf32 = bool(steps["tf32"].fillna(False).any())
    rank0 = int(steps["rank"].min())
    mine = ops[ops["rank"] == rank0]
    row = steps[steps["rank"] == rank0].iloc[0]
    alignment = latest_alignment(run, tf32=tf32)
    table = make_op_table(alignment[alignment["rank"] == rank0], tf32=tf32)
    text = [
        f"Captured step {int(row['step'])} (rank {rank0}): {float(row['matmul_flops']):.3g} matmul/conv/attention "
        f"FLOPs in {int(row['matmul_ops'])} calls; other ops moved {float(row['other_bytes']):.3g} bytes "
        f"in {int(row['other_ops'])} calls (optimizer: {float(row['optimizer_bytes']):.3g} bytes).",
    ]
    mfu = diagnosis.health.get("mfu", {})
    if mfu.get("value") is not None:
        text.append(
            f"MFU {mfu['value']:.1%} on {mfu.get('device')} "
            f"({mfu['achieved_flops_per_s'] / 1e12:.3g} TFLOP/s achieved)."
        )
    elif mfu.get("note"):
        text.append(str(mfu["note"]))
    tables = [("Executed matmul/conv/attention ops, by FLOP share", table.head(MAX_ROWS))]
    stayed = fp32_modules(mine)
    if len(stayed):
        tables.append(
            (
                "Modules that ran fp32 matmuls, and why",
                stayed.drop(columns=["rank"]).assign(flop_share=lambda f: f["flop_share"].round(4)),
            )
        )
    return Section(
        "compute",
        title,
        figures=(make_coverage_figure(autocast_coverage(ops)),),
        tables=tuple(tables),
        text=tuple(text),
    )
