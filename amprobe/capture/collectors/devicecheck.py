"""Known-answer device check: a fixed GEMM on each rank's device, compared exactly (AMP-D06).

A device that computes wrong (a faulty SM, a bad HBM stack, a marginal clock) rarely crashes:
it returns numbers, and the job trains on them. The :class:`DeviceCheckCollector` runs, at the
first step boundary and then every ``Config.device_check_minutes`` minutes, one matrix product
whose exact answer is known in advance, in the job's precision, on the rank's own device, and
counts the elements that differ from the stored answer. Nothing else on the rank is compared
with anything: the check is rank-local (no collective).

The known answer: ``A`` (M x K) and ``B`` (K x N) hold only -1, 0 and 1, built from the element
indices (no random generator is used), so every product is -1, 0 or 1 and every partial sum of
the K products, in any summation order, split-K and reduced-precision reductions included, is
an integer of magnitude at most K. Such integers are exact in the product's dtype as long as K
is at most :data:`EXACT_BOUND` (256 for bf16, 2048 for fp16 and for fp32 under TF32): K is
:data:`K_DIM` = 256, so a correct device returns the answer bit for bit, whatever kernel its
library picks. ``A``'s rows repeat every :data:`TILE` rows and ``B``'s columns every
:data:`TILE` columns, so the answer is one :data:`TILE` x :data:`TILE` block computed once on
the host in float64 (exact) and kept on the device. The product's size is :data:`SHAPES`: on
CUDA 2048 x 2048 (256 output tiles of 128 x 128: every SM of a current GPU gets work).

Per check, on the device: one GEMM, one comparison and one sum into a 0-d int64 tensor, kept
until the next flush (which reads back the step records anyway): no host-device sync on the
step. The check runs at a step boundary, outside autocast (switched off for its duration with
``torch.set_autocast_enabled``, not through ``torch.autocast``, which the hub would book as the
job's), outside any compiled region and any CUDA graph capture (it waits for the next boundary
then), under ``torch.no_grad``; it uses its own tensors only, draws no random numbers and
changes no setting of the job's (TF32 and reduced-precision reductions are the job's own, the
precision it computes in): what the job computes is unchanged. The first check builds the
operands (a few small device kernels, and one 8 KiB host-to-device copy of the stored answer
from pinned memory) and reads the device's identity from NVML (UUID, PCI bus id; once per
rank, on the training thread, some milliseconds). ``on_close`` drops the operands.

Events:

- ``device_identity`` (once per rank, at the first check): ``device`` (``cuda:0``),
  ``gpu_name``, ``uuid``, ``pci_bus_id``, ``serial`` (NVML's board serial, where readable),
  ``source`` (``nvml`` or ``torch``: which one gave the UUID and PCI bus id) and ``note`` (why
  NVML was not read, where it was not).
- ``device_check`` (one per check, dated to the step at whose end it ran): ``mismatches``
  (elements that differ from the stored answer; 0 on a correct device), ``elements``,
  ``shape`` ([M, K, N]), ``dtype`` (``bfloat16``), ``precision`` (``autocast``,
  ``parameters`` or ``default``: where the dtype came from) and ``device``.
- ``device_check_off`` (once, when the device is known and the check is off): ``reason``.
- ``device_check_error`` (once: the check stops): ``error``, ``dtype``.

Cost: on CUDA a 2048 x 256 x 2048 GEMM (2.1 GFLOP, microseconds on a data-centre GPU) every 30
minutes by default, its operands kept (4 MiB in fp32, 2 MiB in bf16) and at most 20 MiB of
transient device memory (an fp32 result and its comparison mask, returned to the caching
allocator); on other steps one clock read at the step's end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from amprobe.capture.protocol import Collector, StepFacts
from amprobe.config import DEFAULT_DEVICE_CHECK_MINUTES

__all__ = [
    "EXACT_BOUND",
    "K_DIM",
    "SHAPES",
    "TILE",
    "DeviceCheckCollector",
    "KnownAnswer",
    "build_known_answer",
    "device_identity",
    "run_gemm",
]

#: dtype -> the largest integer magnitude that every value on the GEMM's path (inputs,
#: products, each partial sum, the output) holds exactly: 2 ** (mantissa bits + 1). fp32 is
#: bounded by TF32 (10 mantissa bits), which cuBLAS may use for fp32 inputs when the job allows
#: it; fp16 and bf16 by their own mantissa, which reduced-precision reductions accumulate in.
EXACT_BOUND: dict[torch.dtype, int] = {
    torch.bfloat16: 2**8,
    torch.float16: 2**11,
    torch.float32: 2**11,
    torch.float64: 2**11,
}
#: the inner dimension: the largest partial sum of products in {-1, 0, 1} is K
K_DIM = 256
#: rows of A and columns of B repeat with this period: the stored answer is TILE x TILE
TILE = 64
#: device type -> (M, N) of the product; others use the "default" entry (a CPU check is small:
#: bf16 matmuls are slow there)
SHAPES: dict[str, tuple[int, int]] = {"cuda": (2048, 2048), "default": (256, 256)}

assert K_DIM <= min(EXACT_BOUND.values()), "the known answer would not be exact"
assert all(m % TILE == 0 and n % TILE == 0 for m, n in SHAPES.values())

_now = time.monotonic  # the check's clock (tests replace it)


def _ternary(index: torch.Tensor, salt: int) -> torch.Tensor:
    """-1, 0 or 1 from each integer of ``index`` (int64), by a fixed linear congruential hash:
    no random generator, the same values on every device and every run. The shift takes bits
    above the low ones, so the values follow no short period of the index."""
    return ((index * 1103515245 + salt) >> 16) % 3 - 1


def _a_values(rows: int, k: int, device: torch.device | str) -> torch.Tensor:
    """A[i, k] in {-1, 0, 1} (int64), rows repeating every :data:`TILE`."""
    i = torch.arange(rows, device=device) % TILE
    kk = torch.arange(k, device=device)
    return _ternary(i[:, None] * k + kk[None, :], 12345)


def _b_values(k: int, cols: int, device: torch.device | str) -> torch.Tensor:
    """B[k, j] in {-1, 0, 1} (int64), columns repeating every :data:`TILE`."""
    kk = torch.arange(k, device=device)
    j = torch.arange(cols, device=device) % TILE
    return _ternary(kk[:, None] * TILE + j[None, :], 2531011)


@dataclasses.dataclass
class KnownAnswer:
    """The operands and the stored answer of one (device, dtype), built once.

    Attributes:
        a: (M, K) on the device, in the dtype checked.
        b: (K, N) on the device.
        answer: the (TILE, TILE) block every block of ``a @ b`` equals, on the device.
        source: the host copy the answer came from (pinned on CUDA: kept alive for the copy).
    """

    a: torch.Tensor
    b: torch.Tensor
    answer: torch.Tensor
    source: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return (int(self.a.shape[0]), int(self.a.shape[1]), int(self.b.shape[1]))

    def mismatches(self, result: torch.Tensor) -> torch.Tensor:
        """Elements of ``result`` that differ from the stored answer: a 0-d int64 tensor on the
        device (no sync). A result of another shape counts every element as wrong."""
        m, _, n = self.shape
        if tuple(result.shape) != (m, n):
            return torch.full((), m * n, dtype=torch.int64, device=self.a.device)
        blocks = result.reshape(m // TILE, TILE, n // TILE, TILE)
        return blocks.ne(self.answer.reshape(1, TILE, 1, TILE)).sum()


def build_known_answer(device: torch.device, dtype: torch.dtype) -> KnownAnswer:
    """The operands of the check on ``device`` in ``dtype`` and their exact answer.

    The operands are built on the device from their indices; the answer on the host, in
    float64 (integers far below 2 ** 53: exact), then copied once (8 KiB).

    Raises:
        ValueError: ``dtype`` has no exact known answer (:data:`EXACT_BOUND`).
    """
    if dtype not in EXACT_BOUND:
        raise ValueError(f"no exact known-answer GEMM in {dtype}")
    m, n = SHAPES.get(device.type, SHAPES["default"])
    a = _a_values(m, K_DIM, device).to(dtype)
    b = _b_values(K_DIM, n, device).to(dtype)
    exact = _a_values(TILE, K_DIM, "cpu").double() @ _b_values(K_DIM, TILE, "cpu").double()
    source = exact.to(dtype)
    if device.type == "cuda":
        source = source.pin_memory()
        answer = source.to(device, non_blocking=True)
    else:
        answer = source.to(device)
    return KnownAnswer(a=a, b=b, answer=answer, source=source)


def run_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The product the check measures: ``a @ b`` on their device, as the job's matmuls run."""
    return torch.mm(a, b)


@contextlib.contextmanager
def _autocast_off(device_type: str) -> Iterator[None]:
    """Autocast off for ``device_type`` inside, as it was after (the flag only: the hub books
    ``torch.autocast`` regions as the job's)."""
    try:
        was = torch.is_autocast_enabled(device_type)
    except Exception:  # a device type autocast does not know: nothing to switch off
        was = False
    if was:
        torch.set_autocast_enabled(device_type, False)
    try:
        yield
    finally:
        if was:
            torch.set_autocast_enabled(device_type, True)


def _must_wait(device: torch.device) -> bool:
    """The boundary is inside a compiled region (dynamo tracing the step), or the job is
    capturing a CUDA graph on the current stream: nothing of the check's may go into either."""
    if torch.compiler.is_compiling():
        return True
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _torch_identity(index: int) -> dict[str, Any]:
    """UUID, PCI bus id (NVML's format) and name from torch's device properties."""
    props = torch.cuda.get_device_properties(index)
    out: dict[str, Any] = {"gpu_name": getattr(props, "name", None)}
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        out["uuid"] = text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
    bus = getattr(props, "pci_bus_id", None)
    if isinstance(bus, int):
        domain = getattr(props, "pci_domain_id", 0) or 0
        dev = getattr(props, "pci_device_id", 0) or 0
        out["pci_bus_id"] = f"{int(domain):08X}:{bus:02X}:{int(dev):02X}.0"
    return out


def device_identity(device: torch.device) -> dict[str, Any]:
    """Who ``device`` is, to drain it: for CUDA its UUID, PCI bus id, name and board serial.

    NVML is asked first (the handle found by the CUDA UUID); where ``pynvml`` is missing or
    NVML cannot be read, torch's device properties give the UUID and PCI bus id, and ``note``
    says why NVML was not used. Never raises. Touches NVML and the CUDA device properties only
    (no stream work).
    """
    out: dict[str, Any] = {
        "device": str(device),
        "gpu_name": None,
        "uuid": None,
        "pci_bus_id": None,
        "serial": None,
        "source": None,
        "note": None,
    }
    if device.type != "cuda":
        out["note"] = f"{device.type} device: no UUID or PCI bus id"
        return out
    index = device.index if device.index is not None else torch.cuda.current_device()
    out["device"] = f"cuda:{index}"
    try:
        out.update(_torch_identity(index))
        out["source"] = "torch"
    except Exception as exc:
        out["note"] = f"torch device properties: {type(exc).__name__}: {exc}"
    try:
        import pynvml
    except Exception as exc:
        out["note"] = f"NVML not read: pynvml cannot be imported ({exc})"
        return out
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        out["note"] = f"NVML not read: {type(exc).__name__}: {exc}"
        return out
    try:
        uuid = out["uuid"]
        handle = (
            pynvml.nvmlDeviceGetHandleByUUID(uuid)
            if uuid
            else pynvml.nvmlDeviceGetHandleByIndex(index)
        )
        out["uuid"] = _text(pynvml.nvmlDeviceGetUUID(handle))
        out["source"] = "nvml"
        with contextlib.suppress(Exception):
            out["pci_bus_id"] = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
        with contextlib.suppress(Exception):
            out["gpu_name"] = _text(pynvml.nvmlDeviceGetName(handle))
        with contextlib.suppress(Exception):
            out["serial"] = _text(pynvml.nvmlDeviceGetSerial(handle))
    except Exception as exc:
        out["note"] = f"NVML not read: {type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return out


def _floating_dtype(tensors: Iterator[torch.Tensor]) -> torch.dtype | None:
    for t in tensors:
        if t.is_floating_point():
            return t.dtype
    return None


class DeviceCheckCollector(Collector):
    """Runs the known-answer GEMM on the rank's device every ``device_check_minutes``.

    Records the events listed in :mod:`amprobe.capture.collectors.devicecheck` (no ``steps``
    column): ``device_identity`` once, ``device_check`` per check (``mismatches``: elements,
    0 when the device answered right), ``device_check_off`` or ``device_check_error`` with the
    reason when it does not check.

    The precision checked is the job's: the dtype of the autocast region the job last entered
    on the device (seen on detail steps), else the dtype of the root models' (or optimizers')
    first floating parameter, else float32.
    """

    name = "devicecheck"
    fields: ClassVar[tuple[Any, ...]] = ()

    def on_attach(self, probe: Any) -> None:
        super().on_attach(probe)
        self._minutes: float | None = probe.config.device_check_minutes
        self._period_s = 0.0
        self._device: torch.device | None = None  # the device the decision was made for
        self._on = False
        self._due = -float("inf")  # the first boundary checks
        self._autocast: tuple[str, str | None] | None = None
        self._models: list[weakref.ReferenceType[torch.nn.Module]] = []
        self._optimizers: list[weakref.ReferenceType[torch.optim.Optimizer]] = []
        self._known: dict[tuple[str, torch.dtype], KnownAnswer] = {}
        self._pending: list[tuple[int, dict[str, Any], torch.Tensor]] = []
        self._identified = False
        probe.hub.dispatch.mute(self, "on_step_end")  # until the device is known and checked
        self._decide()

    # -- when to check ------------------------------------------------------------------------
    def on_model(self, model: torch.nn.Module) -> None:
        self._models.append(weakref.ref(model))
        self._decide()

    def on_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizers.append(weakref.ref(optimizer))
        self._decide()

    def _decide(self) -> None:
        """On or off for the training device, once it is known (again if it changes)."""
        device = self.probe.device
        if device is None or device == self._device:
            return
        self._device = device
        minutes = self._minutes
        reason = None
        if minutes == 0:
            reason = "device_check_minutes=0 turned it off"
        elif minutes is None and device.type == "cpu":
            reason = (
                "the job runs on the CPU, where the check is off unless asked "
                "(set device_check_minutes)"
            )
        self._on = reason is None
        self.probe.hub.dispatch.mute(self, "on_step_end", muted=not self._on)
        if reason is not None:
            self.probe.event("device_check_off", reason=reason, device=str(device))
            return
        self._period_s = 60.0 * float(
            minutes if minutes is not None else DEFAULT_DEVICE_CHECK_MINUTES
        )

    def on_step_end(self, step: int, record: dict[str, Any], facts: StepFacts) -> None:
        """At the step boundary: a check when one is due (one clock read otherwise)."""
        if facts.autocast is not None:
            self._autocast = facts.autocast
        now = _now()
        if now < self._due:
            return
        device = self.probe.device
        if device is None or not self._on:
            return
        if _must_wait(device):
            return  # the next boundary checks
        self._check(step, device)
        self._due = now + self._period_s

    def _job_dtype(self, device: torch.device) -> tuple[torch.dtype, str]:
        """The dtype the job computes in on ``device`` and where it came from."""
        if self._autocast is not None and self._autocast[0] == device.type:
            dtype = getattr(torch, str(self._autocast[1]), None)
            if isinstance(dtype, torch.dtype):
                return dtype, "autocast"
        for ref in self._models:
            model = ref()
            if model is not None and (found := _floating_dtype(model.parameters())) is not None:
                return found, "parameters"
        for oref in self._optimizers:
            opt = oref()
            if opt is not None:
                params = (p for g in opt.param_groups for p in g["params"])
                if (found := _floating_dtype(params)) is not None:
                    return found, "parameters"
        return torch.float32, "default"

    def _check(self, step: int, device: torch.device) -> None:
        dtype, precision = self._job_dtype(device)
        try:
            if not self._identified:
                self._identified = True
                self.probe.event("device_identity", **device_identity(device))
            if dtype not in EXACT_BOUND:
                raise ValueError(
                    f"the job's precision {dtype} has no exact known-answer GEMM "
                    "(checked: bfloat16, float16, float32, float64)"
                )
            with torch.no_grad(), _autocast_off(device.type):
                key = (str(device), dtype)
                known = self._known.get(key)
                if known is None:
                    known = self._known[key] = build_known_answer(device, dtype)
                count = known.mismatches(run_gemm(known.a, known.b))
        except Exception as exc:  # one event, and no more checks: never into the user's loop
            self._on = False
            self._known.clear()
            self.probe.hub.dispatch.mute(self, "on_step_end")
            self.probe.event(
                "device_check_error",
                error=f"{type(exc).__name__}: {exc}",
                dtype=str(dtype).replace("torch.", ""),
                device=str(device),
            )
            return
        m, k, n = known.shape
        facts = {
            "device": str(device),
            "dtype": str(dtype).replace("torch.", ""),
            "precision": precision,
            "shape": [m, k, n],
            "elements": m * n,
        }
        self._pending.append((step, facts, count))

    # -- flush --------------------------------------------------------------------------------
    def on_flush(self, writer: Any) -> None:
        """The checks' mismatch counts, read back (the flush syncs anyway), one event each."""
        if self._device is None:
            self._decide()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        by_device: dict[torch.device, list[int]] = {}
        for i, (_, _, count) in enumerate(pending):
            by_device.setdefault(count.device, []).append(i)
        values: list[int] = [0] * len(pending)
        for indices in by_device.values():
            read = torch.stack([pending[i][2] for i in indices]).cpu().tolist()
            for i, value in zip(indices, read, strict=True):
                values[i] = int(value)
        for (step, facts, _), value in zip(pending, values, strict=True):
            self.probe.event_at(step, "device_check", mismatches=value, **facts)

    def on_close(self) -> None:
        self._known.clear()
