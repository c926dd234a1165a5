"""numkernel: the compiled CPU statistics kernel is built once beside training, cached, equal to
the eager reduction, and replaced by it, silently and once recorded, when it cannot be built."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import amprobe
from amprobe.capture.collectors import numkernel, numstats
from tests import numstats_reference


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A process that has not built the kernel yet, with an empty cache of its own."""
    monkeypatch.setattr(numkernel, "_BUILD", numkernel._Build())
    cache = tmp_path / "cache"
    monkeypatch.setenv("AMPROBE_KERNEL_CACHE", str(cache))
    monkeypatch.delenv("AMPROBE_NO_KERNEL", raising=False)
    return cache


def _no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CC", raising=False)


def test_built_in_a_subprocess_then_loaded_from_the_cache(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from torch._dynamo.utils import counters

    before = {k: dict(v) for k, v in counters.items()}
    numkernel.start_build()
    assert numkernel.status() in ("building", "ready")
    assert numkernel.wait() is not None and numkernel.status() == "ready"
    assert [p.suffix for p in fresh.iterdir()] == [".so"]  # no build leftovers
    x = torch.randn(5000).to(torch.bfloat16)
    assert torch.equal(numstats.stats_v2(x, kernel=True), numstats_reference.stats_v1(x))
    # a later process: loaded at once, no compiler run
    monkeypatch.setattr(numkernel, "_BUILD", numkernel._Build())
    numkernel.start_build()
    assert numkernel._BUILD.proc is None and numkernel.kernel() is not None
    assert capfd.readouterr() == ("", "")  # nothing printed
    assert {k: dict(v) for k, v in counters.items()} == before  # not a torch.compile


@pytest.mark.parametrize("why", ["no compiler", "compiler fails", "disabled"])
def test_falls_back_to_the_eager_reduction(
    why: str,
    fresh: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    if why == "no compiler":
        _no_compiler(monkeypatch, tmp_path)
    elif why == "compiler fails":
        bad = tmp_path / "badcc"
        bad.write_text("#!/bin/sh\necho 'bad: no such flag' >&2\nexit 3\n")
        bad.chmod(0o755)
        monkeypatch.setenv("CC", str(bad))
    else:
        monkeypatch.setenv("AMPROBE_NO_KERNEL", "1")
    numkernel.start_build()
    assert numkernel.wait() is None and numkernel.kernel() is None
    state = numkernel.status()
    assert state.startswith("unavailable: "), state
    if why == "compiler fails":
        assert "exit 3" in state and "bad: no such flag" in state
        assert not list(fresh.iterdir())  # nothing half-built is left in the cache
    x = torch.randn(3000).to(torch.float16)
    assert torch.equal(numstats.stats_v2(x), numstats_reference.stats_v1(x))  # the eager path
    with pytest.raises(RuntimeError, match="unavailable"):
        numstats.StepStats(1, torch.device("cpu"), kernel=True)
    assert capfd.readouterr() == ("", "")


def _run(run_dir: Path) -> amprobe.Run:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.0), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    config = {"collectors": ["numerics"], "numerics_every": 1}
    with amprobe.attach(model, opt, run_dir=run_dir, config=config):
        for step in range(3):
            x = torch.randn(16, 8)
            if step == 1:
                x[0, 0] = float("inf")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return amprobe.load_run(run_dir)


class _CountBincount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.bincount.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_collector_records_the_same_with_and_without_the_kernel(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert numkernel.wait() is not None
    with _CountBincount() as counted:  # hooks run under the mode: the kernel replaces bincount
        compiled = _run(tmp_path / "kernel")
    assert counted.count == 0
    assert not compiled.events_of("numerics_kernel")
    monkeypatch.setattr(numkernel, "_BUILD", numkernel._Build())
    _no_compiler(monkeypatch, tmp_path)
    eager = _run(tmp_path / "eager")
    events = eager.events_of("numerics_kernel")
    assert len(events) == 1 and "no C compiler" in events[0]["reason"]
    a, b = compiled.table("numerics"), eager.table("numerics")
    assert len(a) == len(b) > 0 and (a["inf"] > 0).any()
    key = ["step", "module", "kind"]
    a = a.sort_values(key).reset_index(drop=True).astype(str)
    b = b.sort_values(key).reset_index(drop=True).astype(str)
    assert a.equals(b)
    assert os.environ["AMPROBE_KERNEL_CACHE"] == str(fresh)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_input_check_counts_in_the_kernel_as_torch_does(dtype: torch.dtype) -> None:
    """The per-step input check (``count_nonfinite`` on CPU) runs in the kernel for contiguous
    fp32/fp16/bf16 tensors and counts exactly what ``torch.isfinite`` does; strided tensors take
    the eager path with the same answer."""
    numkernel.wait()
    if numkernel.kernel() is None:
        pytest.skip(f"kernel {numkernel.status()}")
    x = torch.randn(4099).to(dtype)
    x[[3, 7, 9, 4098]] = torch.tensor([float("inf"), float("nan"), -float("inf"), float("nan")]).to(
        dtype
    )
    x[100] = torch.finfo(dtype).max  # the largest finite value is finite
    x[101] = -torch.finfo(dtype).tiny
    for view in (x, x[::2], x.view(-1, 1).t(), x[:0]):
        expected = view.numel() - int(torch.isfinite(view).sum())
        assert numstats.count_nonfinite(view, False) == expected
    calls = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            calls.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        assert numstats.count_nonfinite(x, False) == 4
    assert calls == []  # no dispatched op: no aminmax, no detach


def test_a_killed_builds_leftovers_are_removed_at_the_next_build(fresh: Path) -> None:
    """A process killed while the compiler ran leaves ``.build-*`` files in the cache: the next
    build removes those older than an hour, and never a build's that may be running now."""
    fresh.mkdir(parents=True)
    old_so, old_c = fresh / ".build-dead.so", fresh / ".build-dead.c"
    young = fresh / ".build-running.so"
    for path in (old_so, old_c, young):
        path.write_bytes(b"")
    hours_ago = os.path.getmtime(young) - 2 * numkernel.STALE_BUILD_S
    for path in (old_so, old_c):
        os.utime(path, (hours_ago, hours_ago))
    numkernel.start_build()
    assert numkernel.wait() is not None
    left = sorted(p.name for p in fresh.iterdir())
    assert ".build-dead.so" not in left and ".build-dead.c" not in left
    assert ".build-running.so" in left
