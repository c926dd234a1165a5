"""The collector protocol: lifecycle hooks that default to no-ops."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from amprobe.probe import Probe

__all__ = ["Collector"]


class Collector:
    """Base class of every collector.

    A collector overrides only the hooks it needs. The probe calls each hook through a
    dispatcher that catches any exception, records it once in the run (``collector_error``
    event) and switches the collector off, so a collector bug never reaches the training loop.

    Hooks:
        on_attach(probe): install hooks/patches; raise :class:`amprobe.ConfigError` here for
            configuration mistakes (the only hook allowed to raise to the user).
        on_model(model): a root model became known (attach argument or discovery).
        on_object(obj): an optimizer or GradScaler was passed to attach or discovered.
        on_step_end(step, record): the iteration ``step`` ended; add this collector's per-step
            fields to ``record`` (device tensors are fine: the probe reads them back at flush).
        on_flush(writer): write buffered rows of this collector's own tables.
        on_recording(active): recording starts (``True``) or stops (``False``) at a step
            boundary; see "Dormant probes" below.
        on_close(): remove every hook and patch this collector installed.

    Dormant probes (``Config.dormant``, ``amprobe run --dormant``, ``amprobe attach``):
        A probe may be attached with ``probe.recording`` False. While it is dormant the probe
        still counts steps but dispatches no ``on_step_end`` and no ``on_flush`` (except the
        final flush at close), so a collector must keep its per-step cost near zero:

        * install class-level patches and global hooks in ``on_attach`` if needed, but make
          their bodies return at once while ``probe.recording`` is False (a single attribute
          read), unless they are needed to find step boundaries;
        * install per-layer hooks (forward/backward hooks on the model's modules) only while
          recording: in ``on_model`` when ``probe.recording`` is True, and for every model in
          ``probe.models`` on ``on_recording(True)``; remove them all on ``on_recording(False)``
          (and in ``on_close``);
        * drop any partial per-step state on ``on_recording(True)``: the first recorded step
          starts at the boundary where recording began.

        ``on_recording`` is dispatched from the training thread at a step boundary, after
        ``probe.window`` has been incremented (``True``) or before the window is flushed
        (``False``). A probe attached with recording on never receives ``on_recording(True)``.
    """

    name: str = "collector"

    def on_attach(self, probe: Probe) -> None:
        self.probe = probe

    def on_model(self, model: Any) -> None:
        return None

    def on_object(self, obj: Any) -> None:
        return None

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        return None

    def on_flush(self, writer: Any) -> None:
        return None

    def on_recording(self, active: bool) -> None:
        return None

    def on_close(self) -> None:
        return None
