"""Class- and module-level patches that several collectors can stack and remove in any order.

Collectors wrap the same torch attributes (``GradScaler.scale``, ``autocast.__enter__``, ...).
Restoring a saved original out of order would drop or resurrect another collector's wrapper, so
every patch goes through :func:`patch`: a removed patch turns into a pass-through at once and
leaves the attribute as soon as nothing is stacked above it, so the original is always restored
when the last patch is gone.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["OPEN", "Patch", "gated", "patch"]

_STACKS: dict[tuple[int, str], list[Patch]] = {}
_LOCK = threading.Lock()


def gated(make: Callable[..., Callable[..., Any]]) -> Callable[..., Callable[..., Any]]:
    """Mark ``make`` as a maker whose wrapper checks its own patch: it is called as
    ``make(original, patch)`` and what it returns is installed as it is (no wrapper frame
    around it, for the wrappers every training step runs). The wrapper must pass straight to
    ``original`` while ``not patch.alive``, and when ``patch.inner_calls`` (if not None and
    not empty) holds ``(id(self), attr)`` of the call."""
    make.gated = True  # type: ignore[attr-defined]
    return make


class _Open:
    """The patch a gated maker is given where something else gates its wrapper."""

    alive = True
    inner_calls: set[tuple[int, str]] | None = None


#: an always-open gate (see :func:`gated`)
OPEN = _Open()


class Patch:
    """One wrapper installed on ``owner.attr``; see :func:`patch`."""

    def __init__(
        self,
        owner: Any,
        attr: str,
        make: Callable[..., Callable[..., Any]],
        inner_calls: set[tuple[int, str]] | None = None,
    ) -> None:
        self.owner = owner
        self.attr = attr
        self.own = attr in getattr(owner, "__dict__", {})
        self.original = owner.__dict__[attr] if self.own else getattr(owner, attr)
        self.alive = True
        self.inner_calls = inner_calls
        original = self.original

        if getattr(make, "gated", False):
            # the wrapper reads ``alive`` and ``inner_calls`` itself: one frame less per call
            self.wrapper: Callable[..., Any] = make(original, self)
        else:
            self.wrapper = self._wrap(make(original), original, inner_calls, attr)
        with _LOCK:
            _STACKS.setdefault((id(owner), attr), []).append(self)
            setattr(owner, attr, self.wrapper)

    def _wrap(
        self,
        impl: Callable[..., Any],
        original: Any,
        inner_calls: set[tuple[int, str]] | None,
        attr: str,
    ) -> Callable[..., Any]:
        """``impl`` behind a wrapper that passes to ``original`` once removed (and for inner
        calls)."""
        if inner_calls is None:

            @functools.wraps(impl)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if self.alive:
                    return impl(*args, **kwargs)
                return original(*args, **kwargs)

            return wrapper
        active = inner_calls

        @functools.wraps(impl)
        def inner_wrapper(*args: Any, **kwargs: Any) -> Any:
            # a method called again inside its own wrapped call on the same object (a
            # subclass's override calling super()) passes straight through
            if self.alive and not (active and (id(args[0]), attr) in active):
                return impl(*args, **kwargs)
            return original(*args, **kwargs)

        return inner_wrapper

    def remove(self) -> None:
        """Stop wrapping: pass-through at once, off the attribute once nothing is stacked above."""
        self.alive = False
        key = (id(self.owner), self.attr)
        with _LOCK:
            stack = _STACKS.get(key, [])
            while stack and not stack[-1].alive:
                top = stack.pop()
                current = top.owner.__dict__.get(top.attr)
                if current is not top.wrapper:
                    continue  # someone outside amprobe replaced it: leave theirs in place
                if top.own:
                    setattr(top.owner, top.attr, top.original)
                else:
                    delattr(top.owner, top.attr)
            if not stack:
                _STACKS.pop(key, None)


def patch(
    owner: Any,
    attr: str,
    make: Callable[..., Callable[..., Any]],
    inner_calls: set[tuple[int, str]] | None = None,
) -> Patch:
    """Replace ``owner.attr`` by ``make(original)``; return the handle whose ``remove()`` undoes it.

    ``inner_calls``: ``(id(self), attr)`` of the method calls running now (kept by the caller):
    a call whose object and method are in it passes straight to the original."""
    return Patch(owner, attr, make, inner_calls)
