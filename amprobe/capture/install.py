"""What the hub installs on torch, held in one place and removed newest first.

:class:`Installed` is the hub's stack of class-level patches and hook handles: every role of
the hub installs through it, and :meth:`Installed.remove_all` takes everything off in the
reverse order of installation at close. A recording window's interceptions are a
:meth:`Installed.layer` of it: a nested stack, removed newest first when the window closes (or
with the rest at close). :class:`ScalerMethods` wraps ``GradScaler``'s methods and, once an
instance of a subclass is seen (``ShardedGradScaler``), that subclass's overrides, in every
layer that wraps them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.amp import GradScaler

from amprobe.capture.patching import OPEN, Patch, patch

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

    def patch(
        self,
        owner: Any,
        attr: str,
        make: Callable[..., Any],
        inner_calls: set[tuple[int, str]] | None = None,
    ) -> Patch:
        """Replace ``owner.attr`` by ``make(original)`` (see :func:`amprobe.capture.patching.patch`)."""
        handle = patch(owner, attr, make, inner_calls)
        self._items.append(handle)
        return handle

    def hook(self, handle: Any) -> Any:
        """Own a hook handle (anything with ``remove()``); return it."""
        self._items.append(handle)
        return handle

    def layer(self) -> Installed:
        """A nested stack, owned by this one: removed with it, or earlier by :meth:`drop`.

        Nothing in a layer shares an attribute with what its parent holds, so a layer removed
        before newer items of its parent leaves those in place (see
        :mod:`amprobe.capture.patching`)."""
        child = Installed()
        self._items.append(child)
        return child

    def drop(self, child: Installed) -> None:
        """Remove layer ``child`` now (newest first), and forget it."""
        child.remove_all()
        self._items = [item for item in self._items if item is not child]

    def remove_all(self) -> None:
        """Remove everything, in the reverse order of installation. Idempotent."""
        for item in reversed(self._items):
            try:
                item.remove()
            except Exception:
                pass
        self._items.clear()
        self.closed = True

    remove = remove_all  # a layer is an item of its parent stack


class ScalerMethods:
    """``GradScaler``'s wrapped methods, and the same wrappers on the subclasses that override
    them (``ShardedGradScaler`` has its own ``scale``/``unscale_``/``update``, so the wrappers on
    ``GradScaler`` never see its step boundary).

    Methods are wrapped in sets, each installed in one stack (the hub's own, or a recording
    window's layer): a subclass seen once is hooked in every set wrapped now, and in each set
    wrapped later (a window opened again)."""

    def __init__(self, probe: Probe, installed: Installed) -> None:
        self.probe = probe
        self.installed = installed
        self._active: set[tuple[int, str]] = set()  # (scaler id, method) of the calls running
        self._classes: list[type] = []  # the subclasses seen, in order
        # the sets wrapped now: (the stack they are in, attr -> maker, attr -> owners hooked)
        self._sets: list[tuple[Installed, dict[str, Callable[[Any], Any]], dict[str, set[type]]]]
        self._sets = []
        self._reported: set[tuple[type, str]] = set()

    def wrap(self, installed: Installed, makers: dict[str, Callable[..., Any]]) -> None:
        """Wrap ``GradScaler.<attr>`` by each ``makers[attr]`` in ``installed``, and the
        overrides of every subclass seen so far (and of those seen while ``installed`` lives)."""
        hooked: dict[str, set[type]] = {}
        entry = (installed, makers, hooked)
        self._sets.append(entry)
        for attr, make in makers.items():
            # GradScaler's own wrapper is never outer to another: it only looks (the patch's
            # own check, no layer of its own)
            installed.patch(GradScaler, attr, make, inner_calls=self._active)
        for cls in self._classes:
            self._hook(cls, entry)

    def unwrap(self, installed: Installed) -> None:
        """Forget the set wrapped in ``installed`` (its owner removes the patches)."""
        self._sets = [entry for entry in self._sets if entry[0] is not installed]

    def _outermost(self, attr: str, make: Callable[..., Any]) -> Callable[[Any], Any]:
        """``make`` whose wrapper acts only in the outermost ``<attr>`` call on a scaler.

        A subclass's own ``update`` that calls ``super().update()`` reaches the wrapped base
        method too; only the outer call is the user's, so the inner one passes straight through
        (one step boundary, one ``on_unscale``). A subclass's wrapper marks its call (a set
        insert and removal); GradScaler's own wrapper is never outer to another, so it only
        looks (its patch's ``inner_calls``; nothing to mark while no subclass method is
        hooked). The mark is per scaler and method, not per thread: a GradScaler is used by
        one thread at a time.
        """
        active = self._active

        def make_outermost(orig: Any) -> Any:
            # (a gated maker's wrapper: this one's patch gates it)
            inner = make(orig, OPEN) if getattr(make, "gated", False) else make(orig)

            def outermost(scaler: Any, *args: Any, **kwargs: Any) -> Any:
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
        if cls is GradScaler or cls in self._classes or self.installed.closed:
            return
        self._classes.append(cls)
        for entry in self._sets:
            self._hook(cls, entry)

    def _hook(
        self,
        cls: type,
        entry: tuple[Installed, dict[str, Callable[[Any], Any]], dict[str, set[type]]],
    ) -> None:
        installed, makers, hooked = entry
        if installed.closed:
            return
        for attr, make in makers.items():
            owner = next((k for k in cls.__mro__ if attr in vars(k)), None)
            if owner is None or owner is GradScaler or owner in hooked.get(attr, ()):
                continue
            if not (isinstance(owner, type) and issubclass(owner, GradScaler)):
                if (cls, attr) not in self._reported:
                    self._reported.add((cls, attr))
                    self.probe.event(
                        "scaler_method_unhooked",
                        scaler_class=cls.__name__,
                        method=attr,
                        owner=getattr(owner, "__qualname__", "?"),
                    )
                continue
            hooked.setdefault(attr, set()).add(owner)
            installed.patch(owner, attr, self._outermost(attr, make))
