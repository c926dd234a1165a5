"""The ranks of a job sample the same steps (amprobe.capture.agree, amprobe.capture.budget).

In-process: budgets standing for ranks share a ``HashStore`` and measure very different costs.
Subprocess: a DDP job on gloo (2 ranks, 500 steps, the default budget and every sampling
collector; 4 ranks in tests/test_origin.py), rank 1 three times slower than rank 0 and an inf
in rank 1's batch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import amprobe
from amprobe.capture import agree
from amprobe.capture.budget import ARMED_DEBT_SAMPLES, SampleBudget
from tests.helpers import recorded_rows, run_gloo_job, sampled_steps, torchrun_argv

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"numerics": (100, 0), "shapes": (200, 1), "syncs": (50, 1)}  # (default period, first)
#: the kinds sampled in the gloo jobs: the replicas collector's fingerprints too (AMP-D05, on by
#: default with several ranks)
GLOO_KINDS = {**KINDS, "replicas": (100, 0)}


# -- in process: budgets that stand for ranks ------------------------------------------------------
class _CountingStore:
    """A ``HashStore`` that counts the calls made to it."""

    def __init__(self) -> None:
        self.inner = dist.HashStore()
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        self.calls += 1
        return getattr(self.inner, name)


def _ranks(world: int, timeout_s: float = 5.0) -> tuple[list[SampleBudget], list[list[Any]]]:
    store = _CountingStore()
    budgets, events = [], []
    generation = agree.next_generation()  # (one probe on every rank: one count)
    for rank in range(world):
        seen: list[Any] = []
        budget = SampleBudget(0.01, lambda kind, seen=seen, **detail: seen.append((kind, detail)))
        for kind, (every, first) in KINDS.items():
            budget.register(kind, every, fixed=False, first=first)
        budget.share(
            agree.Agreement(store, rank, world, timeout_s=timeout_s, generation=generation)
        )
        budgets.append(budget)
        events.append(seen)
    return budgets, events


def _lockstep(
    budgets: list[SampleBudget],
    steps: int,
    step_s: list[float],
    sample_s: list[dict[str, float]],
    armed: range = range(0),
) -> list[dict[str, list[int]]]:
    """Every rank runs each step (rank 0 first: its plan is published before the others read
    it); rank r's step takes ``step_s[r]``, a sample of kind k ``sample_s[r][k]`` more."""
    taken: list[dict[str, list[int]]] = [{k: [] for k in KINDS} for _ in budgets]
    for step in range(steps):
        for rank, budget in enumerate(budgets):
            extra = 0.0
            if step in armed and budget.take_armed("numerics", step):
                taken[rank]["numerics"].append(step)
                extra += sample_s[rank]["numerics"]
            for kind in KINDS:
                if not budget.quiet(step) and budget.due(kind, step):
                    if kind != "numerics" or step not in armed:
                        taken[rank][kind].append(step)
                        extra += sample_s[rank][kind]
            budget.end_step(step_s[rank] + extra)
    return taken


def test_ranks_with_very_different_costs_follow_rank_0s_plan():
    # rank 1 measures 3x slower steps and samples that cost 5x more than rank 0's: decided
    # alone, the budgets space their samples differently (shown below); agreed, they match
    costs = [
        {"numerics": 0.004, "shapes": 0.008, "syncs": 0.002},
        {"numerics": 0.02, "shapes": 0.04, "syncs": 0.01},
        {"numerics": 0.001, "shapes": 0.003, "syncs": 0.0005},
    ]
    steps_s = [0.01, 0.03, 0.012]
    budgets, events = _ranks(3)
    taken = _lockstep(budgets, 3_000, steps_s, costs, armed=range(1_500, 1_503))
    assert taken[0] == taken[1] == taken[2], taken
    for kind in KINDS:
        assert len(taken[0][kind]) >= 4, taken[0]  # the first sample and budgeted ones
    assert taken[0]["numerics"][:2] == [0, 100]
    assert {1_500, 1_501, 1_502} <= set(taken[0]["numerics"])
    # the same events everywhere: a deferral names rank 0's numbers on every rank
    deferred = [[e for e in seen if e[0] == "sample_deferred"] for seen in events]
    assert deferred[0] and deferred[0] == deferred[1] == deferred[2]
    summaries = [b.summary() for b in budgets]
    for s in summaries:
        assert s["schedule"]["shared"] is True
        assert s["schedule"]["world_size"] == 3
        assert s["schedule"]["plans"] > 0
        assert "fell_back" not in s["schedule"]
    periods = [{k: v["period"] for k, v in s["kinds"].items()} for s in summaries]
    assert periods[0] == periods[1] == periods[2]
    # one exchange per sampled step, none on the others: rank 0 writes a plan and its latest
    # (and checks whether the previous plan was read), each other rank checks, gets and counts
    # (and the last deletes)
    store = budgets[0]._agreement.store  # type: ignore[union-attr]
    sampled = {step for kind in KINDS for step in taken[0][kind]}
    assert summaries[0]["schedule"]["plans"] == len(sampled) < 3_000 // 40
    plans = len(sampled)
    # (a plan is read when first needed: the last one, which names a step past the end, never)
    # (rank 0 checks the plans it wrote that a rank may not have read yet: one or two)
    reads = (plans - 1) * (3 + 3 + 2)
    assert 2 * plans + reads <= store.calls <= 4 * plans + reads, (store.calls, plans)
    # the store holds no plan once every rank read it (the last reader deletes it): only
    # rank 0's latest and the last plan are left, and nothing once every rank closed
    assert store.inner.num_keys() == 2
    for budget in budgets:
        budget.close()
    assert store.inner.num_keys() == 0

    alone = []
    for rank in range(2):
        budget = SampleBudget(0.01)
        for kind, (every, first) in KINDS.items():
            budget.register(kind, every, fixed=False, first=first)
        alone.append(_lockstep([budget], 3_000, [steps_s[rank]], [costs[rank]])[0])
    assert alone[0] != alone[1]  # (what the agreement is for)


def test_a_rank_0_still_busy_after_a_sample_does_not_hold_the_others_at_the_store():
    # rank 1 ends every step before rank 0 has (rank 0 saving a checkpoint after its step):
    # read at the sampled step's end, rank 1 would wait for a plan not yet written and, past
    # the timeout, decide alone; read when first needed, rank 0 wrote it steps before
    costs = [{"numerics": 0.004, "shapes": 0.008, "syncs": 0.002}] * 2
    budgets, _ = _ranks(2, timeout_s=0.2)
    taken: list[dict[str, list[int]]] = [{k: [] for k in KINDS} for _ in budgets]
    for step in range(1_000):
        for rank in (1, 0):
            budget, extra = budgets[rank], 0.0
            for kind in KINDS:
                if not budget.quiet(step) and budget.due(kind, step):
                    taken[rank][kind].append(step)
                    extra += costs[rank][kind]
            budget.end_step(0.01 + extra)
    summaries = [b.summary()["schedule"] for b in budgets]
    assert "fell_back" not in summaries[1], summaries[1]
    assert summaries[1]["shared"] is True and summaries[1]["plans"] > 3
    assert taken[0] == taken[1]


def test_ranks_recording_into_differently_named_run_directories_follow_rank_0():
    # attach() without a run_dir names a directory per process: no key names a directory
    # (the keys' namespace is the probe's count in the process), so they share rank 0's
    budgets, events = _ranks(2)
    costs = [{"numerics": 0.004, "shapes": 0.008, "syncs": 0.002}] * 2
    taken = _lockstep(budgets, 1_000, [0.01, 0.03], costs)
    assert taken[0] == taken[1]
    schedule = budgets[1].summary()["schedule"]
    assert schedule["shared"] and "fell_back" not in schedule
    assert not [e for e in events[1] if e[0] == "schedule_not_shared"]


def test_a_rank_that_gets_no_plan_decides_alone_and_says_so():
    budgets, events = _ranks(2, timeout_s=0.05)
    follower = budgets[1]
    taken: list[int] = []
    for step in range(400):  # rank 0 never runs: no plan is ever published
        sampled = [k for k in KINDS if not follower.quiet(step) and follower.due(k, step)]
        if "numerics" in sampled:
            taken.append(step)
        follower.end_step(0.01 + 0.001 * len(sampled))
    said = [d for kind, d in events[1] if kind == "schedule_not_shared"]
    assert len(said) == 1
    assert said[0]["step"] == 0 and said[0]["rank"] == 1
    assert "DistStoreError" in said[0]["reason"] or "timeout" in said[0]["reason"].lower()
    schedule = follower.summary()["schedule"]
    assert schedule["shared"] is False
    assert schedule["fell_back"]["step"] == 0
    assert taken[:2] == [0, 100]  # its own budget's schedule from then on
    assert not follower.shared


def test_armed_samples_declined_on_every_rank_when_rank_0_is_in_debt():
    # a storm of armed samples: rank 0's samples are expensive (deep debt), rank 1's cheap;
    # both take and decline the same armed samples, by rank 0's count
    budgets, events = _ranks(2)
    costs = [
        {"numerics": 0.2, "shapes": 0.01, "syncs": 0.01},
        {"numerics": 0.0001, "shapes": 0.0001, "syncs": 0.0001},
    ]
    taken = _lockstep(budgets, 600, [0.01, 0.01], costs, armed=range(200, 240))
    assert taken[0] == taken[1]
    armed = [s for s in taken[0]["numerics"] if 200 <= s < 240]
    assert len(armed) == ARMED_DEBT_SAMPLES, armed  # taken on credit, then declined
    declined = [[d for kind, d in seen if kind == "armed_sample_declined"] for seen in events]
    assert declined[0] and declined[0] == declined[1]
    counts = [b.summary()["kinds"]["numerics"]["armed_declined"] for b in budgets]
    assert counts[0] == counts[1] > 0


def test_a_single_process_decides_alone_without_asking_a_store():
    budget = SampleBudget(0.01)
    budget.register("numerics", 100, fixed=False)
    for step in range(150):
        budget.end_step(0.01 + (0.001 if budget.due("numerics", step) else 0.0))
    assert budget.summary()["schedule"] == {"shared": False, "world_size": 1}


def test_only_a_skipped_update_arms_the_capture_on_several_ranks(tmp_path, monkeypatch):
    """A non-finite loss seen by one rank alone does not arm the per-layer capture (the other
    ranks cannot know it); a GradScaler-skipped update, known on every rank, does."""
    monkeypatch.setattr(SampleBudget, "several_ranks", staticmethod(lambda: True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)  # (no overflow of its own)
    run_dir = tmp_path / "run"
    with amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=run_dir):
        for step in range(30):
            x = torch.randn(2, 4)
            if step == 12:
                x[0, 0] = float("inf")  # the scaler skips this update
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().mean()
            if step == 5:  # a NaN loss with finite gradients: this rank's own fact, no skip
                loss = loss + torch.tensor(float("nan"))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    events = recorded_rows(run_dir, "events")
    armed = [json.loads(e["detail"]) for e in events if e["kind"] == "numerics_armed"]
    assert armed == [{"from_step": 13, "until_step": 15}], armed
    not_armed = [e for e in events if e["kind"] == "numerics_not_armed"]
    assert len(not_armed) == 1 and json.loads(not_armed[0]["detail"])["at_step"] == 5
    sampled = [r["step"] for r in recorded_rows(run_dir, "steps") if r.get("numerics_sampled")]
    assert {13, 14, 15} <= set(sampled) and 6 not in sampled


# -- DDP on gloo: real ranks ----------------------------------------------------------------------
def _job(tmp_path: Path, nproc: int, **env: str | int) -> Path:
    out = tmp_path / f"ranks{nproc}"
    full_env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SCHED_OUT": str(out),
        **{k: str(v) for k, v in env.items()},
    }
    t0 = time.perf_counter()
    proc = run_gloo_job(
        torchrun_argv("sched_gloo.py", nproc), out, cwd=tmp_path, env=full_env, timeout=300
    )
    took = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"{nproc} ranks: {took:.1f} s", file=sys.stderr)
    return out


def _events(out: Path, rank: int, *kinds: str) -> list[tuple[str, Any]]:
    return [
        (e["kind"], json.loads(e["detail"]))
        for e in recorded_rows(out, "events", rank)
        if e["kind"] in kinds
    ]


def _check_agreement(out: Path, nproc: int) -> dict[str, list[int]]:
    sampled = [sampled_steps(out, rank) for rank in range(nproc)]
    for kind in GLOO_KINDS:
        per_rank = {rank: s[kind] for rank, s in enumerate(sampled)}
        assert all(steps == per_rank[0] for steps in per_rank.values()), (kind, per_rank)
    for rank in range(nproc):
        end = json.loads((out / f"rank{rank}" / "end.json").read_text())
        schedule = end["sampling"]["schedule"]
        assert schedule["shared"] is True and "fell_back" not in schedule, schedule
        assert schedule["world_size"] == nproc and schedule["plans"] >= 5, schedule
    told = [_events(out, r, "sample_deferred", "armed_sample_declined") for r in range(nproc)]
    assert all(t == told[0] for t in told), told
    kinds = [
        json.loads((out / f"rank{r}" / "end.json").read_text())["sampling"]["kinds"]
        for r in range(nproc)
    ]
    chosen = [
        {k: (v["deferred"], v["armed_declined"], v["period"]) for k, v in kinds[r].items()}
        for r in range(nproc)
    ]
    assert all(c == chosen[0] for c in chosen), chosen
    return sampled[0]


def _budgeted(steps: list[int], first: int, every: int) -> list[int]:
    """The samples after the first that fell on the kind's grid (armed ones do not)."""
    return [s for s in steps[1:] if (s - first) % every == 0]


def _not_vacuous(out: Path, sampled: dict[str, list[int]]) -> None:
    """Each kind's schedule held decisions of rank 0's budget that every rank followed: at
    least two after the first sample, each a sample on the kind's grid or a deferral (a plan
    that put the kind's next sample later than its minimum period; their count is checked equal
    on every rank by :func:`_check_agreement`), and at least one a sample. On a loaded machine
    one sample's cost can read 100 ms (a stall), and the debt then defers a kind for the rest
    of 500 steps: that is a decision too. (The in-process test above takes four samples of
    each kind whatever the load.)"""
    end = json.loads((out / "rank0" / "end.json").read_text())["sampling"]["kinds"]
    for kind, (every, first) in GLOO_KINDS.items():
        assert sampled[kind][0] == first
        budgeted = _budgeted(sampled[kind], first, every)
        assert budgeted, (kind, sampled)
        assert len(budgeted) + end[kind]["deferred"] >= 2, (kind, sampled, end[kind])


def test_two_ranks_one_three_times_slower_sample_the_same_steps(tmp_path):
    """2 ranks x 500 steps, rank 1 three times slower than rank 0 (rank 0 waits for it at the
    all-reduce, which hides what rank 0's samples cost: decided alone, rank 0 samples more
    often), and an inf in rank 1's batch at step 450: the GradScaler skips that update on both
    ranks, which arms the per-layer capture on both at the same steps."""
    out = _job(
        tmp_path, 2, STEPS=500, SLEEP_MS=6, SLOW_RANK=1, SLOW=3, INJECT_RANK=1, INJECT_STEP=450
    )
    sampled = _check_agreement(out, 2)
    _not_vacuous(out, sampled)
    armed = [_events(out, r, "numerics_armed") for r in range(2)]
    assert armed[0] == armed[1] == [("numerics_armed", {"from_step": 451, "until_step": 453})]
    assert {451, 452, 453} <= set(sampled["numerics"])
    skipped = [
        [r["step"] for r in recorded_rows(out, "steps", rank) if r.get("skipped")]
        for rank in (0, 1)
    ]
    assert skipped[0] == skipped[1] == [450]


# 4 ranks x 500 steps (DDP, and HSDP on a 2 x 2 mesh), every collector at its default schedule:
# tests/test_origin.py::test_gloo_healthy_every_rank_samples_the_same_steps, on the healthy
# launches that also check AMP-D04 and AMP-D05 (one 4-rank launch fewer: about 25 s)


def test_the_diagnosis_says_whether_the_ranks_shared_one_schedule():
    from types import SimpleNamespace

    from amprobe.analysis.sampling import sampling_summary, sampling_text

    kinds = {"numerics": {"mode": "budget", "min_period": 100, "samples": 4, "period": 100}}

    def rank(r: int, schedule: dict[str, Any]) -> Any:
        sampling = {"budget": 0.01, "kinds": kinds, "schedule": schedule}
        return SimpleNamespace(rank=r, end={"sampling": sampling})

    shared = {"shared": True, "world_size": 2, "plans": 9}
    run = SimpleNamespace(ranks=[rank(0, shared), rank(1, shared)])
    summary = sampling_summary(run)  # type: ignore[arg-type]
    assert summary is not None and "fell_back_ranks" not in summary
    assert "one schedule for 2 ranks (rank 0's)" in sampling_text(summary)
    alone = {"shared": False, "fell_back": {"step": 100, "reason": "DistStoreError: timeout"}}
    run = SimpleNamespace(ranks=[rank(0, shared), rank(1, {**shared, **alone})])
    summary = sampling_summary(run)  # type: ignore[arg-type]
    assert summary is not None
    assert summary["fell_back_ranks"] == [
        {"rank": 1, "step": 100, "reason": "DistStoreError: timeout"}
    ]
    text = sampling_text(summary)
    assert "rank 1 chose its own sampled steps from step 100 (DistStoreError: timeout)" in text
    assert "one schedule" not in text
    # a rank that missed plans and followed rank 0's next one is not said to decide alone for good
    run = SimpleNamespace(ranks=[rank(0, shared), rank(1, {**shared, **alone, "plans_lost": 2})])
    text = sampling_text(sampling_summary(run))  # type: ignore[arg-type]
    assert (
        "rank 1 missed 2 of rank 0's plans (the first at step 100: DistStoreError: timeout) and "
        "chose its own sampled steps until it could follow the next one"
    ) in text
    assert "from step 100" not in text


# -- recording windows, successive probes, where a plan read's wait is booked ----------------------
def _windows(
    budgets: list[SampleBudget], start: list[int], steps: int, armed: dict[int, range] | None = None
) -> tuple[list[dict[str, list[int]]], list[tuple[int, int, float]]]:
    """Each rank records from its own ``start`` step (a dormant window opened by each rank's
    control watcher on its own); returns the samples taken and the steps a rank blocked at
    the store (rank, step, seconds)."""
    taken: list[dict[str, list[int]]] = [{k: [] for k in KINDS} for _ in budgets]
    blocked = []
    for step in range(steps):
        for rank, budget in enumerate(budgets):
            if step < start[rank]:
                continue
            t0 = time.perf_counter()
            if step in (armed or {}).get(rank, ()) and budget.take_armed("numerics", step):
                taken[rank]["numerics"].append(step)
            for kind in KINDS:
                if not budget.quiet(step) and budget.due(kind, step):
                    taken[rank][kind].append(step)
            budget.end_step(0.01)
            waited = time.perf_counter() - t0
            if waited > 0.1:
                blocked.append((rank, step, waited))
    return taken, blocked


def test_recording_windows_opened_at_different_steps_cost_no_stall_and_no_split():
    # fails before the fix: each rank took its first sample at its own first step, the
    # follower waited the full timeout for a plan rank 0 never wrote, then decided alone
    for start in ([10, 12], [12, 10]):
        budgets, events = _ranks(2, timeout_s=1.0)
        taken, blocked = _windows(budgets, start, 600)
        assert blocked == [], blocked
        assert taken[0] == taken[1], taken
        assert taken[0]["numerics"][0] == 100 and taken[0]["syncs"][0] == 51  # on the grid
        assert not [e for e in events[1] if e[0] == "schedule_not_shared"]
        assert budgets[1].summary()["schedule"]["shared"] is True


def test_a_plan_that_never_comes_is_waited_for_once_and_loses_that_plan_only():
    # rank 0 opens its window at step 300: the follower's first plan (its step 0's) is never
    # written. It waits once, decides alone, and follows rank 0's plans once there are some
    # (fails before the fix: one timeout and it decided alone for the rest of the run)
    budgets, events = _ranks(2, timeout_s=0.2)
    taken, blocked = _windows(budgets, [300, 0], 1_500)
    assert [(rank, step) for rank, step, _ in blocked] == [(1, 1)], blocked
    late = [{k: [s for s in v if s >= 600] for k, v in t.items()} for t in taken]
    assert late[0] == late[1] and late[0]["syncs"], late
    said = [d for kind, d in events[1] if kind == "schedule_not_shared"]
    assert len(said) == 1 and said[0]["step"] == 0
    schedule = budgets[1].summary()["schedule"]
    assert schedule["shared"] is False and schedule["plans_lost"] >= 1 and schedule["plans"] > 3
    assert budgets[1].shared  # following rank 0's plan again


def test_a_skip_only_some_ranks_saw_costs_one_plan_not_the_agreement():
    # one GradScaler per pipeline stage: the found-inf is not reduced across every rank, and
    # only rank 1's stage skipped at step 170 (the assumption numerics.on_step_bad states
    # fails). Rank 1 samples alone there, waits once for a plan rank 0 never writes, decides
    # alone, then follows rank 0 again (fails before the fix: it decided alone for good)
    budgets, events = _ranks(2, timeout_s=0.2)
    taken, blocked = _windows(budgets, [0, 0], 1_000, armed={1: range(170, 173)})
    assert [rank for rank, _, _ in blocked] == [1], blocked
    assert {170, 171, 172} <= set(taken[1]["numerics"]) and 170 not in taken[0]["numerics"]
    late = [{k: [s for s in v if s >= 400] for k, v in t.items()} for t in taken]
    assert late[0] == late[1] and late[0]["numerics"], late
    assert len([e for e in events[1] if e[0] == "schedule_not_shared"]) == 1
    assert budgets[1].shared and budgets[1].summary()["schedule"]["plans_lost"] >= 1


def test_a_second_probe_in_the_same_process_group_uses_its_own_keys(tmp_path):
    # attach() without run_dir: each rank's run directory is named differently. Failed before
    # the per-probe keys: the first probe's keys stayed, the second probe's follower read the
    # first's run directory name and timed out
    import threading

    store = _CountingStore()

    def probe() -> tuple[list[list[int]], list[list[Any]], float]:
        generation = agree.next_generation()
        budgets, events = [], []
        for rank in range(2):
            seen: list[Any] = []
            budget = SampleBudget(0.01, lambda kind, seen=seen, **d: seen.append((kind, d)))
            for kind, (every, first) in KINDS.items():
                budget.register(kind, every, fixed=False, first=first)
            agreement = agree.Agreement(store, rank, 2, timeout_s=2.0, generation=generation)
            budget.share(agreement)
            budgets.append(budget)
            events.append(seen)
        barrier = threading.Barrier(2)
        out: list[list[int]] = [[], []]

        def loop(rank: int) -> None:
            budget = budgets[rank]
            for step in range(20):
                if 1 <= step < 4 and budget.take_armed("numerics", step):
                    out[rank].append(step)  # (step 0's update was skipped: armed)
                for kind in KINDS:
                    if not budget.quiet(step) and budget.due(kind, step) and kind == "numerics":
                        out[rank].append(step)
                barrier.wait()  # the step's collective
                if rank == 0:
                    time.sleep(0.02)  # rank 0 ends its step a little later
                budget.end_step(0.01)
            budget.close()

        threads = [threading.Thread(target=loop, args=(rank,)) for rank in (0, 1)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out, events, time.perf_counter() - t0

    for _ in range(2):  # two probes, one after the other
        out, events, took = probe()
        assert out[0] == out[1] and took < 1.5, (out, took)
        assert not [e for e in events[1] if e[0] == "schedule_not_shared"]
        assert store.inner.num_keys() == 0  # rank 0's keys deleted at close, the plans read


def test_a_plan_reads_wait_is_amprobes_time_in_the_step_it_happens(tmp_path, monkeypatch):
    # fails before the fix: the wait landed in the job's wall_s of the step that read the plan,
    # and in the next step's probe_s (whose wall_s was clamped to 0)
    class SlowStore:  # rank 1 of 2: rank 0 writes every plan 0.3 s after it is asked for
        def check(self, keys: list[str]) -> bool:
            return False

        def wait(self, keys: list[str], timeout: Any) -> None:
            time.sleep(0.3)

        def get(self, key: str) -> bytes:
            step = key.rsplit("/", 1)[1]
            if not step.isdigit():
                return b"run"  # (the old design's key naming rank 0's run directory)
            return json.dumps({"v": 1, "step": int(step), "kinds": {}}).encode()

        def add(self, key: str, n: int) -> int:
            return 1

        def delete_key(self, key: str) -> bool:
            return True

    monkeypatch.setattr(
        agree,
        "default_group_agreement",
        lambda generation=0: agree.Agreement(SlowStore(), 1, 2),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    run_dir = tmp_path / "run"
    with amprobe.attach(model=model, optimizer=opt, run_dir=run_dir):
        for _ in range(120):
            loss = model(torch.randn(2, 4)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    steps = recorded_rows(run_dir, "steps")
    slow = [r for r in steps if r["wall_s"] > 0.2 or r["probe_s"] > 0.2]
    assert slow, "no plan was read"
    for r in slow:
        assert r["probe_s"] >= 0.29 and r["wall_s"] < 0.2, slow
