"""The hub: every interception of torch, installed once, fanned out to the collectors.

One :class:`Hub` per probe owns the parts below, one role each, and removes everything they
installed at :meth:`Hub.close`, in the reverse order of installation:

* :class:`~amprobe.capture.dispatch.Dispatcher` (``dispatch``): the collectors' subscriptions,
  the event dispatch and the one guard (a collector that raises is switched off and recorded
  once; nothing reaches the training loop);
* :class:`~amprobe.capture.install.Installed` (``installed``): the stack of every patch and hook
  handle; :class:`~amprobe.capture.install.ScalerMethods` (``scaler_methods``): GradScaler's
  wrapped methods, and those of a subclass (``ShardedGradScaler``) once one of its instances is
  seen;
* :class:`~amprobe.capture.interceptions.Interceptions` (``interceptions``): the class-level
  wrappers of GradScaler, Optimizer (and torch's global optimizer step hooks), autocast,
  ``torch.autograd.backward``, DataLoader iteration, the gradient-clipping helpers and
  ``torch.compile``, and the checkpoint saves
  (:class:`~amprobe.capture.checkpoints.CheckpointGuard`, ``interceptions.checkpoints``:
  AMP-N18); :class:`~amprobe.capture.interceptions.RootModelHooks` (``roots``): one
  forward pre-hook and one forward hook per root model;
* :class:`~amprobe.capture.boundary.StepBoundary` (``boundary``): the step boundary (the
  ``update()`` of the first GradScaler used, else an engine's own step, else the ``step()`` of
  the first optimizer that steps) and the facts of the iteration in progress;
* :class:`~amprobe.capture.sources.EngineSources` (``sources``): the engines that own the loss
  scale (DeepSpeed, Megatron-core), installed once the program imports them;
* :class:`~amprobe.capture.opmode.OpMode` (``ops``): on the steps a collector asks for, one
  probe-owned ``TorchDispatchMode`` that hands every op to each collector that asked;
* :class:`~amprobe.capture.modules.ModuleStack` (``modules``): on the steps a collector asks
  for ops with module attribution, torch's global module hooks naming the module each op runs
  in (never while torch.compile is in use);
* :class:`~amprobe.capture.compilewatch.CompileWatch` (``compile``): what torch.compile did;
* :class:`~amprobe.capture.discovery.RootModelFinder` (``discovery``): root-model discovery.

The methods the collectors, the probe, discovery and the engines call (``emit``, ``safe``,
``call``, ``source_step``, ...) are the parts' own bound methods, set as attributes: a call
through the hub costs no extra layer on the per-step path. While the probe is dormant, the
hub has only the step boundary and the objects' set-up calls installed: the per-step
interceptions and the root models' hooks are a layer of the install stack, installed when a
recording window opens (:meth:`Hub.start_recording`) and removed, newest first, when it closes
(:meth:`Hub.stop_recording`). Once ``torch.compile`` is in use the layer is installed for good
(no hook dynamo could trace comes or goes while compiled code runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from amprobe.capture.boundary import StepBoundary
from amprobe.capture.compilewatch import CompileWatch
from amprobe.capture.discovery import RootModelFinder
from amprobe.capture.dispatch import EVENTS, Dispatcher
from amprobe.capture.install import Installed, ScalerMethods
from amprobe.capture.interceptions import Interceptions, RootModelHooks
from amprobe.capture.modules import ModuleStack
from amprobe.capture.opmode import OpMode
from amprobe.capture.sites import dtype_name, user_call_site
from amprobe.capture.sources import EngineSources

if TYPE_CHECKING:
    from amprobe.capture.probe import Probe

__all__ = ["EVENTS", "Hub", "dtype_name", "user_call_site"]


class Hub:
    """Owns every interception of torch and delivers its events to the collectors.

    Attributes:
        optimizers: every optimizer seen (weakly held).
        scalers: every GradScaler seen (weakly held).
        closed: :meth:`close` ran.
    """

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.closed = False
        self.dispatch = Dispatcher(probe)
        self.installed = Installed()
        self.scaler_methods = ScalerMethods(probe, self.installed)
        self.ops = OpMode(probe, self.dispatch)
        self.modules = ModuleStack(probe, self.ops)
        #: root-model discovery (the global module hooks, the candidates)
        self.discovery = RootModelFinder(self)
        self.compile = CompileWatch(
            probe, self.dispatch, self.installed, self.modules, self.discovery
        )
        self.sources = EngineSources(self, self.dispatch, self.installed)
        self.boundary = StepBoundary(
            probe,
            self.dispatch,
            self.ops,
            self.modules,
            self.compile,
            self.sources,
            self.scaler_methods,
            self.discovery,
        )
        self.interceptions = Interceptions(
            probe,
            self.dispatch,
            self.installed,
            self.scaler_methods,
            self.boundary,
            self.compile,
            self.sources,
        )
        self.roots = RootModelHooks(
            probe, self.dispatch, self.installed, self.compile, self.boundary
        )
        self.optimizers = self.boundary.optimizers
        self.scalers = self.boundary.scalers
        # the parts' bound methods, as attributes (no extra call layer): the guard and dispatch
        dispatch = self.dispatch
        self.subscribe = dispatch.subscribe
        self.is_enabled = dispatch.is_enabled
        self.call = dispatch.call
        self.own_work = dispatch.own_work
        self.safe = dispatch.safe
        self.guard = dispatch.guard
        self.emit = dispatch.emit
        self.failed = dispatch.failed
        # the step boundary and the objects seen
        boundary = self.boundary
        self.see_scaler = boundary.see_scaler
        self.see_optimizer = boundary.see_optimizer
        self.begin_step = boundary.begin_step
        self.end_recording = boundary.end_recording
        self.source_scaled = boundary.source_scaled
        self.source_step = boundary.source_step
        # engine step sources
        self.load_sources = self.sources.load
        self.patch_source = self.sources.patch
        self.unwrap = self.sources.unwrap
        # torch.compile
        self.note_compile = self.compile.note
        self.compile_seen = self.compile.seen
        self._recording_layer: Installed | None = None
        self._pinned = False  # torch.compile is in use: the recording layer stays to close

    # -- state read through the hub ----------------------------------------------------------------
    @property
    def compile_in_use(self) -> bool:
        """Anything was compiled since attach: no hook dynamo could trace is installed."""
        return self.compile.in_use

    @property
    def compiled_before_attach(self) -> bool:
        """Something was compiled before amprobe attached (no in-graph statistics)."""
        return self.compile.before_attach

    # -- installation and removal ----------------------------------------------------------------
    def install(self) -> None:
        """Install the class-level interceptions (once per probe), and the recording layer
        when the probe records from attach or something was compiled already."""
        self.interceptions.install()
        self.compile.on_started = self._pin_recording
        if self.probe.recording:
            self.start_recording()
        if self.compile.before_attach or self.compile.in_use:
            self._pin_recording()

    def start_recording(self) -> None:
        """A recording window opens: install the per-step interceptions and the root models'
        hooks (a layer of the install stack). Idempotent."""
        if self._recording_layer is not None or self.installed.closed:
            return
        layer = self.installed.layer()
        self._recording_layer = layer
        self.interceptions.install_recording(layer)
        self.roots.install(layer)

    def stop_recording(self) -> None:
        """A recording window closes: remove its layer, newest first (kept while compiled
        code may run: see :meth:`_pin_recording`)."""
        layer = self._recording_layer
        if layer is None or self._pinned:
            return
        self._recording_layer = None
        self.roots.install(None)
        self.scaler_methods.unwrap(layer)
        self.installed.drop(layer)

    def _pin_recording(self) -> None:
        """torch.compile is in use: the recording layer is installed now (before the compiled
        code is traced, when torch.compile is called) and stays until close, so no hook dynamo
        could trace is added or removed under compiled code."""
        self._pinned = True
        self.start_recording()

    def watch_model(self, model: torch.nn.Module) -> None:
        """A root model is registered: name it in the module stack, hook its forward."""
        if self.modules.active:
            self.modules.name_roots()
        self.roots.watch(model)

    def close(self) -> None:
        """Remove everything the hub installed, newest first. Idempotent."""
        if self.closed:
            return
        self.ops.pop(final=True)
        if self.modules.active:
            self.modules.stop()
        self.discovery.stop()
        self.installed.remove_all()
        self.dispatch.closed = True
        self.closed = True
