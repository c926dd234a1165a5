"""The three GEMM operands of every matmul layer, and what a block-scaled cast does to them.

Owned by the numerics collector and called from its hooks (eager forward hooks and output
gradient hooks; in a compiled region, ``amprobe::layer_stats`` and ``amprobe::grad_tap``), on its
budgeted sampled steps only (not on the steps a problem armed), and only when
``block_formats`` names at least one format. A matmul layer is one whose output a fusing
compiler stores anyway (:func:`~amprobe.capture.collectors.graphstats.materialized_output`:
``nn.Linear`` and subclasses, ``nn.Conv*``, Hugging Face's ``Conv1D``). Per call of such a layer:

* X: its first floating positional input, else its keyword ``input``, else its first floating
  keyword value (as the layer receives it: before autocast's cast);
* W: ``module.weight`` read inside the forward (under FSDP2 the unsharded weight; a
  tensor-parallel DTensor weight is its local shard, labelled approximate; in a compiled
  region read from the module the slot names when the graph hands over the layer's output);
* dY: the gradient of its output, divided by the loss scale as numerics divides
  ``grad_output`` (the same tensor numerics measures as that row).

X and W go into the ``numerics`` table as kinds ``gemm_input`` and ``gemm_weight`` (numerics'
usual statistics and units; dY is the layer's ``grad_output`` row). Each operand's canonical
2-D view (:func:`~amprobe.capture.collectors.blockstats.canonical`: X ``[T, K]``, W ``[N, K]``,
dY ``[T, N]``) is reduced at once by
:func:`~amprobe.capture.collectors.blockstats.measure` into a small float64 table per
(orientation, format), added on the device to the step's sum for (layer, operand): no operand
is kept past its hook and nothing is read back before the flush, which reads every sampled
step's sums in one transfer.

Records:
    ``blockstats`` table, one row per sampled step, layer, operand, orientation and format:
    ``step``, ``layer`` (qualified module name), ``layer_type``, ``operand`` (``x``, ``w``,
    ``dy``), ``orientation`` (``fwd``, ``wgrad``, ``dgrad``: the GEMM whose reduction the
    blocks run along; ``both``: 2-D weight tiles; ``tensor``: one scale), ``format``,
    ``dtype`` (the operand's), ``rows``/``cols`` (canonical shape of the last call),
    ``calls`` (calls pooled in the step), ``approx`` (empty when exact, else why), and the
    counts summed over the step's calls (elements, counts of elements or blocks):
    ``elements``, ``nonzero`` (finite, not 0), ``nonfinite``, ``flushed`` (nonzero values the
    cast makes 0), ``clipped`` (nonzero values it saturates), ``blocks``, ``scale_under`` /
    ``scale_sat`` (blocks whose own scale underflows / saturates its format), ``signal`` and
    ``noise`` (sum of x**2 and of (x - cast(x))**2 over finite elements, float64; SQNR in dB
    = 10 log10(signal / noise)). Definitions: :mod:`amprobe.store.blockformats`.
    ``numerics`` rows of kinds ``gemm_input`` and ``gemm_weight`` (see the numerics collector).
    Events ``blockstats_not_measured`` (field ``reason``), where block statistics are not
    taken:

    * on CPU without the compiled block kernel (no C compiler, a failed build, or the first
      seconds while it builds): the sampled steps are skipped whole (their ``gemm_input`` /
      ``gemm_weight`` rows stay), one event per distinct reason with ``step``, the first step
      skipped: the eager reduction would make a sampled step ~18x slower. Accelerators run it;
    * ``nn.MultiheadAttention`` (:data:`MHA_REASON`; ``modules``: their names, once per run):
      its projections run inside ``F.multi_head_attention_forward`` with the raw weights, no
      module call to hook (its ``out_proj`` gets no rows);
    * a compiled region's layer called with X by keyword (:data:`KEYWORD_REASON`; ``modules``,
      ``step``; each layer once per run): the in-graph hook receives positional inputs only.

Cost: on a budgeted sampled step, per matmul call two more numerics passes (X, W) and three
block reductions (X, W, dY); nothing on other steps, and nothing traced into a compiled
graph (the unsampled graph variant is the model's). Memory: each reduction's temporaries
only, freed before the hook returns.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from amprobe.capture.collectors import blockstats, numkernel
from amprobe.capture.collectors.compiled import is_compiling
from amprobe.capture.collectors.graphstats import first_float, materialized_output
from amprobe.capture.collectors.sharded import PLAIN_TENSORS, user_module_name
from amprobe.store.blockformats import STAT_FIELDS, rows_for
from amprobe.store.schema import NUMERICS_OPERAND_KINDS

__all__ = ["OPERAND_KINDS", "GemmOperands", "module_kind"]

#: numerics kinds of a matmul layer's forward operands (X, W); dY is its ``grad_output`` row
OPERAND_KINDS = NUMERICS_OPERAND_KINDS
#: the approx label of an operand measured as a DTensor's local shard
LOCAL_SHARD = "local shard of a tensor-parallel {what}"
#: the approx label of a weight FSDP2 had resharded when it was read (a compiled region's
#: ``fully_shard``-ed layer: its hook runs after FSDP's)
FSDP_SHARD = "local shard of an FSDP-sharded weight (read after its reshard)"
_WHAT = {"x": "input", "w": "weight", "dy": "output gradient"}
#: convolutions whose GEMMs the canonical views do not follow: a transposed one keeps its
#: weight as ``[Cin, Cout/groups, *k]`` and reduces over Cin in forward; a grouped one's dY
#: blocks (along Cout) run across groups, each a GEMM of its own
TRANSPOSED_CONV = "transposed convolution: blocks laid as a plain convolution's, not its GEMMs'"
GROUPED_CONV = "grouped convolution ({groups} groups): blocks along channels cross the groups"
_INT_FIELDS = tuple(f for f in STAT_FIELDS if f not in ("signal", "noise"))
#: the event of operands whose block statistics are not taken (one per distinct reason)
NOT_MEASURED = "blockstats_not_measured"
#: its reason for ``nn.MultiheadAttention`` (field ``modules``: their names)
MHA_REASON = (
    "nn.MultiheadAttention runs its projections inside F.multi_head_attention_forward "
    "(no module call to hook): not measured"
)
#: its reason for a compiled layer called with X by keyword (field ``modules``: the layer)
KEYWORD_REASON = (
    "X passed by keyword to a layer in a compiled region: the in-graph hook receives "
    "positional inputs only, so X is not measured (W and dY are)"
)


def module_kind(module: torch.nn.Module) -> str:
    """How :func:`~amprobe.capture.collectors.blockstats.canonical` lays a layer's operands
    out: ``Conv`` (any ``nn.Conv*``), ``Conv1D`` (Hugging Face's, weight ``[K, N]``) or
    ``Linear`` (``nn.Linear`` and its subclasses, whatever their names)."""
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return "Conv"
    if isinstance(module, torch.nn.Linear):
        return "Linear"
    return "Conv1D"


class _Layer:
    __slots__ = ("module", "name", "layer_type", "kind", "x_slot", "w_slot", "note", "spatial")

    def __init__(
        self, module: torch.nn.Module, name: str, layer_type: str, x_slot: int, w_slot: int
    ) -> None:
        self.module = weakref.ref(module)
        self.name = name
        self.layer_type = layer_type
        self.kind = module_kind(module)
        self.x_slot = x_slot
        self.w_slot = w_slot
        #: a convolution's spatial dimensions (its X and dY have one more without a batch)
        self.spatial = 0
        if isinstance(module, torch.nn.modules.conv._ConvNd):
            self.spatial = len(module.kernel_size)
        #: operand -> why its canonical view does not follow the layer's GEMMs
        self.note: dict[str, str] = {}
        if isinstance(module, torch.nn.modules.conv._ConvTransposeNd):
            self.note = dict.fromkeys(("x", "w", "dy"), TRANSPOSED_CONV)
        elif isinstance(module, torch.nn.modules.conv._ConvNd) and module.groups > 1:
            grouped = GROUPED_CONV.format(groups=module.groups)
            self.note = {"x": grouped, "dy": grouped}

    def batched(self, operand: str, t: torch.Tensor) -> torch.Tensor:
        """A convolution's unbatched X or dY (``[C, *S]``) as a batch of one (``[1, C, *S]``),
        the layout :func:`~amprobe.capture.collectors.blockstats.canonical` reads."""
        if self.spatial and operand != "w" and t.dim() == self.spatial + 1:
            return t.unsqueeze(0)
        return t


class _Sum:
    """One (layer, operand)'s block statistics in a step: a device sum and host facts."""

    __slots__ = ("table", "calls", "rows", "cols", "dtype", "approx")

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.calls = 0
        self.rows = self.cols = 0
        self.dtype = ""
        self.approx = ""


class GemmOperands:
    """X, W and dY of the numerics collector's matmul layers, on its budgeted sampled steps.

    See the module docstring for what it records. ``owner`` is the numerics collector: its
    slots, its measurement (``_measure``), its loss-scale tensor and its layer names are used.
    """

    def __init__(self, owner: Any, formats: Sequence[str]) -> None:
        self.owner = owner
        self.formats = tuple(formats)
        self.on = False  # this step is a budgeted sample with formats to measure
        self._layers: dict[int, _Layer] = {}  # output slot -> layer
        self._by_grad: dict[int, int] = {}  # grad_output slot -> output slot
        self._step = -1
        self._sums: dict[tuple[int, str], _Sum] = {}
        self._done: list[tuple[int, dict[tuple[int, str], _Sum]]] = []
        self._inside: set[int] = set()  # ids of matmul layers whose calls no hook sees
        self._noted: set[tuple[str, str]] = set()  # (reason, layer) already in an event
        self._keyword: list[str] = []  # compiled layers met this step with X by keyword
        self._kernel_ok = False  # the CPU block kernel was found ready (it stays so)
        self._cpu_skip = -1  # the last step whose CPU operands were skipped (no kernel)

    def discover(self, model: torch.nn.Module, inner: torch.nn.Module, selected: Any) -> None:
        """A root model's layers, before :meth:`add`: ``nn.MultiheadAttention`` modules whose
        name (or whose ``out_proj``'s) ``selected`` accepts run their projections inside
        ``F.multi_head_attention_forward`` with their raw weights (the in-projection is no
        module, ``out_proj``'s forward never runs): one event names them, and ``out_proj``
        gets no operand slots (they would stay empty)."""
        if not self.formats:
            return
        names: list[str] = []
        for name, mod in inner.named_modules():
            if not isinstance(mod, torch.nn.MultiheadAttention):
                continue
            label = user_module_name(name) or "<root>"
            proj = getattr(mod, "out_proj", None)
            proj_label = f"{label}.out_proj" if name else "out_proj"
            if not (selected(label) or (proj is not None and selected(proj_label))):
                continue
            if isinstance(proj, torch.nn.Module):
                self._inside.add(id(proj))
            root = self.owner.probe.root_name(model)  # several root models: as _layer_name
            if root is not None:
                label = f"{root}.{label}" if name else root
            names.append(label)
        new = [n for n in names if (MHA_REASON, n) not in self._noted]
        if new:
            self._noted.update((MHA_REASON, n) for n in new)
            self.owner.probe.event(NOT_MEASURED, reason=MHA_REASON, modules=new)

    def add(self, module: torch.nn.Module, label: str, mtype: str, root: int, slots: Any) -> None:
        """Give a selected matmul layer its ``gemm_input``/``gemm_weight`` slots (at discovery)."""
        if not self.formats or not materialized_output(module) or id(module) in self._inside:
            return
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            return
        new = self.owner._new_slot
        x_slot = new(label, mtype, OPERAND_KINDS[0], root)
        w_slot = new(label, mtype, OPERAND_KINDS[1], root)
        self._layers[slots[0]] = _Layer(module, label, mtype, x_slot, w_slot)
        if slots[1] is not None:
            self._by_grad[slots[1]] = slots[0]

    def begin(self, step: int, budgeted: bool) -> None:
        """A step begins (or, asked again in the same step, a root model found in the middle
        of it): measured when it is a budgeted (not an armed) sample."""
        if step != self._step:
            self.end()
        self.on = budgeted and bool(self._layers)
        self._step = step

    def end(self) -> None:
        """The step's sums join those read at the next flush; the compiled layers it met with
        X by keyword go into one event."""
        self._note_keywords()
        if self._sums:
            self._done.append((self._step, self._sums))
            self._sums = {}
        self.on = False

    def install(self, handles: list[Any], guard: Any) -> None:
        """Eager sampled steps: a forward hook per matmul layer that runs before the module's
        other forward hooks (``prepend``), so that it reads the weight the forward used: FSDP2
        reshards a ``fully_shard``-ed layer's weight in a forward hook of its own. It returns
        at once unless the step is a budgeted sample. The handles join the owner's. Keyword
        inputs are handed over too (``fc(input=x)``)."""
        for out_slot, layer in self._layers.items():
            module = layer.module()
            if module is not None:
                hook = _bind(guard(self.forward), out_slot)
                handles.append(module.register_forward_hook(hook, prepend=True, with_kwargs=True))

    # -- hot path of budgeted sampled steps --------------------------------------------------
    def forward(
        self, out_slot: int, args: Any, kwargs: dict[str, Any] | None = None, unread: int = 0
    ) -> None:
        """A matmul layer's call: X and W into numerics and into the block statistics.

        X is the first floating positional input, else the keyword ``input``, else the first
        floating keyword value. ``kwargs`` None: a compiled region's call, whose in-graph hook
        hands over positional inputs only (``unread`` of them were not plain tensors): a
        layer with none there took X by keyword, recorded once as an event."""
        layer = self._layers.get(out_slot)
        if not self.on or layer is None:
            return
        module = layer.module()
        x = first_float(args)
        if x is None and kwargs:
            x = first_float((kwargs.get("input"), *kwargs.values()))
        if x is None and kwargs is None and not unread:
            self._note_keyword(layer)
        if x is not None:
            self.owner._measure(layer.x_slot, x)
            self._blocks(out_slot, "x", x, layer.kind)
        weight = getattr(module, "weight", None) if module is not None else None
        if isinstance(weight, torch.Tensor):
            self.owner._measure(layer.w_slot, weight)
            self._blocks(out_slot, "w", weight, layer.kind)

    def grad(self, grad_slot: int, grad: torch.Tensor) -> None:
        """A matmul layer's output gradient (dY), divided by the loss scale as numerics does."""
        out_slot = self._by_grad.get(grad_slot)
        if not self.on or out_slot is None:
            return
        kind = self._layers[out_slot].kind
        self._blocks(out_slot, "dy", grad, kind, grad=True)

    def _note_keywords(self) -> None:
        if self._keyword:
            names, self._keyword = self._keyword, []
            self.owner.probe.event(
                NOT_MEASURED, reason=KEYWORD_REASON, modules=names, step=self._step
            )

    def _note_keyword(self, layer: _Layer) -> None:
        """A compiled layer without X: named in the step's event (once per run)."""
        name = self.owner._layer_name(self.owner._slots[layer.x_slot])
        if (KEYWORD_REASON, name) not in self._noted:
            self._noted.add((KEYWORD_REASON, name))
            self._keyword.append(name)

    def _cpu_ready(self) -> bool:
        """Whether this step's CPU operands get their block statistics: only with the
        compiled CPU kernel (the eager reduction costs a sampled step ~18x; an accelerator
        runs it fast enough). Without it (no compiler, a failed build, or the first seconds
        while it builds) the whole step is skipped, one event per distinct reason; the
        operands' numerics rows stay."""
        if self._kernel_ok:
            return True
        if self._cpu_skip == self._step:
            return False
        numkernel.start_build()  # (a model on an accelerator with a CPU operand: not started)
        k = numkernel.kernel()
        if k is not None and k.has_blocks:
            self._kernel_ok = True
            return True
        self._cpu_skip = self._step
        state = numkernel.status()
        if k is not None:
            reason = (
                "the CPU block kernel is unavailable: the compiled kernel has no block "
                "functions (the C compiler lacks vector extensions)"
            )
        elif state.startswith("unavailable"):
            why = state.split(":", 1)[1].strip() if ":" in state else state
            reason = f"the CPU block kernel is unavailable: {why}"
        else:
            reason = f"the CPU block kernel is not built yet ({state})"
        if (reason, "") not in self._noted:
            self._noted.add((reason, ""))
            self.owner.probe.event(NOT_MEASURED, reason=reason, step=self._step)
        return False

    def _blocks(
        self, out_slot: int, operand: str, t: torch.Tensor, kind: str, grad: bool = False
    ) -> None:
        approx = ""
        layer = self._layers[out_slot]
        if type(t) not in PLAIN_TENSORS:
            # a sharded DTensor's local shard is part of the operand (a replicated one's is all)
            if hasattr(t, "placements") and not _replicated(t):
                approx = LOCAL_SHARD.format(what=_WHAT[operand])
                if operand == "w" and _fsdp_module(self._layers[out_slot].module()):
                    approx = FSDP_SHARD
            # as numerics reads it: a DTensor's local tensor, an AsyncCollectiveTensor waited on,
            # a subclass over its own memory as a plain tensor; None for a wrapper subclass (no
            # memory of its own: never handed to the kernel) and other layouts (an event says so)
            own = self.owner._own_values(t, out_slot)
            if own is None:
                return
            t = layer.batched(operand, own)
        else:
            t = layer.batched(operand, t)
            if operand != "w" and _tp_split(layer, operand, t):
                # a plain local tensor (use_local_output) of a layer whose weight is split
                # along the dimension this operand shares with it: this rank's part of it
                approx = LOCAL_SHARD.format(what=_WHAT[operand])
        if not t.is_floating_point() or t.numel() == 0 or t.layout is not torch.strided:
            return
        if t.device.type == "cpu" and not self._cpu_ready():
            return
        owner = self.owner
        cap = owner._capture(t.device)
        if cap.device != t.device:
            return  # one device per capture, as numerics
        with torch.no_grad():
            x2d, why = blockstats.canonical(operand, t.detach(), kind)
            divisor = owner._scale_tensor(cap) if grad else None
            table = blockstats.measure(x2d, operand, self.formats, divisor)
        key = (out_slot, operand)
        entry = self._sums.get(key)
        if entry is None:
            self._sums[key] = entry = _Sum(table)
        else:
            entry.table.add_(table)
        entry.calls += 1
        entry.rows, entry.cols = int(x2d.shape[0]), int(x2d.shape[1])
        entry.dtype = str(t.dtype).replace("torch.", "")
        note = layer.note.get(operand, "")
        entry.approx = "; ".join(a for a in (approx, why or "", note) if a)

    # -- flush -----------------------------------------------------------------------------------
    def flush(self, writer: Any) -> None:
        """Write the finished sampled steps' rows (one device-to-host transfer per device)."""
        self._note_keywords()  # (a run closed inside a step)
        done, self._done = self._done, []
        entries = [(step, key, e) for step, sums in done for key, e in sums.items()]
        if not entries:
            return
        by_device: dict[torch.device, list[int]] = {}
        for i, (_, _, e) in enumerate(entries):
            by_device.setdefault(e.table.device, []).append(i)
        values: list[list[list[float]]] = [[] for _ in entries]
        width = len(STAT_FIELDS)
        for indices in by_device.values():
            tables = [entries[i][2].table for i in indices]  # (rows differ per operand)
            read = torch.cat([t.flatten() for t in tables]).cpu().tolist()
            at = 0
            for i, table in zip(indices, tables, strict=True):
                n = table.shape[0] * width
                flat = read[at : at + n]
                values[i] = [flat[r : r + width] for r in range(0, n, width)]
                at += n
        rows: list[dict[str, Any]] = []
        for (step, (out_slot, operand), e), read_rows in zip(entries, values, strict=True):
            layer = self._layers[out_slot]
            name = self.owner._layer_name(self.owner._slots[out_slot])
            for (orientation, fmt), stats in zip(
                rows_for(operand, self.formats), read_rows, strict=True
            ):
                row: dict[str, Any] = {
                    "step": step,
                    "layer": name,
                    "layer_type": layer.layer_type,
                    "operand": operand,
                    "orientation": orientation,
                    "format": fmt,
                    "dtype": e.dtype,
                    "rows": e.rows,
                    "cols": e.cols,
                    "calls": e.calls,
                    "approx": e.approx,
                }
                for field, value in zip(STAT_FIELDS, stats, strict=True):
                    row[field] = int(value) if field in _INT_FIELDS else float(value)
                rows.append(row)
        writer.append("blockstats", rows)


def _bind(fn: Any, out_slot: int) -> Any:
    def hook(module: torch.nn.Module, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        # not traced by dynamo, not run for an activation checkpoint's recompute (the forward
        # pass measured those values)
        if not is_compiling() and torch._C._current_graph_task_id() == -1:
            fn(out_slot, args, kwargs)

    return hook


def _fsdp_module(module: torch.nn.Module | None) -> bool:
    return module is not None and any(c.__name__ == "FSDPModule" for c in type(module).__mro__)


def _replicated(t: torch.Tensor) -> bool:
    """A DTensor replicated on every mesh dimension (its local tensor is the whole value)."""
    placements: tuple[Any, ...] = tuple(getattr(t, "placements", None) or ())
    return bool(placements) and all(p.is_replicate() for p in placements)


def _tp_split(layer: _Layer, operand: str, t: torch.Tensor) -> bool:
    """Whether a tensor-parallel layer's plain ``operand`` (``x``, ``dy``) is this rank's part:
    its weight (not FSDP's) is a DTensor sharded along K (X's last dimension: RowwiseParallel)
    or N (dY's: ColwiseParallel), and ``t`` is shorter there than the weight's global size (a
    gathered, replicated output's gradient is whole). In the canonical ``[N, K]`` layout;
    Hugging Face's Conv1D is ``[K, N]``."""
    module = layer.module()
    weight = getattr(module, "weight", None)
    placements = getattr(weight, "placements", None)
    if weight is None or not placements or _fsdp_module(module) or t.dim() < 1:
        return False
    dims = {p.dim % 2 for p in placements if p.is_shard()}
    axis = 1 if operand == "x" else 0  # K or N, in [N, K]
    if layer.kind == "Conv1D":
        dims = {1 - d for d in dims}
        axis = 1 - axis
    size = t.shape[1] if layer.kind == "Conv" and t.dim() > 2 else t.shape[-1]
    return axis in dims and size < weight.shape[axis]
