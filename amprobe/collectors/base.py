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
        on_close(): remove every hook and patch this collector installed.
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

    def on_close(self) -> None:
        return None
