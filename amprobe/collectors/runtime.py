"""Runtime profile: where a step's time goes, host-device syncs, memory and GPU activity.

The :class:`RuntimeCollector` answers "why is AMP not faster" from inside the training process
without adding a host-device sync on the hot path.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.data import dataloader as _dataloader

from amprobe.collectors.base import Collector
from amprobe.collectors.nvml import GpuSampler
from amprobe.collectors.patching import Patch, patch
from amprobe.collectors.syncs import SyncCounter

__all__ = ["RuntimeCollector", "PHASES", "read_rss_bytes"]

#: step phases timed by the collector, in order.
PHASES = ("fwd", "bwd", "opt")
_MAX_EVENTS_PER_KIND = 20
_STATM = "/proc/self/statm"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_rss_bytes() -> int | None:
    """Resident set size of this process in bytes (Linux ``/proc``), or None elsewhere."""
    try:
        with open(_STATM, "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class RuntimeCollector(Collector):
    """Records step-time breakdown, data-loader stalls, host-device syncs, memory and GPU samples.

    Per step (``steps`` table), host clock, probe's own time excluded:

    - ``data_wait_s``: seconds spent inside ``DataLoader`` iterators' ``__next__`` (waiting for
      the next batch); ``batches``: batches fetched during the step.
    - ``fwd_s``, ``bwd_s``, ``opt_s``: seconds inside the root models' forward, inside
      ``torch.autograd.backward`` and inside ``optimizer.step`` (host time: on CUDA this is the
      time to launch the work; the device time is in the ``cuda_phases`` table).
    - ``peak_mem_bytes``: CUDA only, ``torch.cuda.max_memory_allocated`` over the step (the
      allocator's host-side counter, no sync); the peak is reset at every step unless
      ``Config.reset_peak_memory`` is False (then it is the peak since the start).
    - ``rss_bytes``: the process's resident set size at the end of the step (Linux).
    - ``syncs`` and ``syncs_sampled``: on sampled steps (``Config.syncs_every``), the number of
      synchronizing ops issued by user code (see :mod:`amprobe.collectors.syncs`); null on
      other steps. Sampled steps run under a dispatch mode, so their ``wall_s`` is inflated.

    Tables: ``syncs`` (step, site ``file:line``, op, kind user/scaler/optimizer, count, device),
    ``cuda_phases`` (step, ``fwd_s``/``bwd_s``/``opt_s`` measured with CUDA events on the
    current stream, read back at flush), ``gpu`` (NVML samples, see
    :mod:`amprobe.collectors.nvml`).

    Events: ``dataloader_seen`` (num_workers, prefetch_factor, pin_memory, persistent_workers,
    batch_size), ``gpu_sampler`` (status: sampling / not available / stopped, and why),
    ``sync_counting_stopped``.

    Cost: two ``perf_counter`` calls per batch and per phase, one ``/proc`` read per step;
    on CUDA two events per phase and a host-side allocator query. The NVML sampler runs in its
    own thread. The sync-counting dispatch mode costs about 10 % on sampled steps only.
    """

    name = "runtime"

    def on_attach(self, probe: Any) -> None:
        super().on_attach(probe)
        cfg = probe.config
        self._syncs_every: int = cfg.syncs_every
        self._originals: list[Patch] = []
        self._handles: list[Any] = []
        self._wait = 0.0
        self._batches = 0
        self._acc: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._depth: dict[str, int] = dict.fromkeys(PHASES, 0)
        self._t_open: dict[str, float] = {}
        self._ev_open: dict[str, Any] = {}
        self._cuda_events: list[tuple[int, str, Any, Any]] = []
        self._sync_rows: list[dict[str, Any]] = []
        self._counter: SyncCounter | None = None
        self._sync_disabled = False
        self._sampler: GpuSampler | None = None
        self._sampler_started = False
        self._event_counts: dict[str, int] = defaultdict(int)
        self._loader_configs: set[tuple[Any, ...]] = set()
        self._install()
        self._maybe_start_sampler()
        self._maybe_start_syncs(probe.step)

    # -- installation -------------------------------------------------------------------------
    def _live(self) -> bool:
        probe = self.probe
        return not probe.closed and probe.recording and probe.is_enabled(self.name)

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        if not self._live():
            return
        try:
            fn(*args)
        except Exception as exc:
            self.probe.collector_failed(self.name, exc)

    def _patch(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        self._originals.append(patch(owner, attr, make))

    def _install(self) -> None:
        c = self
        probe = self.probe

        def wrap_next(orig: Any) -> Any:
            def __next__(self_it: Any) -> Any:
                if not c._live():
                    return orig(self_it)
                c._guard(c._before_batch, self_it)
                t0 = time.perf_counter()
                p0 = probe.probe_time
                try:
                    return orig(self_it)
                finally:
                    spent = time.perf_counter() - t0 - max(0.0, probe.probe_time - p0)
                    c._guard(c._after_batch, spent)

            return __next__

        def wrap_backward(orig: Any) -> Any:
            def backward(*args: Any, **kwargs: Any) -> Any:
                c._guard(c._begin, "bwd")
                try:
                    return orig(*args, **kwargs)
                finally:
                    c._guard(c._end, "bwd")

            return backward

        self._patch(_dataloader._BaseDataLoaderIter, "__next__", wrap_next)
        self._patch(torch.autograd, "backward", wrap_backward)
        self._handles.append(
            register_optimizer_step_pre_hook(lambda opt, args, kwargs: c._guard(c._begin, "opt"))
        )
        self._handles.append(
            register_optimizer_step_post_hook(lambda opt, args, kwargs: c._guard(c._end, "opt"))
        )

    def on_model(self, model: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            return
        self._handles.append(
            model.register_forward_pre_hook(lambda mod, args: self._guard(self._begin, "fwd"))
        )
        self._handles.append(
            model.register_forward_hook(
                lambda mod, args, out: self._guard(self._end, "fwd"), always_call=True
            )
        )

    def on_close(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
        self._stop_syncs()
        for handle in self._handles:
            with contextlib.suppress(Exception):
                handle.remove()
        self._handles.clear()
        for handle in reversed(self._originals):
            handle.remove()
        self._originals.clear()

    def _event(self, kind: str, **detail: Any) -> None:
        self._event_counts[kind] += 1
        if self._event_counts[kind] <= _MAX_EVENTS_PER_KIND:
            self.probe.event(kind, **detail)

    # -- data loader --------------------------------------------------------------------------
    def _before_batch(self, it: Any) -> None:
        self.probe.touch()
        if getattr(it, "_amprobe_seen", False):
            return
        with contextlib.suppress(Exception):
            it._amprobe_seen = True
        config = (
            getattr(it, "_num_workers", None),
            getattr(it, "_prefetch_factor", None),
            getattr(it, "_pin_memory", None),
            getattr(it, "_persistent_workers", None),
            getattr(getattr(it, "_index_sampler", None), "batch_size", None),
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

    def _after_batch(self, spent: float) -> None:
        self._wait += spent
        self._batches += 1

    # -- phases -------------------------------------------------------------------------------
    def _is_cuda(self) -> bool:
        device = self.probe.device
        return device is not None and device.type == "cuda"

    def _begin(self, phase: str) -> None:
        depth = self._depth[phase]
        self._depth[phase] = depth + 1
        if depth:
            return
        self.probe.touch()  # the first step starts at its first forward/batch
        self._t_open[phase] = time.perf_counter()
        if self._is_cuda():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._ev_open[phase] = event

    def _end(self, phase: str, now: float | None = None) -> None:
        depth = self._depth[phase] - 1
        if depth < 0:
            return  # already closed at the step boundary
        self._depth[phase] = depth
        if depth:
            return
        now = time.perf_counter() if now is None else now
        self._acc[phase] += now - self._t_open.pop(phase, now)
        start = self._ev_open.pop(phase, None)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._cuda_events.append((self.probe.step, phase, start, end))

    # -- syncs --------------------------------------------------------------------------------
    def _sampled(self, step: int) -> bool:
        every = self._syncs_every
        return every > 0 and step % every == 1 % every

    def _maybe_start_syncs(self, step: int) -> None:
        if self._sync_disabled or self._counter is not None or not self._sampled(step):
            return
        if not self.probe.recording or self.probe.device is None:
            return
        counter = SyncCounter(self.probe.device.type)
        counter.__enter__()
        self._counter = counter

    def _stop_syncs(self) -> Any:
        counter = self._counter
        if counter is None:
            return None
        self._counter = None
        counts = counter.take()
        if _get_current_dispatch_mode() is counter:
            counter.__exit__(None, None, None)
        else:
            # another mode was pushed above ours and is still active: popping would remove it
            counter.active = False
            self._sync_disabled = True
            self._event(
                "sync_counting_stopped",
                reason="another TorchDispatchMode is active above amprobe's",
            )
            return None
        return counts

    # -- step boundary ------------------------------------------------------------------------
    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        now = time.perf_counter()
        for phase in PHASES:  # a phase still open (the optimizer step that ended the step)
            if self._depth[phase]:
                self._depth[phase] = 1
                self._end(phase, now)
        counts = self._stop_syncs()
        if self.probe.recording:
            record["data_wait_s"] = self._wait
            record["batches"] = self._batches
            record["fwd_s"] = self._acc["fwd"]
            record["bwd_s"] = self._acc["bwd"]
            record["opt_s"] = self._acc["opt"]
            record["rss_bytes"] = read_rss_bytes()
            if self._is_cuda():
                record["peak_mem_bytes"] = self._peak_memory()
            if counts is not None:
                device = self.probe.device.type if self.probe.device is not None else "?"
                record["syncs_sampled"] = True
                record["syncs"] = sum(n for (_, _, kind), n in counts.items() if kind == "user")
                self._sync_rows.extend(
                    {
                        "step": step,
                        "site": site,
                        "op": op,
                        "kind": kind,
                        "count": n,
                        "device": device,
                    }
                    for (site, op, kind), n in counts.items()
                )
        self._wait = 0.0
        self._batches = 0
        self._acc = dict.fromkeys(PHASES, 0.0)
        self._maybe_start_sampler()
        self._maybe_start_syncs(step + 1)

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
