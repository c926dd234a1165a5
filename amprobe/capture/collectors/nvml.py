"""GPU sampler: a background thread reading NVML (``pynvml`` from nvidia-ml-py).

:class:`GpuSampler` polls the GPU(s) the training process uses at a fixed rate, one batch of
NVML queries per sample, and keeps the rows in a bounded buffer that the runtime collector
drains at flush. NVML calls are driver queries, not stream operations: they never wait for
the training stream and cost the training thread nothing.

Per sample and GPU (``gpu`` table): ``gpu_util`` and ``mem_util`` (%, NVML's utilization
rates over its last sample period), ``mem_used_bytes``, ``mem_total_bytes``, ``power_w``,
``sm_clock_mhz``, ``temp_c``, ``clock_event_reasons`` (NVML bit mask) and ``throttle`` (its
decoded names), and on GPUs with GPM (Hopper or newer) ``sm_util``, ``sm_occupancy``,
``tensor_any``, ``tensor_hmma``, ``tensor_imma``, ``tensor_dfma`` (%, averaged between two
consecutive samples).

Nothing is invented: a metric the GPU does not support stays null and is reported once; without
a driver the sampler reports "not available: <reason>" once and records no rows.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GpuSampler", "THROTTLE_REASONS", "decode_throttle", "GPM_METRICS"]

#: NVML clock-event (throttle) reason mask attribute -> short name.
THROTTLE_REASONS: dict[str, str] = {
    "GpuIdle": "gpu_idle",
    "ApplicationsClocksSetting": "app_clocks",
    "SwPowerCap": "sw_power_cap",
    "HwSlowdown": "hw_slowdown",
    "SyncBoost": "sync_boost",
    "SwThermalSlowdown": "sw_thermal",
    "HwThermalSlowdown": "hw_thermal",
    "HwPowerBrakeSlowdown": "hw_power_brake",
    "DisplayClockSetting": "display_clocks",
}

#: column -> pynvml GPM metric constant name.
GPM_METRICS: dict[str, str] = {
    "sm_util": "NVML_GPM_METRIC_SM_UTIL",
    "sm_occupancy": "NVML_GPM_METRIC_SM_OCCUPANCY",
    "tensor_any": "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
    "tensor_hmma": "NVML_GPM_METRIC_HMMA_TENSOR_UTIL",
    "tensor_imma": "NVML_GPM_METRIC_IMMA_TENSOR_UTIL",
    "tensor_dfma": "NVML_GPM_METRIC_DFMA_TENSOR_UTIL",
}


def decode_throttle(mask: int | None) -> str | None:
    """Names of the clock-event reasons set in ``mask``, comma-separated ("" when none)."""
    if mask is None:
        return None
    import pynvml

    names = []
    for attr, name in THROTTLE_REASONS.items():
        bit = getattr(pynvml, f"nvmlClocksEventReason{attr}", None)
        if bit is None:
            bit = getattr(pynvml, f"nvmlClocksThrottleReason{attr}", None)
        if bit is not None and mask & bit:
            names.append(name)
    return ",".join(names)


class _Stop(Exception):
    """Sampling cannot go on (GPU lost, NVML gone); the message says why."""


@dataclass
class _Gpu:
    index: int  # the torch (visible) device index
    handle: Any
    uuid: str | None
    name: str | None
    mapping: str
    disabled: dict[str, str] = field(default_factory=dict)
    errors: set[str] = field(default_factory=set)
    gpm_samples: list[Any] = field(default_factory=list)
    gpm_ids: dict[str, int] = field(default_factory=dict)
    gpm_primed: bool = False


class GpuSampler:
    """Samples NVML metrics in a daemon thread.

    Args:
        device_indices: torch CUDA device indices the process trains on (empty on a CPU run:
            the sampler then only reports whether a driver exists).
        device_uuids: the matching CUDA UUIDs (from ``torch.cuda.get_device_properties``),
            ``None`` entries where unknown; used to find the NVML handle exactly.
        hz: samples per second.
        clock: returns the time stamp to record (the probe's clock).
        step: returns the training step in progress.
        max_rows: rows kept until drained; older rows are dropped and counted.
        gpm: also read GPM metrics where the GPU supports them.
    """

    def __init__(
        self,
        device_indices: list[int],
        device_uuids: list[str | None],
        hz: float,
        clock: Callable[[], float],
        step: Callable[[], int],
        max_rows: int = 100_000,
        gpm: bool = True,
    ) -> None:
        self.device_indices = list(device_indices)
        self.device_uuids = list(device_uuids)
        self.period = 1.0 / hz
        self.clock = clock
        self.step = step
        self.gpm = gpm
        self.rows: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_rows)
        self.dropped = 0
        self.samples = 0
        self._notes: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- main-thread API --------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="amprobe-nvml", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the thread to finish and wait for it (it never blocks on the training stream)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def drain(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Rows sampled and status notes since the last call."""
        with self._lock:
            rows = list(self.rows)
            self.rows.clear()
            notes, self._notes = self._notes, []
        return rows, notes

    # -- thread -----------------------------------------------------------------------------
    def _note(self, **detail: Any) -> None:
        with self._lock:
            self._notes.append(detail)

    def _run(self) -> None:
        try:
            import pynvml
        except Exception as exc:  # nvidia-ml-py not installed
            self._note(status="not available", reason=f"pynvml cannot be imported: {exc}")
            return
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            self._note(status="not available", reason=_init_reason(pynvml, exc))
            return
        gpus: list[_Gpu] = []
        try:
            if not self.device_indices:
                self._note(status="not sampled", reason="the job does not train on a CUDA device")
                return
            gpus = self._resolve(pynvml)
            self._note(
                status="sampling",
                hz=1.0 / self.period,
                gpus=[
                    {"index": g.index, "uuid": g.uuid, "name": g.name, "mapping": g.mapping}
                    for g in gpus
                ],
            )
            if self.gpm:
                for gpu in gpus:
                    self._setup_gpm(pynvml, gpu)
            next_t = time.perf_counter()
            while not self._stop.is_set():
                self._sample(pynvml, gpus)
                next_t += self.period
                delay = next_t - time.perf_counter()
                if delay < 0:  # fell behind (slow NVML): skip the missed ticks
                    next_t = time.perf_counter()
                    delay = 0.0
                if self._stop.wait(delay):
                    break
        except _Stop as exc:
            self._note(status="stopped", reason=str(exc))
        except Exception as exc:
            self._note(status="stopped", reason=_error_text(pynvml, exc))
        finally:
            for gpu in gpus:
                for sample in gpu.gpm_samples:
                    try:
                        pynvml.nvmlGpmSampleFree(sample)
                    except Exception:
                        pass
            try:
                pynvml.nvmlShutdown()
            except Exception:
                pass

    def _resolve(self, pynvml: Any) -> list[_Gpu]:
        """Map the torch device indices to NVML handles, by UUID where possible."""
        visible = [
            v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()
        ]
        gpus = []
        for pos, index in enumerate(self.device_indices):
            uuid = self.device_uuids[pos] if pos < len(self.device_uuids) else None
            handle, mapping = None, ""
            if uuid:
                if not uuid.startswith(("GPU-", "MIG-")):
                    uuid = f"GPU-{uuid}"
                try:
                    handle, mapping = pynvml.nvmlDeviceGetHandleByUUID(uuid), "uuid"
                except pynvml.NVMLError:
                    handle = None
            if handle is None and os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
                if index >= len(visible):
                    raise _Stop(f"CUDA device {index} is not in CUDA_VISIBLE_DEVICES={visible}")
                entry = visible[index]
                if entry.isdigit():
                    handle = pynvml.nvmlDeviceGetHandleByIndex(int(entry))
                    mapping = "CUDA_VISIBLE_DEVICES index (assumes PCI bus order)"
                else:
                    handle = pynvml.nvmlDeviceGetHandleByUUID(entry)
                    mapping = "CUDA_VISIBLE_DEVICES uuid"
            if handle is None:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                mapping = "index (assumes PCI bus order)"
            name = uuid_real = None
            try:
                name = _text(pynvml.nvmlDeviceGetName(handle))
                uuid_real = _text(pynvml.nvmlDeviceGetUUID(handle))
            except pynvml.NVMLError:
                pass
            gpus.append(
                _Gpu(index=index, handle=handle, uuid=uuid_real or uuid, name=name, mapping=mapping)
            )
        return gpus

    def _setup_gpm(self, pynvml: Any, gpu: _Gpu) -> None:
        try:
            support = pynvml.nvmlGpmQueryDeviceSupport(gpu.handle)
            if not getattr(support, "isSupportedDevice", 0):
                self._note(
                    status="gpm not available",
                    gpu=gpu.index,
                    reason="GPM is not supported on this GPU (needs Hopper or newer)",
                )
                return
            gpu.gpm_samples = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
            for column, const in GPM_METRICS.items():
                value = getattr(pynvml, const, None)
                if value is not None:
                    gpu.gpm_ids[column] = int(value)
        except pynvml.NVMLError as exc:
            self._note(status="gpm not available", gpu=gpu.index, reason=_error_text(pynvml, exc))
            gpu.gpm_ids = {}

    def _call(self, pynvml: Any, gpu: _Gpu, metric: str, fn: Callable[..., Any], *args: Any) -> Any:
        if metric in gpu.disabled:
            return None
        try:
            return fn(*args)
        except (
            pynvml.NVMLError_GpuIsLost,
            pynvml.NVMLError_Uninitialized,
            pynvml.NVMLError_DriverNotLoaded,
            pynvml.NVMLError_LibraryNotFound,
        ) as exc:
            raise _Stop(f"GPU {gpu.index}: {_error_text(pynvml, exc)}") from None
        except (
            pynvml.NVMLError_NotSupported,
            pynvml.NVMLError_NoPermission,
            pynvml.NVMLError_FunctionNotFound,
        ) as exc:
            gpu.disabled[metric] = _error_text(pynvml, exc)
            self._note(
                status="metric not available",
                gpu=gpu.index,
                metric=metric,
                reason=gpu.disabled[metric],
            )
            return None
        except pynvml.NVMLError as exc:
            if metric not in gpu.errors:
                gpu.errors.add(metric)
                self._note(
                    status="metric error",
                    gpu=gpu.index,
                    metric=metric,
                    reason=_error_text(pynvml, exc),
                )
            return None

    def _sample(self, pynvml: Any, gpus: list[_Gpu]) -> None:
        t = self.clock()
        step = self.step()
        out = []
        for gpu in gpus:
            h = gpu.handle
            util = self._call(pynvml, gpu, "utilization", pynvml.nvmlDeviceGetUtilizationRates, h)
            mem = self._call(pynvml, gpu, "memory", pynvml.nvmlDeviceGetMemoryInfo, h)
            power = self._call(pynvml, gpu, "power", pynvml.nvmlDeviceGetPowerUsage, h)
            clock = self._call(
                pynvml, gpu, "sm_clock", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM
            )
            temp = self._call(
                pynvml,
                gpu,
                "temperature",
                pynvml.nvmlDeviceGetTemperature,
                h,
                pynvml.NVML_TEMPERATURE_GPU,
            )
            reasons_fn = (
                getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
            )
            reasons = self._call(pynvml, gpu, "clock_event_reasons", reasons_fn, h)
            row: dict[str, Any] = {
                "t": t,
                "step": step,
                "gpu": gpu.index,
                "gpu_util": _num(getattr(util, "gpu", None)),
                "mem_util": _num(getattr(util, "memory", None)),
                "mem_used_bytes": _num(getattr(mem, "used", None)),
                "mem_total_bytes": _num(getattr(mem, "total", None)),
                "power_w": power / 1000.0 if isinstance(power, (int, float)) else None,
                "sm_clock_mhz": _num(clock),
                "temp_c": _num(temp),
                "clock_event_reasons": int(reasons) if isinstance(reasons, int) else None,
                "throttle": decode_throttle(reasons) if isinstance(reasons, int) else None,
            }
            row.update(self._gpm(pynvml, gpu))
            out.append(row)
        with self._lock:
            free = self.rows.maxlen - len(self.rows) if self.rows.maxlen is not None else len(out)
            self.dropped += max(0, len(out) - free)
            self.rows.extend(out)
            self.samples += 1

    def _gpm(self, pynvml: Any, gpu: _Gpu) -> dict[str, Any]:
        if not gpu.gpm_ids or not gpu.gpm_samples or "gpm" in gpu.disabled:
            return {}
        prev, cur = gpu.gpm_samples
        if self._call(pynvml, gpu, "gpm", pynvml.nvmlGpmSampleGet, gpu.handle, cur) is None:
            gpu.gpm_primed = False  # no valid interval start any more
            return {}
        gpu.gpm_samples = [cur, prev]  # the newest sample is the next interval's start
        if not gpu.gpm_primed:
            gpu.gpm_primed = True
            return {}
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(gpu.gpm_ids)
        request.sample1 = prev
        request.sample2 = cur
        columns = list(gpu.gpm_ids)
        for i, column in enumerate(columns):
            request.metrics[i].metricId = gpu.gpm_ids[column]
        result = self._call(pynvml, gpu, "gpm", pynvml.nvmlGpmMetricsGet, request)
        if result is None:
            return {}
        values: dict[str, Any] = {}
        for i, column in enumerate(columns):
            metric = result.metrics[i]
            values[column] = float(metric.value) if int(metric.nvmlReturn) == 0 else None
        return values


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _error_text(pynvml: Any, exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _init_reason(pynvml: Any, exc: BaseException) -> str:
    if isinstance(exc, pynvml.NVMLError_LibraryNotFound):
        return "no NVIDIA driver (NVML library not found)"
    if isinstance(exc, pynvml.NVMLError_DriverNotLoaded):
        return "no NVIDIA driver (driver not loaded)"
    if isinstance(exc, pynvml.NVMLError_NoPermission):
        return "no permission to query NVML"
    return f"NVML could not be initialized: {_error_text(pynvml, exc)}"
