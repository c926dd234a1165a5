"""The checkpoint guard: a save of parameters or optimizer state holding inf/NaN (AMP-N18).

:class:`CheckpointGuard` (one per hub, ``hub.checkpoints``) wraps, in the hub's install stack
(removed with the rest at close), the calls that write a checkpoint:

* ``torch.save`` (and ``torch.serialization.save``) of a module, an optimizer, or a dict/list
  holding state dicts (a module's, an optimizer's), at any depth; a bare tensor or a list of
  bare tensors is data, not a checkpoint, and is passed on unchecked;
* ``torch.distributed.checkpoint.save`` and ``async_save`` (checked before the call; an
  asynchronous save's staging and writing come after);
* the Hugging Face Trainer's ``_save_checkpoint`` (model, and optimizer state unless
  ``save_only_model``) and ``save_model`` (the model: it writes safetensors, so ``torch.save``
  never sees it; its ``on_save`` callback runs after the write, too late to refuse it);
* Lightning's ``Trainer.save_checkpoint`` (``lightning.pytorch`` and ``pytorch_lightning``;
  its ``ModelCheckpoint`` callback saves through it).

DCP and the frameworks are wrapped once the program has imported them: at attach, when an
optimizer is built, when a recording window opens, and at each checked ``torch.save``.

What is checked: parameters and optimizer state, not buffers (a causal mask of -inf, a
torch.ao observer's min_val=+inf and max_val=-inf before calibration are healthy). A module
saved whole gives its parameters; in a state dict (``model.state_dict()``, or one inside
``{"model": ..., "optimizer": ...}``) the tensors that are buffers of a module amprobe knows
(the root models and their submodules, matched by storage at save time) are skipped; the rest
of a mapping of tensors is checked (the buffers of a model amprobe never saw run included).

What a check does: every floating-point tensor so chosen (a DTensor's local shard, on
any device; tied tensors once) is reduced to its minimum and maximum (``torch.aminmax``: one
read of each tensor, no copy of it), and the flags are read back once per device: **one pass
over the saved tensors and, on an accelerator, one host-device sync per save**, at save time.
A step that saves nothing runs none of this: no per-step cost at all. A poisoned save costs
a second read of its first :data:`MAX_NAMED_TENSORS` poisoned tensors (their inf and NaN counts).

What it records (events, on the saving rank):

* ``checkpoint_saved``: a save whose tensors are all finite: ``path`` (the path argument as a
  string; a file object's ``name``, else ``"<file object>"``), ``function`` (the save called),
  ``tensor_count`` (the floating tensors checked), ``written`` (False where a DCP save was
  refused because another rank held inf/NaN);
* ``checkpoint_nonfinite``: a save holding inf/NaN: as above, plus ``tensors`` (the first
  :data:`MAX_NAMED_TENSORS`: ``tensor``, the key path as ``model.layers.0.weight`` or
  ``optimizer.state.3.exp_avg``, ``inf_count``, ``nan_count``, ``numel``),
  ``nonfinite_tensor_count`` and ``refused`` (``checkpoint_guard="raise"``);
* ``checkpoint_check_failed``: the check itself failed (once per run); the save went on.

With ``checkpoint_guard="raise"`` a poisoned save raises
:class:`~amprobe.errors.PoisonedCheckpointError` before the save function runs: no file, and
for DCP no directory or shard file, is written. A DCP save is collective: the ranks all-reduce
one flag over the save's process group (the default one unless given; a CPU tensor on gloo,
the current CUDA device otherwise) so that every rank raises or none does; that costs one small
collective per DCP save while ``checkpoint_guard="raise"``. The Trainer's and Lightning's saves
(``_save_checkpoint``, ``save_checkpoint``) are called on every rank (the main process
writes), so their ranks agree the same way (their weights may be sharded: FSDP). So does the
Trainer's ``save_model`` on a distributed Trainer with sharded weights (FSDP or DeepSpeed: it
gathers them on every rank; a rank raising alone would leave the others waiting in the
gather). Elsewhere ``save_model`` (DDP: the same weights on every rank, and it may be called
on the main process only) and ``torch.save`` (a job often saves on rank 0 only) are not
collective: each rank decides alone.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from amprobe.capture.install import Installed
from amprobe.errors import PoisonedCheckpointError

if TYPE_CHECKING:
    from amprobe.capture.dispatch import Dispatcher
    from amprobe.capture.probe import Probe

__all__ = ["MAX_NAMED_TENSORS", "CheckpointGuard", "PoisonedCheckpointError", "buffer_keys", "scan"]

#: poisoned tensors a ``checkpoint_nonfinite`` event (and the guard's error) names
MAX_NAMED_TENSORS = 5
#: how deep a saved object is walked for tensors (an optimizer state dict is 3 levels deep)
_MAX_DEPTH = 12
#: the frameworks' checkpoint saves: framework -> (the module defining its Trainer, methods);
#: wrapped once that module is imported (never imported by amprobe)
_FRAMEWORKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "transformers": ("transformers.trainer", ("_save_checkpoint", "save_model")),
    "lightning.pytorch": ("lightning.pytorch.trainer.trainer", ("save_checkpoint",)),
    "pytorch_lightning": ("pytorch_lightning.trainer.trainer", ("save_checkpoint",)),
}
_DCP = "torch.distributed.checkpoint"
#: what a framework's save writes could not be read (the check is counted as failed)
_UNREAD = object()


class Scan:
    """The result of checking one save's tensors (see :func:`scan`).

    Attributes:
        tensor_count: floating tensors checked.
        nonfinite: ``(name, tensor)`` of every tensor holding inf/NaN, in walk order.
        is_checkpoint: the saved object held a module, an optimizer or a mapping of tensors.
    """

    def __init__(self) -> None:
        self.tensor_count = 0
        self.nonfinite: list[tuple[str, torch.Tensor]] = []
        self.is_checkpoint = False

    def named(self) -> list[dict[str, Any]]:
        """The first :data:`MAX_NAMED_TENSORS` poisoned tensors with their inf/NaN counts (reads
        each of them once more; on an accelerator, one sync per tensor: a poisoned save only)."""
        out = []
        for name, t in self.nonfinite[:MAX_NAMED_TENSORS]:
            out.append(
                {
                    "tensor": name,
                    "inf_count": int(torch.isinf(t).sum()),
                    "nan_count": int(torch.isnan(t).sum()),
                    "numel": int(t.numel()),
                }
            )
        return out


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose values this rank holds (a DTensor's local shard), or None when it
    holds none to read (a meta or fake tensor, not floating point)."""
    to_local = getattr(t, "to_local", None)
    if to_local is not None and callable(to_local):
        t = to_local()
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return None
    return t.detach()


def _walk(
    obj: Any, prefix: str, depth: int, seen: set[int], out: Scan
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key path, tensor)`` of every floating tensor in ``obj``."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen.add(id(obj))
            yield prefix, obj
        return
    if depth > _MAX_DEPTH or id(obj) in seen:
        return
    dot = f"{prefix}." if prefix else ""
    if isinstance(obj, torch.nn.Module):
        seen.add(id(obj))
        out.is_checkpoint = True
        # parameters only, never state_dict() (its hooks may gather sharded weights); buffers
        # are no parameters: a causal mask of -inf, an uncalibrated observer's ±inf are healthy
        for name, t in obj.named_parameters():
            yield from _walk(t, dot + name, depth + 1, seen, out)
    elif isinstance(obj, torch.optim.Optimizer):
        seen.add(id(obj))
        out.is_checkpoint = True
        yield from _optimizer_state(obj, f"{dot}state", depth, seen, out)
    elif isinstance(obj, Mapping):
        seen.add(id(obj))
        for key, value in obj.items():
            if isinstance(value, torch.Tensor):
                out.is_checkpoint = True
            yield from _walk(value, dot + str(key), depth + 1, seen, out)
    elif isinstance(obj, (list, tuple)):
        seen.add(id(obj))
        for i, value in enumerate(obj):
            yield from _walk(value, f"{dot}{i}", depth + 1, seen, out)


def _optimizer_state(
    opt: torch.optim.Optimizer, prefix: str, depth: int, seen: set[int], out: Scan
) -> Iterator[tuple[str, torch.Tensor]]:
    """An optimizer's state named as its ``state_dict()`` names it (``state.3.exp_avg``: the
    parameter's index over the param groups), read without building the state dict."""
    index = 0
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if state:
                yield from _walk(state, f"{prefix}.{index}", depth + 1, seen, out)
            index += 1


def _unwrap_optimizer(opt: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``)."""
    for _ in range(4):
        if opt is None or isinstance(opt, torch.optim.Optimizer):
            return opt
        opt = getattr(opt, "optimizer", None) or getattr(opt, "_optimizer", None)
    return opt


def _storage_key(tensor: Any) -> tuple[Any, ...] | None:
    """Where a tensor's values lie (device, data pointer, dtype, shape, strides): the same for a
    module's buffer and the detached copy its ``state_dict()`` holds. None when unreadable."""
    t = _local(tensor) if isinstance(tensor, torch.Tensor) else None
    if t is None:
        return None
    try:
        return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
    except Exception:  # a fake or functional tensor: no storage to name
        return None


def buffer_keys(models: Iterable[torch.nn.Module]) -> frozenset[tuple[Any, ...]]:
    """The storage keys of the buffers of ``models`` and their submodules, less any that a
    parameter shares (a parameter is always checked)."""
    buffers: set[tuple[Any, ...]] = set()
    params: set[tuple[Any, ...]] = set()
    for model in models:
        for b in model.buffers():
            key = _storage_key(b)
            if key is not None:
                buffers.add(key)
        for p in model.parameters():
            key = _storage_key(p)
            if key is not None:
                params.add(key)
    return frozenset(buffers - params)


def scan(obj: Any, skip: frozenset[tuple[Any, ...]] = frozenset()) -> Scan:
    """Check every floating tensor of ``obj`` for inf/NaN, but those whose storage key is in
    ``skip`` (the buffers of the models amprobe knows: see :func:`buffer_keys`).

    One pass over the tensors: each is reduced to its minimum and maximum on its own device
    (NaN propagates through both; an inf is one of them), and the flags are read back once per
    device: **on an accelerator this syncs once per device holding saved tensors**. A tensor
    whose reduction is not supported (an exotic dtype) is checked with ``torch.isfinite``.
    """
    out = Scan()
    flags: dict[torch.device, list[torch.Tensor]] = {}
    named: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in _walk(obj, "", 0, set(), out):
        t = _local(tensor)
        if t is None or (skip and _storage_key(t) in skip):
            continue
        out.tensor_count += 1
        try:
            if t.is_complex():
                raise TypeError("complex")
            lo, hi = torch.aminmax(t)
            finite = torch.isfinite(torch.stack([lo, hi])).all()
        except (RuntimeError, TypeError, NotImplementedError):
            finite = torch.isfinite(t).all()
        flags.setdefault(t.device, []).append(finite)
        named.setdefault(t.device, []).append((name, t))
    for device, values in flags.items():
        for (name, t), ok in zip(named[device], torch.stack(values).tolist(), strict=True):
            if not ok:
                out.nonfinite.append((name, t))
    if len(flags) > 1:  # several devices: keep the walk's order
        order = {name: i for device in named for i, (name, _) in enumerate(named[device])}
        out.nonfinite.sort(key=lambda item: order[item[0]])
    return out


def _path_of(target: Any) -> str:
    """What a save writes to, as a string: a path as it is, a file object's ``name``."""
    if isinstance(target, (str, os.PathLike)):
        return (
            os.fspath(target) if not isinstance(target, bytes) else target.decode(errors="replace")
        )
    name = getattr(target, "name", None)
    if isinstance(name, str):
        return name
    path = getattr(target, "path", None)  # a DCP storage writer
    if isinstance(path, (str, os.PathLike)):
        return str(path)
    return "<file object>"


class CheckpointGuard:
    """Wraps the checkpoint saves (see the module docstring). Installed only when
    ``checkpoint_guard`` is not ``"off"``."""

    def __init__(self, probe: Probe, dispatch: Dispatcher, installed: Installed) -> None:
        self.probe = probe
        self.dispatch = dispatch
        self.installed = installed
        self.mode = probe.config.checkpoint_guard
        self._pending = dict(_FRAMEWORKS)
        self._dcp_pending = True
        self._inside = threading.local()  # a save checked already is in progress (nested saves)
        self._failed = False
        #: (path, step) of the last clean save on this rank that checked a tensor and was written
        self._last_clean: tuple[str, int] | None = None

    # -- installation ------------------------------------------------------------------------
    def install(self) -> None:
        """Wrap ``torch.save`` and the saves of what the program has imported (once)."""
        if self.mode == "off" or self.installed.closed:
            return
        for owner in (torch, torch.serialization):
            self.installed.patch(owner, "save", self._wrap_torch_save)
        self.dispatch.safe(self.load)  # a framework that changed is no attach error

    def load(self) -> None:
        """Wrap DCP's and the frameworks' saves once their modules are imported. Cheap: a few
        ``sys.modules`` look-ups while something is pending."""
        if self.mode == "off" or self.installed.closed:
            return
        if self._dcp_pending and _DCP in sys.modules:
            self._dcp_pending = False
            dcp = sys.modules[_DCP]
            for attr in ("save", "async_save"):
                if callable(getattr(dcp, attr, None)):
                    self.installed.patch(dcp, attr, self._dcp_maker(attr))
        for module, (owner, methods) in list(self._pending.items()):
            if owner not in sys.modules:
                continue
            del self._pending[module]
            cls = getattr(sys.modules[owner], "Trainer", None)
            if not isinstance(cls, type):  # the framework moved its Trainer: say so
                self.probe.event("checkpoint_guard_unhooked", framework=module, module=owner)
                continue
            for method in methods:
                if method in vars(cls):
                    self.installed.patch(cls, method, self._framework_maker(module, method))

    # -- the wrappers ------------------------------------------------------------------------
    def _active(self) -> bool:
        return not self.probe.closed and not getattr(self._inside, "depth", 0)

    def _wrap_torch_save(self, orig: Any) -> Any:
        guard = self

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if not guard._active() or isinstance(obj, torch.Tensor):
                return orig(obj, f, *args, **kwargs)
            if guard._dcp_pending or guard._pending:
                # (for the next save: a framework's is under way already)
                guard.dispatch.safe(guard.load)
            with guard._checking():
                guard.check(obj, f, "torch.save")
                return orig(obj, f, *args, **kwargs)

        save.__doc__ = orig.__doc__
        save.__wrapped__ = orig  # type: ignore[attr-defined]
        return save

    def _dcp_maker(self, attr: str) -> Callable[[Any], Any]:
        guard = self
        function = f"torch.distributed.checkpoint.{attr}"

        def make(orig: Any) -> Any:
            def save(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
                if not guard._active():
                    return orig(state_dict, *args, **kwargs)
                target = kwargs.get("checkpoint_id")
                if target is None:
                    target = kwargs.get("storage_writer")
                with guard._checking():
                    guard.check(
                        state_dict,
                        target if target is not None else "<storage writer>",
                        function,
                        collective=None
                        if kwargs.get("no_dist")
                        else (kwargs.get("process_group") or True),
                    )
                    return orig(state_dict, *args, **kwargs)

            save.__doc__ = orig.__doc__
            return save

        return make

    def _framework_maker(self, module: str, method: str) -> Callable[[Any], Any]:
        guard = self
        cls_name = "Trainer"
        function = f"{module}.{cls_name}.{method}"
        collective = True if method != "save_model" else None

        def make(orig: Any) -> Any:
            def save(trainer: Any, *args: Any, **kwargs: Any) -> Any:
                if not guard._active():
                    return orig(trainer, *args, **kwargs)
                with guard._checking():
                    saved: Any
                    try:
                        saved, target = _framework_state(module, method, trainer, args, kwargs)
                    except Exception as exc:
                        guard._check_failed(exc, function)
                        saved, target = _UNREAD, "<unknown>"
                    # the Trainer's _save_checkpoint and Lightning's save_checkpoint run on every
                    # rank (the main process writes; Lightning has a barrier in it): sharded
                    # weights (FSDP) differ per rank, so the ranks agree as for DCP. save_model
                    # too where it gathers sharded weights on every rank (see
                    # _save_model_collective); else its ranks hold the same weights and each
                    # decides alone (a call on the main process only must not wait for others)
                    agree = collective
                    if method == "save_model" and _save_model_collective(trainer):
                        agree = True
                    guard.check(saved, target, function, collective=agree)
                    return orig(trainer, *args, **kwargs)

            save.__doc__ = orig.__doc__
            return save

        return make

    def _checking(self) -> _Depth:
        return _Depth(self._inside)

    # -- the check ---------------------------------------------------------------------------
    def check(self, obj: Any, target: Any, function: str, collective: Any = None) -> None:
        """Check ``obj`` before it is saved to ``target``; record the result; raise
        :class:`PoisonedCheckpointError` when ``checkpoint_guard="raise"`` and it (or, for a
        collective save, any rank's) holds inf/NaN. Never raises anything else.

        ``collective``: the process group of a collective save (``True``: the default group;
        None: not collective)."""
        path = _path_of(target)
        try:
            if obj is _UNREAD:
                raise RuntimeError("what the save writes could not be read")
            with self.dispatch.own_work():
                result = scan(obj, self._known_buffers())
                poisoned = bool(result.nonfinite)
                named = result.named() if poisoned else []
        except Exception as exc:
            self._check_failed(exc, function)
            result, poisoned, named = None, False, []
        elsewhere = False
        if self.mode == "raise" and collective is not None:
            try:
                elsewhere = _any_rank(poisoned, collective) and not poisoned
            except Exception as exc:  # no group to agree over: this rank decides alone
                self._check_failed(exc, function)
        if result is not None and not (result.is_checkpoint or collective is not None):
            return  # data (a dict of lists of tensors), not a checkpoint: nothing recorded
        if result is None:
            if elsewhere:
                raise PoisonedCheckpointError(
                    path,
                    self.probe.step,
                    function,
                    [],
                    elsewhere=True,
                    last_good=self._last_clean,
                )
            return
        step = self.probe.step
        refuse = self.mode == "raise" and (poisoned or elsewhere)
        if poisoned:
            self.probe.event(
                "checkpoint_nonfinite",
                path=path,
                function=function,
                tensor_count=result.tensor_count,
                nonfinite_tensor_count=len(result.nonfinite),
                tensors=named,
                refused=refuse,
            )
        else:
            self.probe.event(
                "checkpoint_saved",
                path=path,
                function=function,
                tensor_count=result.tensor_count,
                written=not refuse,
            )
            if not refuse and result.tensor_count > 0:  # a save that checked nothing is no proof
                self._last_clean = (path, step)
        if refuse:
            raise PoisonedCheckpointError(
                path, step, function, named, elsewhere=elsewhere, last_good=self._last_clean
            )

    def _known_buffers(self) -> frozenset[tuple[Any, ...]]:
        """The buffers of the root models amprobe knows and their submodules (at save time:
        nothing is kept between saves)."""
        models = [m for m in (ref() for ref in self.probe.models) if m is not None]
        return buffer_keys(models) if models else frozenset()

    def _check_failed(self, exc: Exception, function: str) -> None:
        """The check could not run: recorded once; the save goes on."""
        if self._failed:
            return
        self._failed = True
        self.probe.event(
            "checkpoint_check_failed", function=function, error=f"{type(exc).__name__}: {exc}"
        )


class _Depth:
    """Marks a checked save in progress on this thread: the saves it makes itself (the
    Trainer's ``torch.save`` of its optimizer) pass straight through."""

    def __init__(self, local: threading.local) -> None:
        self.local = local

    def __enter__(self) -> None:
        self.local.depth = getattr(self.local, "depth", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        self.local.depth -= 1


def _any_rank(poisoned: bool, group: Any) -> bool:
    """Whether any rank of ``group`` (``True``: the default group) holds inf/NaN: one
    all-reduce of one flag (a CPU tensor on gloo, the current CUDA device otherwise).
    Not initialized: this rank alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return poisoned
    pg = None if group is True else group
    backend = str(dist.get_backend(pg)).lower()
    device = torch.device("cpu")
    if "gloo" not in backend and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([1.0 if poisoned else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
    return bool(flag.item() > 0)


def _world_size(trainer: Any) -> int:
    """The Trainer's world size: its ``args.world_size``, or the default process group's."""
    sizes = [1]
    try:
        sizes.append(int(getattr(trainer.args, "world_size", 1) or 1))
    except Exception:
        pass
    if dist.is_available() and dist.is_initialized():
        sizes.append(dist.get_world_size())
    return max(sizes)


def _save_model_collective(trainer: Any) -> bool:
    """Whether the HF Trainer's ``save_model`` runs on every rank and gathers the weights:
    a distributed Trainer with sharded weights (FSDP, DeepSpeed; ``save_model`` is then a
    collective gather that Transformers requires on all ranks). There a rank deciding alone
    would raise while the others wait in the gather: the ranks agree as for
    ``_save_checkpoint``. Not sharded (DDP), the ranks hold the same weights and reach the same
    verdict alone, and a call on the main process only stays free of any collective."""
    try:
        sharded = bool(getattr(trainer, "is_fsdp_enabled", False)) or bool(
            getattr(trainer, "is_deepspeed_enabled", False)
        )
        return sharded and _world_size(trainer) > 1
    except Exception:
        return False


def _framework_state(
    module: str, method: str, trainer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], str]:
    """What a framework's save writes (``{"model": ..., "optimizer": ...}``) and where."""
    saved: dict[str, Any] = {}
    if module == "transformers":
        targs = trainer.args
        if method == "_save_checkpoint":
            trial = args[1] if len(args) > 1 else kwargs.get("trial")
            step = trainer.state.global_step
            try:
                run_dir = trainer._get_output_dir(trial=trial)
            except Exception:
                run_dir = targs.output_dir
            target = os.path.join(str(run_dir), f"checkpoint-{step}")
            saved["model"] = trainer.model
            if not getattr(targs, "save_only_model", False):
                saved["optimizer"] = _unwrap_optimizer(trainer.optimizer)
        else:  # save_model(output_dir=None, _internal_call=False)
            out = args[0] if args else kwargs.get("output_dir")
            target = str(out if out is not None else targs.output_dir)
            saved["model"] = trainer.model
        return saved, target
    # Lightning: save_checkpoint(filepath, weights_only=None, storage_options=None)
    filepath = args[0] if args else kwargs.get("filepath")
    weights_only = args[1] if len(args) > 1 else kwargs.get("weights_only")
    saved["model"] = trainer.lightning_module
    if not weights_only:
        saved["optimizer"] = [_unwrap_optimizer(o) for o in trainer.optimizers]
    return saved, _path_of(filepath)
