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
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import amprobe
from tests.helpers import torchrun_argv

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
#: torch's, not amprobe's: after ``destroy_process_group`` the gloo group that functional
#: collectives used stays alive, and now and then (on a loaded machine, plain jobs as well) a
#: gloo worker thread frees its last all-reduce's tensors while the interpreter is finalizing
#: and aborts the rank (``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` ->
#: ``decref_pyobject`` -> ``take_gil`` -> ``std::terminate``). Such a job is run again.
EXIT_ABORT = "terminate called without an active exception"


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
    for _ in range(3):
        proc = subprocess.run(cmd, cwd=base, env=env, capture_output=True, text=True, timeout=240)
        if proc.returncode == 0 or EXIT_ABORT not in proc.stderr:
            break
        shutil.rmtree(out, ignore_errors=True)  # run again from scratch
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
