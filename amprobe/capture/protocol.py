"""The collector protocol: typed events from the hub, each a documented no-op by default.

A collector never patches torch and never reads another collector's state: the
:class:`~amprobe.capture.hub.Hub` installs every interception once and calls the ``on_*`` methods a
collector overrides, with the shared facts of the iteration (loss, found-inf, loss scale) as
arguments, so the order collectors run in cannot change what they record.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from amprobe.capture.probe import Probe
    from amprobe.store.fields import Field

__all__ = ["PHASES", "Collector", "FlushWriter", "StepFacts", "due"]

#: the step phases the hub's phase clock times (:attr:`StepFacts.phase_s` keys), in order
PHASES = ("fwd", "bwd", "opt")


def due(step: int, every: int, first: int = 0) -> bool:
    """The one sampling schedule: ``first``, ``first + every``, ``first + 2 * every``, ...

    Args:
        step: the iteration in question.
        every: period in steps; 0 (or less) means never.
        first: the first sampled step.
    """
    return every > 0 and step >= first and (step - first) % every == 0


#: the types a host value of the step's facts has (read at once from a CPU tensor)
_HOST_NUMBERS = (float, int)


@dataclass(init=False)
class StepFacts:
    """What the hub saw of one iteration, shared with every collector at its end.

    Values of tensors on an accelerator stay there as tensors (reading them would synchronize);
    the probe reads back the values a collector puts into the step record at flush, in one
    transfer per device. Values of CPU tensors are Python numbers, read at once (no sync, and
    cheaper than keeping a copy). A collector handles both.

    Attributes:
        loss: sum of the scalar losses backpropagated into ``.grad`` during the iteration
            (the roots of ``torch.autograd.backward``, unscaled: for ``scaler.scale(x)
            .backward()`` it is ``x``): the objective whose gradient this step applies. A
            ``scale()`` output given to ``torch.autograd.grad`` (a gradient penalty) is not
            counted. With gradient accumulation a framework divides each micro-batch's loss by
            the accumulation count, so this is the mean loss the framework logs.
        loss_count: how many scalar losses were summed.
        loss_dtype: dtype of the first loss summed.
        scaled: ``(output, input, scale)`` of each scalar ``GradScaler.scale()`` call of the
            iteration (output weakly held), to find the unscaled loss of a backward root.
        scaler: the GradScaler that owns the step boundary, when one is used.
        scaler_enabled: that scaler was enabled.
        scale_before: its loss scale used for this iteration's backward (0-d tensor).
        scale_after: its loss scale after ``update()``.
        growth_tracker: consecutive unskipped steps after ``update()``.
        found_inf: inf/NaN found in the gradients, summed over optimizers and devices.
        scaler_stepped: optimizers that scaler's ``step()`` was called for in the iteration
            (a host fact: with fewer ``opt_steps``, the scaler skipped an update, which it
            knows on the host; a fused optimizer that skips on the device steps anyway).
        phase_s: host seconds per phase (``fwd``, ``bwd``, ``opt``) when a collector asked
            for phase times (see :mod:`amprobe.capture.phases`), else None.
        cuda_phases: ``(phase, start, end)`` CUDA timing events of the phases (not read yet).
        scalers_scaled: the GradScalers whose ``scale()`` ran, in first-use order.
        unscale_calls: ``GradScaler.unscale_`` calls; ``unscaled_opts`` their optimizers.
        scaler_steps: ``(scaler, optimizer)`` of each ``GradScaler.step`` call.
        opt_steps: optimizer ``step()`` calls that ran (a skipped one does not).
        autocast: ``(device, dtype)`` of the last enabled autocast region entered, else of the
            last one inside a compiled graph (it runs in the graph, not through ``__enter__``).
        autocast_new: ``(device, dtype, enabled, site)`` of each autocast setting this probe
            had not seen before, with the user's line that entered it.
        clip_calls: gradient-clipping calls; ``clip_scaled`` those on still-scaled gradients
            (counted by the scaler collector's ``on_clip``).
        input_nonfinite: non-finite elements in the floating tensors passed to the root
            models' forward (None: no input was checked; gathered when a collector asks,
            ``checks_inputs``): a Python int on CPU, else a device count read back at flush.
        data_wait_s: seconds spent inside ``DataLoader`` iterators' ``__next__`` (the probe's own
            time excluded); ``batches``: batches fetched.
        rss_bytes: the process's resident set size read at this step's end, when a collector
            asked for it (:meth:`Probe.watch_rss`) and its period had passed; else None.
        detail: a detail step (``Config.details_every``, a sampled step, or the boundary not
            known yet): only then are ``unscale_calls``/``unscaled_opts``, ``scaler_steps``,
            ``autocast``/``autocast_new`` and clipping gathered, and ``phase_s`` on the
            schedule's detail steps (not on a step that is one because it is sampled: its hooks
            would inflate the split).
    """

    loss: torch.Tensor | float | None = None
    loss_count: int = 0
    loss_dtype: str | None = None
    scaled: list[tuple[Any, torch.Tensor, Any]] = field(default_factory=list)
    scaler: Any = None
    scaler_enabled: bool = False
    scale_before: torch.Tensor | float | None = None
    scale_after: torch.Tensor | float | None = None
    growth_tracker: torch.Tensor | float | None = None
    found_inf: torch.Tensor | float | None = None
    scaler_stepped: int = 0
    phase_s: dict[str, float] | None = None
    cuda_phases: list[tuple[str, Any, Any]] = field(default_factory=list)
    scalers_scaled: list[Any] = field(default_factory=list)
    unscale_calls: int = 0
    unscaled_opts: list[Any] = field(default_factory=list)
    scaler_steps: list[tuple[Any, Any]] = field(default_factory=list)
    opt_steps: int = 0
    autocast: tuple[str, str | None] | None = None
    autocast_new: list[tuple[str, str | None, bool, str | None]] = field(default_factory=list)
    clip_calls: int = 0
    clip_scaled: int = 0
    input_nonfinite: torch.Tensor | int | None = None
    data_wait_s: float = 0.0
    batches: int = 0
    rss_bytes: int | None = None
    detail: bool = True

    def __init__(self) -> None:
        # One is made at every step boundary: the generated __init__ stored all 27 fields
        # (about 130 bytecodes a step). The fields with a plain default are read from the
        # class until a step sets them; only the lists are the instance's own.
        self.scaled = []
        self.cuda_phases = []
        self.scalers_scaled = []
        self.unscaled_opts = []
        self.scaler_steps = []
        self.autocast_new = []

    def host_skipped(self) -> bool:
        """The GradScaler skipped an update in this iteration, as far as the host knows it: a
        found-inf on the host, or (on an accelerator) fewer optimizer steps than ``step()``
        calls of that scaler (it read found-inf on the host to skip them; free to ask)."""
        found: Any = self.found_inf
        if type(found) in _HOST_NUMBERS:
            return bool(found > 0)
        return found is not None and self.scaler_stepped > self.opt_steps

    def host_nonfinite(self) -> bool:
        """Something of the step is non-finite as far as its host values tell: found-inf, the
        loss or the inputs (a value on an accelerator is not read: it counts as finite here).
        Host values are Python floats or ints (an engine may count found-inf in an integer
        tensor), checked by exact type: a bool is not a count."""
        found: Any = self.found_inf  # (narrowed by the exact-type tests below)
        loss: Any = self.loss
        inputs = self.input_nonfinite
        return (
            (type(found) in _HOST_NUMBERS and found > 0)
            or (type(loss) in _HOST_NUMBERS and not math.isfinite(loss))
            or (type(inputs) is int and inputs > 0)
        )


class FlushWriter:
    """The writer a collector's :meth:`Collector.on_flush` receives.

    Rows appended to it go to the run's writer as they would directly, and are kept (by
    reference, until the flush ends) so that the probe can hand them to every collector's
    :meth:`Collector.on_rows` once all ``on_flush`` calls have run: a collector that needs
    another's per-layer values gets them in memory, never by reading the run's files back.
    Any other attribute is the run writer's own.
    """

    def __init__(self, writer: Any) -> None:
        self._writer = writer
        self.appended: list[tuple[str, list[Mapping[str, Any]]]] = []

    def append(self, table: str, rows: Iterable[Mapping[str, Any]]) -> None:
        """Queue ``rows`` for ``table`` (see the run writer's ``append``) and keep them."""
        kept = list(rows)
        self._writer.append(table, kept)
        if kept:
            self.appended.append((table, kept))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


class Collector:
    """Base class of every collector: a subscriber to the hub's events.

    Override only the events you need (the hub calls only overridden ones). Every call goes
    through the hub's guard: an exception is recorded once in the run (``collector_error``
    event) and switches that collector off; it never reaches the training loop. Only
    :meth:`on_attach` may raise, and only :class:`amprobe.ConfigError` for a configuration
    mistake. Per-step events are not delivered while the probe is dormant.

    Class attributes:
        name: the name accepted in ``Config.collectors``.
        fields: the ``steps`` columns this collector writes (see :mod:`amprobe.store.fields`);
            writing a column not declared here is reported as an ``undeclared_field`` event.
        track_modules: the ops it asks for (:meth:`wants_ops`) come with the module stack: on
            those steps the hub installs torch's global module hooks and the collector reads
            which module runs now from ``probe.hub.modules``
            (:class:`amprobe.capture.modules.ModuleStack`: ``active``, ``innermost()``,
            ``forward_depth``, ``name_of(module)``); removed at the step end, never installed
            while torch.compile is in use. A collector never installs global hooks itself.
        detail_events: per-step events (``on_autocast``, ``on_forward_begin``, ...) this
            collector needs only on some steps (:meth:`wants_detail` True, by default the steps
            it asks for ops): the hub delivers them on those steps only, so an unsampled step
            does not call it at all.
        phase_times: the hub times the forward, backward and optimizer phases for it on the
            steps ``Config.details_every`` selects (:attr:`StepFacts.phase_s`; no event per
            phase).
        checks_inputs: the hub counts the non-finite elements of the root models' floating
            inputs on every step (:attr:`StepFacts.input_nonfinite`).
        samples: its :meth:`on_step_begin` only decides whether to sample the step (through
            the probe's :class:`~amprobe.capture.budget.SampleBudget`): the hub skips it on the
            steps no sample can be due (``budget.quiet(step)``) unless the collector asked for
            ops or detail events at the step before (its sample ends there).

    Per-layer hooks a collector registers on the user's modules (never on torch itself) go
    through :meth:`amprobe.capture.hub.Hub.guard` and are removed by the collector in
    :meth:`on_recording` (``False``) and :meth:`on_close`.
    """

    name: ClassVar[str] = "collector"
    fields: ClassVar[tuple[Field, ...]] = ()
    track_modules: ClassVar[bool] = False
    detail_events: ClassVar[frozenset[str]] = frozenset()
    phase_times: ClassVar[bool] = False
    checks_inputs: ClassVar[bool] = False
    samples: ClassVar[bool] = False

    # -- lifecycle ---------------------------------------------------------------------------
    def on_attach(self, probe: Probe) -> None:
        """Set up; may raise ConfigError. ``probe.hub`` is ready, no model is known yet."""
        self.probe = probe

    def on_model(self, model: torch.nn.Module) -> None:
        """A root model became known (attach argument, discovery, or live attach)."""

    def on_recording(self, active: bool) -> None:
        """Recording starts (True) or stops (False) at a step boundary (dormant probes)."""

    def on_flush(self, writer: Any) -> None:
        """Write this collector's own tables; the step records were read back just before.
        ``writer`` is a :class:`FlushWriter`."""

    def on_rows(self, table: str, rows: list[Mapping[str, Any]]) -> None:
        """Rows queued for ``table`` at this flush, after every ``on_flush``: the step records
        (``steps``) and what the collectors (this one included) queued; Python values, already
        read back. Read them; never modify them."""

    def on_close(self) -> None:
        """Remove every hook this collector registered and stop its threads."""

    # -- objects -----------------------------------------------------------------------------
    def on_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer was seen for the first time (delivered while dormant too)."""

    def on_scaler(self, scaler: torch.amp.GradScaler, site: str | None) -> None:
        """A GradScaler was seen for the first time; ``site`` is its creation line, or None
        when it was created before the probe attached (delivered while dormant too)."""

    def on_scaler_state_loaded(self, scaler: torch.amp.GradScaler, state: Any) -> None:
        """``GradScaler.load_state_dict`` ran (delivered while dormant too)."""

    def on_optimizer_state_loaded(self, optimizer: torch.optim.Optimizer, restored: bool) -> None:
        """``Optimizer.load_state_dict`` ran; ``restored`` when the state had been trained
        (per-parameter state present), not a re-placement of a fresh optimizer's state."""

    def on_compile(self) -> None:
        """torch.compile is in use in this process (first call seen, a compiled model attached,
        or dynamo's counters show compiled frames): from now on install no hook that dynamo
        could trace (per-layer module hooks, global module hooks); the hub's module stack stops."""

    def on_compiled_graph(self, facts: dict[str, Any]) -> None:
        """dynamo compiled a graph (at compile time): ``facts`` from
        :func:`amprobe.capture.collectors.compiled.graph_facts` (its GEMM/conv/attention ops with their
        modules, shapes and dtypes, and the autocast regions inside it)."""

    # -- one iteration -----------------------------------------------------------------------
    def on_step_begin(self, step: int) -> None:
        """Iteration ``step`` starts (after the previous boundary, or when recording starts)."""

    def wants_ops(self, step: int) -> bool:
        """Ask for :meth:`on_op` during iteration ``step``; asked right after ``on_step_begin``
        on the steps some kind of sample is taken (:class:`~amprobe.capture.budget.SampleBudget`)
        and on the step after a collector asked (to stop): ask only on a sampled step."""
        return False

    def wants_detail(self, step: int) -> bool:
        """Ask for the :attr:`detail_events` during iteration ``step`` (asked right after
        :meth:`wants_ops`); by default on the steps this collector observes ops."""
        return self.wants_ops(step)

    def on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """An aten op ran (below autocast and autograd), on steps this collector asked for."""

    def on_dataloader(self, iterator: Any) -> None:
        """A DataLoader iterator returned its first batch (its waits go into
        :attr:`StepFacts.data_wait_s`)."""

    def on_forward_begin(self, model: torch.nn.Module, args: Any, kwargs: Any) -> None:
        """A root model's forward starts."""

    def on_forward_end(self, model: torch.nn.Module) -> None:
        """A root model's forward ended (also when it raised)."""

    def on_forward_output(self, model: torch.nn.Module, output: Any) -> None:
        """A root model's forward returned ``output`` (not delivered when it raised, nor inside
        a compiled region)."""

    def on_autocast(self, device: str, dtype: str | None, enabled: bool) -> None:
        """An autocast region was entered."""

    def on_autocast_exit(self, device: str) -> None:
        """An autocast region was left."""

    def on_scale(self, scaler: torch.amp.GradScaler, loss: torch.Tensor | None) -> None:
        """``GradScaler.scale`` ran; ``loss`` is the scalar it scaled (None for other outputs)."""

    def on_backward_begin(self, loss: torch.Tensor | None) -> None:
        """``torch.autograd.backward`` (or ``Tensor.backward``) starts; ``loss`` if scalar."""

    def on_backward_end(self) -> None:
        """Backward ended."""

    def on_unscale(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        """``GradScaler.unscale_`` ran for ``optimizer``."""

    def on_clip(self, function: str, grads: list[Any], site: str | None, facts: StepFacts) -> None:
        """``clip_grad_norm_`` or ``clip_grad_value_`` is about to read ``grads``; ``facts``
        are those of the iteration so far (which optimizers were unscaled)."""

    def on_scaler_step(
        self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer
    ) -> None:
        """``GradScaler.step(optimizer)`` was called."""

    def on_optimizer_step_begin(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer's ``step`` starts (it was not skipped)."""

    def on_optimizer_step_end(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer's ``step`` ended."""

    def on_scaler_update(
        self,
        scaler: torch.amp.GradScaler,
        scale_before: torch.Tensor | None,
        scale_after: torch.Tensor | None,
        found_inf: torch.Tensor | None,
    ) -> None:
        """``GradScaler.update`` of the scaler that owns the step boundary ran (device tensors)."""

    def on_step_nonfinite(self, step: int, facts: StepFacts) -> None:
        """Iteration ``step`` is ending and its host values show something non-finite
        (:meth:`StepFacts.host_nonfinite`: a CPU run; on an accelerator those values are read
        at flush). Delivered before ``on_step_end`` and the next ``on_step_begin``."""

    def on_step_bad(self, step: int, facts: StepFacts) -> None:
        """Iteration ``step`` is ending and the host knows it was bad: what
        :meth:`on_step_nonfinite` is delivered for, or an update the GradScaler skipped
        (:meth:`StepFacts.host_skipped`, also on an accelerator: the scaler read found-inf on
        the host to skip it). Delivered right after ``on_step_nonfinite``."""

    def on_step_end(self, step: int, record: dict[str, Any], facts: StepFacts) -> None:
        """Iteration ``step`` ended, now: what must be read from the live job at this moment
        (a CUDA allocator's peak, a sample's buffers) goes into ``record`` (device tensors are
        fine: the probe reads them back at flush). Everything that follows from the step's
        facts belongs in :meth:`on_step_fold`, which costs the step nothing."""

    def on_step_fold(self, step: int, record: dict[str, Any], facts: StepFacts) -> None:
        """Fill in iteration ``step``'s record from its ``facts`` and this collector's own
        state, never from the live job: called at the next flush (or when live metrics are
        read) for each step, in step order, with the events it records dated to ``step``,
        after that step's ``on_step_end``. A run's once-only readings for the manifest (a
        framework's setting) may be made at a fold."""
