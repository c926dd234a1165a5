"""The module stack: which modules run now, for the collectors that book ops to layers.

On the steps a collector asks for ops with module attribution (``Collector.track_modules`` and
``wants_ops``), the hub starts a :class:`ModuleStack`: torch's global module forward pre/post
hooks, and on each module call a multi-grad hook on its inputs and outputs for backward (as
:class:`torch.utils.module_tracker.ModuleTracker` does, which the collectors no longer enter
themselves). Everything is removed at the step end, newest first. It is never started while
``torch.compile`` is in use (dynamo would trace the global hooks into compiled graphs), and it
stops when a compile starts.

Unlike ModuleTracker's set, the stack remembers when each module was entered, by the op mode's
clock (the ops handed to the collectors so far): in backward several modules are entered by
hooks on the same tensor with no op between them (a module and its parent that return the same
output, or an identity such as ``Dropout(p=0)`` whose exit hook fired before its entry hook),
and :meth:`ModuleStack.innermost` picks, among those entered last, the deepest one that owns
parameters. Cost on a tracked step: three global hooks per module call, a multi-grad hook per
module call with tensors that require grad; nothing on other steps.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.utils._pytree import tree_flatten

from amprobe.capture.collectors.sharded import user_model, wrapped_module
from amprobe.capture.opmode import OpMode

if TYPE_CHECKING:
    from amprobe.capture.probe import Probe

__all__ = ["ModuleStack"]


def _grad_tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]


class ModuleStack:
    """The modules running now (forward and backward) on the steps a collector asked for.

    Modules are named by their path from their root, the root by its class name (or, with
    several root models, by :meth:`amprobe.capture.probe.Probe.root_name`): ``Net.fc1``.

    Attributes:
        active: the hooks are installed (a tracked step).
        forward_depth: module forwards running now; non-zero during backward means activation
            checkpointing is recomputing a module.
    """

    def __init__(self, probe: Probe, ops: OpMode) -> None:
        self.probe = probe
        self.active = False
        self.forward_depth = 0
        self._mux = ops.mux
        self._entered: dict[str, int] = {}  # module name -> op clock when entered
        self._known: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._seen: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._owners: dict[str, bool] = {}
        self._handles: list[Any] = []
        self._has_callback = False
        self._failed = False

    # -- driven by the hub --------------------------------------------------------------------
    def start(self) -> None:
        """Install the global module hooks for this step (the hub checked compile is not in use)."""
        if self.active or self._failed:
            return
        self._entered = {}
        self._known = weakref.WeakKeyDictionary()
        self._seen = weakref.WeakSet()
        self._owners = {}
        self.forward_depth = 0
        self._has_callback = False
        self.name_roots()
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post),
            # always called, also when the forward raised (non-reentrant checkpointing stops its
            # recomputation with an exception once it has what backward needs)
            register_module_forward_hook(self._post_always, always_call=True),
        ]
        self.active = True

    def stop(self) -> None:
        """Remove every hook this step installed, newest first."""
        self.active = False
        handles, self._handles = self._handles, []
        for handle in reversed(handles):
            try:
                handle.remove()
            except Exception:
                pass

    def name_roots(self) -> None:
        """Name each root model as the probe names it (``model1.fc``): with several roots the
        class names would collide. Called at start and when a root becomes known."""
        probe = self.probe
        for ref in list(probe.models):
            model = ref()
            if model is None:
                continue
            name = probe.root_name(model)
            if name is not None:
                self._known[model] = name
                self._known[user_model(model)] = name

    # -- read by the collectors -----------------------------------------------------------------
    def name_of(self, module: Any) -> str | None:
        """The name the stack gave ``module`` (None when it has not run on this step)."""
        return self._known.get(module) if module is not None else None

    def innermost(self) -> str | None:
        """The innermost module running now: among those entered last (same op clock), the
        deepest one that owns parameters. None outside every module."""
        items = list(self._entered.items())
        if not items:
            return None
        latest = max(stamp for _, stamp in items)
        group = [(i, name) for i, (name, stamp) in enumerate(items) if stamp == latest]
        return max(group, key=lambda p: (self._owns_params(p[1]), p[1].count("."), p[0]))[1]

    def _owns_params(self, name: str) -> bool:
        cache = self._owners
        if name not in cache:
            for module, qual in list(self._known.items()):
                if qual not in cache:
                    cache[qual] = any(True for _ in module.parameters(recurse=False))
        return cache.get(name, False)

    # -- the hooks ------------------------------------------------------------------------------
    def _name(self, module: torch.nn.Module) -> str:
        known = self._known
        name = known.get(module)
        if name is None:
            name = known[module] = type(module).__name__
        if module not in self._seen:
            self._seen.add(module)
            inner = wrapped_module(module)
            if inner is not None:  # DDP, torch.compile's wrapper: the user's model goes by its name
                known[inner] = name
                self._name(inner)
                return name
            for child_name, child in module.named_children():
                known[child] = f"{name}.{child_name}"
                self._name(child)
        return name

    def _enter(self, name: str, backward: bool = False, *grads: Any) -> None:
        if backward and not self._has_callback:
            # the stack empties when this backward ends (assumes no concurrent backward)
            torch.autograd.Variable._execution_engine.queue_callback(self._reset)
            self._has_callback = True
        entered = self._entered
        entered.pop(name, None)
        entered[name] = self._mux.delivered

    def _leave(self, name: str, *grads: Any) -> None:
        self._entered.pop(name, None)

    def _reset(self) -> None:
        self._entered = {}
        self._has_callback = False

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if not self.active:
            return
        try:
            name = self._name(module)
            self._enter(name)
            self.forward_depth += 1
            tensors = _grad_tensors(args)
            if tensors:
                self._handles.append(register_multi_grad_hook(tensors, partial(self._leave, name)))
        except Exception as exc:
            self._fail(exc)

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.active:
            return
        try:
            name = self._name(module)
            self._leave(name)
            tensors = _grad_tensors(output)
            if tensors:
                self._handles.append(
                    register_multi_grad_hook(tensors, partial(self._enter, name, True))
                )
        except Exception as exc:
            self._fail(exc)

    def _post_always(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.active:
            self.forward_depth = max(0, self.forward_depth - 1)

    def _fail(self, exc: Exception) -> None:
        """A hook failed: stop tracking (hooks turn inert), record it once; never raise."""
        self.active = False
        if not self._failed:
            self._failed = True
            self.probe.event("module_stack_failed", error=f"{type(exc).__name__}: {exc}")
