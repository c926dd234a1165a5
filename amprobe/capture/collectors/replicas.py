"""Replica fingerprints: an exact integer checksum of every parameter on sampled steps (AMP-D05).

Data-parallel replicas must hold bit-identical parameters after every step. On its sampled
steps (every ``fingerprint_every`` steps, budgeted like the other samples: see
:mod:`amprobe.capture.budget`, kind ``"replicas"``) this collector takes, at the step's end
(after the optimizer update), one fingerprint per parameter of each root model: the sum of the
local tensor's bit patterns read as integers of the same width (``int16`` for fp16/bf16,
``int32`` for fp32, ...), accumulated in int64 on the tensor's device (:func:`fingerprint`).
The sum is exact (no rounding: a float sum would miss low mantissa bits), independent of the
order in which the device adds, and any single flipped bit changes it (by ``±2**k``). The
fingerprints of a step stay on the device, stacked, and are read back at flush with the
other device values: no host-device sync on the step.

Each parameter's replica group, the ranks that must hold the same bits, is read once from the
objects in memory when the root model becomes known:

* DDP: every rank of DDP's process group, when it spans the job (read from the group's
  ``size()``; a smaller group's members are not read: the capture side calls nothing of
  ``torch.distributed``, so such a DDP is not checked, with the reason);
* a DTensor parameter (FSDP2, tensor parallel): the ranks of its device mesh with the same
  coordinates on every mesh dimension whose placement is not ``Replicate``; HSDP (FSDP2 on a
  2-D mesh, replicate x shard) gives the ranks with the same shard index; FSDP2 on a 1-D
  mesh (pure sharding) gives the rank alone: no replica;
* anything else (no data-parallel wrapper, FSDP1's flat parameters, an engine such as
  DeepSpeed that replicates by itself): no replica group; the reason is recorded.

A parameter without replicas is not fingerprinted; when no parameter has any, the collector
takes no sample at all (it registers its budget kind only once a replica exists).

Records:
    ``fingerprints`` table, one row per replicated parameter and sampled step: ``step``,
    ``param`` (qualified name as in the user's model; prefixed with the root's name when
    several roots are watched), ``fingerprint`` (int64, the sum above, modulo ``2**64`` only
    for 64-bit tensors or local tensors of more than ``2**32`` 32-bit elements), ``group``
    (the replica group's global ranks, ``"0,2"``), ``dtype``, ``numel`` (of the local tensor).
    ``replicas_layout`` event, once per root model: ``root``, ``engine`` (``ddp``,
    ``fsdp2``, ``dtensor``, ``fsdp1``, ``none``), ``param_count``, ``replicated_count``, ``groups``
    (distinct replica groups, at most 8), ``reason`` (why a parameter has no replica).

Cost: nothing on unsampled steps (the collector is not called: quiet steps skip it and its
step-end event is muted). On a sampled step one integer reduction per replicated parameter
(one read of its local tensor); see ``benchmarks/bench_fingerprint.py``.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import torch

from amprobe.capture.collectors.sharded import user_model, user_module_name, wrapper_classes
from amprobe.capture.protocol import Collector, StepFacts
from amprobe.store.fields import Field

__all__ = ["ReplicasCollector", "fingerprint", "replica_group"]

#: the integer type of each element width, in bytes (the bit patterns are read as these)
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: 16-bit patterns are summed in int32 over chunks of this many elements (exact: at most
#: 2**15 * 2**16 = 2**31 in magnitude; int32 sums run several times faster than int64 on CPU)
_CHUNK16 = 1 << 16
#: 32-bit patterns on the CPU are widened to int64 this many elements at a time (512 KiB)
_CHUNK32 = 1 << 16
#: distinct replica groups listed in a layout event
_MAX_GROUPS = 8


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """The exact integer fingerprint of ``t``'s bits: a 0-d int64 tensor on ``t``'s device.

    The sum of the elements' bit patterns read as signed integers of the same width, in int64:
    exact below ``2**32`` elements for 32-bit types (always for 8- and 16-bit ones), otherwise
    kept modulo ``2**64`` (integer addition wraps), which stays order-independent and still
    changes with any single flipped bit. ``t`` is read as stored (a DTensor must be passed as
    its local tensor). No host-device sync.
    """
    bits = t.detach()
    if bits.is_complex():
        bits = torch.view_as_real(bits)
    if bits.dtype == torch.bool:
        bits = bits.view(torch.int8)
    width = bits.element_size()
    as_int = _INT_OF_WIDTH[width]
    if bits.dtype != as_int:
        bits = bits.view(as_int)
    if width == 2 and bits.numel() > _CHUNK16:
        flat = bits.reshape(-1)
        whole = flat.numel() // _CHUNK16 * _CHUNK16
        total = flat[:whole].view(-1, _CHUNK16).sum(1, dtype=torch.int32).sum(dtype=torch.int64)
        return total + flat[whole:].sum(dtype=torch.int64)
    if width == 4 and bits.device.type == "cpu" and bits.numel() > _CHUNK32:
        return _cpu_sum32(bits.reshape(-1))
    return bits.sum(dtype=torch.int64)


def _cpu_sum32(flat: torch.Tensor) -> torch.Tensor:
    """``flat.sum(dtype=torch.int64)`` for 32-bit integers on the CPU, about 3x faster: torch's
    CPU reduction widening int32 to int64 is not vectorized, a copy into an int64 buffer and an
    int64 sum are (a buffer of :data:`_CHUNK32` elements, reused; the same exact value)."""
    buf = torch.empty(_CHUNK32, dtype=torch.int64)
    total = torch.zeros((), dtype=torch.int64)
    for start in range(0, flat.numel(), _CHUNK32):
        part = flat[start : start + _CHUNK32]
        out = buf[: part.numel()]
        out.copy_(part)
        total += out.sum()
    return total


def _process_group_ranks(group: Any, world_size: int) -> list[int] | None:
    """The global ranks of DDP's process group, from the group object itself (its ``size()``;
    the capture side calls nothing of ``torch.distributed``): every rank of the job when the
    group spans it; None for a smaller group, whose members only c10d's tables know."""
    size = getattr(group, "size", None)
    if not callable(size):
        return None
    try:
        n = int(size())
    except Exception:
        return None
    return list(range(world_size)) if n == world_size else None


def replica_group(param: Any, rank: int) -> list[int] | None:
    """The global ranks holding a replica of DTensor ``param`` (``rank`` included): its mesh's
    ranks with ``rank``'s coordinates on the dimensions not ``Replicate``; None for a tensor
    that is no DTensor, or when ``rank`` is not in its mesh."""
    mesh = getattr(param, "device_mesh", None)
    placements = getattr(param, "placements", None)
    if mesh is None or placements is None:
        return None
    ranks = getattr(mesh, "mesh", None)
    if not isinstance(ranks, torch.Tensor):
        return None
    where = (ranks == rank).nonzero()
    if where.shape[0] != 1:
        return None
    coord = where[0].tolist()
    index = tuple(
        slice(None) if placement.is_replicate() else c
        for placement, c in zip(placements, coord, strict=True)
    )
    return sorted(int(r) for r in ranks[index].reshape(-1).tolist())


class ReplicasCollector(Collector):
    """Exact per-parameter fingerprints of the replicated parameters on sampled steps.

    See the module docstring for what it records and what it costs.
    """

    name = "replicas"
    samples = True  # on_step_begin decides its samples (skipped on quiet steps)
    fields: ClassVar[tuple[Field, ...]] = ()

    def on_attach(self, probe: Any) -> None:
        super().on_attach(probe)
        self.every, self._fixed = probe.config.sample_period("fingerprint_every")
        self.rank = int(probe.rank)
        # (param, name, group text) of every replicated parameter of the roots
        self._params: list[tuple[weakref.ReferenceType[torch.Tensor], str, str]] = []
        # parameters fingerprinted already: a root registered again (the same model found
        # inside its DDP wrapper, or wrapped after it was first seen) adds none twice; one seen
        # without replicas may get them from a wrapper registered later
        self._replicated: set[int] = set()
        self._registered = False
        self._sampled_now = False
        self._done: list[tuple[int, list[tuple[str, str, str, int]], torch.Tensor]] = []
        self._mute_step_end(True)
        # nothing to ask at a step's start before a replica exists (a job of pure sharding:
        # never), whatever the budget's quiet steps say
        probe.hub.dispatch.mute(self, "on_step_begin")
        if probe.world_size < 2:
            probe.event("replicas_layout", root=None, engine="none", reason="single rank")

    def _mute_step_end(self, muted: bool) -> None:
        self.probe.hub.dispatch.mute(self, "on_step_end", muted=muted)

    # -- set-up ------------------------------------------------------------------------------
    def on_model(self, model: Any) -> None:
        if not isinstance(model, torch.nn.Module) or self.probe.world_size < 2:
            return
        wrappers = wrapper_classes(model)
        inner = user_model(model)
        ddp = "DistributedDataParallel" in wrappers
        fsdp1 = "FullyShardedDataParallel" in wrappers
        world = int(self.probe.world_size)
        ddp_group = (
            _process_group_ranks(getattr(model, "process_group", None), world) if ddp else None
        )
        # parameters DDP was told to leave alone (``_set_params_and_buffers_to_ignore_for_model``)
        # are not kept in sync by it: not replicas
        ignored = set(getattr(model, "parameters_to_ignore", ()) or ()) if ddp else set()
        fsdp2 = hasattr(model, "_get_fsdp_state") or hasattr(inner, "_get_fsdp_state")
        root = self.probe.root_name(model)
        count = replicated = 0
        groups: list[list[int]] = []
        reasons: set[str] = set()
        engines: set[str] = set()
        for name, p in inner.named_parameters():
            if id(p) in self._replicated:
                continue
            count += 1
            label = user_module_name(name)
            if root is not None:
                label = f"{root}.{label}"
            group = replica_group(p, self.rank)
            if group is not None:
                engines.add("fsdp2" if fsdp2 else "dtensor")
                if len(group) < 2:
                    reasons.add("sharded: each rank holds its own shard (no replicate dimension)")
                    continue
            elif fsdp1:
                engines.add("fsdp1")
                reasons.add("FSDP1 (FullyShardedDataParallel): its flat parameters are not read")
                continue
            elif ddp and name in ignored:
                engines.add("ddp")
                reasons.add("left out of DDP's synchronization (parameters_to_ignore)")
                continue
            elif ddp:
                engines.add("ddp")
                group = ddp_group
                if group is None or len(group) < 2:
                    reasons.add(
                        "DDP's process group is smaller than the job (its ranks are not read) "
                        "or has one rank"
                    )
                    continue
            else:
                engines.add("none")
                reasons.add("no data-parallel wrapper (DDP) and no DTensor parameters")
                continue
            if self.rank not in group:
                reasons.add("this rank is not in its parameters' replica group")
                continue
            replicated += 1
            self._replicated.add(id(p))
            if group not in groups:
                groups.append(group)
            self._params.append((weakref.ref(p), label, ",".join(map(str, group))))
        if not count:
            return
        self.probe.event(
            "replicas_layout",
            root=root,
            engine=",".join(sorted(engines)),
            param_count=count,
            replicated_count=replicated,
            groups=groups[:_MAX_GROUPS],
            reason="; ".join(sorted(reasons)) or None,
        )
        if self._params and not self._registered and self.every > 0:
            self._registered = True
            # its grid stays the multiples of the period (the same steps on every rank); its
            # first step is the first of them at or after now: a root found after step 0 leaves
            # the steps before that one quiet (not asked)
            now = self.probe.step
            first = -(-now // self.every) * self.every
            self.probe.budget.register("replicas", self.every, fixed=self._fixed, first=first)
            self.probe.hub.dispatch.mute(self, "on_step_begin", muted=False)
            if self.probe.recording:  # a root found during a step: that step may be due
                self.on_step_begin(self.probe.step)

    # -- step boundary -----------------------------------------------------------------------
    def on_step_begin(self, step: int) -> None:
        sampled = self._registered and bool(self.probe.budget.due("replicas", step))
        self._sampled_now = sampled
        if sampled:
            self._mute_step_end(False)

    def on_step_end(self, step: int, record: dict[str, Any], facts: StepFacts) -> None:
        """Live on sampled steps only: the fingerprints of the parameters as updated."""
        if not self._sampled_now:
            self._mute_step_end(True)  # (quiet steps after a sample are not asked to begin)
            return
        self._sampled_now = False
        by_device: dict[torch.device, tuple[list[tuple[str, str, str, int]], list[Any]]] = {}
        with torch.no_grad():
            for ref, name, group in self._params:
                p = ref()
                if p is None:
                    continue
                local = _local(p)
                meta, sums = by_device.setdefault(local.device, ([], []))
                meta.append((name, group, str(local.dtype).replace("torch.", ""), local.numel()))
                sums.append(fingerprint(local))
            for meta, sums in by_device.values():
                self._done.append((step, meta, torch.stack(sums)))

    def on_recording(self, active: bool) -> None:
        if not active:
            self._sampled_now = False
            self._mute_step_end(True)

    # -- flush -------------------------------------------------------------------------------
    def on_flush(self, writer: Any) -> None:
        done, self._done = self._done, []
        if not done:
            return
        rows: list[dict[str, Any]] = []
        for step, meta, sums in done:  # one transfer per sampled step and device, at flush
            for (name, group, dtype, numel), value in zip(meta, sums.cpu().tolist(), strict=True):
                rows.append(
                    {
                        "step": step,
                        "param": name,
                        "fingerprint": int(value),
                        "group": group,
                        "dtype": dtype,
                        "numel": numel,
                    }
                )
        writer.append("fingerprints", rows)

    def on_close(self) -> None:
        self._params.clear()


def _local(p: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (no communication, no copy; about 1 us under ``no_grad``), else
    the tensor."""
    to_local = getattr(p, "to_local", None)
    if to_local is None or type(p) in (torch.Tensor, torch.nn.Parameter):
        return p
    local: torch.Tensor = to_local()
    return local
