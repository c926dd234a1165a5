"""torch.compile awareness: what was compiled, how, and what the compiled graphs hold.

:class:`CompileWatch` (one per hub, ``hub.compile``) hears every ``torch.compile`` call (the
hub's wrapper), notices compiles made before attach (dynamo's frame counters), and from the
first compile on keeps amprobe from installing anything dynamo could trace: the module stack
stops, discovery stops watching global module calls, collectors hear ``on_compile``. It reads
each graph dynamo hands its backend (shapes, dtypes, modules, autocast: ``on_compiled_graph``)
at compile time, never at run time, and lists what was compiled in the run's manifest.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from amprobe.capture.collectors.compiled import (
    backend_name,
    compiled_frames,
    graph_facts,
    unwrap_compiled,
)
from amprobe.capture.collectors.graphstats import NON_FUSING_BACKENDS
from amprobe.capture.dispatch import Dispatcher
from amprobe.capture.install import Installed
from amprobe.capture.modules import ModuleStack

if TYPE_CHECKING:
    from amprobe.capture.discovery import RootModelFinder
    from amprobe.capture.probe import Probe

__all__ = ["CompileWatch"]


class CompileWatch:
    """What torch.compile did in this process since attach (see the module docstring).

    Attributes:
        in_use: anything was compiled since attach: no hook dynamo could trace is installed.
        before_attach: something was compiled before amprobe attached: a hook added now would
            recompile what already runs, so no in-graph statistics are installed.
        autocast: the (device, dtype) of the last autocast region inside a compiled graph.
        functions: a function (a train step, a loss) was compiled: any module may run inside
            a compiled region.
    """

    def __init__(
        self,
        probe: Probe,
        dispatch: Dispatcher,
        installed: Installed,
        modules: ModuleStack,
        discovery: RootModelFinder,
    ) -> None:
        self.probe = probe
        self.dispatch = dispatch
        self.installed = installed
        self.modules = modules
        self.discovery = discovery
        self.in_use = False
        self._frames_at_start = compiled_frames()  # what the process compiled before attach
        self.before_attach = self._frames_at_start > 0
        self.autocast: tuple[str, str | None] | None = None
        self._compiled: list[dict[str, Any]] = []
        self._compiled_ids: set[int] = set()
        self._method_compiled: set[int] = set()  # modules whose own compile() ran
        self._modules: list[weakref.ReferenceType[torch.nn.Module]] = []  # compiled modules
        self._backends: set[str] = set()
        self.functions = False
        #: called when torch.compile is first seen in use (the hub pins its recording layer)
        self.on_started: Callable[[], None] | None = None

    def note(self, target: Any, compiled: Any, kwargs: dict[str, Any] | None) -> None:
        """``torch.compile`` was called on ``target`` (or a compiled model became known).

        From here on no hook that dynamo could trace is installed (collectors hear
        ``on_compile``), discovery stops watching global module calls, and the run's manifest
        lists what was compiled, how.
        """
        owner = getattr(target, "__self__", None)
        if isinstance(owner, torch.nn.Module):  # Module.compile() compiles its _call_impl
            module, kind, called = owner, "method", owner
        elif isinstance(target, torch.nn.Module):
            module = unwrap_compiled(target)
            if compiled is not target or module is not target:  # torch.compile(module)
                kind, called = "module", compiled
            else:  # a model whose compile() ran before amprobe attached
                kind, called = "method", target
        else:
            module, kind, called = None, "function", None
        key = id(module if module is not None else target)
        if kind == "method":
            self._method_compiled.add(key)
        if key in self._compiled_ids:
            return
        self._compiled_ids.add(key)
        if module is not None:
            self._modules.append(weakref.ref(module))
        else:
            self.functions = True
        if module is not None:
            name = type(module).__name__
        else:
            code = getattr(target, "__code__", None)
            where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
            name = f"{getattr(target, '__qualname__', type(target).__name__)}{where}"
        if kwargs is None:  # compiled before amprobe saw the call: read what the wrapper keeps
            backend = _wrapper_backend(target)
            fact: dict[str, Any] = {"target": name, "kind": kind, "backend": backend}
        else:
            fact = {
                "target": name,
                "kind": kind,
                "backend": backend_name(kwargs.get("backend")),
                "mode": kwargs.get("mode"),
                "dynamic": kwargs.get("dynamic"),
                "fullgraph": bool(kwargs.get("fullgraph", False)),
            }
        self._compiled.append(fact)
        self._backends.add(str(fact["backend"]))
        first = not self.in_use
        self.in_use = True
        self.probe.annotate_manifest(compile=list(self._compiled))
        self.probe.event("compiled", **fact)
        self.discovery.compiled(called)
        if first:
            self._started()
        self.discovery.claim_compiled_roots()

    def fusing(self) -> bool:
        """Whether a compile seen may fuse ops (any backend but ``eager``/``aot_eager``; a
        backend amprobe could not read counts as fusing)."""
        return bool(self._backends - NON_FUSING_BACKENDS) or not self._backends

    def compiled_modules(self) -> list[torch.nn.Module]:
        """The modules compiled since attach (``torch.compile(module)``'s original module, or
        the module whose ``compile()`` ran), alive ones only."""
        return [m for ref in self._modules if (m := ref()) is not None]

    def method_compiled(self, module: Any) -> bool:
        """Whether ``module``'s own ``compile()`` ran (its hooks run inside the compiled frame)."""
        return id(module) in self._method_compiled

    def check(self) -> None:
        """A compile amprobe did not see being made (before attach) shows in dynamo's counters.

        Only frames compiled since attach count: what the process compiled and ran before (an
        earlier job in the same interpreter) says nothing about the model trained now."""
        if not self.in_use and compiled_frames() > self._frames_at_start:
            self.in_use = True
            self.probe.event("compiled", target="(compiled before amprobe attached)", kind="?")
            self._started()

    def seen(self) -> bool:
        """Whether ``torch.compile`` is in use in this process since attach (checked now)."""
        self.check()
        return self.in_use

    def _started(self) -> None:
        if self.on_started is not None:
            self.on_started()
        if self.modules.active:
            self.modules.stop()  # its global hooks would be traced into the graphs
        self._watch_graphs()
        self.dispatch.emit("on_compile")

    def _watch_graphs(self) -> None:
        """Read each graph dynamo hands its backend (shapes, dtypes, modules, autocast): at
        compile time, never at run time. The backend gets the very same graph."""
        if self.installed.closed:
            return  # nothing is installed after close (it would never be removed)
        try:
            from torch._dynamo.output_graph import OutputGraph
        except (ImportError, AttributeError) as exc:
            self.probe.event("compiled_graphs_unreadable", error=f"{type(exc).__name__}: {exc}")
            return
        if not hasattr(OutputGraph, "call_user_compiler"):
            self.probe.event(
                "compiled_graphs_unreadable", error="no OutputGraph.call_user_compiler"
            )
            return
        watch = self
        probe = self.probe

        def wrap_call_user_compiler(orig: Any) -> Any:
            def call_user_compiler(self: Any, gm: Any, example_inputs: Any) -> Any:
                if not probe.closed:
                    watch.dispatch.safe(watch._on_graph, gm)
                return orig(self, gm, example_inputs)

            return call_user_compiler

        self.installed.patch(OutputGraph, "call_user_compiler", wrap_call_user_compiler)

    def _on_graph(self, gm: Any) -> None:
        facts = graph_facts(gm)
        if facts["autocast"]:
            self.autocast = facts["autocast"][-1]
        self.dispatch.emit("on_compiled_graph", facts)


def _wrapper_backend(module: Any) -> str:
    """The backend of a module compiled before amprobe attached, where torch keeps it."""
    try:
        ctx = getattr(module, "dynamo_ctx", None)
        if ctx is None:
            impl = getattr(module, "_compiled_call_impl", None)
            ctx = getattr(impl, "_torchdynamo_orig_callable", None) and impl
        callback = getattr(ctx, "callback", None)
        backend = getattr(callback, "_torchdynamo_orig_backend", None)
        inner = getattr(backend, "_torchdynamo_orig_backend", backend)
        return backend_name(inner) if inner is not None else "unknown"
    except Exception:
        return "unknown"
