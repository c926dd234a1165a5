"""Tensor parallelism (issue 31 §3): a ``RowwiseParallel`` layer's output is measured, and
AMP-N05 names it when it overflows.

``RowwiseParallel``'s output is an all-reduce still in flight, a
``torch.distributed._functional_collectives.AsyncCollectiveTensor`` (with
``use_local_output=False`` the local tensor of a DTensor); it was skipped as a wrapper subclass,
and the layer reading it counted that unread input as finite, so AMP-N05 blamed ``head``. It is
now measured as the tensor it becomes once waited on, on sampled steps only; an input that
cannot be read marks its layer's inputs "not checked", and such a layer is never named.

The 2-rank gloo jobs (``tests/scripts/tp_gloo.py``, every Linear in the plan) run once per
module, each plain and under ``amprobe run -- torchrun``, two at a time.
"""

from __future__ import annotations

import json
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.testing._internal.two_tensor import TwoTensor

import amprobe
from tests.helpers import run_gloo_job, torchrun_argv

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"inp", "mlp.fc1", "mlp.fc2", "head"}
STEPS = 6
#: per dtype: the script's environment, ``amprobe run`` options, the sampled steps, the planted
#: step AMP-N05 names and the first step that overflowed. fp16: x1e6 on steps 3-4 with a
#: GradScaler (step 3 unsampled, its overflow arms the capture of 4 and 5); bf16: x1e39 (beyond
#: bf16's range) on the last step, sampled every 5 steps
DTYPES: dict[str, dict[str, Any]] = {
    "float16": {
        "env": {"PLANT": "3,4"},
        "sets": (),
        "sampled": [0, 4, 5],
        "named_at": 4,
        "first_overflow": 3,
    },
    "bfloat16": {
        "env": {"PLANT": "5", "GAIN": "1e39"},
        "sets": ("--set", "numerics_every=5"),
        "sampled": [0, 5],
        "named_at": 5,
        "first_overflow": 5,
    },
}
CASES = [(dtype, local) for dtype in DTYPES for local in ("1", "0")]


def _job(base: Path, dtype: str, local: str, probed: bool) -> dict[str, Any]:
    """One 2-rank job: each rank's per-step record (and the run when ``probed``)."""
    name = f"{dtype}-local{local}-{'run' if probed else 'plain'}"
    losses = base / name
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DTYPE": dtype,
        "USE_LOCAL_OUTPUT": local,
        "STEPS": str(STEPS),
        "LOSSES": str(losses),
        **DTYPES[dtype]["env"],
    }
    cmd = torchrun_argv("tp_gloo.py")
    out = base / f"{name}-run"
    if probed:
        cmd = [sys.executable, "-m", "amprobe", "run", "--out", str(out)]
        cmd += [*DTYPES[dtype]["sets"], "--", *torchrun_argv("tp_gloo.py")]
    proc = run_gloo_job(cmd, out, cwd=base, env=env, timeout=240)  # (torch's exit abort)
    assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    records = [json.loads(Path(f"{losses}.{rank}.json").read_text()) for rank in (0, 1)]
    return {"records": records, "run": amprobe.load_run(out) if probed else None}


@pytest.fixture(scope="module")
def tp_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, bool], Any]:
    base = tmp_path_factory.mktemp("tp")
    keys = [(dtype, local, probed) for dtype, local in CASES for probed in (False, True)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(_job, base, *key) for key in keys}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize(("dtype", "local"), CASES)
def test_probed_job_has_the_plain_jobs_losses_scales_and_skips(tp_jobs, dtype, local):
    plain, probed = tp_jobs[dtype, local, False], tp_jobs[dtype, local, True]
    assert probed["records"] == plain["records"], "per-step losses (bit for bit), scales, skips"
    for records in plain["records"]:
        skipped = [step for step, r in enumerate(records) if r["skipped"]]
        assert skipped == ([3, 4] if dtype == "float16" else [])
        planted = DTYPES[dtype]["first_overflow"]
        assert math.isfinite(float.fromhex(records[planted - 1]["loss"]))
        assert not math.isfinite(float.fromhex(records[planted]["loss"]))
    assert plain["records"][0] == plain["records"][1], "both ranks train on the same batches"
    steps = probed["run"].steps
    for rank, records in enumerate(probed["records"]):
        part = steps[steps["rank"] == rank].sort_values("step")
        assert part["skipped"].astype(bool).tolist() == [r["skipped"] for r in records]


@pytest.mark.parametrize(("dtype", "local"), CASES)
def test_every_layer_output_is_measured_on_both_ranks(tp_jobs, dtype, local):
    run = tp_jobs[dtype, local, True]["run"]
    assert [r.rank for r in run.ranks] == [0, 1]
    assert not run.events_of("collector_error")
    subclass = [e for e in run.events_of("numerics_not_checked") if e["what"] == "subclass_tensors"]
    assert subclass == []  # the AsyncCollectiveTensor was skipped as a wrapper subclass
    numerics = run.table("numerics")
    outputs = numerics[numerics["kind"] == "output"]
    sampled = DTYPES[dtype]["sampled"]
    for rank in (0, 1):
        mine = outputs[outputs["rank"] == rank]
        assert sorted(set(mine["step"])) == sampled
        for step in sampled:
            rows = mine[mine["step"] == step].set_index("module")
            assert set(rows.index) == LAYERS, (rank, step)
            assert set(rows["dtype"]) == {dtype}
            # the RowwiseParallel layer's all-reduced output (batch 4 x 16, replicated); its
            # reader's input counted from it, not skipped
            assert rows.loc["mlp.fc2", "elements"] == 64
            assert rows["in_nonfinite"].notna().all()
        planted = mine[mine["step"] == DTYPES[dtype]["named_at"]].set_index("module")
        bad = planted["nan"] + planted["inf"]
        assert bad["mlp.fc2"] == 64 and bad["inp"] == bad["mlp.fc1"] == 0
        assert planted.loc["mlp.fc2", "in_nonfinite"] == 0
        assert planted.loc["head", "in_nonfinite"] == 64  # head's input is fc2's output


@pytest.mark.parametrize(("dtype", "local"), CASES)
def test_n05_names_the_rowwise_parallel_layer_not_head(tp_jobs, dtype, local):
    run = tp_jobs[dtype, local, True]["run"]
    n05 = [f for f in amprobe.diagnose(run).findings if f.id == "AMP-N05"]
    assert len(n05) == 1, [f.title for f in n05]
    ev = n05[0].evidence
    assert n05[0].title.startswith("mlp.fc2 (Gained) is the first module whose output")
    assert ev["module"] == "mlp.fc2" and ev["offending_modules"] == ["mlp.fc2"]
    assert ev["ranks"] == [0, 1]
    assert ev["step"] == DTYPES[dtype]["named_at"]
    assert ev["first_overflow_step"] == DTYPES[dtype]["first_overflow"]
    offenders = run.table("offenders")
    forward = offenders[offenders["kind"] == "forward"]
    assert sorted(forward["rank"]) == [0, 1] and set(forward["module"]) == {"mlp.fc2"}


# -- in one process, no process group ------------------------------------------------------------
class _Pending(torch.autograd.Function):
    """Identity whose result is an ``AsyncCollectiveTensor`` not yet waited on, as a functional
    all-reduce returns it (waiting on a tensor no collective wrote returns it at once)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return AsyncCollectiveTensor(x.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Reduced(nn.Linear):
    """Stands for ``RowwiseParallel``: its output an all-reduce still in flight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Pending.apply(super().forward(x))


class _PendingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.red = _Reduced(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.red(torch.relu(self.inp(x))))


def test_async_collective_output_is_measured_and_waited_on_sampled_steps_only(tmp_path):
    torch.manual_seed(0)
    model = _PendingNet()
    seen: list[tuple[bool, float]] = []

    def look(module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0]
        assert type(x) is AsyncCollectiveTensor
        seen.append((x.completed, x.elem.abs().max().item()))  # .elem: no wait

    model.head.register_forward_pre_hook(look)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amprobe.attach(model, opt, run_dir=tmp_path / "r", config={"numerics_every": 2}):
        for _ in range(4):
            model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    # waited on by the measurement on sampled steps (0, 2); left to the reader on the others
    assert [done for done, _ in seen] == [True, False, True, False]
    run = amprobe.load_run(tmp_path / "r")
    assert not run.events_of("numerics_not_checked") and not run.events_of("collector_error")
    numerics = run.table("numerics")
    red = numerics[(numerics["module"] == "red") & (numerics["kind"] == "output")]
    assert red["step"].tolist() == [0, 2]
    assert red["elements"].tolist() == [24, 24]
    assert red["amax"].tolist() == pytest.approx([seen[0][1], seen[2][1]])
    head = numerics[(numerics["module"] == "head") & (numerics["kind"] == "output")]
    assert head["in_nonfinite"].tolist() == [0, 0]  # its pending input was read, not skipped


class _Pair(nn.Module):
    """Output a wrapper tensor subclass (a float8/NF4 stand-in) whose values amprobe cannot read."""

    def __init__(self, wrap: bool) -> None:
        super().__init__()
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach()
        return TwoTensor(x, x) if self.wrap else x


class _Blowup(nn.Module):
    """Makes inf/NaN from whatever it is given."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = x.a if isinstance(x, TwoTensor) else x
        return plain * float("inf")


class _UnreadNet(nn.Module):
    def __init__(self, wrap: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.pair = _Pair(wrap)
        self.blowup = _Blowup()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blowup(self.pair(self.inp(x))))


@pytest.mark.parametrize("wrap", [True, False])
def test_a_layer_whose_input_was_not_read_is_never_named_the_first_offender(tmp_path, wrap):
    """``blowup`` turns its input non-finite. With a plain input (the control) it is the first
    offender; with a ``TwoTensor`` input, whose values amprobe cannot read, its inputs are
    'not checked' (``in_nonfinite`` null, never 0), so it is not named, and neither is ``head``,
    whose input was read and non-finite."""
    torch.manual_seed(0)
    model = _UnreadNet(wrap)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amprobe.attach(model, opt, run_dir=tmp_path / "r", config={"numerics_every": 1}):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    run = amprobe.load_run(tmp_path / "r")
    assert not run.events_of("collector_error")
    numerics = run.table("numerics")
    rows = numerics[(numerics["kind"] == "output") & (numerics["step"] == 0)].set_index("module")
    assert rows.loc["blowup", "nan"] + rows.loc["blowup", "inf"] == 4 * 3
    assert rows.loc["head", "in_nonfinite"] == 12
    offenders = run.table("offenders")
    named = offenders.loc[offenders["kind"] == "forward", "module"].tolist()
    n05 = [f.evidence["module"] for f in amprobe.diagnose(run).findings if f.id == "AMP-N05"]
    if wrap:
        assert pd.isna(rows.loc["blowup", "in_nonfinite"])
        assert named == [] and n05 == []
    else:
        assert rows.loc["blowup", "in_nonfinite"] == 0
        assert named == ["blowup"] and n05 == ["blowup"]


@pytest.mark.parametrize(("dtype", "local"), CASES)
def test_gemm_operands_of_tensor_parallel_layers_are_labelled_local_shards(tp_jobs, dtype, local):
    """Issue 36: a tensor-parallel weight is measured as its local shard (labelled
    approximate); a replicated input (the Colwise layers') is whole, a sharded one is not; the
    AsyncCollectiveTensor input of ``head`` (use_local_output) is waited on, never handed to
    the block kernel as a wrapper without memory (a segfault once)."""
    blocks = tp_jobs[dtype, local, True]["run"].table("blockstats")
    first = blocks[blocks["step"] == 0].drop_duplicates(["rank", "layer", "operand"])
    assert set(first["rank"]) == {0, 1}
    full = {"inp": (16, 8), "mlp.fc1": (32, 16), "mlp.fc2": (16, 32), "head": (4, 16)}
    for r in first.itertuples():
        if r.operand == "w":
            assert r.approx == "local shard of a tensor-parallel weight", r
            assert 2 * r.rows * r.cols == full[r.layer][0] * full[r.layer][1], r
        elif r.operand == "x":
            sharded = r.layer == "mlp.fc2"  # RowwiseParallel: its input is split along K
            assert r.approx == ("local shard of a tensor-parallel input" if sharded else ""), r
        else:  # dY: split along N where the Colwise output is not gathered (a plain local
            # tensor with use_local_output, a DTensor without)
            # (without it, the Rowwise output's gradient arrives as a DTensor not replicated:
            # its local tensor is labelled, as every such DTensor)
            sharded = r.layer == "mlp.fc1" or (r.layer == "mlp.fc2" and local == "0")
            what = "local shard of a tensor-parallel output gradient"
            assert r.approx == (what if sharded else ""), r
