"""A package's public names loaded with their module on first use (PEP 562).

``amprobe``, ``amprobe.store`` and ``amprobe.report`` name more than a caller usually needs:
``import amprobe`` in a training script must not load pandas, ``amprobe diagnose`` must not load
the report's section builders. Each of them gets its module ``__getattr__``/``__dir__`` from
:func:`lazy_names`; a name, once loaded, becomes a plain attribute of the package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str,
    names: Mapping[str, str],
    submodules: Iterable[str],
    namespace: dict[str, Any],
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``.

    Args:
        package: the package's dotted name.
        names: public name -> the module that defines it.
        submodules: the package's modules, as attributes (``package.<name>``).
        namespace: the package's ``globals()`` (a loaded name is kept there).
    """
    subs = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        if name in subs:
            return importlib.import_module(f"{package}.{name}")
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # the next access is a plain attribute read
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names) | subs)

    return __getattr__, __dir__
