"""Summary sections of the numerics collector's tables: ``numerics`` and ``offenders``.

``numerics``: per (module, kind) aggregates of a rank's sampled numerics rows, enough to build
the per-layer totals, the gradient underflow (AMP-N06) and the what-if table exactly:

- counts summed over the rows (:data:`COUNTS`), ``amax`` max, the dtypes seen, the first
  recorded ``module_type``, the first output ``order``;
- the sampled steps: how many (distinct consecutive step numbers: a repeated row of the same
  step counts once when it follows its step, a row out of step order counts again), first
  and last; the steps holding NaN/inf as runs (the first :data:`MAX_RUNS`, ``left_out``
  counts the rest); a gradient layer's sampled steps per measure as runs (the first
  :data:`MAX_LISTED`: what its evidence lists);
- ``hist``: per (dtype, amax class, top binade) the nonzero finite exponent histograms summed
  (``bins``: the text of :func:`encode_bins`; zeros
  taken out of bin -127, inf/NaN left out, the lump below 2**-133 keyed -134, the top binade
  of its range) with the row count. The amax class (:func:`amax_class`) holds every row whose
  ``amax`` a per-tensor scale and an overflow check of the what-if formats treat alike, so the
  what-if classification of the summed histogram equals the sum of the rows' classifications;
- ``scale``: per (dtype, loss scale) of gradient rows: nonzero values (elements - zeros - nan
  - inf) and the values lost at the row's own scale (fp16-held: binades wholly below 2**-14
  once scaled; wider: ``underflow_at_scale``).

A repeated row (same step, module and kind) is counted twice, as the loader's frame would
count it if it held it twice.

``offenders``: per offender kind (forward, backward, input) the first offender (smallest step,
first in file order among equal steps) with its detail, the offender steps as runs, the
offending modules (capped); and the steps whose model input held inf/NaN (the steps table's
``input_nonfinite``) as runs with their count and the first elements counts; the steps that
overflowed (``found_inf`` > 0, ``skipped`` or ``loss_nonfinite``) and those with a non-finite
loss, as runs.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from amprobe.store.schema import NUMERICS_OPERAND_KINDS
from amprobe.store.summary import Section, section

__all__ = [
    "COUNTS",
    "MAX_RUNS",
    "MAX_MODULES",
    "AMAX_SCALE_EDGES",
    "AMAX_OVERFLOW_EDGES",
    "amax_class",
    "nonzero_binades",
    "encode_bins",
    "decode_bins",
    "NumericsSection",
    "OffendersSection",
    "step_facts",
]

#: the numerics count columns summed per (module, kind)
COUNTS = (
    "elements",
    "zeros",
    "nan",
    "inf",
    "finite",
    "over_fp16",
    "below_normal",
    "below_subnormal",
    "underflow_at_scale",
    "in_nonfinite",
)
#: step runs kept per list (the first ones); the rest is counted
MAX_RUNS = 256
#: runs kept of a gradient layer's sampled steps: the evidence lists the first 20 steps and
#: runs (``amprobe.analysis.frames.MAX_LISTED_STEPS``), and the first 20 runs hold them
MAX_LISTED = 20
#: modules kept per offender kind
MAX_MODULES = 64

#: the what-if formats' max (fp16, bf16, e4m3, e5m2) as mantissas in [1, 2): a per-tensor
#: scale ``floor(log2(max / amax))`` depends on amax's binade and on which of these its
#: mantissa exceeds (``tests/test_store_numerics.py`` checks them against the formats)
AMAX_SCALE_EDGES = sorted(
    m / 2.0 ** math.floor(math.log2(m))
    for m in (65504.0, float.fromhex("0x1.fep127"), 448.0, 57344.0)
)
#: the formats' smallest overflowing values as mantissas: whether amax (scaled or not) stays
#: finite depends on which of these it reaches. Max plus half its step, where that tie rounds
#: past the max; e4m3's tie 464 rounds to even, to 448: only values above it overflow
AMAX_OVERFLOW_EDGES = sorted(
    m / 2.0 ** math.floor(math.log2(m))
    for m in (65520.0, float.fromhex("0x1.ffp127"), math.nextafter(464.0, math.inf), 61440.0)
)

_LUMP, _LUMP_TOP = -149, -134


def _num(value: Any) -> float | None:
    """A finite-or-not number, None for a missing one (NaN included)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return None if v != v else v


def amax_class(amax: Any) -> str:
    """The class of an ``amax`` the what-if treats alike: ``nan`` (missing), ``inf``,
    ``zero`` (<= 0), else ``E:s:o``: amax's binade ``E`` and how many of
    :data:`AMAX_SCALE_EDGES` its mantissa exceeds (``s``) and :data:`AMAX_OVERFLOW_EDGES` it
    reaches (``o``)."""
    v = _num(amax)
    if v is None:
        return "nan"
    if math.isinf(v):
        return "inf"
    if v <= 0:
        return "zero"
    m, e = math.frexp(v)  # v = m * 2**e, m in [0.5, 1)
    f = 2.0 * m
    s = bisect.bisect_left(AMAX_SCALE_EDGES, f)
    o = bisect.bisect_right(AMAX_OVERFLOW_EDGES, f)
    return f"{e - 1}:{s}:{o}"


def nonzero_binades(text: Any, zeros: int) -> dict[str, int]:
    """An ``exp_hist`` JSON text as top binade (the exponent as text, as JSON keys it) ->
    nonzero finite count: the zeros taken out of bin -127, inf/NaN (128) left out, the lump
    (-149: the values below 2**-133) keyed by its top binade -134. A text that is not a JSON
    object of counts raises."""
    if not isinstance(text, str) or not text:
        return {}
    out: dict[str, int] = json.loads(text)
    out.pop("128", None)
    if "-127" in out:
        out["-127"] -= zeros
    if "-149" in out:
        out["-134"] = out.get("-134", 0) + out.pop("-149")
    if out and min(out.values()) <= 0:
        out = {e: n for e, n in out.items() if n > 0}
    return out


def encode_bins(bins: Mapping[Any, int]) -> str:
    """A histogram group's exponent -> count as the text ``"e,n,e,n,..."`` (in the dict's
    order; ``""`` when empty): one JSON string instead of an object of one key per binade, so
    that a reader parses a rank's record several times faster and the what-if reads every
    rank's histograms as one array (:func:`amprobe.analysis.whatif.compute_whatif_summaries`)."""
    return ",".join(f"{e},{n}" for e, n in bins.items())


def decode_bins(value: Any) -> dict[int, int]:
    """:func:`encode_bins`'s text (or the exponent -> count object of an earlier record) as
    exponent -> count."""
    if isinstance(value, Mapping):
        return {int(e): int(n) for e, n in value.items()}
    if not value:
        return {}
    parts = value.split(",")
    return dict(zip(map(int, parts[::2]), map(int, parts[1::2]), strict=True))


def _below(binades: Mapping[str, int], bound_exp: float, scale: float) -> int:
    """Values of the binades wholly at or below ``2**bound_exp`` once multiplied by ``scale``."""
    cut = bound_exp - math.log2(scale) - 1
    return sum(n for e, n in binades.items() if int(e) <= cut)


# -- step runs --------------------------------------------------------------------------------
def _runs_new() -> dict[str, Any]:
    return {"runs": [], "left_out": 0, "last": None}


def _runs_add(r: dict[str, Any], step: int, cap: int = 0) -> None:
    """Add a step, in file order: a step equal to the last one added is ignored, the next
    step number extends the last run, any other starts a run (counted in ``left_out`` once
    :data:`MAX_RUNS` are kept)."""
    last = r["last"]
    if last is not None and step == last:
        return
    r["last"] = step
    if last is not None and step == last + 1:
        if not r["left_out"]:
            r["runs"][-1][1] = step
        return
    if len(r["runs"]) < (cap or MAX_RUNS):
        r["runs"].append([step, step])
    else:
        r["left_out"] += 1


def _runs_merge(a: Mapping[str, Any], b: Mapping[str, Any], cap: int = 0) -> dict[str, Any]:
    """The runs of ``a``'s steps followed by ``b``'s."""
    out = {"runs": [list(x) for x in a["runs"]], "left_out": a["left_out"], "last": a["last"]}
    for first, last in b["runs"]:
        _runs_add(out, first, cap)
        if last != first:
            if not out["left_out"]:
                out["runs"][-1][1] = last
            out["last"] = last
    if b["left_out"]:
        # b kept MAX_RUNS runs before it left any out, so out is full: they are left out too
        out["left_out"] += b["left_out"]
        out["last"] = b["last"]
    return out


def _union(a: list[Any], b: list[Any]) -> list[Any]:
    """``a`` then the items of ``b`` not in ``a``."""
    seen = set(map(str, a))
    return [*a, *(x for x in b if str(x) not in seen)]


# -- numerics -----------------------------------------------------------------------------------
def _layer_new(module_type: Any) -> dict[str, Any]:
    return {
        "module_type": module_type,
        "dtypes": [],
        "order": None,
        "counts": dict.fromkeys(COUNTS, 0),
        "missing": {},  # count column -> rows without it (only those with some)
        "amax": None,
        "rows": 0,
        "steps": 0,
        "first_step": None,
        "last_step": None,
        "file_first": None,  # the first and last step in file order (to count steps)
        "file_last": None,
        "grad_steps": {},  # gradient measure -> its sampled steps' first MAX_LISTED runs
        "nonfinite_runs": _runs_new(),
        "last": None,  # [step, amax, top exponent] of the last row in step order
        "hist": {},  # "dtype|amax class|top" -> {"rows": n, "amax": x, "bins": {exp: count}}
        "scale": {},  # "dtype|loss scale" -> gradient facts
    }


def _top(binades: Mapping[str, int]) -> int | None:
    return max(map(int, binades)) if binades else None


@section
class NumericsSection(Section):
    """Per (module, kind) aggregates of the ``numerics`` rows (see the module docstring)."""

    name: ClassVar[str] = "numerics"
    tables: ClassVar[tuple[str, ...]] = ("numerics",)

    def __init__(self) -> None:
        self.layers: dict[str, dict[str, Any]] = {}
        self.outputs: dict[str, Any] = {}  # module -> min output order, by first appearance
        self.grad_scale: list[Any] | None = None  # [step, loss scale] of the last scaled grad row
        self.rows = 0
        # the last Linear of each step's forward (execution order, missing orders last): the
        # modules that were, with a half output there, and the candidates of the chunk's first
        # and last steps, which a neighbouring chunk may continue
        self.last_linear: dict[str, Any] = {"half": [], "edges": []}
        # the facts of steps with a non-finite output (AMP-N05's detail, see _step_facts_add)
        self.step_facts: dict[str, Any] = _facts_new()

    def add(self, table: str, row: Mapping[str, Any]) -> None:
        module, kind, step = row.get("module"), row.get("kind"), row.get("step")
        if step is None or kind in NUMERICS_OPERAND_KINDS:  # (a GEMM's operands: see schema)
            return
        step = int(step)
        _facts_add(self.step_facts, step, row if kind == "output" and module is not None else None)
        if module is None or kind is None:
            return
        self.rows += 1
        key = f"{kind}\x00{module}"
        layer = self.layers.get(key)
        mtype = row.get("module_type")
        if layer is None:
            layer = self.layers[key] = _layer_new(mtype)
        elif layer["module_type"] is None and mtype is not None:
            layer["module_type"] = mtype
        dtype = row.get("dtype")
        if dtype is not None and dtype not in layer["dtypes"]:
            layer["dtypes"].append(dtype)
        order = row.get("order")
        if kind == "output":
            known = self.outputs.get(module)
            if order is not None and (known is None or order < known):
                self.outputs[module] = int(order)
            elif module not in self.outputs:
                self.outputs[module] = None
        if kind == "output" and isinstance(mtype, str) and "Linear" in mtype:
            _last_linear_add(
                self.last_linear,
                [step, order is None, 0 if order is None else order, module, dtype in _HALF],
            )
        counts, missing = layer["counts"], layer["missing"]
        for c in COUNTS:
            v = row.get(c)
            if v is None:
                missing[c] = missing.get(c, 0) + 1
            else:
                counts[c] += int(v)
        amax = _num(row.get("amax"))
        if amax is not None and (layer["amax"] is None or amax > layer["amax"]):
            layer["amax"] = amax
        layer["rows"] += 1
        if layer["file_last"] != step:
            layer["steps"] += 1
        if layer["file_first"] is None:
            layer["file_first"] = step
        layer["file_last"] = step
        if layer["first_step"] is None or step < layer["first_step"]:
            layer["first_step"] = step
        layer["last_step"] = step if layer["last_step"] is None else max(step, layer["last_step"])
        if (row.get("nan") or 0) + (row.get("inf") or 0) > 0:
            _runs_add(layer["nonfinite_runs"], step)
        zeros = row.get("zeros") or 0
        binades = nonzero_binades(row.get("exp_hist"), int(zeros))
        top = _top(binades)
        if layer["last"] is None or step >= layer["last"][0]:
            layer["last"] = [step, amax, top]
        hkey = f"{dtype}|{amax_class(amax)}|{top}"
        h = layer["hist"].setdefault(hkey, {"rows": 0, "amax": None, "bins": {}})
        h["rows"] += 1
        if amax is not None and (h["amax"] is None or amax > h["amax"]):
            h["amax"] = amax
        bins = h["bins"]
        for e, n in binades.items():
            bins[e] = bins.get(e, 0) + n
        if kind in ("grad_output", "grad_param"):
            self._add_grad(layer, row, step, dtype, binades)

    def _add_grad(
        self, layer: dict[str, Any], row: Mapping[str, Any], step: int, dtype: Any, binades: Any
    ) -> None:
        scale_v = _num(row.get("loss_scale"))
        if scale_v is not None and (self.grad_scale is None or step >= self.grad_scale[0]):
            self.grad_scale = [step, scale_v]
        own = scale_v if scale_v and scale_v > 0 else 1.0
        counts = [_num(row.get(c)) for c in ("elements", "zeros", "nan", "inf")]
        nz = None
        if all(c is not None for c in counts):
            nz = int(sum(c or 0.0 for c in counts[:1]) - sum(c or 0.0 for c in counts[1:]))
        fp16 = dtype == "float16"
        s = layer["scale"].setdefault(
            f"{dtype}|{own!r}",
            {"dtype": dtype, "scale": own, "nonzero": 0, "lost": 0, "damaged": None},
        )
        measure = "subnormal" if fp16 else "flushed"
        runs = layer["grad_steps"].get(measure)
        if runs is None:
            runs = layer["grad_steps"][measure] = _runs_new()
        _runs_add(runs, step, MAX_LISTED)
        if nz is None:
            if s["damaged"] is None:
                s["damaged"] = step
            return
        s["nonzero"] += nz
        if not nz:
            return
        if fp16:
            s["lost"] += _below(binades, -14, own)
        else:
            uas = row.get("underflow_at_scale")
            if uas is None:
                if s["damaged"] is None:
                    s["damaged"] = step
                return
            s["lost"] += int(uas)

    def to_json(self) -> dict[str, Any]:
        layers = []
        for key, layer in self.layers.items():
            kind, module = key.split("\x00", 1)
            out = dict(layer)
            out["module"], out["kind"] = module, kind
            out["hist"] = {
                k: {
                    "rows": h["rows"],
                    "amax": h["amax"],
                    "bins": encode_bins(h["bins"]),
                }
                for k, h in layer["hist"].items()
            }
            layers.append(json.loads(json.dumps(out)))
        return {
            "rows": self.rows,
            "layers": layers,
            "outputs": [[m, o] for m, o in self.outputs.items()],
            "grad_scale": self.grad_scale,
            "last_linear": json.loads(json.dumps(self.last_linear)),
            "step_facts": json.loads(json.dumps(self.step_facts)),
        }

    @classmethod
    def merge(cls, first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
        layers = {(x["kind"], x["module"]): json.loads(json.dumps(x)) for x in first["layers"]}
        for b in second["layers"]:
            a = layers.get((b["kind"], b["module"]))
            if a is None:
                layers[(b["kind"], b["module"])] = json.loads(json.dumps(b))
                continue
            _merge_layer(a, b)
        outputs = {m: o for m, o in first["outputs"]}
        for m, o in second["outputs"]:
            known = outputs.get(m)
            if m not in outputs or (o is not None and (known is None or o < known)):
                outputs[m] = o
        g1, g2 = first.get("grad_scale"), second.get("grad_scale")
        grad = g2 if g2 is not None and (g1 is None or g2[0] >= g1[0]) else g1
        last_linear = json.loads(json.dumps(first["last_linear"]))
        for cand in second["last_linear"]["edges"]:
            _last_linear_add(last_linear, list(cand))
        for m in second["last_linear"]["half"]:
            if m not in last_linear["half"]:
                last_linear["half"].append(m)
        last_linear["half"].sort()
        facts = _facts_merge(first.get("step_facts"), second.get("step_facts"))
        return {
            "rows": first["rows"] + second["rows"],
            "layers": list(layers.values()),
            "outputs": [[m, o] for m, o in outputs.items()],
            "grad_scale": grad,
            "last_linear": last_linear,
            "step_facts": facts,
        }


_HALF = ("float16", "bfloat16")


# -- the facts of a step with a non-finite output (AMP-N05) --------------------------------------
#: steps with a non-finite output whose facts are kept between a chunk's first and last step
MAX_FACT_STEPS = 2
#: bf16's overflow bound: a cast to bf16 makes inf every amax at or above it
BF16_OVERFLOW = float.fromhex("0x1.ffp127")


def _facts_new() -> dict[str, Any]:
    """``edges``: the facts of the chunk's first and last step (every output module's, which a
    neighbouring chunk may continue); ``kept``: those of the first :data:`MAX_FACT_STEPS`
    steps in between with a non-finite output (the modules with one only: ``trimmed``);
    ``ordered``: whether the rows' steps never went down in file order (else the facts'
    ``prev`` are not the previous sampled steps and a reader must not use them)."""
    return {"ordered": True, "edges": [], "kept": []}


def _fact_new(step: int, prev: int | None) -> dict[str, Any]:
    return {
        "step": step,
        "prev": prev,  # the previous step with a numerics row (file order)
        "bad": False,  # some output row held NaN/inf
        "out": {},  # module -> [smallest order, first dtype, held NaN/inf] of its output rows
        "linear": None,  # [order missing, order, module] of the last Linear output
        "fp16": None,  # the first output (execution order) with values >= 65520
        "bf16": None,  # the first output with amax >= bf16's overflow bound
        "trimmed": False,
    }


def _origin(row: Mapping[str, Any], order: Any) -> dict[str, Any]:
    return {
        "order": order,
        "module": row.get("module"),
        "module_type": row.get("module_type"),
        "amax": _num(row.get("amax")),
        "over_fp16": row.get("over_fp16"),
        "elements": row.get("elements"),
        "dtype": row.get("dtype"),
    }


def _fact_row(fact: dict[str, Any], row: Mapping[str, Any]) -> None:
    """Add one output row of the fact's step."""
    module, order, dtype = row.get("module"), row.get("order"), row.get("dtype")
    bad = (row.get("nan") or 0) + (row.get("inf") or 0) > 0
    entry = fact["out"].get(module)
    if entry is None:
        fact["out"][module] = [order, dtype, bad]
    else:
        if order is not None and (entry[0] is None or order < entry[0]):
            entry[0] = order
        entry[2] = entry[2] or bad
    fact["bad"] = fact["bad"] or bad
    mtype = row.get("module_type")
    if isinstance(mtype, str) and "Linear" in mtype:
        _fact_linear(fact, [order is None, 0 if order is None else order, module])
    if order is None:
        return
    over = row.get("over_fp16")
    if over is not None and over > 0:
        _fact_origin(fact, "fp16", _origin(row, order))
    amax = _num(row.get("amax"))
    if amax is not None and amax >= BF16_OVERFLOW:
        _fact_origin(fact, "bf16", _origin(row, order))


def _fact_linear(fact: dict[str, Any], cand: list[Any] | None) -> None:
    """The later in execution order wins (missing orders last; ties: the later row)."""
    old = fact["linear"]
    if cand is not None and (old is None or (cand[0], cand[1]) >= (old[0], old[1])):
        fact["linear"] = cand


def _fact_origin(fact: dict[str, Any], key: str, cand: dict[str, Any] | None) -> None:
    """The first in execution order wins (ties: the earlier row)."""
    old = fact[key]
    if cand is not None and (old is None or cand["order"] < old["order"]):
        fact[key] = cand


def _fact_join(a: dict[str, Any], b: Mapping[str, Any]) -> None:
    """``a`` becomes the facts of its step's rows followed by ``b``'s (the same step)."""
    for module, (order, dtype, bad) in b["out"].items():
        entry = a["out"].get(module)
        if entry is None:
            a["out"][module] = [order, dtype, bad]
            continue
        if order is not None and (entry[0] is None or order < entry[0]):
            entry[0] = order
        entry[2] = entry[2] or bad
    a["bad"] = a["bad"] or b["bad"]
    _fact_linear(a, b["linear"])
    _fact_origin(a, "fp16", b["fp16"])
    _fact_origin(a, "bf16", b["bf16"])


def _fact_settle(state: dict[str, Any], fact: dict[str, Any]) -> None:
    """A step between the chunk's edges is complete: keep it (its non-finite modules only)
    when it held a non-finite output and fewer than :data:`MAX_FACT_STEPS` are kept."""
    if fact["bad"] and len(state["kept"]) < MAX_FACT_STEPS:
        kept = dict(fact)
        kept["out"] = {m: e for m, e in fact["out"].items() if e[2]}
        kept["trimmed"] = True
        state["kept"].append(kept)


def _facts_step(state: dict[str, Any], fact: dict[str, Any]) -> None:
    """Make ``fact`` (a new step's) the chunk's last step."""
    edges = state["edges"]
    if edges and fact["step"] < edges[-1]["step"]:
        state["ordered"] = False
    if len(edges) == 2:
        _fact_settle(state, edges.pop())
    edges.append(fact)


def _facts_add(state: dict[str, Any], step: int, row: Mapping[str, Any] | None) -> None:
    """Add a numerics row of ``step`` (``row``: an output row, else None)."""
    edges = state["edges"]
    if not edges or edges[-1]["step"] != step:
        _facts_step(state, _fact_new(step, edges[-1]["step"] if edges else None))
    if row is not None:
        _fact_row(edges[-1], row)


def _facts_merge(
    first: Mapping[str, Any] | None, second: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The step facts of ``first``'s rows followed by ``second``'s; None when either has none
    (a record of an amprobe that did not keep them: the facts of the union are not known)."""
    if first is None or second is None:
        return None
    out: dict[str, Any] = json.loads(json.dumps(first))
    b = json.loads(json.dumps(second))
    out["ordered"] = out["ordered"] and b["ordered"]
    if not b["edges"]:
        return out
    head = b["edges"][0]
    edges = out["edges"]
    if edges and edges[-1]["step"] == head["step"]:
        _fact_join(edges[-1], head)
    else:
        head["prev"] = edges[-1]["step"] if edges else head["prev"]
        _facts_step(out, head)
    if len(b["edges"]) == 2:
        if len(edges) == 2:
            _fact_settle(out, edges.pop())
        out["kept"].extend(b["kept"][: MAX_FACT_STEPS - len(out["kept"])])
        edges.append(b["edges"][1])
    return out


def step_facts(section: Mapping[str, Any], step: int) -> dict[str, Any] | None:
    """The facts of ``step`` in a rank's ``numerics`` section (None when they were not kept or
    the rows' steps went down in file order)."""
    state = section.get("step_facts")
    if not state or not state["ordered"]:
        return None
    for fact in (*state["edges"], *state["kept"]):
        if fact["step"] == step:
            return dict(fact)
    return None


def _last_linear_add(state: dict[str, Any], cand: list[Any]) -> None:
    """Add a Linear output ``[step, order missing, order, module, half]`` (in file order): it
    replaces its step's candidate when it comes later in execution order (ties: the later
    row); a new step settles the previous last step's candidate unless that is the chunk's
    first step."""
    edges = state["edges"]
    if edges and edges[-1][0] == cand[0]:
        if (cand[1], cand[2]) >= (edges[-1][1], edges[-1][2]):
            edges[-1] = cand
        return
    if len(edges) == 2:
        settled = edges.pop()
        if settled[4] and settled[3] not in state["half"]:
            state["half"].append(settled[3])
            state["half"].sort()
    edges.append(cand)


def last_linear_half(state: dict[str, Any]) -> set[str]:
    """The modules that were the last Linear of a step's forward with a half output there."""
    return {str(m) for m in state["half"]} | {str(c[3]) for c in state["edges"] if c[4]}


def _merge_layer(a: dict[str, Any], b: Mapping[str, Any]) -> None:
    if a["module_type"] is None:
        a["module_type"] = b["module_type"]
    a["dtypes"] = _union(a["dtypes"], b["dtypes"])
    for c in COUNTS:
        a["counts"][c] += b["counts"][c]
        if c in b["missing"]:
            a["missing"][c] = a["missing"].get(c, 0) + b["missing"][c]
    if b["amax"] is not None and (a["amax"] is None or b["amax"] > a["amax"]):
        a["amax"] = b["amax"]
    a["rows"] += b["rows"]
    joined = a["file_last"] is not None and a["file_last"] == b["file_first"]
    a["steps"] += b["steps"] - (1 if joined else 0)
    if b["first_step"] is not None:
        a["first_step"] = (
            b["first_step"] if a["first_step"] is None else min(a["first_step"], b["first_step"])
        )
        a["last_step"] = (
            b["last_step"] if a["last_step"] is None else max(a["last_step"], b["last_step"])
        )
    if b["file_last"] is not None:
        a["file_first"] = a["file_first"] if a["file_first"] is not None else b["file_first"]
        a["file_last"] = b["file_last"]
    for measure, runs in b["grad_steps"].items():
        mine_runs = a["grad_steps"].get(measure)
        a["grad_steps"][measure] = (
            runs if mine_runs is None else _runs_merge(mine_runs, runs, MAX_LISTED)
        )
    a["nonfinite_runs"] = _runs_merge(a["nonfinite_runs"], b["nonfinite_runs"])
    if b["last"] is not None and (a["last"] is None or b["last"][0] >= a["last"][0]):
        a["last"] = b["last"]
    for k, h in b["hist"].items():
        mine = a["hist"].get(k)
        if mine is None:
            a["hist"][k] = h
            continue
        mine["rows"] += h["rows"]
        if h["amax"] is not None and (mine["amax"] is None or h["amax"] > mine["amax"]):
            mine["amax"] = h["amax"]
        bins = decode_bins(mine["bins"])
        for e, n in decode_bins(h["bins"]).items():
            bins[e] = bins.get(e, 0) + n
        mine["bins"] = encode_bins(bins)
    for k, s in b["scale"].items():
        mine = a["scale"].get(k)
        if mine is None:
            a["scale"][k] = s
            continue
        mine["nonzero"] += s["nonzero"]
        mine["lost"] += s["lost"]
        if mine["damaged"] is None:
            mine["damaged"] = s["damaged"]


# -- offenders ----------------------------------------------------------------------------------
#: non-finite input steps whose element counts are kept (the first ones)
MAX_INPUT_COUNTS = 20


def _kind_new() -> dict[str, Any]:
    return {"count": 0, "first": None, "runs": _runs_new(), "modules": [], "modules_more": False}


@section
class OffendersSection(Section):
    """Per offender kind: the first offender, offender steps as runs, the modules (capped);
    and the steps whose model input held inf/NaN (see the module docstring)."""

    name: ClassVar[str] = "offenders"
    tables: ClassVar[tuple[str, ...]] = ("offenders", "steps")

    def __init__(self) -> None:
        self.kinds: dict[str, dict[str, Any]] = {}
        self.inputs: dict[str, Any] = {
            "count": 0,
            "runs": _runs_new(),
            "first_counts": [],
            "checked": 0,
        }
        # steps that overflowed (found_inf > 0, skipped or a non-finite loss), and those
        # whose loss was non-finite
        self.overflow = _runs_new()
        self.loss_nonfinite = _runs_new()
        # loss-scale cuts (scale_after < scale_before) and skipped updates as runs and counts,
        # and the non-finite losses of steps whose update was not skipped (AMP-N16)
        self.scaling: dict[str, Any] = {
            "cuts": _runs_new(),
            "cut_count": 0,
            "skipped": _runs_new(),
            "skipped_count": 0,
            "loss_nonfinite_kept": 0,
        }

    def add(self, table: str, row: Mapping[str, Any]) -> None:
        step = row.get("step")
        if step is None:
            return
        step = int(step)
        if table == "steps":
            loss_bad = bool(row.get("loss_nonfinite"))
            if loss_bad:
                _runs_add(self.loss_nonfinite, step)
            skipped = bool(row.get("skipped"))
            if loss_bad or (row.get("found_inf") or 0) > 0 or skipped:
                _runs_add(self.overflow, step)
                sc = self.scaling
                if skipped:
                    _runs_add(sc["skipped"], step)
                    sc["skipped_count"] += 1
                elif loss_bad:
                    sc["loss_nonfinite_kept"] += 1
            before, after = row.get("scale_before"), row.get("scale_after")
            if before is not None and after is not None and after < before:
                _runs_add(self.scaling["cuts"], step)
                self.scaling["cut_count"] += 1
            bad = row.get("input_nonfinite")
            if bad is None:
                return
            self.inputs["checked"] += 1
            if bad > 0:
                self.inputs["count"] += 1
                _runs_add(self.inputs["runs"], step)
                if len(self.inputs["first_counts"]) < MAX_INPUT_COUNTS:
                    self.inputs["first_counts"].append(int(bad))
            return
        kind = row.get("kind")
        if kind is None:
            return
        k = self.kinds.setdefault(str(kind), _kind_new())
        k["count"] += 1
        if k["first"] is None or step < k["first"]["step"]:
            k["first"] = {
                "step": step,
                "module": row.get("module"),
                "module_type": row.get("module_type"),
                "detail": row.get("detail"),
            }
        _runs_add(k["runs"], step)
        module = row.get("module")
        if module is not None and module not in k["modules"]:
            if len(k["modules"]) < MAX_MODULES:
                k["modules"].append(module)
            else:
                k["modules_more"] = True

    def to_json(self) -> dict[str, Any]:
        return json.loads(
            json.dumps(
                {
                    "kinds": self.kinds,
                    "inputs": self.inputs,
                    "overflow": self.overflow,
                    "loss_nonfinite": self.loss_nonfinite,
                    "scaling": self.scaling,
                }
            )
        )

    @classmethod
    def merge(cls, first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
        out = json.loads(json.dumps(first))
        for kind, b in second["kinds"].items():
            a = out["kinds"].get(kind)
            if a is None:
                out["kinds"][kind] = b
                continue
            a["count"] += b["count"]
            if b["first"] is not None and (
                a["first"] is None or b["first"]["step"] < a["first"]["step"]
            ):
                a["first"] = b["first"]
            a["runs"] = _runs_merge(a["runs"], b["runs"])
            for m in b["modules"]:
                if m not in a["modules"]:
                    if len(a["modules"]) < MAX_MODULES:
                        a["modules"].append(m)
                    else:
                        a["modules_more"] = True
            a["modules_more"] = a["modules_more"] or b["modules_more"]
        ai, bi = out["inputs"], second["inputs"]
        ai["count"] += bi["count"]
        ai["checked"] += bi["checked"]
        ai["runs"] = _runs_merge(ai["runs"], bi["runs"])
        ai["first_counts"] = (ai["first_counts"] + bi["first_counts"])[:MAX_INPUT_COUNTS]
        for name in ("overflow", "loss_nonfinite"):
            out[name] = _runs_merge(out[name], second[name])
        a_sc, b_sc = out["scaling"], second["scaling"]
        for name in ("cuts", "skipped"):
            a_sc[name] = _runs_merge(a_sc[name], b_sc[name])
        for name in ("cut_count", "skipped_count", "loss_nonfinite_kept"):
            a_sc[name] += b_sc[name]
        return out
