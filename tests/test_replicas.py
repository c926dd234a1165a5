"""AMP-D05 replica-divergence: the fingerprint, the rule on hand-built rows, and gloo jobs
(DDP on 2 and 4 ranks, HSDP on a 2 x 2 mesh, pure FSDP2 sharding) with one flipped bit."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import amprobe
from amprobe.capture.collectors.replicas import fingerprint
from tests.helpers import (
    TinyNet,
    fake_run,
    recorded_rows,
    run_gloo_job,
    run_jobs,
    torchrun_argv,
    train_loop,
)

ROOT = Path(__file__).resolve().parent.parent


# -- the fingerprint -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1000, 70_001])  # 16-bit: one chunk, and chunks + a tail
def test_one_flipped_bit_changes_the_fingerprint(dtype, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(dtype)
    base = int(fingerprint(x))
    bits = torch.iinfo(torch.int32 if dtype == torch.float32 else torch.int16).bits
    as_int = torch.int32 if bits == 32 else torch.int16
    for index in (0, numel // 2, numel - 1):
        for bit in range(bits):  # every bit: the lowest mantissa bit, the exponent, the sign
            y = x.clone()
            y.view(as_int)[index] ^= torch.tensor(1 << bit).to(as_int)
            assert int(fingerprint(y)) != base, (dtype, index, bit)
    # a float sum misses the lowest mantissa bit; the fingerprint does not
    y = x.clone()
    y.view(as_int)[1] ^= 1
    assert int(fingerprint(y)) != base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fingerprint_is_exact_and_order_independent(dtype):
    x = torch.randn(70_001, generator=torch.Generator().manual_seed(1)).to(dtype)
    as_int = torch.int32 if dtype == torch.float32 else torch.int16
    exact = sum(int(v) for v in x.view(as_int).tolist())
    assert int(fingerprint(x)) == exact
    perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(2))
    assert int(fingerprint(x[perm])) == exact  # order-independent
    assert int(fingerprint(x.view(-1, 1).expand(-1, 1).t())) == exact  # a strided view
    assert fingerprint(x).dtype == torch.int64 and fingerprint(x).device == x.device


def test_config_turns_the_collector_on_in_multi_rank_jobs_only(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert "replicas" not in amprobe.Config().collectors  # one rank: nothing to compare
    assert "replicas" in amprobe.Config(world_size=4).collectors
    assert "replicas" in amprobe.Config(world_size=2, collectors=("scaler",)).collectors
    assert "replicas" not in amprobe.Config(world_size=2, fingerprint_every=0).collectors
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "replicas" in amprobe.Config().collectors
    assert amprobe.Config(fingerprint_every=7).sample_period("fingerprint_every") == (7, True)
    assert amprobe.Config().sample_period("fingerprint_every") == (100, False)
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(amprobe.ConfigError, match="fingerprint_every"):
            amprobe.Config(fingerprint_every=bad)


@pytest.mark.parametrize("late", [False, True])
def test_collector_samples_its_grid_and_is_not_called_between(tmp_path, monkeypatch, late):
    """In one process with a faked replica group (a second root model's parameters): the
    fingerprints on the multiples of the period only, and the collector not even called at the
    other steps' start, also when the replicated model is found after step 0 (its first sample
    is then the next multiple, the same grid)."""
    from amprobe.capture.collectors import replicas as collector_module

    replicated = TinyNet()
    ids = {id(p) for p in replicated.parameters()}
    monkeypatch.setattr(
        collector_module, "replica_group", lambda p, rank: [0, 1] if id(p) in ids else [0]
    )
    calls: list[int] = []
    begin = collector_module.ReplicasCollector.on_step_begin

    def counted(self, step):
        calls.append(step)
        begin(self, step)

    monkeypatch.setattr(collector_module.ReplicasCollector, "on_step_begin", counted)
    model = TinyNet()
    opt = torch.optim.SGD([*model.parameters(), *replicated.parameters()], lr=0.01)
    config = {"world_size": 2, "rank": 0, "fingerprint_every": 4, "replay": "off"}
    config["collectors"] = ("scaler", "replicas")
    with amprobe.attach(model, opt, run_dir=tmp_path / "r", config=config) as probe:
        if not late:
            probe.add_model(replicated)
        train_loop(model, opt, torch.amp.GradScaler("cpu"), 1)
        if late:
            probe.add_model(replicated)  # found at step 1
        train_loop(model, opt, torch.amp.GradScaler("cpu"), 10, seed=1)
    rows = recorded_rows(tmp_path / "r", "fingerprints")
    sampled = [4, 8] if late else [0, 4, 8]
    assert sorted({r["step"] for r in rows}) == sampled
    assert len({r["param"] for r in rows}) == 4 and {r["group"] for r in rows} == {"0,1"}
    # never asked on the other steps (step 1: asked once, where the model was found)
    assert sorted(set(calls)) == ([1, 4, 8] if late else sampled)


# -- the rule on hand-built rows ---------------------------------------------------------------
def _rows(
    ranks: list[int],
    steps: list[int],
    params: tuple[str, ...] = ("fc.weight", "fc.bias"),
    bad: dict[tuple[int, int, str], int] | None = None,
    group: str | None = None,
) -> list[dict[str, Any]]:
    """Fingerprint rows of ranks that agree except where ``bad[(rank, step, param)]`` says."""
    bad = bad or {}
    text = group or ",".join(map(str, ranks))
    return [
        {
            "rank": r,
            "step": s,
            "param": p,
            "fingerprint": bad.get((r, s, p), 1000 * s + i),
            "group": text,
            "dtype": "float32",
            "numel": 8,
        }
        for r in ranks
        for s in steps
        for i, p in enumerate(params)
    ]


def _d05(run) -> tuple[list[Any], str | None]:
    d = amprobe.diagnose(run, only=["AMP-D05"])
    reason = next((n.reason for n in d.not_checked if n.id == "AMP-D05"), None)
    return [f for f in d.findings if f.id == "AMP-D05"], reason


def _run(rows, ranks, events=(), manifest=None):
    return fake_run(
        ranks=ranks, tables={"fingerprints": rows}, events=list(events), manifest=manifest
    )


@pytest.mark.parametrize(
    ("ranks", "bad", "named", "majority", "step", "params"),
    [
        # three replicas, rank 2 differs at step 20 in one parameter: the minority rank
        (
            [0, 1, 2],
            {(2, 20, "fc.weight"): 7, (2, 30, "fc.weight"): 8},
            [2],
            True,
            20,
            ["fc.weight"],
        ),
        # two replicas: no majority, both named
        ([0, 1], {(1, 20, "fc.bias"): 7}, [0, 1], False, 20, ["fc.bias"]),
        # four replicas, rank 3 differs in both parameters from step 10
        (
            [0, 1, 2, 3],
            {(3, 10, "fc.weight"): 1, (3, 10, "fc.bias"): 2},
            [3],
            True,
            10,
            ["fc.bias", "fc.weight"],
        ),
        # four replicas split two against two: no majority, every rank named
        (
            [0, 1, 2, 3],
            {(2, 10, "fc.bias"): 5, (3, 10, "fc.bias"): 5},
            [0, 1, 2, 3],
            False,
            10,
            ["fc.bias"],
        ),
    ],
)
def test_d05_names_first_step_params_and_minority(ranks, bad, named, majority, step, params):
    rows = _rows(ranks, [0, 10, 20, 30], bad=bad)
    found, reason = _d05(_run(rows, ranks))
    assert reason is None and len(found) == 1
    ev = found[0].evidence
    assert ev["divergent"] == {
        "step": step,
        "ranks": named,
        "majority": majority,
        "params": params,
        "group": ranks,
    }
    assert ev["last_agreed_step"] == step - 10
    assert found[0].severity == "error" and found[0].category == "distributed"
    assert ("cannot be told" in found[0].title) == (not majority)
    assert f"step {step}" in found[0].title


def test_d05_silent_when_replicas_agree_and_groups_apart():
    # HSDP-like: groups {0, 2} and {1, 3} hold different shards (different values): no finding
    rows = _rows([0, 2], [0, 5, 10]) + [
        {**r, "fingerprint": r["fingerprint"] + 1} for r in _rows([1, 3], [0, 5, 10])
    ]
    found, reason = _d05(_run(rows, [0, 1, 2, 3]))
    assert reason is None and found == []
    # one bit off in group {1, 3} only: that group is named, not {0, 2}
    rows[-1] = {**rows[-1], "fingerprint": rows[-1]["fingerprint"] ^ 1}
    found, _ = _d05(_run(rows, [0, 1, 2, 3]))
    assert [f.evidence["divergent"]["group"] for f in found] == [[1, 3]]
    assert found[0].evidence["divergent"]["ranks"] == [1, 3]


def test_d05_steps_sampled_by_some_ranks_only_are_counted_not_compared():
    # rank 1 sampled step 15 and rank 0 did not; rank 1's step 15 differs: never compared
    rows = _rows([0, 1], [0, 10, 20]) + [
        {**r, "fingerprint": -1} for r in _rows([1], [15], group="0,1")
    ]
    found, reason = _d05(_run(rows, [0, 1]))
    assert reason is None and found == []
    # only unmatched steps: not checked, with the count
    rows = _rows([0], [0, 10], group="0,1") + _rows([1], [5, 15], group="0,1")
    found, reason = _d05(_run(rows, [0, 1]))
    assert found == [] and "share no step" in reason and "4 step(s)" in reason
    # a divergence is reported with the unmatched count beside it
    rows = _rows([0, 1], [0, 10, 20], bad={(1, 20, "fc.weight"): 3}) + _rows([1], [15], group="0,1")
    found, _ = _d05(_run(rows, [0, 1]))
    assert found[0].evidence["unmatched_step_count"] == 1
    assert found[0].evidence["compared_step_count"] == 3


@pytest.mark.parametrize(
    ("ranks", "rows", "events", "manifest", "says"),
    [
        ([0], _rows([0], [0, 10]), [], None, "single-rank"),
        ([0, 1], [], [], None, "no fingerprints recorded: the replicas collector was not on"),
        (
            [0, 1],
            [],
            [
                {
                    "kind": "replicas_layout",
                    "rank": r,
                    "engine": "dtensor",
                    "param_count": 4,
                    "replicated_count": 0,
                    "reason": "sharded: each rank holds its own shard (no replicate dimension)",
                }
                for r in (0, 1)
            ],
            None,
            "no replicas: sharded",
        ),
        (
            [0, 1],
            [],
            [],
            {"engine": "deepspeed", "engine_zero_stage": 2},
            "ZeRO-2 rewrites every rank's parameters",
        ),
    ],
)
def test_d05_not_checked_reasons(ranks, rows, events, manifest, says):
    found, reason = _d05(_run(rows, ranks, events, manifest))
    assert found == [] and reason is not None and says in reason, reason


def test_d05_evidence_renders_as_words_and_a_table():
    from amprobe.report.evidence import evidence_lines

    rows = _rows([0, 1, 2], [0, 10], bad={(1, 10, "fc.weight"): 9})
    (finding,), _ = _d05(_run(rows, [0, 1, 2]))
    text = "\n".join(evidence_lines(finding))
    assert "Rank 1 differs from the other 2 replicas of group 0-2 at step 10" in text
    assert "fc.weight" in text and "{" not in text and "None" not in text


# -- gloo jobs ------------------------------------------------------------------------------------
EVERY = 4  # fixed fingerprint period of the jobs (set explicitly: not the budget's schedule)
FLIP_STEP = 5  # the first sampled step at or after it: 8
JOBS: dict[str, tuple[dict[str, str], int, int]] = {
    # name: (environment, ranks, fingerprint_every)
    "ddp2": ({"WRAP": "ddp", "FLIP": f"1@{FLIP_STEP}"}, 2, EVERY),
    "ddp4": ({"WRAP": "ddp", "FLIP": f"2@{FLIP_STEP}"}, 4, EVERY),
    "hsdp": ({"WRAP": "hsdp", "FLIP": f"2@{FLIP_STEP}"}, 4, EVERY),
    "fsdp": ({"WRAP": "fsdp"}, 2, EVERY),
    "ddp2-off": ({"WRAP": "ddp", "FLIP": f"1@{FLIP_STEP}"}, 2, 0),
    "hsdp-off": ({"WRAP": "hsdp", "FLIP": f"2@{FLIP_STEP}"}, 4, 0),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tmp_path_factory.mktemp("replicas")

    def run(job: str) -> dict[str, Any]:
        job_env, nproc, every = JOBS[job]
        where = base / job
        where.mkdir()
        out = where / "run"
        cmd = [sys.executable, "-m", "amprobe", "run", "--out", str(out)]
        cmd += ["--set", f"fingerprint_every={every}", "--set", "replay=off"]
        cmd += ["--", *torchrun_argv("replicas_gloo.py", nproc=nproc), str(where)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), **job_env}
        proc = run_gloo_job(cmd, out, cwd=where, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        run_ = amprobe.load_run(out)
        found, reason = _d05(run_)
        losses = [(where / f"losses{r}.txt").read_text() for r in range(nproc)]
        return {"found": found, "reason": reason, "losses": losses, "run": run_}

    return run_jobs(JOBS, run)


@pytest.mark.parametrize(
    ("job", "named", "majority", "group"),
    [
        ("ddp2", [0, 1], False, [0, 1]),  # two replicas: both named, cannot be told
        ("ddp4", [2], True, [0, 1, 2, 3]),  # the minority rank
        ("hsdp", [0, 2], False, [0, 2]),  # replicas of shard 0: ranks 0 and 2
    ],
)
def test_flipped_bit_names_rank_param_and_first_sampled_step(jobs, job, named, majority, group):
    found = jobs[job]["found"]
    assert len(found) == 1, [f.title for f in found]
    ev = found[0].evidence
    assert ev["divergent"] == {
        "step": 8,  # the first sampled step at or after the flip at step 5
        "ranks": named,
        "majority": majority,
        "params": ["0.weight"],
        "group": group,
    }
    assert ev["last_agreed_step"] == 4 and ev["unmatched_step_count"] == 0
    assert ("cannot be told" in found[0].title) == (not majority)


def test_pure_sharding_is_not_checked_with_its_reason(jobs):
    assert jobs["fsdp"]["found"] == []
    assert "no replicas: sharded" in jobs["fsdp"]["reason"]


# 500 healthy steps of 2- and 4-rank DDP and of HSDP, every collector at its default schedule:
# no AMP-D05 and D05 checked, in tests/test_origin.py::test_gloo_healthy_no_origin (one launch
# per shape serves both rules and the sampled-steps agreement)


@pytest.mark.parametrize("job", ["ddp2", "hsdp"])
def test_losses_bit_identical_with_fingerprints_on_and_off(jobs, job):
    assert jobs[job]["losses"] == jobs[f"{job}-off"]["losses"]
    assert jobs[f"{job}-off"]["run"].table("fingerprints").empty
    assert "fingerprint" in jobs[f"{job}-off"]["reason"] or "not on" in jobs[f"{job}-off"]["reason"]
