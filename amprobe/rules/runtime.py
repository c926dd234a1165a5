"""Rules on the runtime profile: input-bound steps, host-device syncs, idle Tensor Cores (B)."""

from __future__ import annotations

from typing import Any

from amprobe.analysis.frames import MAX_LISTED_STEPS, section_keys
from amprobe.analysis.runtime import (
    column,
    compute_gpu_util,
    compute_sync_sites,
    expand_steps,
    gpu_unavailable_reason,
    rank_runtime,
    summary_data_wait,
    summary_steps,
    training_samples,
)
from amprobe.rules.data import HALF_DTYPES, autocast_dtypes
from amprobe.rules.engine import Finding, RuleContext, requirement, rule
from amprobe.rules.refs import AUTOCAST_OPS, DATA_LOADING, MATMUL_GUIDE, TUNING_GUIDE
from amprobe.store.loader import Run

__all__: list[str] = []

#: what a sync counted on a CPU run is
CPU_SYNC_NOTE = (
    "would synchronize on a GPU; counted on tensors derived from the model's parameters, "
    "outputs or loss"
)


@requirement("runtime")
def _has_runtime(run: Run) -> str | None:
    if any(rt["wait_steps"]["n"] for rt in rank_runtime(run).values()):
        return None
    return "step timing was not recorded (runtime collector off)"


@requirement("syncs")
def _has_syncs(run: Run) -> str | None:
    if any(rt["syncs"]["sampled"]["n"] for rt in rank_runtime(run).values()):
        return None
    return "host-device syncs were not counted (runtime collector off, syncs_every=0, or no sampled step)"


@requirement("gpm")
def _has_gpm(run: Run) -> str | None:
    gpu = run.table("gpu")
    if len(gpu) and column(gpu, "tensor_any").notna().any():
        return None
    reason = gpu_unavailable_reason(run)
    if reason:
        return reason
    for note in run.events_of("gpu_sampler"):
        if note.get("status") == "gpm not available":
            return str(note.get("reason"))
    return "the GPU reported no Tensor Core activity metrics (GPM needs Hopper or newer)"


@rule(
    "AMP-S01",
    "input-bound",
    "warning",
    "speed",
    requires=("runtime",),
    thresholds={"data_wait_share": 0.20, "gpu_util_median": 70.0, "skip_steps": 1, "min_steps": 3},
    refs=(DATA_LOADING, TUNING_GUIDE),
)
def input_bound(ctx: RuleContext) -> list[Finding]:
    """Low GPU utilization and/or a large share of step time spent waiting for the next batch.

    Algorithm: per rank, data-wait share = Σ data_wait_s / Σ wall_s over the steps after the
    first ``skip_steps`` (warm-up; the first batch of a multi-worker loader is slow) and outside
    sync-sampled steps, from the rank's summary (the sums exact, the medians in the evidence
    from its histograms, within 0.27 %; a ``skip_steps`` past the summary's 16 head rows leaves
    out only those); GPU utilization = median NVML ``gpu_util`` of the samples taken after
    warm-up. Fires when the share exceeds ``data_wait_share`` or the median is under
    ``gpu_util_median``. Without GPU samples the GPU part says why it was not checked.
    Assumes host wait approximates device idle (on CUDA the host may run ahead and hide it).
    """
    th = ctx.thresholds
    skip = int(th["skip_steps"])
    gpu = ctx.run.table("gpu")
    gpu_reason = gpu_unavailable_reason(ctx.run)
    out = []
    # once per class of ranks with equal runtime sections (the key is the section's data)
    waits_of: dict[int, dict[str, Any] | None] = {}
    keys = section_keys(ctx.run, "runtime")
    for rank, runtime in rank_runtime(ctx.run).items():
        key = keys[rank]
        if key not in waits_of:
            waits_of[key] = summary_data_wait(runtime, skip)
        wait = waits_of[key]
        if wait is None or wait["measured_step_count"] < th["min_steps"]:
            continue
        util = None
        if gpu_reason is None:
            util = compute_gpu_util(gpu[gpu["rank"] == rank], skip)
        evidence: dict[str, Any] = {
            "rank": rank,
            **wait,
            "data_wait_threshold": th["data_wait_share"],
        }
        if util is not None:
            evidence.update(util, gpu_util_threshold=th["gpu_util_median"])
        else:
            evidence["gpu_util"] = f"not checked: {gpu_reason or 'no sample after warm-up'}"
        waits = wait["data_wait_share"] > th["data_wait_share"]
        idle = util is not None and util["gpu_util_median"] < th["gpu_util_median"]
        if not (waits or idle):
            continue
        loaders = [e for e in ctx.run.events_of("dataloader_seen") if e.get("rank") == rank]
        if loaders:
            evidence["dataloader"] = {
                k: loaders[-1].get(k)
                for k in ("num_workers", "prefetch_factor", "pin_memory", "batch_size")
            }
        parts = []
        if waits:
            parts.append(f"{wait['data_wait_share']:.0%} of step time waits for the next batch")
        if idle:
            parts.append(f"median GPU utilization {util['gpu_util_median']:.0f}%")  # type: ignore[index]
        out.append(
            ctx.finding(
                title="Input-bound: " + "; ".join(parts),
                evidence=evidence,
                fix=(
                    "Feed the device faster: raise DataLoader num_workers (and prefetch_factor), set "
                    "pin_memory=True with non_blocking copies, use persistent_workers, move decoding "
                    "and augmentation out of __getitem__ or use memory-mapped/pre-processed data."
                ),
            )
        )
    return out


@rule(
    "AMP-S03",
    "host-sync",
    "warning",
    "speed",
    requires=("syncs",),
    thresholds={"syncs_per_step": 3.0, "top_sites": 5},
    refs=(TUNING_GUIDE,),
)
def host_sync(ctx: RuleContext) -> list[Finding]:
    """The step forces host-device synchronizations more than a few times.

    Algorithm: per rank, mean of ``syncs`` (user-issued synchronizing ops) over the sampled
    steps (from the rank's summary; the ``syncs`` table is read for the ranks it fires on); fires above ``syncs_per_step``. Evidence lists the top source lines by count per
    sampled step. GradScaler's own check and optimizer/data-loader internals are not counted.
    On a CPU run the ops are counted on the tensors a GPU run would keep on the device (those
    derived from the model's parameters, outputs or loss; see :mod:`amprobe.capture.collectors.syncs`):
    they would synchronize on a GPU. Host-side indices and counters are not counted.
    """
    th = ctx.thresholds
    out = []
    for rank, runtime in rank_runtime(ctx.run).items():
        sampled = runtime["syncs"]["sampled"]
        count = int(sampled["n"])
        if not count:
            continue
        per_step = runtime["syncs"]["total"] / count
        if per_step <= th["syncs_per_step"]:
            continue
        rank_syncs = ctx.run.rank_table("syncs", rank)
        sites = compute_sync_sites(rank_syncs, count).head(int(th["top_sites"]))
        devices = set(rank_syncs["device"].dropna()) if len(rank_syncs) else set()
        on_cpu = devices <= {"cpu"}
        scaler_checks = 0.0
        if len(rank_syncs):
            scaler_checks = float(rank_syncs[rank_syncs["kind"] == "scaler"]["count"].sum()) / count
        sampled_runs = summary_steps(sampled)
        top = [f"{r.site} ({r.op}, {r.per_step:g}/step)" for r in sites.itertuples()]
        note = f" ({CPU_SYNC_NOTE})" if on_cpu else ""
        out.append(
            ctx.finding(
                title=f"{per_step:.1f} host-device syncs per step{note}, "
                f"top: {top[0] if top else '?'}",
                evidence={
                    "rank": rank,
                    "syncs_per_step": per_step,
                    "threshold": th["syncs_per_step"],
                    "sampled_steps": expand_steps(sampled_runs, MAX_LISTED_STEPS),
                    "sampled_step_ranges": sampled_runs[:MAX_LISTED_STEPS],
                    "top_sites": top,
                    "counted_on": f"cpu ({CPU_SYNC_NOTE})" if on_cpu else ",".join(sorted(devices)),
                    "gradscaler_checks_per_step": scaler_checks,
                },
                fix=(
                    "Take metrics out of the hot loop: accumulate losses/metrics on the device "
                    "(e.g. total += loss.detach()) and call .item()/.cpu()/print every N steps; avoid "
                    "nonzero, boolean-mask indexing and data-dependent Python branches on device tensors."
                ),
            )
        )
    return out


@rule(
    "AMP-S07",
    "tensor-core-idle",
    "warning",
    "speed",
    requires=("amp_as_written", "gpm", "autocast"),
    thresholds={"tensor_active_pct": 1.0, "busy_gpu_util": 50.0, "skip_steps": 1},
    refs=(AUTOCAST_OPS, MATMUL_GUIDE),
    explained_by=("AMP-S05", "AMP-S04"),  # matmuls outside autocast, or misaligned
)
def tensor_core_idle(ctx: RuleContext) -> list[Finding]:
    """Tensor Cores stay near idle while AMP is on and the GPU is busy.

    Algorithm: per rank, GPM ``tensor_any`` samples taken after warm-up while NVML ``gpu_util``
    is at least ``busy_gpu_util``; fires when their median is under ``tensor_active_pct`` and
    autocast used a half dtype. Only GPUs with GPM (Hopper or newer) report the metric.
    """
    th = ctx.thresholds
    if not set(autocast_dtypes(ctx.run)) & set(HALF_DTYPES):
        return []
    gpu = ctx.run.table("gpu")
    out = []
    for rank, samples in gpu.groupby("rank"):
        samples = training_samples(samples, int(th["skip_steps"]))
        busy = samples[(samples["gpu_util"] >= th["busy_gpu_util"]) & samples["tensor_any"].notna()]
        if busy.empty:
            continue
        median = float(busy["tensor_any"].median())
        if median >= th["tensor_active_pct"]:
            continue
        hmma = busy["tensor_hmma"].dropna()
        out.append(
            ctx.finding(
                title=f"Tensor Cores idle under AMP: median tensor activity "
                f"{median:.2f}% while the GPU is busy",
                evidence={
                    "rank": int(rank),
                    "tensor_any_median": median,
                    "tensor_hmma_median": float(hmma.median()) if len(hmma) else None,
                    "threshold": th["tensor_active_pct"],
                    "busy_sample_count": int(len(busy)),
                    "gpu_util_median": float(busy["gpu_util"].median()),
                },
                fix=(
                    "The half-precision matmuls are not reaching Tensor Cores: check that forward runs "
                    "under torch.autocast (AMP-S05) and that matmul dimensions are multiples of 8 "
                    "(AMP-S04)."
                ),
            )
        )
    return out
