"""The op mode: amprobe's one ``TorchDispatchMode``, pushed on the steps a collector asks for.

On such a step (``Collector.wants_ops``) :class:`OpMode` pushes one probe-owned mode that hands
every aten op to each collector that asked (sync counting, shape capture, FLOP counting), so no
two of amprobe's modes can ever shadow each other. It is popped at the step end, or left as a
pass-through (recorded once) when the job pushed a mode of its own above it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from amprobe.capture.dispatch import Dispatcher
from amprobe.capture.protocol import Collector

if TYPE_CHECKING:
    from amprobe.capture.probe import Probe

__all__ = ["OpMode"]


class _OpMux(TorchDispatchMode):
    """amprobe's only dispatch mode: hands each op to the collectors that asked for this step.

    ``delivered`` counts the ops handed over (the module stack's clock: modules entered with no
    op between them share a stamp).
    """

    #: higher-order operators reach ``__torch_dispatch__`` (else torch raises for each one a
    #: compiled graph runs: inductor's ``run_and_save_rng_state`` under activation
    #: checkpointing killed a torchtitan-shaped job at its first captured step)
    supports_higher_order_operators = True

    def __init__(self, dispatch: Dispatcher) -> None:
        super().__init__()
        self.dispatch = dispatch
        self.observers: list[tuple[Collector, Callable[..., None]]] = []
        self.delivered = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile neither skips a frame met while this mode is active (it would run the
        # model uncompiled for the rest of the job) nor traces it: the mode is off while dynamo
        # and AOTAutograd compile, and sees the compiled artifacts' ops as they run
        return True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            # run as it is (the mode is popped meanwhile): the ops inside it are not handed over
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        dispatch = self.dispatch
        if self.observers and not dispatch.busy:
            self.delivered += 1
            for collector, fn in self.observers:
                dispatch.call(collector, fn, func, args, kwargs, out)
        return out


class OpMode:
    """Pushes and pops the one op mode (see the module docstring).

    Attributes:
        mux: the dispatch mode (created once, pushed only on the steps asked for).
    """

    def __init__(self, probe: Probe, dispatch: Dispatcher) -> None:
        self.probe = probe
        self.mux = _OpMux(dispatch)
        #: the mode is pushed (:meth:`pop` has work to do while this or ``observing`` is set)
        self.pushed = False
        dispatch.on_failure(self.drop)

    def push(self, observers: list[tuple[Collector, Callable[..., None]]]) -> None:
        """Hand this step's ops to ``observers`` (pushes the mode unless it is pushed)."""
        self.mux.observers = observers
        self.mux.dispatch.observing = True
        if not self.pushed:
            self.mux.__enter__()
            self.pushed = True

    def pop(self, final: bool = False) -> None:
        """Stop handing ops over; pop the mode when it is the innermost one."""
        mux = self.mux
        mux.observers = []
        mux.dispatch.observing = False
        if not self.pushed:
            return
        if _get_current_dispatch_mode() is mux:
            mux.__exit__(None, None, None)
            self.pushed = False
        elif final:
            # someone pushed a mode above ours and keeps it: ours stays a pass-through
            self.probe.event("op_mode_left_inert", reason="another TorchDispatchMode is above it")

    def drop(self, collector: Collector) -> None:
        """A collector was switched off: it sees no more ops."""
        self.mux.observers = [(c, fn) for c, fn in self.mux.observers if c is not collector]
