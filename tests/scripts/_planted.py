"""A linear layer that plants an overflow, shared by the framework scripts."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class PlantedLinear(nn.Linear):
    """A leaf ``Linear`` whose output is multiplied by ``gain`` on the training calls in ``at``.

    ``at=None`` plants on every call. With ``fp32`` the layer runs outside autocast on fp32
    inputs, so its output stays fp32: a value beyond fp16's range then overflows only where a
    later op casts it to half.
    """

    def __init__(
        self,
        features: int,
        gain: float,
        at: Iterable[int] | None = None,
        fp32: bool = False,
        out_features: int | None = None,
    ) -> None:
        super().__init__(features, out_features or features)
        self.gain = gain
        self.at = None if at is None else set(at)
        self.fp32 = fp32
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            with torch.autocast(x.device.type, enabled=False):
                y = super().forward(x.float())
        else:
            y = super().forward(x)
        if self.training:
            call, self.calls = self.calls, self.calls + 1
            if self.at is None or call in self.at:
                y = y * self.gain
        return y


class BlowNet(nn.Module):
    """Two Linear layers (``embed``, ``head``); ``blow = True`` multiplies the hidden state by
    1e6 (an fp16 overflow), as the engine scripts set it on their planted iterations."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.blow = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        if self.blow:
            h = h * 1e6
        return self.head(h)
