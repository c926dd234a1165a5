"""GradScaler and step telemetry: the loss-scale trajectory, skipped steps, AMP protocol misuse.

A subscriber of the hub: it sees every GradScaler, optimizer and clip call through the hub's
events, and what each iteration did (``unscale_``/``step`` calls, optimizer steps, autocast
settings, the scale and found-inf) through the step's ``StepFacts`` at its end; it never patches
torch. Values stay on their device; the probe reads them back at flush.
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter
from typing import Any, ClassVar

import torch
from torch.amp import GradScaler
from torch.optim import Optimizer

from amprobe.capture.collectors.frameworks import framework_amp_facts
from amprobe.capture.collectors.sharded import sharding_facts
from amprobe.capture.protocol import Collector, StepFacts
from amprobe.capture.sites import dtype_name
from amprobe.store.fields import Field, fields_of

__all__ = ["ScalerCollector"]

_MAX_EVENTS_PER_KIND = 50  # per-step facts live in the steps table; events only sample them


class ScalerCollector(Collector):
    """Records the loss-scale trajectory, skipped steps and AMP protocol misuse.

    Per step (``steps`` table): ``scale_before`` and ``scale_after`` (the loss scale before
    and after ``update()``), ``growth_tracker``, ``found_inf`` (number of optimizer/device
    inf checks that found inf/NaN), ``skipped`` (the update was not applied), ``opt_steps``
    (optimizer steps that ran), ``loss`` (the sum of the losses backpropagated in the step:
    with gradient accumulation frameworks divide each micro-batch's loss, so this is the loss
    they log) and ``loss_dtype``. On detail steps (``Config.details_every``; null on others):
    ``unscale_calls``, ``clip_calls``, ``clip_scaled`` (clip calls that saw still-scaled
    gradients), ``autocast_device`` and ``autocast_dtype`` (the last autocast region entered).

    Events: ``scaler_created`` (call site, init_scale, growth/backoff factors, interval),
    ``scaler_bound`` (scaler used with an optimizer), ``optimizer_seen`` (class, parameter
    dtypes, fused), ``scaler_state_loaded``, ``optimizer_state_loaded``,
    ``clip_before_unscale``, ``autocast_seen`` (each distinct device/dtype/enabled).

    Step boundaries come from the hub: the ``update()`` of the first GradScaler used, else the
    ``step()`` of the first optimizer that steps. A skipped iteration is still an iteration.

    The record of a step is filled in from its facts at the next flush (``on_step_fold``),
    with its events dated to it.

    Manifest (once, at the first step's fold): the AMP setting of a framework in the process
    (:mod:`amprobe.capture.collectors.frameworks`) and, for an FSDP2 or DDP model, its
    ``MixedPrecisionPolicy`` and gradient reduction (:func:`amprobe.capture.collectors.sharded.sharding_facts`).

    Cost: nothing at a step's end; a few Python calls per step at flush; no sync.
    """

    name = "scaler"
    fields: ClassVar[tuple[Field, ...]] = fields_of("scaler")

    def on_attach(self, probe: Any) -> None:
        super().on_attach(probe)
        self._ids: weakref.WeakKeyDictionary[GradScaler, int] = weakref.WeakKeyDictionary()
        self._serial = itertools.count(1)
        self._bound: set[tuple[int, int]] = set()
        self._event_counts: Counter[str] = Counter()
        self._framework_read = False
        self._models: list[weakref.ReferenceType[torch.nn.Module]] = []
        self._sharding_read = False

    def _event(self, kind: str, **detail: Any) -> None:
        self._event_counts[kind] += 1
        if self._event_counts[kind] <= _MAX_EVENTS_PER_KIND:
            self.probe.event(kind, **detail)

    def _id(self, scaler: GradScaler) -> int:
        sid = self._ids.get(scaler)
        if sid is None:
            sid = self._ids[scaler] = next(self._serial)
        return sid

    # -- objects ------------------------------------------------------------------------------
    def on_scaler(self, scaler: GradScaler, site: str | None) -> None:
        self._event(
            "scaler_created",
            scaler_id=self._id(scaler),
            site=site,
            created_before_attach=site is None,
            enabled=bool(getattr(scaler, "_enabled", True)),
            device=str(getattr(scaler, "_device", "cuda")),
            init_scale=getattr(scaler, "_init_scale", None),
            growth_factor=getattr(scaler, "_growth_factor", None),
            backoff_factor=getattr(scaler, "_backoff_factor", None),
            growth_interval=getattr(scaler, "_growth_interval", None),
        )

    def on_optimizer(self, opt: Optimizer) -> None:
        dtypes: Counter[str] = Counter()
        trainable_half = 0
        n_params = 0
        device = None
        for group in opt.param_groups:
            for p in group["params"]:
                if device is None:
                    device = p.device
                if p.requires_grad:
                    dtypes[dtype_name(p.dtype) or "?"] += p.numel()
                    n_params += p.numel()
                    if p.dtype in (torch.float16, torch.bfloat16):
                        trainable_half += p.numel()
        defaults = getattr(opt, "defaults", {}) or {}
        self.probe.note_device(device)
        self._event(
            "optimizer_seen",
            optimizer_id=id(opt),
            optimizer_class=type(opt).__name__,
            param_dtypes=dict(dtypes),
            trainable_params=n_params,
            trainable_half_params=trainable_half,
            fused=bool(defaults.get("fused") or False),
            amp_scaling_in_step=bool(getattr(opt, "_step_supports_amp_scaling", False)),
            device=str(device) if device is not None else None,
        )

    def on_scaler_state_loaded(self, scaler: GradScaler, state: Any) -> None:
        scale = state.get("scale") if isinstance(state, dict) else None
        self._event(
            "scaler_state_loaded",
            scaler_id=self._id(scaler),
            scale=scale if isinstance(scale, (int, float)) else None,
            empty=not state,
        )

    def on_optimizer_state_loaded(self, opt: Optimizer, restored: bool) -> None:
        if restored:  # a fresh optimizer's state re-placed on its device is no restore
            self._event(
                "optimizer_state_loaded", optimizer_id=id(opt), optimizer_class=type(opt).__name__
            )

    # -- one iteration (what the hub saw is in its facts: read at the step's end) -----------------
    def on_clip(self, function: str, grads: list[Any], site: str | None, facts: StepFacts) -> None:
        facts.clip_calls += 1
        if not any(getattr(s, "_enabled", False) for s in facts.scalers_scaled):
            return
        unscaled = {
            id(p.grad)
            for opt in facts.unscaled_opts
            for group in opt.param_groups
            for p in group["params"]
            if p.grad is not None
        }
        if any(id(g) not in unscaled for g in grads):
            facts.clip_scaled += 1
            self._event("clip_before_unscale", function=function, site=site)

    def on_model(self, model: Any) -> None:
        if isinstance(model, torch.nn.Module):
            self._models.append(weakref.ref(model))

    def _read_sharding(self) -> None:
        """FSDP2's ``MixedPrecisionPolicy`` (the job's precision setting) and a half-precision
        gradient reduction, read at the end of the first step a root model is known
        (``fully_shard`` may follow attach); a framework's own setting keeps its name."""
        for ref in self._models:
            model = ref()
            facts = sharding_facts(model) if model is not None else {}
            if not facts:
                continue
            if "framework" in self.probe.rank_manifest:
                keep = (
                    "framework_casts_params",
                    "fsdp_mp_policy",
                    "fsdp_mp_policies",
                    "grad_reduce",
                )
                facts = {k: v for k, v in facts.items() if k in keep}
            self.probe.annotate_manifest(**facts)
            return

    def on_step_fold(self, step: int, record: dict[str, Any], facts: StepFacts) -> None:
        if not self._sharding_read:
            self._read_once()
        for scaler, optimizer in facts.scaler_steps:
            key = (self._id(scaler), id(optimizer))
            if key not in self._bound:
                self._bound.add(key)
                self._event(
                    "scaler_bound",
                    scaler_id=key[0],
                    optimizer_id=id(optimizer),
                    optimizer_class=type(optimizer).__name__,
                )
        for device, dtype, enabled, site in facts.autocast_new:
            self._event("autocast_seen", device=device, dtype=dtype, enabled=enabled, site=site)
        record["opt_steps"] = facts.opt_steps
        record["loss_dtype"] = facts.loss_dtype
        record["scaler_enabled"] = facts.scaler_enabled
        loss = facts.loss
        if loss is not None:
            record["loss"] = loss
        if facts.detail:  # the protocol's details are gathered on detail steps only
            record["unscale_calls"] = facts.unscale_calls
            record["clip_calls"] = facts.clip_calls
            record["clip_scaled"] = facts.clip_scaled
            autocast = facts.autocast
            if autocast is not None:
                record["autocast_device"], record["autocast_dtype"] = autocast
        scale = facts.scale_before
        if scale is not None:
            record["scale_before"] = scale
            record["scale_after"] = facts.scale_after
            if facts.growth_tracker is not None:
                record["growth_tracker"] = facts.growth_tracker
        found = facts.found_inf
        if found is not None:
            record["found_inf"] = found
            record["skipped"] = found > 0
        else:
            record["skipped"] = False

    def _read_once(self) -> None:
        """The framework's AMP setting at the first step's fold (a callback may have set it),
        and the sharding setting once a model is known (discovery: step 1)."""
        if not self._framework_read:
            self._framework_read = True
            framework = framework_amp_facts()
            if framework and "framework" not in self.probe.rank_manifest:
                self.probe.annotate_manifest(**framework)
        if self._models:
            self._sharding_read = True
            self._read_sharding()
