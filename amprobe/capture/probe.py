"""The attach scope: one :class:`Probe` per process owns the hub, the collectors and the files.

Step boundaries come from the training job itself (the GradScaler's ``update`` or the
optimizer's ``step``, seen by the :class:`~amprobe.capture.hub.Hub`), so the user's loop needs no extra
call. The probe turns each iteration into a step record, buffers records and events, and writes
them through the store at flush.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import enum
import json
import math
import os
import socket
import sys
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from amprobe.capture.boundary import host_value
from amprobe.capture.budget import SampleBudget
from amprobe.capture.collectors import REGISTRY, Collector, StepFacts
from amprobe.capture.collectors.compiled import compiled_wrapper_of, unwrap_compiled
from amprobe.capture.collectors.runtime import read_rss_bytes
from amprobe.capture.collectors.sharded import user_class_name, user_model, wrapper_classes
from amprobe.capture.discovery import DISCOVERY, find_live_training_objects, name_in_caller
from amprobe.capture.hub import Hub
from amprobe.capture.protocol import FlushWriter
from amprobe.config import Config, ConfigError, check_collectors, make_config
from amprobe.store.fields import STEP_FIELDS
from amprobe.store.layout import StoreError, check_writable
from amprobe.store.writer import RunWriter

__all__ = ["Probe", "attach", "current_probe"]

_ACTIVE: Probe | None = None
_LOCK = threading.Lock()
_MAX_DORMANT_EVENTS = 5_000  # events kept while dormant (flushed with the next window)
_ALWAYS_KEPT = frozenset(
    {"window_start", "window_end", "run_end", "max_steps_reached", "terminated"}
)
_DECLARED = frozenset(f.name for f in STEP_FIELDS)
#: what a dormant probe runs at its first step (the control-file watcher); returns a handle
#: with ``stop()``. Supplied by the layer above (``amprobe.api``, ``amprobe.control.autoattach``).
Announcer = Callable[["Probe"], Any]


def current_probe() -> Probe | None:
    """The probe attached in this process, if any."""
    return _ACTIVE


def _default_run_dir() -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("amprobe_runs") / f"{stamp}-{os.getpid()}"


def device_facts(device: torch.device | None) -> dict[str, Any]:
    """Describe ``device`` for the manifest. Touches CUDA only when the job already uses it."""
    facts: dict[str, Any] = {"device": str(device) if device is not None else None}
    try:
        if device is not None and device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            facts.update(
                gpu_name=props.name,
                gpu_capability=f"{props.major}.{props.minor}",
                gpu_memory_bytes=int(props.total_memory),
                bf16_supported=bool(props.major >= 8),
                cuda_version=torch.version.cuda,
            )
        elif device is not None and device.type == "cpu":
            cpu = getattr(torch, "cpu", None)
            bf16 = False
            for probe_name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
                fn = getattr(cpu, probe_name, None)
                if fn is not None:
                    with contextlib.suppress(Exception):
                        bf16 = bf16 or bool(fn())
            facts.update(gpu_name=None, bf16_supported=bf16, cpu_count=os.cpu_count())
    except Exception as exc:  # facts are best effort; never fail the attach on them
        facts["device_error"] = f"{type(exc).__name__}: {exc}"
    return facts


class Probe:
    """A live recording of one training process.

    Use :func:`attach` to create one. ``close()`` is idempotent and also runs at interpreter
    exit. The probe is a context manager.

    Attributes:
        run_dir: where the run is written.
        step: index of the iteration in progress (iterations the GradScaler skipped count).
        recording: False while the probe is dormant (instrumented but recording nothing).
        window: recording windows opened so far (0 for a probe that records from the start;
            each :meth:`start_recording` of a dormant probe opens window ``window + 1``).
    """

    def __init__(
        self,
        run_dir: Path,
        config: Config,
        recording: bool = True,
        adoptable: bool = False,
        lazy: bool = False,
        on_announce: Announcer | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.pid = os.getpid()
        self.created_unix = time.time()
        self.adoptable = adoptable  # an automatic probe (`amprobe run`) that attach() joins
        self.lazy = lazy  # nothing written until the first step (`amprobe run`)
        self._on_announce = on_announce
        self.config = config
        self.rank = config.resolved_rank
        self.world_size = config.resolved_world_size
        self.step = 0
        self.window = 0
        self.recording = recording
        self.closed = False
        #: a bad step is being replayed (:mod:`amprobe.capture.collectors.replay`): the
        #: collectors' hooks on the user's modules and tensors stay out of it
        self.replaying = False
        self._t0 = time.perf_counter()
        #: when the step in progress started (``perf_counter``); None until the first activity
        #: after attach (:meth:`touch`; the wrappers test it before calling)
        self.t_step_start: float | None = None
        self._probe_time = 0.0
        self._last_flush = time.perf_counter()
        self._flush_steps, self._flush_spacing = config.flush_schedule()
        self._pending_steps: list[dict[str, Any]] = []
        # the resident set size: read at a step's end once due (no collector asked: never)
        self._rss_period = math.inf
        self._rss_due = math.inf
        # steps whose records the collectors have not folded yet (on_step_fold)
        self._unfolded: collections.deque[tuple[int, dict[str, Any], StepFacts]]
        self._unfolded = collections.deque()
        self._event_step: int | None = None  # events of a step folded later are dated to it
        self._pending_events: list[dict[str, Any]] = []
        # events come from other threads too (the control watcher): the flush's hand-over of
        # the list and an append must not interleave, or the appended event is lost
        self._events_lock = threading.Lock()
        self.collectors: list[Collector] = []
        #: spaces the sampled steps of the default schedules within the overhead budget
        self.budget = SampleBudget(self.config.overhead_budget, self.event)
        self.hub = Hub(self)
        self._subs = self.hub.dispatch.subs  # event -> its subscribers now (kept in place)
        self.models: list[weakref.ReferenceType[torch.nn.Module]] = []
        self._model_labels: list[str] = []  # parallel to models: the user's name for each root
        self.device: torch.device | None = None
        self._rank_manifest: dict[str, Any] = {}
        self.writer: RunWriter | None = None
        # dormant mode: requests come from any thread, are applied by the training thread at
        # the next step boundary (end_step reads one attribute while nothing is pending)
        self._control: _Request | None = None
        self._control_lock = threading.Lock()
        self.control_state: dict[str, Any] = {"seq": 0, "result": None, "step": 0, "window": 0}
        self._window_left: int | None = None
        self._window_first = 0
        self._dropped_events = 0
        self._announced = recording  # a dormant probe announces itself at its first step
        self._watcher: Any = None
        self._undeclared: set[str] = set()
        self._live: dict[str, float] = {}
        self._live_pending: dict[str, float] = {}  # CPU runs: the unflushed steps, folded once
        self._live_pending_n = 0

    # -- set-up -----------------------------------------------------------------------------
    def _start(self, model: Any, optimizer: Any, scaler: Any) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ConfigError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        device = _first_param_device(optimizer) if optimizer is not None else None
        model_device = _first_param_device(model) if model is not None else None
        #: the device came from a root model's parameters (an optimizer's gives way to it)
        self._device_from_model = model_device is not None
        if model_device is not None and _model_device_wins(device, model_device):
            device = model_device  # (see note_device)
        self.device = device
        self._rank_manifest = {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": int(os.environ.get("LOCAL_RANK", self.rank) or 0),
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            # NCCL checks every collective's input for NaN when set (AMP-D04 says so)
            "nccl_nan_check": os.environ.get("TORCH_NCCL_NAN_CHECK"),
            "argv": list(sys.argv),
            "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "start_unix": time.time(),
            "config": {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self.config).items()
            },
            **device_facts(device),
        }
        try:
            if self.lazy:  # nothing is written before the first step: check the place now
                check_writable(self.run_dir)
            self.writer = RunWriter(
                self.run_dir,
                self.rank,
                self.world_size,
                self._rank_manifest,
                max_buffered_rows=self.config.max_buffered_rows,
                overwrite=self.config.overwrite,
                lazy=self.lazy,
            )
        except StoreError as exc:
            raise ConfigError(str(exc)) from None
        self.hub.install()
        for name in self.config.collectors:
            if name == DISCOVERY:  # not a collector: the hub's root-model finder, always on
                continue
            collector = REGISTRY[name]()
            self.collectors.append(collector)
            collector.on_attach(self)  # may raise ConfigError: attach-time errors are loud
        self.hub.discovery.on_attach()
        self.hub.subscribe(self.collectors)
        self.event("run_start", recording=self.recording)
        for obj in (optimizer, scaler):
            if obj is not None:
                self.add_object(obj)
        if model is not None:
            self.add_model(model)
        if self.recording:
            self.hub.begin_step(self.step)

    def add_object(self, obj: Any) -> None:
        """Register an optimizer or GradScaler passed to attach (or found live)."""
        if isinstance(obj, torch.optim.Optimizer):
            self.hub.see_optimizer(obj)
            self.note_device(_first_param_device(obj))
        elif isinstance(obj, torch.amp.GradScaler):
            self.hub.see_scaler(obj, None)

    def add_model(self, model: torch.nn.Module, found_by: str = "attach") -> None:
        """Register a root model (the attach argument, or one found by discovery); an engine's
        wrapper (``DeepSpeedEngine``) is registered as the user's model inside it.

        The module registered is the one the job calls (its hooks check the model's inputs);
        its layers are named from the user's model inside its wrappers
        (:func:`~amprobe.capture.collectors.sharded.user_model`: no ``module.`` of DDP, no
        ``_orig_mod.`` of torch.compile). ``found_by`` says how the root was found (the
        ``model_registered`` event's field; see :mod:`amprobe.capture.discovery`)."""
        model = self.hub.unwrap(model)
        # the job calls torch.compile's wrapper: its hooks run outside the compiled frame
        wrapper = compiled_wrapper_of(model)
        if wrapper is not None:
            model = wrapper
        if any(ref() is model for ref in self.models):
            return
        inner = user_model(model)
        label = name_in_caller(model, inner, unwrap_compiled(model)) or user_class_name(model)
        self.models.append(weakref.ref(model))
        self._model_labels.append(label)
        self.event(
            "model_registered",
            model_class=user_class_name(model),
            name=label,
            parameters=sum(p.numel() for p in model.parameters()),
            trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
            found_by=found_by,
            # layers are named from the user's model inside these (older runs: names as recorded)
            wrappers=wrapper_classes(model),
        )
        if not self._device_from_model:
            self.note_device(_first_param_device(model), model=True)
        self.hub.watch_model(model)
        self.hub.emit("on_model", model)

    def root_name(self, model: Any) -> str | None:
        """The name of root model ``model`` (the wrapper or the module it wraps) in layer names.

        With one root model, layers are named by their path in it (``encoder.fc1``) and this
        is ``None``. With several, each layer's name starts with its root's name: the name the
        user's code binds the model to where amprobe first met it (``model1``), else its class
        name; names that would be equal get the root's registration index (``Sequential[0]``,
        ``Sequential[1]``).
        """
        if len(self.models) < 2:
            return None
        index = next(
            (
                i
                for i, ref in enumerate(self.models)
                if (m := ref()) is not None
                and (m is model or unwrap_compiled(m) is model or user_model(m) is model)
            ),
            None,
        )
        if index is None:
            return None
        label = self._model_labels[index]
        if self._model_labels.count(label) > 1:
            return f"{label}[{index}]"
        return label

    def note_device(self, device: torch.device | None, model: bool = False) -> None:
        """Record the training device once it is known: the first root model's, else the
        first optimizer's until a root model is seen. A model's accelerator wins over an
        optimizer's CPU noted before it: an optimizer may hold CPU master copies of a model on
        an accelerator (ZeRO-Offload), and taking the CPU for the job's device would read the
        model's device values on the host every step and record no GPU. The CPU never
        replaces an accelerator (a model whose first parameter, an embedding, stays on the
        host while it trains on a GPU)."""
        if device is None or self.writer is None:
            return
        if self.device is not None and (self._device_from_model or not model):
            return
        self._device_from_model = model
        if not _model_device_wins(self.device, device):
            return
        self.device = device
        self.annotate_manifest(**device_facts(device))

    @property
    def rank_manifest(self) -> Mapping[str, Any]:
        return self._rank_manifest

    def annotate_manifest(self, **facts: Any) -> None:
        """Add facts to this rank's manifest (rewritten atomically if already on disk)."""
        self._rank_manifest.update(facts)
        if self.writer is not None:
            with contextlib.suppress(OSError):
                self.writer.update_manifest(self._rank_manifest)

    @property
    def start_time(self) -> float:
        """``time.perf_counter()`` at attach: the origin of the run's ``t`` columns."""
        return self._t0

    @property
    def probe_time(self) -> float:
        """Seconds the probe itself has spent (flushes) since the last step boundary."""
        return self._probe_time

    def is_enabled(self, name: str) -> bool:
        """False once collector ``name`` failed and was switched off."""
        return self.hub.is_enabled(name)

    # -- recording ----------------------------------------------------------------------------
    def touch(self) -> None:
        """Mark activity in the current step (used to time the very first step)."""
        if self.t_step_start is None:
            self.t_step_start = time.perf_counter()

    def watch_rss(self, period_s: float) -> None:
        """Read the process's resident set size into :attr:`StepFacts.rss_bytes` at a step's
        end, at most every ``period_s`` seconds (one ``pread``; steps between read nothing)."""
        self._rss_period = min(self._rss_period, period_s)
        self._rss_due = 0.0

    def event(self, kind: str, /, **detail: Any) -> None:
        """Record an event in the current step. Cheap: no I/O until the next flush."""
        if (
            not self.recording
            and len(self._pending_events) >= _MAX_DORMANT_EVENTS
            and kind not in _ALWAYS_KEPT
        ):
            self._dropped_events += 1
            return
        row = {
            "step": self.step if self._event_step is None else self._event_step,
            "t": time.perf_counter() - self._t0,
            "kind": kind,
            "detail": json.dumps(detail, default=str, sort_keys=True),
        }
        with self._events_lock:
            self._pending_events.append(row)

    def event_at(self, step: int, kind: str, /, **detail: Any) -> None:
        """Record an event dated to an earlier ``step`` (a fact learnt at a flush)."""
        saved, self._event_step = self._event_step, step
        try:
            self.event(kind, **detail)
        finally:
            self._event_step = saved

    def end_step(self, facts: StepFacts) -> None:
        """Close the iteration in progress. Called by the hub at the step boundary.

        While dormant this only counts the step (and applies a pending start request).
        """
        if not self.recording:
            self.step += 1
            if not self._announced:
                self._announce()
            if self._control is not None:
                self._apply_control()
            self._check_max_steps()
            return
        now = time.perf_counter()
        start = self.t_step_start
        if start is None:
            start = now
        step = self.step
        # plans of the other ranks' schedule read during this step (amprobe.capture.agree):
        # amprobe's time in this step, not the job's
        self._probe_time += self.budget.unreported()
        spent = self._probe_time
        wall = now - start - spent
        record: dict[str, Any] = {
            "step": step,
            "window": self.window,
            "t": now - self._t0,
            "wall_s": wall if wall > 0.0 else 0.0,
            "probe_s": spent,
        }
        self._probe_time = 0.0
        if now >= self._rss_due:
            self._rss_due = now + self._rss_period
            facts.rss_bytes = read_rss_bytes()
        subs = self._subs
        if subs["on_step_end"]:
            dispatch = self.hub.dispatch
            if not dispatch.closed:
                dispatch.deliver(subs["on_step_end"], (step, record, facts))
        if subs["on_step_fold"]:
            self._unfolded.append((step, record, facts))
        self._pending_steps.append(record)
        self.step = step + 1
        self.t_step_start = end = time.perf_counter()
        # the step and the collectors' work at its end (a sampled step's folds), without
        # flushes: what a sampled step costs is measured against an unsampled one's
        took = end - start - spent
        # (the ranks' schedule agreed at a sampled step's end: amprobe's time, not the next step's)
        self._probe_time += self.budget.end_step(took if took > 0.0 else 0.0)
        # root models found at this boundary are the next step's: a sample they start (the
        # first per-layer sample of a job whose model discovery finds) is that step's
        discovery = self.hub.discovery
        if discovery.checking:
            discovery.on_step_end(step)
            self._probe_time += time.perf_counter() - end
        if self._window_left is not None:
            self._window_left -= 1
            if self._window_left <= 0:
                self._stop_window("steps")
        if self._control is not None:
            self._apply_control()
        config = self.config
        if config.max_steps is not None:
            self._check_max_steps()
        if self.recording and (
            (
                len(self._pending_steps) >= self._flush_steps
                and now - self._last_flush >= self._flush_spacing
            )
            or now - self._last_flush >= config.flush_interval_s
        ):
            self.flush()

    def _check_max_steps(self) -> None:
        if self.config.max_steps is not None and self.step >= self.config.max_steps:
            self.event("max_steps_reached", max_steps=self.config.max_steps)
            self.close()
            raise SystemExit(0)  # asked for: `amprobe baseline` bounds the job's length

    # -- dormant mode: recording windows ------------------------------------------------------
    def start_recording(self, steps: int | None = None, source: str = "api", seq: int = 0) -> None:
        """Ask a dormant probe to record from the next step boundary. Safe from any thread.

        Never blocks the training thread: the request is applied by the training thread when the
        iteration in progress ends. When the probe knows no root model yet, the live modules are
        searched here (a scan of the garbage collector's objects, on the calling thread) so that
        layer collectors can hook the model from the first recorded step.

        Args:
            steps: stop recording by itself after this many steps; ``None`` records until
                :meth:`stop_recording` or the end of the job.
            source: who asked (recorded in the ``window_start`` event).
            seq: the control file's sequence number of this request (0 from the API).
        """
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ConfigError(f"steps must be a positive integer or None, got {steps!r}")
        models: list[Any] = []
        if not any(ref() is not None for ref in self.models):
            with contextlib.suppress(Exception):
                models = find_live_training_objects().models
        with self._control_lock:
            self._control = _Request(Action.START, steps, seq, source, models)

    def stop_recording(self, source: str = "api", seq: int = 0) -> None:
        """Ask the probe to stop recording and flush at the next step boundary. Safe from any thread."""
        with self._control_lock:
            self._control = _Request(Action.STOP, None, seq, source, [])

    def _apply_control(self) -> None:
        with self._control_lock:
            request, self._control = self._control, None
        if request is None or self.closed:
            return
        steps, seq, source, models = request.steps, request.seq, request.source, request.models
        if request.action is Action.START:
            if self.recording:
                if steps is not None:
                    self._window_left = steps
                result = "already recording"
            else:
                for model in models:  # found live by their optimizers' parameters
                    self.add_model(model, found_by="optimizer")
                self._start_window(steps, source)
                result = "recording"
        else:
            if self.recording:
                self._stop_window("detach")
                result = "stopped"
            else:
                result = "not recording"
        self.control_state = {
            "seq": seq,
            "result": result,
            "step": self.step,
            "window": self.window,
        }

    def _start_window(self, steps: int | None, source: str) -> None:
        self.window += 1
        self.recording = True
        self._window_left = steps
        self._window_first = self.step
        self._probe_time = 0.0
        self.t_step_start = time.perf_counter()
        self.event(
            "window_start",
            window=self.window,
            first_step=self.step,
            steps=steps,
            source=source,
            dormant_events_dropped=self._dropped_events,
        )
        self.hub.start_recording()  # the per-step interceptions, from this boundary on
        self.hub.emit("on_recording", True)
        self.hub.discovery.on_recording(True)
        self.hub.begin_step(self.step)

    def _window_end_event(self, reason: str) -> None:
        self.event(
            "window_end",
            window=self.window,
            first_step=self._window_first,
            last_step=self.step - 1,
            steps=self.step - self._window_first,
            reason=reason,
        )

    def _stop_window(self, reason: str) -> None:
        self.hub.end_recording()
        self.hub.emit("on_recording", False)
        self.hub.discovery.on_recording(False)
        self.hub.stop_recording()
        self.recording = False
        self._window_left = None
        self._window_end_event(reason)
        self.flush()

    def _announce(self) -> None:
        """First step of a dormant probe: write this rank's manifest and start the control watcher.

        Done here rather than at attach so that processes that never train (a launcher, a
        torchrun agent) leave no trace. Never raises.
        """
        self._announced = True
        if self.writer is None or os.getpid() != self.pid:
            return
        if self._on_announce is None:
            return
        try:
            self._watcher = self._on_announce(self)
        except Exception as exc:
            self.event("control_unavailable", error=f"{type(exc).__name__}: {exc}")

    def flush(self) -> None:
        """Write everything buffered. Costs one host-device sync per device holding values."""
        if self.writer is None or os.getpid() != self.pid:
            return
        t = time.perf_counter()
        try:
            self._fold_steps()
            rows = self._pending_steps
            self._pending_steps = []
            _materialize(rows)
            self._check_declared(rows)
            self._update_live(rows)
            self.writer.append("steps", rows)
            written = FlushWriter(self.writer)
            self.hub.emit("on_flush", written)
            if rows:  # the step records, read back: first (a collector reads values it folded)
                written.appended.insert(0, ("steps", list[Mapping[str, Any]](rows)))
            for table, new in written.appended:  # per-layer values reach collectors in memory
                self.hub.emit("on_rows", table, new)
            with self._events_lock:
                events, self._pending_events = self._pending_events, []
            self.writer.append("events", events)
            self.writer.flush()
        except Exception as exc:  # the writer never raises; this guards the materialisation
            with contextlib.suppress(Exception):
                self.writer.write_errors.append(f"flush: {type(exc).__name__}: {exc}")
        finally:
            self._last_flush = time.perf_counter()
            self._probe_time += self._last_flush - t

    def _fold_steps(self) -> None:
        """The collectors fill in the records of the steps since the last call
        (``on_step_fold``): each collector the steps in step order, its events dated to the
        step, under the guard once per collector (a batch of warm calls). Training thread
        only."""
        unfolded = self._unfolded
        if not unfolded:
            return
        batch = list(unfolded)
        unfolded.clear()
        dispatch = self.hub.dispatch

        def fold(fn: Callable[..., None]) -> None:
            for step, record, facts in batch:
                self._event_step = step
                fn(step, record, facts)

        try:
            for collector, fn in list(self._subs["on_step_fold"]):
                dispatch.call(collector, fold, fn)
        finally:
            self._event_step = None

    def _update_live(self, rows: list[dict[str, Any]]) -> None:
        _fold_live(self._live, rows)
        self._live_pending, self._live_pending_n = {}, 0  # those rows are flushed now

    def publish(self, name: str, value: float) -> None:
        """A collector's live value (e.g. ``nonfinite_layers``), read by :meth:`live_metrics`."""
        self._live[name] = value

    def live_metrics(self) -> dict[str, float]:
        """amprobe's live values as of the last flush: never a host-device sync.

        Keys present only once recorded: ``steps`` (recorded iterations), ``loss_scale`` (after
        the last flushed ``update()``), ``skipped_steps`` (with a GradScaler), ``loss``,
        ``nonfinite_layers`` (modules whose sampled outputs or gradients held inf/NaN, from the
        numerics collector). Framework callbacks push these into the framework's own logging.
        On a CPU run the steps not flushed yet count too (reading a host tensor is no sync).
        """
        if self.device is None or self.device.type != "cpu":
            return dict(self._live)
        self._fold_steps()
        pending = list(self._pending_steps)
        if len(pending) < self._live_pending_n:  # flushed since: start the pending fold afresh
            self._live_pending, self._live_pending_n = {}, 0
        new = pending[self._live_pending_n :]
        with self.hub.own_work():  # amprobe's reads are not the job's host syncs
            rows = [{k: host_value(v) for k, v in r.items()} for r in new]
        _fold_live(self._live_pending, rows)
        self._live_pending_n = len(pending)
        live = dict(self._live)
        for key, value in self._live_pending.items():  # counts add up, last values replace
            live[key] = live.get(key, 0) + value if key in _LIVE_COUNTS else value
        return live

    def _check_declared(self, rows: list[dict[str, Any]]) -> None:
        """Every steps column must be declared in amprobe.store.fields; say so once if not."""
        if not rows:
            return
        keys: set[str] = set()
        for row in rows:
            keys.update(row)
        for name in sorted(keys - _DECLARED - self._undeclared):
            self._undeclared.add(name)
            self.event("undeclared_field", table="steps", field=name)

    # -- shutdown -----------------------------------------------------------------------------
    def close(self, *, ended_by: BaseException | str | None = None) -> None:
        """Flush, remove every hook and patch, and mark the run as cleanly closed. Idempotent.

        Args:
            ended_by: what is ending the program, when it is not a normal end: the uncaught
                exception (the run's status becomes ``failed``; ``interrupted`` for
                ``KeyboardInterrupt``) or the name of a signal (``interrupted``). At exit and in
                ``with attach(...)`` this is found by itself.
        """
        global _ACTIVE
        with _LOCK:
            if self.closed:
                return
            self.closed = True
        if os.getpid() != self.pid:
            return  # a forked child (DataLoader worker) never writes the parent's run
        status, reason = _end_status(ended_by)
        try:
            if self.recording and self.window > 0:
                self._window_end_event("run_end")
            self.event("run_end", steps=self.step, status=status)
            if self._watcher is not None:
                self._watcher.stop()
            if self.writer is not None and not self.writer.ready and self._trained_something():
                # the job died before its first step ended (the fault most in need of a
                # diagnosis): keep what was seen instead of leaving no run at all
                with contextlib.suppress(Exception):
                    self.writer.prepare()
            self.flush()
        finally:
            for collector in reversed(self.collectors):
                self.hub.call(collector, collector.on_close)
            self.hub.close()
            if self.writer is not None:
                end: dict[str, Any] = {
                    "status": status,
                    "steps": self.step,
                    "end_unix": time.time(),
                }
                if reason:
                    end["reason"] = reason
                with contextlib.suppress(Exception):
                    self.budget.close()  # (its keys in the ranks' store)
                with contextlib.suppress(Exception):
                    end["sampling"] = self.budget.summary()
                with contextlib.suppress(Exception):
                    self.writer.close(end)
            with contextlib.suppress(Exception):
                atexit.unregister(self._close_at_exit)
            if _ACTIVE is self:
                _ACTIVE = None

    def _close_at_exit(self) -> None:
        self.close(ended_by=_uncaught_exception())

    def _trained_something(self) -> bool:
        """Whether this process got as far as training objects (not a launcher or a helper)."""
        return bool(len(self.hub.optimizers) or len(self.hub.scalers)) or any(
            ref() is not None for ref in self.models
        )

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(ended_by=exc)

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("recording" if self.recording else "dormant")
        return f"<amprobe.Probe {state} step={self.step} run_dir={str(self.run_dir)!r}>"


_LIVE_COUNTS = frozenset({"steps", "skipped_steps"})


def _fold_live(live: dict[str, float], rows: list[dict[str, Any]]) -> None:
    """Add materialized step records to the live totals (see :meth:`Probe.live_metrics`)."""
    if not rows:
        return
    live["steps"] = live.get("steps", 0) + len(rows)
    skipped = sum(1 for row in rows if row.get("skipped") is True)
    if skipped:
        live["skipped_steps"] = live.get("skipped_steps", 0) + skipped
    for key, name in (("scale_after", "loss_scale"), ("loss", "loss")):
        for row in reversed(rows):  # the last value recorded
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                live[name] = float(value)
                if name == "loss_scale":
                    live.setdefault("skipped_steps", 0)
                break


def _uncaught_exception() -> BaseException | None:
    """The exception ending the program, at exit: the interpreter keeps an uncaught one in
    ``sys.last_exc`` (``sys.last_value`` before 3.12) before running exit handlers. In an
    interactive session those hold an earlier error the session went on from: not used."""
    if hasattr(sys, "ps1") or "IPython" in sys.modules:
        return None
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return exc if isinstance(exc, BaseException) else None


def _end_status(ended_by: BaseException | str | None) -> tuple[str, str | None]:
    """``(status, reason)`` for ``end.json`` from what ended the program."""
    if ended_by is None:
        return "finished", None
    if isinstance(ended_by, str):
        return "interrupted", ended_by
    if isinstance(ended_by, KeyboardInterrupt):
        return "interrupted", "KeyboardInterrupt"
    if isinstance(ended_by, SystemExit):
        code = ended_by.code
        if code is None or code == 0:
            return "finished", None
        return "failed", f"SystemExit({code!r})"[:300]
    if not isinstance(ended_by, Exception):  # GeneratorExit and friends: not a failure
        return "finished", None
    text = str(ended_by).strip().splitlines()
    message = f"{type(ended_by).__name__}: {text[0]}" if text else type(ended_by).__name__
    return "failed", message[:300]


def _model_device_wins(current: torch.device | None, new: torch.device) -> bool:
    """A root model's device ``new`` becomes the job's over ``current`` (none yet, or an
    optimizer's): unless it is the same, or the CPU over an accelerator."""
    if current is None:
        return True
    return new != current and not (new.type == "cpu" and current.type != "cpu")


def _first_param_device(obj: Any) -> torch.device | None:
    try:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                return p.device
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for p in group["params"]:
                    return p.device
    except Exception:
        return None
    return None


#: the types of a step record's values that need no read-back
_SCALARS = frozenset({float, int, bool, str, type(None)})


def _materialize(rows: list[dict[str, Any]]) -> None:
    """Replace device tensors in ``rows`` by Python numbers with one transfer per device.

    Values are stacked per (device, dtype) (one kernel per group, not per value), widened to
    float64 (float32 on MPS) and concatenated, so each device costs one copy to the host.
    """
    groups: dict[
        tuple[torch.device, torch.dtype], list[tuple[dict[str, Any], str, torch.Tensor]]
    ] = defaultdict(list)
    tensor = torch.Tensor
    for row in rows:
        if set(map(type, row.values())) <= _SCALARS:
            continue  # a CPU job's row: Python values only (one C-level pass over its types)
        for key, value in row.items():
            if isinstance(value, tensor):
                groups[(value.device, value.dtype)].append((row, key, value))
    by_device: dict[
        torch.device, list[tuple[torch.dtype, list[tuple[dict[str, Any], str, torch.Tensor]]]]
    ] = defaultdict(list)
    for (device, dtype), items in groups.items():
        by_device[device].append((dtype, items))
    for device, parts in by_device.items():
        wide = torch.float32 if device.type == "mps" else torch.float64
        with torch.no_grad():
            stacked = [
                torch.stack(
                    [t.detach().reshape(-1)[0] if t.dim() else t.detach() for _, _, t in items]
                ).to(wide)
                for _, items in parts
            ]
            values = torch.cat(stacked).cpu().tolist()
        offset = 0
        for dtype, items in parts:
            chunk = values[offset : offset + len(items)]
            offset += len(items)
            if dtype == torch.bool:
                chunk = [bool(v) for v in chunk]
            elif not (dtype.is_floating_point or dtype.is_complex):
                chunk = [int(v) for v in chunk]
            for (row, key, _), value in zip(items, chunk, strict=True):
                row[key] = value


def attach(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    config: Config | Mapping[str, Any] | None = None,
    *,
    adoptable: bool = False,
    lazy: bool = False,
    on_announce: Announcer | None = None,
) -> Probe:
    """The core of :func:`amprobe.attach` (see there for the public arguments).

    Keyword-only arguments are for the layers above: ``adoptable`` makes an automatic probe
    (``amprobe run``) that a later ``attach()`` joins, ``lazy`` writes nothing until the first
    training step, and ``on_announce`` is what a dormant probe starts at its first step (the
    control-file watcher).

    Raises:
        ConfigError: a bad config, an unusable run directory, or a second probe in the process.
    """
    global _ACTIVE
    cfg = make_config(config)
    check_collectors(cfg, {**REGISTRY, DISCOVERY: None})
    if DISCOVERY not in cfg.collectors:
        # nothing passed (accelerate, `amprobe run`): find the root model at its first forward,
        # so the per-layer collectors see it as if it had been passed; a model passed may not
        # be the only one trained: the others are found in the first step
        cfg = dataclasses.replace(cfg, collectors=(*cfg.collectors, DISCOVERY))
    with _LOCK:
        existing = _ACTIVE
        if existing is not None and not existing.closed:
            if not existing.adoptable:
                raise ConfigError(
                    f"a probe is already attached in this process ({existing.run_dir}); "
                    "close it first or use the existing one"
                )
        else:
            existing = None
    if existing is not None:
        # `amprobe run` attached an automatic probe: join it instead of instrumenting twice.
        if run_dir is not None and Path(run_dir).resolve() != Path(existing.run_dir).resolve():
            existing.event("attach_joined", requested_run_dir=str(run_dir))
            print(
                f"amprobe: attach(run_dir={str(run_dir)!r}) joins the run `amprobe run` is "
                f"recording in {existing.run_dir}; nothing is written to {str(run_dir)!r}",
                file=sys.stderr,
            )
        for obj in (optimizer, scaler):
            if obj is not None:
                existing.add_object(obj)
        if model is not None:
            existing.add_model(model)
        return existing
    probe = Probe(
        Path(run_dir) if run_dir is not None else _default_run_dir(),
        cfg,
        recording=not cfg.dormant,
        adoptable=adoptable,
        lazy=lazy,
        on_announce=on_announce,
    )
    try:
        probe._start(model, optimizer, scaler)
    except BaseException:
        for collector in reversed(probe.collectors):
            with contextlib.suppress(Exception):
                collector.on_close()
        probe.hub.close()
        raise
    with _LOCK:
        _ACTIVE = probe
    atexit.register(probe._close_at_exit)
    return probe


class Action(enum.Enum):
    """What a recording request asks of the probe."""

    START = "start"
    STOP = "stop"


class _Request:
    """A recording request from any thread, applied by the training thread at a boundary."""

    __slots__ = ("action", "steps", "seq", "source", "models")

    def __init__(
        self, action: Action, steps: int | None, seq: int, source: str, models: list[Any]
    ) -> None:
        self.action = action
        self.steps = steps
        self.seq = seq
        self.source = source
        self.models = models


def _after_fork_in_child() -> None:
    """A forked child (DataLoader worker, user fork) inherits the probe: make it inert there."""
    probe = _ACTIVE
    if probe is not None:
        probe.closed = True
        probe._events_lock = threading.Lock()  # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):  # POSIX only
    os.register_at_fork(after_in_child=_after_fork_in_child)
