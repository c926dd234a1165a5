"""numstats: the v2 statistics equal the v1 reference (tests/numstats_reference.py) on the same
tensors, in both device modes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import amprobe
import amprobe.capture.collectors.numerics as numerics
from amprobe.capture.collectors import numkernel, numstats
from amprobe.capture.collectors.numstats import (
    C_AMAX,
    C_IN_BAD,
    C_NAN,
    C_OVER16,
    C_ZEROS,
    E_MIN,
    H0,
    H_LUMP,
    H_NONFINITE,
    H_ZERO,
    NBINS,
    K,
)
from tests import numstats_reference

SPECIAL = [
    0.0,
    -0.0,
    float("nan"),
    float("inf"),
    -float("inf"),
    65504.0,  # fp16 max
    65505.0,  # in (65504, 65520): rounds down to 65504, not over fp16
    65520.0,  # the first value fp16's cast makes inf
    -65535.5,
    65536.0,
    2.0**-14,  # fp16 min normal
    2.0**-14 * (1 - 2.0**-10),
    2.0**-24,  # fp16 min subnormal
    2.0**-25,
    2.0**-110,  # divided by 2**16 lands on fp32's min normal
    2.0**-110 * (1 - 2.0**-20),
    2.0**-126,
    2.0**-127,  # fp32 subnormals
    1e-40,
    2.0**-133,
    2.0**-140,  # below bf16-truncation resolution: in the lump with 1e-45
    1e-45,
    3.0e38,
]
RANGES = {
    torch.float16: (-26, 16),
    torch.bfloat16: (-136, 127),
    torch.float32: (-150, 127),
    torch.float64: (-150, 129),
    torch.float8_e4m3fn: (-10, 9),
}
SCALES = [None, 1.0, 2.0**16, 1000.0, 0.5]
#: host: the eager CPU reduction; kernel: the compiled CPU kernel (numkernel); sync-free: the
#: accelerator path (index_add_, nothing read back), run on CPU here
MODES = ["host", "kernel", "sync-free"]


def _kw(mode: str) -> dict[str, bool]:
    return {"sync_free": mode == "sync-free", "kernel": mode == "kernel"}


def _values(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """Signed values spread over the dtype's whole exponent range, the special ones first."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = RANGES[dtype]
    exponents = torch.randint(lo, hi, (n,), generator=g).double()
    mantissa = 1 + torch.rand(n, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x = sign * mantissa * torch.exp2(exponents)
    x[torch.rand(n, generator=g) < 0.05] = 0.0  # zeros are common (ReLU, unused embeddings)
    special = torch.tensor(SPECIAL, dtype=torch.float64)
    if dtype == torch.float8_e4m3fn:  # no inf in e4m3fn: keep it finite or NaN
        special = special[~torch.isinf(special)].clamp(-448, 448)
    k = min(n, special.numel())
    x[:k] = special[:k]
    return x.to(dtype)


def _scale(value: float | None) -> torch.Tensor | None:
    return None if value is None else torch.tensor(value, dtype=torch.float32)


def _assert_rows_equal(v1: torch.Tensor, v2: torch.Tensor) -> None:
    v1, v2 = v1.clone(), v2.clone()
    nan = v1[..., C_NAN] > 0
    v1[..., C_AMAX][nan] = 0  # the maximum is not recorded when NaN are present
    v2[..., C_AMAX][nan] = 0
    diff = (v1 != v2).nonzero().tolist()
    assert not diff, f"v1 and v2 differ at {diff[:8]}: {v1[v1 != v2][:8]} vs {v2[v1 != v2][:8]}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"scale={s}")
@pytest.mark.parametrize("n", [300, 20000], ids=["small", "large"])
@pytest.mark.parametrize("dtype", list(RANGES), ids=str)
def test_v2_equals_v1(dtype: torch.dtype, n: int, scale: float | None, mode: str) -> None:
    x = _values(dtype, n)
    s = _scale(scale)
    v1 = numstats_reference.stats_v1(x, s)
    v2 = numstats.stats_v2(x, s, **_kw(mode))
    assert int(v1[H0:].sum()) == n  # the reference sees every element
    _assert_rows_equal(v1, v2)


@pytest.mark.parametrize("mode", ["host", "kernel"])
def test_the_special_values_are_where_v1_puts_them(mode: str) -> None:
    """Guards the test data: the edge cases really are present and counted."""
    x = _values(torch.float32, 300)[: len(SPECIAL)]
    row = numstats.stats_v2(x, **_kw(mode))
    assert int(row[C_NAN]) == 1
    assert int(row[H_NONFINITE]) == 3  # two infinities and the NaN
    assert int(row[C_ZEROS]) == 2
    assert int(row[H0 + 15 - E_MIN]) == 4  # 65504 .. 65535.5: exponent 15
    assert int(row[C_OVER16]) == 6  # 65520, 65535.5, 65536, 3e38 and the infinities
    assert int(row[H_ZERO]) - int(row[C_ZEROS]) == 1  # 2**-127
    assert int(row[H0 - 133 - E_MIN]) == 2  # 1e-40 and 2**-133
    assert int(row[H_LUMP]) == 2  # 2**-140 and 1e-45: below 2**-133


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_layouts(dtype: torch.dtype, mode: str) -> None:
    base = _values(dtype, 2 * 3 * 40 * 50, seed=3).view(2, 3, 40, 50)
    cases = {
        "transposed": base.transpose(2, 3),
        "strided": base[:, :, ::3, 1::2],
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "expanded": base[0, 0, 0].expand(7, 50),
        "scalar": base[0, 0, 0, 0],
        "empty": base[:, :, :0],
    }
    for name, x in cases.items():
        for s in (None, _scale(2.0**16)):
            v1 = numstats_reference.stats_v1(x, s)
            v2 = numstats.stats_v2(x, s, **_kw(mode))
            assert int(v2[H0:].sum()) == x.numel(), name
            _assert_rows_equal(v1, v2)


@pytest.mark.parametrize("mode", MODES)
def test_a_step_of_mixed_calls(mode: str) -> None:
    """Several tensors per slot, dtypes mixed within a slot, activations and scaled gradients,
    input counts; then the same object reused for a second step."""
    scale = torch.tensor(2.0**12)
    for step in range(2):
        calls = [
            (0, _values(torch.bfloat16, 20000, seed=step), None, 2),
            (0, _values(torch.float32, 5000, seed=step + 10), None, None),
            (0, _values(torch.bfloat16, 100, seed=step + 20), None, torch.tensor(3)),
            (1, _values(torch.float16, 30000, seed=step + 30), scale, None),
            (1, _values(torch.float16, 70, seed=step + 40), scale, None),
            (2, _values(torch.float32, 12000, seed=step + 50), scale, None),
            (2, _values(torch.bfloat16, 9000, seed=step + 60), scale, None),
            (4, torch.zeros(0), None, 1),
        ]
        reference = numstats_reference.StepStatsV1(5, torch.device("cpu"))
        if step == 0:
            stats = numstats.StepStats(5, torch.device("cpu"), **_kw(mode))
        else:
            stats.reset()
        for slot, x, s, bad in calls:
            reference.add(slot, x, scale=s, in_bad=bad)
            stats.add(slot, x, scale=s, in_bad=bad)
        table = stats.table()
        assert table.shape == (5, K)
        assert table[:, C_IN_BAD].tolist() == [5, 0, 0, 0, 1]
        assert int(table[3].abs().sum()) == 0  # a slot never measured stays empty
        _assert_rows_equal(reference.table(), table)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_count_nonfinite(dtype: torch.dtype, mode: str) -> None:
    finite = torch.randn(64, 33).to(dtype)
    bad = finite.clone()
    bad[3, :5] = float("nan")
    bad[7, 1] = float("inf")
    bad[9, 2] = -float("inf")
    for x, expected in ((finite, 0), (bad, 7), (bad.t(), 7), (bad[:0], 0)):
        got = numstats.count_nonfinite(x, sync_free=_kw(mode)["sync_free"])
        assert int(got) == expected == int(numstats_reference.count_nonfinite_v1(x))
        assert isinstance(got, torch.Tensor) == (mode == "sync-free")


_NO_HOST_MEMORY = """
import sys
import torch
from torch.testing._internal.two_tensor import TwoTensor
from amprobe.capture.collectors import numkernel, numstats
assert numkernel.wait() is not None
for x in (torch.empty(8, device="meta"), TwoTensor(torch.ones(8), torch.ones(8))):
    assert x.data_ptr() == 0
    try:  # a Python error (or a count) is fine; a null pointer in C is not
        numstats.count_nonfinite(x, sync_free=False)
    except Exception:
        pass
    stats = numstats.StepStats(1, torch.device("cpu"))
    try:
        stats.add(0, x)
    except Exception:
        pass
print("alive")
"""


def test_the_kernel_is_never_given_a_tensor_without_host_memory(tmp_path):
    """A meta tensor, or one on an accelerator that a caller marked not sync-free, and a wrapper
    subclass have no host memory at their data pointer (null here): the kernel read it and the
    process died of a segmentation fault. In a subprocess, which such a crash would kill."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _NO_HOST_MEMORY],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "alive" in proc.stdout, (proc.returncode, proc.stderr[-1500:])


class _CountScalarReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", MODES)
def test_sync_free_mode_reads_nothing_back(mode: str) -> None:
    x32 = _values(torch.float32, 20000)
    x16 = _values(torch.float16, 20000)
    stats = numstats.StepStats(2, torch.device("cpu"), **_kw(mode))
    with _CountScalarReads() as counter:
        stats.add(
            0,
            x32,
            scale=torch.tensor(2.0**16),
            in_bad=numstats.count_nonfinite(x16, _kw(mode)["sync_free"]),
        )
        stats.add(1, x16, scale=torch.tensor(2.0**16))
        stats.table()
    if mode == "sync-free":
        assert counter.count == 0
    else:
        assert counter.count > 0  # the host mode decides on CPU values (free there)


def _train(run_dir: Path) -> amprobe.Run:
    """A tiny fp16 run with a GradScaler, an overflowing layer and a NaN input on step 2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 4))
    with torch.no_grad():
        model[2].weight[0].fill_(3000.0)  # large activations, fp16 overflow on some steps
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14)
    g = torch.Generator().manual_seed(1)
    with amprobe.attach(
        model,
        opt,
        scaler,
        run_dir=run_dir,
        config={"collectors": ["scaler", "numerics"], "numerics_every": 1},
    ):
        for step in range(4):
            x = torch.randn(16, 8, generator=g) * (10.0 ** (step - 1))
            if step == 2:
                x[0, 0] = float("nan")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return amprobe.load_run(run_dir)


def test_collector_records_the_same_with_v1_and_v2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v2 = _train(tmp_path / "v2").table("numerics")
    monkeypatch.setattr(numerics, "StepStats", numstats_reference.StepStatsV1)
    monkeypatch.setattr(numerics, "count_nonfinite", numstats_reference.count_nonfinite_v1)
    v1 = _train(tmp_path / "v1").table("numerics")
    assert len(v1) == len(v2) > 0
    assert (v2["nan"] + v2["inf"]).sum() > 0  # the run does exercise the non-finite paths
    assert v2["in_nonfinite"].fillna(0).sum() > 0
    assert (v2["kind"] == "grad_param").any() and (v2["loss_scale"].dropna() > 1).any()
    key = ["step", "module", "kind"]
    a = v1.sort_values(key).reset_index(drop=True)
    b = v2.sort_values(key).reset_index(drop=True)
    columns = [c for c in a.columns if c != "amax"]
    assert a[columns].astype(str).equals(b[columns].astype(str))
    finite = a["nan"] == 0
    assert a.loc[finite, "amax"].equals(b.loc[finite, "amax"])


class _CountOps(TorchDispatchMode):
    def __init__(self, op: object) -> None:
        super().__init__()
        self.op = op
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is self.op:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_tensor_measured_twice_is_reused_while_unchanged(dtype: torch.dtype) -> None:
    """Dropout(p=0) and Identity return their input object: measure it once per version."""
    x = _values(dtype, 20000, seed=5)
    y = x.clone()  # equal values, another object: measured afresh
    reference = numstats_reference.StepStatsV1(4, torch.device("cpu"))
    stats = numstats.StepStats(4, torch.device("cpu"), sync_free=False, kernel=False)
    with _CountOps(torch.ops.aten.bincount.default) as bincounts:
        for slot, t in ((0, x), (1, x), (3, y)):
            reference.add(slot, t)
            stats.add(slot, t)
        x.mul_(4.0)  # in place: a new version, so measured again
        reference.add(2, x)
        stats.add(2, x)
    assert bincounts.count == 3
    table = stats.table()
    _assert_rows_equal(reference.table(), table)
    assert torch.equal(table[0], table[1]) and not torch.equal(table[1], table[2])


def test_on_the_device_v2_equals_v1_without_a_sync(device: torch.device) -> None:
    """On CUDA, ``torch.cuda.set_sync_debug_mode('error')`` turns any sync into an error."""
    scale = torch.tensor(2.0**16, device=device)
    calls = [
        (0, _values(torch.bfloat16, 20000, seed=7), None),
        (1, _values(torch.float16, 20000, seed=8), scale),
        (2, _values(torch.float32, 20000, seed=9), scale),
        (2, _values(torch.float32, 300, seed=10), scale),
    ]
    calls = [(slot, x.to(device), s) for slot, x, s in calls]
    reference = numstats_reference.StepStatsV1(3, device)
    for slot, x, s in calls:
        reference.add(slot, x, scale=s)
    stats = numstats.StepStats(3, device)
    assert stats.sync_free == (device.type != "cpu")
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for slot, x, s in calls:
            stats.add(slot, x, scale=s, in_bad=numstats.count_nonfinite(x))
        table = stats.table()
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    expected = reference.table()
    for slot, x, _ in calls:
        expected[slot, C_IN_BAD] += numstats_reference.count_nonfinite_v1(x)
    assert expected[:, C_IN_BAD].tolist() == [3, 7, 6]  # fp16 overflows its large specials
    _assert_rows_equal(expected.cpu(), table.cpu())


@pytest.mark.parametrize("mode", ["host", "kernel"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_an_input_measured_as_an_output_is_counted_from_its_histogram(
    dtype: torch.dtype, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "host":  # the eager count (one aminmax pass), whether or not a test built the kernel
        monkeypatch.setattr(numstats.numkernel, "kernel", lambda: None)
    else:
        numstats.numkernel.wait()
    x = _values(dtype, 20000, seed=11)
    other = _values(dtype, 20000, seed=12)
    expected = int(numstats_reference.count_nonfinite_v1(x))
    assert expected >= 3
    stats = numstats.StepStats(2, torch.device("cpu"), **_kw(mode))
    stats.add(0, x)
    with _CountOps(torch.ops.aten.aminmax.default) as reductions:
        assert stats.count_nonfinite(x) == expected  # from the histogram: no pass over x
    assert reductions.count == 0
    with _CountOps(torch.ops.aten.aminmax.default) as reductions:
        assert stats.count_nonfinite(other) == int(numstats_reference.count_nonfinite_v1(other))
    # a tensor not measured this step is counted in one pass: aminmax, or the kernel's own
    no_kernel = mode == "host" or numstats.numkernel.kernel() is None
    assert reductions.count == (1 if no_kernel else 0)
    x[5] = float("nan")  # in place (65504 before): a new version, counted afresh
    assert stats.count_nonfinite(x) == expected + 1


# -- the definitions, checked against real casts (issue 19 items 8-10) ---------------------------
def _boundary_values(dtype: torch.dtype, scale: float | None) -> torch.Tensor:
    """Values whose recorded magnitude (``|x| / scale``) sits on fp16's cast boundaries: the
    overflow boundary 65520, the flush boundary 2**-25 (the tie) and its neighbours, fp32
    subnormals of every binade; plus the wide spread of ``_values``."""
    s = 1.0 if scale is None else scale
    up = 1 + 2.0**-23
    targets = [65504.0, 65505.0, 65519.0, 65519.996, 65520.0, 65520.004, 65535.0, 65536.0]
    targets += [2.0**-25, 2.0**-25 * up, 2.0**-25 / up, 2.0**-25 * 1.5, 2.0**-24, 2.0**-26]
    targets += [2.0**-24 / up, 2.0**-14, 2.0**-14 / up]
    targets += [2.0**e * 1.25 for e in range(-149, -126)]  # fp32 subnormal binades
    wanted = torch.tensor(targets, dtype=torch.float64) * s
    wanted = torch.cat([wanted, -wanted]).to(dtype)
    return torch.cat([wanted, _values(dtype, 4000, seed=21)])


def _truth(x: torch.Tensor, scale: float | None) -> dict[str, int]:
    """What real ``.to(float16)`` casts make of the recorded values (plain torch)."""
    u = x.to(torch.float32).abs()
    s = 1.0 if scale is None else scale
    if scale is not None:
        u = u / torch.tensor(scale, dtype=torch.float32)
    at_scale = (u * torch.tensor(s, dtype=torch.float32)).to(torch.float16)
    e = torch.frexp(u.double())[1] - 1  # binade, exact for fp32 subnormals too
    nonzero = (u > 0) & torch.isfinite(u)
    return {
        "over": int((torch.isinf(u.to(torch.float16)) & torch.isfinite(u)).sum()),
        "flush": int(((at_scale == 0) & (u != 0)).sum()),
        "inf": int(torch.isinf(u).sum()),
        "zeros": int((u == 0).sum()),
        "lump": int((nonzero & (u < 2.0**-133)).sum()),
        **{f"e{k}": int((nonzero & (e == k)).sum()) for k in range(-133, 128)},
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale", [None, 2.0**16, 1000.0, 2.0**-3], ids=lambda s: f"scale={s}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fp16_counts_are_what_real_casts_do(
    dtype: torch.dtype, scale: float | None, mode: str
) -> None:
    """Items 8 and 9: overflow from 65520 (not 2**16), flush at or below 2**-25 at the scale
    (values in (2**-25, 2**-24) round up to 2**-24; the tie 2**-25 goes to zero)."""
    x = _boundary_values(dtype, scale)
    truth = _truth(x, scale)
    for row in (
        numstats.stats_v2(x, _scale(scale), **_kw(mode)),
        numstats_reference.stats_v1(x, _scale(scale)),
    ):
        counts = numerics.summarize_hist(row.tolist())
        assert counts["over_fp16"] == truth["over"]
        assert counts["underflow_at_scale"] == truth["flush"]
        assert int(row[C_ZEROS]) == truth["zeros"]
        assert int(row[H_NONFINITE]) - int(row[C_NAN]) == truth["inf"]
    if dtype == torch.float32 and scale in (None, 2.0**16):
        assert truth["over"] > 0 and truth["flush"] > 0  # the boundaries are exercised


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale", [None, 2.0**16, 1000.0], ids=lambda s: f"scale={s}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_subnormal_binades_are_resolved(dtype: torch.dtype, scale: float | None, mode: str) -> None:
    """Item 10: fp32 subnormals sit in their own binades down to 2**-133, the rest in the lump
    column (exponent -149), zeros with the top subnormal binade (-127)."""
    x = _boundary_values(dtype, scale)
    truth = _truth(x, scale)
    row = numstats.stats_v2(x, _scale(scale), **_kw(mode))
    for k in range(-133, 128):
        extra = truth["zeros"] if k == -127 else 0
        assert int(row[H0 + k - E_MIN]) == truth[f"e{k}"] + extra, k
    assert int(row[H_LUMP]) == truth["lump"]
    assert int(row[H0 : H0 + NBINS].sum()) == x.numel()
    if dtype == torch.float32:
        assert truth["lump"] > 0 and truth["e-130"] > 0


class _Emit(nn.Module):
    """Outputs its parameter (times ones): the output and both gradients are known tensors."""

    def __init__(self, t: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(t.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x


def test_recorded_columns_are_what_real_casts_do(tmp_path: Path) -> None:
    """Items 8 and 9 end to end: the stored ``over_fp16`` and ``underflow_at_scale`` of an
    output and its gradients equal plain-torch casts of the same values."""
    scale = 2.0**10
    t = torch.tensor([65504.0, 65510.0, 65519.0, 65520.0, 65530.0, 65535.9, 7e4, 1.0, 2.0**-25])
    t = torch.cat([t, 2.0**-25 * (1 + torch.rand(50, generator=torch.Generator().manual_seed(0)))])
    g = torch.tensor([2.0**-25, 1.5 * 2.0**-25, 2.0**-24 * (1 - 2.0**-20), 2.0**-26, 1e-3]) / scale
    g = torch.cat([g, torch.zeros(len(t) - len(g))])
    model = _Emit(t)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    config = {"collectors": ["scaler", "numerics"], "numerics_every": 1}
    with amprobe.attach(model, opt, scaler, run_dir=tmp_path / "run", config=config):
        loss = (model(torch.ones(len(t))) * g).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    table = amprobe.load_run(tmp_path / "run").table("numerics")
    rows = {
        kind: table[(table["module"] == "<root>") & (table["kind"] == kind)].iloc[0]
        for kind in ("output", "grad_output", "grad_param")
    }
    assert rows["output"]["over_fp16"] == int(torch.isinf(t.half()).sum()) == 4
    assert rows["output"]["underflow_at_scale"] == int(((t.half() == 0) & (t != 0)).sum()) == 1
    s = torch.tensor(scale)
    flushed = int((((g * s).half() == 0) & (g != 0)).sum())
    assert flushed == 2  # the tie 2**-25 and 2**-26; (2**-25, 2**-24) rounds up to 2**-24
    for kind in ("grad_output", "grad_param"):
        assert rows[kind]["loss_scale"] == scale
        assert rows[kind]["underflow_at_scale"] == flushed, kind


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_kernel_on_large_tensors_and_runs_of_one_key(dtype: torch.dtype) -> None:
    """From 2**18 elements the kernel counts into four sub-histograms merged at the end; runs
    of one key (a ReLU's zeros) and a transposed (dense, not contiguous) layout included."""
    n = 1 << 19
    x = _values(dtype, n, seed=13)
    x[1000:200000] = 0.0  # a long run of one key
    cases = [x, x.view(512, 1024).t(), x.view(512, 1024)[:, ::2]]
    for s in (None, _scale(1000.0), _scale(2.0**16), _scale(2.0**-3)):
        for t in cases:
            _assert_rows_equal(
                numstats_reference.stats_v1(t, s), numstats.stats_v2(t, s, kernel=True)
            )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_tensor_measured_twice_by_the_kernel(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel keeps each tensor's own row: the same object at the same version (a
    Dropout(p=0) output, a gradient hooked twice) is added again without a pass; an in-place
    change, an equal copy, or the same tensor as a gradient is measured afresh."""
    kern = numkernel.wait()
    assert kern is not None
    passes = []
    for name in ("row16", "row32"):
        run = getattr(kern, name)
        monkeypatch.setattr(kern, name, lambda *a, run=run: passes.append(a) or run(*a))
    x = _values(dtype, 20000, seed=5)
    x[:5000] = 0.0
    big = _values(dtype, numkernel.SUB_MIN + 5, seed=6)  # folded from the sub-histograms
    y = x.clone()
    scale = _scale(2.0**12)
    reference = numstats_reference.StepStatsV1(8, torch.device("cpu"))
    stats = numstats.StepStats(8, torch.device("cpu"), kernel=True)
    calls = [(0, x, None), (1, x, None), (3, y, None), (4, x, scale), (5, x, scale)]
    calls += [(6, big, scale), (7, big, scale), (6, big, None)]
    for slot, t, s in calls:
        reference.add(slot, t, scale=s)
        stats.add(slot, t, scale=s)
    assert len(passes) == 5  # x, y, x as a gradient, big as a gradient, big
    x.mul_(4.0)  # in place: a new version, so measured again
    reference.add(2, x)
    stats.add(2, x)
    assert len(passes) == 6
    table = stats.table()
    _assert_rows_equal(reference.table(), table)
    assert torch.equal(table[0], table[1]) and not torch.equal(table[1], table[2])
    assert torch.equal(table[4], table[5]) and torch.equal(table[0], table[3])
    assert int(table[7, H0:].sum()) == big.numel() and int(table[6, H0:].sum()) == 2 * big.numel()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_kernel_on_both_sides_of_its_size_threshold(dtype: torch.dtype) -> None:
    """Below ``numkernel.SUB_MIN`` elements the kernel counts segments per element, from it
    it counts keys into the sub-histograms and folds them: both equal the reference, tails
    that fill no whole group of elements included, and both return the inf/NaN count that
    a later ``count_nonfinite`` of the same tensor reads instead of a pass."""
    assert numkernel.wait() is not None
    threshold = numkernel.SUB_MIN
    for n in (1, 3, 37, threshold - 1, threshold, threshold + 37):
        x = _values(dtype, n, seed=n)
        for s in (None, _scale(2.0**16), _scale(1000.0)):
            _assert_rows_equal(
                numstats_reference.stats_v1(x, s), numstats.stats_v2(x, s, kernel=True)
            )
        stats = numstats.StepStats(1, torch.device("cpu"), kernel=True)
        stats.add(0, x)
        with _CountOps(torch.ops.aten.aminmax.default) as reductions:
            assert stats.count_nonfinite(x) == int(numstats_reference.count_nonfinite_v1(x))
        assert reductions.count == 0


@pytest.mark.parametrize("mode", MODES)
def test_rows_added_in_the_middle_of_a_step(mode: str) -> None:
    """``grow`` (a root model registered mid-step) keeps the counts so far and measures into
    the new rows."""
    a = _values(torch.bfloat16, 3000, seed=1)
    b = _values(torch.float32, 3000, seed=2)
    g = _values(torch.float16, 3000, seed=3)
    scale = _scale(2.0**10)
    reference = numstats_reference.StepStatsV1(4, torch.device("cpu"))
    stats = numstats.StepStats(2, torch.device("cpu"), **_kw(mode))
    for target in (reference, stats):
        target.add(0, a)
        target.add(1, g, scale=scale)
    stats.grow(4)
    for target in (reference, stats):
        target.add(3, b, scale=scale)
        target.add(2, a)
        target.add(0, b)
    _assert_rows_equal(reference.table(), stats.table())
