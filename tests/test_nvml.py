"""The NVML sampler against pynvml's real functions faked at the narrowest seam."""

from __future__ import annotations

import time

import pynvml
import pytest

import amprobe
from amprobe.capture.collectors.nvml import GpuSampler, decode_throttle
from tests.helpers import TinyNet, train_loop


class FakeNvml:
    """Replaces the pynvml functions the sampler calls; ``fail`` maps a name to an exception
    (or a callable taking the call count and returning one, or None to succeed)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpm: bool = True, fail: dict | None = None):
        self.calls: dict[str, int] = {}
        self.args: dict[str, list] = {}
        self.fail = fail or {}
        self.gpm = gpm
        values = {
            "nvmlInit": None,
            "nvmlShutdown": None,
            "nvmlDeviceGetHandleByIndex": "handle",
            "nvmlDeviceGetHandleByUUID": "handle",
            "nvmlDeviceGetName": b"NVIDIA H100 80GB HBM3",
            "nvmlDeviceGetUUID": "GPU-1234",
            "nvmlDeviceGetUtilizationRates": pynvml.c_nvmlUtilization_t(gpu=37, memory=12),
            "nvmlDeviceGetMemoryInfo": pynvml.c_nvmlMemory_t(
                total=80 << 30, free=60 << 30, used=20 << 30
            ),
            "nvmlDeviceGetPowerUsage": 350_000,
            "nvmlDeviceGetClockInfo": 1980,
            "nvmlDeviceGetTemperature": 61,
            "nvmlDeviceGetCurrentClocksEventReasons": pynvml.nvmlClocksEventReasonSwPowerCap
            | pynvml.nvmlClocksEventReasonHwThermalSlowdown,
            "nvmlGpmQueryDeviceSupport": pynvml.c_nvmlGpmSupport_t(
                isSupportedDevice=1 if gpm else 0
            ),
            "nvmlGpmSampleAlloc": None,
            "nvmlGpmSampleGet": None,
            "nvmlGpmSampleFree": None,
        }
        for name, value in values.items():
            monkeypatch.setattr(pynvml, name, self._make(name, value))
        monkeypatch.setattr(
            pynvml, "nvmlGpmMetricsGet", self._make("nvmlGpmMetricsGet", None, self._metrics)
        )

    def _make(self, name, value, compute=None):
        def fn(*args):
            n = self.calls.get(name, 0) + 1
            self.calls[name] = n
            self.args.setdefault(name, []).append(args)
            err = self.fail.get(name)
            if callable(err) and not isinstance(err, Exception):
                err = err(n)
            if err is not None:
                raise err
            if compute is not None:
                return compute(*args)
            if name in ("nvmlGpmSampleAlloc",):
                return pynvml.c_nvmlGpmSample_t()
            if name == "nvmlGpmSampleGet":
                return args[1]
            return value

        return fn

    @staticmethod
    def _metrics(request):
        fake = {
            pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 42.5,
            pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL: 40.0,
            pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 55.0,
        }
        for i in range(request.numMetrics):
            metric = request.metrics[i]
            if metric.metricId in fake:
                metric.value = fake[metric.metricId]
                metric.nvmlReturn = 0
            else:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return request


def run_sampler(indices=(0,), uuids=(None,), seconds=0.08, hz=200.0, gpm=True):
    sampler = GpuSampler(
        list(indices), list(uuids), hz=hz, clock=time.perf_counter, step=lambda: 3, gpm=gpm
    )
    sampler.start()
    time.sleep(seconds)
    sampler.stop()
    assert not sampler.running
    return sampler.drain()


def statuses(notes):
    return [n["status"] for n in notes]


def test_sampler_records_every_metric(monkeypatch):
    fake = FakeNvml(monkeypatch)
    rows, notes = run_sampler()
    assert len(rows) >= 3
    row = rows[-1]
    assert row["gpu"] == 0 and row["step"] == 3
    assert (row["gpu_util"], row["mem_util"]) == (37.0, 12.0)
    assert row["mem_used_bytes"] == float(20 << 30)
    assert row["power_w"] == 350.0 and row["sm_clock_mhz"] == 1980.0 and row["temp_c"] == 61.0
    assert row["throttle"] == "sw_power_cap,hw_thermal"
    assert row["tensor_any"] == 42.5 and row["tensor_hmma"] == 40.0 and row["sm_occupancy"] == 55.0
    assert row["tensor_imma"] is None, "a metric NVML did not return stays null"
    assert "tensor_any" not in rows[0], "the first GPM sample only opens the interval"
    assert (
        notes[0]["status"] == "sampling" and notes[0]["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    )
    assert fake.calls["nvmlShutdown"] == 1 and fake.calls["nvmlGpmSampleFree"] == 2
    # one batch of NVML calls per sample
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == fake.calls["nvmlDeviceGetPowerUsage"]


@pytest.mark.parametrize(
    "error, reason",
    [
        (pynvml.NVMLError_LibraryNotFound, "no NVIDIA driver (NVML library not found)"),
        (pynvml.NVMLError_DriverNotLoaded, "no NVIDIA driver (driver not loaded)"),
        (pynvml.NVMLError_NoPermission, "no permission to query NVML"),
        (pynvml.NVMLError_Unknown, "NVML could not be initialized: NVMLError_Unknown"),
    ],
)
def test_init_errors_report_not_available_once(monkeypatch, error, reason):
    FakeNvml(monkeypatch, fail={"nvmlInit": error()})
    rows, notes = run_sampler(seconds=0.02)
    assert rows == []
    assert len(notes) == 1 and notes[0]["status"] == "not available"
    assert notes[0]["reason"].startswith(reason)


def test_real_library_without_driver_degrades():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:  # pragma: no cover - a machine with a driver
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present")
    rows, notes = run_sampler(seconds=0.02)
    assert rows == [] and notes == [
        {"status": "not available", "reason": "no NVIDIA driver (NVML library not found)"}
    ]


def test_unsupported_metric_stays_null_and_is_reported_once(monkeypatch):
    FakeNvml(
        monkeypatch,
        fail={"nvmlDeviceGetPowerUsage": pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)},
    )
    rows, notes = run_sampler()
    assert len(rows) >= 3 and all(r["power_w"] is None for r in rows)
    assert all(r["gpu_util"] == 37.0 for r in rows)
    unavailable = [n for n in notes if n["status"] == "metric not available"]
    assert len(unavailable) == 1 and unavailable[0]["metric"] == "power"
    assert "NotSupported" in unavailable[0]["reason"]


def test_gpu_lost_stops_sampling_cleanly(monkeypatch):
    lost = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    assert isinstance(lost, pynvml.NVMLError_GpuIsLost)
    fake = FakeNvml(
        monkeypatch, fail={"nvmlDeviceGetUtilizationRates": lambda n: lost if n >= 3 else None}
    )
    rows, notes = run_sampler(seconds=0.1)
    assert len(rows) == 2
    assert notes[-1]["status"] == "stopped" and "GpuIsLost" in notes[-1]["reason"]
    assert fake.calls["nvmlShutdown"] == 1


def test_transient_error_gives_null_and_one_note(monkeypatch):
    FakeNvml(
        monkeypatch,
        fail={"nvmlDeviceGetTemperature": lambda n: pynvml.NVMLError_Unknown() if n == 2 else None},
    )
    rows, notes = run_sampler()
    assert rows[1]["temp_c"] is None and rows[0]["temp_c"] == 61.0 and rows[2]["temp_c"] == 61.0
    assert [n["metric"] for n in notes if n["status"] == "metric error"] == ["temperature"]


def test_gpm_unsupported_gpu(monkeypatch):
    fake = FakeNvml(monkeypatch, gpm=False)
    rows, notes = run_sampler()
    assert rows and all("tensor_any" not in r for r in rows)
    assert "gpm not available" in statuses(notes)
    assert "nvmlGpmSampleAlloc" not in fake.calls


def test_device_mapping_by_uuid_then_visible_devices(monkeypatch):
    fake = FakeNvml(monkeypatch)
    run_sampler(uuids=("abcd-ef",), seconds=0.01)
    assert fake.args["nvmlDeviceGetHandleByUUID"][0] == ("GPU-abcd-ef",)
    fake = FakeNvml(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,3")
    run_sampler(indices=(1,), seconds=0.01)
    assert fake.args["nvmlDeviceGetHandleByIndex"] == [(3,)]
    fake = FakeNvml(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ffff")
    run_sampler(indices=(0,), seconds=0.01)
    assert fake.args["nvmlDeviceGetHandleByUUID"] == [("GPU-ffff",)]


def test_cpu_job_is_not_sampled(monkeypatch):
    fake = FakeNvml(monkeypatch)
    rows, notes = run_sampler(indices=(), uuids=(), seconds=0.01)
    assert rows == [] and notes[0]["status"] == "not sampled"
    assert "nvmlDeviceGetUtilizationRates" not in fake.calls and fake.calls["nvmlShutdown"] == 1


def test_decode_throttle():
    assert decode_throttle(0) == ""
    assert decode_throttle(None) is None
    assert decode_throttle(pynvml.nvmlClocksEventReasonGpuIdle) == "gpu_idle"


def test_collector_records_sampler_status_in_the_run(tmp_path, monkeypatch):
    FakeNvml(monkeypatch, fail={"nvmlInit": pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)})
    model = TinyNet()
    opt = __import__("torch").optim.SGD(model.parameters(), lr=0.01)
    with amprobe.attach(model, opt, run_dir=tmp_path, config={"collectors": ("scaler", "runtime")}):
        train_loop(model, opt, None, steps=2, dtype=None)
    run = amprobe.load_run(tmp_path)
    notes = run.events_of("gpu_sampler")
    assert [(n["status"], n["reason"]) for n in notes] == [
        ("not available", "no NVIDIA driver (NVML library not found)")
    ]
    assert run.table("gpu").empty
    not_checked = {n.id: n.reason for n in amprobe.diagnose(run).not_checked}
    assert not_checked["AMP-S07"] == "no NVIDIA driver (NVML library not found)"


def test_sampler_off(tmp_path):
    model = TinyNet()
    opt = __import__("torch").optim.SGD(model.parameters(), lr=0.01)
    with amprobe.attach(
        model, opt, run_dir=tmp_path, config={"collectors": ("runtime",), "gpu_sample_hz": 0}
    ):
        train_loop(model, opt, None, steps=2, dtype=None)
    assert amprobe.load_run(tmp_path).events_of("gpu_sampler") == []
