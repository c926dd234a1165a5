"""Precision what-if: would the recorded values survive fp16, bf16, fp8-e4m3 or fp8-e5m2?

A pure analysis of a loaded run (it adds nothing to the job's cost). Input is the ``numerics``
table: per module, tensor kind and sampled step, a base-2 exponent histogram of ``|x|``
(``exp_hist``: exponent ``e`` -> count of values in ``[2**e, 2**(e+1))``; ``-127`` also holds
the exact zeros, ``-133`` .. ``-128`` are fp32 subnormal binades, ``-149`` holds every nonzero
value below ``2**-133`` (the lump: binades -149 .. -134, not resolved), ``128`` inf/NaN),
``zeros``, ``nan``, ``inf``, ``amax`` and ``elements``. Gradients were divided by the loss
scale before they were measured (see :mod:`amprobe.capture.collectors.numerics`), so their histograms
and ``amax`` are already the true, unscaled gradients.

For each format, a nonzero finite value ``y`` (``y = |x| * 2**k`` for a scale ``2**k``) is
classified by what a round-to-nearest-even cast does with it:

* **overflow** when the cast does not keep it within half a step of a finite value:
  ``y >= max + ulp(max)/2`` (:attr:`FloatFormat.overflow_at`: fp16 65520, bf16 ``0x1.ffp127``,
  e5m2 61440), where the tie rounds to even, past ``max``; for e4m3 ``y > 464``: its max 448
  has an even mantissa, so the tie 464 rounds to 448 (:attr:`FloatFormat.overflows_from`).
  Such values become inf, or for fp8-e4m3, which has no inf, saturate to 448. Values between
  ``max`` and that bound round down to ``max``;
* **flush** to zero when it rounds to 0: ``y <= 2**(m-1)``, half the minimum subnormal
  ``2**m`` (the tie at exactly ``2**(m-1)`` rounds to even, i.e. to 0);
* **subnormal** when it lands in ``[2**m, 2**emin)``: kept, with fewer significant bits.

Two scalings are evaluated: ``none`` (cast as-is) and ``per-tensor``: the power of two that maps
the tensor's ``amax`` just under the format's max, ``k = floor(log2(max / amax))``, as fp8
delayed/current scaling recipes (Transformer Engine) compute it; per sampled step, so a layer's
counts are summed over steps each with its own scale. With that scale nothing overflows.

What the exponent-only histogram resolves, and the tolerance that follows:

* Exact: every bin that lies wholly inside one class: above the top binade ``[2**T, 2**(T+1))``
  (``T = floor(log2(max))``) is overflow, bins up to ``m-2`` flush, bins ``m`` .. ``emin-2``
  subnormal, bins ``emin`` .. ``T-1`` normal.
* Top binade: holds values on both sides of the overflow bound (fp16: 32768 .. 65519.99 fit,
  65520 .. 65536 do not). ``amax`` settles it when the (scaled) ``amax`` does not overflow
  (then the whole bin fits; always the case with per-tensor scaling); otherwise ``amax``
  itself is counted as overflowing and the rest of the bin is unresolved (``edge``).
* Bin ``m-1``, ``[2**(m-1), 2**m)``: rounds up to the min subnormal, except a value of exactly
  ``2**(m-1)`` (a tie) which flushes; counted as subnormal and in ``edge``. Ties need not be
  rare (data held in a format whose grid contains ``2**(m-1)``, e.g. gradients that are powers
  of two), so the histogram does not tell how many there are.
* Bin ``emin-1``: values within half a subnormal step of ``2**emin`` round up to the min
  normal; counted as subnormal and in ``edge``. The part of the bin's width that rounds up is
  ``2**(m-emin)``: fp16 0.1 %, bf16 0.8 %, e4m3 12.5 %, e5m2 25 %.
* fp32 subnormals: the binades down to ``2**-133`` are exact bins, scaled like any other; the
  lump (nonzero values below ``2**-133``) covers the scaled binades ``-149+k`` .. ``-134+k``:
  counted in the class of its top binade, and in ``edge`` (once) unless that whole range lies
  in one exactly resolved class. Where the lump holds a tensor's only values, per-tensor
  scaling places its top at ``amax``'s binade instead of -134 (the scale maps ``amax``, not
  2**-134, under the max: nothing overflows). ``min_exp`` is -149 when the lump holds values
  (a lower bound).
* Values a narrower dtype already flushed (an fp16 tensor's underflow) are zeros by now and
  are not counted: shares are of the values that were recorded nonzero.

So, with ``E`` the bin ``m-1`` count, ``N`` the bin ``emin-1`` count and ``L`` the lump and
open top-binade values counted in ``edge``: overflow is exact up to ``L``; flush is low by at
most ``E + L`` (the ties); subnormal is high by at most ``E + N + L`` and never low by more
than ``L``. ``edge = E + N + L`` therefore bounds every class's error;
``tests/test_whatif.py`` casts real tensors to check the predicted counts against it.
"""

from __future__ import annotations

import dataclasses
import marshal
import math
from collections.abc import Iterable
from operator import itemgetter
from typing import Any

import numpy as np
import pandas as pd

from amprobe.analysis.frames import section_keys, steps_text
from amprobe.analysis.numerics import LayerHistograms, SectionBins, section_bins
from amprobe.store.sections.numerics import decode_bins, encode_bins

__all__ = [
    "FloatFormat",
    "FORMATS",
    "KINDS",
    "SCALINGS",
    "WHATIF_COLUMNS",
    "compute_whatif",
    "compute_whatif_frame",
    "whatif_records",
    "not_judged_text",
    "compute_whatif_rows",
    "compute_exponent_shares",
    "compute_exponent_shares_summaries",
    "compute_fp16_gradient_fit",
    "per_tensor_scale_exp",
    "layer_order",
    "value_codes",
]


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """A floating-point format's range, as the what-if needs it.

    Attributes:
        name: short name (``fp16``, ``bf16``, ``e4m3``, ``e5m2``).
        dtype: the torch dtype's name (``torch.<dtype>``).
        max: largest finite value.
        min_normal_exp: ``emin``, the min normal is ``2**emin``.
        min_subnormal_exp: ``m``, the min subnormal is ``2**m``.
        mantissa_bits: stored mantissa bits ``p`` (the step in ``[2**e, 2**(e+1))`` is
            ``2**(e-p)``).
    """

    name: str
    dtype: str
    max: float
    min_normal_exp: int
    min_subnormal_exp: int
    mantissa_bits: int

    @property
    def overflow_at(self) -> float:
        """The round-to-nearest bound: ``max`` plus half its step (values below it round down
        to ``max``; the tie itself overflows where :attr:`tie_overflows`)."""
        return self.max + 2.0 ** (self.top_exp - self.mantissa_bits - 1)

    @property
    def tie_overflows(self) -> bool:
        """Whether a value of exactly :attr:`overflow_at` overflows: round-to-nearest-even takes
        the tie to the neighbour with an even last mantissa bit, past ``max`` where ``max``'s is
        odd (fp16, bf16, e5m2), to ``max`` where it is even (e4m3: 464 rounds to 448)."""
        return int(self.max / 2.0 ** (self.top_exp - self.mantissa_bits)) % 2 == 1

    @property
    def overflows_from(self) -> float:
        """The smallest float the cast does not keep finite: :attr:`overflow_at`, or for a
        format whose tie rounds down to ``max`` the next float above it (e4m3: above 464)."""
        at = self.overflow_at
        return at if self.tie_overflows else math.nextafter(at, math.inf)

    @property
    def top_exp(self) -> int:
        """``T``: the exponent of the binade holding the max."""
        return math.floor(math.log2(self.max))

    @property
    def label(self) -> str:
        return {"e4m3": "fp8-e4m3", "e5m2": "fp8-e5m2"}.get(self.name, self.name)


#: The formats evaluated, as data.
FORMATS: dict[str, FloatFormat] = {
    "fp16": FloatFormat("fp16", "float16", 65504.0, -14, -24, 10),
    "bf16": FloatFormat("bf16", "bfloat16", float.fromhex("0x1.fep127"), -126, -133, 7),
    "e4m3": FloatFormat("e4m3", "float8_e4m3fn", 448.0, -6, -9, 3),
    "e5m2": FloatFormat("e5m2", "float8_e5m2", 57344.0, -14, -16, 2),
}
#: numerics kind -> what the what-if calls it
KINDS: dict[str, str] = {
    "output": "activation",
    "grad_output": "output gradient",
    "grad_param": "parameter gradient",
}
SCALINGS = ("none", "per-tensor")
#: columns of :func:`compute_whatif_frame`, in order
WHATIF_COLUMNS = [
    "rank",
    "module",
    "module_type",
    "kind",
    "order",
    "dtype",
    "steps",
    "nonzero",
    "nonfinite",
    "judged",
    "nonfinite_steps",
    "min_exp",
    "max_exp",
    "amax",
    "format",
    "scaling",
    "scale_exp",
    "overflow",
    "flush",
    "subnormal",
    "edge",
    "overflow_share",
    "flush_share",
    "subnormal_share",
    "lost_share",
    "edge_share",
]
# histogram columns: exponent e at e - _E_LO for e in -134 .. 128; the lump (``exp_hist`` key
# -149, nonzero values below 2**-133) sits at column 0, the position of its top binade -134
_E_LO = -134
_LUMP_EXP = -149  # the lump's lowest binade: what min_exp reports for it
_NBINS = 128 - _E_LO + 1
_ZERO = -127 - _E_LO  # the column that also holds the zeros
_FINITE = 128 - _E_LO  # columns 0 .. _FINITE - 1 are finite; _FINITE holds inf/NaN
_NONE = -(10**6)  # exponent of "no nonzero finite value"


_STRIP = str.maketrans({"{": None, "}": None, '"': None, " ": None, ":": ","})
#: rows per block in :func:`compute_whatif_rows` (dense (rows, 256) arrays stay ~30 MB)
_BLOCK = 16384


def _parse_hists(texts: Iterable[Any]) -> np.ndarray:
    """``exp_hist`` JSON strings -> (rows, _NBINS) int64 counts indexed by exponent - _E_LO
    (exponents below -134, the lump, go to column 0).

    The collector writes flat ``{"e": n, ...}`` objects; they are parsed as one number list
    (string and numpy operations, no per-bin Python loop).
    """
    if isinstance(texts, (pd.Series, np.ndarray)):
        texts = texts.tolist()  # plain strings: iterating the column one value at a time is slow
    cleaned = [t.translate(_STRIP) if isinstance(t, str) else "" for t in texts]
    out = np.zeros((len(cleaned), _NBINS), dtype=np.int64)
    pairs = np.array([(c.count(",") + 1) // 2 if c else 0 for c in cleaned], dtype=np.int64)
    if not pairs.any():
        return out
    values = np.array(",".join(c for c in cleaned if c).split(","), dtype=np.int64).reshape(-1, 2)
    rows = np.repeat(np.arange(len(cleaned)), pairs)
    cols = np.maximum(values[:, 0] - _E_LO, 0)
    keep = cols < _NBINS
    np.add.at(out, (rows[keep], cols[keep]), values[keep, 1])
    return out


def _nonzero_bins(hist: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """The finite columns with the zeros taken out of their bin."""
    finite = hist[:, :_FINITE].copy()
    finite[:, _ZERO] = np.maximum(finite[:, _ZERO] - zeros, 0)
    return finite


def _top_finite_exp(hist: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """Per row, the exponent of the highest nonzero finite bin (``_NONE`` when there is none;
    -134 when only the lump holds values: they lie below 2**-133)."""
    return _top_exp(_nonzero_bins(hist, zeros) > 0)


def _low_finite_exp(hist: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """Per row, the exponent of the lowest nonzero finite bin (-149 for the lump, a bound;
    ``-_NONE`` when there is none)."""
    return _low_exp(_nonzero_bins(hist, zeros) > 0)


def _top_exp(has: np.ndarray) -> np.ndarray:
    """:func:`_top_finite_exp` of the rows' nonzero finite bins (``has``: bin holds values)."""
    idx = _FINITE - 1 - np.argmax(has[:, ::-1], axis=1)
    return np.where(has.any(axis=1), idx + _E_LO, _NONE)


def _low_exp(has: np.ndarray) -> np.ndarray:
    """:func:`_low_finite_exp` of the rows' nonzero finite bins (``has``: bin holds values)."""
    idx = np.argmax(has, axis=1)
    low = np.where(idx == 0, _LUMP_EXP, idx + _E_LO)
    return np.where(has.any(axis=1), low, -_NONE)


def per_tensor_scale_exp(amax: float, fmt: FloatFormat) -> int:
    """``k`` of the amax-based power-of-two scale: ``amax * 2**k <= max < amax * 2**(k+1)``."""
    return math.floor(math.log2(fmt.max / amax))


def _scale_exps(amax: np.ndarray, top: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Per-tensor scale exponents; rows without a usable amax use the histogram's bound."""
    ok = np.isfinite(amax) & (amax > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        exact = np.floor(np.log2(fmt.max / np.where(ok, amax, 1.0)))
    # amax unknown (NaN present) or inf: the largest finite value is below 2**(top+1)
    bound = fmt.top_exp - (top + 1)
    k = np.where(ok, exact, np.where(top > _NONE, bound, 0))
    return k.astype(np.int64)


class _Counter:
    """Counts of nonzero finite values over scaled-exponent ranges, per row.

    The lump (column 0: nonzero values below 2**-133, binades -149 .. -134) is counted at its
    top binade -134; :meth:`lump_open` says where its range crosses a class boundary.
    """

    def __init__(self, hist: np.ndarray, zeros: np.ndarray) -> None:
        finite = _nonzero_bins(hist, zeros)
        self.has = finite > 0  # the bins that hold values
        self.lump = finite[:, 0].copy()
        self.prefix = np.concatenate(
            [np.zeros((len(hist), 1), dtype=np.int64), np.cumsum(finite, axis=1)], axis=1
        )
        self.rows = np.arange(len(hist))

    def between(self, lo: np.ndarray | int, hi: np.ndarray | int, k: np.ndarray) -> np.ndarray:
        """Values whose scaled exponent ``e + k`` lies in ``[lo, hi]`` (inclusive)."""
        # np.minimum/np.maximum, not np.clip: the same bounds without clip's per-call checks
        a = np.minimum(np.maximum(np.asarray(lo) - k - _E_LO, 0), _FINITE)
        b = np.minimum(np.maximum(np.asarray(hi) - k - _E_LO + 1, 0), _FINITE)
        b = np.maximum(a, b)
        return self.prefix[self.rows, b] - self.prefix[self.rows, a]

    def lump_open(
        self, exact: list[tuple[Any, Any]], k: np.ndarray, top: np.ndarray | int = _E_LO
    ) -> np.ndarray:
        """The lump's count where ``edge`` must add it, else 0: where its scaled top binade
        ``top + k`` (the bin :meth:`between` counts it in) lies in one of the ``exact``
        exponent ranges (inclusive; per row or for all) but its scaled range
        ``[-149 + k, top + k]`` in none. Where its top binade is itself an edge bin, that bin's
        count in ``edge`` holds it already. ``top``: the lump's top binade, -134, or amax's
        binade where the lump holds a tensor's only values (see :func:`_classify`)."""
        high = np.asarray(top) + k
        low = _LUMP_EXP + k
        counted = np.zeros(len(self.rows), dtype=bool)
        inside = np.zeros(len(self.rows), dtype=bool)
        for lo, hi in exact:
            counted |= (high >= lo) & (high <= hi)
            inside |= (low >= lo) & (high <= hi)
        return np.where(counted & ~inside, self.lump, 0)


class _WindowCounter(_Counter):
    """:class:`_Counter` of histograms that hold values only in columns ``lo`` .. ``lo + w - 1``
    (``hist`` holds those ``w`` columns, the finite ones, zeros already out): the prefix sums
    cover the window alone, every count the same as the full width's."""

    def __init__(self, hist: np.ndarray, lo: int) -> None:
        self.lo = lo
        self.width = hist.shape[1]
        self.has = hist > 0  # the window's bins that hold values
        self.lump = hist[:, 0].copy() if lo == 0 else np.zeros(len(hist), dtype=np.int64)
        self.prefix = np.concatenate(
            [np.zeros((len(hist), 1), dtype=np.int64), np.cumsum(hist, axis=1)], axis=1
        )
        self.rows = np.arange(len(hist))
        # row r's prefix position p is flat[base[r] + p] (one flat take, not a 2-D gather)
        self.flat = self.prefix.ravel()
        self.base = self.rows * (self.width + 1)

    def between(self, lo: np.ndarray | int, hi: np.ndarray | int, k: np.ndarray) -> np.ndarray:
        a = np.minimum(np.maximum(np.asarray(lo) - k - _E_LO, 0), _FINITE)
        b = np.minimum(np.maximum(np.asarray(hi) - k - _E_LO + 1, 0), _FINITE)
        b = np.maximum(a, b)
        # full-width prefix positions to the window's: before it 0, after it the total
        a = np.minimum(np.maximum(a - self.lo, 0), self.width)
        b = np.minimum(np.maximum(b - self.lo, 0), self.width)
        return self.flat.take(self.base + b) - self.flat.take(self.base + a)

    def top_low(self) -> tuple[np.ndarray, np.ndarray]:
        """:func:`_top_exp` and :func:`_low_exp` of the rows."""
        any_ = self.has.any(axis=1)
        top = self.width - 1 - np.argmax(self.has[:, ::-1], axis=1) + self.lo
        low = np.argmax(self.has, axis=1) + self.lo
        low_exp = np.where(low == 0, _LUMP_EXP, low + _E_LO)
        return np.where(any_, top + _E_LO, _NONE), np.where(any_, low_exp, -_NONE)


_ROWS_COLUMNS = [
    "rank",
    "step",
    "module",
    "module_type",
    "kind",
    "order",
    "dtype",
    "nonzero",
    "nonfinite",
    "amax",
    "low_exp",
    "top_exp",
    "format",
    "scaling",
    "scale_exp",
    "overflow",
    "flush",
    "subnormal",
    "edge",
]
_COUNTS = ("overflow", "flush", "subnormal", "edge")


def _base(frame: pd.DataFrame, counter: _Counter) -> dict[str, Any]:
    """The identifying columns and per-row facts of ``frame``'s rows (one per row)."""
    return {
        "rank": frame["rank"].to_numpy() if "rank" in frame else np.zeros(len(frame), np.int64),
        "step": frame["step"].to_numpy(),
        "module": frame["module"].to_numpy(),
        "module_type": frame["module_type"].to_numpy(),
        "kind": frame["kind"].to_numpy(),
        "order": frame["order"].to_numpy(),
        "dtype": frame["dtype"].to_numpy(),
        "nonzero": counter.prefix[:, -1],
        "nonfinite": (
            frame["nan"].fillna(0).to_numpy(dtype=np.int64)
            + frame["inf"].fillna(0).to_numpy(dtype=np.int64)
        ),
        "amax": pd.to_numeric(frame["amax"], errors="coerce").to_numpy(dtype=float),
        "low_exp": _low_exp(counter.has),
        "top_exp": _top_exp(counter.has),
    }


def _classify(
    counter: _Counter, amax: np.ndarray, top: np.ndarray, weight: np.ndarray | None = None
) -> Iterable[tuple[FloatFormat, str, dict[str, np.ndarray]]]:
    """Per format and scaling (:data:`FORMATS` x :data:`SCALINGS`, in that order), per row:
    ``scale_exp`` and the counts ``overflow``, ``flush``, ``subnormal``, ``edge``.

    ``weight``: the number of recorded rows each row stands for (summed histograms of rows
    whose ``amax`` and top binade classify alike, :func:`amprobe.store.sections.numerics.amax_class`):
    the ``amax`` counted as overflowing counts once per row."""
    ones = np.ones(len(amax), dtype=np.int64) if weight is None else weight
    zero = np.zeros(len(amax), dtype=np.int64)
    # a row holding only the lump (top binade -134) with a known amax: its values lie at or
    # below amax's binade. The per-tensor scale maps amax under the max, so there the lump is
    # placed at that binade, not at -134 (which the scale would carry past the max)
    lump_row = (top == _E_LO) & np.isfinite(amax) & (amax > 0)
    amax_binade = np.frexp(np.where(lump_row, amax, 1.0))[1].astype(np.int64) - 1
    lump_top = np.where(lump_row, np.clip(amax_binade, _LUMP_EXP, _E_LO), _E_LO)
    for fmt in FORMATS.values():
        t, emin, m = fmt.top_exp, fmt.min_normal_exp, fmt.min_subnormal_exp
        for scaling in SCALINGS:
            if scaling == "none":
                k = zero
                top_l: np.ndarray | int = _E_LO
                at = k  # where between() places each row's columns (the lump's at -134 + at)
            else:
                k = _scale_exps(amax, top, fmt)
                top_l = lump_top
                # a lump-only row's values are all in the lump: the row moved as one
                at = k + (lump_top - _E_LO)
            scaled_amax = amax * np.exp2(k.astype(float))
            above = counter.between(t + 1, 10**6, at)
            top_bin = counter.between(t, t, at)
            # amax settles the top binade when it rounds to a finite value; else amax
            # overflows and the rest of the bin is open
            bound = fmt.overflows_from
            known_fit = np.isfinite(scaled_amax) & (scaled_amax < bound)
            amax_over = (
                np.isfinite(scaled_amax) & (scaled_amax >= bound) & (top + k == t) & (top_bin > 0)
            )
            over = amax_over.astype(np.int64) * ones
            overflow = above + over
            top_open = np.where(known_fit, 0, top_bin - over)
            flush = counter.between(-(10**6), m - 2, at)
            subnormal = counter.between(m - 1, emin - 1, at)
            # the top binade is exact where amax settles it
            normal_hi = t - 1 + known_fit.astype(np.int64)
            exact = [(-math.inf, m - 2), (m, emin - 2), (emin, normal_hi), (t + 1, math.inf)]
            edge = (
                counter.between(m - 1, m - 1, at)
                + counter.between(emin - 1, emin - 1, at)
                + counter.lump_open(exact, k, top_l)
            )
            yield (
                fmt,
                scaling,
                {
                    "scale_exp": k,
                    "overflow": overflow,
                    "flush": flush,
                    "subnormal": subnormal,
                    "edge": edge + np.maximum(top_open, 0),
                },
            )


def compute_whatif_rows(numerics: pd.DataFrame) -> pd.DataFrame:
    """Per numerics row (module, kind, step), format and scaling: overflow/flush/subnormal counts.

    Rows of kind ``input`` are left out. See the module docstring for the classification and
    its tolerance.

    Returns:
        The identifying columns (``rank`` when present, ``step``, ``module``, ``module_type``,
        ``kind``, ``order``, ``dtype``), ``nonzero`` (finite nonzero values), ``nonfinite``
        (NaN + inf, not part of the shares), ``amax``,
        ``top_exp``/``low_exp`` (range of nonzero bins), ``format``, ``scaling``,
        ``scale_exp`` and the counts ``overflow``, ``flush``, ``subnormal``, ``edge``.
    """
    frame = numerics[numerics["kind"].isin(list(KINDS))]
    if frame.empty:
        return pd.DataFrame(columns=_ROWS_COLUMNS)
    frame = frame.reset_index(drop=True)
    if len(frame) > _BLOCK:
        return pd.concat(
            [compute_whatif_rows(frame.iloc[i : i + _BLOCK]) for i in range(0, len(frame), _BLOCK)],
            ignore_index=True,
        )
    hist = _parse_hists(frame["exp_hist"])
    counter = _Counter(hist, frame["zeros"].fillna(0).to_numpy(dtype=np.int64))
    base = _base(frame, counter)
    parts = [
        pd.DataFrame({**base, "format": fmt.name, "scaling": scaling, **counts})
        for fmt, scaling, counts in _classify(counter, base["amax"], base["top_exp"])
    ]
    return pd.concat(parts, ignore_index=True)


def layer_order(numerics: pd.DataFrame) -> dict[str, int]:
    """Module -> position in forward execution order (modules without outputs come last)."""
    if numerics.empty:
        return {}
    kind = numerics["kind"].to_numpy()
    module = numerics["module"].to_numpy()
    outputs = kind == "output"
    # each module's first output position (a missing module or position is left out), modules
    # in order of first appearance; then sorted by it, stably, those without one last
    codes, modules = pd.factorize(module[outputs])
    positions = pd.to_numeric(numerics["order"], errors="coerce").to_numpy(dtype=float)[outputs]
    first = np.full(len(modules), np.nan)
    np.fmin.at(first, codes[codes >= 0], positions[codes >= 0])
    order = {str(modules[i]): n for n, i in enumerate(np.argsort(first, kind="stable"))}
    for name in pd.unique(module[kind != "input"]):
        order.setdefault(str(name), len(order))
    return order


def _group_codes(columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the index of its key (the values of ``columns`` in that row) among the distinct
    keys in order of first appearance, -1 when a key value is missing (groupby drops such
    rows); and the first row of each key."""
    codes = np.zeros(len(columns[0]), dtype=np.int64)
    missing = np.zeros(len(columns[0]), dtype=bool)
    for values in columns:
        part, uniques = pd.factorize(values)
        missing |= part < 0
        codes = codes * (len(uniques) + 1) + part
    _, first, inverse = np.unique(codes[~missing], return_index=True, return_inverse=True)
    # renumber the keys by first appearance (np.unique numbers them by value)
    by_appearance = np.argsort(np.argsort(first, kind="stable"), kind="stable")
    out = np.full(len(codes), -1, dtype=np.int64)
    out[~missing] = by_appearance[inverse.reshape(-1)]
    rows = np.flatnonzero(~missing)[np.sort(first)]
    return out, rows


def compute_whatif_frame(numerics: pd.DataFrame) -> pd.DataFrame:
    """The what-if table: per rank, layer, tensor kind, format and scaling, summed over steps.

    Args:
        numerics: a ``numerics`` table (from :meth:`Run.table`), any number of ranks/steps.

    Returns:
        One row per (rank, module, kind, format, scaling) with :data:`WHATIF_COLUMNS`:
        ``order`` is the module's forward execution position, ``nonfinite`` the NaN + inf
        values, ``judged`` False when there were any (the layer's range is then not known:
        every ``*_share`` is null, the counts are those of its finite values) and
        ``nonfinite_steps`` the sorted sampled steps at which it held them, ``min_exp``/``max_exp`` the
        range of nonzero finite values in powers of two (``2**min_exp`` .. ``2**(max_exp+1)``),
        ``amax`` the largest magnitude over the steps, ``scale_exp`` the per-tensor scale
        exponent of the last sampled step (0 for ``none``), counts summed over steps and shares
        of ``nonzero`` (null where not judged); ``lost_share`` = overflow + flush, ``edge_share`` = values the
        histogram cannot classify exactly (the tolerance, see the module docstring).

    The rows of :func:`compute_whatif_rows` are summed per layer as arrays, one group index
    per row shared by every format and scaling (a frame eight times the table's size, grouped
    and merged, cost more than the classification itself).
    """
    frame = numerics[numerics["kind"].isin(list(KINDS))]
    if frame.empty:
        return pd.DataFrame(columns=WHATIF_COLUMNS)
    frame = frame.reset_index(drop=True)
    n = len(frame)
    blocks = range(0, n, _BLOCK)
    parts = []
    for i in blocks:
        part = frame.iloc[i : i + _BLOCK]
        hist = _parse_hists(part["exp_hist"])
        counter = _Counter(hist, part["zeros"].fillna(0).to_numpy(dtype=np.int64))
        parts.append((counter, _base(part, counter)))
    base = {key: np.concatenate([b[key] for _, b in parts]) for key in parts[0][1]}
    # the dtypes a frame of these columns infers (those of the table grouped before)
    inferred = {k: pd.Series(base[k]).dtype for k in ("module", "module_type", "kind", "dtype")}
    codes, key_rows = _group_codes([base["rank"], base["module"], base["kind"]])
    grouped = codes >= 0
    n_layers = len(key_rows)
    g_rows = codes[grouped]
    # step order (stable): a layer's scale_exp is that of its last sampled step, its
    # module_type the first recorded
    by_step = pd.Series(base["step"]).sort_values(kind="stable").index.to_numpy()
    position = np.empty(n, dtype=np.int64)
    position[by_step] = np.arange(n)
    last = np.full(n_layers, -1, dtype=np.int64)
    np.maximum.at(last, g_rows, position[grouped])
    is_last = np.zeros(n, dtype=bool)
    is_last[by_step[last]] = True
    # per layer facts, from the rows' own values (the same for every format and scaling)
    module_type = base["module_type"]
    named = grouped & ~pd.isna(module_type)
    first_named = np.full(n_layers, n, dtype=np.int64)
    np.minimum.at(first_named, codes[named], position[named])
    type_rows = np.where(first_named < n, by_step[np.minimum(first_named, n - 1)], key_rows)
    step_codes, step_values = pd.factorize(base["step"])
    stepped = grouped & (step_codes >= 0)
    width = max(len(step_values), 1)
    pairs = np.unique(codes[stepped] * width + step_codes[stepped])  # (layer, step) seen
    steps = np.bincount(pairs // width, minlength=n_layers)
    nonfinite = np.zeros(n_layers, dtype=np.int64)
    np.add.at(nonfinite, g_rows, base["nonfinite"][grouped])
    # the sampled steps at which each layer held inf/NaN: such a layer is not judged
    bad = stepped & (base["nonfinite"] > 0)
    bad_steps: list[list[int]] = [[] for _ in range(n_layers)]
    for pair in np.unique(codes[bad] * width + step_codes[bad]).tolist():
        bad_steps[pair // width].append(int(step_values[pair % width]))
    judged = nonfinite == 0
    has = grouped & (base["nonzero"] > 0)
    min_exp = np.full(n_layers, np.inf)
    max_exp = np.full(n_layers, -np.inf)
    np.minimum.at(min_exp, codes[has], base["low_exp"][has])
    np.maximum.at(max_exp, codes[has], base["top_exp"][has])
    amax = np.full(n_layers, np.nan)
    np.fmax.at(amax, g_rows, base["amax"][grouped])
    dtype_codes, dtype_names = pd.factorize(base["dtype"])
    typed = grouped & (dtype_codes >= 0)
    width = max(len(dtype_names), 1)
    seen: dict[int, set[str]] = {}
    for pair in np.unique(codes[typed] * width + dtype_codes[typed]).tolist():
        seen.setdefault(pair // width, set()).add(dtype_names[pair % width])
    if seen:
        dtype_text: pd.Series = pd.Series(
            [",".join(sorted(seen[i])) if i in seen else np.nan for i in range(n_layers)]
        )
    else:
        blank = np.float64 if inferred["dtype"] == np.float64 else object
        dtype_text = pd.Series(np.full(n_layers, np.nan), dtype=blank)
    # the counts of every format and scaling, summed per layer
    combos = [(fmt.name, scaling) for fmt in FORMATS.values() for scaling in SCALINGS]
    sums = {name: np.zeros((len(combos), n_layers), dtype=np.int64) for name in _COUNTS}
    nonzero = np.zeros(n_layers, dtype=np.int64)
    np.add.at(nonzero, g_rows, base["nonzero"][grouped])
    scale_exp = np.zeros((len(combos), n_layers), dtype=np.int64)
    for i, (counter, part_base) in zip(blocks, parts, strict=True):
        rows = slice(i, i + _BLOCK)
        g, keep, tail = codes[rows], grouped[rows], is_last[rows]
        counts_of = _classify(counter, part_base["amax"], part_base["top_exp"])
        for c, (_, _, counts) in enumerate(counts_of):
            for name in _COUNTS:
                np.add.at(sums[name][c], g[keep], counts[name][keep])
            scale_exp[c, g[tail]] = counts["scale_exp"][tail]
    # one row per layer and format/scaling, layers in (rank, execution order, kind) order
    order_of = layer_order(numerics)
    modules = base["module"][key_rows]
    layer_pos = np.array([order_of.get(str(m), len(order_of)) for m in modules], dtype=np.int64)
    kind_rank = {k: i for i, k in enumerate(KINDS)}
    kinds = base["kind"][key_rows]
    ranks = base["rank"][key_rows]
    layers = np.lexsort((np.array([kind_rank[k] for k in kinds]), layer_pos, ranks))
    each = np.repeat(layers, len(combos))
    combo = np.tile(np.arange(len(combos)), n_layers)
    out = pd.DataFrame(
        {
            "rank": ranks[each],
            "module": pd.Series(modules[each], dtype=inferred["module"]),
            "module_type": pd.Series(module_type[type_rows][each], dtype=inferred["module_type"]),
            "kind": pd.Series(kinds[each], dtype=inferred["kind"]),
            "order": layer_pos[each],
            "dtype": dtype_text.iloc[each].reset_index(drop=True),
            "nonfinite_steps": pd.Series([sorted(bad_steps[i]) for i in each], dtype=object),
        }
    )
    return _with_layer_columns(
        out, each, combo, combos, steps, nonzero, nonfinite, judged, min_exp, max_exp, amax,
        scale_exp, sums,
    )  # fmt: skip


def _with_layer_columns(
    out: pd.DataFrame,
    each: np.ndarray,
    combo: np.ndarray,
    combos: list[tuple[str, str]],
    steps: np.ndarray,
    nonzero: np.ndarray,
    nonfinite: np.ndarray,
    judged: np.ndarray,
    min_exp: np.ndarray,
    max_exp: np.ndarray,
    amax: np.ndarray,
    scale_exp: np.ndarray,
    sums: dict[str, np.ndarray],
) -> pd.DataFrame:
    """``out`` (one row per layer and format: its rank, module, kind and dtype columns) with
    the columns every what-if table has alike, from per-layer arrays (``each``: the row's
    layer, ``combo``: its format), in :data:`WHATIF_COLUMNS` order."""
    counts = {name: sums[name][combo, each] for name in _COUNTS}
    denom = np.where(nonzero[each] > 0, nonzero[each], np.nan)
    # a layer that held inf/NaN gets no share: its range is not known (null, not 0)
    unjudged = ~judged[each]
    # the columns gathered, then one frame (not a frame grown a column at a time)
    columns: dict[str, Any] = dict(out.items())
    columns["steps"] = steps[each]
    columns["nonzero"] = nonzero[each]
    columns["nonfinite"] = nonfinite[each]
    columns["judged"] = judged[each]
    for name, exps in (("min_exp", min_exp), ("max_exp", max_exp)):
        columns[name] = pd.array(np.where(np.isfinite(exps), exps, np.nan)[each], dtype="Int64")
    columns["amax"] = amax[each]
    columns["format"] = np.array([f for f, _ in combos], dtype=object)[combo]
    columns["scaling"] = np.array([s for _, s in combos], dtype=object)[combo]
    columns["scale_exp"] = scale_exp[combo, each]
    for name in _COUNTS:
        columns[name] = counts[name]
    for name in _COUNTS:
        columns[f"{name}_share"] = _share(counts[name], denom, unjudged)
    columns["lost_share"] = _share(counts["overflow"] + counts["flush"], denom, unjudged)
    return pd.DataFrame({name: columns[name] for name in WHATIF_COLUMNS})


def _share(count: np.ndarray, denom: np.ndarray, unjudged: np.ndarray) -> np.ndarray:
    """``count / denom`` (0 where nothing nonzero was recorded), NaN for not-judged rows."""
    return np.where(unjudged, np.nan, np.nan_to_num(count / denom, nan=0.0))


def not_judged_text(module: Any, steps: Iterable[int]) -> str:
    """``booster: not judged, held inf/NaN at steps 120–129`` (``step`` for one step)."""
    return f"{module}: not judged, held inf/NaN at {steps_text(steps, word=True)}"


def compute_whatif(run: Any) -> pd.DataFrame:
    """The what-if table of a loaded run, from its per-rank summaries
    (:func:`compute_whatif_summaries`), computed once per run."""
    return run.cached(  # type: ignore[no-any-return]
        "whatif",
        lambda r: compute_whatif_summaries(
            r.summaries(), section_keys(r, "numerics"), _bins_or_none(r)
        ),
    )


def _bins_or_none(run: Any) -> SectionBins | None:
    """The run's decoded histograms (:func:`~amprobe.analysis.numerics.section_bins`), None
    where a text cannot be read as one array (then each text is parsed, naming the bad one)."""
    try:
        return section_bins(run)
    except (ValueError, OverflowError):
        return None


def _steps_of(runs: dict[str, Any]) -> list[int]:
    """The steps of a section's step runs (the kept runs: a capped list is cut)."""
    return [s for a, b in runs["runs"] for s in range(int(a), int(b) + 1)]


def summary_layer_order(summaries: dict[int, dict[str, Any]]) -> dict[str, int]:
    """:func:`layer_order` of the ranks' ``numerics`` sections (ranks in ascending order, as
    the merged table holds them)."""
    first: dict[str, float] = {}
    for rank in sorted(summaries):
        sec = summaries[rank].get("numerics") or {}
        for module, order in sec.get("outputs", []):
            value = math.nan if order is None else float(order)
            known = first.get(module)
            # np.fmin(known, value) in plain floats: the smaller, a NaN only where both are
            if known is None or known != known or value < known:
                first[module] = value
    names = list(first)
    positions = np.array([first[m] for m in names], dtype=float)
    order = {names[i]: n for n, i in enumerate(np.argsort(positions, kind="stable"))}
    for rank in sorted(summaries):
        sec = summaries[rank].get("numerics") or {}
        for layer in sec.get("layers", []):
            if layer["kind"] != "input":
                order.setdefault(str(layer["module"]), len(order))
    return order


def compute_whatif_summaries(
    summaries: dict[int, dict[str, Any]],
    keys: dict[int, int] | None = None,
    bins: SectionBins | None = None,
) -> pd.DataFrame:
    """:func:`_whatif_from_summaries` worked out once per class of ranks with equal ``numerics``
    sections (the key is the section's data: equal ``marshal`` bytes load back to equal
    values, never the file), each other rank of a class given its representative's rows.
    ``keys``: each rank's class of equal sections found already
    (:func:`~amprobe.analysis.frames.section_keys`), else found here; ``bins``: the
    histograms of those classes decoded already (:func:`~amprobe.analysis.numerics.section_bins`
    of the same ``keys``), else parsed here.

    Exact: a rank's rows are a function of its own section and the layer order; the order,
    taken from the lowest rank at which each layer appears, is the same from the lowest rank
    of each class (a layer's first rank is the lowest of its class)."""
    rep_of: dict[int, int] = {}
    first_of: dict[Any, int] = {}
    for rank in sorted(summaries):
        key: bytes | str | int
        if keys is not None and rank in keys:
            key = keys[rank]
        else:
            section = summaries[rank].get("numerics") or {}
            try:
                key = marshal.dumps(section)
            except ValueError:  # not plain values (marshal cannot write them)
                key = repr(section)
        rep_of[rank] = first_of.setdefault(key, rank)
    if keys is None:
        bins = None
    if len(first_of) == len(summaries):
        return _whatif_from_summaries(summaries, bins)
    frame = _whatif_from_summaries({r: summaries[r] for r in first_of.values()}, bins)
    if frame.empty:
        return frame
    rank_col = frame["rank"].to_numpy()
    bounds = np.flatnonzero(np.diff(rank_col)) + 1  # a rank's rows are contiguous
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(rank_col)]])
    rows_of = {int(rank_col[a]): np.arange(a, b) for a, b in zip(starts, ends, strict=True)}
    empty = np.zeros(0, dtype=np.int64)
    parts = [rows_of.get(rep_of[rank], empty) for rank in sorted(summaries)]
    index = np.concatenate(parts)
    ranks = np.repeat(np.array(sorted(summaries), dtype=np.int64), [len(p) for p in parts])
    out = frame.iloc[index].reset_index(drop=True)
    out["rank"] = ranks.astype(frame["rank"].dtype)
    return out


_AMAX, _ROWS, _BINS = itemgetter("amax"), itemgetter("rows"), itemgetter("bins")


def _whatif_from_summaries(
    summaries: dict[int, dict[str, Any]], bins: SectionBins | None = None
) -> pd.DataFrame:
    """:func:`compute_whatif_frame` from the ranks' ``numerics`` summary sections
    (:mod:`amprobe.store.sections.numerics`): the same frame, built from each layer's
    histograms summed per (dtype, amax class, top binade) instead of from every sampled row.

    Exact: rows of one amax class and top binade get the same per-tensor scale and the same
    overflow verdict for ``amax`` in every format, so classifying their summed histogram (the
    amax counted once per row) sums their classifications. Two bounds: a layer's sampled steps
    are counted as distinct consecutive step numbers (the rows of a rank's file are in step
    order), and ``nonfinite_steps`` holds the first
    :data:`~amprobe.store.sections.numerics.MAX_RUNS` runs of such steps only. ``bins``: the
    ranks' histograms decoded already (every rank of ``summaries`` a representative there).
    """
    if bins is not None and not all(rank in bins.first for rank in summaries):
        bins = None
    # one pass over the layers of the what-if's kinds: each layer's facts and its histogram
    # groups (one pseudo-row per (layer, histogram group))
    layers: list[tuple[int, dict[str, Any]]] = []
    sizes: list[int] = []  # each layer's groups
    g_first: list[int] = []  # each layer's first group's number in bins
    g_amax: list[float | None] = []
    g_rows: list[int] = []
    texts: list[str] = []
    for rank in sorted(summaries):
        g = bins.first[rank] if bins is not None else 0
        for layer in (summaries[rank].get("numerics") or {}).get("layers", []):
            groups = layer["hist"]
            if layer["kind"] in KINDS:
                layers.append((rank, layer))
                sizes.append(len(groups))
                g_first.append(g)
                # (map of itemgetters: no Python frame per group)
                g_amax.extend(map(_AMAX, groups.values()))
                g_rows.extend(map(_ROWS, groups.values()))
                if bins is None:
                    for text in map(_BINS, groups.values()):
                        texts.append(
                            text if isinstance(text, str) else encode_bins(decode_bins(text))
                        )
            g += len(groups)
    if not layers:
        return pd.DataFrame(columns=WHATIF_COLUMNS)
    n_layers, n_groups = len(layers), len(g_amax)
    size = np.array(sizes, dtype=np.int64)
    owner = np.repeat(np.arange(n_layers), size)
    # (None -> NaN: numpy's conversion to float)
    amax_g = np.array(g_amax, dtype=float)
    weight = np.array(g_rows, dtype=np.int64)
    if bins is not None:
        # each group's number in bins: a rank's groups are numbered in section order
        offset = np.arange(n_groups) - np.repeat(np.cumsum(size) - size, size)
        g_num = np.repeat(np.array(g_first, dtype=np.int64), size) + offset
        pairs = bins.start[g_num + 1] - bins.start[g_num]
    else:
        pairs = np.array([(t.count(",") + 1) // 2 if t else 0 for t in texts], dtype=np.int64)
    combos = [(fmt.name, scaling) for fmt in FORMATS.values() for scaling in SCALINGS]
    sums = {name: np.zeros((len(combos), n_layers), dtype=np.int64) for name in _COUNTS}
    nonzero = np.zeros(n_layers, dtype=np.int64)
    min_exp = np.full(n_layers, np.inf)
    max_exp = np.full(n_layers, -np.inf)

    def per_layer(block: np.ndarray, values: np.ndarray) -> np.ndarray:
        """``values`` of the block's groups summed per layer (bincount: float sums of counts,
        exact below 2**53)."""
        return np.bincount(block, weights=values, minlength=n_layers).astype(np.int64)

    # in blocks of groups: dense (groups, binades) arrays stay ~35 MB at any rank count
    for g0 in range(0, n_groups, _BLOCK):
        g1 = min(g0 + _BLOCK, n_groups)
        n = g1 - g0
        # the block's "e,n,e,n" texts parsed as one array (no Python loop per binade)
        lo, width = 0, 1
        hist = np.zeros(n, dtype=np.int64)
        if pairs[g0:g1].any():
            if bins is not None:
                exp, count, _ = bins.entries(g_num[g0:g1])
                values = np.stack([exp, count], axis=1)
            else:
                text = ",".join(t for t in texts[g0:g1] if t)
                values = np.array(text.split(","), dtype=np.int64).reshape(-1, 2)
            rows = np.repeat(np.arange(n), pairs[g0:g1])
            cols = np.minimum(np.maximum(values[:, 0] - _E_LO, 0), _FINITE - 1)
            # only the columns some group of the block uses (a few dozen of the 263)
            lo, width = int(cols.min()), int(cols.max() - cols.min()) + 1
            flat = rows * width + (cols - lo)
            hist = np.bincount(flat, weights=values[:, 1], minlength=n * width)
        counter = _WindowCounter(hist.astype(np.int64).reshape(n, width), lo)
        block = owner[g0:g1]
        top_g, low_g = counter.top_low()
        classified = _classify(counter, amax_g[g0:g1], top_g, weight[g0:g1])
        for c_i, (_, _, counts) in enumerate(classified):
            for name in _COUNTS:
                sums[name][c_i] += per_layer(block, counts[name])
        nonzero += per_layer(block, counter.prefix[:, -1])
        has = counter.prefix[:, -1] > 0
        np.minimum.at(min_exp, block[has], low_g[has])
        np.maximum.at(max_exp, block[has], top_g[has])
    # each layer's facts, a field at a time (map of itemgetters: no Python frame per layer)
    kept = [layer for _, layer in layers]
    last = list(map(itemgetter("last"), kept))
    last_amax_l = [np.nan if x[1] is None else float(x[1]) for x in last]
    last_top_l = [_NONE if x[2] is None else int(x[2]) for x in last]
    nonfinite_l = [c["nan"] + c["inf"] for c in map(itemgetter("counts"), kept)]
    module_l = list(map(itemgetter("module"), kept))
    kind_l = list(map(itemgetter("kind"), kept))
    type_l = list(map(itemgetter("module_type"), kept))
    dtype_l = [",".join(sorted(d)) if d else np.nan for d in map(itemgetter("dtypes"), kept)]
    amax_l = [np.nan if a is None else a for a in map(itemgetter("amax"), kept)]
    steps_l = list(map(itemgetter("steps"), kept))
    # sorted once per layer; a layer's rows (one per format and scaling) share its list: a
    # list per row was ~100,000 allocations at 1,024 ranks (read them, never change them)
    bad_steps = np.empty(n_layers, dtype=object)
    for i, runs in enumerate(map(itemgetter("nonfinite_runs"), kept)):
        bad_steps[i] = sorted(_steps_of(runs)) if runs["runs"] else []
    last_amax = np.array(last_amax_l)
    last_top = np.array(last_top_l, dtype=np.int64)
    scale_exp = np.zeros((len(combos), n_layers), dtype=np.int64)
    for c_i, (fmt_name, scaling) in enumerate(combos):
        if scaling != "none":
            scale_exp[c_i] = _scale_exps(last_amax, last_top, FORMATS[fmt_name])
    nonfinite = np.array(nonfinite_l, dtype=np.int64)
    judged = nonfinite == 0
    order_of = summary_layer_order(summaries)
    ranks = np.array([rank for rank, _ in layers], dtype=np.int64)
    layer_pos = np.array([order_of.get(str(m), len(order_of)) for m in module_l], dtype=np.int64)
    kind_rank = {k: i for i, k in enumerate(KINDS)}
    ordered = np.lexsort((np.array([kind_rank[k] for k in kind_l]), layer_pos, ranks))
    each = np.repeat(ordered, len(combos))
    combo = np.tile(np.arange(len(combos)), n_layers)
    amax = np.array(amax_l)
    steps = np.array(steps_l, dtype=np.int64)

    def repeated(values: list[Any]) -> pd.Series:
        """The layers' ``values`` in the rows' order, with the dtype pandas infers for them
        (that of the rows' values: the same values, each layer repeated)."""
        return pd.Series(values).iloc[each].reset_index(drop=True)

    out = pd.DataFrame(
        {
            "rank": ranks[each],
            "module": repeated(module_l),
            "module_type": repeated(type_l),
            "kind": repeated(kind_l),
            "order": layer_pos[each],
            "dtype": repeated(dtype_l),
            "nonfinite_steps": pd.Series(bad_steps[each], dtype=object),
        }
    )
    return _with_layer_columns(
        out, each, combo, combos, steps, nonzero, nonfinite, judged, min_exp, max_exp, amax,
        scale_exp, sums,
    )  # fmt: skip


def value_codes(column: pd.Series) -> np.ndarray:
    """Per value of a what-if column, a code equal for equal values: lists (``nonfinite_steps``)
    compared by their items, every missing value (None, NaN, NA) the code -1. For the readers
    that find which rows hold the same values (hashing codes, not a tuple of each row)."""
    try:
        return pd.factorize(column)[0]
    except TypeError:  # lists: unhashable
        pass
    # the values by identity first (a layer's rows share its list), then each distinct
    # object's items: identical objects are equal
    values = column.tolist()
    same, _ = pd.factorize(np.fromiter(map(id, values), dtype=np.int64, count=len(values)))
    _, firsts = np.unique(same, return_index=True)
    items = (tuple(v) if isinstance(v, list) else v for v in (values[i] for i in firsts.tolist()))
    codes = pd.factorize(np.fromiter(items, dtype=object, count=len(firsts)))[0]
    return codes[same]


def whatif_records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The what-if table as JSON-ready records (plain Python values, missing values as None).

    Built from each column's values as a list (the plain Python values), not through an
    object-dtype copy of the frame.
    """
    columns = [
        [
            value if isinstance(value, list) else None if value is None or pd.isna(value) else value
            for value in frame[name].tolist()
        ]
        for name in frame.columns
    ]
    names = list(frame.columns)
    return [dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True)]


def compute_exponent_shares(numerics: pd.DataFrame, kinds: Iterable[str]) -> pd.DataFrame:
    """Per module and kind (forward execution order) and base-2 exponent: the share of values.

    Histograms of ``kinds`` are summed over sampled steps and ranks; zeros and inf/NaN are
    left out (exponent -127 keeps only the values in ``[2**-127, 2**-126)``; -149 stands for
    every nonzero value below 2**-133, binade not resolved). Returns columns ``module``, ``kind``,
    ``order``, ``exponent``, ``count``, ``share`` (of that module and kind's nonzero finite
    values).
    """
    frame = numerics[numerics["kind"].isin(list(kinds))]
    if frame.empty:
        return pd.DataFrame(columns=_SHARE_COLUMNS)
    order = layer_order(numerics)
    hist = _parse_hists(frame["exp_hist"])
    zeros = frame["zeros"].fillna(0).to_numpy(dtype=np.int64)
    hist[:, _ZERO] = np.maximum(hist[:, _ZERO] - zeros, 0)
    hist[:, _FINITE] = 0
    index = pd.MultiIndex.from_arrays(
        [frame["module"].astype(str).to_numpy(), frame["kind"].astype(str).to_numpy()]
    )
    summed = pd.DataFrame(hist, index=index).groupby(level=[0, 1], sort=False).sum()
    return _shares(
        [(module, kind, counts.to_numpy()) for (module, kind), counts in summed.iterrows()], order
    )


def compute_exponent_shares_summaries(
    histograms: LayerHistograms, order: dict[str, int], kinds: Iterable[str]
) -> pd.DataFrame:
    """:func:`compute_exponent_shares` of every rank's rows, from their summed histograms
    (:func:`amprobe.analysis.numerics.compute_layer_histograms`) and the layer order
    (:func:`summary_layer_order`): the same frame.

    Exact: the summaries' groups hold each row's nonzero finite binades (the zeros taken out
    of bin -127 row by row, as here), the values below 2**-133 at the lump's column."""
    wanted = set(kinds)
    picked = [i for i, (_, kind) in enumerate(histograms.keys) if kind in wanted]
    if not picked:
        return pd.DataFrame(columns=_SHARE_COLUMNS)
    # LayerHistograms' columns are binades HIST_LOW (-134, the lump) .. 127: this module's
    # finite columns (_E_LO = HIST_LOW)
    return _shares(
        [
            (str(histograms.keys[i][0]), str(histograms.keys[i][1]), histograms.counts[i])
            for i in picked
        ],
        order,
    )


_SHARE_COLUMNS = ["module", "kind", "order", "exponent", "count", "share"]


def _shares(summed: list[tuple[str, str, np.ndarray]], order: dict[str, int]) -> pd.DataFrame:
    """:func:`compute_exponent_shares`' frame of each (module, kind)'s summed counts per column
    (column ``j``: binade ``j + _E_LO``, column 0 the lump), layers in order of first
    appearance."""
    records = []
    for module, kind, values in summed:
        total = int(values.sum())
        if total == 0:
            continue
        for j in np.flatnonzero(values):
            n = int(values[j])
            exponent = _LUMP_EXP if j == 0 else j + _E_LO
            records.append(
                (module, kind, order.get(str(module), len(order)), exponent, n, n / total)
            )
    out = pd.DataFrame.from_records(records, columns=_SHARE_COLUMNS)
    kind_rank = {k: i for i, k in enumerate(KINDS)}
    out = out.assign(_k=out["kind"].map(kind_rank))
    out = out.sort_values(["order", "_k", "exponent"], kind="stable").drop(columns="_k")
    return out.reset_index(drop=True)


def compute_fp16_gradient_fit(numerics: pd.DataFrame) -> pd.DataFrame:
    """Gradients under fp16 with one loss scale per step: the best scale and what it loses.

    fp16 training multiplies every gradient by one loss scale. Per rank and sampled step, the
    best power of two is the largest that keeps the step's largest gradient (unscaled ``amax``
    over every gradient row) under 65504: ``2**floor(log2(65504 / amax))``; a larger scale
    overflows, a smaller one flushes more. Counted as in :func:`compute_whatif_rows`: flush =
    scaled binade below 2**-25, exact; ``edge`` = the binade ``[2**-25, 2**-24)``, whose values
    round up to 2**-24 except a tie at exactly 2**-25 (it flushes), plus the lump of values
    below 2**-133 where its scaled range crosses the flush boundary.

    Returns:
        One row per (rank, step, module, kind) of gradients: ``loss_scale_exp``, ``nonzero``,
        ``flush``, ``edge``, plus ``low_exp``/``top_exp``.
    """
    fmt = FORMATS["fp16"]
    grads = numerics[numerics["kind"].isin(["grad_output", "grad_param"])].reset_index(drop=True)
    cols = ["rank", "step", "module", "kind", "loss_scale_exp", "nonzero", "flush", "edge"]
    if grads.empty:
        return pd.DataFrame(columns=[*cols, "low_exp", "top_exp"])
    if "rank" not in grads:
        grads = grads.assign(rank=0)
    hist = _parse_hists(grads["exp_hist"])
    zeros = grads["zeros"].fillna(0).to_numpy(dtype=np.int64)
    top = _top_finite_exp(hist, zeros)
    amax = pd.to_numeric(grads["amax"], errors="coerce").to_numpy(dtype=float)
    # where amax is unknown, the histogram bounds it
    amax = np.where(
        np.isfinite(amax) & (amax > 0), amax, np.where(top > _NONE, np.exp2(top + 1.0), 0)
    )
    peak = pd.Series(amax).groupby([grads["rank"], grads["step"]]).transform("max").to_numpy()
    with np.errstate(divide="ignore"):
        k = np.where(peak > 0, np.floor(np.log2(fmt.max / np.where(peak > 0, peak, 1.0))), 0)
    k = k.astype(np.int64)
    counter = _Counter(hist, zeros)
    m = fmt.min_subnormal_exp
    exact = [(-math.inf, m - 2), (m, math.inf)]
    return pd.DataFrame(
        {
            "rank": grads["rank"].to_numpy(),
            "step": grads["step"].to_numpy(),
            "module": grads["module"].to_numpy(),
            "kind": grads["kind"].to_numpy(),
            "loss_scale_exp": k,
            "nonzero": counter.prefix[:, -1],
            "flush": counter.between(-(10**6), m - 2, k),
            "edge": counter.between(m - 1, m - 1, k) + counter.lump_open(exact, k),
            "low_exp": _low_finite_exp(hist, zeros),
            "top_exp": top,
        }
    )
