"""Prometheus exporter: each rank serves its live AMP metrics over HTTP for fleet monitoring.

Opt-in: set ``prometheus_port`` (config, or ``amprobe run --prometheus-port N``); rank ``r``
with local rank ``l`` serves ``http://<prometheus_host>:<prometheus_port + l>/metrics``, bound
to 127.0.0.1 unless told otherwise. A cluster that already scrapes DCGM exporter metrics sees
AMP health beside them, labelled by job (the run directory's name) and rank.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amprobe.capture.protocol import Collector
from amprobe.config import ConfigError

if TYPE_CHECKING:
    from amprobe.capture.probe import Probe

__all__ = ["PrometheusCollector", "METRICS"]

#: metric name -> (type, help). Counters are exposed with a ``_total`` suffix.
METRICS: dict[str, tuple[str, str]] = {
    "amprobe_loss_scale": ("gauge", "GradScaler loss scale after the last recorded update()"),
    "amprobe_steps": ("counter", "training iterations recorded (skipped ones included)"),
    "amprobe_skipped_steps": (
        "counter",
        "iterations whose optimizer update the GradScaler skipped (inf/NaN)",
    ),
    "amprobe_last_step": ("gauge", "index of the last recorded iteration"),
    "amprobe_step_seconds": (
        "gauge",
        "mean user time per iteration over the last flush window, seconds",
    ),
    "amprobe_data_wait_share": (
        "gauge",
        "share of step time spent waiting for the DataLoader, last flush window (0-1)",
    ),
    "amprobe_syncs_per_step": (
        "gauge",
        "host-device synchronizations issued by user code per sampled step",
    ),
    "amprobe_gpu_utilization_percent": (
        "gauge",
        "GPU utilization of the latest NVML sample, percent",
    ),
    "amprobe_nonfinite": (
        "counter",
        "non-finite (inf + NaN) elements seen per layer and tensor kind (sampled steps)",
    ),
}


def _number(value: Any) -> float | None:
    """A plain Python number, or None; device tensors are never read here (no sync)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


class PrometheusCollector(Collector):
    """Serves this rank's metrics in the Prometheus text format through ``prometheus-client``.

    Records nothing into the run. Exposes, with labels ``job`` (run directory name) and
    ``rank``:

    - ``amprobe_loss_scale`` (gauge): loss scale after the last update().
    - ``amprobe_steps_total``, ``amprobe_skipped_steps_total`` (counters): iterations, skipped ones.
    - ``amprobe_last_step`` (gauge): last recorded iteration index.
    - ``amprobe_step_seconds`` (gauge, s): mean ``wall_s`` over the last flush window.
    - ``amprobe_data_wait_share`` (gauge, 0-1): ``data_wait_s`` / ``wall_s`` over the window,
      when the runtime collector records ``data_wait_s``.
    - ``amprobe_syncs_per_step`` (gauge): mean ``syncs`` of the window's sampled steps, when recorded.
    - ``amprobe_gpu_utilization_percent`` (gauge, %, label ``gpu``): latest ``gpu`` row,
      when the NVML sampler records one.
    - ``amprobe_nonfinite_total`` (counter, labels ``layer``, ``kind``): ``nan + inf`` summed
      over the ``numerics`` rows, when the numerics collector records them.

    Metrics whose data is not recorded are absent, never zero. Step values are taken at flush
    time from the already materialized step records (the hot path only keeps a reference to
    the record), so the exporter adds no host-device sync; the ``gpu`` and ``numerics`` rows
    come in memory at flush (:meth:`on_rows`, after the other collectors wrote them), never
    read back from the run's files. The exporter uses its own ``CollectorRegistry`` and adds no collective
    communication. The server starts at attach (for the automatic probe of ``amprobe run``:
    at the process's first training step, so launcher processes open no port) and stops at close.
    """

    name = "prometheus"

    def on_attach(self, probe: Probe) -> None:
        super().on_attach(probe)
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise ConfigError(
                "prometheus_port is set but prometheus-client is not installed: pip install prometheus-client"
            ) from None
        from prometheus_client import CollectorRegistry

        config = probe.config
        local_rank = int(probe.rank_manifest.get("local_rank") or 0)
        self.host = config.prometheus_host
        self.port = config.prometheus_port + local_rank
        if not config.prometheus_port:
            raise ConfigError(
                "the prometheus collector needs prometheus_port, e.g. config={'prometheus_port': 9400}"
            )
        if self.port > 65535:
            raise ConfigError(
                f"prometheus_port {config.prometheus_port} + local rank {local_rank} exceeds 65535; choose a lower port"
            )
        self.labels = {"job": Path(probe.run_dir).resolve().name, "rank": str(probe.rank)}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_MetricSource(self))
        self._records: list[dict[str, Any]] = []
        self._totals = {"steps": 0.0, "skipped": 0.0}
        self._snapshot: dict[str, float] = {}
        self._lock = threading.Lock()  # on_rows (training thread) vs. a scrape (server thread)
        self._nonfinite: dict[tuple[str, str], float] = {}
        self._gpu_util: dict[str, float] = {}
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._pending_start = probe.lazy
        if not self._pending_start:
            self._start()

    def _start(self) -> None:
        from prometheus_client import start_http_server

        self._pending_start = False
        try:
            self._server, self._thread = start_http_server(
                self.port, addr=self.host, registry=self.registry
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot serve Prometheus metrics on {self.host}:{self.port}: {exc.strerror or exc}; "
                "choose another prometheus_port (rank r uses port + local rank) or 0 to disable"
            ) from None
        self.probe.event("prometheus_serving", host=self.host, port=self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    # -- hot path: keep a reference, read nothing -----------------------------------------------
    def on_step_fold(self, step: int, record: dict[str, Any], facts: Any) -> None:
        if self._pending_start:
            self._start()  # raising here switches only this collector off (dispatcher)
        self._records.append(record)

    # -- flush: the records hold Python numbers now ----------------------------------------------
    def on_flush(self, writer: Any) -> None:
        records, self._records = self._records, []
        if not records:
            return
        snapshot = dict(self._snapshot)
        self._totals["steps"] += len(records)
        self._totals["skipped"] += sum(1 for r in records if r.get("skipped") is True)
        snapshot["amprobe_steps"] = self._totals["steps"]
        last_step = _number(records[-1].get("step"))
        if last_step is not None:
            snapshot["amprobe_last_step"] = last_step
        scales = [
            s
            for s in (_number(r.get("scale_after")) for r in records if r.get("scaler_enabled"))
            if s is not None
        ]
        if scales:
            snapshot["amprobe_loss_scale"] = scales[-1]
            snapshot["amprobe_skipped_steps"] = self._totals["skipped"]
        walls = [_number(r.get("wall_s")) for r in records]
        walls_known = [w for w in walls if w is not None]
        if walls_known:
            snapshot["amprobe_step_seconds"] = sum(walls_known) / len(walls_known)
        waits: list[tuple[float, float]] = []
        for w, r in zip(walls, records, strict=True):
            d = _number(r.get("data_wait_s"))
            if w is not None and d is not None:
                waits.append((w, d))
        if waits and sum(w for w, _ in waits) > 0:
            snapshot["amprobe_data_wait_share"] = sum(d for _, d in waits) / sum(
                w for w, _ in waits
            )
        syncs = [_number(r.get("syncs")) for r in records if r.get("syncs_sampled") is not False]
        syncs_known = [s for s in syncs if s is not None]
        if syncs_known:
            snapshot["amprobe_syncs_per_step"] = sum(syncs_known) / len(syncs_known)
        self._snapshot = snapshot  # replaced whole: the scrape thread sees old or new, never half

    def on_close(self) -> None:
        server, self._server = getattr(self, "_server", None), None
        if server is not None:
            with contextlib.suppress(Exception):
                server.shutdown()
            with contextlib.suppress(Exception):
                server.server_close()
        thread, self._thread = getattr(self, "_thread", None), None
        if thread is not None:
            thread.join(timeout=5)

    def on_rows(self, table: str, rows: list[Mapping[str, Any]]) -> None:
        """Fold the flush's ``numerics`` and ``gpu`` rows (Python values) into the metrics."""
        if table == "numerics":
            with self._lock:
                for row in rows:
                    nan, inf = _number(row.get("nan")), _number(row.get("inf"))
                    if nan is None and inf is None:
                        continue
                    key = (str(row.get("module")), str(row.get("kind")))
                    self._nonfinite[key] = (
                        self._nonfinite.get(key, 0.0) + (nan or 0.0) + (inf or 0.0)
                    )
        elif table == "gpu":
            with self._lock:
                for row in rows:
                    value = _number(row.get("gpu_util"))
                    if value is not None and value == value:  # NaN: no reading
                        self._gpu_util[str(row.get("gpu", 0))] = value

    # -- scrape time (server thread) -------------------------------------------------------------
    def collect_families(self) -> Iterator[Any]:
        """The metric families for one scrape (called by ``prometheus_client``)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            gpu_util, nonfinite = dict(self._gpu_util), dict(self._nonfinite)
        names, values = list(self.labels), list(self.labels.values())
        snapshot: Mapping[str, float] = self._snapshot
        for metric, value in snapshot.items():
            kind, doc = METRICS[metric]
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(metric, doc, labels=names)
            family.add_metric(values, value)
            yield family
        if gpu_util:
            kind, doc = METRICS["amprobe_gpu_utilization_percent"]
            family = GaugeMetricFamily(
                "amprobe_gpu_utilization_percent", doc, labels=[*names, "gpu"]
            )
            for device, value in sorted(gpu_util.items()):
                family.add_metric([*values, device], value)
            yield family
        if nonfinite:
            kind, doc = METRICS["amprobe_nonfinite"]
            counter = CounterMetricFamily(
                "amprobe_nonfinite", doc, labels=[*names, "layer", "kind"]
            )
            for (layer, tensor_kind), value in sorted(nonfinite.items()):
                counter.add_metric([*values, layer, tensor_kind], value)
            yield counter


class _MetricSource:
    """The custom collector registered in the exporter's own registry."""

    def __init__(self, owner: PrometheusCollector) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Any]:
        return self.owner.collect_families()
