"""The replay of the first bad steps: their cause measured in the training process (AMP-N17).

When an update is skipped for inf/NaN gradients outside the GradScaler's start-up calibration,
or a loss is non-finite before its update (a loss read for free: on the host), the step's model
forward, and its backward seeded with the gradient that reached the model's output, are run
again on the same weights and inputs, in a short fixed set of variants (:mod:`.replay_run`):
as it ran, eager instead of compiled, autocast off, layers pinned to fp32, a lower loss scale.
Which variants ran, their results and times, and the cause they measure are recorded in a
``replay`` event; a bad step that could not be replayed gets a ``replay`` event that says why.

What is kept for a possible replay, on every step, of the last root-model forward of the step:
references to its inputs (no copy) and their version counters, the CPU generator's state (5 KB,
copied) and the device generator's (16 bytes), the autocast setting, and a reference to the
gradient that reached each floating output (one tensor hook per output; on a language model
the logits' gradient stays alive until the step ends instead of being freed in the backward).
What was kept is replaced at the next root forward (dropping it at the step's end would put a
collector call on every step's end): the output gradient stays alive through the optimizer step
and the data loading, but not beside the next forward's activations; under gradient accumulation
each micro-batch's forward replaces the last one's. Cost on a step: three Python calls (the root
forward's start and output, the backward's end), one tensor hook and one or two generator-state
copies; no device work, no host-device sync (measured: ``benchmarks/bench_replay.py``).

The replay itself runs only on a bad step, at its end (without a GradScaler: at the end of the
backward whose host loss is non-finite, before the update), at most ``Config.replay_max`` times per
run, each bounded by :data:`TIME_FACTOR` (``Config.replay_time_factor``) times the bad step's
own time. It leaves the training
as it would have been without it: the generators and the model's buffers are restored, gradients
are taken with ``torch.autograd.grad`` into tensors of its own (no ``.grad``, no optimizer state
is touched), compiled graphs are only called as they ran (the other variants run under
``torch.compiler.set_stance("force_eager")``, which compiles nothing), and amprobe's own hooks
stay out of it (``probe.recording`` is off while it runs).
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from amprobe.capture.collectors.compiled import is_compiled_module
from amprobe.capture.collectors.graphstats import GRAPH_SAMPLE
from amprobe.capture.collectors.replay_run import (
    COMPILED_DDP_NOTE,
    Kept,
    ReplayPlan,
    describe_model,
    exchange,
    exchange_device,
    fsdp_backward_blocker,
    fsdp_states,
    replay_step,
    replay_target,
)
from amprobe.capture.collectors.sharded import user_model
from amprobe.capture.protocol import Collector, StepFacts

__all__ = ["MAX_CALIBRATION_SKIPS", "TIME_FACTOR", "ReplayCollector"]

#: a replay may take at most this many times the bad step's own wall time
TIME_FACTOR = 10.0
#: leading skipped steps at the scaler's init_scale that are its start-up calibration (as the
#: read side's :data:`amprobe.analysis.scaler.MAX_CALIBRATION_CUTS`)
MAX_CALIBRATION_SKIPS = 16


def _host_number(value: Any) -> float | None:
    return float(value) if type(value) in (float, int) else None


class ReplayCollector(Collector):
    """Replays the first bad steps in variants and records their measured cause.

    Events: ``replay`` (one per bad step considered: ``replayed`` true with ``cause``,
    ``experiments`` — each variant's ``variant``, ``finite``, ``forward_finite``,
    ``grads_finite``, ``first_nonfinite``, ``max_abs``, ``seconds`` — ``verified_fix``, ``seconds``,
    ``micro_batch``/``micro_batches``; or ``replayed`` false with ``reason``). In a job of
    several ranks also ``world_size``, ``collective`` (FSDP2: the ranks ran the variants
    together) and ``local_finite``: whether this rank's own step ("as it ran": its forward, and
    its backward where one ran) is finite on replay; true on a rank whose update was skipped
    means the non-finite gradients reached it through the gradient reduction from another rank.
    FSDP2 replays add ``memory_check`` (the headroom judged before starting).

    Distributed jobs: every rank of a data-parallel group meets the same bad steps (found-inf is
    taken after the gradient all-reduce, and ShardedGradScaler all-reduces it), and the
    calibration, episode and ``replay_max`` decisions read only step numbers, the scale and
    found-inf, so every rank decides alike. A DDP replay runs on the inner module (a forward
    through the wrapper would prepare its reducer) and takes gradients with
    ``torch.autograd.grad`` (DDP's reducer hooks sit on the gradient accumulators, which do not
    run): it launches no collective, so each rank's own time budget is harmless. An FSDP2
    replay gathers parameters in every forward: see :meth:`_replay_sharded`.
    """

    name = "replay"

    def on_attach(self, probe: Any) -> None:
        super().on_attach(probe)
        config = probe.config
        self._left = 0 if config.replay == "off" else int(config.replay_max)
        self._kept: Kept | None = None  # the step's last root forward
        self._roots: dict[int, Kept] = {}  # the step's last forward of each root model
        self._counts: dict[int, int] = {}  # forwards of each root model in the step
        self._kept_step = -1  # the step those forwards belong to
        self._first_step: int | None = None  # the first step seen (a forward or a bad step)
        self._bad_count = 0  # skipped steps seen
        self._last_bad: int | None = None
        self._last_bad_loss: int | None = None  # the last step whose host loss was non-finite
        self._loss_steps: set[int] = set()  # the steps whose non-finite host loss was judged
        self._first_scale: float | None = None
        self._replayed_steps: set[int] = set()
        self._loss_reported = False
        self._reported_off: set[str] = set()
        self._models: list[weakref.ReferenceType[torch.nn.Module]] = []

    def on_model(self, model: torch.nn.Module) -> None:
        self._models.append(weakref.ref(model))

    # -- what is kept on every step ------------------------------------------------------------
    def on_forward_begin(self, model: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if self._left <= 0 or not torch.is_grad_enabled():
            return  # no replay left, or an evaluation forward
        step = self.probe.step
        if self._first_step is None:
            self._first_step = step
        if step != self._kept_step:  # the first forward of a step: a new micro-batch count
            self._kept_step = step
            self._roots = {}
            self._counts = {}
        self._kept = Kept.take(model, args, kwargs, self.probe.device)
        key = id(model)
        self._roots.pop(key, None)  # (insertion order: the last forward of each root last)
        self._roots[key] = self._kept
        self._counts[key] = self._counts.get(key, 0) + 1

    def on_forward_output(self, model: torch.nn.Module, output: Any) -> None:
        kept = self._kept
        if kept is not None and kept.model() is model and output is not None:
            kept.watch_output(output)

    def on_backward_end(self) -> None:
        # no GradScaler: a loss read for free (on the host) and non-finite is known here, at
        # the end of its backward (the gradient that reached the model's output is kept by
        # now), before the update changes the weights the step saw. (Not at the optimizer
        # step's start: the hub's optimizer pre-hook reaches collectors on detail steps only.)
        # Under gradient accumulation this is the micro-batch whose loss went non-finite.
        facts = self.probe.hub.boundary.facts
        if facts.scaler_enabled or any(getattr(s, "_enabled", False) for s in facts.scalers_scaled):
            return
        loss = _host_number(facts.loss)
        step = self.probe.step
        if loss is None or math.isfinite(loss) or step in self._loss_steps:
            return  # (a later micro-batch of a step already judged)
        episode = self._last_bad_loss == step - 1  # the previous loss was non-finite too
        self._last_bad_loss = step
        self._loss_steps.add(step)  # judged here: not again at flush
        if episode:  # the first of a run of non-finite losses is replayed, not each
            return
        if self._left <= 0:
            self._report_max("nonfinite_loss")
        elif self._kept is not None:
            self._replay("nonfinite_loss", facts, None)

    def _report_max(self, trigger: str) -> None:
        """A bad step past ``replay_max``: said once."""
        if self.probe.config.replay == "on" and "max" not in self._reported_off:
            self._reported_off.add("max")
            self.probe.event(
                "replay",
                replayed=False,
                reason=f"replay_max ({self.probe.config.replay_max}) replays already made",
                trigger=trigger,
            )

    def on_step_bad(self, step: int, facts: StepFacts) -> None:
        # delivered on bad steps only (a skipped update or a non-finite host value): the
        # ordinary step pays nothing here; what was kept is replaced at the next forward
        if not facts.host_skipped():
            return  # a non-finite loss without a skip: judged before the update, if at all
        first = self._first_step
        if first is None:
            first = self._first_step = step
        self._bad_count += 1
        episode = self._last_bad == step - 1  # the previous step was bad too: the same episode
        self._last_bad = step
        # calibration: every step since the first seen was skipped, from the init scale
        leading = self._bad_count == step - first + 1
        if leading and self._bad_count == 1:
            self._first_scale = _scale_value(facts.scale_before)
        if leading and self._in_calibration(facts):
            return
        if episode and not (leading and self._bad_count == MAX_CALIBRATION_SKIPS):
            return  # the first bad step of a run of them is replayed, not each
        if self._left <= 0 or step in self._replayed_steps:
            if self._left <= 0:
                self._report_max("skipped_update")
            return
        self._replay("skipped_update", facts, _scale_value(facts.scale_before))

    def _in_calibration(self, facts: StepFacts) -> bool:
        scaler = facts.scaler
        init = getattr(scaler, "_init_scale", None)
        return (
            init is not None
            and self._first_scale is not None
            and self._first_scale == float(init)
            and self._bad_count < MAX_CALIBRATION_SKIPS
        )

    def on_rows(self, table: str, rows: list[Mapping[str, Any]]) -> None:
        # a non-finite loss known only now (read back from the device with the flush's one
        # transfer), without a GradScaler: the update already changed the weights the step saw
        if table != "steps" or self._loss_reported:
            return
        for row in rows:
            loss = row.get("loss")
            step = row.get("step")
            if (
                isinstance(step, int)
                and isinstance(loss, float)
                and not math.isfinite(loss)
                and not row.get("scaler_enabled")
                and (row.get("opt_steps") or 0) > 0
                and step not in self._replayed_steps
                and step not in self._loss_steps  # (a host loss, judged in time)
            ):
                self._loss_reported = True
                self.probe.event_at(
                    step,
                    "replay",
                    replayed=False,
                    trigger="nonfinite_loss",
                    reason=(
                        "weights already updated: without a GradScaler a non-finite loss on "
                        "the device is known only when read back, after the optimizer step"
                    ),
                )
                return

    # -- the replay ----------------------------------------------------------------------------
    def _replay(self, trigger: str, facts: StepFacts, scale: float | None) -> None:
        probe = self.probe
        step = probe.step
        self._replayed_steps.add(step)
        kept = self._kept if self._kept_step == step else None  # (a forward of this step)
        roots = list(self._roots.values()) if self._kept_step == step else []
        counts = dict(self._counts)
        self._kept = None  # held no longer than this replay (none may follow: replay_max)
        self._roots, self._counts = {}, {}
        reason = self._cannot(kept)
        if self._sharded(kept):
            forwards = counts.get(id(kept.model()), 1) if kept is not None else 1
            self._replay_sharded(trigger, facts, scale, kept, reason, forwards)
            return
        if reason is not None or kept is None:
            probe.event("replay", replayed=False, trigger=trigger, reason=reason)
            return
        self._left -= 1
        budget = self._budget_s()
        detail = self._replay_root(kept, facts, scale, budget, counts.get(id(kept.model()), 1))
        # several root models in the step (a GAN, an encoder and a head): the last one's forward
        # is replayed first; when it does not reproduce the bad step, the others, latest first
        others = [k for k in reversed(roots) if k is not kept and self._cannot(k) is None]
        if others and detail.get("cause") == "not-reproduced":
            tried = [_root_label(kept)]
            for other in others:
                more = self._replay_root(
                    other, facts, scale, budget, counts.get(id(other.model()), 1)
                )
                tried.append(_root_label(other))
                if more.get("replayed") and more.get("cause") not in (None, "not-reproduced"):
                    detail = more
                    break
            detail.setdefault("notes", []).append(
                "root models replayed: " + ", ".join(tried) + " (one per root model)"
            )
        detail["trigger"] = trigger
        if self._compiled_ddp(kept):
            detail.setdefault("notes", []).append(COMPILED_DDP_NOTE)
        probe.event("replay", **detail)

    def _budget_s(self) -> float:
        """A replay's time: ``replay_time_factor`` (else :data:`TIME_FACTOR`) times the bad
        step's own wall time so far."""
        probe = self.probe
        start = probe.t_step_start
        took = time.perf_counter() - start if start is not None else 0.0
        factor = probe.config.replay_time_factor
        return (TIME_FACTOR if factor is None else float(factor)) * max(took, 1e-3)

    def _replay_root(
        self, kept: Kept, facts: StepFacts, scale: float | None, budget_s: float, forwards: int
    ) -> dict[str, Any]:
        """One root model's kept forward replayed (see :func:`replay_step`)."""
        probe = self.probe
        compiled = self._compiled(kept)
        plan = ReplayPlan(
            budget_s=budget_s,
            scale=scale,
            compiled=compiled,
            # the step ran amprobe's statistics variant of its graphs (a candidate cause)
            sampled_graph=GRAPH_SAMPLE.on and compiled,
            micro_batch=forwards,
            micro_batches=forwards,
            loss=_scale_value(facts.loss),
        )
        with _amprobe_out(probe):
            detail = replay_step(kept, plan)
        detail["root"] = _root_label(kept)
        return detail

    def _sharded(self, kept: Kept | None) -> bool:
        """Whether the model is under FSDP2 (its forward gathers parameters across ranks):
        from the kept forward's model, else from the models amprobe knows (every rank alike)."""
        held = kept or self._kept  # (the last kept forward, of any step: the same model)
        models = [held.model()] if held is not None else []
        models += [r() for r in self._models]
        return any(m is not None and fsdp_states(user_model(m)) for m in models)

    def _replay_sharded(
        self,
        trigger: str,
        facts: StepFacts,
        scale: float | None,
        kept: Kept | None,
        reason: str | None,
        forwards: int,
    ) -> None:
        """An FSDP2 replay: every rank of the group replays this step or none, so that the
        forward's all-gathers match. Entered by every rank alike: the trigger is the found-inf
        that ShardedGradScaler all-reduces, and the calibration, episode and replay_max
        decisions before it read only step numbers and found-inf. One all-reduce (here, on a bad
        step only) gathers each rank's readiness (its kept forward, its memory headroom, a finite
        output gradient for the backward) before anything runs; any rank not ready: no rank
        replays, each says why. A variant that raises on one rank is carried by the next
        agreement and stops every rank together (see ``_decide_collective``); a failure between
        a forward's own collectives would still leave the others in an all-gather: the headroom
        is judged before starting against the likeliest, an out of memory. Only a probe that
        records since attach without windows replays (every rank saw the same steps)."""
        probe = self.probe
        if trigger != "skipped_update":
            probe.event(
                "replay",
                replayed=False,
                trigger=trigger,
                reason=(
                    "FSDP2 without a GradScaler: a non-finite loss is this rank's own fact, and "
                    "a replay's forward gathers parameters from every rank; the ranks cannot "
                    "agree to replay without a collective on every step"
                ),
            )
            return
        if probe.window != 0 or not probe.recording:
            # a dormant probe records in windows, started and stopped by each rank's watcher at
            # its own next step boundary, and on_step_bad reaches only recording ranks: the
            # ranks' recorded steps (and so the first step, the bad-step count, calibration)
            # may differ, and a rank alone in the agreement below would pair with another
            # rank's all-gather. Decided from this probe's own mode, no collective.
            probe.event(
                "replay",
                replayed=False,
                trigger=trigger,
                reason=(
                    "FSDP2: the ranks' recording windows may differ (a dormant or live-attached "
                    "probe): a replay is collective, so none"
                ),
            )
            return
        # whatever happens here, this rank reaches the exchange below (the others wait in it)
        compiled = False
        memory_note = "not measured"
        seeds_ok = False
        blocker: str | None = "not checked"
        try:
            compiled = kept is not None and self._compiled(kept)
            if reason is None and compiled:
                reason = (
                    "a compiled FSDP2 model: its eager variants would gather parameters outside "
                    "the compiled graphs' collectives"
                )
            memory_ok, memory_note = _memory_headroom(kept)
            if reason is None and not memory_ok:
                reason = f"not enough memory to replay: {memory_note}"
            seeds_ok = kept is not None and bool(kept.grads) and kept.grads_finite()
            if kept is not None:
                blocker = fsdp_backward_blocker(fsdp_states(user_model(kept.model())))
        except Exception as exc:
            reason = reason or f"the replay's checks failed: {type(exc).__name__}: {exc}"
        code = 0 if reason is None else (2 if reason.startswith("not enough memory") else 1)
        group = getattr(facts.scaler, "process_group", None)  # found-inf's group
        plan = ReplayPlan(
            budget_s=self._budget_s(),
            scale=scale,
            compiled=compiled,
            sampled_graph=False,
            micro_batch=forwards,
            micro_batches=forwards,
            loss=_scale_value(facts.loss),
            collective=True,
            group=group,
        )
        try:
            rows = exchange(
                [code, int(seeds_ok), int(blocker is None)], plan, exchange_device(group)
            )
        except Exception as exc:
            probe.event(
                "replay",
                replayed=False,
                trigger=trigger,
                reason=f"the ranks could not agree on a replay: {type(exc).__name__}: {exc}",
            )
            return
        others = [i for i, row in enumerate(rows) if row[0]]
        if others or kept is None:
            why = {1: "it cannot replay this step", 2: "not enough memory"}
            if reason is None:
                reason = "; ".join(
                    f"rank {i} of the group: {why.get(rows[i][0], 'not ready')}" for i in others
                )
                reason += " (FSDP2: every rank replays the step or none)"
            probe.event("replay", replayed=False, trigger=trigger, reason=reason)
            return
        plan.backward = all(row[1] and row[2] for row in rows)
        if not all(row[2] for row in rows):
            plan.forward_only = blocker or "a rank's FSDP2 state would reduce-scatter into `.grad`"
        elif not plan.backward:
            plan.forward_only = (
                "a rank's gradient at the model's output was non-finite or missing (every rank "
                "must run the same backward, whose pre-backward gathers parameters)"
            )
        self._left -= 1
        with _amprobe_out(probe):
            detail = replay_step(kept, plan)
        detail["trigger"] = trigger
        detail["memory_check"] = memory_note
        probe.event("replay", **detail)

    def _compiled(self, kept: Kept) -> bool:
        """Whether what the replay calls runs compiled graphs: under ``torch.compile(DDP(m))``
        the replay calls DDP's module (see :func:`replay_target`), eager unless compiled inside."""
        model = kept.model()
        if model is None:
            return False
        target, _ = replay_target(model)
        if is_compiled_module(target):
            return True
        return any(is_compiled_module(m) for m in target.modules())

    def _compiled_ddp(self, kept: Kept) -> bool:
        """Whether the replay skipped a compiled wrapper around DDP (it runs eager then)."""
        model = kept.model()
        return model is not None and replay_target(model)[1]

    def _cannot(self, kept: Kept | None) -> str | None:
        """Why this step cannot be replayed, decided before anything runs."""
        hub = self.probe.hub
        model = kept.model() if kept is not None else None
        if hub.sources.sources and (
            hub.boundary.mode == "source"  # an engine's step is the boundary
            or (model is not None and hub.sources.unwrap(model) is not model)  # its wrapper
        ):
            names = ", ".join(sorted(type(s).__name__ for s in hub.sources.sources))
            return f"the engine owns backward ({names}): its step is not replayed"
        if kept is None:
            return (
                "no forward of a root model was seen in this step (the model ran inside a "
                "compiled step function, or amprobe does not know its model)"
            )
        return describe_model(kept)


@contextlib.contextmanager
def _amprobe_out(probe: Any) -> Iterator[None]:
    """amprobe's own hooks stay out of a replay: the hub's wrappers (recording off), the
    collectors' guarded hooks (``probe.replaying``), the compiled graphs' statistics (their
    plain variant runs); all put back after it, whatever happens."""
    was, sampled = probe.recording, GRAPH_SAMPLE.on
    probe.recording = False
    probe.replaying = True
    GRAPH_SAMPLE.on = False
    try:
        yield
    finally:
        GRAPH_SAMPLE.on = sampled
        probe.replaying = False
        probe.recording = was


def _root_label(kept: Kept) -> str:
    """The root model's class as the user wrote it (the event names which root was replayed)."""
    model = kept.model()
    return type(user_model(model)).__name__ if model is not None else "?"


def _scale_value(value: Any) -> float | None:
    """The loss scale as a number (a device scale is read: only on a bad step)."""
    if type(value) in (float, int):
        return float(value)
    if isinstance(value, torch.Tensor):
        return float(value.item())
    return None


#: a replay on a GPU may need this many times the step's own transient memory
MEMORY_MARGIN = 1.25


def _memory_headroom(kept: Kept | None) -> tuple[bool, str]:
    """Whether this rank has the memory for a replay, judged before it starts: on a GPU the
    free memory (the device's and the caching allocator's) against the job's peak over what
    it holds now (what a forward and backward took, at most) times :data:`MEMORY_MARGIN`."""
    if kept is None or kept.device_type != "cuda" or not torch.cuda.is_available():
        return True, "not measured (CPU memory: the replay needs about one step's activations)"
    try:
        free, _ = torch.cuda.mem_get_info()
        held = torch.cuda.memory_allocated()
        cached = torch.cuda.memory_reserved() - held
        need = torch.cuda.max_memory_allocated() - held
    except Exception as exc:
        return False, f"the GPU memory could not be read ({type(exc).__name__})"
    have = free + cached
    ok = have >= MEMORY_MARGIN * need
    return ok, f"{have / 2**20:.0f} MiB free, {need / 2**20:.0f} MiB needed (the step's peak)"
