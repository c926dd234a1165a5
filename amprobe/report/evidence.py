"""A finding's evidence as a person reads it: sentences, labelled values and small tables.

One rendering for every output: the HTML report (:mod:`amprobe.report.document`), the dashboard
(``dashboard.layout.build_finding``) and the text and Markdown renderers turn the neutral
blocks of :func:`render_evidence` into their own markup. The keys follow the vocabulary of
``docs/evidence.md``, so a generic renderer reads every rule's evidence:

- ``*_steps`` (at most the first 20) with ``*_step_ranges`` (every step, as runs) and the
  matching count (``*_count``, ``*_step_count``): ``120–179 (60)``; where the steps left out
  are not known, the text says how many were shown;
- ``*_count``: an integer with thousands separators; ``*_share``: a percentage;
  ``*_pct``: already a percentage; ``*_s``: seconds (``31 ms``, ``1.25 s``);
- a loss scale (``*scale*``): a power of two far from 1 as ``2^-42 (2.27e-13)``;
- ``rank`` / ``ranks``: ``ranks 0-3``; ``module``, ``module_type`` and a dict naming a
  ``module`` (``first_forward_offender``): ``booster (Booster), step 81``;
- a list of dicts (``layers``): a table; ``by_rank``: a table with one row per rank;
- the rule's thresholds (the names in its registry entry, ``threshold``, ``*_threshold``): one
  line at the end, each by its name.

Numbers keep three significant digits; nothing renders as ``null``, ``None``, ``true`` or a
JSON or dict repr. :data:`VIEWS` holds, by rule ID, what the generic renderer cannot guess:
a key whose fraction is a percentage without a ``_share`` suffix, a better label, a sentence.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from amprobe.analysis.frames import MAX_LISTED_STEPS, points_text, range_text, steps_text
from amprobe.analysis.numerics import COUNT_DEFINITIONS
from amprobe.rules.engine import REGISTRY, Finding, format_ranks

__all__ = [
    "Text",
    "Facts",
    "Table",
    "Block",
    "EvidenceView",
    "VIEWS",
    "render_evidence",
    "evidence_lines",
    "format_number",
    "format_steps",
    "finding_step",
    "finding_layer",
    "finding_anchors",
    "fix_parts",
    "FINDING_ANCHOR_PREFIX",
    "STEP_VIEW_CATEGORIES",
]

_MAX_TEXT = 300  # characters of one text value before it is cut at a word
_MAX_ROWS = 50  # rows of an evidence table


@dataclasses.dataclass(frozen=True)
class Text:
    """A sentence."""

    text: str


@dataclasses.dataclass(frozen=True)
class Facts:
    """Labelled values, in order: ``(label, value)`` pairs of plain text."""

    items: tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class Table:
    """A small table of plain text cells, with a caption (the evidence key it comes from)."""

    caption: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""  # e.g. "first 50 of 120 rows shown"


Block = Text | Facts | Table


@dataclasses.dataclass(frozen=True)
class EvidenceView:
    """What one rule's evidence needs beyond the generic renderer (data, by rule ID).

    Attributes:
        percent: keys whose value is a fraction in [0, 1] shown as a percentage.
        labels: key -> label, where the key's words read badly.
        sentence: a function of the evidence returning a sentence to show first, or None when
            the keys it reads are absent (the generic facts then say it all).
        said: keys the sentence already says, left out of the facts when it is shown.
        counts: ``*_steps`` key -> the key of its count, where it is not ``<prefix>_count``.
        codes: keys whose value is a code word (``nonfinite_weights``), shown as words.
        percent_points: keys whose number is already a percentage (0-100).
    """

    percent: tuple[str, ...] = ()
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    sentence: Callable[[Mapping[str, Any]], str | None] | None = None
    said: tuple[str, ...] = ()
    counts: Mapping[str, str] = dataclasses.field(default_factory=dict)
    codes: tuple[str, ...] = ()
    percent_points: tuple[str, ...] = ()


#: label of a key wherever it appears (its words, with units and abbreviations, read badly)
_LABELS: Mapping[str, str] = MappingProxyType(
    {
        "module": "layer",
        "module_type": "layer type",
        "offending_modules": "offending layers",
        "first_forward_offender": "first forward offender",
        "first_backward_offender": "first backward offender",
        "first_input_offender": "first input offender",
        "flops_share": "share of matmul FLOPs",
        "flop_share": "share of matmul FLOPs",
        "matmul_flops": "matmul FLOPs",
        "flops_per_byte": "FLOPs per byte",
        "min_flops_per_byte": "min FLOPs per byte",
        "candidate_flops_share": "candidates' share of matmul FLOPs",
        "trainable_param_count": "trainable parameters",
        "activation_lost_e4m3": "activations lost in e4m3",
        "gradient_lost_e5m2": "gradients lost in e5m2",
        "own_code": "in its own code",
        "cut_run_starts_at_step": "cuts start at step",
        "first_step_below_min": "first step below the minimum",
        "min_scale_threshold": "minimum scale",
        "consecutive_cut_count": "consecutive cuts",
        "nan_count": "NaN values",
        "inf_count": "inf values",
        "element_count": "values",
        "not_judged_nonfinite": "not judged (held inf/NaN)",
        # the per-layer counts, by their column's one definition (the numerics tab's too)
        "nonfinite_count": f"nonfinite ({COUNT_DEFINITIONS['nonfinite']})",
        "over_fp16_count": f"over_fp16 ({COUNT_DEFINITIONS['over_fp16']})",
        "origin_over_fp16_count": f"origin over_fp16 ({COUNT_DEFINITIONS['over_fp16']})",
        "dims": "dimensions",
        "wall_s_median": "median step time",
        "wall_s": "step time",
        "data_wait_s": "data wait",
        "data_wait_s_median": "median data wait",
        "step_s": "step time",
        "median_of_ranks_s": "median over ranks",
        "gpu_util_median": "median GPU utilization",
        "tensor_any_median": "median tensor activity",
        "tensor_hmma_median": "median HMMA activity",
        "steps_per_s_fp32": "FP32 steps per second",
        "steps_per_s_amp": "AMP steps per second",
    }
)

#: keys whose number is already a percentage (0-100)
_PERCENT_POINTS = ("gpu_util_median", "tensor_any_median", "tensor_hmma_median", "busy_gpu_util")


def _n05_sentence(e: Mapping[str, Any]) -> str | None:
    if e.get("module") is None or e.get("element_count") is None or "overflow_module" in e:
        return None
    counts = [
        f"{format_number(e[k])} {name}"
        for k, name in (("inf_count", "inf"), ("nan_count", "NaN"))
        if isinstance(e.get(k), int) and e[k]
    ]
    dtype = f" {e['output_dtype']}" if e.get("output_dtype") else ""
    what = " and ".join(counts) or "non-finite values"
    return (
        f"{_layer_text({'module': e['module'], 'module_type': e.get('module_type')})} output {what} of {format_number(e['element_count'])}{dtype} values "
        f"at step {e.get('step')}"
        + (
            f"; the first overflow was at step {e['first_overflow_step']}"
            if e.get("first_overflow_step") not in (None, e.get("step"))
            else ""
        )
        + "."
    )


def _n02_sentence(e: Mapping[str, Any]) -> str | None:
    if not isinstance(e.get("success_rate"), float | int) or "step_count" not in e:
        return None
    return (
        f"{_percent(e['success_rate'])} of {format_number(e['step_count'])} steps applied their "
        f"update; {format_number(e.get('skipped_count', 0))} were skipped."
    )


def _n17_sentence(e: Mapping[str, Any]) -> str | None:
    experiments = e.get("experiments")
    if not isinstance(experiments, list) or e.get("step") is None:
        return None
    cause = e.get("cause")
    measured = f"measured cause: {cause}" if cause else "no cause measured"
    spent = e.get("replay_wall_s")
    took = f" in {_seconds(float(spent))}" if isinstance(spent, int | float) else ""
    return (
        f"Step {e['step']} replayed in {len(experiments)} variant(s){took} on the same weights "
        f"and inputs; {measured}."
    )


_D04_WHAT = {
    "input": "its input batch",
    "activation": "a layer's activation",
    "loss": "its local loss",
    "gradient": "its local gradient before the reduction",
}


def _d04_sentence(e: Mapping[str, Any]) -> str | None:
    o = e.get("origin")
    if not isinstance(o, Mapping) or o.get("rank") is None:
        return None
    where = ", ".join(
        str(x)
        for x in (
            o.get("hostname") or None,
            f"local rank {o['local_rank']}"
            if isinstance(o.get("local_rank"), int) and o["local_rank"] >= 0
            else None,
            o.get("device"),
        )
        if x
    )
    what = _D04_WHAT.get(str(o.get("what")), str(o.get("what")))
    layer = f" ({o['layer']})" if o.get("layer") else ""
    received = e.get("received") or []
    got = (
        f" {'Rank' if len(received) == 1 else 'Ranks'} {format_ranks(int(r) for r in received)} "
        "received it through the all-reduce."
        if received
        else ""
    )
    return (
        f"Rank {o['rank']}"
        + (f" ({where})" if where else "")
        + f" produced it at step {o.get('step')}: {what}{layer}.{got}"
    )


def _d05_sentence(e: Mapping[str, Any]) -> str | None:
    d = e.get("divergent")
    if not isinstance(d, Mapping) or not isinstance(d.get("step"), int):
        return None
    ranks, group = list(d.get("ranks") or []), list(d.get("group") or [])
    agreed = e.get("last_agreed_step")
    since = f" (they agreed at step {agreed})" if isinstance(agreed, int) else ""
    if d.get("majority"):
        who = (
            f"Rank {ranks[0]} differs" if len(ranks) == 1 else f"Ranks {format_ranks(ranks)} differ"
        )
        others = len(group) - len(ranks)
        return (
            f"{who} from the other {others} replicas of group {format_ranks(group)} at step "
            f"{d['step']}, the first compared step where they differ{since}."
        )
    if len(group) == 2:
        return (
            f"Ranks {group[0]} and {group[1]}, the two replicas, differ at step {d['step']}, the "
            f"first compared step where they differ{since}; with two replicas the copy at fault "
            "cannot be told."
        )
    return (
        f"Ranks {format_ranks(ranks)} of replica group {format_ranks(group)} differ at step "
        f"{d['step']}, the first compared step where they differ{since}; no majority agrees, so "
        "the copy at fault cannot be told."
    )


#: rule ID -> what its evidence needs beyond the generic renderer
#: the block-format rules' keys (AMP-P04, AMP-P05): units and acronyms
_BLOCK_LABELS: Mapping[str, str] = MappingProxyType(
    {
        "sqnr_db": "SQNR (dB)",
        "min_sqnr_db": "min SQNR (dB)",
        "fp8_per_tensor": "fp8 per-tensor (beside)",
        "limiting": "limiting operand",
        "narrowest": "narrowest format",
        "bits": "bits per element",
        "scale_under_share": "block scales underflowing",
        "approx_modules": "approximate rows in",
        "not_measured": "not measured",
        "all_zero_modules": "all zero (not judged)",
        "order": "tried in order",
        **{
            f"{e}_{name}": f"{e} {label}"
            for e in ("e4m3", "e5m2", "e2m1")
            for name, label in (
                ("min_sqnr_db", "min SQNR (dB)"),
                ("max_flushed_share", "max flushed"),
                ("max_clipped_share", "max clipped"),
            )
        },
    }
)

VIEWS: Mapping[str, EvidenceView] = MappingProxyType(
    {
        "AMP-N02": EvidenceView(
            percent=("success_rate", "warn_below", "error_below"),
            sentence=_n02_sentence,
            said=("success_rate", "step_count", "skipped_count"),
        ),
        "AMP-N05": EvidenceView(
            codes=("cause",),
            sentence=_n05_sentence,
            said=(
                "module",
                "module_type",
                "inf_count",
                "nan_count",
                "element_count",
                "output_dtype",
                "step",
                "first_overflow_step",
            ),
        ),
        "AMP-N17": EvidenceView(
            sentence=_n17_sentence,
            codes=("trigger",),
            said=("step", "cause", "replay_wall_s"),
            labels={
                "forward_finite": "forward",
                "grads_finite": "gradients",
                "first_nonfinite": "first non-finite layer",
                "max_abs": "largest magnitude",
                "wall_s": "time",
                "verified_fix": "verified fix (fp32 pins)",
                "replays": "replayed steps",
                "received_ranks": "received through the all-reduce",
                "finite_at_scale": "finite at scale",
                "replayed_step_count": "steps replayed",
            },
        ),
        "AMP-S04": EvidenceView(percent=("min_tile_efficiency",)),
        "AMP-N06": EvidenceView(
            percent=(
                "share",
                "share_at_hint",
                "underflow_share_at_current",
                "underflow_share_at_hint",
            )
        ),
        "AMP-P01": EvidenceView(percent=("activation_lost_e4m3", "gradient_lost_e5m2")),
        "AMP-S07": EvidenceView(
            labels={"threshold": "tensor activity below"}, percent_points=("threshold",)
        ),
        "AMP-S03": EvidenceView(labels={"threshold": "syncs per step above"}),
        "AMP-D02": EvidenceView(codes=("metric",)),
        "AMP-P03": EvidenceView(percent=("gradient_flush_share_at_best_scale",)),
        "AMP-N01": EvidenceView(labels={"threshold": "cuts per growth interval, frequent above"}),
        "AMP-N09": EvidenceView(counts={"clipped_steps": "affected_step_count"}),
        "AMP-N13": EvidenceView(counts={"half_loss_steps": "affected_step_count"}),
        "AMP-D04": EvidenceView(
            sentence=_d04_sentence,
            said=("origin", "received", "ranks", "step", "what", "layer"),
            labels={
                "origin_source": "seen by",
                "nccl_nan_check": "TORCH_NCCL_NAN_CHECK",
                "ranks_at_step": "the ranks at that step",
                "episode_last_step": "non-finite until step",
                "ranks_not_listed_count": "ranks not in the table",
            },
        ),
        "AMP-D05": EvidenceView(
            sentence=_d05_sentence,
            said=("divergent", "ranks", "last_agreed_step"),
            labels={"params": "parameters that differ", "param": "parameter"},
        ),
        "AMP-P04": EvidenceView(labels=_BLOCK_LABELS),
        "AMP-P05": EvidenceView(labels=_BLOCK_LABELS),
    }
)


def fix_parts(fix: str) -> list[tuple[str, bool]]:
    """A fix's text split at its fenced code blocks (```python ... ```): ``(text, is_code)``
    pairs in order, the fences and the language word left out, so that each renderer shows
    the code as code (AMP-N17's verified fix is code to write)."""
    parts: list[tuple[str, bool]] = []
    pieces = fix.split("```")
    for i, piece in enumerate(pieces):
        code = i % 2 == 1 and i < len(pieces) - 1  # an unclosed fence stays text
        if code:
            first, _, rest = piece.partition("\n")
            piece = rest if first.strip().isidentifier() or not first.strip() else piece
            piece = piece.strip("\n")
        else:
            piece = piece.strip() if len(pieces) > 1 else piece
        if piece:
            parts.append((piece, code))
    return parts


#: finding categories whose step is worth showing on the loss-scale chart
STEP_VIEW_CATEGORIES = ("nan", "distributed")


# -- numbers ----------------------------------------------------------------------------------


def format_number(value: Any) -> str:
    """A number as a person reads it: ``6,777``, ``9.13``, ``0.0413``, ``2.27e-13``."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if not isinstance(value, float):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    size = abs(value)
    if size >= 1e15 or size < 1e-3:
        mantissa, exponent = f"{value:.2e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    if value.is_integer() or size >= 1000:
        return f"{round(value):,}"
    digits = max(0, 2 - math.floor(math.log10(size)))
    return f"{value:.{digits}f}"


def _percent(fraction: float) -> str:
    """A fraction as a percentage with three significant digits: ``80.0 %``, ``4.13 %``."""
    return _percent_points(100.0 * float(fraction))


def _percent_points(points: float) -> str:
    if points == 0 or not math.isfinite(points):
        return f"{format_number(float(points))} %"
    if abs(points) >= 100:
        return f"{points:,.0f} %"
    digits = max(0, 2 - math.floor(math.log10(abs(points))))
    return f"{points_text(points, digits)} %"  # below 100 % never "100" (99.95: "99.95 %")


def _seconds(value: float) -> str:
    if value != 0 and abs(value) < 1:
        return f"{format_number(value * 1000.0)} ms"
    return f"{format_number(float(value))} s"


def _scale(value: float) -> str:
    """A loss scale: a power of two far from 1 as ``2^-42 (2.27e-13)``."""
    if value > 0 and math.isfinite(value):
        exponent = math.log2(value)
        if exponent.is_integer() and not -6 <= exponent <= 20:
            return f"2^{int(exponent)} ({format_number(value)})"
    return format_number(value)


# -- steps ------------------------------------------------------------------------------------


def format_steps(
    listed: Sequence[int],
    ranges: Sequence[Sequence[int]] | None = None,
    count: int | None = None,
    limit: int = MAX_LISTED_STEPS,
) -> str:
    """Step numbers as ranges with the true count: ``120–179 (60)``.

    Args:
        listed: the ``*_steps`` list (the first ``limit`` steps).
        ranges: the ``*_step_ranges`` runs of every step (the first ``limit`` runs), if recorded.
        count: how many steps there are, if the evidence says.
    """
    if ranges:
        runs = [(int(r[0]), int(r[1])) for r in ranges]
        in_runs = sum(b - a + 1 for a, b in runs)
        complete = len(runs) < limit or (count is not None and count == in_runs)
        total = count if count is not None else (in_runs if complete else None)
        text = ", ".join(range_text(a, b) for a, b in runs)
        if not complete:
            text += ", \u2026"
        if total is None:
            return f"{text} (first {len(runs)} runs of steps shown)"
        return text if total == 1 else f"{text} ({format_number(total)})"
    steps = [int(s) for s in listed]
    if not steps:
        return "none"
    text = steps_text(steps)
    if count is not None and count == len(steps) or count is None and len(steps) < limit:
        total = len(steps)
        return text if total == 1 else f"{text} ({format_number(total)})"
    if count is not None:
        return f"{text}, \u2026 ({format_number(count)}; first {len(steps)} shown)"
    return f"{text}, \u2026 (first {len(steps)} shown)"


def _count_for(
    prefix: str, evidence: Mapping[str, Any], view: EvidenceView | None = None
) -> int | None:
    """The count matching the ``<prefix>_steps`` list: ``<prefix>_count``,
    ``<prefix>_step_count`` or the key the rule's view names."""
    named = view.counts.get(f"{prefix}_steps") if view is not None else None
    for key in (f"{prefix}_count", f"{prefix}_step_count", named or ""):
        value = evidence.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _is_steps(key: str, value: Any) -> bool:
    return (
        key.endswith("_steps")
        and isinstance(value, list | tuple)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


# -- values -----------------------------------------------------------------------------------


def _label(key: str, view: EvidenceView | None = None) -> str:
    if view is not None and key in view.labels:
        return view.labels[key]
    if key in _LABELS:
        return _LABELS[key]
    words = [w for w in key.split("_") if w != "s"]
    text = " ".join(words)
    text = re.sub(r"\bflops\b", "FLOPs", text)
    text = re.sub(r"\bnan\b", "NaN", text)
    return text or key


def _short(text: str) -> str:
    """Run text cut at a word, never mid-token, with a real ellipsis."""
    text = " ".join(str(text).split())
    if len(text) <= _MAX_TEXT:
        return text
    cut = text[:_MAX_TEXT].rsplit(" ", 1)[0]
    return cut + " \u2026"


def _layer_text(d: Mapping[str, Any]) -> str:
    """``booster (Booster), step 81`` from a dict naming a ``module``."""
    text = str(d.get("module"))
    if d.get("module_type"):
        text += f" ({d['module_type']})"
    if isinstance(d.get("step"), int):
        text += f", step {d['step']}"
    return text


def _is_percent(key: str, view: EvidenceView | None) -> bool:
    return key.endswith(("_share", "_fraction_share")) or (view is not None and key in view.percent)


#: a key in seconds: ``*_s``, or ``*_s_median`` and the like (not ``steps_per_s_fp32``)
_SECONDS = re.compile(r"(?<!per)_s(?:_(?:median|mean|min|max|total|p\d+))?$")


def _is_seconds(key: str) -> bool:
    return bool(_SECONDS.search(key))


def format_value(
    key: str,
    value: Any,
    siblings: Mapping[str, Any] | None = None,
    view: EvidenceView | None = None,
) -> str | None:
    """``value`` of evidence ``key`` as plain text; None when there is nothing to show."""
    siblings = siblings or {}
    if value is None:
        return None
    if isinstance(value, float) and math.isnan(value):
        return "not measured"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if _is_steps(key, value):
        prefix = key[: -len("_steps")]
        ranges = siblings.get(f"{prefix}_step_ranges")
        return format_steps(
            value, ranges if isinstance(ranges, list) else None, _count_for(prefix, siblings, view)
        )
    if key in ("ranks",) and isinstance(value, list | tuple):
        runs = siblings.get("rank_ranges")
        if isinstance(runs, list) and runs:  # more ranks than the list holds: every one, as runs
            joined = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
            count = siblings.get("rank_count")
            return f"{joined} ({count:,} ranks)" if isinstance(count, int) else joined
        return format_ranks(int(v) for v in value)
    if isinstance(value, int | float):
        if _is_percent(key, view):
            return _percent(float(value))
        if (
            key.endswith("_pct")
            or key in _PERCENT_POINTS
            or (view is not None and key in view.percent_points)
        ):
            return _percent_points(float(value))
        if _is_seconds(key):
            return _seconds(float(value))
        if "scale" in key and "count" not in key and "exp" not in key and isinstance(value, float):
            return _scale(value)
        if key == "step" or key.endswith(("_step", "_at_step")):
            return str(int(value))
        return format_number(value)
    if isinstance(value, str):
        if view is not None and key in view.codes:
            return _label(value)
        return _short(value)
    if isinstance(value, Mapping):
        if "module" in value:
            return _layer_text(value)
        if key == "dims":
            return ", ".join(f"{k} \u2192 {format_number(v)}" for k, v in value.items())
        if _is_seconds(key):  # {rank: seconds}
            parts = [f"{k}: {_seconds(float(v))}" for k, v in value.items() if _is_number(v)]
            return "; ".join(parts) or "none"
        parts = [
            f"{_label(str(k), view)}: {text}"
            for k, v in value.items()
            if (text := format_value(str(k), v, value, view)) is not None
        ]
        return "; ".join(parts) or "none"
    if isinstance(value, list | tuple):
        if not value:
            return "none"
        items = [
            _layer_text(v)
            if isinstance(v, Mapping) and "module" in v
            else format_value(key, v, None, view)
            for v in value
        ]
        return ", ".join(i for i in items if i is not None)
    return _short(str(value))


def _table(
    key: str, rows: Sequence[Mapping[str, Any]], view: EvidenceView | None, first: str = ""
) -> Table:
    columns: list[str] = [first] if first else []
    for row in rows:
        # a row's *_step_ranges are read with its *_steps, not shown as a column of their own
        columns += [
            str(k) for k in row if str(k) not in columns and not str(k).endswith("_step_ranges")
        ]
    shown = rows[:_MAX_ROWS]
    cells = tuple(
        tuple(
            (format_value(c, row.get(c), row, view) or "") if c else str(row.get("", ""))
            for c in columns
        )
        for row in shown
    )
    # a column with no value in any row says nothing
    keep = [i for i in range(len(columns)) if any(r[i] for r in cells)]
    note = f"first {len(shown)} of {len(rows)} rows shown" if len(rows) > len(shown) else ""
    return Table(
        caption=_label(key, view),
        columns=tuple(_label(columns[i], view) if columns[i] else "rank" for i in keep),
        rows=tuple(tuple(r[i] for i in keep) for r in cells),
        note=note,
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _threshold_keys(finding_id: str, evidence: Mapping[str, Any]) -> set[str]:
    """Evidence keys holding the rule's thresholds: ``threshold``, ``*_threshold`` and a
    registered threshold's name with a number, unless the evidence reports that threshold
    apart (a ``threshold`` key, or ``<prefix>_threshold`` for a name starting with the prefix:
    the name then holds the measured value, as ``min_scale`` beside ``min_scale_threshold``)."""
    spec = REGISTRY.get(finding_id)
    names = set(spec.thresholds) if spec is not None else set()
    apart = [k[: -len("_threshold")] for k in evidence if k.endswith("_threshold")]
    out = {k for k in evidence if k == "threshold" or k.endswith("_threshold")}
    if "threshold" in evidence:
        return out
    return out | {
        n for n in names if _is_number(evidence.get(n)) and not any(n.startswith(p) for p in apart)
    }


def _threshold_text(key: str, value: Any, evidence: Mapping[str, Any], view: Any) -> str | None:
    """A ``<prefix>_threshold`` in the unit of the measured value it is compared with."""
    if key.endswith("_threshold") and key not in (view.percent if view else ()):
        prefix = key[: -len("_threshold")]
        measured = [k for k in evidence if k != key and k.startswith(prefix)]
        if measured:
            return format_value(measured[0], value, evidence, view)
    return format_value(key, value, evidence, view)


def render_evidence(finding: Finding) -> list[Block]:
    """A finding's evidence as blocks: a sentence, labelled values, tables, then thresholds.

    The ``*_step_ranges`` of a ``*_steps`` list are read with it; ``rank`` is left out where
    ``ranks`` names every rank; values that are None (not applicable) are left out.
    """
    evidence = dict(finding.evidence)
    view = VIEWS.get(finding.id)
    thresholds = _threshold_keys(finding.id, evidence)
    blocks: list[Block] = []
    said: set[str] = set()
    if view is not None and view.sentence is not None:
        sentence = view.sentence(evidence)
        if sentence:
            blocks.append(Text(sentence))
            said = set(view.said)
    facts: list[tuple[str, str]] = []
    tables: list[Table] = []
    limits: list[str] = []
    for key, value in evidence.items():
        if key in said or key.endswith("_step_ranges") or (key == "rank" and "ranks" in evidence):
            continue
        if key in ("rank_ranges", "rank_count", "by_rank_left_off") and "ranks" in evidence:
            continue  # read with ``ranks`` and ``by_rank``
        if key == "by_rank" and isinstance(value, Mapping):
            rows = [{"": r, **dict(v)} for r, v in value.items() if isinstance(v, Mapping)]
            table = _table(key, rows, view, first="")
            left = evidence.get("by_rank_left_off")
            note = table.note
            if isinstance(left, Mapping):
                note = (
                    f"{left.get('row_count', 0):,} more sets of values, on "
                    f"{left.get('rank_count', 0):,} ranks, not shown"
                )
            columns = table.columns
            if columns and columns[0] == "rank" and any(not str(r).isdigit() for r in value):
                columns = ("ranks", *columns[1:])
            tables.append(
                dataclasses.replace(
                    table, caption="values that differ by rank", columns=columns, note=note
                )
            )
            continue
        if key == "by_rank_range" and isinstance(value, Mapping):
            rows = [
                {"": _label(str(k), view), **dict(v)}
                for k, v in value.items()
                if isinstance(v, Mapping)
            ]
            table = _table(key, rows, view, first="")
            if table.columns[:1] == ("rank",):
                table = dataclasses.replace(table, columns=("value", *table.columns[1:]))
            tables.append(dataclasses.replace(table, caption="range over the ranks"))
            continue
        if isinstance(value, list | tuple) and value and all(isinstance(v, Mapping) for v in value):
            tables.append(_table(key, value, view))
            continue
        if key in thresholds:
            text = _threshold_text(key, value, evidence, view)
            if text is not None:
                limits.append(f"{_label(key, view)} {text}")
            continue
        text = format_value(key, value, evidence, view)
        if text is not None:
            facts.append((_label(key, view), text))
    if facts:
        blocks.append(Facts(tuple(facts)))
    blocks += tables
    if limits:
        blocks.append(Text("Thresholds: " + ", ".join(limits) + "."))
    return blocks


def evidence_lines(finding: Finding) -> list[str]:
    """The blocks as plain text lines (the text renderer's ``--verbose`` form)."""
    lines: list[str] = []
    for block in render_evidence(finding):
        if isinstance(block, Text):
            lines.append(block.text)
        elif isinstance(block, Facts):
            lines += [f"{label}: {value}" for label, value in block.items]
        else:
            lines.append(f"{block.caption}:")
            lines.append("  " + " | ".join(block.columns))
            lines += ["  " + " | ".join(row) for row in block.rows]
            if block.note:
                lines.append(f"  ({block.note})")
    return lines


# -- where to look ----------------------------------------------------------------------------

#: evidence keys naming the step to look at first, most telling first
_STEP_KEYS = ("first_overflow_step", "cut_run_starts_at_step", "first_step_below_min")


def finding_step(finding: Finding) -> int | None:
    """The first step a finding points at (the loss-scale chart's), or None.

    The first of: the first overflow, the start of the cuts, the first step of its first
    ``*_step_ranges`` / ``*_steps`` list, its ``step``. Only findings whose category shows on
    the loss-scale chart (:data:`STEP_VIEW_CATEGORIES`) have one.
    """
    if finding.category not in STEP_VIEW_CATEGORIES:
        return None
    e = finding.evidence
    for key in _STEP_KEYS:
        if isinstance(e.get(key), int) and not isinstance(e.get(key), bool):
            return int(e[key])
    for key, value in e.items():
        if key.endswith("_step_ranges") and isinstance(value, list) and value:
            return int(value[0][0])
    for key, value in e.items():
        if _is_steps(key, value) and value:
            return int(min(value))
    step = e.get("step")
    return int(step) if isinstance(step, int) and not isinstance(step, bool) else None


def finding_layer(finding: Finding) -> str | None:
    """The layer a finding names first (its numerics view's), or None.

    Its ``module``, else the module of its first forward offender or of its first ``layers``
    / ``overflowing_layers`` row. Pseudo-modules such as ``<loss>`` are not layers.
    """
    e = finding.evidence
    candidates: list[Any] = [e.get("module")]
    offender = e.get("first_forward_offender")
    if isinstance(offender, Mapping):
        candidates.append(offender.get("module"))
    for key in ("layers", "overflowing_layers"):
        rows = e.get(key)
        if isinstance(rows, list) and rows and isinstance(rows[0], Mapping):
            candidates.append(rows[0].get("module"))
    for name in candidates:
        if isinstance(name, str) and name and not name.startswith("<"):
            return name
    return None


#: a finding's anchor in the HTML report and the dashboard: this prefix and its ID
FINDING_ANCHOR_PREFIX = "finding-"


def finding_anchors(findings: Sequence[Finding], prefix: str = FINDING_ANCHOR_PREFIX) -> list[str]:
    """One unique anchor per finding: ``finding-AMP-N05`` for the first finding of an ID (the
    target of a cross-reference), ``finding-AMP-N05-2`` for the next ones."""
    seen: dict[str, int] = {}
    out = []
    for f in findings:
        seen[f.id] = seen.get(f.id, 0) + 1
        n = seen[f.id]
        out.append(f"{prefix}{f.id}" if n == 1 else f"{prefix}{f.id}-{n}")
    return out
