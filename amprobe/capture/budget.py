"""The overhead budget: sampled steps spaced so that they cost a bounded share of training time.

Some collectors measure more on a few steps than on the others: per-layer numerics (hooks and
histograms on every layer), shape capture and sync counting (every op through Python). What such
a sampled step costs depends on the model, not on amprobe: a few percent of a long step, many
times a short one. A fixed period ("every 100 steps") therefore bounds nothing. Here amprobe
measures what each sampled step cost, and spaces the next one so that all samples together add
at most ``Config.overhead_budget`` (1 % by default) of the training time measured so far.

The rule is a token bucket. Each unsampled step earns ``fraction x its time`` of credit; a
sampled step spends its measured cost: its time (the step, and the collectors' work at its end)
minus a typical unsampled step's (a running median of recent unsampled steps). A kind of sample
is due on a grid of steps: its minimum period (``numerics_every`` and friends: the schedule with
no budget), doubled until what one period earns covers its last measured cost; and not while the
bucket is in debt (after an armed sample).

The ranks of a job sample the same steps (a sample on one rank alone stalls the others at the
next collective). Their budgets cannot ensure it alone: each measures its own times, and a rank
that waits at the all-reduce for a slower one hides its sample's cost (decided alone, the ranks
of a 2-rank DDP job sampled numerics at [0, 100, 200, 400] and [0, 100]). So with a default
process group of several ranks, rank 0's budget decides for all (:mod:`amprobe.capture.agree`):
at the end of each step on which a budgeted kind sampled, rank 0 turns its bucket into a plan
(:meth:`SampleBudget._plan`: per kind, the next step :meth:`due` would take, the credit of the
steps in between projected at the typical step's rate; whether the next armed sample may be
taken) and publishes it through the default process group's c10d store; every other rank reads
it when it first needs it (the first step that plan can name: a kind's last sample plus its
minimum period, or an armed sample), not at that step's end, so a rank 0 still busy after its
step (a checkpoint save) does not hold the others at a key instead of at their next
collective; and every rank follows it. Between two such steps a decision is a
pure function of the step, the config and the last plan (nothing is exchanged on other steps,
and nothing on a fixed period's samples: a fixed period is the same everywhere). Recording
windows open at a different step on each rank, so with several ranks a kind's first sample
falls on its grid too; a rank that sampled a step rank 0 did not adopts rank 0's latest plan
when it is later. A rank that gets no plan loses that one plan: it decides alone until it can
adopt the next (``schedule_not_shared``, once). Each rank still measures and records its own
costs. Arming is a shared fact too: with several ranks only a GradScaler-skipped update arms
(:mod:`amprobe.capture.collectors.numerics`), which assumes the found-inf was reduced across
every rank (not so with one scaler per pipeline stage: see ``on_step_bad`` there).

The first sample of each kind is taken at its first due step whatever it costs (every run
needs one; in one process the first step asked, with several ranks the first on its grid), and
it is a warm-up: what it added is recorded (``warmup_ms``) but neither charged
to the bucket nor taken as the kind's cost. It holds one-time work: the hooks installed, the
compiled model's sampled graph variant built (seconds to minutes: a compiled nanoGPT's first
sample took 80 s more than its plain first step), and often the job's own first step, whose
warm-up the typical step leaves out. Charged, it spaced a compiled job's next sample hundreds of
thousands of steps away: one per-layer sample per job. The second sample comes one minimum
period later and measures the steady cost; from then on the grid follows the last measured
cost, so the amortized overhead tends to the budget from above.

A period the user set explicitly is followed exactly (``numerics_every=1`` samples every step);
the budget spaces only the default schedules. Samples armed by a problem (numerics after a
non-finite loss or gradient) are taken at once and their cost charged to the bucket, so the
periodic samples pause until that debt is paid back; once :data:`ARMED_DEBT_SAMPLES` armed
samples of a kind have been taken on credit (a job that overflows every few steps), further
ones are declined until the bucket is out of debt, so that a storm of problems cannot make
amprobe the job's cost. That limit counts samples, not milliseconds: a decision made from one
sample's measured cost (noisy, split between the kinds sampled with it, sometimes read as 0)
would be erratic; with several ranks it is rank 0's count, carried by its plan.

A deferred kind is not asked again before the credit can cover its cost (an estimate from the
typical step), and a step on which no kind can be due is quiet (:meth:`SampleBudget.quiet`): the
hub does not ask the sampling collectors at its start, so an unsampled step costs them nothing.

What the budget chose is recorded: one ``sample_deferred`` event per kind the first time the
budget holds a sample back (its cost, the step time, the budget), and in ``end.json``'s
``sampling`` (per kind: samples taken, times a due sample was deferred, mean cost of the
charged samples, the first sample's warm-up, period used; ``schedule``: whether the ranks
shared rank 0's plans, how many, the time the exchanges took, and where this rank fell back).
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

from amprobe.capture import agree
from amprobe.capture.protocol import due

__all__ = ["ARMED_DEBT_SAMPLES", "SampleBudget"]

#: unsampled steps kept for the running median of a typical step's time
_WINDOW = 64
#: armed samples of a kind taken on credit before further ones wait for the debt to be paid
ARMED_DEBT_SAMPLES = 10
#: the widest spacing of a budgeted sample, in steps
_MAX_GRANULE = 1 << 24


def _up(step: int, first: int, g: int) -> int:
    """The first step of the grid ``first + n * g`` at or after ``step``."""
    return first - (first - step) // g * g


@dataclass
class _Kind:
    every: int
    fixed: bool
    first: int
    last: int | None = None  # last sampled step
    cost: float | None = None  # seconds the last measured sample added
    samples: int = 0
    deferred: int = 0
    declined: int = 0  # armed samples declined (ARMED_DEBT_SAMPLES taken on credit)
    owed: int = 0  # armed samples taken on credit since the bucket was last out of debt
    spent: float = 0.0
    charged: int = 0  # samples whose cost was charged (all but the first)
    warmup: float | None = None  # seconds the first sample added (one-time work, not charged)
    told: bool = False  # the first deferral was recorded
    retry: int = 0  # deferred: the step the credit should cover its cost again (an estimate)
    # an agreed schedule (several ranks, see amprobe.capture.agree): rank 0's plan for this kind
    planned: int | None = None  # the next budgeted sample
    agreed_period: int | None = None  # the spacing rank 0's budget allows
    armed_ok: bool = True  # the next armed sample may be taken
    declined_note: dict[str, Any] | None = None  # rank 0's numbers, when it may not


class SampleBudget:
    """Decides which steps the sampling collectors sample; owned by the probe.

    Args:
        fraction: the share of training time sampled steps may add (``Config.overhead_budget``);
            0 follows every period exactly.
        event: records an event in the run (the probe's ``event``).
    """

    def __init__(self, fraction: float, event: Any = None) -> None:
        self.fraction = float(fraction)
        self._event = event
        # this probe's count in the process (the same on every rank): its keys' namespace
        self.generation = agree.next_generation()
        # the agreed schedule: None until the first budgeted sample ends (then looked up once)
        self._agreement: agree.Agreement | None = None
        self._looked = False
        self._schedule: dict[str, Any] = {"shared": False}
        self._plans = 0
        self._exchange_s = 0.0
        self._exchange_max_s = 0.0
        # a rank other than 0: the step whose plan it has not read yet, and the first step
        # that plan can name (until then no budgeted kind is due, whatever the plan says)
        self._pending: int | None = None
        self._need = 0
        self._unreported_s = 0.0  # seconds of plan reads not yet returned by end_step
        self._lost = False  # the last plan read failed: decide alone until one is adopted
        self._plans_lost = 0
        self.credit = 0.0
        self._kinds: dict[str, _Kind] = {}
        self._decided: dict[str, tuple[int, bool]] = {}
        self._now: list[str] = []  # kinds sampled in the step in progress
        self._recent: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self._unresolved: list[tuple[list[str], float]] = []  # sampled before a typical step
        self.trained_s = 0.0
        self.spent_s = 0.0
        self.warmup_s = 0.0
        self._quiet_until: float | None = 0  # no kind can be due before this step (None: ask)
        self._armed_until = -1  # an armed sample may be taken up to this step

    def register(self, kind: str, every: int, *, fixed: bool, first: int = 0) -> None:
        """Declare a kind of sample: its minimum period, and whether the user fixed it."""
        self._kinds[kind] = _Kind(every=every, fixed=fixed or self.fraction <= 0, first=first)
        self._decided.pop(kind, None)
        self._quiet_until = None

    def quiet(self, step: int) -> bool:
        """No kind can sample ``step``: its period has not passed since its last sample (or its
        first step is later), the credit is known to be short, and nothing is armed. On such a
        step the sampling collectors are not asked (:meth:`due` would say no to each)."""
        if step <= self._armed_until or self._now:
            return False  # armed, or a kind already samples it (taken at the boundary)
        if self._pending is not None and step >= self._need:
            self._read_plan(step)
        until = self._quiet_until
        if until is None:
            until = self._quiet_until = min(
                (
                    self._need if self._awaits(k) else self._next_possible(k)
                    for k in self._kinds.values()
                ),
                default=float("inf"),
            )
        return step < until

    def _awaits(self, k: _Kind) -> bool:
        """``k``'s next sample is in the plan this rank has not read yet."""
        return self._pending is not None and not k.fixed and k.every > 0 and k.last is not None

    def arm(self, until: int) -> None:
        """A problem arms samples up to step ``until`` (see :meth:`take_armed`)."""
        self._armed_until = max(self._armed_until, until)

    def _next_possible(self, k: _Kind) -> float:
        if k.every <= 0:
            return float("inf")
        if k.planned is not None and not k.fixed and k.last is not None:
            return k.planned
        if k.fixed or k.last is None:
            nxt = k.first if k.last is None else max(k.first, k.last + k.every)
            return max(nxt, k.retry)
        g = self._granule(k)
        return _up(max(k.last + g, k.retry), k.first, g)

    def _granule(self, k: _Kind) -> int:
        """The spacing of a budgeted kind's samples: its minimum period doubled until the
        credit one period earns covers a sample's measured cost. Samples fall on the multiples
        of it (from ``first``); with several ranks, rank 0's granule, through its plan."""
        g = k.every
        earn = self.fraction * self.typical()
        if k.cost is None or earn <= 0:
            return g
        while g * earn < k.cost and g < _MAX_GRANULE:
            g *= 2
        return g

    def due(self, kind: str, step: int) -> bool:
        """Whether ``kind`` samples ``step``; the same answer however often it is asked."""
        decided = self._decided.get(kind)
        if decided is not None and decided[0] == step:
            return decided[1]
        k = self._kinds[kind]
        if k.fixed:
            answer = due(step, k.every, k.first)
        elif k.every <= 0 or step < k.first:
            answer = False
        elif k.last is None:
            # the first sample measures the cost: at once in one process; with several ranks
            # on the kind's grid, so that ranks whose recording windows opened at different
            # steps (dormant, attach: each rank's watcher polls on its own) take it together
            answer = not self._several() or not (step - k.first) % k.every
        elif self._pending is not None and step < self._need:
            answer = False  # the unread plan names no step before this one
        elif self._pending is not None:
            self._read_plan(step)  # (a plan lost: decided alone until the next is adopted)
            return self.due(kind, step)
        elif k.planned is not None:
            answer = step >= k.planned  # several ranks: the step rank 0's plan agreed
        elif (step - k.first) % k.every:
            answer = False
        elif step < k.retry:
            answer = False  # deferred for the debt (counted then): not before its retry step
        elif (step - k.first) % (g := self._granule(k)) or step - k.last < g:
            answer = False  # off its grid, or too soon
            self._quiet_until = None  # (the grid may have widened since quiet() computed it)
            if g > k.every:
                self._spaced(kind, k)
        elif self.credit >= 0 or k.cost is None:
            answer = True
        else:
            answer = False
            # in debt (armed samples, a second sample): not asked again before the credit
            # can cover it, on the grid
            earn = self.fraction * self.typical()
            short = -self.credit
            k.retry = _up(step + (max(1, int(short / earn)) if earn > 0 else 1), k.first, g)
            self._quiet_until = None
            self._spaced(kind, k)
        self._decided[kind] = (step, answer)
        if answer:
            self.take(kind, step)
        return answer

    @staticmethod
    def several_ranks() -> bool:
        """The default process group holds several ranks (a host fact, no communication): the
        collectors arm only from facts every rank shares (see
        :mod:`amprobe.capture.collectors.numerics`)."""
        return agree.multi_rank()

    def _several(self) -> bool:
        """Several ranks record this job (host facts: the agreement, or the default process
        group before it is looked up)."""
        if self._agreement is not None:
            return True
        return not self._looked and agree.multi_rank()

    def _spaced(self, kind: str, k: _Kind) -> None:
        """A due sample of ``kind`` waits for the budget: counted, and said once."""
        k.deferred += 1
        if not k.told and self._event is not None and k.cost is not None:
            k.told = True
            self._event(
                "sample_deferred",
                sample=kind,
                cost_ms=round(k.cost * 1e3, 3),
                step_ms=round(self.typical() * 1e3, 3),
                budget=self.fraction,
                next_period=self.period(kind),
            )

    def take_armed(self, kind: str, step: int) -> bool:
        """An armed sample of ``kind`` (a problem asks for it): taken unless
        :data:`ARMED_DEBT_SAMPLES` of them were taken on credit since the bucket was last out
        of debt. Fixed schedules always take it. The same answer however often it is asked
        for one step."""
        decided = self._decided.get(f"armed:{kind}")
        if decided is not None and decided[0] == step:
            return decided[1]
        k = self._kinds.get(kind)
        answer = True
        if self._pending is not None and k is not None and not k.fixed:
            self._read_plan(step)  # whether it may be taken is in the plan
        if k is not None and not k.fixed and k.planned is not None:
            # several ranks: rank 0's plan said whether the next armed sample may be taken
            answer = k.armed_ok
            if not answer:
                k.declined += 1
                if k.declined == 1 and self._event is not None:
                    self._event("armed_sample_declined", sample=kind, **(k.declined_note or {}))
            elif self.credit < 0:
                k.owed += 1  # (rank 0's count is the one its next plan reads)
        elif k is not None and not k.fixed and self.credit < 0:
            if k.owed >= ARMED_DEBT_SAMPLES:
                answer = False
                k.declined += 1
                if k.declined == 1 and self._event is not None:
                    self._event(
                        "armed_sample_declined",
                        sample=kind,
                        cost_ms=None if k.cost is None else round(k.cost * 1e3, 3),
                        debt_ms=round(-self.credit * 1e3, 3),
                        budget=self.fraction,
                        taken_on_credit=k.owed,
                    )
            else:
                k.owed += 1
        self._decided[f"armed:{kind}"] = (step, answer)
        if answer:
            self.take(kind, step)
        return answer

    @property
    def sampling(self) -> bool:
        """Some kind samples the step in progress (asked at its start, after ``due``)."""
        return bool(self._now)

    def take(self, kind: str, step: int) -> None:
        """``kind`` samples ``step`` (a due sample, or one armed by a problem)."""
        k = self._kinds.get(kind)
        if k is None or kind in self._now:
            return
        k.last = step
        k.samples += 1
        self._now.append(kind)
        self._quiet_until = None

    def typical(self) -> float:
        """A typical unsampled step's seconds (the median of the last :data:`_WINDOW`), 0
        before the first. Computed when asked (a sample is charged, the schedule reported),
        never on an unsampled step."""
        return statistics.median_high(self._recent) if self._recent else 0.0

    def period(self, kind: str) -> int | None:
        """The spacing, in steps, that the budget allows ``kind`` now (None: not measured; the
        agreed one while the ranks follow rank 0's plan)."""
        k = self._kinds[kind]
        if k.fixed:
            return k.every
        if k.planned is not None and k.agreed_period is not None:
            return k.agreed_period
        if k.cost is None or self.typical() <= 0 or self.fraction <= 0:
            return None
        return self._granule(k)

    def unreported(self) -> float:
        """Seconds this rank waited for rank 0's plans since last asked (read at a step's start,
        in :meth:`quiet`, :meth:`due` or :meth:`take_armed`): amprobe's time in the step in
        progress, which the probe books before it measures the step (``probe_s``)."""
        read, self._unreported_s = self._unreported_s, 0.0
        return read

    def end_step(self, seconds: float) -> float:
        """The step in progress took ``seconds`` (collectors' work at its end included).
        Returns the seconds spent agreeing on the schedule with the other ranks (0.0 but at
        the end of a budgeted sample in a job of several ranks, and plan reads not yet taken
        by :meth:`unreported`): amprobe's time, not the job's."""
        now = self._now
        read, self._unreported_s = self._unreported_s, 0.0  # plans read during this step
        if now:
            self._now = []
        else:  # an unsampled step: the common case
            self.trained_s += seconds
            self.credit += self.fraction * seconds
            self._recent.append(seconds)
            if self._unresolved:
                pending, self._unresolved = self._unresolved, []
                for kinds, took in pending:
                    self._charge(kinds, took)
            return read
        if not self._recent:
            self._unresolved.append((now, seconds))
        else:
            self._charge(now, seconds)
        if self._agreement is None and self._looked:
            return read  # one process, or the ranks no longer agree: decided alone
        table = self._kinds
        if all(table[kind].fixed for kind in now):
            return read  # a fixed period is the same on every rank: the last plan still holds
        step = table[now[0]].last
        return read + (0.0 if step is None else self._agree(step))

    # -- several ranks: one schedule (amprobe.capture.agree) ----------------------------------
    def share(self, agreement: agree.Agreement | None) -> None:
        """Follow ``agreement`` from the next sampled step on (None: decide alone). The probe
        does not call this: the first budgeted sample looks up the default process group."""
        self._agreement = agreement
        self._looked = True
        self._schedule = {
            "shared": agreement is not None,
            "world_size": 1 if agreement is None else agreement.world_size,
        }

    @property
    def shared(self) -> bool:
        """The ranks of a job follow one schedule (rank 0's plans) now."""
        return self._agreement is not None and not self._lost

    def close(self) -> None:
        """The probe closes: this rank's keys leave the store (:meth:`agree.Agreement.close`).
        Never raises."""
        pending, self._pending = self._pending, None
        if self._agreement is not None:
            self._agreement.close(pending)

    def _agree(self, step: int) -> float:
        """The end of a step on which a budgeted kind sampled: rank 0 publishes its plan, the
        other ranks wait for it; every rank then follows it. Never raises: on any failure this
        rank decides alone from now on (one event)."""
        t0 = time.perf_counter()
        try:
            if not self._looked:
                self._looked = True
                self.share(agree.default_group_agreement(self.generation))
            agreement = self._agreement
            if agreement is None:
                return time.perf_counter() - t0  # one process (looked up once)
            if agreement.leader:
                plan = self._plan(step)
                agreement.publish(step, plan)
                self._adopt(plan)
            else:
                # read when it is first needed, not now: rank 0 may still be inside this
                # step's end (a checkpoint save) while this rank goes on to its next
                # collective; no plan names a step before ``_need``
                if self._pending is not None:
                    self._read_plan(step)  # (two plans unread: the older one first)
                if self._agreement is not None:
                    self._pending = step
                    self._need = min(
                        (
                            _up(max(k.last + k.every, step + 1), k.first, k.every)
                            for k in self._kinds.values()
                            if not k.fixed and k.every > 0 and k.last is not None
                        ),
                        default=step + 1,
                    )
                    self._quiet_until = None
        except Exception as exc:
            self._fall_back(step, f"{type(exc).__name__}: {exc}")
        return self._exchanged(t0)

    def _exchanged(self, t0: float) -> float:
        """Seconds since ``t0`` spent exchanging a plan, counted in the schedule's totals."""
        took = time.perf_counter() - t0
        self._exchange_s += took
        self._exchange_max_s = max(self._exchange_max_s, took)
        return took

    def _read_plan(self, step: int) -> bool:
        """A rank other than 0 reads the plan it awaits (``step`` is the step asking): its
        sampled step's, or rank 0's latest when that is later. Returns whether this rank
        follows rank 0's plan now; on a timeout or any failure it loses that plan only: it
        decides alone until it adopts the next one, and waits for none before it has."""
        waited, self._pending = self._pending, None
        agreement = self._agreement
        if waited is None or agreement is None:
            return self.shared
        t0 = time.perf_counter()
        try:
            self._adopt(agreement.read(waited, wait=not self._lost))
            self._lost = False
        except Exception as exc:
            self._lose(waited, f"{type(exc).__name__}: {exc}")
        self._unreported_s += self._exchanged(t0)
        return self.shared

    def _plan(self, step: int) -> dict[str, Any]:
        """Rank 0, at the end of sampled ``step``: each budgeted kind's next sample as this
        rank's budget would take it if nothing armed one, the credit earned by the steps in
        between projected at the typical step's rate (what :meth:`due` does step by step on
        a single process: the grid, the granule, the debt)."""
        typical = self.typical()
        earn = self.fraction * typical
        kinds: dict[str, Any] = {}
        for name, k in self._kinds.items():
            if k.fixed or k.last is None or k.every <= 0:
                continue
            g = self._granule(k)
            soonest = _up(max(k.last + k.every, step + 1), k.first, k.every)
            nxt = _up(max(k.last + g, step + 1), k.first, g)
            if self.credit < 0 and k.cost is not None:
                # in debt: not before the steps in between have earned it back
                wait = math.ceil(-self.credit / earn) if earn > 0 else 0
                nxt = max(nxt, _up(step + 1 + wait, k.first, g))
            entry: dict[str, Any] = {"next": nxt, "period": g}
            if nxt > soonest and k.cost is not None:
                entry["held"] = {
                    "cost_ms": round(k.cost * 1e3, 3),
                    "step_ms": round(typical * 1e3, 3),
                    "budget": self.fraction,
                    "next_period": g,
                }
            if self.credit < 0 and k.owed >= ARMED_DEBT_SAMPLES:
                entry["declined"] = {
                    "cost_ms": None if k.cost is None else round(k.cost * 1e3, 3),
                    "debt_ms": round(-self.credit * 1e3, 3),
                    "budget": self.fraction,
                    "taken_on_credit": k.owed,
                }
            kinds[name] = entry
        return {"v": 1, "step": step, "kinds": kinds}

    def _adopt(self, plan: dict[str, Any]) -> None:
        """Follow rank 0's ``plan`` (rank 0 as well): the same decisions on every rank."""
        for name, entry in plan["kinds"].items():
            k = self._kinds.get(name)
            if k is None or k.fixed:
                continue
            nxt = int(entry["next"])
            held = entry.get("held")
            if held is not None and nxt != k.planned:  # the budget put this kind's sample later
                k.deferred += 1
                if not k.told and self._event is not None:
                    k.told = True
                    self._event("sample_deferred", sample=name, **held)
            k.planned = nxt
            k.agreed_period = int(entry["period"])
            k.declined_note = entry.get("declined")
            k.armed_ok = k.declined_note is None
        self._plans += 1
        self._quiet_until = None

    def _lose(self, step: int, reason: str) -> None:
        """This rank could not get the plan of ``step``: it decides alone until it adopts rank
        0's next plan (said once, with the first loss)."""
        self._lost = True
        self._plans_lost += 1
        self._forget_plans()
        if "fell_back" in self._schedule:
            return
        self._not_shared(
            step,
            reason,
            "this rank chooses its sampled steps alone until it can adopt rank 0's next plan "
            "(one it has written by then; no further wait): they may differ from the other "
            "ranks' meanwhile, and a sample on one rank alone stalls the others at the next "
            "collective",
            None if self._agreement is None else self._agreement.rank,
        )

    def _fall_back(self, step: int, reason: str) -> None:
        """This rank decides alone from now on: its budget's own schedule, said once."""
        agreement, self._agreement = self._agreement, None
        self._looked = True
        self._pending = None
        self._forget_plans()
        self._not_shared(
            step,
            reason,
            "this rank chooses its sampled steps alone from now on: they may differ from the "
            "other ranks', and a sample on one rank alone stalls the others at the next "
            "collective",
            None if agreement is None else agreement.rank,
        )

    def _forget_plans(self) -> None:
        """Each kind follows this rank's own budget again (no agreed step, period or note)."""
        for k in self._kinds.values():
            k.planned = k.agreed_period = k.declined_note = None
            k.armed_ok = True
        self._quiet_until = None
        self._schedule["shared"] = False

    def _not_shared(self, step: int, reason: str, consequence: str, rank: int | None) -> None:
        """Record where and why this rank stopped following rank 0's plans."""
        self._schedule["fell_back"] = {"step": step, "reason": reason}
        if self._event is None:
            return
        self._event(
            "schedule_not_shared", step=step, rank=rank, reason=reason, consequence=consequence
        )

    def _charge(self, kinds: list[str], seconds: float) -> None:
        typical = self.typical()
        self.trained_s += min(seconds, typical)
        extra = max(0.0, seconds - typical)
        if self.credit >= 0:  # a new debt may start here: each kind's armed allowance anew
            for k in self._kinds.values():
                k.owed = 0
        fresh = [self._kinds[kind] for kind in kinds if self._kinds[kind].warmup is None]
        if fresh:
            # a first sample on this step: what the step added is one-time work, however many
            # kinds shared it; the others' samples are counted, their cost is not re-measured
            # (the same choice on every rank: it depends on which kinds sampled, not on time)
            share = extra / len(fresh)
            for k in fresh:
                k.warmup = share
            self.warmup_s += extra
            return
        share = extra / len(kinds)
        for kind in kinds:
            k = self._kinds[kind]
            k.cost = share
            k.spent += share
            k.charged += 1
        self.credit -= extra
        self.spent_s += extra

    def summary(self) -> dict[str, Any]:
        """What the budget chose, for ``end.json``."""
        kinds = {}
        for name, k in self._kinds.items():
            kinds[name] = {
                "mode": "fixed" if k.fixed else "budget",
                "min_period": k.every,
                "samples": k.samples,
                "deferred": k.deferred,
                "armed_declined": k.declined,
                "mean_cost_ms": round(k.spent / k.charged * 1e3, 3) if k.charged else None,
                "warmup_ms": None if k.warmup is None else round(k.warmup * 1e3, 3),
                "period": self.period(name),
            }
        return {
            "budget": self.fraction,
            "typical_step_ms": round(self.typical() * 1e3, 3),
            "sampled_share": round(self.spent_s / self.trained_s, 5) if self.trained_s else None,
            "warmup_ms": round(self.warmup_s * 1e3, 3),
            "kinds": kinds,
            "schedule": self._schedule_summary(),
        }

    def _schedule_summary(self) -> dict[str, Any]:
        """Whether the ranks shared one schedule, and where this rank fell back to its own."""
        out = dict(self._schedule)
        if out.get("world_size", 1) > 1 or "fell_back" in out:
            out["plans"] = self._plans
            out["exchange_ms"] = round(self._exchange_s * 1e3, 3)
            out["longest_exchange_ms"] = round(self._exchange_max_s * 1e3, 3)
            if self._plans_lost:
                out["plans_lost"] = self._plans_lost
        agreement = self._agreement
        if agreement is not None:
            if agreement.cleanup_failed:
                out["keys_left"] = True
        return out
