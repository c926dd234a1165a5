from __future__ import annotations

import pytest
import torch

import amprobe


@pytest.fixture(autouse=True)
def _no_probe_leaks():
    """Every test starts and ends with no probe attached and torch's classes unpatched."""
    update = torch.amp.GradScaler.update
    yield
    probe = amprobe.current_probe()
    if probe is not None:
        probe.close()
    assert torch.amp.GradScaler.update is update, "a probe left GradScaler patched"


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device(request.param)
