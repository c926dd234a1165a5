"""Per-step series of many ranks reduced on the server for drawing: bands, outliers, a matrix.

A run of hundreds of ranks cannot be drawn one line per rank (the page would carry every
rank's series). Instead each rank's series is binned by step, the bins are summarized across
ranks (min, p10, median, p90, max: :func:`compute_rank_bands`), the ranks that stray from the
others are named (:class:`OutlierRule`), and a rank x step-bin matrix of each rank's deviation
from the median of ranks is kept for a heatmap, its rows bucketed by rank order when there are
many ranks (:func:`compute_rank_matrix`; a bucket shows its rank that deviates most, never an
average, so one diverging rank is never hidden).

Binning: the steps are cut into at most ``max_bins`` bins of equal width in steps (one bin per
step when there are fewer steps); a rank's value in a bin is the ``reduce`` of its values there
(``"min"`` for the loss scale, so that a drop is never hidden; ``"median"`` for step times;
``"mean"`` for the loss). Pure numpy/pandas on a frame; on a run of many ranks the rank x
bin matrix is reduced in the derived store's DuckDB instead (:class:`StepsRelation`: one
``GROUP BY rank, bin`` query per series, 4,096 x 1,000 cells back), and only the quantiles
across ranks are taken in numpy, as on a frame.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "MAX_BINS",
    "MAX_ROWS",
    "OutlierRule",
    "SERIES_RULES",
    "StepBins",
    "Outlier",
    "RankBands",
    "RankMatrix",
    "StepsRelation",
    "ResultStore",
    "CHUNK_ROWS",
    "compute_step_bins",
    "compute_rank_bands",
    "compute_rank_matrix",
    "bucket_ranks",
    "rank_range_text",
    "rule_for",
]

#: step bins of a band, at most
MAX_BINS = 1000
#: rows of a rank x step heatmap, at most (more ranks are bucketed by rank order)
MAX_ROWS = 512
_REDUCERS = ("min", "max", "mean", "median", "last")
#: rows of one ``GROUP BY rank`` query with a median, at most: a run of more rows is queried
#: by blocks of consecutive ranks (at 4,096 ranks x 10,000 steps one query of all the rows
#: ran out of DuckDB's 1 GB: a holistic aggregate keeps every value of its groups)
CHUNK_ROWS = 4_000_000
#: each reducer as a DuckDB aggregate of the value ``v`` (``median`` interpolates between the
#: two middle values, as numpy's; ``last``: the value at the bin's highest step)
_SQL_REDUCERS = {
    "min": "min(v)",
    "max": "max(v)",
    "mean": "avg(v)",
    "median": "median(v)",
    "last": "arg_max(v, step)",
}


@dataclass(frozen=True)
class OutlierRule:
    """When a rank is named as an outlier of a series.

    A rank's value in a bin is *out* when it differs from the median of all ranks in that bin
    by more than ``(ratio - 1) * |median|`` and by more than ``floor`` (the series' unit). A
    rank is named when it is out in at least ``min_share`` of the bins it has a value in (and
    in one bin at least); the named are ordered by that share, then by their largest relative
    deviation, and at most ``max_named`` are named (the rest are counted).
    """

    ratio: float
    floor: float
    min_share: float
    max_named: int = 8
    #: how a rank's steps in one bin are reduced to one value (one of min, max, mean, median, last)
    reduce: str = "median"

    def describe(self) -> str:
        """The rule in words, short enough for a figure's note."""
        off = (
            "off the median of ranks"
            if self.ratio <= 1.0
            else f">{self.ratio - 1:.0%} off the median of ranks"
        )
        share = (
            "in any bin" if self.min_share <= 0 else f"in \u2265{self.min_share:.0%} of its bins"
        )
        return f"{off} {share}"


#: series (a steps column) -> its binning and outlier rule; declared once, for every figure
SERIES_RULES: dict[str, OutlierRule] = {
    # powers of two: any difference is a different scale; a drop in one step must show
    "scale_before": OutlierRule(ratio=1.0, floor=0.0, min_share=0.0, reduce="min"),
    "scale_after": OutlierRule(ratio=1.0, floor=0.0, min_share=0.0, reduce="min"),
    # 20 µs: AMP-D02's floor under timer noise; 20 % of bins: consistent, not one hiccup
    "wall_s": OutlierRule(ratio=1.5, floor=20e-6, min_share=0.2, reduce="median"),
    "probe_s": OutlierRule(ratio=2.0, floor=20e-6, min_share=0.2, reduce="median"),
    "data_wait_s": OutlierRule(ratio=2.0, floor=1e-3, min_share=0.2, reduce="median"),
    # ranks see other data: only a loss far from the others' (and not for one bin) is named
    "loss": OutlierRule(ratio=1.5, floor=0.0, min_share=0.2, reduce="mean"),
    "gpu_util": OutlierRule(ratio=1.5, floor=10.0, min_share=0.2, reduce="mean"),
    "tensor_any": OutlierRule(ratio=1.5, floor=10.0, min_share=0.2, reduce="mean"),
}
_DEFAULT_RULE = OutlierRule(ratio=1.5, floor=0.0, min_share=0.2, reduce="median")


def rule_for(column: str) -> OutlierRule:
    """The :data:`SERIES_RULES` entry of ``column`` (a median-binned 50 % rule if none)."""
    return SERIES_RULES.get(column, _DEFAULT_RULE)


@dataclass(frozen=True)
class StepBins:
    """Step bins: bin ``i`` holds the steps ``first[i]..last[i]`` (inclusive, ascending)."""

    first: np.ndarray
    last: np.ndarray

    def __len__(self) -> int:
        return len(self.first)

    @property
    def single(self) -> bool:
        """Whether every bin is one step (the series as recorded)."""
        return bool(np.array_equal(self.first, self.last))

    def of(self, steps: np.ndarray) -> np.ndarray:
        """The bin index of each step (steps are within the bins' range)."""
        return np.searchsorted(self.first, steps, side="right") - 1

    def width(self) -> int:
        """The largest number of steps a bin spans."""
        return int((self.last - self.first).max()) + 1 if len(self) else 0


def compute_step_bins(steps: np.ndarray | pd.Series, max_bins: int = MAX_BINS) -> StepBins:
    """At most ``max_bins`` bins of equal width (in steps) over ``steps``; bins with no step
    are dropped and each bin's bounds are its first and last recorded step."""
    unique = np.unique(np.asarray(steps, dtype=np.int64))
    if len(unique) <= max_bins:
        return StepBins(unique, unique.copy())
    lo, hi = int(unique[0]), int(unique[-1])
    width = -(-(hi - lo + 1) // max_bins)
    code = (unique - lo) // width
    starts = np.flatnonzero(np.diff(code, prepend=-1))
    ends = np.append(starts[1:], len(unique)) - 1
    return StepBins(unique[starts], unique[ends])


class ResultStore:
    """Results of a :class:`StepsRelation` kept on disk, one file per result in ``folder``
    (a rank x bin matrix as ``.npz``, a frame as Parquet), named by a hash of the result's key
    (the relation's filter and the query or series) and holding the key, checked on reading.

    The folder belongs to one version of the rows (``amprobe.store.derived.results_dir``
    names it after the derived ``steps.parquet`` file): a rebuilt store gets a new folder, so a
    result is never read for other rows. Files are written under a temporary name and moved
    into place; a file that cannot be read or written is computed again, never an error.
    """

    def __init__(self, folder: Path):
        self.folder = folder

    def _path(self, key: tuple[Any, ...], suffix: str) -> Path:
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
        return self.folder / f"{key[0]}-{digest}{suffix}"

    def load(self, key: tuple[Any, ...]) -> Any:
        """The stored result of ``key``, or None (none stored, unreadable, another key)."""
        try:
            if key[0] == "matrix":
                with np.load(self._path(key, ".npz"), allow_pickle=False) as z:
                    if str(z["key"]) != repr(key):
                        return None
                    bins = StepBins(z["first"], z["last"])
                    return bins, z["ranks"], z["matrix"]
            table = pq.read_table(self._path(key, ".parquet"))
            if (table.schema.metadata or {}).get(b"amprobe_key") != repr(key).encode():
                return None
            return table.to_pandas()
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, key: tuple[Any, ...], value: Any) -> None:
        """Keep ``value`` (best effort: a folder that cannot be written keeps nothing)."""
        tmp = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if key[0] == "matrix":
                bins, ranks, matrix = value
                path = self._path(key, ".npz")
                fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
                with os.fdopen(fd, "wb") as out:
                    np.savez_compressed(
                        out,
                        key=np.array(repr(key)),
                        first=np.asarray(bins.first, dtype=np.int64),
                        last=np.asarray(bins.last, dtype=np.int64),
                        ranks=np.asarray(ranks, dtype=np.int64),
                        matrix=np.asarray(matrix, dtype="float64"),
                    )
            else:
                path = self._path(key, ".parquet")
                table = pa.Table.from_pandas(value, preserve_index=False)
                meta = dict(table.schema.metadata or {})
                meta[b"amprobe_key"] = repr(key).encode()
                fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
                os.close(fd)
                pq.write_table(table.replace_schema_metadata(meta), tmp)
            os.replace(tmp, path)
            tmp = None
        except (OSError, ValueError, TypeError, ImportError):
            pass
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


class StepsRelation:
    """A run's ``steps`` read through its derived store (``Run.relation("steps")``, DuckDB):
    what a figure of many ranks needs, computed in the engine, never the merged frame.

    ``where`` is a SQL condition on the rows (``scaler_rows``' filter, for example);
    :meth:`filtered` adds one. Results are kept per query (one relation object per figure
    set: a report and a dashboard tab read each series once), and in ``store`` when given
    (:class:`ResultStore`: the next process that reads the same rows reads them there).
    """

    def __init__(
        self,
        relation: Any,
        where: str = "TRUE",
        cache: dict[Any, Any] | None = None,
        ranks: np.ndarray | None = None,
        store: ResultStore | None = None,
    ):
        self.relation = relation
        self.where = where
        self._cache: dict[Any, Any] = {} if cache is None else cache
        #: the ranks with a row, when the caller knows them (a run's summaries), else queried
        self._ranks = ranks
        self.store = store

    def filtered(self, condition: str) -> StepsRelation:
        """The rows that also meet ``condition`` (results cached with this one's)."""
        return StepsRelation(
            self.relation, f"({self.where}) AND ({condition})", self._cache, store=self.store
        )

    def result(self, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        """``compute()``, once per ``key`` (a tuple: ``("matrix", ...)`` for a
        :meth:`rank_bin_matrix` result, else a frame): from this relation's cache, else
        from its :class:`ResultStore`, else computed and kept in both."""
        if key in self._cache:
            return self._cache[key]
        value = self.store.load(key) if self.store is not None else None
        if value is None:
            value = compute()
            if self.store is not None:
                self.store.save(key, value)
        self._cache[key] = value
        return value

    def query(self, sql: str) -> pd.DataFrame:
        """``sql`` over the rows, named ``s`` (``SELECT ... FROM s``), as a frame; the
        rows of :attr:`where` only."""
        return self.result(("query", self.where, sql), lambda: self._run(sql, self.where))  # type: ignore[no-any-return]

    def _run(self, sql: str, where: str) -> pd.DataFrame:
        return self.relation.filter(where).query("s", sql).df()  # type: ignore[no-any-return]

    def query_by_rank(self, sql: str) -> pd.DataFrame:
        """:meth:`query` of a ``... GROUP BY rank ORDER BY rank`` query (whose groups never
        span ranks), run over blocks of consecutive ranks of at most :data:`CHUNK_ROWS` rows
        when the rows are more, the blocks' frames put together in rank order: the same
        frame, within DuckDB's memory limit where a median per rank keeps every value."""

        def run() -> pd.DataFrame:
            blocks = self._rank_blocks()
            if len(blocks) <= 1:
                return self._run(sql, self.where)
            parts = [self._run(sql, f"({self.where}) AND ({block})") for block in blocks]
            return pd.concat(parts, ignore_index=True)

        return self.result(("query", self.where, sql), run)  # type: ignore[no-any-return]

    def _rank_blocks(self) -> list[str]:
        """Conditions ``rank BETWEEN a AND b`` of consecutive ranks, each of at most
        :data:`CHUNK_ROWS` rows (a rank of more rows alone); one (TRUE) when all are fewer."""
        counts = self.query("SELECT rank, count(*) AS n FROM s GROUP BY rank ORDER BY rank")
        ranks = counts["rank"].to_numpy(dtype=np.int64)
        rows = counts["n"].to_numpy(dtype=np.int64)
        if rows.sum() <= CHUNK_ROWS:
            return ["TRUE"]
        blocks, first, total = [], 0, 0
        for i, n in enumerate(rows):
            if total and total + n > CHUNK_ROWS:
                blocks.append(f"rank BETWEEN {ranks[first]} AND {ranks[i - 1]}")
                first, total = i, 0
            total += int(n)
        blocks.append(f"rank BETWEEN {ranks[first]} AND {ranks[-1]}")
        return blocks

    @property
    def ranks(self) -> np.ndarray:
        """The ranks with a row (ascending)."""
        if self._ranks is not None and self.where == "TRUE":
            return self._ranks
        frame = self.query("SELECT DISTINCT rank FROM s ORDER BY rank")
        return frame["rank"].to_numpy(dtype=np.int64)

    def has(self, column: str) -> bool:
        """Whether some row holds a value (not null) of ``column`` (stops at the first)."""
        return len(self.query(f'SELECT 1 AS n FROM s WHERE "{column}" IS NOT NULL LIMIT 1')) > 0

    def rank_bin_matrix(
        self, column: str, max_bins: int, reduce: str
    ) -> tuple[StepBins, np.ndarray, np.ndarray]:
        """:func:`compute_step_bins` over the steps with a finite ``column`` and the ranks x
        bins matrix of ``reduce`` of it, as :func:`_rank_bin_matrix` on the frame, in one
        ``GROUP BY rank, bin`` query (each cell's first and last step with it; by blocks of
        ranks on a run of more than :data:`CHUNK_ROWS` rows).

        The bins' origin and width come from the first and last step (one cheap query); the
        bins are then exactly :func:`compute_step_bins`' when they prove more than
        ``max_bins`` distinct steps (a bin with two steps counts two) or when every step is
        a bin of its own; otherwise (sparse steps) the distinct steps are queried first."""
        if reduce not in _REDUCERS:
            raise ValueError(f"reduce must be one of {_REDUCERS}, not {reduce!r}")
        key = ("matrix", self.where, column, max_bins, reduce)
        return self.result(key, lambda: self._rank_bin_matrix(column, max_bins, reduce))  # type: ignore[no-any-return]

    def _rank_bin_matrix(
        self, column: str, max_bins: int, reduce: str
    ) -> tuple[StepBins, np.ndarray, np.ndarray]:
        finite = f'step IS NOT NULL AND "{column}" IS NOT NULL AND isfinite("{column}")'
        ends = self.query(f"SELECT min(step) AS lo, max(step) AS hi FROM s WHERE {finite}")
        lo, hi = ends["lo"].iloc[0], ends["hi"].iloc[0]
        if pd.isna(lo):
            none = np.empty(0, dtype=np.int64)
            return StepBins(none, none), none, np.full((0, 0), np.nan)
        lo, hi = int(lo), int(hi)
        width = 1 if hi - lo + 1 <= max_bins else -(-(hi - lo + 1) // max_bins)
        cells = self._cells(column, finite, reduce, lo, width)
        codes, first, last = _code_bounds(cells)
        if width > 1 and len(codes) + int((first < last).sum()) <= max_bins:
            # maybe no more than max_bins distinct steps: compute_step_bins keeps each alone
            steps = self.query(f"SELECT DISTINCT step FROM s WHERE {finite}")["step"]
            if len(steps) <= max_bins:
                width = 1
                cells = self._cells(column, finite, reduce, lo, width)
                codes, first, last = _code_bounds(cells)
        bins = StepBins(first, last)
        ranks, rank_code = _codes(cells["rank"].to_numpy(dtype=np.int64))
        bin_code = np.searchsorted(codes, cells["code"].to_numpy(dtype=np.int64))
        matrix = np.full((len(ranks), len(bins)), np.nan)
        matrix[rank_code, bin_code] = cells["v"].to_numpy(dtype="float64")
        return bins, ranks, matrix

    def _cells(self, column: str, finite: str, reduce: str, lo: int, width: int) -> pd.DataFrame:
        """Each (rank, bin code)'s reduced value and its first and last step."""
        sql = (
            f"SELECT rank, (step - {lo}) // {width} AS code, {_SQL_REDUCERS[reduce]} AS v, "
            "min(step) AS first, max(step) AS last "
            f'FROM (SELECT rank, step, "{column}"::DOUBLE AS v FROM s WHERE {finite}) '
            "GROUP BY rank, code"
        )
        blocks = self._rank_blocks()
        if len(blocks) <= 1:
            return self._run(sql, self.where)
        parts = [self._run(sql, f"({self.where}) AND ({block})") for block in blocks]
        return pd.concat(parts, ignore_index=True)


def _code_bounds(cells: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The bin codes present (ascending) and each one's first and last step over the ranks."""
    code = cells["code"].to_numpy(dtype=np.int64)
    if not len(code):
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    codes, at = _codes(code)
    first = np.full(len(codes), np.iinfo(np.int64).max)
    last = np.full(len(codes), np.iinfo(np.int64).min)
    np.minimum.at(first, at, cells["first"].to_numpy(dtype=np.int64))
    np.maximum.at(last, at, cells["last"].to_numpy(dtype=np.int64))
    return codes, first, last


def _codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` for integers, by a lookup table when their
    range is small (no sort of every value: the sort was most of a band's cost)."""
    if not len(values):
        return np.unique(values, return_inverse=True)  # type: ignore[return-value]
    low, high = int(values.min()), int(values.max())
    if high - low > 4 * len(values) + 1_000_000:
        return np.unique(values, return_inverse=True)  # type: ignore[return-value]
    seen = np.zeros(high - low + 1, dtype=bool)
    seen[values - low] = True
    unique = np.flatnonzero(seen) + low
    table = np.cumsum(seen) - 1
    return unique, table[values - low]


def _rank_bin_matrix(
    frame: pd.DataFrame, column: str, bins: StepBins, reduce: str
) -> tuple[np.ndarray, np.ndarray]:
    """Ranks (ascending) and their ranks x bins matrix of ``reduce`` of ``column`` (NaN: no
    finite value of that rank in that bin)."""
    if reduce not in _REDUCERS:
        raise ValueError(f"reduce must be one of {_REDUCERS}, not {reduce!r}")
    ranks_col = frame["rank"].to_numpy() if "rank" in frame else np.zeros(len(frame), dtype=int)
    values = frame[column].to_numpy(dtype="float64")
    keep = np.isfinite(values)
    steps = frame["step"].to_numpy(dtype=np.int64)[keep]
    ranks, rank_code = _codes(ranks_col[keep].astype(np.int64))
    values = values[keep]
    matrix = np.full((len(ranks), len(bins)), np.nan)
    if not len(values):
        return ranks, matrix
    bin_code = bins.of(steps)
    if bins.single:  # one step per bin: each rank's value as recorded
        matrix[rank_code, bin_code] = values
        return ranks, matrix
    dense = _dense_reduce(rank_code, steps, values, len(ranks), bins, reduce)
    if dense is not None:
        return ranks, dense
    grouped = pd.Series(values).groupby([rank_code, bin_code], sort=False)
    if reduce == "last":
        order = np.lexsort((steps, bin_code, rank_code))
        grouped = pd.Series(values[order]).groupby([rank_code[order], bin_code[order]], sort=False)
    agg = getattr(grouped, reduce)()
    r = agg.index.get_level_values(0).to_numpy()
    b = agg.index.get_level_values(1).to_numpy()
    matrix[r, b] = agg.to_numpy()
    return ranks, matrix


#: cells of the dense rank x step grid of the fast path, at most (8 bytes each)
_DENSE_CELLS = 40_000_000


def _dense_reduce(
    rank_code: np.ndarray,
    steps: np.ndarray,
    values: np.ndarray,
    n_ranks: int,
    bins: StepBins,
    reduce: str,
) -> np.ndarray | None:
    """The ranks x bins matrix from a dense rank x step grid, bins of one width reduced at
    once (a sort for the median): 10x faster than a grouped median. None (use the grouped
    path) when a (rank, step) holds several rows, the grid would be too large, or for
    ``last``."""
    if reduce == "last":
        return None
    unique, step_code = _codes(steps)
    cells = n_ranks * len(unique)
    if cells > _DENSE_CELLS:
        return None
    key = rank_code * len(unique) + step_code
    if np.bincount(key, minlength=cells).max(initial=0) > 1:
        return None
    flat = np.full(cells, np.nan)
    flat[key] = values
    grid = flat.reshape(n_ranks, len(unique))
    starts = np.searchsorted(unique, bins.first)
    widths = np.diff(np.append(starts, len(unique)))
    out = np.full((n_ranks, len(bins)), np.nan)
    for width in np.unique(widths):
        which = np.flatnonzero(widths == width)
        cube = grid[:, starts[which][:, None] + np.arange(width)[None, :]]  # ranks x bins x w
        if reduce == "median":
            (out[:, which],) = _nanquantiles(cube, (0.5,), axis=2)
            continue
        present = ~np.isnan(cube)
        has = present.any(axis=2)
        if reduce == "mean":
            total = np.where(present, cube, 0.0).sum(axis=2)
            value = total / np.maximum(present.sum(axis=2), 1)
        elif reduce == "min":
            value = np.where(present, cube, np.inf).min(axis=2)
        else:
            value = np.where(present, cube, -np.inf).max(axis=2)
        out[:, which] = np.where(has, value, np.nan)
    return out


@dataclass(frozen=True)
class Outlier:
    """A named rank: the share of its bins that are out, its largest deviation from the median
    of ranks (relative to the median; signed) and the first step of the bin it is in."""

    rank: int
    share: float
    bins_out: int
    worst: float
    worst_step: int


def _nanquantiles(matrix: np.ndarray, qs: tuple[float, ...], axis: int = 0) -> list[np.ndarray]:
    """Quantiles ``qs`` along ``axis`` of ``matrix`` over its non-NaN values (linear
    interpolation, as ``np.nanquantile``; NaN where there is none), in one sort:
    ``np.nanquantile`` walks the columns one by one in Python when a NaN is present."""
    ordered = np.moveaxis(np.sort(matrix, axis=axis), axis, -1)  # NaN sorts last
    count = (~np.isnan(ordered)).sum(axis=-1, keepdims=True)
    out = []
    for q in qs:
        at = q * np.maximum(count - 1, 0)
        low = np.floor(at).astype(np.int64)
        high = np.minimum(low + 1, np.maximum(count - 1, 0))
        frac = at - low
        lo = np.take_along_axis(ordered, low, axis=-1)
        hi = np.take_along_axis(ordered, high, axis=-1)
        # frac 0: the value itself, exact (no inf * 0, no rounding)
        value = np.where(frac == 0, lo, lo * (1 - frac) + hi * frac)
        out.append(np.where(count > 0, value, np.nan)[..., 0])
    return out


@dataclass(frozen=True)
class RankBands:
    """Bands across ranks of one per-step series, per step bin (arrays of ``len(bins)``).

    ``values`` is the ranks x bins matrix each band is taken from (row ``i`` is ``ranks[i]``);
    ``min_rank``/``max_rank`` the rank at the band's edges (-1: no rank in the bin).
    """

    column: str
    rule: OutlierRule
    bins: StepBins
    ranks: np.ndarray
    values: np.ndarray
    count: np.ndarray
    low: np.ndarray
    p10: np.ndarray
    median: np.ndarray
    p90: np.ndarray
    high: np.ndarray
    min_rank: np.ndarray
    max_rank: np.ndarray
    outliers: tuple[Outlier, ...] = ()
    #: ranks that the rule found but that were not named (over ``rule.max_named``)
    more: int = 0
    deviation: np.ndarray = field(default_factory=lambda: np.empty((0, 0)), repr=False)

    def series(self, rank: int) -> np.ndarray:
        """``rank``'s value per bin (NaN where it has none)."""
        return self.values[int(np.searchsorted(self.ranks, rank))]

    def binning_text(self) -> str:
        """How the steps were binned and what a bin's value is, in words."""
        if self.bins.single:
            return "one point per step"
        return (
            f"{len(self.bins):,} bins of \u2264{self.bins.width():,} steps, each rank's "
            f"{self.rule.reduce} in a bin"
        )

    def outliers_text(self) -> str:
        """The named ranks, or that none strays, and the rule."""
        if not self.outliers:
            return f"no rank named (rule: {self.rule.describe()})"
        named = ", ".join(str(o.rank) for o in self.outliers)
        more = f" and {self.more} more" if self.more else ""
        return f"named: rank{'s' if len(self.outliers) > 1 else ''} {named}{more} (rule: {self.rule.describe()})"


def compute_rank_bands(
    frame: pd.DataFrame | StepsRelation,
    column: str,
    max_bins: int = MAX_BINS,
    rule: OutlierRule | None = None,
) -> RankBands:
    """Min, p10, median, p90 and max across ranks of ``column`` per step bin, and the ranks
    that stray from the others (:class:`OutlierRule`; :data:`SERIES_RULES` by default).

    Args:
        frame: rows with ``rank``, ``step`` and ``column`` (``Run.steps``), or the run's
            :class:`StepsRelation` (the matrix is then reduced in DuckDB, the same values);
            non-finite values are left out (a NaN loss is drawn by its own bands).
        column: the series.
        max_bins: the most step bins.
        rule: the binning reducer and the outlier rule.
    """
    rule = rule or rule_for(column)
    if isinstance(frame, StepsRelation):
        bins, ranks, matrix = frame.rank_bin_matrix(column, max_bins, rule.reduce)
    else:
        finite = frame[np.isfinite(frame[column].to_numpy(dtype="float64"))]
        bins = compute_step_bins(finite["step"], max_bins)
        ranks, matrix = _rank_bin_matrix(finite, column, bins, rule.reduce)
    present = ~np.isnan(matrix)
    count = present.sum(axis=0)
    low, p10, median, p90, high = _nanquantiles(matrix, (0.0, 0.1, 0.5, 0.9, 1.0))
    any_rank = count > 0
    min_rank = np.where(
        any_rank, ranks[np.where(present, matrix, np.inf).argmin(axis=0)] if len(ranks) else -1, -1
    )
    max_rank = np.where(
        any_rank, ranks[np.where(present, matrix, -np.inf).argmax(axis=0)] if len(ranks) else -1, -1
    )
    deviation = matrix - median[None, :]
    allowed = np.maximum(rule.floor, (rule.ratio - 1.0) * np.abs(median))[None, :]
    with np.errstate(invalid="ignore"):
        out = present & (np.abs(deviation) > allowed + 1e-12 * np.abs(median)[None, :])
    bins_out = out.sum(axis=1)
    has = present.sum(axis=1)
    share = np.divide(bins_out, has, out=np.zeros(len(ranks)), where=has > 0)
    scale = np.where(np.abs(median) > 0, np.abs(median), 1.0)[None, :]
    relative = np.where(out, deviation / scale, 0.0)
    worst_at = np.abs(relative).argmax(axis=1) if len(bins) else np.zeros(len(ranks), dtype=int)
    worst = relative[np.arange(len(ranks)), worst_at] if len(bins) else np.zeros(len(ranks))
    found = np.flatnonzero((bins_out > 0) & (share >= rule.min_share))
    order = found[np.lexsort((-np.abs(worst[found]), -share[found]))]
    named = tuple(
        Outlier(
            rank=int(ranks[i]),
            share=float(share[i]),
            bins_out=int(bins_out[i]),
            worst=float(worst[i]),
            worst_step=int(bins.first[worst_at[i]]),
        )
        for i in order[: rule.max_named]
    )
    return RankBands(
        column=column,
        rule=rule,
        bins=bins,
        ranks=ranks,
        values=matrix,
        count=count,
        low=low,
        p10=p10,
        median=median,
        p90=p90,
        high=high,
        min_rank=min_rank,
        max_rank=max_rank,
        outliers=named,
        more=max(0, len(order) - rule.max_named),
        deviation=deviation,
    )


def bucket_ranks(
    ranks: np.ndarray | list[int], max_rows: int = MAX_ROWS, alone: Sequence[int] = ()
) -> list[np.ndarray]:
    """``ranks`` (ascending) cut into at most ``max_rows`` buckets of consecutive ranks, of
    equal size but the last; one rank each when there are few.

    Each rank of ``alone`` (the ranks a finding marks) is a bucket of its own, its bucket's
    other ranks split around it, so that it is never folded into a row of other ranks: at
    most ``2 * len(alone)`` rows more."""
    ranks = np.asarray(sorted(set(int(r) for r in ranks)), dtype=np.int64)
    if len(ranks) <= max_rows:
        return [ranks[i : i + 1] for i in range(len(ranks))]
    size = -(-len(ranks) // max_rows)
    buckets = [ranks[i : i + size] for i in range(0, len(ranks), size)]
    single = np.asarray(sorted(set(int(r) for r in alone)), dtype=np.int64)
    if not len(single):
        return buckets
    out: list[np.ndarray] = []
    for bucket in buckets:
        hit = np.isin(bucket, single)
        if len(bucket) == 1 or not hit.any():
            out.append(bucket)
            continue
        start = 0
        for at in np.flatnonzero(hit).tolist():
            if at > start:
                out.append(bucket[start:at])
            out.append(bucket[at : at + 1])
            start = at + 1
        if start < len(bucket):
            out.append(bucket[start:])
    return out


def rank_range_text(bucket: np.ndarray) -> str:
    """``"r7"`` for one rank, ``"r0–7"`` for consecutive ranks, ``"r0…9 (8 ranks)"`` else."""
    if len(bucket) == 1:
        return f"r{int(bucket[0])}"
    first, last = int(bucket[0]), int(bucket[-1])
    if last - first + 1 == len(bucket):
        return f"r{first}\u2013{last}"
    return f"r{first}\u2026{last} ({len(bucket)} ranks)"


@dataclass(frozen=True)
class RankMatrix:
    """A rank x step-bin matrix for a heatmap: ``z[row, bin]`` is the deviation from the median
    of ranks (``relative``: divided by the median) of the rank ``rank_at[row, bin]``, the rank
    of row ``row``'s bucket that deviates most in that bin (NaN / -1: none has a value).
    ``labels`` names each row's ranks (``"r0–7"``)."""

    bands: RankBands
    buckets: list[np.ndarray]
    labels: list[str]
    z: np.ndarray
    rank_at: np.ndarray
    relative: bool

    @property
    def bucketed(self) -> bool:
        return any(len(b) > 1 for b in self.buckets)


def compute_rank_matrix(
    bands: RankBands, max_rows: int = MAX_ROWS, relative: bool = True, alone: Sequence[int] = ()
) -> RankMatrix:
    """Each rank's deviation from the median of ranks per bin of ``bands``, its rows bucketed
    by rank order (:func:`bucket_ranks`) when there are more than ``max_rows`` ranks: a
    bucket's cell is its rank with the largest absolute deviation there (its signed value),
    so a single diverging rank shows in full, never averaged with the others. The ranks of
    ``alone`` keep a row each whatever the bucketing (:func:`bucket_ranks`)."""
    dev = bands.deviation
    if relative:
        scale = np.where(np.abs(bands.median) > 0, np.abs(bands.median), np.nan)[None, :]
        dev = dev / scale
    buckets = bucket_ranks(bands.ranks, max_rows, alone)
    z = np.full((len(buckets), len(bands.bins)), np.nan)
    rank_at = np.full(z.shape, -1, dtype=np.int64)
    row = 0
    for i, bucket in enumerate(buckets):
        part = dev[row : row + len(bucket)]
        row += len(bucket)
        has = ~np.isnan(part)
        if not has.any():
            continue
        at = np.where(has, np.abs(part), -1.0).argmax(axis=0)
        cols = np.arange(part.shape[1])
        any_has = has.any(axis=0)
        z[i] = np.where(any_has, part[at, cols], np.nan)
        rank_at[i] = np.where(any_has, bucket[at], -1)
    return RankMatrix(
        bands=bands,
        buckets=buckets,
        labels=[rank_range_text(b) for b in buckets],
        z=z,
        rank_at=rank_at,
        relative=relative,
    )
