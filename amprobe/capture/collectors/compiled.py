"""torch.compile as a recorded fact: what was compiled, and what the compiler did each step.

amprobe never changes what the compiler runs. Three rules keep it so, each enforced in the
capture code that would otherwise break it:

* its one dispatch mode declares ``ignore_compile_internals`` (dynamo neither skips nor traces a
  frame met while it is active; the compiled artifacts' ops reach it as they run);
* no per-layer module hook, global module hook or ``ModuleTracker`` is installed while a compiled
  region may run (dynamo would trace it: graph breaks, recompiles, a changed fusion), and every
  hook amprobe keeps on a root model returns at once while dynamo traces it;
* discovery learns compiled roots from ``torch.compile``/``Module.compile`` themselves, not from
  global module hooks (torch warns about those on every ``OptimizedModule`` call).

:class:`CompileCollector` records the compiler's own counters once per step (a few dict reads,
nothing while ``torch._dynamo`` was never imported) and the reasons it gives for recompiles and
graph breaks.
"""

from __future__ import annotations

import gc
import math
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from amprobe.capture.collectors.sharded import user_module_name
from amprobe.capture.protocol import Collector, StepFacts
from amprobe.store.fields import Field, fields_of

if TYPE_CHECKING:
    from amprobe.capture.probe import Probe

__all__ = [
    "CompileCollector",
    "backend_name",
    "compiled_wrapper_of",
    "graph_facts",
    "stack_module_name",
    "compiled_frames",
    "is_compiled_module",
    "is_compiling",
    "unwrap_compiled",
    "user_module_name",
]

_OWN_FLAG = "GRAPH_SAMPLE"  # amprobe's guarded flag (collectors.graphstats) in a guard's text
_NOTHING_COMPILED = {"compile_frames": 0, "compile_graphs": 0, "graph_breaks": 0, "recompiles": 0}
_MAX_REASONS = 50  # recompile / graph-break events kept per run (the steps table has counts)


def _never_compiling() -> bool:
    return False


#: True while dynamo traces the calling code (a hook met inside a compiled region). torch's own
#: function, not a wrapper of it: the forward hooks call it on every step, and dynamo folds it
#: to a constant by its identity, whatever name it is called by.
is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", _never_compiling)


def unwrap_compiled(module: Any) -> Any:
    """The user's module behind ``torch.compile(module)``'s ``OptimizedModule`` (else itself)."""
    inner = getattr(module, "_orig_mod", None)
    if isinstance(module, torch.nn.Module) and isinstance(inner, torch.nn.Module):
        return inner
    return module


def is_compiled_module(module: Any) -> bool:
    """``torch.compile(module)``'s wrapper, or a module whose ``compile()`` was called."""
    if not isinstance(module, torch.nn.Module):
        return False
    return unwrap_compiled(module) is not module or (
        getattr(module, "_compiled_call_impl", None) is not None
    )


def compiled_wrapper_of(module: Any) -> Any:
    """The ``OptimizedModule`` that ``torch.compile(module)`` made of ``module``, if any.

    For a model attached by its original module while the job calls the compiled wrapper. Cost:
    ``gc.get_referrers`` passes at attach time (none when ``torch._dynamo`` was never imported).
    """
    if "torch._dynamo" not in sys.modules or not isinstance(module, torch.nn.Module):
        return None
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return None
    try:
        for holder in gc.get_referrers(module):
            if not (isinstance(holder, dict) and holder.get("_orig_mod") is module):
                continue
            for owner in gc.get_referrers(holder):
                if isinstance(owner, dict) and owner.get("_modules") is holder:
                    owners = gc.get_referrers(owner)
                else:
                    owners = [owner]
                for wrapper in owners:
                    if isinstance(wrapper, OptimizedModule) and wrapper._orig_mod is module:
                        return wrapper
    except Exception:
        return None
    return None


def backend_name(backend: Any) -> str:
    """``"inductor"`` for the default, the string given, or the callable's name."""
    if backend is None:
        return "inductor"
    if isinstance(backend, str):
        return backend
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
    return str(name or type(backend).__name__)


def compiled_frames() -> int:
    """Frames dynamo has been asked to compile in this process (0 when it was never imported)."""
    utils = _UTILS[0] if _UTILS else _dynamo_utils()
    return utils.counters["frames"]["total"] if utils is not None else 0


_STACK_ROOT = re.compile(r"^L\[[^\]]*\]\.?")
_STACK_ITEM = re.compile(r"\.?_modules\[['\"]([^'\"]+)['\"]\]|\[['\"]?([^'\"\]]+)['\"]?\]")


def stack_module_name(path: str) -> str:
    """``"L['self'].blocks[0]._orig_mod.qkv"`` (dynamo's ``nn_module_stack``) -> ``"blocks.0.qkv"``."""
    path = _STACK_ROOT.sub("", path)
    path = _STACK_ITEM.sub(lambda m: "." + (m.group(1) or m.group(2)), path)
    return user_module_name(path.strip("."))


def _node_module(node: Any) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    entry = list(stack.values())[-1]
    path = entry[0] if isinstance(entry, tuple) else str(entry)
    return stack_module_name(str(path))


def _value(arg: Any) -> Any:
    return arg.meta.get("example_value") if hasattr(arg, "meta") else None


def _dims(value: Any) -> list[int] | None:
    shape = getattr(value, "shape", None)
    return [int(s) for s in shape] if shape is not None else None


def _gemm_kind(node: Any) -> str | None:
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    if name in ("linear",):
        return "linear"
    if name in ("matmul", "mm", "bmm", "__matmul__"):
        return "matmul"
    if name in ("addmm", "baddbmm"):
        return "addmm"
    if name in ("conv1d", "conv2d", "conv3d"):
        return "conv"
    if name == "scaled_dot_product_attention":
        return "attention"
    return None


def graph_facts(gm: Any) -> dict[str, Any]:
    """What a graph dynamo hands its backend computes: GEMM/conv/attention ops and autocast.

    Read from the FX nodes' metadata at compile time (``example_value`` fake tensors carry the
    shapes and the dtypes autocast chose, ``nn_module_stack`` the owning module), so it costs
    nothing at run time. Returns ``{"ops": [...], "autocast": [(device, dtype), ...]}``; each
    op is ``{"module", "kind", "m", "n", "k", "batch", "in_dtype", "out_dtype", "grad"}`` with
    the GEMM dimensions of its forward (``grad``: whether a backward will run for it).
    """
    ops: list[dict[str, Any]] = []
    autocast: list[tuple[str, str | None]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" and node.op != "call_method":
            continue
        target_name = getattr(node.target, "__name__", str(node.target))
        if target_name == "_enter_autocast" and len(node.args) >= 2:
            enabled = node.args[2] if len(node.args) > 2 else True
            if enabled:
                autocast.append((str(node.args[0]), str(node.args[1]).replace("torch.", "")))
            continue
        kind = _gemm_kind(node)
        if kind is None:
            continue
        out = node.meta.get("example_value")
        args = [_value(a) for a in node.args]
        a = args[1] if kind == "addmm" and len(args) > 2 else (args[0] if args else None)
        b = args[2] if kind == "addmm" and len(args) > 2 else (args[1] if len(args) > 1 else None)
        da, db, dout = _dims(a), _dims(b), _dims(out)
        if not da or not db or not dout:
            continue
        row: dict[str, Any] = {"module": _node_module(node), "kind": kind}
        if kind == "linear":  # x [..., K] @ W[N, K]^T: the GEMM runs on x flattened to 2-D
            row.update(m=int(math.prod(da[:-1])), k=da[-1], n=db[0], batch=None)
        elif kind == "conv":
            kernel = db[2:]
            row.update(
                m=da[0] * int(math.prod(dout[2:])),
                n=db[0],
                k=db[1] * int(math.prod(kernel)),
                batch=da[0],
                cin=da[1],
                cout=db[0],
                kernel="x".join(str(s) for s in kernel),
            )
        elif kind == "attention":
            row.update(m=da[-2], n=db[-2], k=da[-1], batch=int(math.prod(da[:-2])))
        else:
            row.update(
                m=da[-2],
                k=da[-1],
                n=db[-1],
                batch=int(math.prod(dout[:-2])) if len(dout) > 2 else None,
            )
        # autocast casts a GEMM's operands to the dtype it computes in, the output's
        row["out_dtype"] = str(getattr(out, "dtype", "")).replace("torch.", "") or None
        row["in_dtype"] = row["out_dtype"]
        row["grad"] = bool(getattr(out, "requires_grad", False))
        ops.append(row)
    return {"ops": ops, "autocast": autocast}


_UTILS: list[Any] = []  # torch._dynamo.utils, once found


def _dynamo_utils() -> Any:
    """``torch._dynamo.utils`` once something imported dynamo (never imported by amprobe)."""
    if _UTILS:
        return _UTILS[0]
    if "torch._dynamo" not in sys.modules:
        return None
    try:
        from torch._dynamo import utils
    except ImportError:
        return None
    _UTILS.append(utils)
    return utils


def _counters() -> tuple[int, int, dict[str, int]] | None:
    """(frames compiled, unique graphs, graph breaks by reason), or None without dynamo."""
    utils = _dynamo_utils()
    if utils is None:
        return None
    counters = utils.counters
    return (
        int(counters["frames"]["total"]),
        int(counters["stats"]["unique_graphs"]),
        dict(counters["graph_break"]),
    )


def _metrics() -> list[Any]:
    utils = _dynamo_utils()
    getter = getattr(utils, "get_compilation_metrics", None)
    return list(getter()) if getter is not None else []


class CompileCollector(Collector):
    """Records what torch.compile compiled and what it did each step.

    Run manifest: ``compile`` (one entry per ``torch.compile``/``Module.compile`` call seen or
    compiled model attached: ``target``, ``kind`` module/method/function, ``backend``, ``mode``,
    ``dynamic``, ``fullgraph``), written by the hub.

    Per step (``steps`` table; from the moment torch.compile is in use in the process,
    null before and in a job that compiles nothing, which pays nothing per step for it):
    ``compile_frames`` (frames
    dynamo compiled during the step, count), ``compile_graphs`` (new graphs, count),
    ``graph_breaks`` (graph breaks met while compiling, count), ``recompiles`` (compilations of
    a frame that already had compiled code, count).

    Events: ``recompile`` (step, function, ``where`` file:line, the guard that failed as
    dynamo words it), ``graph_break`` (step, reason): the first 50 of each.

    Cost: a few dict reads per step from ``torch._dynamo.utils.counters`` once something is
    compiled; no call at all before. No hook, no host-device sync.
    """

    name = "compile"
    fields: ClassVar[tuple[Field, ...]] = fields_of("compile")

    def on_attach(self, probe: Probe) -> None:
        super().on_attach(probe)
        self._last: tuple[int, int, dict[str, int]] | None = None
        self._seen_metric: Any = None
        self._events = 0
        self._snapshot()
        if not probe.hub.compile.in_use:  # nothing to read per step until something compiles
            probe.hub.dispatch.mute(self, "on_step_end")

    def on_compile(self) -> None:
        self.probe.hub.dispatch.mute(self, "on_step_end", muted=False)

    def _snapshot(self) -> None:
        self._last = _counters()
        if self._last is not None:
            metrics = _metrics()
            self._seen_metric = metrics[-1] if metrics else None

    def on_recording(self, active: bool) -> None:
        if active:  # what was compiled while dormant is not this window's
            self._snapshot()

    def on_step_end(self, step: int, record: dict[str, Any], facts: StepFacts) -> None:
        # graphs, breaks and recompiles only happen while a frame compiles: one dict read
        # tells a step that compiled nothing
        frames = compiled_frames()
        last = self._last
        if last is None:
            last = (0, 0, {})  # dynamo was not imported at attach
        if frames == last[0]:
            record.update(_NOTHING_COMPILED)
            return
        now = _counters()
        if now is None:
            return
        self._last = now
        frames = now[0] - last[0]
        breaks = {k: v - last[2].get(k, 0) for k, v in now[2].items() if v > last[2].get(k, 0)}
        recompiles = 0
        if frames:
            for metric in self._new_metrics():
                reason = getattr(metric, "recompile_reason", None)
                if reason and _OWN_FLAG in str(reason):
                    # the graph variant of amprobe's sampled steps (graphstats), compiled once
                    self._note("compiled_variant", step=step, function=metric.co_name)
                    continue
                if reason:
                    recompiles += 1
                    self._note(
                        "recompile",
                        step=step,
                        function=getattr(metric, "co_name", None),
                        where=_where(metric),
                        reason=str(reason).strip()[:500],
                    )
        for reason in breaks:
            self._note("graph_break", step=step, reason=str(reason).strip()[:500])
        record.update(
            compile_frames=frames,
            compile_graphs=now[1] - last[1],
            graph_breaks=sum(breaks.values()),
            recompiles=recompiles,
        )

    def _new_metrics(self) -> list[Any]:
        metrics = _metrics()
        seen = self._seen_metric
        self._seen_metric = metrics[-1] if metrics else seen
        if seen is None:
            return metrics
        for i in range(len(metrics) - 1, -1, -1):
            if metrics[i] is seen:
                return metrics[i + 1 :]
        return metrics  # the bounded deque dropped the last one seen: all are new

    def _note(self, kind: str, **detail: Any) -> None:
        if self._events < 2 * _MAX_REASONS:
            self._events += 1
            self.probe.event(kind, **detail)


def _where(metric: Any) -> str | None:
    filename = getattr(metric, "co_filename", None)
    line = getattr(metric, "co_firstlineno", None)
    return f"{filename}:{line}" if filename else None
