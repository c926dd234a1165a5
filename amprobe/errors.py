"""Errors amprobe raises into the training program on purpose (no torch: ``import amprobe``
loads this module).

:class:`PoisonedCheckpointError` is the only error amprobe raises from inside the user's
calls, and only where the user asked for it (``checkpoint_guard="raise"``): every other hook
records its failures and lets the training go on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PoisonedCheckpointError"]


class PoisonedCheckpointError(RuntimeError):
    """A checkpoint save was refused before anything was written: parameters or optimizer
    state held inf/NaN (``checkpoint_guard="raise"``, finding AMP-N18).

    The training can go on: catch it around the save (the last good checkpoint is still on
    disk), or let it end the job before a poisoned checkpoint replaces a good one.

    Attributes:
        path: where the checkpoint would have been written.
        step: amprobe's step counter at the save (the steps completed).
        function: the save called (``torch.save``, ``torch.distributed.checkpoint.save``, ...).
        tensors: the first poisoned tensors: ``{"tensor", "inf_count", "nan_count", "numel"}``
            (empty on a rank refused because another rank of a collective save held inf/NaN).
        elsewhere: this rank's tensors were finite; another rank's were not.
    """

    def __init__(
        self,
        path: str,
        step: int,
        function: str,
        tensors: Sequence[Mapping[str, Any]],
        elsewhere: bool = False,
    ) -> None:
        self.path = path
        self.step = step
        self.function = function
        self.tensors = [dict(t) for t in tensors]
        self.elsewhere = elsewhere
        if elsewhere:
            what = "another rank's parameters or optimizer state hold inf/NaN"
        else:
            named = ", ".join(
                f"{t['tensor']} ({t['inf_count']:,} inf, {t['nan_count']:,} NaN of {t['numel']:,})"
                for t in self.tensors
            )
            what = f"inf/NaN in {named}"
        super().__init__(
            f"amprobe refused {function} to {path!r} at step {step}: {what}. Nothing was "
            "written; the last good checkpoint is still on disk (amprobe diagnose names it, "
            "AMP-N18). Catch amprobe.PoisonedCheckpointError to train on, or set "
            'checkpoint_guard="warn" to save anyway.'
        )
