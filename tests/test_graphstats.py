"""In-graph activation statistics (graphstats): the same small-end counts as the eager ones."""

from __future__ import annotations

import pytest
import torch

from amprobe.capture.collectors import graphstats, numstats
from amprobe.capture.collectors.numerics import summarize_hist


def _values(dtype: torch.dtype) -> torch.Tensor:
    """Zeros, values at and around fp16's flush, subnormal and normal boundaries, overflow."""
    plain = [0.0, -0.0, 2.0**-26, 2.0**-25, 1.5 * 2.0**-25, 2.0**-24, 3.0 * 2.0**-24]
    plain += [2.0**-15, 2.0**-14, 1e-3, -0.5, 1.0, 70000.0, -65520.0, 65504.0]
    x = torch.tensor(plain * 3, dtype=torch.float32)
    x = torch.cat([x, torch.tensor([float("nan"), float("inf")])])
    return x.to(dtype)


def _hooked_row(x: torch.Tensor, compiled: bool) -> dict[str, int]:
    buf = graphstats.new_buffer(1, x.device)
    module = torch.nn.Identity()
    module.register_forward_hook(graphstats.graph_stats_hook(buf, 0))
    run = torch.compile(module, backend="aot_eager", fullgraph=True) if compiled else module
    graphstats.GRAPH_SAMPLE.on = True
    try:
        run(x)
    finally:
        graphstats.GRAPH_SAMPLE.on = False
    return dict(zip(graphstats.COLUMNS, (int(v) for v in buf[0].tolist()), strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_small_end_counts_match_the_eager_statistics(dtype):
    x = _values(dtype)
    got = _hooked_row(x, compiled=False)
    row = numstats.stats_v2(x)
    want = summarize_hist(row.tolist())
    assert got["zeros"] == int(row[numstats.C_ZEROS]) > 0
    for key in ("underflow_at_scale", "below_subnormal", "below_normal", "over_fp16"):
        assert got[key] == want[key], (key, got[key], want[key])
    if dtype is not torch.float16:  # fp16 cannot hold these values: nothing to count there
        assert got["underflow_at_scale"] > 0 and got["below_subnormal"] > 0
    assert got["below_normal"] > 0 and got["nan"] == 1 and got["inf"] >= 1


def test_compiled_hook_counts_what_the_eager_hook_counts():
    torch._dynamo.reset()
    x = _values(torch.bfloat16)
    assert _hooked_row(x, compiled=True) == _hooked_row(x, compiled=False)
