"""The histograms of every rank's ``numerics`` section decoded once per run (section_bins) give
what each rank's own decode gives: the groups' binades, AMP-N06's rows and hint per class of
ranks, the what-if table; and the runtime histograms summed as arrays are the same in either
form. The ranks differ (``write_ranks``: counts scaled per rank, rows left out, a rank without
numerics), so each class is a rank of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import amprobe
from amprobe.analysis.frames import section_keys
from amprobe.analysis.numerics import (
    compute_layer_histograms,
    compute_section_bins,
    gradient_underflow_classes,
    gradient_underflow_rows,
    numerics_section,
    section_bins,
)
from amprobe.analysis.runtime import _array_hist
from amprobe.analysis.whatif import compute_whatif_summaries
from amprobe.store.sections.numerics import decode_bins
from amprobe.store.sections.runtime import hist_add, new_hist
from tests.test_numerics_many_ranks import write_ranks


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return amprobe.load_run(write_ranks(tmp_path_factory.mktemp("bins") / "run", 9))


def test_the_run_decode_is_each_ranks_decode(run: Any) -> None:
    bins = section_bins(run)
    keys = section_keys(run, "numerics")
    assert len(set(keys.values())) > 3  # the ranks differ
    assert sorted(bins.first) == sorted({keys[r]: r for r in sorted(keys, reverse=True)}.values())
    checked = 0
    for rank, g in bins.first.items():
        for layer in numerics_section(run, rank)["layers"]:
            for group in layer["hist"].values():
                a, b = bins.start[g], bins.start[g + 1]
                got = dict(zip(bins.exp[a:b].tolist(), bins.count[a:b].tolist(), strict=True))
                assert got == decode_bins(group["bins"])
                checked += bool(got)
                g += 1
    assert checked > 50


def test_a_damaged_text_raises() -> None:
    summaries = {0: {"numerics": {"layers": [{"hist": {"k": {"bins": "3,1,x,2"}}}]}}}
    with pytest.raises(ValueError):
        compute_section_bins(summaries, {0: 0})


def test_grad_underflow_per_class_is_each_ranks_rows(run: Any) -> None:
    keys = section_keys(run, "numerics")
    for margin in (8.0, 2.0**40):  # the second: a hint with counts at or below its bound
        classes = gradient_underflow_classes(run, margin)
        hints = 0
        damaged = 0
        for rank in sorted(run.summaries()):
            got = classes[keys[rank]]
            try:
                want = gradient_underflow_rows(numerics_section(run, rank), margin)
            except ValueError as exc:  # a gradient row without its counts (rank 6)
                assert isinstance(got, ValueError) and str(got) == str(exc)
                damaged += 1
                continue
            assert not isinstance(got, Exception)
            assert got[0] == want[0] and got[1] == want[1]
            assert repr(got[2]) == repr(want[2])  # (nan dtypes: compared as text)
            hints += want[1] is not None
        assert hints and damaged == 1


def test_whatif_from_the_run_decode_is_the_text_parse(run: Any) -> None:
    keys = section_keys(run, "numerics")
    want = compute_whatif_summaries(run.summaries(), keys)
    got = compute_whatif_summaries(run.summaries(), keys, section_bins(run))
    assert len(want) > 100
    pd.testing.assert_frame_equal(got, want)


def _hist(values: list[float]) -> dict[str, Any]:
    h = new_hist()
    for v in values:
        hist_add(h, v)
    return h


def test_array_hist_reads_either_form(tmp_path: Path) -> None:
    a, b = _hist([0.5, 1.0, 1.5, 0.0, 3.0]), _hist([1.0, 7.0])
    listed = {**b, "b": [sorted(b["b"]), [b["b"][k] for k in sorted(b["b"])]]}
    twice = {**b, "b": [[*listed["b"][0], listed["b"][0][0]], [*listed["b"][1], 5]]}
    for parts in ([a, b], [a, listed], [listed], [a], [twice, a]):
        got = _array_hist(parts)
        merged: dict[int, int] = {}
        for h in parts:
            k = h["b"] if isinstance(h["b"], dict) else dict(zip(*h["b"], strict=True))
            for key, n in k.items():
                merged[key] = merged.get(key, 0) + n
        assert got["keys"].tolist() == sorted(merged)
        assert got["counts"].tolist() == [merged[k] for k in sorted(merged)]
        assert got["keys"].dtype == np.int64 and got["counts"].dtype == np.int64
        assert got["n"] == sum(h["n"] for h in parts)


def test_layer_histograms_from_the_run_decode_are_the_text_parse(run: Any) -> None:
    keys = section_keys(run, "numerics")
    want = compute_layer_histograms(run.summaries(), keys)
    got = compute_layer_histograms(run.summaries(), keys, section_bins(run))
    assert got.keys == want.keys and len(want.keys) > 5
    assert np.array_equal(got.counts, want.counts) and np.array_equal(got.wide, want.wide)
    assert want.counts.sum() > 0
