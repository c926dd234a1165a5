"""GradScaler and step telemetry.

Observes every ``torch.amp.GradScaler`` and optimizer in the process through class-level
wrappers and PyTorch's global optimizer step hooks, without changing what they compute and
without a host-device sync of its own: the scale, growth tracker and found-inf values are
cloned on their device and read back by the probe at flush.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.amp import GradScaler
from torch.amp.autocast_mode import autocast
from torch.optim import Optimizer
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from amprobe.collectors.base import Collector
from amprobe.collectors.patching import Patch, patch

__all__ = ["ScalerCollector"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_AMPROBE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEMO_DIR = os.path.join(_AMPROBE_DIR, "demo")
_MAX_EVENTS_PER_KIND = 50  # per-step facts live in the steps table; events only sample them
_serial = itertools.count(1)
# frames that torch's decorators (no_grad and friends) put between clip_grad_norm_ and its helper
_DECORATOR_FRAMES = frozenset({"_no_grad_wrapper", "decorate_context", "wrapper", "inner"})


def user_call_site(depth: int = 2) -> str | None:
    """``file:line`` of the first caller outside torch and amprobe (no tensor work)."""
    try:
        frame = sys._getframe(depth)
    except ValueError:
        return None
    while frame is not None:
        filename = frame.f_code.co_filename
        own = filename.startswith(_AMPROBE_DIR) and not filename.startswith(_DEMO_DIR)
        if not (filename.startswith(_TORCH_DIR) or own):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return str(dtype).replace("torch.", "") if dtype is not None else None


def _inside_unwrapped_scaler_step() -> bool:
    """True inside a ``GradScaler.step`` entered before the probe patched it (a live attach).

    Checked once per process, while the step-boundary mode is still undecided: the optimizer
    step is then the scaler's, and the following ``update()`` owns the step boundary.
    """
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "step" and code.co_filename.endswith("grad_scaler.py"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _Iteration:
    """What one training iteration did, as seen by the wrappers."""

    __slots__ = (
        "opt_steps",
        "unscale_calls",
        "clip_calls",
        "clip_scaled",
        "loss",
        "loss_count",
        "loss_dtype",
        "autocast",
        "scaled",
        "unscaled_opts",
        "scale_fields",
    )

    def __init__(self) -> None:
        self.opt_steps = 0
        self.unscale_calls = 0
        self.clip_calls = 0
        self.clip_scaled = 0
        self.loss: torch.Tensor | None = None
        self.loss_count = 0
        self.loss_dtype: str | None = None
        self.autocast: tuple[str, str | None] | None = None
        self.scaled: list[GradScaler] = []
        self.unscaled_opts: list[Optimizer] = []
        self.scale_fields: dict[str, Any] | None = None


class ScalerCollector(Collector):
    """Records the loss-scale trajectory, skipped steps and AMP protocol misuse.

    Per step (``steps`` table): ``scale_before`` and ``scale_after`` (the loss scale before
    and after ``update()``), ``growth_tracker``, ``found_inf`` (number of optimizer/device
    inf checks that found inf/NaN), ``skipped`` (the update was not applied), ``opt_steps``
    (optimizer steps that ran), ``unscale_calls``, ``clip_calls``, ``clip_scaled`` (clip calls
    that saw still-scaled gradients), ``loss`` (the mean over the step's micro-batches) and
    ``loss_dtype``, ``autocast_device`` and
    ``autocast_dtype`` (the last autocast region entered).

    Events: ``scaler_created`` (call site, init_scale, growth/backoff factors, interval),
    ``scaler_bound`` (scaler used with an optimizer), ``optimizer_seen`` (class, parameter
    dtypes, fused), ``scaler_state_loaded``, ``optimizer_state_loaded``,
    ``clip_before_unscale``, ``autocast_seen`` (each distinct device/dtype/enabled).

    Step boundaries: the ``update()`` of the first GradScaler used, else the ``step()`` of the
    first optimizer that steps. A skipped iteration is still an iteration.

    Cost: a few Python calls and three 0-d tensor clones per iteration; no sync. While the
    probe is dormant, only the step-boundary bodies run (no clone, no record): a few attribute
    reads per wrapped call.
    """

    name = "scaler"

    def on_attach(self, probe: Any) -> None:
        super().on_attach(probe)
        self._it = _Iteration()
        self._mode: str | None = None  # "scaler" | "optimizer"
        self._primary_scaler: weakref.ReferenceType[GradScaler] | None = None
        self._primary_used = False
        self._primary_opt: weakref.ReferenceType[Optimizer] | None = None
        self._in_scaler_step = threading.local()
        self._seen_opts: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self._seen_scalers: weakref.WeakSet[GradScaler] = weakref.WeakSet()
        self._bound: set[tuple[int, int]] = set()
        self._autocast_seen: set[tuple[str, str | None, bool]] = set()
        self._event_counts: Counter[str] = Counter()
        self._originals: list[Patch] = []
        self._handles: list[Any] = []
        self._install()

    # -- installation -------------------------------------------------------------------------
    def _patch(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        self._originals.append(patch(owner, attr, make))

    def _install(self) -> None:
        c = self
        probe = self.probe

        def guard(fn: Callable[..., None], *args: Any) -> None:
            # bodies that only record: skipped at once while the probe is dormant
            if not probe.recording or probe.closed or not c.probe.is_enabled(c.name):
                return
            try:
                fn(*args)
            except Exception as exc:
                probe.collector_failed(c.name, exc)

        def guard_always(fn: Callable[..., None], *args: Any) -> None:
            # bodies that find step boundaries (or rare facts): run while dormant too
            if probe.closed or not c.probe.is_enabled(c.name):
                return
            try:
                fn(*args)
            except Exception as exc:
                probe.collector_failed(c.name, exc)

        def wrap_init(orig: Any) -> Any:
            def __init__(self: GradScaler, *args: Any, **kwargs: Any) -> None:
                orig(self, *args, **kwargs)
                guard_always(c._on_scaler_created, self, user_call_site(2))

            return __init__

        def wrap_scale(orig: Any) -> Any:
            def scale(self: GradScaler, outputs: Any) -> Any:
                result = orig(self, outputs)
                guard_always(c._on_scale, self, outputs)
                return result

            return scale

        def wrap_unscale(orig: Any) -> Any:
            def unscale_(self: GradScaler, optimizer: Optimizer) -> None:
                orig(self, optimizer)
                guard(c._on_unscale, self, optimizer)

            return unscale_

        def wrap_step(orig: Any) -> Any:
            def step(self: GradScaler, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
                guard_always(c._on_scaler_step, self, optimizer)
                depth = getattr(c._in_scaler_step, "depth", 0)
                c._in_scaler_step.depth = depth + 1
                try:
                    return orig(self, optimizer, *args, **kwargs)
                finally:
                    c._in_scaler_step.depth = depth

            return step

        def wrap_update(orig: Any) -> Any:
            def update(self: GradScaler, new_scale: Any = None) -> None:
                before: dict[str, Any] = {}
                guard_always(c._before_update, self, before)
                orig(self, new_scale)
                guard_always(c._after_update, self, before)

            return update

        def wrap_scaler_load(orig: Any) -> Any:
            def load_state_dict(self: GradScaler, state_dict: dict[str, Any]) -> None:
                orig(self, state_dict)
                guard_always(c._on_scaler_loaded, self, state_dict)

            return load_state_dict

        def wrap_opt_load(orig: Any) -> Any:
            def load_state_dict(self: Optimizer, state_dict: dict[str, Any]) -> None:
                orig(self, state_dict)
                guard_always(c._on_optimizer_loaded, self)

            return load_state_dict

        def wrap_autocast_enter(orig: Any) -> Any:
            def __enter__(self: autocast) -> Any:
                result = orig(self)
                guard(c._on_autocast, self)
                return result

            return __enter__

        def wrap_backward(orig: Any) -> Any:
            def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                guard(c._on_backward, self)
                return orig(self, *args, **kwargs)

            return backward

        import torch.nn.utils.clip_grad as clip_grad

        def wrap_group(orig: Any) -> Any:
            def _group_tensors_by_device_and_dtype(
                tensorlistlist: Any, *args: Any, **kwargs: Any
            ) -> Any:
                guard(c._maybe_clip, tensorlistlist)
                return orig(tensorlistlist, *args, **kwargs)

            return _group_tensors_by_device_and_dtype

        self._patch(GradScaler, "__init__", wrap_init)
        self._patch(GradScaler, "scale", wrap_scale)
        self._patch(GradScaler, "unscale_", wrap_unscale)
        self._patch(GradScaler, "step", wrap_step)
        self._patch(GradScaler, "update", wrap_update)
        self._patch(GradScaler, "load_state_dict", wrap_scaler_load)
        self._patch(Optimizer, "load_state_dict", wrap_opt_load)
        self._patch(autocast, "__enter__", wrap_autocast_enter)
        self._patch(torch.Tensor, "backward", wrap_backward)
        if hasattr(clip_grad, "_group_tensors_by_device_and_dtype"):
            self._patch(clip_grad, "_group_tensors_by_device_and_dtype", wrap_group)
        self._handles.append(
            register_optimizer_step_pre_hook(
                lambda opt, args, kwargs: guard_always(c._on_opt_pre, opt)
            )
        )
        self._handles.append(
            register_optimizer_step_post_hook(
                lambda opt, args, kwargs: guard_always(c._on_opt_post, opt)
            )
        )

    def on_close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for handle in reversed(self._originals):
            handle.remove()
        self._originals.clear()

    def on_object(self, obj: Any) -> None:
        if isinstance(obj, GradScaler):
            self._see_scaler(obj, site=None)
        elif isinstance(obj, Optimizer):
            self._see_optimizer(obj)

    # -- events -------------------------------------------------------------------------------
    def _event(self, kind: str, **detail: Any) -> None:
        self._event_counts[kind] += 1
        if self._event_counts[kind] <= _MAX_EVENTS_PER_KIND:
            self.probe.event(kind, **detail)

    def _see_scaler(self, scaler: GradScaler, site: str | None) -> int:
        sid = getattr(scaler, "_amprobe_id", None)
        if sid is None:
            sid = next(_serial)
            scaler._amprobe_id = sid  # type: ignore[attr-defined]
        if scaler not in self._seen_scalers:
            self._seen_scalers.add(scaler)
            self._event(
                "scaler_created",
                scaler_id=sid,
                site=site,
                created_before_attach=site is None,
                enabled=bool(getattr(scaler, "_enabled", True)),
                device=str(getattr(scaler, "_device", "cuda")),
                init_scale=getattr(scaler, "_init_scale", None),
                growth_factor=getattr(scaler, "_growth_factor", None),
                backoff_factor=getattr(scaler, "_backoff_factor", None),
                growth_interval=getattr(scaler, "_growth_interval", None),
            )
        return sid

    def _see_optimizer(self, opt: Optimizer) -> None:
        if opt in self._seen_opts:
            return
        self._seen_opts.add(opt)
        dtypes: Counter[str] = Counter()
        trainable_half = 0
        n_params = 0
        device = None
        for group in opt.param_groups:
            for p in group["params"]:
                if device is None:
                    device = p.device
                if p.requires_grad:
                    dtypes[_dtype_name(p.dtype) or "?"] += p.numel()
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

    # -- wrapper bodies (run under guard) -------------------------------------------------------
    def _on_scaler_created(self, scaler: GradScaler, site: str | None) -> None:
        self._see_scaler(scaler, site=site or "?")

    def _on_scale(self, scaler: GradScaler, outputs: Any) -> None:
        if not self.probe.recording:  # dormant: only what finding the step boundary needs
            if self._primary_scaler is not None and self._primary_scaler() is scaler:
                self._primary_used = True
            return
        self.probe.touch()
        self._see_scaler(scaler, site=None)
        it = self._it
        if scaler not in it.scaled:
            it.scaled.append(scaler)
        if self._primary_scaler is not None and self._primary_scaler() is scaler:
            self._primary_used = True
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            self._capture_loss(outputs)

    def _capture_loss(self, loss: torch.Tensor) -> None:
        """Keep the loss on its device; with gradient accumulation, the step's mean over micro-batches."""
        it = self._it
        if it.loss_dtype is None:
            it.loss_dtype = _dtype_name(loss.dtype)
        if self.probe.config.capture_loss and self.probe.recording:
            value = loss.detach().reshape(()).float()
            it.loss = value if it.loss is None else it.loss + value.to(it.loss.device)
            it.loss_count += 1

    def _on_backward(self, tensor: torch.Tensor) -> None:
        self.probe.touch()
        it = self._it
        if not it.scaled and tensor.numel() == 1:
            self._capture_loss(tensor)

    def _on_unscale(self, scaler: GradScaler, optimizer: Optimizer) -> None:
        self._it.unscale_calls += 1
        self._it.unscaled_opts.append(optimizer)

    def _on_scaler_step(self, scaler: GradScaler, optimizer: Optimizer) -> None:
        if self._mode is None:
            self._mode = "scaler"
        sid = self._see_scaler(scaler, site=None)
        self._see_optimizer(optimizer)
        key = (sid, id(optimizer))
        if key not in self._bound:
            self._bound.add(key)
            self._event(
                "scaler_bound",
                scaler_id=sid,
                optimizer_id=id(optimizer),
                optimizer_class=type(optimizer).__name__,
            )

    def _before_update(self, scaler: GradScaler, before: dict[str, Any]) -> None:
        if self._mode is None:
            self._mode = "scaler"
        primary = self._primary_scaler() if self._primary_scaler is not None else None
        if primary is None or (primary is not scaler and not self._primary_used):
            # first scaler, or the old one is no longer used (a scaler rebuilt in the loop)
            self._primary_scaler = weakref.ref(scaler)
        current = self._primary_scaler
        if current is None or current() is not scaler or not self.probe.recording:
            return
        enabled = bool(getattr(scaler, "_enabled", True))
        before["enabled"] = enabled
        scale = getattr(scaler, "_scale", None)
        if enabled and isinstance(scale, torch.Tensor):
            before["scale_before"] = scale.detach().clone()
            found = [
                f
                for state in scaler._per_optimizer_states.values()
                for f in state.get("found_inf_per_device", {}).values()
            ]
            if found:
                total = found[0].to(scale.device, non_blocking=True).clone()
                for f in found[1:]:
                    total += f.to(scale.device, non_blocking=True)
                before["found_inf"] = total

    def _after_update(self, scaler: GradScaler, before: dict[str, Any]) -> None:
        if self._primary_scaler is None or self._primary_scaler() is not scaler:
            return
        if self._mode != "scaler":
            return
        self._primary_used = False
        if self.probe.recording:
            fields: dict[str, Any] = {"scaler_enabled": before.get("enabled", False)}
            if "scale_before" in before:
                fields["scale_before"] = before["scale_before"]
                fields["scale_after"] = scaler._scale.detach().clone()  # type: ignore[union-attr]
                tracker = getattr(scaler, "_growth_tracker", None)
                if isinstance(tracker, torch.Tensor):
                    fields["growth_tracker"] = tracker.detach().clone()
            if "found_inf" in before:
                fields["found_inf"] = before["found_inf"]
                fields["skipped"] = before["found_inf"] > 0
            self._it.scale_fields = fields
        self.probe.end_step()

    def _on_scaler_loaded(self, scaler: GradScaler, state_dict: dict[str, Any]) -> None:
        sid = self._see_scaler(scaler, site=None)
        scale = state_dict.get("scale") if isinstance(state_dict, dict) else None
        self._event(
            "scaler_state_loaded",
            scaler_id=sid,
            scale=scale if isinstance(scale, (int, float)) else None,
            empty=not state_dict,
        )

    def _on_optimizer_loaded(self, opt: Optimizer) -> None:
        self._event(
            "optimizer_state_loaded", optimizer_id=id(opt), optimizer_class=type(opt).__name__
        )

    def _on_autocast(self, ctx: autocast) -> None:
        self.probe.touch()
        device = str(getattr(ctx, "device", "?"))
        dtype = _dtype_name(getattr(ctx, "fast_dtype", None))
        enabled = bool(getattr(ctx, "_enabled", True))
        if enabled:
            self._it.autocast = (device, dtype)
        key = (device, dtype, enabled)
        if key not in self._autocast_seen:
            self._autocast_seen.add(key)
            self._event(
                "autocast_seen", device=device, dtype=dtype, enabled=enabled, site=user_call_site(3)
            )

    def _on_opt_pre(self, opt: Optimizer) -> None:
        if self.probe.recording:
            self.probe.touch()
        self._see_optimizer(opt)

    def _on_opt_post(self, opt: Optimizer) -> None:
        self._it.opt_steps += 1
        if (
            self._mode is None
            and getattr(self._in_scaler_step, "depth", 0) == 0
            and not _inside_unwrapped_scaler_step()
        ):
            self._mode = "optimizer"
            self._primary_opt = weakref.ref(opt)
        if (
            self._mode == "optimizer"
            and self._primary_opt is not None
            and self._primary_opt() is opt
        ):
            self.probe.end_step()

    def _maybe_clip(self, tensorlistlist: Any) -> None:
        caller: Any = sys._getframe(1)
        while caller is not None and not caller.f_code.co_filename.endswith("clip_grad.py"):
            caller = caller.f_back  # skip amprobe's own wrapper frames
        if caller is None:
            return
        name = caller.f_code.co_name
        if name == "_get_total_norm":
            outer = caller.f_back
            while outer is not None and outer.f_code.co_name in _DECORATOR_FRAMES:
                outer = outer.f_back
            if outer is None or outer.f_code.co_name != "clip_grad_norm_":
                return
            function = "clip_grad_norm_"
        elif name == "clip_grad_value_":
            function = "clip_grad_value_"
        else:
            return
        grads = tensorlistlist[0] if tensorlistlist else []
        it = self._it
        it.clip_calls += 1
        scaled_by = [s for s in it.scaled if getattr(s, "_enabled", False)]
        if not scaled_by:
            return
        unscaled = {
            id(p.grad)
            for opt in it.unscaled_opts
            for group in opt.param_groups
            for p in group["params"]
            if p.grad is not None
        }
        if any(id(g) not in unscaled for g in grads):
            it.clip_scaled += 1
            self._event("clip_before_unscale", function=function, site=user_call_site(3))

    # -- per-step record ------------------------------------------------------------------------
    def on_recording(self, active: bool) -> None:
        self._it = _Iteration()  # the first recorded step starts clean at this boundary

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        it = self._it
        self._it = _Iteration()
        record.update(
            opt_steps=it.opt_steps,
            unscale_calls=it.unscale_calls,
            clip_calls=it.clip_calls,
            clip_scaled=it.clip_scaled,
            loss_dtype=it.loss_dtype,
        )
        if it.loss is not None:
            record["loss"] = it.loss / it.loss_count if it.loss_count > 1 else it.loss
        if it.autocast is not None:
            record["autocast_device"], record["autocast_dtype"] = it.autocast
        if it.scale_fields is not None:
            record.update(it.scale_fields)
        record.setdefault("scaler_enabled", False)
        record.setdefault("skipped", False)
