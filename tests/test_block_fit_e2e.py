"""AMP-P04/P05 end to end: a model of its own with one outlier-channel layer and one
tiny-gradient layer (each planted, everything else benign), recorded by a real probe.

- ``outlier``'s input X has one channel in every 16 near 300, the others within 1 (what LLM
  activations' outlier channels do to a block): a 16- or 32-element block along K is scaled to its outlier and
  the 4-bit elements flush the rest (MXFP4 93 %, NVFP4 89 %); along T (wgrad), and in 8 bits,
  it is benign.
- ``tiny``'s output enters the residual at 1e-37, so its output gradient dY is about 1e-38:
  every MX block's e8m0 scale clamps at 2^-127 and its values flush (MXFP8 31 %, MXFP4 100 %),
  while NVFP4's per-tensor fp32 scale keeps them.

Everything runs in fp32 (no autocast: the what-if is about the operands, and fp16 would flush
``tiny``'s gradient itself). One probe, four steps, numerics every 2 steps: a second or two.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import amprobe
from amprobe.rules import diagnose
from amprobe.store import load_run


class Planted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 256)
        self.mid = nn.Linear(256, 256)
        self.outlier = nn.Linear(256, 256)
        self.tiny = nn.Linear(256, 256)
        self.head = nn.Linear(256, 16)
        shift = torch.zeros(256)
        shift[::16] = 300.0  # added, not multiplied: the gradient flowing back is not scaled
        self.register_buffer("shift", shift)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        h = self.outlier(h + self.shift) / 300.0
        h = torch.tanh(h + 1e-37 * self.tiny(h))
        return self.head(h)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> object:
    torch.manual_seed(0)
    model = Planted()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    run_dir = Path(tmp_path_factory.mktemp("planted")) / "run"
    probe = amprobe.attach(model, opt, None, run_dir=run_dir, config={"numerics_every": 2})
    try:
        for _ in range(4):
            loss = nn.functional.mse_loss(model(torch.randn(128, 64)), torch.randn(128, 16))
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        probe.close()
    return load_run(run_dir)


def test_p04_names_each_layers_narrowest_format(run: object) -> None:
    d = diagnose(run, only=["AMP-P04"])
    assert not d.not_checked, d.not_checked
    (finding,) = [f for f in d.findings if f.id == "AMP-P04"]
    narrowest = {row["module"]: row["narrowest"] for row in finding.evidence["layers"]}
    assert (
        narrowest
        == {
            "inp": "MXFP4",
            "mid": "MXFP4",
            "head": "MXFP4",
            "outlier": "MXFP8",  # its X fails both 4-bit formats, fits 8 bits
            "tiny": "NVFP4",  # its dY fails the MX formats (e8m0 underflow), NVFP4's tensor scale keeps it
        }
    )
    assert finding.title.startswith("3 of 5 matmul layer(s) fit MXFP4")


def test_p05_names_the_two_planted_layers_their_operand_and_format(run: object) -> None:
    d = diagnose(run, only=["AMP-P05"])
    assert not d.not_checked, d.not_checked
    found = {f.evidence["module"]: f for f in d.findings if f.id == "AMP-P05"}
    assert set(found) == {"outlier", "tiny"}
    outlier, tiny = found["outlier"].evidence, found["tiny"].evidence
    assert (outlier["operand"], outlier["orientation"]) == ("X", "fwd")
    assert set(outlier["failing_formats"]) == {"MXFP4", "NVFP4"}
    assert outlier["format"] in {"MXFP4", "NVFP4"}
    assert "flushes" in found["outlier"].title and "`outlier`'s X (fwd)" in found["outlier"].title
    assert tiny["operand"] == "dY"
    assert set(tiny["failing_formats"]) == {"MXFP4", "MXFP8"}
    assert "`tiny`'s dY" in found["tiny"].title
    # it fits NVFP4 (AMP-P04 says so too): the title says so, not "keep it in bf16" alone
    assert "(it fits NVFP4, or bf16)" in found["tiny"].title
    assert "(it fits MXFP8, or bf16)" in found["outlier"].title
    # the cause named in the fix: tiny values whose block scales underflow
    assert "underflow" in found["tiny"].fix
