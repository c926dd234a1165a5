"""Cross-rank rules (checklist section D): the ranks of one job compared with each other.

Every rank records on its own (the probe adds no collective to the job's process groups: the
one exchange between ranks is the sampling schedule, which rank 0 writes and the others read
through the default process group's c10d store, a host TCP key-value store, at the end of
sampled steps only; see ``amprobe.capture.agree``); these rules merge the ranks at analysis
time, on the ``rank`` column of the loaded run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from amprobe.analysis.frames import MAX_LISTED_STEPS, section_keys
from amprobe.analysis.ranks import (
    compute_hist_quantiles,
    compute_others_median,
    compute_reduce_peaks,
)
from amprobe.analysis.runtime import (
    median_of,
    rank_runtime,
    rank_step_counts,
    step_rows_from,
    summary_steps,
    timed_hist,
)
from amprobe.analysis.scaler import scale_trajectory_classes, scaler_summaries
from amprobe.rules.data import step_ranges, steps_list
from amprobe.rules.engine import (
    Finding,
    RuleContext,
    format_ranks,
    requirement,
    rule,
)
from amprobe.rules.refs import DATA_LOADING, MULTI_GPU_EXAMPLE
from amprobe.store.loader import Run
from amprobe.store.sections.runtime import Ranges

__all__: list[str] = []

MAX_LISTED = 16  # ranks whose values are spelled out in evidence


@requirement("multi_rank")
def _has_multiple_ranks(run: Run) -> str | None:
    n = len(rank_step_counts(run))
    if n >= 2:
        return None
    return f"single-rank run ({n} rank with recorded steps); cross-rank rules need at least 2 ranks"


def _first_values(ranks: np.ndarray, row: np.ndarray, mask: np.ndarray) -> dict[int, Any]:
    picked = np.flatnonzero(mask)[:MAX_LISTED]
    return {int(ranks[j]): float(row[j]) for j in picked}


def _weighted_median(
    values: np.ndarray, present: np.ndarray, weight: np.ndarray, count: np.ndarray
) -> np.ndarray:
    """Per row, the median of the present values, each counted ``weight`` times: what
    ``np.nanmedian`` gives on the row with every class's column repeated per rank."""
    keyed = np.where(present, values, np.inf)
    order = np.argsort(keyed, axis=1, kind="stable")
    ordered = np.take_along_axis(keyed, order, axis=1)
    cumulative = np.cumsum(
        np.where(present, weight[None, :], 0)[np.arange(len(values))[:, None], order], axis=1
    )
    rows = np.arange(len(values))
    low = ordered[rows, np.argmax(cumulative > ((count - 1) // 2)[:, None], axis=1)]
    high = ordered[rows, np.argmax(cumulative > (count // 2)[:, None], axis=1)]
    return np.where(count % 2 == 1, low, (low + high) / 2)


@rule(
    "AMP-D01",
    "rank-scale-divergence",
    "warning",
    "distributed",
    requires=("amp_as_written", "scaler", "multi_rank"),
    thresholds={"min_divergent_steps": 1},
    refs=(MULTI_GPU_EXAMPLE,),
)
def check_rank_scale_divergence(ctx: RuleContext) -> Iterator[Finding]:
    """Ranks of one job disagree on the loss scale or on which steps were skipped.

    Algorithm: compare ``scale_before`` and ``skipped`` step by step over the steps that at
    least two ranks recorded. The ranks are read from their ``scaler`` summaries and grouped
    into classes of equal trajectories
    (:func:`~amprobe.analysis.scaler.scale_trajectory_classes`): one step x class grid, each
    class counted once per rank, the same findings as a step x rank grid. A step diverges on the scale when the ranks' scales are
    not all equal; the ranks named are those whose scale differs from the median of the ranks
    at that step (with two ranks, or no majority, every rank differs from the median and all
    are named). A step diverges on skipping when some ranks skipped it and others did not; the
    minority side is named. found-inf looks synchronized when every rank skipped exactly the
    same steps (as DDP's gradient all-reduce makes it); a ``GradScaler`` never synchronizes
    found-inf by itself. A finding needs at least ``min_divergent_steps`` divergent steps.
    """
    ranks, class_of, steps, present, scales, skipped = scale_trajectory_classes(ctx.run)
    weight = np.bincount(class_of, minlength=present.shape[1])  # ranks per class
    n_present = present.astype(np.int64) @ weight
    shared = n_present >= 2
    if not shared.any():
        return
    steps, scales, skipped, present, n_present = (
        steps[shared],
        scales[shared],
        skipped[shared],
        present[shared],
        n_present[shared],
    )
    reference = _weighted_median(scales, present, weight, n_present)
    scale_dev = present & (scales != reference[:, None])
    scale_rows = np.flatnonzero(scale_dev.any(axis=1))
    is_skipped = present & skipped
    n_skipped = is_skipped.astype(np.int64) @ weight
    skip_rows = np.flatnonzero((n_skipped > 0) & (n_skipped < n_present))
    minority = np.where(
        (n_skipped < n_present - n_skipped)[:, None],
        is_skipped,
        np.where((n_skipped > n_present - n_skipped)[:, None], present & ~is_skipped, present),
    )
    skip_dev = np.zeros_like(present)
    skip_dev[skip_rows] = minority[skip_rows]
    divergent = len(scale_rows) + len(skip_rows)
    if (
        max(len(scale_rows), len(skip_rows)) < ctx.thresholds["min_divergent_steps"]
        or divergent == 0
    ):
        return
    named = sorted(int(r) for r in ranks[(scale_dev | skip_dev).any(axis=0)[class_of]])
    any_skip = bool(is_skipped.any())
    synchronized: bool | None = (len(skip_rows) == 0) if any_skip else None
    if synchronized is None:
        sync_note = "no rank skipped a step, so found-inf synchronization was not observed"
    elif synchronized:
        sync_note = (
            f"found-inf looks synchronized: every rank skipped the same "
            f"{int(is_skipped.any(axis=1).sum())} step(s)"
        )
    else:
        sync_note = (
            f"found-inf is NOT synchronized: ranks skipped different steps at "
            f"{len(skip_rows)} step(s)"
        )
    evidence: dict[str, Any] = {
        "ranks": named,
        "compared_rank_count": len(ranks),
        "compared_step_count": len(steps),
        "scale_divergent_step_count": len(scale_rows),
        "scale_divergent_steps": steps_list(steps[scale_rows]),
        "scale_divergent_step_ranges": step_ranges(steps[scale_rows]),
        "skip_divergent_step_count": len(skip_rows),
        "skip_divergent_steps": steps_list(steps[skip_rows]),
        "skip_divergent_step_ranges": step_ranges(steps[skip_rows]),
        "found_inf_synchronized": synchronized,
        "found_inf_note": sync_note,
        "min_divergent_steps": ctx.thresholds["min_divergent_steps"],
    }
    if len(scale_rows):
        i = scale_rows[0]
        evidence["median_scale_at_first_divergence"] = float(reference[i])
        evidence["scales_at_first_divergence"] = _first_values(
            ranks, scales[i][class_of], scale_dev[i][class_of]
        )
    if len(skip_rows):
        i = skip_rows[0]
        evidence["skipped_at_first_divergence"] = {
            int(ranks[j]): bool(skipped[i, class_of[j]])
            for j in np.flatnonzero(present[i][class_of])[:MAX_LISTED]
        }
    inits = {
        rank: float(facts["init_scale"])
        for rank, facts in scaler_summaries(ctx.run).items()
        if facts["init_scale"] is not None
    }
    if len(set(inits.values())) > 1:
        evidence["init_scales"] = {r: inits[r] for r in sorted(inits)[:MAX_LISTED]}
    parts = []
    if len(scale_rows):
        parts.append(
            f"the loss scale at {len(scale_rows)} step(s) (first: step {int(steps[scale_rows[0]])})"
        )
    if len(skip_rows):
        parts.append(f"which steps were skipped at {len(skip_rows)} step(s)")
    fix = (
        "Every rank must see the same data order and a synchronized overflow decision: "
        "with DDP or FSDP the gradient all-reduce spreads an inf to every rank; without it, "
        "all-reduce found-inf yourself or use ShardedGradScaler."
    )
    if "init_scales" in evidence:
        fix = (
            "The ranks built their GradScaler with different init_scale values: construct it "
            "identically on every rank (and restore the same scaler state on resume). " + fix
        )
    yield ctx.finding(
        title=(
            f"ranks {format_ranks(named)} disagree on "
            if len(named) == len(ranks)
            else (
                f"rank {named[0]} disagrees"
                if len(named) == 1
                else f"ranks {format_ranks(named)} disagree"
            )
            + " with the other ranks on "
        )
        + " and on ".join(parts)
        + f"; {sync_note}",
        evidence=evidence,
        fix=fix,
    )


@rule(
    "AMP-D02",
    "rank-straggler",
    "info",
    "distributed",
    requires=("steps", "multi_rank"),
    thresholds={
        "slow_factor": 1.5,
        "min_consistent_share": 0.8,
        "min_excess_s": 2e-05,
        "min_wait_step_share": 0.05,
        "warmup_steps": 2,
        "min_steps": 5,
    },
    refs=(DATA_LOADING,),
)
def check_rank_straggler(ctx: RuleContext) -> Iterator[Finding]:
    """One rank's step time or data wait is far above the other ranks'.

    Algorithm, on each rank's summary: ranks with fewer than ``min_steps`` steps after
    ``warmup_steps`` are left out; per metric (``wall_s``, and ``data_wait_s`` when recorded),
    each remaining rank's steps after the warmup that measured it are taken, and a metric with
    fewer than ``min_steps`` steps that every remaining rank measured is not judged. A rank is
    a straggler when (1) its median is at least ``slow_factor`` x the median of the other ranks'
    medians, (2) it is at least ``slow_factor`` x slower than the other ranks on at least
    ``min_consistent_share`` of its steps, judged quantile by quantile (below; so a few stalls,
    or a rank slow on alternate steps, are not a straggler), and (3) its median exceeds the
    others' by at least ``min_excess_s``; for the data wait, also by at least
    ``min_wait_step_share`` of the other ranks' median step time (a wait that adds a few
    percent to a step holds nothing up). The judgment is a ratio, so a 3x rank is named on a
    fast machine as on a slow one; ``min_excess_s`` is only a floor under timer noise
    (``wall_s`` comes from ``time.perf_counter``, which resolves nanoseconds, but timing a step
    from Python jitters by microseconds), not a machine-tuned step time. One finding per metric
    lists every straggler. Under DDP the gradient all-reduce makes every rank wait for the
    slowest, so a slow input pipeline usually shows in the data wait rather than in the step
    time.

    From summaries (issue #33): the medians come from each rank's log-bucket histogram of the
    metric, within 0.27 % of the exact ones
    (:data:`~amprobe.store.sections.runtime.QUANTILE_REL_ERROR`). Test (2) used to pair steps
    across ranks (a step x rank grid, 330 MB at 4,096 ranks x 10,000 steps): a rank's step
    was slower when it exceeded the median of the other ranks at the same step. Per-rank
    summaries hold no per-step values, so test (2) pairs quantiles instead: at each of 200
    quantiles (:data:`~amprobe.analysis.ranks.QUANTILES`) the rank's value is compared with
    ``slow_factor`` x the median of the other ranks' values at the same quantile, and
    ``slower_step_share`` is the share of quantiles where it is slower (``slower_step_count``
    that share of the rank's steps after the warmup, an estimate). A rank 3x slower on every
    step is slower at every quantile (share 1.0, as before). A rank slow on some steps only
    mixes two distributions, and its share is blurred by how widely the step times spread: a
    rank 3x slower on 3 of 4 steps scores about 0.82 on ``sample_runs/healthy``'s steps (0.75
    when steps are paired). Comparing every step with ``slow_factor`` x the others' median
    alone (not quantile by quantile) would miss a 3x rank whose step times spread over more
    than 2x (0.57 on those steps). ``compared_step_count`` and its ranges are the steps every
    compared rank measured.
    """
    th = ctx.thresholds
    run = ctx.run
    warmup = int(th["warmup_steps"])
    hosts = {r.rank: r.manifest.get("hostname") for r in run.ranks}
    counts = rank_step_counts(run)
    runtimes = rank_runtime(run)
    eligible = [
        rank
        for rank, runtime in runtimes.items()
        if step_rows_from(runtime, counts[rank], warmup) >= th["min_steps"]
    ]
    if len(eligible) < 2:
        return
    ranks = np.asarray(eligible)
    # each histogram and its median worked out once per class of ranks with equal runtime
    # sections (the key is the section's data); ranks of a class share them (read only)
    keys = [section_keys(run, "runtime")[r] for r in eligible]
    made: dict[tuple[Any, str], dict[str, Any]] = {}
    for m in ("wall", "wait"):
        for r, key in zip(eligible, keys, strict=True):
            if (key, m) not in made:
                made[key, m] = timed_hist(runtimes[r], m, warmup)
    hists_of = {m: [made[key, m] for key in keys] for m in ("wall", "wait")}
    median_memo: dict[int, float | None] = {id(h): median_of(h) for h in made.values()}
    walls = np.asarray(
        [np.nan if (v := median_memo[id(h)]) is None else v for h in hists_of["wall"]]
    )
    for column, metric, label in (
        ("wall_s", "wall", "step time"),
        ("data_wait_s", "wait", "data-loader wait"),
    ):
        hists = hists_of[metric]
        if any(not h["n"] for h in hists):
            continue
        shared = _shared_steps([runtimes[r][f"{metric}_steps"] for r in eligible], warmup)
        shared_count = sum(b - a + 1 for a, b in shared)
        if shared_count < max(1, th["min_steps"]):
            continue
        medians = np.asarray([median_memo[id(h)] for h in hists], dtype=float)
        others = compute_others_median(medians[None, :])[0]
        excess = medians - others
        floor = np.full(len(ranks), float(th["min_excess_s"]))
        if column != "wall_s" and not np.isnan(walls).any():
            step_time = compute_others_median(walls[None, :])[0]
            floor = np.maximum(floor, th["min_wait_step_share"] * step_time)
        candidates = np.flatnonzero((medians >= th["slow_factor"] * others) & (excess >= floor))
        if not len(candidates):
            continue
        # the quantiles of each rank paired with the same quantiles of the other ranks (a
        # quantile x rank grid, in place of the step x rank grid of paired steps)
        grid = compute_hist_quantiles(hists)
        slower = grid[:, candidates] > th["slow_factor"] * compute_others_median(grid, candidates)
        share_of = dict(zip(candidates.tolist(), slower.mean(axis=0).tolist(), strict=True))
        slower_of = {j: int(round(share * hists[j]["n"])) for j, share in share_of.items()}
        slow = np.asarray([j for j in candidates if share_of[int(j)] >= th["min_consistent_share"]])
        if not len(slow):
            continue
        slow = slow[np.argsort(-medians[slow], kind="stable")]
        j = int(slow[0])
        worst_rank, worst, reference = int(ranks[j]), float(medians[j]), float(others[j])
        ratio = worst / reference if reference > 0 else None
        listed = slow[:MAX_LISTED]
        yield ctx.finding(
            title=(
                f"rank {worst_rank}"
                + (f" ({hosts.get(worst_rank)})" if hosts.get(worst_rank) else "")
                + f" median {label} {_ms(worst)} vs {_ms(reference)} median of the other "
                f"{len(ranks) - 1} rank(s)"
                + f" ({f'{ratio:.1f}x, ' if ratio else ''}slower on {slower_of[j]:,} of "
                f"{hists[j]['n']:,} steps compared)"
                + (
                    f"; {len(slow)} straggler ranks: {format_ranks(ranks[slow])}"
                    if len(slow) > 1
                    else ""
                )
            ),
            evidence={
                "metric": column,
                "ranks": sorted(int(r) for r in ranks[slow]),
                "slowest_rank": worst_rank,
                "hostname": hosts.get(worst_rank),
                "rank_medians_s": {int(ranks[i]): round(float(medians[i]), 7) for i in listed},
                "median_of_ranks_s": round(float(np.median(medians)), 7),
                "median_of_other_ranks_s": round(reference, 7),
                "ratio": round(ratio, 3) if ratio else None,
                "rank_ratios": {
                    int(ranks[i]): (
                        round(float(medians[i] / others[i]), 3) if others[i] > 0 else None
                    )
                    for i in listed
                },
                "slower_step_count": int(slower_of[j]),
                "slower_step_share": round(float(share_of[j]), 4),
                "rank_slower_step_shares": {
                    int(ranks[i]): round(float(share_of[int(i)]), 4) for i in listed
                },
                "compared_rank_count": len(ranks),
                "compared_step_count": shared_count,
                "compared_step_ranges": shared[:MAX_LISTED_STEPS],
                "slow_factor": th["slow_factor"],
                "min_consistent_share": th["min_consistent_share"],
                "min_excess_s": th["min_excess_s"],
                **(
                    {"min_wait_step_share": th["min_wait_step_share"]} if column != "wall_s" else {}
                ),
            },
            fix=(
                "The slowest rank sets the pace of every synchronized step: look at its input "
                "pipeline (DataLoader workers, storage, CPU contention on its host) and at its "
                "device (thermal throttling, a different GPU model)."
            ),
        )


def _shared_steps(ranges: list[Any], warmup: int) -> list[list[int]]:
    """The steps from ``warmup`` on that every rank's ranges hold, as sorted runs (ranks whose
    ranges are equal, the common case, are intersected once)."""
    distinct: dict[str, Any] = {}
    for r in ranges:
        distinct.setdefault(repr(Ranges.runs(r)), r)
    shared: list[list[int]] | None = None
    for r in distinct.values():
        runs = summary_steps(r, min_step=warmup)
        shared = runs if shared is None else _intersect(shared, runs)
    return shared or []


def _intersect(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append([lo, hi])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _ms(seconds: float) -> str:
    """A step time in ms, with enough digits for microsecond steps."""
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms >= 1 else f"{ms:.3f} ms"


# -- AMP-D03 half-reduce -------------------------------------------------------------------------
_HALF_REDUCE = ("float16", "bfloat16")


def _grad_reduce(run: Run) -> dict[str, Any] | None:
    """The half-precision gradient reduction a rank's manifest records (``grad_reduce``)."""
    for info in run.ranks:
        reduce = info.manifest.get("grad_reduce")
        if isinstance(reduce, dict) and reduce.get("dtype") in _HALF_REDUCE:
            return {**reduce, "rank": info.rank}
    return None


@requirement("half_reduce")
def _has_half_reduce(run: Run) -> str | None:
    if _grad_reduce(run) is not None:
        return None
    return (
        "gradients were not reduced in half precision (no FSDP2 reduce_dtype fp16/bf16 and no "
        "DDP fp16/bf16 compression hook was recorded)"
    )


@rule(
    "AMP-D03",
    "half-reduce",
    "warning",
    "distributed",
    requires=("half_reduce", "numerics"),
    thresholds={
        "fp16_max": 65504.0,
        "range_fraction": 1.0,
        "bf16_unit_roundoff": 2.0**-8,
        "max_sum_rel_error": 0.01,
    },
    refs=(MULTI_GPU_EXAMPLE,),
)
def check_half_reduce(ctx: RuleContext) -> Iterator[Finding]:
    """Gradients are reduced across ranks in half precision, and the reduction loses range or
    precision.

    Algorithm (fp16): for every recorded ``grad_param`` row (per rank, sampled step, layer),
    the peak inside the reduction is :func:`compute_reduce_peaks`; a layer is named when its
    peak exceeds ``fp16_max * range_fraction`` on some step, or (FSDP2, which measures the
    reduced gradient) when its reduced gradient is inf/NaN while its output gradient on that
    rank was finite. Assumes the ranks' gradients are of similar size (the recorded maximum
    stands for every rank's). bf16 (same range as fp32): the rounding error of an
    ``N``-term bf16 sum is bounded by ``(N - 1) * bf16_unit_roundoff``; a finding (info) when
    that exceeds ``max_sum_rel_error``.
    """
    th = ctx.thresholds
    reduce = _grad_reduce(ctx.run)
    assert reduce is not None  # the requirement
    world = int(reduce.get("world_size") or 1)
    pre = float(reduce.get("pre_divide") or 1.0)
    measured = str(reduce.get("measured") or "local")
    source = str(reduce.get("source") or "a half-precision reduction")
    numerics = ctx.run.table("numerics")
    common = {
        "reduce_dtype": reduce["dtype"],
        "reduce_source": source,
        "world_size": world,
        "pre_divide": pre,
        "measured": measured,
    }
    if reduce["dtype"] == "bfloat16":
        bound = (world - 1) * th["bf16_unit_roundoff"]
        if bound <= th["max_sum_rel_error"]:
            return
        reduced = sorted(set(numerics.loc[numerics["kind"] == "grad_param", "module"]))
        yield ctx.finding(
            title=(
                f"gradients are summed across {world} ranks in bf16 ({source}): up to "
                f"{bound:.1%} relative rounding error per element"
            ),
            evidence={
                **common,
                "sum_rel_error_bound": round(bound, 6),
                "layers": [{"module": m} for m in reduced[:MAX_LISTED]],
                "layer_count": len(reduced),
                "bf16_unit_roundoff": th["bf16_unit_roundoff"],
                "max_sum_rel_error": th["max_sum_rel_error"],
            },
            fix=(
                "bf16 keeps fp32's range but only 8 significant bits, so a sum over many ranks "
                "drops the small gradients' low bits: reduce in fp32 "
                "(MixedPrecisionPolicy(reduce_dtype=torch.float32)) if convergence suffers."
            ),
            severity="info",
        )
        return
    rows = compute_reduce_peaks(numerics, world, pre, measured)
    if rows.empty:
        return
    limit = th["fp16_max"] * th["range_fraction"]
    over = rows[(rows["peak"] > limit) | rows["nonfinite"]]
    if over.empty:
        return
    layers: list[dict[str, Any]] = []
    for module, part in over.groupby("module", sort=False):
        finite = part.loc[~part["nonfinite"] & part["peak"].notna(), "peak"]
        layers.append(
            {
                "module": str(module),
                "peak_in_reduction": float(finite.max()) if len(finite) else None,
                "nonfinite_after_reduce": bool(part["nonfinite"].any()),
                "ranks": sorted(int(r) for r in part["rank"].unique()),
                "exceeded_steps": steps_list(np.unique(part["step"].to_numpy())),
                "exceeded_step_ranges": step_ranges(part["step"]),
            }
        )
    layers.sort(key=lambda d: (not d["nonfinite_after_reduce"], -(d["peak_in_reduction"] or 0)))
    names = [d["module"] for d in layers]
    ranks = sorted(int(r) for r in over["rank"].unique())
    factor = max(1.0, world / pre) if pre > 0 else float(world)
    yield ctx.finding(
        title=(
            f"gradients are reduced across {world} ranks in fp16 ({source}) and "
            f"{len(names)} layer(s) exceed fp16's range in the reduction: "
            + ", ".join(names[:5])
            + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        ),
        evidence={
            **common,
            "ranks": ranks,
            "layers": layers[:MAX_LISTED],
            "layer_count": len(layers),
            "exceeded_steps": steps_list(np.unique(over["step"].to_numpy())),
            "exceeded_step_ranges": step_ranges(over["step"]),
            "sum_factor": factor,
            "fp16_max": th["fp16_max"],
            "range_fraction": th["range_fraction"],
        },
        fix=(
            "Reduce gradients in fp32: MixedPrecisionPolicy(reduce_dtype=torch.float32) with "
            "FSDP2 (the parameters and the compute stay in half precision), no fp16 compression "
            "hook with DDP (or bf16_compress_hook); or pre-divide each rank's gradients by the "
            "world size before the reduction."
        ),
    )
