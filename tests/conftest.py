from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

import amprobe


@pytest.fixture(autouse=True, scope="session")
def _cpu_kernel_built():
    """The compiled CPU kernel is built (or loaded from its cache) before any test: a CPU
    probe skips the GEMM operands' block statistics of the sampled steps that run while it
    builds (issue 36), and the jobs tests spawn then load it from the cache at once."""
    from amprobe.capture.collectors import numkernel

    numkernel.wait()


@pytest.fixture(autouse=True)
def _no_probe_leaks():
    """Every test starts and ends with no probe attached and torch's classes unpatched."""
    from torch.amp.autocast_mode import autocast
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    watched = [
        (torch.amp.GradScaler, name)
        for name in ("__init__", "scale", "unscale_", "step", "update", "load_state_dict")
    ]
    watched += [
        (torch.Tensor, "backward"),
        (torch.optim.Optimizer, "load_state_dict"),
        (autocast, "__enter__"),
        (autocast, "__exit__"),
        (_BaseDataLoaderIter, "__next__"),
    ]
    before = [getattr(owner, name) for owner, name in watched]
    yield
    probe = amprobe.current_probe()
    if probe is not None:
        probe.close()
    leaked = [
        f"{owner.__name__}.{name}"
        for (owner, name), fn in zip(watched, before, strict=True)
        if getattr(owner, name) is not fn
    ]
    assert not leaked, f"a probe left torch patched: {leaked}"


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device(request.param)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`amprobe demo` as README runs it (default steps), on the CPU as CI runs it: its output
    folder and what it printed. One run per session, read only (test_demo, test_figures_truth)."""
    from amprobe.cli import main

    out = tmp_path_factory.mktemp("demo") / "demo"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        import amprobe.demo

        mp.setattr(amprobe.demo, "default_device", lambda: torch.device("cpu"))
        with contextlib.redirect_stdout(printed):
            assert main(["demo", "--out", str(out)]) == 0
    return out, printed.getvalue()
