"""Host-device synchronization counting with a dispatch mode, attributed to user source lines.

:class:`SyncCounter` is an op observer: the runtime collector asks the hub for the ops of sampled
steps only (the hub's one dispatch mode sees every aten op, which costs about 10 % of a step's
CPU time while active) and hands each to :meth:`SyncCounter.observe`. It counts the ops that
make the host wait for the device:

- ``aten._local_scalar_dense``: ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``, ``if t:``;
- ``aten.nonzero``, ``aten.equal``, ``aten.masked_select`` and the ``unique`` family, whose
  output size (or value) lives on the device;
- ``aten.index.Tensor`` with a boolean mask (``t[t > 0]`` runs a ``nonzero`` below the dispatch
  mode, so the mask is the sign);
- ``aten._to_copy`` and ``aten.copy_`` from the training device to the host (``.cpu()``,
  ``.tolist()``, ``.numpy()``, printing a tensor), CUDA runs only.

Only tensors on the training device count: on a CUDA run the host tensors that optimizers keep
(AdamW's ``step`` counters) never sync. On a CPU run, where every tensor is a host tensor, only
the tensors that would live on the device of a GPU run count: those derived from the model
(tensors on its autograd graph, which need a gradient; its parameters' gradients and its
buffers and the GradScaler's scale, marked with :meth:`SyncCounter.mark` when the step begins)
through the ops of the step, which the counter follows op by op; the model's outputs, the loss
and the optimizer's state are derived from the parameters. A tensor detached from the graph in
an earlier, unsampled step (``loss.detach()`` kept for logging) is not known to be derived. Host-side indices
(``torch.randint`` indices into a numpy memmap, whose ``__index__`` calls ``.item()``) and
optimizer step counters are not counted. These syncs are labelled "would synchronize on a GPU";
copies to the host cannot be seen there (``.cpu()`` and ``.tolist()`` of a CPU tensor dispatch
nothing). A model input moved to the device in a GPU run is not derived from the model, so a
sync on it alone is missed on a CPU run.

Each counted op is classified by walking the Python stack (only for the few ops that match):

- ``user``: the first frame outside torch and amprobe is the site (``file:line``);
- ``scaler``: issued inside ``GradScaler._maybe_opt_step`` (its one necessary ``.item()``);
- ``optimizer``: issued inside ``torch.optim`` (step counters, on CPU runs);
- ``dataloader``: issued inside ``torch.utils.data`` (the iterator's seed, on CPU runs);
- ops issued by the probe itself (flushes, collector work) never reach the observer.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from amprobe.capture.sites import TORCH_DIR as _TORCH_DIR
from amprobe.capture.sites import is_own_frame

__all__ = ["SyncCounter", "SYNC_OPS"]

_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim") + os.sep
_DATA_DIR = os.path.join(_TORCH_DIR, "utils", "data") + os.sep
_GRAD_SCALER_FILES = ("grad_scaler.py", "sharded_grad_scaler.py")

aten = torch.ops.aten

#: op packet -> label for ops that synchronize whenever their input is on the device.
SYNC_OPS: dict[Any, str] = {
    aten._local_scalar_dense: "item",
    aten.nonzero: "nonzero",
    aten.equal: "equal",
    aten.masked_select: "masked_select",
    aten._unique2: "unique",
    aten.unique_consecutive: "unique",
    aten.unique_dim: "unique",
}
_INDEX = aten.index
_TO_COPY = aten._to_copy
_COPY = aten.copy_
_CHECKED = frozenset((*SYNC_OPS, _INDEX, _TO_COPY, _COPY))


def _first_tensor(args: Any) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def _tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors among ``values`` and one level of lists/tuples in them (``cat``, foreach)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            for w in v:
                if isinstance(w, torch.Tensor):
                    yield w


_WRITTEN: dict[Any, tuple[int, ...]] = {}


def _written_args(func: Any) -> tuple[int, ...]:
    """Positions of the arguments an op writes to (its schema's mutable aliases), cached."""
    written = _WRITTEN.get(func)
    if written is None:
        try:
            arguments = func._schema.arguments
        except AttributeError:
            arguments = ()
        written = tuple(
            i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITTEN[func] = written
    return written


class SyncCounter:
    """Counts synchronizing ops per (site, op, kind).

    Args:
        device_type: the training device type; only tensors on it count (on ``"cpu"``, only
            those derived from the tensors given to :meth:`mark`).

    Attributes:
        counts: ``Counter[(site, op, kind)]`` since the last :meth:`take`.
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.counts: Counter[tuple[str, str, str]] = Counter()
        # CPU runs: id -> weak reference of each tensor derived from the model in this step
        self._derived: dict[int, weakref.ReferenceType[torch.Tensor]] | None = (
            {} if device_type == "cpu" else None
        )

    def mark(self, tensors: Iterable[Any]) -> None:
        """On a CPU run, take ``tensors`` (and what the step's ops derive from them) as tensors
        a GPU run would keep on the device. A no-op on other devices."""
        derived = self._derived
        if derived is None:
            return
        for t in _tensors(tensors):
            derived[id(t)] = weakref.ref(t)

    def _is_derived(self, t: torch.Tensor) -> bool:
        if t.requires_grad:  # on the model's autograd graph (a loss from before the boundary)
            return True
        ref = self._derived.get(id(t)) if self._derived is not None else None
        return ref is not None and ref() is t

    def _on_device(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
            return False
        return self._derived is None or self._is_derived(t)

    def observe(self, func: Any, args: Any, kwargs: Any, out: Any = None) -> None:
        """Look at one aten op (after it ran); count it if it synchronizes.

        On a CPU run, ``out`` is derived from the model when any tensor argument is.
        """
        packet = func._overloadpacket
        if packet in _CHECKED:
            label = self._label(packet, args, kwargs)
            if label is not None:
                self._count(label)
        derived = self._derived
        if derived is None:
            return
        if not (self._any_derived(args) or (kwargs and self._any_derived(kwargs.values()))):
            return
        if isinstance(out, torch.Tensor):
            derived[id(out)] = weakref.ref(out)
        elif isinstance(out, (list, tuple)):
            self.mark(out)
        written = _written_args(func)
        if written:  # in-place ops that return nothing (GradScaler's found_inf)
            self.mark(args[i] for i in written if i < len(args))

    def _any_derived(self, values: Iterable[Any]) -> bool:
        """Any tensor among ``values`` (and one level of lists in them) derived from the model."""
        for v in values:
            if isinstance(v, torch.Tensor):
                if self._is_derived(v):
                    return True
            elif isinstance(v, (list, tuple)):
                for w in v:
                    if isinstance(w, torch.Tensor) and self._is_derived(w):
                        return True
        return False

    def _label(self, packet: Any, args: Any, kwargs: Any) -> str | None:
        dev = self.device_type
        if packet in SYNC_OPS:
            return SYNC_OPS[packet] if self._on_device(_first_tensor(args)) else None
        if packet is _INDEX:
            t = args[0] if args else None
            if not self._on_device(t) or len(args) < 2:
                return None
            for idx in args[1] or ():
                if isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8):
                    return "bool-mask-index"
            return None
        if dev == "cpu":
            return None  # host copies of host tensors are not syncs, and mostly not even seen
        if packet is _TO_COPY:
            t = args[0] if args else None
            target = kwargs.get("device")
            if (
                isinstance(t, torch.Tensor)
                and t.device.type == dev
                and target is not None
                and torch.device(target).type == "cpu"
            ):
                return "to-cpu"
            return None
        if packet is _COPY and len(args) >= 2:
            dst, src = args[0], args[1]
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if (
                isinstance(dst, torch.Tensor)
                and isinstance(src, torch.Tensor)
                and dst.device.type == "cpu"
                and src.device.type == dev
                and not non_blocking
            ):
                return "copy-to-cpu"
        return None

    def _count(self, op: str) -> None:
        kind = "user"
        frame = sys._getframe(2)
        site = "?"
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename.startswith(_TORCH_DIR):
                if kind != "user":
                    pass  # the innermost library frame decides
                elif (
                    filename.endswith(_GRAD_SCALER_FILES)
                    and frame.f_code.co_name == "_maybe_opt_step"
                ):
                    kind = "scaler"
                elif filename.startswith(_OPTIM_DIR):
                    kind = "optimizer"
                elif filename.startswith(_DATA_DIR):
                    kind = "dataloader"
            elif not is_own_frame(filename):
                site = f"{filename}:{frame.f_lineno}"
                break
            frame = frame.f_back  # type: ignore[assignment]
        self.counts[(site, op, kind)] += 1

    def take(self) -> Counter[tuple[str, str, str]]:
        """Return the counts so far and start afresh."""
        counts, self.counts = self.counts, Counter()
        return counts
