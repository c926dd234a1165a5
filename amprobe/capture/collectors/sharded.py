"""Sharded and wrapped models: what FSDP2, DDP and module wrappers change about what is recorded.

Read from objects already in memory, never through ``torch.distributed`` (amprobe makes no
collective call and imports none): FSDP2 modules are recognised by their ``_get_fsdp_state``
method, DTensors by their ``to_local`` method, DDP by its ``_comm_hooks`` list.

* :func:`local_tensor`: a DTensor's local shard, where its data lives (no communication), so
  per-layer numerics measure the shard each rank holds;
* :func:`user_model`: the user's model inside the wrappers around it (DDP's ``module``, FSDP1's
  ``_fsdp_wrapped_module``, torch.compile's ``_orig_mod``, ...): layers are named from it, so a
  layer has the same name on every engine (``blocks.1.mlp``, never ``module.blocks.1.mlp``);
* :func:`user_module_name`: a module's qualified name without the wrapper segments that FSDP1
  and activation checkpointing insert (``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``);
* :func:`sharding_facts`: the ``MixedPrecisionPolicy`` of an FSDP2 model (or a DDP model's
  half-precision compression hook) as manifest facts: the job's precision setting, and how its
  gradients are reduced across ranks (AMP-D03 reads ``grad_reduce``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = [
    "PLAIN_TENSORS",
    "WRAPPER_SEGMENTS",
    "local_tensor",
    "sharding_facts",
    "user_class_name",
    "user_model",
    "user_module_name",
    "wrapped_module",
    "wrapper_classes",
]

#: name segments that module wrappers insert between the user's module and its parent
WRAPPER_SEGMENTS = frozenset(
    {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_offload_wrapped_module", "_orig_mod"}
)
#: module wrappers that hold the user's model as one child, by class name (any class in the MRO):
#: the child's attribute. Recognised by name, so no engine is imported to tell them.
WRAPPER_ATTRS = {
    "DistributedDataParallel": "module",  # torch's and Megatron-core's
    "DataParallel": "module",
    "Float16Module": "module",  # Megatron-core
    "DeepSpeedEngine": "module",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",  # FSDP1
    "ActivationWrapper": "_checkpoint_wrapped_module",  # checkpoint and offload wrappers
    "OptimizedModule": "_orig_mod",  # torch.compile(module)
}
_MAX_WRAPPERS = 8  # wrappers around wrappers: never more than a few
#: DDP communication hooks that reduce gradients in half precision (name -> dtype)
_DDP_HALF_HOOKS = {
    "fp16_compress_hook": "float16",
    "fp16_compress_wrapper_hook": "float16",
    "bf16_compress_hook": "bfloat16",
    "bf16_compress_wrapper_hook": "bfloat16",
}
#: tensor types that are their own values (a subclass, DTensor included, may not be: its data
#: pointer and storage are not the values it stands for)
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def local_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x``'s local shard when it is a DTensor (no communication, no copy), else ``x``.

    Cost: one type check for a plain tensor; ``to_local()`` under ``no_grad`` returns the
    DTensor's local tensor as is.
    """
    if type(x) in PLAIN_TENSORS:
        return x
    to_local = getattr(x, "to_local", None)
    if to_local is None:
        return x
    with torch.no_grad():
        local: torch.Tensor = to_local()
    return local


def wrapped_module(module: Any) -> torch.nn.Module | None:
    """The module a wrapper (:data:`WRAPPER_ATTRS`) holds; ``None`` when ``module`` is none."""
    if not isinstance(module, torch.nn.Module):
        return None
    for cls in type(module).__mro__:
        attr = WRAPPER_ATTRS.get(cls.__name__)
        if attr is not None:
            inner = module._modules.get(attr)
            return inner if isinstance(inner, torch.nn.Module) else None
    return None


def user_model(module: Any) -> Any:
    """The user's model inside the wrappers around ``module`` (``DDP(torch.compile(net))`` ->
    ``net``); ``module`` itself when it wraps nothing. Its ``named_modules()`` are the layer
    names as the user's code writes them."""
    for _ in range(_MAX_WRAPPERS):
        inner = wrapped_module(module)
        if inner is None:
            break
        module = inner
    return module


def wrapper_classes(module: Any) -> list[str]:
    """The classes of the wrappers around the user's model, outermost first (``[]``: none)."""
    names: list[str] = []
    for _ in range(_MAX_WRAPPERS):
        inner = wrapped_module(module)
        if inner is None:
            break
        names.append(type(module).__name__)
        module = inner
    return names


def user_module_name(name: str) -> str:
    """``"layers.0._checkpoint_wrapped_module.attn"`` -> ``"layers.0.attn"`` (also drops
    torch.compile's ``_orig_mod``)."""
    if "_wrapped_module" not in name and "_orig_mod" not in name:
        return name
    return ".".join(s for s in name.split(".") if s not in WRAPPER_SEGMENTS)


def user_class_name(module: Any) -> str:
    """The class the user wrote: ``fully_shard`` swaps a module's class for a generated
    ``FSDP<Name>(FSDPModule, <Name>)``; that one is named by ``<Name>``. A wrapper (DDP,
    torch.compile's ``OptimizedModule``, :data:`WRAPPER_ATTRS`) is named by the module it
    wraps."""
    cls = type(user_model(module))
    mro = cls.__mro__
    if len(mro) > 2 and mro[1].__name__ == "FSDPModule" and hasattr(cls, "_get_fsdp_state"):
        return mro[2].__name__
    return cls.__name__


def _dtype(dtype: Any) -> str | None:
    return str(dtype).replace("torch.", "") if dtype is not None else None


def _fsdp_pre_divide(world: int, reduce_dtype: str | None) -> float:
    """What FSDP2 divides each rank's gradient by before a fp16 reduction (its own rule: a
    power of two near sqrt(world), the rest after); bf16/fp32 reduce with AVG (1: sum first)."""
    if reduce_dtype != "float16":
        return 1.0
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    return float(pre)


def _fsdp_facts(model: torch.nn.Module) -> dict[str, Any] | None:
    policies: dict[tuple[str | None, str | None, str | None], int] = {}
    world = 0
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        policy = getattr(state, "_mp_policy", None)
        if policy is None:
            continue
        param = _dtype(getattr(policy, "param_dtype", None))
        # FSDP2 reduces in the compute dtype when reduce_dtype is None
        reduce = _dtype(getattr(policy, "reduce_dtype", None)) or param
        key = (param, reduce, _dtype(getattr(policy, "output_dtype", None)))
        policies[key] = policies.get(key, 0) + 1
        group = getattr(state, "_fsdp_param_group", None)
        mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
        if mesh is not None and not world:
            world = int(mesh.size())
    if not policies:
        return None
    world = world or int(os.environ.get("WORLD_SIZE", "1") or 1)
    (param, reduce, output), _ = max(policies.items(), key=lambda kv: kv[1])
    setting = "MixedPrecisionPolicy(" + ", ".join(
        f"{k}=torch.{v}"
        for k, v in (("param_dtype", param), ("reduce_dtype", reduce), ("output_dtype", output))
        if v is not None
    )
    facts: dict[str, Any] = {
        "framework": "fsdp2",
        "framework_precision": param or "float32",
        "framework_precision_setting": setting + ")",
        "framework_casts_params": True,  # precision set by casting parameters, not autocast
        "fsdp_mp_policy": {"param_dtype": param, "reduce_dtype": reduce, "output_dtype": output},
        "fsdp_mp_policies": len(policies),
    }
    if param in ("float16", "bfloat16"):
        facts["framework_amp_dtype"] = param
    if reduce is not None:
        facts["grad_reduce"] = {
            "dtype": reduce,
            "world_size": world,
            "pre_divide": _fsdp_pre_divide(world, reduce),
            "source": f"FSDP2 MixedPrecisionPolicy(reduce_dtype=torch.{reduce})",
            # FSDP2 calls a sharded parameter's post-accumulate-grad hooks after the
            # reduce-scatter: the recorded gradient is the reduced mean of the ranks
            "measured": "reduced",
        }
    return facts


def _ddp_facts(model: torch.nn.Module) -> dict[str, Any] | None:
    hooks = getattr(model, "_comm_hooks", None)
    if not isinstance(hooks, list) or not hasattr(model, "process_group"):
        return None
    for item in hooks:
        hook = item[0] if isinstance(item, tuple) and item else item
        name = getattr(hook, "__name__", "") or getattr(getattr(hook, "func", None), "__name__", "")
        dtype = _DDP_HALF_HOOKS.get(name)
        if dtype is None:
            continue
        world = 1
        size = getattr(getattr(model, "process_group", None), "size", None)
        if callable(size):
            world = int(size())
        return {
            "grad_reduce": {
                "dtype": dtype,
                "world_size": world,
                # the hook casts the local bucket to half, then divides by the world size
                "pre_divide": float(world),
                "source": f"DDP communication hook {name}",
                "measured": "local",
            }
        }
    return None


def sharding_facts(model: torch.nn.Module) -> dict[str, Any]:
    """Manifest facts about how ``model`` is sharded and reduced; empty for a plain model.

    FSDP2 (``fully_shard``): ``framework="fsdp2"``, its ``MixedPrecisionPolicy`` as the job's
    precision setting (``framework_precision_setting``, ``framework_amp_dtype`` = param dtype,
    ``framework_casts_params``, ``fsdp_mp_policy``) and ``grad_reduce``. A DDP model with a
    half-precision compression hook: ``grad_reduce``. ``grad_reduce`` holds ``dtype``,
    ``world_size``, ``pre_divide`` (what each rank's gradient is divided by before the sum) and
    ``measured`` (``reduced``: the recorded gradients are the reduced mean; ``local``: each
    rank's own). Never raises.
    """
    try:
        return _fsdp_facts(model) or _ddp_facts(model) or {}
    except Exception:
        return {}
