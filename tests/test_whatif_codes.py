"""The what-if columns as value codes (``value_codes``): equal codes exactly for equal values,
as the per-row comparison (lists as tuples, every missing value one value) finds them, on a
10-rank run whose ranks differ (``write_ranks``; 9 with numerics); and the merged JSON's
``spread`` names the columns ``nunique(dropna=False)`` finds differing, per (layer, kind,
format, scaling).
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest

import amprobe
from amprobe.analysis.whatif import compute_whatif, value_codes
from amprobe.report.whatif_json import PER_RANK_UP_TO, whatif_json
from tests.test_numerics_many_ranks import write_ranks


@pytest.fixture(scope="module")
def frame(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    run = amprobe.load_run(write_ranks(tmp_path_factory.mktemp("codes") / "run", 10))
    return compute_whatif(run)


def _key(value: Any) -> Any:
    """The per-row comparison: lists by their items, a missing value as None."""
    if isinstance(value, list):
        return tuple(value)
    return None if value is None or pd.isna(value) else value


def test_codes_are_equal_exactly_for_equal_values(frame: pd.DataFrame) -> None:
    assert frame["rank"].nunique() == 9
    for name in frame.columns:
        codes = value_codes(frame[name]).tolist()
        keys = [_key(v) for v in frame[name].tolist()]
        code_of: dict[Any, int] = {}
        key_of: dict[int, Any] = {}
        for code, key in zip(codes, keys, strict=True):
            assert code_of.setdefault(key, code) == code, name
            assert key_of.setdefault(code, key) == key, name
        assert all(code == -1 for code, key in zip(codes, keys, strict=True) if key is None)
    # the columns that differ between ranks, missing values and lists among them
    assert len(set(value_codes(frame["nonfinite_steps"]).tolist())) > 1
    assert (value_codes(frame["min_exp"]) == -1).any()


def test_spread_names_the_columns_nunique_finds_differing(frame: pd.DataFrame) -> None:
    assert frame["rank"].nunique() > PER_RANK_UP_TO  # merged over the ranks
    key = ["module", "kind", "format", "scaling"]
    columns = [c for c in frame.columns if c not in ("rank", *key)]
    hashable = frame[columns].copy()
    hashable["nonfinite_steps"] = hashable["nonfinite_steps"].map(tuple)
    unique = hashable.groupby([frame[k] for k in key], sort=False).nunique(dropna=False)
    want = {name: sorted(c for c in columns if row[c] > 1) for name, row in unique.iterrows()}
    got = {
        (r["module"], r["kind"], r["format"], r["scaling"]): sorted(r.get("spread", {}))
        for r in whatif_json(frame)
    }
    assert got == want
    assert any(got.values())
