"""Runtime profile: where a step's time goes, host-device syncs, memory and GPU activity.

The :class:`RuntimeCollector` answers "why is AMP not faster" from inside the training process
without adding a host-device sync on the hot path.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from amprobe.capture.collectors.nvml import GpuSampler
from amprobe.capture.collectors.syncs import SyncCounter
from amprobe.capture.protocol import PHASES, Collector, StepFacts
from amprobe.store.fields import Field, fields_of

__all__ = ["RuntimeCollector", "PHASES", "read_rss_bytes"]

_MAX_EVENTS_PER_KIND = 20
_STATM = "/proc/self/statm"
#: seconds between two reads of the resident set size (steps in between reuse the last one)
RSS_PERIOD_S = 0.5
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_statm: list[int] = []  # [pid, fd]: /proc/self/statm kept open by the process that opened it


def read_rss_bytes() -> int | None:
    """Resident set size of this process in bytes (Linux ``/proc``), or None elsewhere.

    The file stays open (one ``pread`` a call: opening it cost 74-94 us inside a training step
    on a loaded machine, a ``pread`` 18 us); a forked child opens its own.
    """
    try:
        pid = os.getpid()
        if not _statm or _statm[0] != pid:
            _statm[:] = [pid, os.open(_STATM, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))]
        return int(os.pread(_statm[1], 256, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class RuntimeCollector(Collector):
    """Records step-time breakdown, data-loader stalls, host-device syncs, memory and GPU samples.

    Per step (``steps`` table), host clock, probe's own time excluded:

    - ``data_wait_s``: seconds spent inside ``DataLoader`` iterators' ``__next__`` (waiting for
      the next batch); ``batches``: batches fetched during the step.
    - ``fwd_s``, ``bwd_s``, ``opt_s``: seconds inside the root models' forward, inside
      ``torch.autograd.backward`` and inside ``optimizer.step`` (host time: on CUDA this is the
      time to launch the work; the device time is in the ``cuda_phases`` table). Phases nest:
      a forward and backward run inside ``optimizer.step(closure)`` (Lightning, LBFGS) count
      as forward and backward, not as optimizer time. On the steps ``Config.details_every``
      selects (every 10th by default; null on others: the clock's calls are most of what an
      unsampled step would otherwise pay for them).
    - ``peak_mem_bytes``: CUDA only, ``torch.cuda.max_memory_allocated`` over the step (the
      allocator's host-side counter, no sync); the peak is reset at every step unless
      ``Config.reset_peak_memory`` is False (then it is the peak since the start).
    - ``rss_bytes``: the process's resident set size at the end of the step (Linux), read at
      most every 0.5 s (:data:`RSS_PERIOD_S`): faster steps repeat the last reading.
    - ``syncs`` and ``syncs_sampled``: on sampled steps (``Config.syncs_every``), the number of
      synchronizing ops issued by user code (see :mod:`amprobe.capture.collectors.syncs`); null on
      other steps. Sampled steps run under a dispatch mode, so their ``wall_s`` is inflated.

    Tables: ``syncs`` (step, site ``file:line``, op, kind user/scaler/optimizer, count, device),
    ``cuda_phases`` (step, ``fwd_s``/``bwd_s``/``opt_s`` measured with CUDA events on the
    current stream, read back at flush), ``gpu`` (NVML samples, see
    :mod:`amprobe.capture.collectors.nvml`).

    Events: ``dataloader_seen`` (num_workers, prefetch_factor, pin_memory, persistent_workers,
    batch_size), ``gpu_sampler`` (status: sampling / not available / stopped, and why),
    ``sync_counting_stopped``.

    The phases are timed by the hub's phase clock (:mod:`amprobe.capture.phases`, asked for
    with ``phase_times``), the data wait by the hub's ``DataLoader`` wrapper and the resident
    set size by the probe (:meth:`~amprobe.capture.probe.Probe.watch_rss`): all of them are
    step facts, folded into the records at flush (``on_step_fold``). Only on CUDA is this
    collector called at a step's end (the allocator's peak is live state).

    Cost: two ``perf_counter`` calls per batch and per timed phase, one ``pread`` of ``/proc``
    per 0.5 s; on CUDA two events per phase and a host-side allocator query at each step's end.
    The NVML sampler runs in its own thread. Sync counting (the hub's op mode) costs about 10 %
    on sampled steps only.
    """

    name = "runtime"
    samples = True  # on_step_begin decides its samples (skipped on quiet steps)
    fields: ClassVar[tuple[Field, ...]] = fields_of("runtime")
    phase_times = True
    # the backward root is a tensor the job owns: marked on the steps syncs are counted
    detail_events = frozenset({"on_backward_begin"})

    def on_attach(self, probe: Any) -> None:
        super().on_attach(probe)
        cfg = probe.config
        self._syncs_every, fixed = cfg.sample_period("syncs_every")
        every = self._syncs_every
        probe.budget.register("syncs", every, fixed=fixed, first=1 % every if every > 0 else 0)
        self._cuda_events: list[tuple[int, str, Any, Any]] = []
        self._sync_rows: list[dict[str, Any]] = []
        self._counter: SyncCounter | None = None
        # the sampled steps' counters, read when their records are folded
        self._counters: collections.deque[tuple[int, SyncCounter]] = collections.deque()
        # what a CPU run's sync counter takes as device tensors (see amprobe.capture.collectors.syncs)
        self._models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._scalers: weakref.WeakSet[torch.amp.GradScaler] = weakref.WeakSet()
        self._sampler: GpuSampler | None = None
        self._sampler_started = False
        self._noted_device: torch.device | None = None  # probe.device as last acted on
        self._rss_value: int | None = None
        self._event_counts: dict[str, int] = defaultdict(int)
        self._loader_configs: set[tuple[Any, ...]] = set()
        probe.watch_rss(RSS_PERIOD_S)
        probe.hub.dispatch.mute(self, "on_step_end")  # until the device is known to be CUDA
        self._maybe_start_sampler()

    def on_close(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()

    def _event(self, kind: str, **detail: Any) -> None:
        self._event_counts[kind] += 1
        if self._event_counts[kind] <= _MAX_EVENTS_PER_KIND:
            self.probe.event(kind, **detail)

    # -- objects ------------------------------------------------------------------------------
    def on_model(self, model: torch.nn.Module) -> None:
        self._models.add(model)
        self._note_device()

    def on_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizers.add(optimizer)
        self._note_device()

    def on_scaler(self, scaler: torch.amp.GradScaler, site: str | None) -> None:
        self._scalers.add(scaler)

    # -- data loader --------------------------------------------------------------------------
    def on_dataloader(self, iterator: Any) -> None:
        config = (
            getattr(iterator, "_num_workers", None),
            getattr(iterator, "_prefetch_factor", None),
            getattr(iterator, "_pin_memory", None),
            getattr(iterator, "_persistent_workers", None),
            getattr(getattr(iterator, "_index_sampler", None), "batch_size", None),
        )
        if config not in self._loader_configs:
            self._loader_configs.add(config)
            keys = (
                "num_workers",
                "prefetch_factor",
                "pin_memory",
                "persistent_workers",
                "batch_size",
            )
            self._event("dataloader_seen", **dict(zip(keys, config, strict=True)))

    # -- phases (timed by the hub's clock) -----------------------------------------------------
    def on_backward_begin(self, loss: Any) -> None:
        if self._counter is not None:
            self._counter.mark((loss,))

    def _note_device(self) -> None:
        """The training device is known (first model or optimizer), or changed (a root
        model's replaced an optimizer's): on CUDA the allocator's peak is read at every
        step's end; the GPU sampler starts (again, for the new device)."""
        device = self.probe.device
        if device is None or device == self._noted_device:
            return
        changed = self._noted_device is not None
        self._noted_device = device
        self.probe.hub.dispatch.mute(self, "on_step_end", muted=device.type != "cuda")
        if changed and self._sampler is not None:  # started for the optimizer's device
            self._sampler.stop(timeout=0.0)  # not waited for: this may be the user's forward
            self._sampler, self._sampler_started = None, False
        self._maybe_start_sampler()

    # -- syncs: the hub's op mode on sampled steps ---------------------------------------------
    def on_step_begin(self, step: int) -> None:
        self._counter = None
        if self._noted_device is None:  # (a device noted after the objects were seen)
            self._note_device()
        device = self.probe.device
        # steps 1, 1 + N, ... (every step when N = 1), spaced by the budget by default
        if device is not None and self.probe.budget.due("syncs", step):
            self._counter = SyncCounter(device.type)
            self._counters.append((step, self._counter))  # its counts are read at the fold
            if device.type == "cpu":
                self._counter.mark(self._model_tensors())

    def _model_tensors(self) -> Iterator[torch.Tensor]:
        """Parameters, buffers and gradients of the known models and optimizers, and the
        GradScalers' scale and growth tracker (``scaler.get_scale()`` syncs on a GPU)."""
        for scaler in list(self._scalers):
            for name in ("_scale", "_growth_tracker"):
                value = getattr(scaler, name, None)
                if isinstance(value, torch.Tensor):
                    yield value
        params: list[torch.Tensor] = []
        for model in list(self._models):
            params.extend(model.parameters())
            yield from model.buffers()
        for opt in list(self._optimizers):
            for group in opt.param_groups:
                params.extend(group["params"])
        for p in params:
            yield p
            if p.grad is not None:
                yield p.grad

    def wants_ops(self, step: int) -> bool:
        return self._counter is not None

    def on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self._counter is not None:
            self._counter.observe(func, args, kwargs, out)

    def on_recording(self, active: bool) -> None:
        self._counter = None

    # -- step boundary ------------------------------------------------------------------------
    def on_step_end(self, step: int, record: dict[str, Any], facts: StepFacts) -> None:
        """CUDA only (muted elsewhere): the allocator's peak, which a later read would lose."""
        record["peak_mem_bytes"] = self._peak_memory()

    def on_step_fold(self, step: int, record: dict[str, Any], facts: StepFacts) -> None:
        record["data_wait_s"] = facts.data_wait_s
        record["batches"] = facts.batches
        phase_s = facts.phase_s
        if phase_s is not None:
            record["fwd_s"] = phase_s["fwd"]
            record["bwd_s"] = phase_s["bwd"]
            record["opt_s"] = phase_s["opt"]
        for phase, start, end in facts.cuda_phases:
            self._cuda_events.append((step, phase, start, end))
        if facts.rss_bytes is not None:
            self._rss_value = facts.rss_bytes
        record["rss_bytes"] = self._rss_value  # steps between two readings repeat the last
        counters = self._counters
        while counters and counters[0][0] < step:
            counters.popleft()  # (a step that did not end: recording stopped inside it)
        if counters and counters[0][0] == step:
            counter = counters.popleft()[1]
            counts = counter.take()
            record["syncs_sampled"] = True
            record["syncs"] = sum(n for (_, _, kind), n in counts.items() if kind == "user")
            self._sync_rows.extend(
                {
                    "step": step,
                    "site": site,
                    "op": op,
                    "kind": kind,
                    "count": n,
                    "device": counter.device_type,
                }
                for (site, op, kind), n in counts.items()
            )
        if self._noted_device is None:
            self._note_device()
        if not self._sampler_started:
            self._maybe_start_sampler()

    def _peak_memory(self) -> int:
        device = self.probe.device
        peak = int(torch.cuda.max_memory_allocated(device))
        if self.probe.config.reset_peak_memory:
            torch.cuda.reset_peak_memory_stats(device)
        return peak

    # -- GPU sampler --------------------------------------------------------------------------
    def _maybe_start_sampler(self, force: bool = False) -> None:
        cfg = self.probe.config
        if self._sampler_started or cfg.gpu_sample_hz <= 0:
            return
        device = self.probe.device
        if device is None and not force:
            return  # wait until the training device is known
        indices: list[int] = []
        uuids: list[str | None] = []
        if device is not None and device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            uuid = None
            with contextlib.suppress(Exception):
                raw = getattr(torch.cuda.get_device_properties(index), "uuid", None)
                uuid = str(raw) if raw is not None else None
            indices, uuids = [index], [uuid]
        t0 = self.probe.start_time
        self._sampler = GpuSampler(
            indices,
            uuids,
            hz=cfg.gpu_sample_hz,
            clock=lambda: time.perf_counter() - t0,
            step=lambda: self.probe.step,
            max_rows=cfg.max_buffered_rows,
            gpm=cfg.gpu_gpm,
        )
        self._sampler_started = True
        self._sampler.start()

    # -- flush --------------------------------------------------------------------------------
    def on_flush(self, writer: Any) -> None:
        if self.probe.closed:
            self._maybe_start_sampler(force=True)
            if self._sampler is not None:
                self._sampler.stop(timeout=5.0)
        if self._sync_rows:
            rows, self._sync_rows = self._sync_rows, []
            writer.append("syncs", rows)
        if self._cuda_events:
            writer.append("cuda_phases", self._read_cuda_events())
        if self._sampler is not None:
            rows, notes = self._sampler.drain()
            for note in notes:
                self.probe.event("gpu_sampler", **note)
            if rows:
                writer.append("gpu", rows)
            if self.probe.closed and self._sampler.dropped:
                self.probe.event("gpu_samples_dropped", rows=self._sampler.dropped)

    def _read_cuda_events(self) -> list[dict[str, Any]]:
        """Device time of each phase. Waits for the last event (the flush syncs anyway)."""
        events, self._cuda_events = self._cuda_events, []
        last = events[-1][3]
        if not last.query():
            last.synchronize()
        per_step: dict[int, dict[str, Any]] = {}
        for step, phase, start, end in events:
            row = per_step.setdefault(step, {"step": step})
            row[f"{phase}_s"] = row.get(f"{phase}_s", 0.0) + start.elapsed_time(end) / 1e3
        return list(per_step.values())
