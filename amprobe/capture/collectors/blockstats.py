"""STAND-IN (operands branch, deleted at the merge of blockkern): spec section 3 signatures."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from amprobe.store.blockformats import STAT_FIELDS, rows_for


def measure(x2d: torch.Tensor, operand: str, formats: Sequence[str], divisor=None) -> torch.Tensor:
    x = x2d.float()
    if divisor is not None:
        x = x / divisor
    fin = torch.isfinite(x)
    xf = torch.where(fin, x, 0.0)
    row = torch.stack([
        torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device),
        (xf != 0).sum().double(),
        (~fin).sum().double(),
        *[torch.zeros((), dtype=torch.float64, device=x.device)] * 5,
        (xf.double() ** 2).sum(),
        torch.zeros((), dtype=torch.float64, device=x.device),
    ])
    n = len(rows_for(operand, formats))
    assert row.numel() == len(STAT_FIELDS)
    return row.expand(n, -1).clone()


def canonical(operand: str, t: torch.Tensor, module_kind: str):
    if module_kind == "conv":
        if operand == "w":
            return t.reshape(t.shape[0], -1), "conv: blocks along input channels at each position, not the im2col patch"
        return t.movedim(1, -1).reshape(-1, t.shape[1]), "conv: blocks along input channels at each position, not the im2col patch"
    if operand == "w":
        return (t.t() if module_kind == "conv1d" else t), None
    return t.reshape(-1, t.shape[-1]), None
