"""What the hub installs on torch, held in one place and removed newest first.

:class:`Installed` is the hub's stack of class-level patches and hook handles: every role of
the hub installs through it, and :meth:`Installed.remove_all` takes everything off in the
reverse order of installation at close. :class:`ScalerMethods` wraps ``GradScaler``'s methods
and, once an instance of a subclass is seen (``ShardedGradScaler``), that subclass's overrides.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.amp import GradScaler

from amprobe.capture.patching import Patch, patch

if TYPE_CHECKING:
    from amprobe.capture.probe import Probe

__all__ = ["Installed", "ScalerMethods"]


class Installed:
    """Every patch and hook handle the hub installed, removed newest first.

    Attributes:
        closed: everything was removed; nothing more is installed.
    """

    def __init__(self) -> None:
        self._items: list[Any] = []  # Patch or RemovableHandle: both have remove()
        self.closed = False

    def patch(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> Patch:
        """Replace ``owner.attr`` by ``make(original)`` (see :func:`amprobe.capture.patching.patch`)."""
        handle = patch(owner, attr, make)
        self._items.append(handle)
        return handle

    def hook(self, handle: Any) -> Any:
        """Own a hook handle (anything with ``remove()``); return it."""
        self._items.append(handle)
        return handle

    def remove_all(self) -> None:
        """Remove everything, in the reverse order of installation. Idempotent."""
        for item in reversed(self._items):
            try:
                item.remove()
            except Exception:
                pass
        self._items.clear()
        self.closed = True


class ScalerMethods:
    """``GradScaler``'s wrapped methods, and the same wrappers on the subclasses that override
    them (``ShardedGradScaler`` has its own ``scale``/``unscale_``/``update``, so the wrappers on
    ``GradScaler`` never see its step boundary)."""

    def __init__(self, probe: Probe, installed: Installed) -> None:
        self.probe = probe
        self.installed = installed
        self._makers: dict[str, Callable[[Any], Any]] = {}
        self._calls = threading.local()
        self._hooked_classes: set[type] = set()
        self._hooked_owners: dict[str, set[type]] = {}

    def wrap(self, attr: str, make: Callable[[Any], Any]) -> None:
        """Wrap ``GradScaler.<attr>`` and remember ``make`` for subclasses that override it."""
        self._makers[attr] = make
        self.installed.patch(GradScaler, attr, self._outermost(attr, make))

    def _outermost(self, attr: str, make: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``make`` whose wrapper acts only in the outermost ``<attr>`` call on a scaler.

        A subclass's own ``update`` that calls ``super().update()`` reaches the wrapped base
        method too; only the outer call is the user's, so the inner one passes straight through
        (one step boundary, one ``on_unscale``). Cost: a set insert and removal per call.
        """
        local = self._calls

        def make_outermost(orig: Any) -> Any:
            inner = make(orig)

            def outermost(scaler: Any, *args: Any, **kwargs: Any) -> Any:
                active: set[tuple[int, str]] = local.__dict__.setdefault("active", set())
                key = (id(scaler), attr)
                if key in active:
                    return orig(scaler, *args, **kwargs)
                active.add(key)
                try:
                    return inner(scaler, *args, **kwargs)
                finally:
                    active.discard(key)

            return outermost

        return make_outermost

    def hook_class(self, cls: type) -> None:
        """Wrap the methods a GradScaler subclass overrides, the first time one of its
        instances is seen. For each wrapped method, the class the instance's MRO resolves it to
        is wrapped (a GradScaler subclass only: a mixin shared with other classes is left alone
        and reported)."""
        if cls is GradScaler or cls in self._hooked_classes or self.installed.closed:
            return
        self._hooked_classes.add(cls)
        for attr, make in self._makers.items():
            owner = next((k for k in cls.__mro__ if attr in vars(k)), None)
            if owner is None or owner is GradScaler or owner in self._hooked_owners.get(attr, ()):
                continue
            if not (isinstance(owner, type) and issubclass(owner, GradScaler)):
                self.probe.event(
                    "scaler_method_unhooked",
                    scaler_class=cls.__name__,
                    method=attr,
                    owner=getattr(owner, "__qualname__", "?"),
                )
                continue
            self._hooked_owners.setdefault(attr, set()).add(owner)
            self.installed.patch(owner, attr, self._outermost(attr, make))
