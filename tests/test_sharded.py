"""FSDP2 (``fully_shard`` + ``MixedPrecisionPolicy`` + ``ShardedGradScaler``) recorded as well as
torch.amp, GradScaler subclasses, wrapper-free layer names, and AMP-D03 (half-precision
gradient reduction).

The two real 2-rank gloo jobs run once per module, under ``amprobe run -- torchrun``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import amprobe
from amprobe.capture.collectors.sharded import local_tensor, sharding_facts, user_module_name
from tests.helpers import fake_run, run_gloo_job, torchrun_argv
from tests.test_analysis import _check_keys

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"inp", "mid", "booster", "head"}


def _record(out: Path, env: dict[str, str], *extra: str) -> amprobe.Run:
    cmd = [sys.executable, "-m", "amprobe", "run", "--out", str(out), *extra, "--"]
    cmd += torchrun_argv("fsdp_gloo.py")
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    proc = run_gloo_job(cmd, out, cwd=out.parent, env=full_env, timeout=240)  # (torch's abort)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = amprobe.load_run(out)
    assert [r.rank for r in run.ranks] == [0, 1]
    return run


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, amprobe.Run]:
    """``fp16``: fp16 params, fp32 reduce, ShardedGradScaler, ``booster`` x1e6 on steps 6-8,
    ``mid`` under an activation-checkpoint wrapper. ``reduce16``: fp32 params, fp16 reduce, no
    scaler, ``booster`` x1000 at step 10 (the next step's gradients overflow the fp16 sum)."""
    base = tmp_path_factory.mktemp("fsdp")
    return {
        "fp16": _record(
            base / "fp16",
            {"SCALER": "1", "PLANT": "6,7,8", "CKPT": "1", "PARAM_DTYPE": "float16"},
        ),
        "reduce16": _record(
            base / "reduce16",
            {"PARAM_DTYPE": "float32", "REDUCE_DTYPE": "float16", "PLANT": "10", "GAIN": "1000"},
            "--set",
            "numerics_every=1",
        ),
    }


# -- item 1: ShardedGradScaler steps, scale trajectory, N01-N03 --------------------------------
def test_sharded_grad_scaler_gives_one_step_per_iteration(fsdp_runs):
    steps = fsdp_runs["fp16"].steps
    for rank in (0, 1):
        part = steps[steps["rank"] == rank].sort_values("step")
        assert part["step"].tolist() == list(range(12))
        assert part.loc[part["skipped"].astype(bool), "step"].tolist() == [6, 7, 8]
        assert part["scale_before"].tolist() == [1024.0] * 7 + [512.0, 256.0] + [128.0] * 3
        assert part["scale_after"].iloc[8] == 128.0
        assert part["loss"].iloc[:6].notna().all()


def test_sharded_grad_scaler_findings_merge_both_ranks(fsdp_runs):
    findings = {f.id: f for f in amprobe.diagnose(fsdp_runs["fp16"]).findings}
    assert findings["AMP-N01"].evidence["ranks"] == [0, 1]
    assert findings["AMP-N02"].evidence["ranks"] == [0, 1]
    assert findings["AMP-N02"].evidence["skipped_count"] == 3
    assert "AMP-N03" not in findings  # three cuts then recovery: no collapse
    assert "AMP-D01" not in findings  # found-inf is all-reduced by ShardedGradScaler


# -- item 1: numerics on DTensor parameters and gradients ----------------------------------------
def test_numerics_measures_local_shards_and_stays_on(fsdp_runs):
    run = fsdp_runs["fp16"]
    assert not run.events_of("collector_error")
    numerics = run.table("numerics")
    grads = numerics[(numerics["kind"] == "grad_param") & (numerics["step"] == 0)]
    # each rank measures its own half of booster's 32x32 weight and 32 bias
    assert sorted(grads.loc[grads["module"] == "booster", "elements"]) == [528, 528]
    assert set(grads["dtype"]) == {"float32"}  # the sharded fp32 gradients FSDP2 keeps
    outputs = numerics[(numerics["kind"] == "output") & (numerics["step"] == 0)]
    assert set(outputs["dtype"]) == {"float16"}  # the compute dtype the policy sets
    n05 = next(f for f in amprobe.diagnose(run).findings if f.id == "AMP-N05")
    assert "booster" in n05.title and n05.evidence["ranks"] == [0, 1]


def test_gemm_weights_are_measured_unsharded(fsdp_runs):
    """Issue 36: every Linear is ``fully_shard``-ed, and FSDP2 reshards its weight in a forward
    hook: the block statistics read the gathered weight (full shape, compute dtype, exact)."""
    blocks = fsdp_runs["fp16"].table("blockstats")
    w = blocks[(blocks["operand"] == "w") & (blocks["step"] == 0)]
    full = {"inp": (32, 16), "mid": (32, 32), "booster": (32, 32), "head": (4, 32)}
    for rank in (0, 1):
        mine = w[w["rank"] == rank].drop_duplicates("layer").set_index("layer")
        assert {k: (r.rows, r.cols) for k, r in mine.iterrows()} == full
        assert set(mine["approx"]) == {""} and set(mine["dtype"]) == {"float16"}


def test_layer_names_are_the_users(fsdp_runs):
    run = fsdp_runs["fp16"]
    numerics = run.table("numerics")
    layers = set(numerics.loc[numerics["kind"] != "input", "module"])
    assert layers == LAYERS  # not "mid._checkpoint_wrapped_module"
    assert set(numerics["module_type"]) == {"Net", "Linear", "Booster"}  # not "FSDPLinear"
    ops = run.table("compute_ops")
    assert not ops.empty
    assert not any("_wrapped_module" in m or "FSDP" in m for m in ops["module"].dropna())
    assert run.events_of("model_registered")[0]["model_class"] == "Net"


# -- item 1: the MixedPrecisionPolicy is the job's precision setting ----------------------------
def test_mixed_precision_policy_recorded_and_no_s05(fsdp_runs):
    run = fsdp_runs["fp16"]
    for info in run.ranks:
        m = info.manifest
        assert m["framework"] == "fsdp2"
        assert m["fsdp_mp_policy"] == {
            "param_dtype": "float16",
            "reduce_dtype": "float32",
            "output_dtype": None,
        }
        assert m["framework_amp_dtype"] == "float16" and m["framework_casts_params"] is True
        assert "grad_reduce" not in m or m["grad_reduce"]["dtype"] == "float32"
    diagnosis = amprobe.diagnose(run)
    assert "AMP-S05" not in diagnosis.ids()
    assert "not reduced in half precision" in next(
        n.reason for n in diagnosis.not_checked if n.id == "AMP-D03"
    )


# -- item 2: AMP-D03 on a real fp16 reduction ------------------------------------------------------
def test_d03_names_layers_whose_fp16_reduction_overflowed(fsdp_runs):
    run = fsdp_runs["reduce16"]
    reduce = run.ranks[0].manifest["grad_reduce"]
    assert reduce == {
        "dtype": "float16",
        "world_size": 2,
        "pre_divide": 2.0,
        "source": "FSDP2 MixedPrecisionPolicy(reduce_dtype=torch.float16)",
        "measured": "reduced",
    }
    d03 = [f for f in amprobe.diagnose(run).findings if f.id == "AMP-D03"]
    assert len(d03) == 1
    ev = d03[0].evidence
    assert {layer["module"] for layer in ev["layers"]} == LAYERS
    assert all(layer["nonfinite_after_reduce"] for layer in ev["layers"])
    assert ev["ranks"] == [0, 1] and ev["exceeded_steps"] == [11]
    assert "reduce_dtype=torch.float32" in d03[0].fix
    _check_keys("AMP-D03", dict(ev))
    assert d03[0].severity == "warning" and d03[0].category == "distributed"


# -- AMP-D03 rule table on hand-built runs -----------------------------------------------------------
def _grad_rows(amax: float, scale: float, module: str = "fc", **extra: float) -> list[dict]:
    rows = []
    for rank in (0, 1):
        rows.append(
            {
                "rank": rank,
                "step": 3,
                "module": module,
                "kind": "grad_param",
                "amax": amax,
                "loss_scale": scale,
                "inf": extra.get("inf", 0),
                "nan": 0,
                "elements": 10,
            }
        )
        rows.append(
            {
                "rank": rank,
                "step": 3,
                "module": module,
                "kind": "grad_output",
                "amax": 1.0,
                "loss_scale": scale,
                "inf": extra.get("gout_inf", 0),
                "nan": 0,
                "elements": 10,
            }
        )
    return rows


def _reduce(dtype: str, world: int, pre: float, measured: str) -> dict:
    return {
        "grad_reduce": {
            "dtype": dtype,
            "world_size": world,
            "pre_divide": pre,
            "measured": measured,
            "source": "test",
        }
    }


@pytest.mark.parametrize(
    ("manifest", "rows", "expect"),
    [
        # DDP-style sum then divide over 8 ranks: 20 * 512 * 8 = 81920 > 65504
        (_reduce("float16", 8, 1.0, "local"), _grad_rows(20.0, 512.0), "fc"),
        # the same with 4 ranks: 40960 fits
        (_reduce("float16", 4, 1.0, "local"), _grad_rows(20.0, 512.0), None),
        # DDP's fp16 hook casts then divides by the world size: the rank's own value counts
        (_reduce("float16", 8, 8.0, "local"), _grad_rows(20.0, 512.0), None),
        (_reduce("float16", 8, 8.0, "local"), _grad_rows(200.0, 512.0), "fc"),
        # FSDP2 hands the reduced gradient to the hooks: inf there, finite upstream
        (_reduce("float16", 2, 2.0, "reduced"), _grad_rows(float("nan"), 1.0, inf=3), "fc"),
        # ...but an inf that came down the backward already is not the reduction's
        (
            _reduce("float16", 2, 2.0, "reduced"),
            _grad_rows(float("nan"), 1.0, inf=3, gout_inf=2),
            None,
        ),
        # bf16 over 2 ranks: error bound 0.4 % < 1 %
        (_reduce("bfloat16", 2, 1.0, "reduced"), _grad_rows(1.0, 1.0), None),
        # bf16 over 64 ranks: 24.6 % bound, an info finding
        (_reduce("bfloat16", 64, 1.0, "reduced"), _grad_rows(1.0, 1.0), "bf16"),
    ],
)
def test_d03_rule_table(manifest, rows, expect):
    run = fake_run(ranks=[0, 1], manifest=manifest, tables={"numerics": rows})
    d03 = [f for f in amprobe.diagnose(run).findings if f.id == "AMP-D03"]
    for f in d03:
        _check_keys(f.id, dict(f.evidence))
    if expect is None:
        assert d03 == []
    elif expect == "bf16":
        assert len(d03) == 1 and d03[0].severity == "info"
        assert d03[0].evidence["sum_rel_error_bound"] == pytest.approx(63 * 2**-8, rel=1e-4)
    else:
        assert len(d03) == 1 and d03[0].evidence["layers"][0]["module"] == expect
        assert d03[0].evidence["ranks"] == [0, 1]


def test_d03_not_checked_for_fp32_reduction():
    run = fake_run(
        ranks=[0, 1],
        manifest=_reduce("float32", 2, 1.0, "reduced"),
        tables={"numerics": _grad_rows(1e9, 1.0)},
    )
    diagnosis = amprobe.diagnose(run)
    assert "AMP-D03" in {n.id for n in diagnosis.not_checked}


# -- pieces that need no process group ----------------------------------------------------------------
def test_ddp_fp16_compress_hook_is_a_half_reduce():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    class _Group:
        def size(self) -> int:
            return 4

    ddp_like = nn.Linear(2, 2)
    ddp_like._comm_hooks = [(fp16_compress_hook, None)]
    ddp_like.process_group = _Group()
    facts = sharding_facts(ddp_like)
    assert facts["grad_reduce"]["dtype"] == "float16"
    assert facts["grad_reduce"]["world_size"] == 4
    assert facts["grad_reduce"]["pre_divide"] == 4.0
    assert sharding_facts(nn.Linear(2, 2)) == {}


def test_user_module_name_and_local_tensor():
    assert user_module_name("layers.0._checkpoint_wrapped_module.attn") == "layers.0.attn"
    assert user_module_name("_fsdp_wrapped_module.fc") == "fc"
    assert user_module_name("fc") == "fc"
    t = torch.ones(3)
    assert local_tensor(t) is t


class _OwnUpdate(torch.amp.GradScaler):
    """A subclass whose update calls the base one (the double-boundary trap)."""

    def update(self, new_scale=None):
        super().update(new_scale)


class _Reimplemented(torch.amp.GradScaler):
    """A subclass that reimplements update without calling the base (as ShardedGradScaler)."""

    def update(self, new_scale=None):
        assert self._scale is not None
        found = sum(
            v.item()
            for s in self._per_optimizer_states.values()
            for v in s["found_inf_per_device"].values()
        )
        if found:
            self._scale.mul_(self._backoff_factor)
        self._per_optimizer_states.clear()


@pytest.mark.parametrize("cls", [_OwnUpdate, _Reimplemented])
def test_grad_scaler_subclass_overrides_are_hooked(tmp_path, cls):
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cls("cpu", init_scale=256.0)
    with amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "r") as _:
        for i in range(5):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(2, 4)).float().sum() * (float("inf") if i == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    steps = amprobe.load_run(tmp_path / "r").steps
    assert steps["step"].tolist() == [0, 1, 2, 3, 4]  # one boundary per iteration, not two
    assert steps["skipped"].astype(bool).tolist() == [False, False, True, False, False]
    assert steps["scale_after"].tolist()[2] == 128.0
    # closing the probe restored the subclass's own method
    assert cls.__dict__["update"].__qualname__.startswith(cls.__name__)
    assert json.dumps(steps["scale_before"].tolist())


class _FakeFSDPNet(nn.Module):
    """Duck-types FSDP2's root (``_get_fsdp_state()._mp_policy``) without a process group."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def _get_fsdp_state(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        class _State:
            _mp_policy = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16
            )
            _fsdp_param_group = None

        return _State()


def test_policy_recorded_when_the_model_is_discovered_after_attach(tmp_path, monkeypatch):
    """Attached late (objects built first, nothing passed): the root is registered at the
    first step's boundary, and the policy is read at the next step's end."""
    monkeypatch.setenv("WORLD_SIZE", "64")
    model = _FakeFSDPNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"collectors": (*amprobe.Config().collectors, "discovery")}
    with amprobe.attach(run_dir=tmp_path / "r", config=config):
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    run = amprobe.load_run(tmp_path / "r")
    manifest = run.ranks[0].manifest
    assert manifest["fsdp_mp_policy"]["param_dtype"] == "bfloat16"
    assert manifest["grad_reduce"]["world_size"] == 64
    assert manifest["framework_precision_setting"] == (
        "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)"
    )
