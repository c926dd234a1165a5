"""The guard and the event dispatch: every call into collector code goes through one place.

A :class:`Dispatcher` (one per hub, ``hub.dispatch``) holds the collectors' subscriptions, turns
the hub's events into calls of the ``on_*`` methods a collector overrides, and runs every such
call under one guard: a collector that raises is switched off and recorded once
(``collector_error``), the hub's own wrapper bodies are recorded once (``hub_error``), and
nothing reaches the training loop. ``busy`` counts the collector code (and amprobe's own tensor
work) running now, so the op mode never books amprobe's ops as the job's.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amprobe.capture.protocol import Collector

if TYPE_CHECKING:
    from amprobe.capture.probe import Probe

__all__ = ["EVENTS", "Dispatcher"]

#: every event of the collector protocol, in the order of a typical iteration, and whether it
#: is delivered while the probe is dormant (rare facts and lifecycle) or only while recording
_EVENT_TABLE: dict[str, bool] = {
    "on_model": True,
    "on_recording": True,
    "on_optimizer": True,
    "on_scaler": True,
    "on_scaler_state_loaded": True,
    "on_optimizer_state_loaded": True,
    "on_compile": True,
    "on_compiled_graph": True,
    "on_step_begin": False,
    "on_dataloader": False,
    "on_forward_begin": False,
    "on_forward_end": False,
    "on_forward_output": False,
    "on_autocast": False,
    "on_autocast_exit": False,
    "on_scale": False,
    "on_backward_begin": False,
    "on_backward_end": False,
    "on_unscale": False,
    "on_clip": False,
    "on_scaler_step": False,
    "on_optimizer_step_begin": False,
    "on_optimizer_step_end": False,
    "on_scaler_update": False,
    "on_op": False,
    "on_step_nonfinite": False,
    "on_step_bad": False,
    "on_step_end": False,
    "on_step_fold": False,
    "on_flush": True,
    "on_rows": True,
    "on_close": True,
}
EVENTS = tuple(_EVENT_TABLE)
_ALWAYS = frozenset(name for name, dormant in _EVENT_TABLE.items() if dormant)


def _where(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    return f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"


class Dispatcher:
    """Delivers the hub's events to the collectors, under one guard.

    Attributes:
        subs: event name -> the (collector, bound ``on_*`` method) pairs an event goes to now:
            those that override it, less a collector's ``detail_events`` on the steps it does
            not ask for them (:meth:`set_detail`).
        busy: non-zero while collector code or amprobe's own tensor work runs.
        closed: set by the hub at close; from then on only ``on_close`` is delivered.
    """

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.busy = 0
        #: the op mode is pushed: amprobe's own code marks itself ``busy`` (else no one reads it)
        self.observing = False
        self.closed = False
        self.subs: dict[str, list[tuple[Collector, Callable[..., Any]]]] = {e: [] for e in EVENTS}
        #: every override, detail events included, in subscription order
        self._all: dict[str, list[tuple[Collector, Callable[..., Any]]]] = {e: [] for e in EVENTS}
        self._detail_on: set[str] = set()  # collectors whose detail events are delivered now
        self._muted: set[tuple[str, str]] = set()  # (collector, event) not delivered for now
        self.detailed: list[Collector] = []
        self.phase_times = False
        #: ``on_step_begin`` subscribers that are not samplers (asked on quiet steps too)
        self.step_begin_always: list[tuple[Collector, Callable[..., Any]]] = []
        self.checks_inputs = False
        self._failed: set[str] = set()
        self._hub_failed = False
        self._failure_listeners: list[Callable[[Collector], None]] = []

    def subscribe(self, collectors: list[Collector]) -> None:
        """Register the collectors; an event goes only to those that override it."""
        for collector in collectors:
            for event in EVENTS:
                if getattr(type(collector), event) is not getattr(Collector, event):
                    self._all[event].append((collector, getattr(collector, event)))
        for event in EVENTS:
            self._rebuild(event)
        self._refresh()

    def _refresh(self) -> None:
        seen: list[Collector] = []
        for subs in self._all.values():
            for c, _ in subs:
                if c.detail_events and not any(c is s for s in seen):
                    seen.append(c)
        #: the collectors (still on) with detail events, asked per step (``wants_detail``)
        self.detailed = seen
        #: a collector (still on) asked for the phase clock
        self.phase_times = any(c.phase_times for subs in self._all.values() for c, _ in subs)
        self.step_begin_always = [(c, fn) for c, fn in self.subs["on_step_begin"] if not c.samples]
        #: the hub counts the root models' non-finite inputs (a collector ``checks_inputs``)
        self.checks_inputs = any(c.checks_inputs for subs in self._all.values() for c, _ in subs)

    def subscribed(self, event: str) -> bool:
        """Whether any collector overrides ``event`` (on some step, for detail events)."""
        return bool(self._all[event])

    def set_detail(self, collector: Collector, on: bool) -> None:
        """Deliver ``collector``'s ``detail_events`` from now on (``on``) or no longer."""
        if (collector.name in self._detail_on) == on:
            return
        if on:
            self._detail_on.add(collector.name)
        else:
            self._detail_on.discard(collector.name)
        for event in collector.detail_events:
            self._rebuild(event)

    def mute(self, collector: Collector, event: str, muted: bool = True) -> None:
        """Stop (``muted``) or resume delivering ``event`` to ``collector``: for an event it
        has nothing to do on until something happens (the compiler's counters before anything
        compiles), so that no step pays for the call."""
        key = (collector.name, event)
        if (key in self._muted) == muted:
            return
        if muted:
            self._muted.add(key)
        else:
            self._muted.discard(key)
        self._rebuild(event)

    def _rebuild(self, event: str) -> None:
        self.subs[event] = [
            (c, fn)
            for c, fn in self._all[event]
            if c.name not in self._failed
            and (event not in c.detail_events or c.name in self._detail_on)
            and (c.name, event) not in self._muted
        ]

    def on_failure(self, listener: Callable[[Collector], None]) -> None:
        """Call ``listener(collector)`` when a collector is switched off (drop it elsewhere)."""
        self._failure_listeners.append(listener)

    def is_enabled(self, name: str) -> bool:
        """Whether the collector called ``name`` is still on."""
        return name not in self._failed

    def call(self, collector: Collector, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run collector code under the one guard: never raises, switches it off on failure."""
        if collector.name in self._failed:
            return None
        self.busy += 1
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.failed(collector, exc)
            return None
        finally:
            self.busy -= 1

    @contextlib.contextmanager
    def own_work(self) -> Iterator[None]:
        """amprobe's own tensor work outside a collector (reading live metrics for a callback):
        its ops are not the job's, so no op observer (sync counter, shape capture) books them."""
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1

    def safe(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run the hub's own body of a wrapper: a failure is recorded once, never raised.

        ``SystemExit`` (``max_steps`` reached, asked for by ``amprobe baseline``) passes. Its
        tensor ops (reading a CPU loss scale) are amprobe's: no op observer books them (they
        are marked ``busy`` while the op mode is pushed, the only reader of the mark).
        """
        if not self.observing:
            try:
                return fn(*args)
            except Exception as exc:
                self.hub_error(exc)
                return None
        self.busy += 1
        try:
            return fn(*args)
        except Exception as exc:
            self.hub_error(exc)
            return None
        finally:
            self.busy -= 1

    def hub_error(self, exc: Exception) -> None:
        """A hub body failed: recorded once (``hub_error``), never raised. For the wrappers that
        inline :meth:`safe`'s guard on the steps no op observer runs (``observing`` False)."""
        if not self._hub_failed:
            self._hub_failed = True
            self.probe.event("hub_error", error=f"{type(exc).__name__}: {exc}", where=_where(exc))

    def guard(self, collector: Collector, fn: Callable[..., Any]) -> Callable[..., None]:
        """Wrap a hook a collector registers on the user's modules or tensors with the guard."""
        probe = self.probe

        def hook(*args: Any, **kwargs: Any) -> None:
            # (a replay of a bad step runs the model again: not the job's values)
            if not probe.closed and not probe.replaying:
                self.call(collector, fn, *args, **kwargs)

        return hook

    def emit(self, event: str, *args: Any) -> None:
        """Deliver ``event`` to every collector that overrides it (dormant: rare events only)."""
        subs = self.subs[event]
        if not subs or self.closed and event != "on_close":
            return
        if not self.probe.recording and event not in _ALWAYS:
            return
        self.deliver(subs, args)

    def deliver(
        self, subs: list[tuple[Collector, Callable[..., Any]]], args: tuple[Any, ...]
    ) -> None:
        """Call each subscriber's handler with ``args``, under the guard (a collector switched
        off is out of every list already: :meth:`failed` rebuilds them)."""
        self.busy += 1
        try:
            for collector, fn in subs:  # self.call, inlined: this is the per-step hot path
                try:
                    fn(*args)
                except Exception as exc:
                    self.failed(collector, exc)
        finally:
            self.busy -= 1

    def failed(self, collector: Collector, exc: BaseException) -> None:
        """Switch ``collector`` off and record why, once."""
        if collector.name in self._failed:
            return
        self._failed.add(collector.name)
        self.probe.event(
            "collector_error",
            collector=collector.name,
            error=f"{type(exc).__name__}: {exc}",
            where=_where(exc),
        )
        for event, subs in self._all.items():
            self._all[event] = [(c, fn) for c, fn in subs if c is not collector]
            self._rebuild(event)
        self._refresh()
        for listener in self._failure_listeners:
            with contextlib.suppress(Exception):
                listener(collector)
        try:
            collector.on_close()
        except Exception:
            pass
