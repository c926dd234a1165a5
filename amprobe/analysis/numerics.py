"""Per-layer numerics: layer summaries, gradient underflow, loss-scale hints, offenders.

Pure functions of the ``numerics`` and ``offenders`` tables written by the ``numerics``
collector (and of the ``input_nonfinite`` step field).
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from amprobe.analysis.frames import section_keys
from amprobe.store.loader import Run
from amprobe.store.schema import NUMERICS_OPERAND_KINDS
from amprobe.store.sections.numerics import decode_bins, encode_bins
from amprobe.store.sections.numerics import last_linear_half as _last_linear_half

__all__ = [
    "FP16_MAX",
    "GRAD_KINDS",
    "own_layer_rows",
    "COUNT_COLUMNS",
    "COUNT_DEFINITIONS",
    "ROLE_LABELS",
    "module_role",
    "last_linears",
    "compute_layer_summary",
    "layer_summary",
    "compute_scale_hint",
    "compute_underflow",
    "compute_gradient_underflow",
    "offender_evidence",
    "gradient_underflow_rows",
    "gradient_underflow_classes",
    "SectionBins",
    "section_bins",
    "fact_steps",
    "layer_overflow_evidence",
    "nonfinite_input_steps",
    "first_overflow_step",
    "first_overflow_since",
    "numerics_missing_reason",
    "root_missing_reason",
    "COUNT_SQL",
    "HIST_LOW",
    "HIST_HIGH",
    "LayerHistograms",
    "summary_layers",
    "compute_layer_summary_summaries",
    "compute_layer_histograms",
    "layer_histograms",
    "class_representatives",
    "compute_scale_hint_summaries",
    "numerics_cells",
]

FP16_MAX = 65504.0
GRAD_KINDS = ("grad_output", "grad_param")
#: what each per-layer count column counts, one definition each, in the words every view uses
#: (the totals table's notes, the heatmaps' titles, the findings' evidence labels)
COUNT_DEFINITIONS: dict[str, str] = {
    "nonfinite": "NaN + inf",
    "over_fp16": "finite values \u2265 65,520",
    "fp16_inf": "over_fp16 + inf",
    "below_normal": "nonzero values below 2**-14",
    "below_subnormal": "nonzero values below 2**-24",
}
#: per-layer counts shown both as totals (:func:`compute_layer_summary`) and per sampled step
#: (the report's heatmaps), one definition each: column -> (what it counts, function of a
#: frame with the ``numerics`` count columns). Each is a sum of counts, so it gives a row's
#: count and, applied to summed rows, their total.
COUNT_COLUMNS: dict[str, tuple[str, Callable[[pd.DataFrame], pd.Series]]] = {
    "nonfinite": (
        f"non-finite values ({COUNT_DEFINITIONS['nonfinite']})",
        lambda f: f["nan"] + f["inf"],
    ),
    "fp16_inf": (
        f"values an fp16 cast makes inf ({COUNT_DEFINITIONS['fp16_inf']}; "
        f"over_fp16: {COUNT_DEFINITIONS['over_fp16']})",
        lambda f: f["over_fp16"] + f["inf"],
    ),
    "below_subnormal": (
        f"{COUNT_DEFINITIONS['below_subnormal']} (the fp16 min subnormal; gradients unscaled)",
        lambda f: f["below_subnormal"],
    ),
}
ROLE_LABELS = {
    "normalization": "a normalization layer",
    "softmax": "a softmax / attention",
    "loss": "a loss",
    "embedding": "an embedding",
    "output projection": "the output projection",
}


def module_role(module_type: str | None, is_last_linear: bool = False) -> str | None:
    """Classify a module: normalization, softmax, loss, embedding, output projection or None."""
    t = module_type or ""
    if "Norm" in t:
        return "normalization"
    if t in ("Softmax", "LogSoftmax", "Softmin", "Softmax2d", "MultiheadAttention"):
        return "softmax"
    if t.endswith("Loss") or t == "loss":
        return "loss"
    if t.startswith("Embedding"):
        return "embedding"
    if is_last_linear and t in ("Linear", "NonDynamicallyQuantizableLinear", "LazyLinear"):
        return "output projection"
    return None


def last_linears(frame: pd.DataFrame) -> set[tuple[int, str]]:
    """(step, module) of the last Linear executed in each step's forward pass."""
    kind = frame["kind"].to_numpy()
    types = frame["module_type"].tolist()
    linear = np.array(["Linear" in t if isinstance(t, str) else False for t in types], dtype=bool)
    rows = np.flatnonzero((kind == "output") & linear)
    if not len(rows):
        return set()
    # in execution order (pandas' sort: NaN positions last), the last row of each step wins
    order = frame["order"].to_numpy()[rows]
    missing = pd.isna(order)
    ranked = np.concatenate(
        [
            np.flatnonzero(~missing)[order[~missing].argsort(kind="quicksort")],
            np.flatnonzero(missing),
        ]
    )
    steps = frame["step"].to_numpy()[rows][ranked].tolist()
    modules = frame["module"].to_numpy()[rows][ranked].tolist()
    last: dict[Any, Any] = {}
    for step, module in zip(steps, modules, strict=True):
        if not pd.isna(step):
            last[step] = module
    return {(int(s), str(m)) for s, m in last.items()}


def _hist(text: Any) -> dict[int, int]:
    if not isinstance(text, str) or not text:
        return {}
    return {int(k): int(v) for k, v in json.loads(text).items()}


#: ``exp_hist`` key of the values below 2**-133 (binades -149 .. -134) and its top binade
_LUMP, _LUMP_TOP = -149, -134


def _nonzero_binades(text: Any, zeros: int) -> dict[int, int]:
    """``exp_hist`` as top binade -> nonzero finite count: the zeros taken out of bin -127,
    inf/NaN left out, the lump below 2**-133 keyed by its top binade -134."""
    out: dict[int, int] = {}
    for e, n in _hist(text).items():
        if e >= 128:
            continue
        if e == -127:
            n -= zeros
        if n > 0:
            key = _LUMP_TOP if e <= _LUMP else e
            out[key] = out.get(key, 0) + n
    return out


def _below(binades: dict[int, int], bound_exp: float, scale: float) -> int:
    """Values of the binades that lie wholly at or below ``2**bound_exp`` once multiplied by
    ``scale``: ``2**(e+1) * scale <= 2**bound_exp``."""
    cut = bound_exp - math.log2(scale) - 1
    return sum(n for e, n in binades.items() if e <= cut)


#: the element counts a gradient row's nonzero count is made of
_COUNTS_READ = "one of elements, zeros, nan, inf"


def _nonzero(frame: pd.DataFrame) -> pd.Series:
    return frame["elements"] - frame["zeros"] - frame["nan"] - frame["inf"]


class _Histograms:
    """Gradient rows' exponent histograms as nonzero binades (:func:`_nonzero_binades`), each
    parsed on first use: the underflow at two scales and the scale hint read the same rows."""

    def __init__(self, texts: list[Any], zeros: list[Any]) -> None:
        self._texts = texts
        self._zeros = zeros
        self._parsed: dict[int, dict[int, int]] = {}

    def __getitem__(self, row: int) -> dict[int, int]:
        parsed = self._parsed.get(row)
        if parsed is None:
            zeros = self._zeros[row]
            parsed = _nonzero_binades(self._texts[row], 0 if pd.isna(zeros) else int(zeros))
            self._parsed[row] = parsed
        return parsed


def _lost_at(
    dtype: Any,
    loss_scale: Any,
    binades: _Histograms,
    row: int,
    underflow_at_scale: Any,
    nz: int,
    scale: float | None,
) -> tuple[float, str]:
    """One gradient row's lost share and its measure, at ``scale`` or the row's own scale."""
    if not nz:
        return 0.0, "subnormal" if dtype == "float16" else "flushed"
    own = float(loss_scale) if loss_scale and loss_scale > 0 else 1.0
    at = own if scale is None else scale
    counts = binades[row]  # parsed before any branch: a damaged histogram always raises
    if dtype == "float16":
        return _below(counts, -14, at) / nz, "subnormal"
    if scale is None:
        return int(underflow_at_scale) / nz, "flushed"
    return _below(counts, -25, at) / nz, "flushed"


#: the gradient rows' columns the underflow reads, and their value where a column is absent
_UNDERFLOW_COLUMNS = (
    ("dtype", None),
    ("loss_scale", None),
    ("exp_hist", None),
    ("zeros", 0),
    ("underflow_at_scale", None),
    ("nonzero", None),
)


class _Gradients:
    """A frame's gradient rows with their values as Python lists (what iterating the rows would
    give, at a fraction of the cost of one tuple per row); ``nonzero`` is added by the first
    :meth:`underflow` (the scale hint does not need the element counts)."""

    def __init__(self, frame: pd.DataFrame) -> None:
        self.frame = frame[frame["kind"].isin(GRAD_KINDS)].copy()
        n = len(self.frame)
        self.values = {
            name: self.frame[name].tolist() if name in self.frame else [default] * n
            for name, default in _UNDERFLOW_COLUMNS
            if name != "nonzero"
        }
        self.histograms = _Histograms(self.values["exp_hist"], self.values["zeros"])

    def underflow(self, scale: float | None) -> tuple[list[float], list[str]]:
        """Per row: :func:`compute_underflow`'s ``lost_share`` and ``measure``."""
        if "nonzero" not in self.values:
            self.frame["nonzero"] = _nonzero(self.frame)
            self.values["nonzero"] = self.frame["nonzero"].tolist()
        lost: list[float] = []
        measure: list[str] = []
        v = self.values
        rows = zip(v["dtype"], v["loss_scale"], v["underflow_at_scale"], v["nonzero"], strict=True)
        for i, (dtype, loss_scale, underflow, nonzero) in enumerate(rows):
            if nonzero != nonzero:  # NaN: a count missing from the record
                raise ValueError(
                    f"a damaged gradient row ({self._where(i)}): {_COUNTS_READ} missing"
                )
            share, kind = _lost_at(
                dtype, loss_scale, self.histograms, i, underflow, int(nonzero), scale
            )
            lost.append(share)
            measure.append(kind)
        return lost, measure

    def _where(self, i: int) -> str:
        row = self.frame.iloc[i]
        return f"module {row.get('module', '?')}, step {row.get('step', '?')}"

    def scale_hint(self, margin: float) -> dict[str, Any] | None:
        """:func:`compute_scale_hint` of these rows."""
        grads = self.frame
        amax = grads["amax"].dropna()
        amax = amax[(amax > 0) & amax.map(math.isfinite)]
        if amax.empty:
            return None
        peak = float(amax.max())
        hint = 2.0 ** math.floor(math.log2(FP16_MAX / margin / peak))
        scaled = grads[grads["loss_scale"].notna()].sort_values("step", kind="stable")
        current = float(scaled["loss_scale"].iloc[-1]) if len(scaled) else 1.0
        current_step = int(scaled["step"].iloc[-1]) if len(scaled) else None
        wide = (
            [i for i, d in enumerate(self.values["dtype"]) if d != "float16"]
            if "dtype" in grads
            else range(len(grads))
        )
        merged: dict[int, int] = {}
        for i in wide:
            for e, n in self.histograms[i].items():
                merged[e] = merged.get(e, 0) + n
        nonzero = sum(merged.values())

        def share(scale: float) -> float | None:
            if not nonzero:
                return None
            return round(_below(merged, -25, scale) / nonzero, 6)

        return {
            "grad_amax": peak,
            "margin": margin,
            "hint_scale": hint,
            "current_scale": current,
            "current_step": current_step,
            "underflow_share_at_current": share(current),
            "underflow_share_at_hint": share(hint),
        }


def compute_underflow(frame: pd.DataFrame, scale: float | None = None) -> pd.DataFrame:
    """Per gradient row: the share of nonzero values that fp16 with the row's loss scale loses.

    For gradients held wider than fp16 (fp32/bf16) the loss is exact: nonzero values that a
    real fp16 cast at the loss scale makes zero, scaled magnitude at most 2**-25
    (``underflow_at_scale``; values in ``(2**-25, 2**-24)`` round up to 2**-24 and are kept).
    For gradients already held in fp16 the lost values are zeros by now and cannot be told
    from true zeros, so the measure is the share of surviving values in fp16's subnormal range
    (scaled magnitude < 2**-14), which is where precision is already lost and the neighbouring
    values were flushed.

    Args:
        frame: ``numerics`` rows (other kinds than gradients are ignored).
        scale: evaluate every row at this loss scale instead of the one it was recorded with,
            from the exponent histograms (they hold unscaled magnitudes): the binades that
            lie wholly at or below 2**-25 at that scale flush; a tie at exactly 2**-25, which
            a binade does not resolve, is not counted. For fp16-held gradients values flushed
            at the recorded scale stay uncounted.

    Returns:
        The gradient rows with ``nonzero``, ``lost_share`` and ``measure`` (``flushed`` or
        ``subnormal``) columns added.
    """
    gradients = _Gradients(frame)
    grads = gradients.frame
    if grads.empty:
        return grads.assign(nonzero=[], lost_share=[], measure=[])
    lost, measure = gradients.underflow(scale)
    grads["lost_share"] = lost
    grads["measure"] = measure
    return grads


def compute_scale_hint(frame: pd.DataFrame, margin: float = 8.0) -> dict[str, Any] | None:
    """The largest power-of-two loss scale that keeps gradients under the fp16 max.

    Algorithm: ``amax`` is the largest unscaled gradient magnitude over every gradient row;
    the hint is ``2**floor(log2(65504 / margin / amax))``. Underflow shares come from the
    exponent histograms of the gradients held wider than fp16: nonzero gradients whose binade
    times the scale lies wholly at or below 2**-25 (what a real fp16 cast flushes; a tie at
    exactly 2**-25 is not resolved), over their nonzero values, at the current scale (the
    last recorded one: ``current_scale``, the scale of the last sampled step with a gradient
    row, ``current_step``, which need not be the run's final scale; ``None`` as the step when
    no row carries a scale, the scale then 1) and at the hint. Gradients held in fp16 are left out: their
    flushed values are zeros already, indistinguishable from true zeros (see
    :func:`compute_underflow` for what is measured there). With no wider gradient the shares
    are ``None``.

    Returns:
        ``None`` when no finite nonzero gradient was recorded.
    """
    return _Gradients(frame).scale_hint(margin)


def compute_gradient_underflow(
    frame: pd.DataFrame, margin: float = 8.0
) -> tuple[pd.DataFrame, dict[str, Any] | None, pd.Series]:
    """:func:`compute_underflow` of ``frame``, its :func:`compute_scale_hint` and the rows'
    lost share at that hint (their own shares when there is no hint), with each histogram
    parsed once for the three.

    Returns:
        ``(rows, hint, lost_share_at_hint)``: ``rows`` as :func:`compute_underflow` returns
        them, the hint or ``None``, and a series on the rows' index.
    """
    gradients = _Gradients(frame)
    grads = gradients.frame
    if grads.empty:
        empty = grads.assign(nonzero=[], lost_share=[], measure=[])
        return empty, None, empty["lost_share"]
    lost, measure = gradients.underflow(None)
    grads["lost_share"] = lost
    grads["measure"] = measure
    hint = gradients.scale_hint(margin)
    if hint is None:
        return grads, None, grads["lost_share"]
    at_hint, _ = gradients.underflow(hint["hint_scale"])
    return grads, hint, pd.Series(at_hint, index=grads.index, dtype=float)


def compute_layer_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (module, kind): totals over sampled steps (and ranks) and shares, with the
    :data:`COUNT_COLUMNS`."""
    if frame.empty:
        return pd.DataFrame()
    g = frame.groupby(["module", "kind"], sort=False)
    out = g[list(_SUM_COLUMNS)].sum()
    out["module_type"] = g["module_type"].first()
    out["dtype"] = g["dtype"].agg(lambda s: ",".join(sorted(set(s.dropna()))))
    out["amax"] = g["amax"].max()
    out["steps"] = g["step"].nunique()
    return _with_shares(out).reset_index()


#: the count columns :func:`compute_layer_summary` sums per (module, kind)
_SUM_COLUMNS = (
    "elements",
    "zeros",
    "nan",
    "inf",
    "over_fp16",
    "below_normal",
    "below_subnormal",
    "underflow_at_scale",
)


def _with_shares(out: pd.DataFrame) -> pd.DataFrame:
    """A layer summary's summed counts with ``zero_share`` and the :data:`COUNT_COLUMNS`."""
    out["zero_share"] = out["zeros"] / out["elements"].where(out["elements"] > 0)
    for column, (_, count) in COUNT_COLUMNS.items():
        out[column] = count(out)
    return out


def root_missing_reason(run: Run) -> str | None:
    """Why no root model was registered (``None`` when one was): the ``discovery_failed``
    reason, which starts with "root unknown" in runs that tried every way of finding one."""
    if run.events_of("model_registered"):
        return None
    failed = [str(e.get("reason")) for e in run.events_of("discovery_failed") if e.get("reason")]
    unknown = [r for r in failed if r.startswith("root unknown")]
    if unknown or failed:
        return (unknown or failed)[0]
    return "root unknown: no root model was registered"


def numerics_missing_reason(run: Run) -> str:
    """Why a run holds no per-layer numerics, in one line (rules' skip reasons, the report).

    In this order: the collector was not in ``Config.collectors``; it was switched off
    (``numerics_every=0``); no root model was known (:func:`root_missing_reason`); else no
    sampled step measured a layer.
    """
    configs: list[dict[str, Any]] = [
        c for r in run.ranks if isinstance(c := r.manifest.get("config"), dict)
    ]
    collectors: list[list[Any]] = [
        names for c in configs if isinstance(names := c.get("collectors"), list)
    ]
    if collectors and not any("numerics" in c for c in collectors):
        return "per-layer numerics were not recorded (add 'numerics' to Config.collectors)"
    if configs and all(c.get("numerics_every") == 0 for c in configs):
        return "per-layer numerics were not recorded (switched off: numerics_every=0)"
    root = root_missing_reason(run)
    if root is not None:
        return f"per-layer numerics were not recorded: no root model was known ({root})"
    return "per-layer numerics were not recorded: no sampled step measured a layer"


def own_layer_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """``numerics`` rows without a matmul layer's GEMM operands (kinds ``gemm_input``,
    ``gemm_weight``: another layer's output and a parameter again), as the summaries keep them."""
    if frame.empty or "kind" not in frame:
        return frame
    return frame[~frame["kind"].isin(NUMERICS_OPERAND_KINDS)]


def layer_summary(run: Run, rank: int | None = None) -> pd.DataFrame:
    """:func:`compute_layer_summary` of the run's numerics, of one rank or all (cached per run)."""

    def compute(r: Run) -> pd.DataFrame:
        frame = own_layer_rows(r.table("numerics"))
        if rank is not None and not frame.empty:
            frame = frame[frame["rank"] == rank]
        return compute_layer_summary(frame)

    return run.cached(f"layer_summary:{rank}", compute)


def nonfinite_input_steps(run: Run, rank: int) -> set[int]:
    """Steps of ``rank`` whose root-model inputs held non-finite values (computed once per run
    and rank; a new set each call)."""
    return set(run.cached(f"nonfinite_input_steps:{rank}", lambda r: _nonfinite_inputs(r, rank)))


def _nonfinite_inputs(run: Run, rank: int) -> frozenset[int]:
    """From the ``offenders`` summary section: every such step while the runs were not capped
    (more than :data:`~amprobe.store.sections.numerics.MAX_RUNS` runs keep the first ones)."""
    return frozenset(s for a, b in nonfinite_input_runs(run, rank) for s in range(a, b + 1))


def first_overflow_step(run: Run, rank: int, captured_step: int) -> int | None:
    """The first step that overflowed before the numerics of ``captured_step`` were recorded.

    A step overflowed when its gradients held inf/NaN (``found_inf``, a skipped update) or its
    loss was non-finite. Looks at the steps after the last step of ``rank`` with recorded
    numerics before ``captured_step``, up to and including ``captured_step``: an overflow arms
    a full capture from the next step, so the module that overflowed is seen one step or more
    after the first overflow. Steps with a non-finite model input (AMP-N04's) are left out.
    ``None`` when no such step overflowed.

    From the ``offenders`` summary section's overflow step runs (exact while they were not
    capped: the first :data:`~amprobe.store.sections.numerics.MAX_RUNS` runs are kept) and
    ``rank``'s own numerics file (:meth:`Run.rank_table`: the rules name one rank); see
    :func:`first_overflow_since` to give the previous sampled step instead.
    """
    if not offenders_section(run, rank).get("overflow", {}).get("runs", []):
        return None
    numerics = run.rank_table("numerics", rank)
    since = None
    if not numerics.empty:
        recorded = numerics["step"].to_numpy()
        earlier = recorded[(numerics["rank"].to_numpy() == rank) & (recorded < captured_step)]
        since = int(earlier.max()) if len(earlier) else None
    return first_overflow_since(run, rank, captured_step, since)


def first_overflow_since(run: Run, rank: int, captured_step: int, since: int | None) -> int | None:
    """:func:`first_overflow_step` given ``since``, the last step of ``rank`` before
    ``captured_step`` with recorded numerics (None: none); reads no file."""
    runs = offenders_section(run, rank).get("overflow", {}).get("runs", [])
    if not runs:
        return None
    since = -1 if since is None else since
    excluded = nonfinite_input_steps(run, rank)
    found = [
        s
        for first, last in runs
        for s in range(max(int(first), since + 1), min(int(last), captured_step) + 1)
        if s not in excluded
    ]
    return min(found) if found else None


def loss_nonfinite_before(run: Run, rank: int, step: int) -> int | None:
    """The last step of ``rank`` before ``step`` whose loss was non-finite (from the
    ``offenders`` summary section's runs), or ``None``."""
    runs = offenders_section(run, rank).get("loss_nonfinite", {}).get("runs", [])
    before = [min(int(last), step - 1) for first, last in runs if int(first) < step]
    return max(before) if before else None


def first_nonfinite_weights(run: Run, rank: int) -> dict[str, Any] | None:
    """The first armed step of ``rank`` that began with inf/NaN in the weights (the
    ``nonfinite_weights`` event: ``at_step``, ``count``, ``params``), or ``None``."""
    first = run.cached("first_nonfinite_weights", _first_nonfinite_weights).get(rank)
    return dict(first) if first is not None else None


def _first_nonfinite_weights(run: Run) -> dict[Any, dict[str, Any]]:
    """:func:`first_nonfinite_weights` of every rank, from one pass over the events."""
    out: dict[Any, dict[str, Any]] = {}
    for e in run.events_of("nonfinite_weights"):
        if not isinstance(e.get("at_step"), int):
            continue
        known = out.get(e.get("rank"))
        if known is None or e["at_step"] < known["at_step"]:
            out[e.get("rank")] = e
    return out


def offender_evidence(run: Run, rank: int) -> dict[str, Any]:
    """First forward / backward / input offenders of ``rank`` as evidence fields (empty if not
    recorded), from the ``offenders`` summary section: per kind the offender of the smallest
    step (the first in the file among offenders of one kind at one step)."""
    kinds = offenders_section(run, rank)["kinds"]
    out: dict[str, Any] = {}
    for kind in ("forward", "backward", "input"):
        first = (kinds.get(kind) or {}).get("first")
        if first is not None:
            out[f"first_{kind}_offender"] = {
                "module": first["module"],
                "module_type": first["module_type"],
                "step": int(first["step"]),
            }
    return out


#: the numerics columns :func:`layer_overflow_evidence` reads
_OVERFLOW_COLUMNS = ("step", "module", "dtype", "order", "nan", "inf", "over_fp16", "in_nonfinite")


def _nan_last(value: Any) -> tuple[bool, Any]:
    """A sort key that puts missing values last, as pandas sorts."""
    missing = bool(pd.isna(value))
    return missing, 0 if missing else value


def layer_overflow_evidence(run: Run, rank: int, limit: int = 5) -> dict[str, Any]:
    """Per-layer overflow evidence for ``rank``: the layers where non-finite or >65504 values arose.

    Algorithm: a forward output row counts when its module's inputs were finite
    (``in_nonfinite`` 0; null means an input could not be read, a wrapper tensor subclass:
    not checked, never counted as finite); a gradient row counts on steps whose forward
    outputs were all finite. Values that only carried an earlier overflow downstream (the
    NaNs every later layer and every gradient hold once one layer overflowed) are left out:
    counted by size they would push the layer that overflowed off the list. Layers are
    listed in the order they first overflowed (step, then forward before backward, then
    execution order); ``propagated_layer_count`` counts the (layer, kind) pairs that were
    non-finite only downstream of an overflow.

    Returns an empty dict when per-layer numerics were not recorded. Reads the rank's own
    numerics file (:meth:`Run.rank_table`): AMP-N11 names one rank.
    """
    numerics = run.rank_table("numerics", rank)
    if numerics.empty:
        return {}
    # the columns as arrays, the rank's rows picked once (frame operations per mask cost more
    # than the arithmetic on a few hundred rows)
    kind = numerics["kind"].to_numpy()
    own = (kind != "input") & ~np.isin(kind, NUMERICS_OPERAND_KINDS)  # a layer's own values
    mine = np.flatnonzero((numerics["rank"].to_numpy() == rank) & own)
    if not len(mine):
        return {}
    col = {c: numerics[c].to_numpy()[mine] for c in _OVERFLOW_COLUMNS}
    kind = kind[mine]
    nonfinite = col["nan"] + col["inf"]
    hit = (nonfinite + col["over_fp16"]) > 0
    outputs = kind == "output"
    step = col["step"]
    broken = set(step[outputs & (nonfinite > 0)].tolist())
    is_broken = pd.Series(step).isin(broken).to_numpy()
    inputs_finite = col["in_nonfinite"] == 0  # (null: not checked, never finite)
    origin = np.flatnonzero(hit & ((outputs & inputs_finite) | (~outputs & ~is_broken)))
    # in order of first overflow: step, forward before backward, execution order (stable)
    values = {c: col[c][origin].tolist() for c in ("step", "order", "module", "dtype", "over_fp16")}
    values["kind"] = kind[origin].tolist()
    values["nonfinite"] = nonfinite[origin].tolist()
    values["phase"] = (~outputs[origin]).astype(int).tolist()
    ranked = sorted(
        range(len(origin)),
        key=lambda i: (
            _nan_last(values["step"][i]),
            values["phase"][i],
            _nan_last(values["order"][i]),
        ),
    )
    # per (module, kind), in order of first overflow
    layers: dict[tuple[Any, Any], dict[str, Any]] = {}
    for i in ranked:
        module, layer_kind = values["module"][i], values["kind"][i]
        if pd.isna(module) or pd.isna(layer_kind):
            continue  # as a groupby drops a missing key
        layer = layers.setdefault(
            (module, layer_kind),
            {"dtypes": set(), "nonfinite": 0, "over_fp16": 0, "first_step": math.nan},
        )
        dtype, count, over, at = (values[c][i] for c in ("dtype", "nonfinite", "over_fp16", "step"))
        if not pd.isna(dtype):
            layer["dtypes"].add(dtype)
        layer["nonfinite"] += 0 if pd.isna(count) else count
        layer["over_fp16"] += 0 if pd.isna(over) else over
        if pd.isna(layer["first_step"]) and not pd.isna(at):
            layer["first_step"] = at
    propagated = {
        (str(m), str(k))
        for m, k in zip(col["module"][hit].tolist(), kind[hit].tolist(), strict=True)
    } - {(str(m), str(k)) for m, k in layers}
    return {
        "overflowing_layers": [
            {
                "module": module,
                "kind": layer_kind,
                "dtype": ",".join(sorted(layer["dtypes"])),
                "nonfinite_count": int(layer["nonfinite"]),
                "over_fp16_count": int(layer["over_fp16"]),
                "first_step": int(layer["first_step"]),
            }
            for (module, layer_kind), layer in list(layers.items())[:limit]
        ],
        "propagated_layer_count": len(propagated),
        **offender_evidence(run, rank),
    }


# -- from the per-rank summaries (amprobe.store.sections.numerics) -------------------------------
def numerics_section(run: Run, rank: int) -> dict[str, Any]:
    """The ``numerics`` summary section of ``rank`` (an empty one when it has none)."""
    return run.summaries().get(rank, {}).get("numerics") or {"rows": 0, "layers": []}


def offenders_section(run: Run, rank: int) -> dict[str, Any]:
    """The ``offenders`` summary section of ``rank`` (an empty one when it has none)."""
    empty = {"kinds": {}, "inputs": {"count": 0, "runs": {"runs": []}, "checked": 0}}
    return run.summaries().get(rank, {}).get("offenders") or empty


def last_linear_half(state: dict[str, Any]) -> set[str]:
    """The modules that were the last Linear of a sampled step's forward with a half output
    there (a ``numerics`` section's ``last_linear``)."""
    return _last_linear_half(state)


def has_numerics(run: Run) -> bool:
    """Whether any rank recorded a numerics row."""
    return any(numerics_section(run, r.rank)["rows"] for r in run.ranks)


def _measure(dtype: Any) -> str:
    return "subnormal" if dtype == "float16" else "flushed"


def _group_dtype(key: str) -> str | None:
    """The dtype part of a histogram or scale group's key (None when it was missing)."""
    dtype = key.split("|", 1)[0]
    return None if dtype == "None" else dtype


def gradient_underflow_layers(
    section: dict[str, Any], margin: float = 8.0
) -> tuple[pd.DataFrame, dict[str, Any] | None, dict[Any, dict[str, Any]]]:
    """:func:`compute_gradient_underflow` summed per (module, kind, measure), from a rank's
    ``numerics`` summary section (AMP-N06): :func:`gradient_underflow_rows` as a frame.

    Returns:
        ``(layers, hint, facts)``: ``layers`` indexed by (module, kind, measure) in order of
        first appearance with ``lost``, ``lost_at_hint`` and ``nonzero``; the
        :func:`compute_scale_hint` dict or ``None``; per index the first ``dtype``, the loss
        ``scales`` and the sampled ``steps``. An empty frame when no gradient was recorded.
    """
    rows, hint, facts = gradient_underflow_rows(section, margin)
    columns = ["lost", "lost_at_hint", "nonzero"]
    if not rows:
        return pd.DataFrame(columns=columns), hint, {}
    frame = pd.DataFrame(
        [r[1:] for r in rows],
        columns=columns,
        index=pd.MultiIndex.from_tuples([r[0] for r in rows]),
    )
    return frame, hint, {key: fact_steps(fact) for key, fact in facts.items()}


def fact_steps(fact: dict[str, Any]) -> dict[str, Any]:
    """A :func:`gradient_underflow_rows` fact with its sampled ``steps`` as a set (from the
    kept ``runs``)."""
    steps = {s for a, b in fact["runs"] for s in range(int(a), int(b) + 1)}
    return {"dtype": fact["dtype"], "scales": fact["scales"], "steps": steps}


def gradient_underflow_rows(
    section: dict[str, Any], margin: float = 8.0
) -> tuple[list[tuple[Any, float, float, float]], dict[str, Any] | None, dict[Any, dict[str, Any]]]:
    """:func:`compute_gradient_underflow` summed per (module, kind, measure), from a rank's
    ``numerics`` summary section (AMP-N06), as plain values (no frame: a rule reads it for
    every rank).

    Exact: the lost counts at the rows' own scales are summed in the section per loss scale,
    and the counts at the hint, linear in the histograms, come from the histograms summed per
    dtype. A layer's listed steps come from the section's first
    :data:`~amprobe.store.sections.numerics.MAX_LISTED` runs of its sampled steps per measure:
    they hold the first 20 steps and runs the evidence lists.

    Returns:
        ``(rows, hint, facts)``: ``rows`` as ``((module, kind, measure), lost, lost_at_hint,
        nonzero)`` in order of first appearance; the :func:`compute_scale_hint` dict or
        ``None``; per (module, kind, measure) the first ``dtype``, the loss ``scales`` and the
        ``runs`` of its sampled steps (:func:`fact_steps` makes them a set).
    """
    grads = [x for x in section.get("layers", []) if x["kind"] in GRAD_KINDS]
    if not grads:
        return [], None, {}
    for layer in grads:
        for group in layer["scale"].values():
            if group["damaged"] is not None:
                raise ValueError(
                    f"a damaged gradient row (module {layer['module']}, step "
                    f"{group['damaged']}): {_COUNTS_READ} missing"
                )
    # the scale hint: the largest finite amax, the last recorded scale, wide histograms
    peak = None
    merged: dict[int, int] = {}
    decoded: list[dict[str, dict[int, int]]] = []  # each layer's groups' bins, parsed once
    for layer in grads:
        decoded.append({})
        for key, group in layer["hist"].items():
            cls = key.split("|")[1]
            if group["amax"] is not None and cls not in ("nan", "inf", "zero"):
                peak = group["amax"] if peak is None else max(peak, group["amax"])
            bins = decoded[-1][key] = decode_bins(group["bins"])
            if _group_dtype(key) != "float16":
                for e, n in bins.items():
                    merged[e] = merged.get(e, 0) + n
    hint = (
        _scale_hint(peak, margin, merged, section.get("grad_scale")) if peak is not None else None
    )
    group_sums: list[int] = []
    for layer, parsed in zip(grads, decoded, strict=True):
        for key in layer["hist"]:
            if hint is None:
                group_sums.append(0)
                continue
            dtype = _group_dtype(key)
            # binades wholly at or below 2**bound once scaled by the hint
            cut = (-14 if dtype == "float16" else -25) - math.log2(hint["hint_scale"]) - 1
            group_sums.append(sum(n for e, n in parsed[key].items() if e <= cut))
    return _underflow_rows(grads, hint, group_sums)


def _underflow_rows(
    grads: list[Any],
    hint: dict[str, Any] | None,
    group_sums: list[int],
    measure_of: dict[str, str] | None = None,
) -> Any:
    """:func:`gradient_underflow_rows`' rows from the gradient layers, the scale hint and per
    histogram group of those layers (in order) its count at or below the flush bound at the
    hint. ``measure_of``: hist key -> its measure, kept across calls."""
    rows: list[tuple[Any, float, float, float]] = []
    facts: dict[Any, dict[str, Any]] = {}
    at = 0
    if measure_of is None:
        measure_of = {}
    for layer in grads:
        by_measure: dict[str, list[float]] = {}
        fact_of: dict[str, dict[str, Any]] = {}
        module, kind = layer["module"], layer["kind"]
        for group in layer["scale"].values():
            measure = _measure(group["dtype"])
            sums = by_measure.get(measure)
            if sums is None:
                sums = by_measure[measure] = [0.0, 0.0, 0.0]
                key = (module, kind, measure)
                fact = facts.get(key)
                if fact is None:
                    runs = layer["grad_steps"].get(measure, {}).get("runs", [])
                    fact = facts[key] = {"dtype": np.nan, "scales": set(), "runs": list(runs)}
                fact_of[measure] = fact
            sums[0] += group["lost"]
            sums[2] += group["nonzero"]
            fact_of[measure]["scales"].add(float(group["scale"]))
        if hint is not None:
            for hkey in layer["hist"]:
                of = measure_of.get(hkey)
                if of is None:
                    of = measure_of[hkey] = _measure(_group_dtype(hkey))
                if of in by_measure:
                    by_measure[of][1] += group_sums[at]
                at += 1
        else:
            at += len(layer["hist"])
            for sums in by_measure.values():
                sums[1] = sums[0]
        for dtype in layer["dtypes"]:
            found = facts.get((module, kind, _measure(dtype)))
            if found is not None and found["dtype"] is np.nan:
                found["dtype"] = dtype
        for measure, sums in by_measure.items():
            rows.append(((module, kind, measure), sums[0], sums[1], sums[2]))
    return rows, hint, facts


@dataclasses.dataclass(frozen=True)
class SectionBins:
    """The exponent histograms of the ``numerics`` sections of one rank per class of equal
    sections (:func:`~amprobe.analysis.frames.section_keys`), decoded once per run into flat
    arrays (:func:`section_bins`), for the rules that sum them per rank.

    Groups are numbered in reading order: representative ranks ascending, a rank's layers in
    section order, a layer's ``hist`` groups in dict order; ``first[rank]`` is the number of
    the representative ``rank``'s first group. Group ``g``'s binades are entries
    ``start[g]:start[g + 1]`` of ``exp`` and ``count`` (as :func:`decode_bins` reads the text,
    in its order)."""

    first: dict[int, int]
    start: np.ndarray  # int64, one more than the groups
    exp: np.ndarray  # int16 per entry (int64 for a damaged value)
    count: np.ndarray  # int32 per entry (int64 for a count past 2**31)

    def entries(self, nums: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The exponents and counts of groups ``nums``, group after group, and each group's
        number of entries."""
        lengths = self.start[nums + 1] - self.start[nums]
        firsts = np.repeat(self.start[nums] - (np.cumsum(lengths) - lengths), lengths)
        entry = firsts + np.arange(int(lengths.sum()))
        return self.exp[entry], self.count[entry], lengths


def _bins_text(bins: Any) -> str:
    return bins if isinstance(bins, str) else encode_bins(decode_bins(bins))


def compute_section_bins(summaries: dict[int, dict[str, Any]], keys: dict[int, int]) -> SectionBins:
    """:class:`SectionBins` of ``summaries`` (``keys``: each rank's class). Raises
    ``ValueError`` on a text that is not ``e,n`` pairs of integers (as :func:`decode_bins`
    would; a caller falls back to reading that rank's texts one by one)."""
    first: dict[int, int] = {}
    seen: set[int] = set()
    texts: list[str] = []
    for rank in sorted(summaries):
        if keys[rank] in seen:
            continue
        seen.add(keys[rank])
        first[rank] = len(texts)
        section = summaries[rank].get("numerics") or {}
        for layer in section.get("layers") or []:
            texts += [_bins_text(group["bins"]) for group in layer["hist"].values()]
    pairs = np.fromiter(
        ((t.count(",") + 1) // 2 if t else 0 for t in texts), np.int64, count=len(texts)
    )
    start = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(pairs, out=start[1:])
    values = _parse_pairs([t for t in texts if t], int(start[-1]))
    if len(values) and (np.abs(values) == np.iinfo(np.int64).max).any():
        raise ValueError("a damaged exponent histogram in a numerics summary: out of range")
    exp, count = values[:, 0], values[:, 1]
    # held for the run's life: the narrowest type that holds them (80 MB -> 29 MB at 4,096
    # distinct ranks); the binades lie in -149..128, a count past 2**31 keeps int64
    if not len(values) or (exp.min() >= -1000 and exp.max() <= 1000):
        exp = exp.astype(np.int16)
    if not len(values) or (count.min() >= 0 and count.max() < 2**31):
        count = count.astype(np.int32)
    return SectionBins(first=first, start=start, exp=exp.copy(), count=count.copy())


def section_bins(run: Run) -> SectionBins:
    """:func:`compute_section_bins` of the run, computed once per run."""
    return run.cached(  # type: ignore[no-any-return]
        "section_bins",
        lambda r: compute_section_bins(r.summaries(), section_keys(r, "numerics")),
    )


def _section_bins_or_none(run: Run) -> SectionBins | None:
    """:func:`section_bins`, None where a text cannot be read as one array (then each reader
    parses the texts itself and names the bad one)."""
    try:
        return section_bins(run)
    except (ValueError, OverflowError):
        return None


def _hint_scale(peak: float, margin: float) -> float:
    return 2.0 ** math.floor(math.log2(FP16_MAX / margin / peak))


_Underflow = tuple[
    list[tuple[Any, float, float, float]], dict[str, Any] | None, dict[Any, dict[str, Any]]
]


def gradient_underflow_classes(run: Run, margin: float = 8.0) -> dict[int, _Underflow | Exception]:
    """:func:`gradient_underflow_rows` of each class of equal ``numerics`` sections
    (:func:`~amprobe.analysis.frames.section_keys`; the class -> its rows, or the
    ``ValueError`` that rank's rows raise), the histograms of every class summed at once from
    :func:`section_bins` instead of decoded per rank. Exact: the same sums of the same integer
    counts (float sums of counts, exact below 2**53). Where a histogram text cannot be read
    as one array, each class is worked out by :func:`gradient_underflow_rows`."""
    keys = section_keys(run, "numerics")
    summaries = run.summaries()
    reps: dict[int, int] = {}
    for rank in sorted(summaries):
        reps.setdefault(keys[rank], rank)
    out: dict[int, _Underflow | Exception] = {}
    bins = _section_bins_or_none(run)
    if bins is None:
        for key, rank in reps.items():
            try:
                out[key] = gradient_underflow_rows(numerics_section(run, rank), margin)
            except ValueError as exc:
                out[key] = exc
        return out
    # each class's gradient layers, their groups' numbers, the scale hint's inputs
    work: list[tuple[int, list[Any], int, float | None]] = []
    l_first: list[int] = []  # per gradient layer: its first group's number, its groups, class
    l_size: list[int] = []
    l_work: list[int] = []
    g_fp16: list[bool] = []  # per gradient group: whether its dtype is float16
    key_info: dict[str, tuple[bool, bool]] = {}  # hist key -> (finite amax class, float16)
    for key, rank in reps.items():
        section = numerics_section(run, rank)
        layers = section.get("layers", [])
        if not any(x["kind"] in GRAD_KINDS for x in layers):
            out[key] = ([], None, {})
            continue
        g = bins.first.get(rank, 0)
        grads: list[Any] = []
        peak = None
        damaged = False
        n_layers, n_groups = len(l_first), len(g_fp16)
        for layer in layers:
            hist = layer["hist"]
            if layer["kind"] not in GRAD_KINDS:
                g += len(hist)
                continue
            grads.append(layer)
            for group in layer["scale"].values():
                damaged = damaged or group["damaged"] is not None
            l_first.append(g)
            l_size.append(len(hist))
            l_work.append(len(work))
            g += len(hist)
            for hkey, group in hist.items():
                info = key_info.get(hkey)
                if info is None:
                    cls = hkey.split("|")[1]
                    info = key_info[hkey] = (
                        cls not in ("nan", "inf", "zero"),
                        _group_dtype(hkey) == "float16",
                    )
                amax = group["amax"]
                if amax is not None and info[0]:
                    peak = amax if peak is None else max(peak, amax)
                g_fp16.append(info[1])
        if damaged:
            try:  # the error, raised where a rank's own rows raise it
                out[key] = gradient_underflow_rows(section, margin)
            except ValueError as exc:
                out[key] = exc
            del l_first[n_layers:], l_size[n_layers:], l_work[n_layers:], g_fp16[n_groups:]
            continue
        work.append((key, grads, len(g_fp16) - n_groups, peak))
    if not work:
        return out
    sizes = np.array(l_size, dtype=np.int64)
    g_num = np.repeat(
        np.array(l_first, dtype=np.int64) - (np.cumsum(sizes) - sizes), sizes
    ) + np.arange(int(sizes.sum()))
    g_rep = np.repeat(np.array(l_work, dtype=np.int64), sizes)
    # the entries of the gradient groups, each with its group's position in g_num
    num = g_num
    lengths = bins.start[num + 1] - bins.start[num]
    local = np.repeat(np.arange(len(num)), lengths)
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    entry = bins.start[num][local] + offsets
    exp = bins.exp[entry]
    count = bins.count[entry].astype(float)
    rep = g_rep[local]
    fp16 = np.array(g_fp16, dtype=bool)
    wide = ~fp16[local]
    n_work = len(work)
    total = np.bincount(rep[wide], weights=count[wide], minlength=n_work)
    hint_scale = np.ones(n_work)
    current = np.ones(n_work)
    for i, (key, _, _, peak) in enumerate(work):
        if peak is not None:
            hint_scale[i] = _hint_scale(peak, margin)
            last = numerics_section(run, reps[key]).get("grad_scale")
            current[i] = float(last[1]) if last else 1.0

    def below(cut: np.ndarray, mask: np.ndarray, owner: np.ndarray, n: int) -> np.ndarray:
        """The counts of the masked entries at or below their owner's ``cut``, per owner."""
        keep = mask & (exp <= cut[owner])
        return np.bincount(owner[keep], weights=count[keep], minlength=n)

    log_cur = np.array([math.log2(c) for c in current])
    log_hint = np.array([math.log2(h) for h in hint_scale])
    below_cur = below(-25 - log_cur - 1, wide, rep, n_work)
    below_hint = below(-25 - log_hint - 1, wide, rep, n_work)
    g_cut = np.where(fp16, -14.0, -25.0) - log_hint[g_rep] - 1
    at_hint = below(g_cut, np.ones(len(exp), dtype=bool), local, len(num)).astype(np.int64)
    pos = 0
    measure_of: dict[str, str] = {}
    for i, (key, grads, n_groups, peak) in enumerate(work):
        hint = None
        if peak is not None:
            tot = int(total[i])
            last = numerics_section(run, reps[key]).get("grad_scale")
            hint = {
                "grad_amax": float(peak),
                "margin": margin,
                "hint_scale": float(hint_scale[i]),
                "current_scale": float(current[i]),
                "current_step": int(last[0]) if last else None,
                "underflow_share_at_current": (round(int(below_cur[i]) / tot, 6) if tot else None),
                "underflow_share_at_hint": round(int(below_hint[i]) / tot, 6) if tot else None,
            }
        group_sums = at_hint[pos : pos + n_groups].tolist()
        pos += n_groups
        out[key] = _underflow_rows(grads, hint, group_sums, measure_of)
    return out


def nonfinite_input_runs(run: Run, rank: int) -> list[list[int]]:
    """The runs of steps of ``rank`` whose root-model inputs held inf/NaN (the first
    :data:`~amprobe.store.sections.numerics.MAX_RUNS`)."""
    return [list(x) for x in offenders_section(run, rank)["inputs"]["runs"]["runs"]]


def _scale_hint(
    peak: float, margin: float, merged: dict[int, int], last: list[Any] | None
) -> dict[str, Any]:
    """:func:`compute_scale_hint`'s dict from the largest finite gradient ``amax``, the wide
    gradients' nonzero binades summed (:func:`_nonzero_binades` keys) and ``[step, scale]``
    of the last sampled step with a scaled gradient row (None: none)."""
    hint_scale = _hint_scale(peak, margin)
    total = sum(merged.values())

    def share(scale: float) -> float | None:
        return round(_below(merged, -25, scale) / total, 6) if total else None

    current = float(last[1]) if last else 1.0
    return {
        "grad_amax": float(peak),
        "margin": margin,
        "hint_scale": hint_scale,
        "current_scale": current,
        "current_step": int(last[0]) if last else None,
        "underflow_share_at_current": share(current),
        "underflow_share_at_hint": share(hint_scale),
    }


# -- every rank at once, from the summaries and the derived store (the report at many ranks) -----
#: :data:`COUNT_COLUMNS` as SQL over the derived ``numerics`` relation (null where a part is
#: missing, as pandas' NaN): the same count per row
COUNT_SQL: dict[str, str] = {
    "nonfinite": "nan + inf",
    "fp16_inf": "over_fp16 + inf",
    "below_subnormal": "below_subnormal",
}
#: binades of :class:`LayerHistograms`' columns: column 0 is -134, the lump of nonzero values
#: below 2**-133 (the summaries key it by its top binade), the last 127
HIST_LOW, HIST_HIGH = _LUMP_TOP, 127
#: histogram groups parsed per block (the text and its numbers stay ~40 MB at any rank count)
_HIST_BLOCK = 65536


def summary_layers(summaries: dict[int, dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """``(rank, layer)`` of every rank's ``numerics`` summary section: ranks ascending, a rank's
    layers in order of first appearance in its file (the merged table's row order)."""
    return [
        (rank, layer)
        for rank in sorted(summaries)
        for layer in (summaries[rank].get("numerics") or {}).get("layers") or []
    ]


def class_representatives(
    summaries: dict[int, dict[str, Any]], keys: dict[int, int] | None
) -> dict[int, int]:
    """The lowest rank of each class of ranks with equal ``numerics`` sections (``keys``:
    :func:`~amprobe.analysis.frames.section_keys` of ``numerics``; None: every rank alone)
    -> the ranks of its class, ascending."""
    if keys is None:
        return dict.fromkeys(sorted(summaries), 1)
    first: dict[Any, int] = {}
    weight: dict[int, int] = {}
    for rank in sorted(summaries):
        key = keys.get(rank, ("rank", rank))  # a rank without a class: alone
        rep = first.setdefault(key, rank)
        weight[rep] = weight.get(rep, 0) + 1
    return dict(sorted(weight.items()))


def _weighted_layers(
    summaries: dict[int, dict[str, Any]], keys: dict[int, int] | None
) -> list[tuple[dict[str, Any], int]]:
    """``(layer, weight)`` of :func:`summary_layers`, read once per class of ranks with equal
    sections (``keys``: :func:`~amprobe.analysis.frames.section_keys` of ``numerics``; None:
    every rank alone): the layers of each
    class's lowest rank, ``weight`` the ranks of its class.

    Their sums times the weights are the sums over every rank, in the same order of first
    appearance: a layer's first rank is the lowest of its class (a lower rank of the class
    would hold the layer too)."""
    if keys is None:
        return [(layer, 1) for _, layer in summary_layers(summaries)]
    return [
        (layer, weight)
        for rank, weight in class_representatives(summaries, keys).items()
        for layer in (summaries[rank].get("numerics") or {}).get("layers") or []
    ]


def compute_layer_summary_summaries(
    summaries: dict[int, dict[str, Any]],
    steps: dict[tuple[str, str], int],
    keys: dict[int, int] | None = None,
) -> pd.DataFrame:
    """:func:`compute_layer_summary` of every rank's rows, from their ``numerics`` summary
    sections: the same columns, rows and values (the sums of a count that some row did not
    record as floats, as the table's are).

    A section counts its own rank's sampled steps; the distinct steps of a layer over the
    ranks are not in the summaries: ``steps`` gives them per (module, kind) (from the derived
    store), a layer missing from it gets none (null). ``keys``:
    :func:`~amprobe.analysis.frames.section_keys` of ``numerics``, to read each class of equal
    sections once.
    """
    layers = _weighted_layers(summaries, keys)
    if not layers:
        return pd.DataFrame()
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for layer, weight in layers:
        key = (layer["module"], layer["kind"])
        row = rows.get(key)
        if row is None:
            row = rows[key] = {
                **dict.fromkeys(_SUM_COLUMNS, 0),
                "module_type": None,
                "dtype": set(),
                "amax": math.nan,
            }
        counts = layer["counts"]
        for column in _SUM_COLUMNS:
            row[column] += counts.get(column, 0) * weight
        if row["module_type"] is None:
            row["module_type"] = layer["module_type"]
        row["dtype"].update(layer["dtypes"])
        amax = layer["amax"]
        if amax is not None and not amax <= row["amax"]:  # (NaN: none yet)
            row["amax"] = float(amax)
    # a count some row did not record is a float column in the table, its sums too
    missing = {c for layer, _ in layers for c in layer.get("missing") or {}}
    out = pd.DataFrame(
        {
            **{
                c: np.array(
                    [r[c] for r in rows.values()], dtype=float if c in missing else np.int64
                )
                for c in _SUM_COLUMNS
            },
            "module_type": [r["module_type"] for r in rows.values()],
            "dtype": [",".join(sorted(r["dtype"])) for r in rows.values()],
            "amax": np.array([r["amax"] for r in rows.values()], dtype=float),
            "steps": [steps.get(key) for key in rows],
        },
        index=pd.MultiIndex.from_tuples(list(rows), names=["module", "kind"]),
    )
    return _with_shares(out).reset_index()


@dataclasses.dataclass(frozen=True)
class LayerHistograms:
    """Every rank's exponent histograms summed per (module, kind), from the ``numerics``
    summary sections: the count of nonzero finite values per binade (zeros and inf/NaN left
    out; column ``j`` holds binade ``HIST_LOW + j``, column 0 the values below 2**-133).

    Exact: a section's groups hold each row's nonzero binades (``exp_hist`` with the row's
    zeros taken out of bin -127), so their sum over the groups and ranks is the sum over the
    rows of the merged table.

    Attributes:
        keys: (module, kind) of every layer of every rank, in order of first appearance
            (ranks ascending), those without a histogram too.
        counts: ``(len(keys), HIST_HIGH - HIST_LOW + 1)`` int64 counts, every dtype.
        wide: the same of the rows held wider than fp16 (dtype not ``float16``, or none).
    """

    keys: list[tuple[str, str]]
    counts: np.ndarray
    wide: np.ndarray

    def binades(self, key: tuple[str, str], wide: bool = False) -> dict[int, int]:
        """Binade -> count (counts above 0) of one layer; the lump keyed -134."""
        row = (self.wide if wide else self.counts)[self.keys.index(key)]
        return {int(j) + HIST_LOW: int(row[j]) for j in np.flatnonzero(row)}


def compute_layer_histograms(
    summaries: dict[int, dict[str, Any]],
    keys: dict[int, int] | None = None,
    bins: SectionBins | None = None,
) -> LayerHistograms:
    """:class:`LayerHistograms` of the ranks' ``numerics`` summary sections (``keys``:
    :func:`~amprobe.analysis.frames.section_keys` of ``numerics``, to read each class of equal
    sections once; ``bins``: their histograms decoded already, :func:`section_bins` of the
    same ``keys``).

    The groups' ``"e,n,e,n"`` texts are parsed as one number list per block of groups (no
    Python loop per binade), each pair added to its layer's row.
    """
    if bins is not None and keys is not None:
        if all(rank in bins.first for rank in class_representatives(summaries, keys)):
            return _layer_histograms_of_bins(summaries, keys, bins)
    index: dict[tuple[str, str], int] = {}
    rows: list[int] = []  # per layer of a rank: its (module, kind)'s row
    weights: list[int] = []  # per layer of a rank: the ranks it stands for
    sizes: list[int] = []  # per layer of a rank: its groups
    names: list[str] = []  # per group: "dtype|amax class|top"
    raw: list[Any] = []  # per group: its bins
    for layer, weight in _weighted_layers(summaries, keys):
        rows.append(index.setdefault((layer["module"], layer["kind"]), len(index)))
        weights.append(weight)
        hist = layer["hist"]
        sizes.append(len(hist))
        names.extend(hist)
        raw.extend(group["bins"] for group in hist.values())
    texts = [b if isinstance(b, str) else encode_bins(decode_bins(b)) for b in raw]
    # each group's layer row, times 2, plus 1 when held wider than fp16
    wide = np.fromiter((not k.startswith("float16|") for k in names), bool, count=len(names))
    owner = 2 * np.repeat(np.asarray(rows, dtype=np.int64), sizes) + wide
    weight_of = np.repeat(np.asarray(weights, dtype=np.float64), sizes)
    kept = np.fromiter((bool(t) for t in texts), dtype=bool, count=len(texts))
    owners, group_weights = owner[kept], weight_of[kept]
    texts = [t for t in texts if t]
    width = HIST_HIGH - HIST_LOW + 1
    sums = np.zeros(2 * len(index) * width, dtype=np.int64)
    for g0 in range(0, len(texts), _HIST_BLOCK):
        block = texts[g0 : g0 + _HIST_BLOCK]
        pairs = np.fromiter((t.count(",") for t in block), np.int64, count=len(block)) // 2 + 1
        values = _parse_pairs(block, int(pairs.sum()))
        at = np.repeat(owners[g0 : g0 + _HIST_BLOCK], pairs)
        cols = np.minimum(np.maximum(values[:, 0] - HIST_LOW, 0), width - 1)
        counts = values[:, 1] * np.repeat(group_weights[g0 : g0 + _HIST_BLOCK], pairs)
        # float sums of counts: exact below 2**53
        summed = np.bincount(at * width + cols, weights=counts, minlength=len(sums))
        sums += summed.astype(np.int64)
    split = sums.reshape(len(index), 2, width)
    return LayerHistograms(keys=list(index), counts=split.sum(axis=1), wide=split[:, 1].copy())


def _layer_histograms_of_bins(
    summaries: dict[int, dict[str, Any]], keys: dict[int, int], bins: SectionBins
) -> LayerHistograms:
    """:func:`compute_layer_histograms` from the decoded histograms: the same sums of the same
    counts (each group's entries in its text's order, float sums exact below 2**53)."""
    index: dict[tuple[str, str], int] = {}
    rows: list[int] = []  # per layer of a rank: its (module, kind)'s row
    weights: list[int] = []  # per layer of a rank: the ranks it stands for
    sizes: list[int] = []  # per layer of a rank: its groups
    firsts: list[int] = []  # per layer of a rank: its first group's number in bins
    names: list[str] = []  # per group: "dtype|amax class|top"
    for rank, weight in class_representatives(summaries, keys).items():
        g = bins.first[rank]
        for layer in (summaries[rank].get("numerics") or {}).get("layers") or []:
            rows.append(index.setdefault((layer["module"], layer["kind"]), len(index)))
            weights.append(weight)
            hist = layer["hist"]
            sizes.append(len(hist))
            firsts.append(g)
            g += len(hist)
            names.extend(hist)
    size = np.asarray(sizes, dtype=np.int64)
    nums = np.repeat(np.asarray(firsts, dtype=np.int64) - (np.cumsum(size) - size), size)
    nums += np.arange(len(nums))
    wide = np.fromiter((not k.startswith("float16|") for k in names), bool, count=len(names))
    owners = 2 * np.repeat(np.asarray(rows, dtype=np.int64), size) + wide
    group_weights = np.repeat(np.asarray(weights, dtype=np.float64), size)
    width = HIST_HIGH - HIST_LOW + 1
    sums = np.zeros(2 * len(index) * width, dtype=np.int64)
    for g0 in range(0, len(nums), _HIST_BLOCK):
        exp, count, pairs = bins.entries(nums[g0 : g0 + _HIST_BLOCK])
        at = np.repeat(owners[g0 : g0 + _HIST_BLOCK], pairs)
        cols = np.minimum(np.maximum(exp - HIST_LOW, 0), width - 1)
        counts = count * np.repeat(group_weights[g0 : g0 + _HIST_BLOCK], pairs)
        # float sums of counts: exact below 2**53
        summed = np.bincount(at * width + cols, weights=counts, minlength=len(sums))
        sums += summed.astype(np.int64)
    split = sums.reshape(len(index), 2, width)
    return LayerHistograms(keys=list(index), counts=split.sum(axis=1), wide=split[:, 1].copy())


def _parse_pairs(texts: list[str], pairs: int) -> np.ndarray:
    """``"e,n,e,n"`` texts (``pairs`` pairs in all) as one ``(pairs, 2)`` int64 array (numpy's
    C parser; a text it cannot read to its end is parsed again by ``int``, which names the bad
    value)."""
    joined = ",".join(texts)
    expected = 2 * pairs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a text numpy cannot read to its end raises
        try:
            values = np.fromstring(joined, dtype=np.int64, sep=",")
        except (ValueError, DeprecationWarning):
            values = np.array([int(v) for v in joined.split(",")], dtype=np.int64)
    if len(values) != expected:
        raise ValueError("a damaged exponent histogram in a numerics summary: not e,n pairs")
    return values.reshape(-1, 2)


def layer_histograms(run: Run) -> LayerHistograms:
    """:func:`compute_layer_histograms` of the run's summaries (computed once per run, each
    class of ranks with equal sections read once)."""
    return run.cached(  # type: ignore[no-any-return]
        "layer_histograms",
        lambda r: compute_layer_histograms(
            r.summaries(), section_keys(r, "numerics"), _section_bins_or_none(r)
        ),
    )


def compute_scale_hint_summaries(
    summaries: dict[int, dict[str, Any]],
    margin: float = 8.0,
    histograms: LayerHistograms | None = None,
    keys: dict[int, int] | None = None,
) -> dict[str, Any] | None:
    """:func:`compute_scale_hint` of every rank's rows, from their ``numerics`` summary
    sections: the same dict.

    Exact: the largest finite gradient ``amax`` is the largest of the histogram groups'
    (a group of one amax class holds finite positive amaxes or none), the current scale is
    that of the last sampled step with a scaled gradient row (each section's ``grad_scale``;
    ranks in order, the highest rank's among equal steps, as the merged table's last row),
    and the wide gradients' histograms summed over the ranks are the rows' sum.

    ``histograms``: :func:`compute_layer_histograms` of ``summaries`` when the caller has it;
    ``keys``: :func:`~amprobe.analysis.frames.section_keys` of ``numerics``, to read each
    class of equal sections once.
    """
    peak: float | None = None
    last: list[Any] | None = None
    for rank in sorted(summaries):
        scale = (summaries[rank].get("numerics") or {}).get("grad_scale")
        if scale is not None and (last is None or scale[0] >= last[0]):
            last = scale
    for layer, _ in _weighted_layers(summaries, keys):
        if layer["kind"] not in GRAD_KINDS:
            continue
        for name, group in layer["hist"].items():
            if group["amax"] is not None and name.split("|")[1] not in ("nan", "inf", "zero"):
                peak = group["amax"] if peak is None else max(peak, group["amax"])
    if peak is None:
        return None
    hists = compute_layer_histograms(summaries, keys) if histograms is None else histograms
    rows = [i for i, (_, kind) in enumerate(hists.keys) if kind in GRAD_KINDS]
    wide = hists.wide[rows].sum(axis=0)
    merged = {int(j) + HIST_LOW: int(wide[j]) for j in np.flatnonzero(wide)}
    return _scale_hint(peak, margin, merged, last)


def numerics_cells(
    relation: Any, counts: list[str], ranks: np.ndarray, size: int, exact: bool
) -> pd.DataFrame:
    """Per bucket of ``size`` consecutive ranks of ``ranks`` (bucket ``i``: ``ranks[i*size :
    (i+1)*size]``), module, kind and sampled step of the derived ``numerics`` relation, for
    each :data:`COUNT_SQL` column ``c`` of ``counts``: ``c``, the largest of the bucket's
    ranks' counts there (null when none recorded one), ``c_rank``, the rank holding it (the
    lowest of equal ones; the lowest rank when none recorded one), and ``n_ranks``, how many
    of its ranks have a row there. One ``GROUP BY`` in DuckDB: a few thousand cells back.

    ``exact``: sum a rank's rows of one (module, kind, step) first, as the merged table's
    cells are (needed only when a rank may hold a repeated row; the summaries say when not:
    several times slower at thousands of ranks). Rows without a module, kind or step are left
    out (the summaries leave them out too).
    """
    ranks = np.asarray(ranks, dtype=np.int64)
    top = int(ranks.max(initial=0)) + 1  # a key v * top - rank orders by v, then lowest rank
    where = "module IS NOT NULL AND kind IS NOT NULL AND step IS NOT NULL"
    where += f" AND kind NOT IN {tuple(NUMERICS_OPERAND_KINDS)!r}"  # (as the summaries)
    if len(ranks):  # the ranks given only (a store built later may hold more)
        where += f" AND rank BETWEEN {int(ranks.min())} AND {int(ranks.max())}"
    parts = [f"{COUNT_SQL[c]} AS v{i}" for i, c in enumerate(counts)]
    if exact:
        sums = ", ".join(f"sum({COUNT_SQL[c]}) AS v{i}" for i, c in enumerate(counts))
        rows = f"SELECT rank, module, kind, step, {sums} FROM s WHERE {where} GROUP BY ALL"
    else:
        rows = f"SELECT rank, module, kind, step, {', '.join(parts)} FROM s WHERE {where}"
    contiguous = len(ranks) > 0 and bool((np.diff(ranks) == 1).all())
    if contiguous:
        bucket, join = f"(rank - {int(ranks[0])}) // {size}", ""
    else:
        values = ",".join(f"({int(r)},{i // size})" for i, r in enumerate(ranks))
        bucket, join = "b.bucket", f"JOIN (VALUES {values}) AS b(rank, bucket) USING (rank)"
    aggregates = ", ".join(
        f'max(v{i}) AS "{c}", '
        f'arg_max(rank, coalesce(v{i}, -1)::HUGEINT * {top} - rank) AS "{c}_rank"'
        for i, c in enumerate(counts)
    )
    sql = (
        f"SELECT {bucket} AS bucket, module, kind, step, count(*) AS n_ranks, {aggregates} "
        f"FROM ({rows}) AS r {join} GROUP BY ALL ORDER BY bucket, module, kind, step"
    )
    return relation.query("s", sql).df()  # type: ignore[no-any-return]
