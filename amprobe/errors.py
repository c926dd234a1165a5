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

    The training can go on: catch it around the save, or let it end the job before a poisoned
    checkpoint replaces a good one. amprobe does not look at the disk: the error names the last
    clean save it saw on this rank, which a checkpoint rotation may have deleted since.

    Attributes:
        path: where the checkpoint would have been written.
        step: amprobe's step counter at the save (the steps completed).
        function: the save called (``torch.save``, ``torch.distributed.checkpoint.save``, ...).
        tensors: the first poisoned tensors: ``{"tensor", "inf_count", "nan_count", "numel"}``
            (empty on a rank refused because another rank of a collective save held inf/NaN).
        elsewhere: this rank's tensors were finite; another rank's were not.
        last_good_path: the last save amprobe saw on this rank with finite tensors (at least
            one checked) that was written, or None.
        last_good_step: amprobe's step counter at that save, or None.
    """

    def __init__(
        self,
        path: str,
        step: int,
        function: str,
        tensors: Sequence[Mapping[str, Any]],
        elsewhere: bool = False,
        last_good: tuple[str, int] | None = None,
    ) -> None:
        self.path = path
        self.step = step
        self.function = function
        self.tensors = [dict(t) for t in tensors]
        self.elsewhere = elsewhere
        self.last_good_path: str | None = last_good[0] if last_good else None
        self.last_good_step: int | None = last_good[1] if last_good else None
        if elsewhere:
            what = "another rank's parameters or optimizer state hold inf/NaN"
        else:
            named = ", ".join(
                f"{t['tensor']} ({t['inf_count']:,} inf, {t['nan_count']:,} NaN of {t['numel']:,})"
                for t in self.tensors
            )
            what = f"inf/NaN in {named}"
        if last_good:
            good = (
                f"The last clean save amprobe saw on this rank was {last_good[0]!r} at step "
                f"{last_good[1]}, if it is still there (a checkpoint rotation may have deleted "
                "it)."
            )
        else:
            good = "amprobe saw no clean save on this rank since it attached."
        super().__init__(
            f"amprobe refused {function} to {path!r} at step {step}: {what}. Nothing was "
            f"written. {good} Catch amprobe.PoisonedCheckpointError to train on, or set "
            'checkpoint_guard="warn" to save anyway.'
        )
