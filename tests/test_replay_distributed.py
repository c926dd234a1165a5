"""The replay (issue 34) on 2-rank gloo jobs: DDP and FSDP2, under ``amprobe run -- torchrun``.

Every rank of a data-parallel group replays the same bad step (the all-reduced found-inf is
shared); the replay launches no gradient reduction and writes no ``.grad`` (the reductions
counted, the gradients after each step digested), so losses, gradients and weights are bit for
bit those of the same job with ``replay=off``. FSDP2's replay gathers parameters: both ranks
run the same variants, agreed at fixed points, and no job hangs (each has a timeout).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import amprobe
from tests.helpers import run_gloo_job, run_jobs, torchrun_argv

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)

#: job: (script, its environment, replay); each replay_gloo job's replay=off twin is "<job>-off"
JOBS: dict[str, tuple[str, dict[str, str], str]] = {
    "ddp": ("replay_gloo.py", {"WRAP": "ddp", "CASES": "layer@3,nan_rank1@6"}, "on"),
    "fsdp": (
        "replay_gloo.py",
        {"WRAP": "fsdp", "CASES": "cosine_nomem1@1,cosine@3,nan_rank1@6"},
        "on",
    ),
    "fsdp-spike": ("replay_gloo.py", {"WRAP": "fsdp", "CASES": "spike@5"}, "on"),
    "fsdp-fail": ("replay_gloo.py", {"WRAP": "fsdp", "CASES": "cosine_fail1@3"}, "on"),
}
JOBS.update({f"{k}-off": (script, env, "off") for k, (script, env, _) in list(JOBS.items())})
# test_sharded's fp16 job: booster x1e6 on steps 6-8 (a call counter), mid under an
# activation-checkpoint wrapper, the budget as amprobe sets it (10x the step's time)
JOBS["fsdp-booster"] = (
    "fsdp_gloo.py",
    {"SCALER": "1", "PLANT": "6,7,8", "CKPT": "1", "PARAM_DTYPE": "float16"},
    "on",
)
# train_blocks' FSDP2 job (ShardedGradScaler, fp16 param_dtype), eager: booster's weight x1e6
# on steps 4-6
JOBS["fsdp-blocks"] = ("train_blocks.py", {}, "on")
ARGS = {"fsdp-blocks": ["--fsdp", "--compile", "none", "--plant", "4", "--steps", "6"]}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tmp_path_factory.mktemp("replay_dist")

    def run(job: str) -> dict[str, Any]:
        script, job_env, replay = JOBS[job]
        where = base / job
        where.mkdir()
        out = where / "run"
        cmd = [sys.executable, "-m", "amprobe", "run", "--out", str(out)]
        cmd += ["--set", f"replay={replay}", "--", *torchrun_argv(script)]
        cmd += [str(where / "out.json"), *ARGS[job]] if job in ARGS else [str(where)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), **job_env}
        proc = run_gloo_job(cmd, out, cwd=where, env=env, timeout=240)  # (torch's abort)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = [
            (where / f"result{r}.txt").read_text().splitlines()
            for r in (0, 1)
            if (where / f"result{r}.txt").exists()
        ]
        # the replay's events by rank and step
        events = {(e["rank"], e["step"]): e for e in amprobe.load_run(out).events_of("replay")}
        return {"results": results, "events": events}

    return run_jobs(JOBS, run)


def _variants(event: dict[str, Any]) -> list[str]:
    return [e["variant"] for e in event["experiments"]]


@pytest.mark.parametrize("job", ["ddp", "fsdp", "fsdp-spike", "fsdp-fail"])
def test_training_is_bit_identical_with_replay_on_and_off(jobs, job):
    on, off = jobs[job]["results"], jobs[f"{job}-off"]["results"]
    assert len(on[0]) == len(on[1]) == 8 * 2 + 2
    # losses, the gradients after each update (no .grad written), the reductions (none
    # launched by the replay) and the final weights, on both ranks
    assert on == off
    assert jobs[job]["events"] and not jobs[f"{job}-off"]["events"]


def test_ddp_overflow_in_one_layer_same_fix_on_both_ranks(jobs):
    events = jobs["ddp"]["events"]
    for rank in (0, 1):
        e = events[rank, 3]
        assert e["replayed"] is True and e["trigger"] == "skipped_update"
        assert e["cause"] == "precision" and e["verified_fix"] == ["big"]
        assert e["first_nonfinite"] == "big"
        assert e["world_size"] == 2 and e["local_finite"] is False and e["collective"] is False


def test_ddp_nan_on_rank1_rank0_says_its_own_step_is_finite(jobs):
    events = jobs["ddp"]["events"]
    assert sorted(events) == [(0, 3), (0, 6), (1, 3), (1, 6)]  # both ranks, the same steps
    assert events[1, 6]["cause"] == "data-or-model" and events[1, 6]["local_finite"] is False
    assert _variants(events[1, 6]) == ["as it ran", "autocast off"]
    # rank 0's own forward and backward are finite: the NaN came through the all-reduce
    assert events[0, 6]["cause"] == "not-reproduced" and events[0, 6]["local_finite"] is True
    assert events[0, 6]["experiments"][0]["grads_finite"] is True


def test_fsdp2_one_rank_unable_no_rank_replays(jobs):
    events = jobs["fsdp"]["events"]
    # rank 1's memory check (planted) says no: it is judged before anything runs, and no
    # rank replays (an out of memory inside would leave the other rank in a collective)
    assert events[1, 1]["replayed"] is False
    assert events[1, 1]["reason"] == (
        "not enough memory to replay: 1 MiB free, 2 MiB needed (planted)"
    )
    assert events[0, 1]["replayed"] is False
    assert events[0, 1]["reason"] == (
        "rank 1 of the group: not enough memory (FSDP2: every rank replays the step or none)"
    )
    # a replay not made is not counted against replay_max (3): steps 3 and 6 are replayed


def test_fsdp2_overflow_both_ranks_run_the_same_variants_and_find_the_same_fix(jobs):
    events = jobs["fsdp"]["events"]
    assert sorted(events) == [(0, 1), (0, 3), (0, 6), (1, 1), (1, 3), (1, 6)]
    for rank in (0, 1):
        e = events[rank, 3]
        assert e["replayed"] is True and e["collective"] is True
        assert e["cause"] == "precision" and e["verified_fix"] == ["cos"]
        assert e["first_nonfinite"] == "cos"
        assert _variants(e) == ["as it ran", "autocast off", "fp32 cos"]


def test_fsdp2_nan_on_rank1_forward_only_on_both_ranks(jobs):
    events = jobs["fsdp"]["events"]
    assert events[1, 6]["cause"] == "data-or-model" and events[1, 6]["local_finite"] is False
    assert events[0, 6]["cause"] == "not-reproduced" and events[0, 6]["local_finite"] is True
    # rank 1's output gradient is NaN: no rank runs a backward (its pre-backward gathers)
    assert _variants(events[0, 6]) == _variants(events[1, 6])
    for rank in (0, 1):
        e = events[rank, 6]
        assert all(x["grads_finite"] is None for x in e["experiments"])
        assert any(n.startswith("forward only") for n in e["notes"])


def test_fsdp2_variant_failing_on_one_rank_stops_every_rank_together(jobs):
    """Rank 1's "autocast off" raises after its collectives: the failure rides the next
    agreement, both ranks stop there (the job ends: no rank waits), each says so."""
    events = jobs["fsdp-fail"]["events"]
    assert sorted(events) == [(0, 3), (1, 3)]
    mine, other = events[1, 3], events[0, 3]
    for e in (mine, other):
        assert e["replayed"] is True and e["cause"] is None and e["failed_ranks"] == [1]
        assert _variants(e) == ["as it ran", "autocast off"]  # no pin ran after the failure
    assert mine["incomplete"] == (
        "the variant 'autocast off' failed on this rank: RuntimeError: planted failure in a "
        "variant (FSDP2: every rank stopped together at the next agreement)"
    )
    assert mine["experiments"][1]["error"] == "RuntimeError: planted failure in a variant"
    assert other["incomplete"] == (
        "a variant failed on rank 1 of the group (FSDP2: every rank stopped together at the "
        "next agreement)"
    )
    assert other["experiments"][1]["finite"] is True and "error" not in other["experiments"][1]


def test_fsdp2_backward_takes_local_gradients_without_reduce_scatter(jobs):
    events = jobs["fsdp-spike"]["events"]
    assert sorted(events) == [(0, 5), (1, 5)]
    for e in events.values():
        assert e["cause"] == "loss-scale" and e["finite_at_scale_divisor"] == 2.0
        first = e["experiments"][0]
        assert first["forward_finite"] is True and first["grads_finite"] is False
        assert first["nonfinite_params"] == ["head.weight"]  # the user's parameter names
    # 4 reduce-scatters a step (one per sharded layer), none more with the replay
    reductions = [line for line in jobs["fsdp-spike"]["results"][0] if line.startswith("red")]
    assert reductions == ["reductions 32"]


def test_fsdp2_pins_see_the_module_state_the_replay_began_with(jobs):
    """booster multiplies by 1e6 on its 7th to 9th calls: each variant starts from the counter
    the replay found, so pinning booster alone is not a fix (its fp32 output of ~1e5 enters
    head, whose FSDP2 input cast is float16); booster and head together are."""
    events = jobs["fsdp-booster"]["events"]
    assert sorted(events) == [(0, 6), (1, 6)]  # steps 7 and 8: the same episode
    for e in events.values():
        assert e["cause"] == "precision" and e["first_nonfinite"] == "booster"
        assert e["verified_fix"] == ["booster", "head"]
        assert _variants(e) == [
            "as it ran",
            "autocast off",
            "fp32 booster",
            "fp32 head",
            "fp32 booster, head",
        ]


def test_fsdp2_weights_beyond_param_dtype_are_named(jobs):
    """train_blocks' booster weight x1e6 is beyond float16: FSDP2 gathers it as inf, so even
    the fp32 variants are not finite; the event names the parameter whose shard holds it."""
    events = jobs["fsdp-blocks"]["events"]
    assert sorted(events) == [(0, 4), (1, 4)]
    for e in events.values():
        assert e["replayed"] is True and e["collective"] is True
        assert e["cause"] == "data-or-model"
        assert e["params_beyond_param_dtype"] == ["layers.0.mlp.booster.weight"]


# -- in-process 1-rank gloo jobs (the replay's seams, without torchrun) ---------------------------
SCRIPTS = ROOT / "tests" / "scripts"


#: set in the process a test of :func:`one_rank` runs apart in: the test's node id
_APART = "AMPROBE_TEST_APART"


@pytest.fixture
def one_rank(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Any:
    """A 1-rank gloo process group, in a process of the test's own: a gloo group's worker
    threads outlive ``destroy_process_group`` (see ``tests/helpers.py``), and a later test of
    the suite that forks with a ``preexec_fn`` (tests/test_hostile.py) then deadlocked in its
    child. In the suite's process the fixture runs the test again in a fresh pytest and yields
    None (the test returns at once); in that process, the group."""
    import torch.distributed as dist

    if os.environ.get(_APART) != request.node.nodeid:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
            cwd=ROOT,
            env={**os.environ, _APART: request.node.nodeid, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0 and " passed" in proc.stdout, (
            proc.stdout[-4000:] + proc.stderr[-2000:]
        )
        yield None
        return
    monkeypatch.syspath_prepend(str(SCRIPTS))
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield tmp_path
    finally:
        dist.destroy_process_group()


def _compiled_ddp_job(where: Path, replay: str) -> tuple[list[str], list[int], Any]:
    """train_replay's ``layer`` case (big's output overflows fp16 at step 5) with a BatchNorm
    buffer after it, as ``torch.compile(DDP(net), backend="aot_eager")``; the losses, the
    ``DDP._pre_forward`` calls per step (its reducer preparation and buffer broadcast)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from train_replay import batch, build

    net, scaler = build("layer", 5)
    seq = torch.nn.Sequential(net, torch.nn.BatchNorm1d(1))
    model = torch.compile(DDP(seq), backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    calls = {"n": 0}
    pre_forward = DDP._pre_forward

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return pre_forward(self, *args, **kwargs)

    DDP._pre_forward = counting  # type: ignore[method-assign]
    probe = amprobe.attach(
        model, opt, scaler, run_dir=str(where), config={"replay": replay, "numerics_every": 0}
    )
    losses, per_step = [], []
    try:
        for step in range(8):
            before = calls["n"]
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(batch("layer", step, 5))
            loss = out.float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(repr(float(loss.detach())))
            per_step.append(calls["n"] - before)
    finally:
        DDP._pre_forward = pre_forward  # type: ignore[method-assign]
        probe.close()
    return losses, per_step, amprobe.load_run(where)


def test_compiled_ddp_replays_ddps_module_eager_without_its_collectives(one_rank, monkeypatch):
    if one_rank is None:
        return  # (ran apart: see one_rank)
    import amprobe.capture.collectors.replay as replay

    monkeypatch.setattr(replay, "TIME_FACTOR", 1e6)
    on, calls_on, run = _compiled_ddp_job(one_rank / "on", "on")
    off, calls_off, _ = _compiled_ddp_job(one_rank / "off", "off")
    # the replay called no DDP forward: one reducer preparation (and buffer broadcast) a step
    assert calls_on == calls_off == [1] * 8
    assert on == off  # the training is the same with the replay on and off
    (event,) = run.events_of("replay")
    assert event["step"] == 5 and event["replayed"] is True
    assert event["compiled"] is False and event["cause"] == "precision"
    assert event["verified_fix"] == ["0.big"]
    assert "compiled DDP: replayed eager through DDP's module" in " ".join(event["notes"])


def _fsdp_job(where: Path, monkeypatch: pytest.MonkeyPatch, window: int = 0) -> dict[str, Any]:
    """train_replay's ``layer`` case under FSDP2 on 1 rank (fp16 MixedPrecisionPolicy,
    ShardedGradScaler), every step sampled (``numerics_every=1``), ``replay_time_factor`` 1e6;
    the probe's window count set to ``window`` before the bad step (5). What the replay saw:
    amprobe's hook calls during it, its budget, the probe's flags."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from train_replay import batch, build

    import amprobe.capture.collectors.replay as replay
    from amprobe.capture.collectors.graphstats import GRAPH_SAMPLE
    from amprobe.capture.dispatch import Dispatcher

    net, _ = build("layer", 5)
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for child in net.children():
        fully_shard(child, mp_policy=policy)
    model = fully_shard(net, mp_policy=policy)
    # (the group explicitly: its default is the first process group this process made)
    group = torch.distributed.group.WORLD
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8, growth_interval=1000, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    seen: dict[str, Any] = {"hooks": 0, "in_replay": False}
    call = Dispatcher.call

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen["hooks"] += seen["in_replay"]
        return call(self, *args, **kwargs)

    replay_step = replay.replay_step

    def spy(kept: Any, plan: Any) -> dict[str, Any]:
        seen.update(
            budget_s=plan.budget_s,
            replaying=probe.replaying,
            recording=probe.recording,
            graph_sample=GRAPH_SAMPLE.on,
            in_replay=True,
        )
        try:
            return replay_step(kept, plan)
        finally:
            seen["in_replay"] = False

    monkeypatch.setattr(Dispatcher, "call", counting)
    monkeypatch.setattr(replay, "replay_step", spy)
    probe = amprobe.attach(
        model,
        opt,
        scaler,
        run_dir=str(where),
        config={"numerics_every": 1, "replay_time_factor": 1e6},
    )
    try:
        for step in range(7):
            if step == 5:
                probe.window = window
            out = model(batch("layer", step, 5))
            scaler.scale(out.float().pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    finally:
        probe.close()
    seen["events"] = amprobe.load_run(where).events_of("replay")
    return seen


def test_fsdp2_replay_keeps_amprobes_hooks_out_and_reads_the_time_factor(one_rank, monkeypatch):
    if one_rank is None:
        return  # (ran apart: see one_rank)
    seen = _fsdp_job(one_rank / "run", monkeypatch)
    (event,) = seen["events"]
    assert event["replayed"] is True and event["step"] == 5
    assert "memory_check" in event  # the FSDP2 path
    # as the single-process replay: no amprobe hook runs inside it, no graph statistics
    assert seen["hooks"] == 0
    assert seen["replaying"] is True and seen["recording"] is False
    assert seen["graph_sample"] is False
    assert seen["budget_s"] > 1e3  # Config.replay_time_factor (1e6), not TIME_FACTOR (10)
    assert event["budget_s"] == pytest.approx(seen["budget_s"], rel=1e-3)


def test_fsdp2_probe_with_recording_windows_does_not_replay(one_rank, monkeypatch):
    """A dormant probe's windows start at each rank's own step boundary: the ranks may have
    recorded different steps, so a collective replay is not entered (decided locally)."""
    if one_rank is None:
        return  # (ran apart: see one_rank)
    seen = _fsdp_job(one_rank / "run", monkeypatch, window=1)
    (event,) = seen["events"]
    assert event["replayed"] is False and event["step"] == 5
    assert event["reason"] == (
        "FSDP2: the ranks' recording windows may differ (a dormant or live-attached probe): "
        "a replay is collective, so none"
    )
    assert "budget_s" not in seen  # nothing ran, no agreement was entered
