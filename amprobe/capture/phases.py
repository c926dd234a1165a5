"""The phase clock: host time inside a step's forward, backward and optimizer step.

One :class:`PhaseClock` per hub (``hub.boundary.clock``). The hub's own wrappers start and stop
its phases where they already run (the root models' forward hooks, ``torch.autograd.backward``,
torch's optimizer step hooks), so timing a phase costs one call there and no event; at the step
boundary the totals go into the step's :class:`~amprobe.capture.protocol.StepFacts`
(``phase_s``, ``cuda_phases``), read by the collectors that time phases (``phase_times``).

Phases nest: a forward and backward run inside ``optimizer.step(closure)`` (Lightning, LBFGS)
count as forward and backward, not as optimizer time; only the innermost open phase accumulates
time. A phase entered again while open (a second root model inside the first) counts once.
On CUDA each outermost phase also records a pair of timing events on the current stream (read
back by the collector at flush, never here: no sync).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from amprobe.capture.protocol import PHASES

__all__ = ["PHASES", "PhaseClock"]


class PhaseClock:
    """Accumulates the host time of the step in progress per phase (see the module docstring).

    Attributes:
        on: phases are timed (a collector asked for phase times); off, every call returns at once.
        cuda: record CUDA timing events too (the training device is a GPU).
    """

    __slots__ = ("on", "cuda", "_acc", "_depth", "_stack", "_seg", "_open", "_events")

    def __init__(self) -> None:
        self.on = False
        self.cuda = False
        self.reset()

    def reset(self) -> None:
        """Forget the step in progress (a recording window starts)."""
        self._acc = dict.fromkeys(PHASES, 0.0)
        self._depth = dict.fromkeys(PHASES, 0)
        self._stack: list[str] = []  # open phases, innermost last: only it accumulates time
        self._seg = 0.0  # when the innermost open phase (re)started accumulating
        self._open: dict[str, Any] = {}
        self._events: list[tuple[str, Any, Any]] = []

    def begin(self, phase: str) -> None:
        """``phase`` starts (nested calls count once)."""
        if not self.on:
            return
        depth = self._depth
        if depth[phase]:
            depth[phase] += 1
            return
        depth[phase] = 1
        now = time.perf_counter()
        stack = self._stack
        if stack:  # pause the enclosing phase: nested time is this phase's
            self._acc[stack[-1]] += now - self._seg
        stack.append(phase)
        self._seg = now
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open[phase] = event

    def end(self, phase: str, now: float | None = None) -> None:
        """``phase`` ends (the outermost call of a nest closes it)."""
        if not self.on:
            return
        depth = self._depth
        left = depth[phase] - 1
        if left:
            if left > 0:
                depth[phase] = left
            return  # still nested, or already closed at the step boundary
        depth[phase] = 0
        if now is None:
            now = time.perf_counter()
        stack = self._stack
        if stack[-1] == phase:
            self._acc[phase] += now - self._seg
            stack.pop()
            self._seg = now  # the enclosing phase resumes
        elif phase in stack:  # closed out of order: its time went to the inner phase
            stack.remove(phase)
        if self.cuda:
            start = self._open.pop(phase, None)
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((phase, start, end))

    def take(self) -> tuple[dict[str, float], list[tuple[str, Any, Any]]] | None:
        """Close the phases still open (the optimizer step that ended the step) and return the
        step's seconds per phase and its CUDA event pairs; the clock starts the next step.
        None when phases are not timed."""
        if not self.on:
            return None
        if self._stack:
            now = time.perf_counter()
            for phase in reversed(self._stack):
                self._depth[phase] = 1
                self.end(phase, now)
        acc, events = self._acc, self._events
        self.reset()
        return acc, events
