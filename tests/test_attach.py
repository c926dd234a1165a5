"""The attach path on CPU: GradScaler telemetry, step counting, numerics untouched, config errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import amprobe
from amprobe.config import ConfigError
from tests.helpers import TinyNet, train_loop


def _setup(seed: int = 0, fused: bool = False, lr: float = 1e-2):
    torch.manual_seed(seed)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused or None)
    return model, opt


EVERY_STEP = {"details_every": 1}  # the details (clipping, autocast) of every step


def _record(
    tmp_path,
    steps,
    dtype=torch.float16,
    use_scaler=True,
    inf_at=(),
    clip=None,
    config=None,
    fused=False,
    init_scale=1024.0,
    growth_interval=4,
):
    model, opt = _setup(fused=fused)
    scaler = (
        torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
        if use_scaler
        else None
    )
    with amprobe.attach(
        model=model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "run", config=config
    ):
        losses = train_loop(model, opt, scaler, steps, dtype=dtype, inf_at=inf_at, clip=clip)
    return amprobe.load_run(tmp_path / "run"), model, losses


def test_fp16_planted_inf_is_a_skipped_step(tmp_path):
    run, _, _ = _record(tmp_path, steps=12, inf_at=(5,))
    steps = run.steps.set_index("step")
    assert list(steps.index) == list(range(12)), "every iteration is a step, skipped ones too"
    assert bool(steps.loc[5, "skipped"]) is True
    assert steps.loc[5, "found_inf"] == 1.0
    assert steps.loc[5, "opt_steps"] == 0
    assert steps.loc[5, "scale_after"] == steps.loc[5, "scale_before"] / 2
    assert not steps.drop(index=5)["skipped"].any()
    assert (steps.drop(index=5)["opt_steps"] == 1).all()
    # the autocast setting is a detail: step 0 and every 10th step, not the others
    assert set(steps["autocast_dtype"].dropna()) == {"float16"}
    assert steps.loc[[0, 9], "autocast_dtype"].eq("float16").all()
    assert steps.loc[[3, 4], "autocast_dtype"].isna().all()  # (5 arms a capture: 6-8 sampled)
    assert set(steps["loss_dtype"]) == {"float32"}
    assert run.status == "finished"


def test_growth_and_backoff_follow_the_scaler(tmp_path):
    run, _, _ = _record(tmp_path, steps=10, inf_at=(6,), growth_interval=2)
    s = run.steps.set_index("step")
    # growth_interval=2: the scale doubles after every 2 clean steps
    assert s.loc[1, "scale_after"] == 2048 and s.loc[3, "scale_after"] == 4096
    assert s.loc[6, "scale_after"] == s.loc[6, "scale_before"] / 2
    # each step's scale_before is the previous step's scale_after
    assert (s["scale_before"].iloc[1:].to_numpy() == s["scale_after"].iloc[:-1].to_numpy()).all()


def test_skipped_iterations_are_not_merged(tmp_path):
    """120 iterations with many skips must show as 120 steps (the peer tool showed 8)."""
    run, _, _ = _record(tmp_path, steps=120, inf_at=range(0, 120, 2), config={"flush_every": 17})
    assert len(run.steps) == 120
    assert int(run.steps["skipped"].sum()) == 60
    health = amprobe.diagnose(run).health["scaler_success_rate"]
    assert health["value"] == pytest.approx(0.5)


def test_bf16_without_scaler_counts_optimizer_steps(tmp_path):
    run, _, _ = _record(tmp_path, steps=7, dtype=torch.bfloat16, use_scaler=False)
    assert list(run.steps["step"]) == list(range(7))
    assert not run.steps["scaler_enabled"].any()
    assert run.steps["scale_before"].isna().all()
    assert set(run.steps["autocast_dtype"].dropna()) == {"bfloat16"}
    assert run.steps["loss"].notna().all()


def test_fp32_run_without_amp(tmp_path):
    run, _, losses = _record(tmp_path, steps=5, dtype=None, use_scaler=False)
    assert len(run.steps) == 5
    assert run.steps["autocast_dtype"].isna().all()
    assert run.steps["loss"].tolist() == pytest.approx(losses)


def test_recorded_loss_matches_the_loop(tmp_path):
    run, _, losses = _record(tmp_path, steps=9)
    assert run.steps["loss"].tolist() == pytest.approx(losses, rel=1e-6)


def test_fused_optimizer_skip_detected_from_found_inf(tmp_path):
    run, _, _ = _record(tmp_path, steps=6, inf_at=(2,), fused=True)
    s = run.steps.set_index("step")
    assert bool(s.loc[2, "skipped"]) and s.loc[2, "found_inf"] == 1.0
    assert not s.drop(index=2)["skipped"].any()
    seen = run.events_of("optimizer_seen")[0]
    assert seen["fused"] is True and seen["amp_scaling_in_step"] is True


@pytest.mark.parametrize("dtype, inf_at", [(torch.float16, (3, 7)), (torch.bfloat16, ())])
def test_weights_bit_identical_with_and_without_probe(tmp_path, dtype, inf_at):
    def train(attach: bool):
        model, opt = _setup(seed=1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
        if attach:
            with amprobe.attach(
                model=model,
                optimizer=opt,
                scaler=scaler,
                run_dir=tmp_path / "p",
                config={"flush_every": 3},
            ):
                train_loop(model, opt, scaler, 15, dtype=dtype, inf_at=inf_at, clip="after_unscale")
        else:
            train_loop(model, opt, scaler, 15, dtype=dtype, inf_at=inf_at, clip="after_unscale")
        return copy.deepcopy(model.state_dict()), scaler.get_scale()

    plain, plain_scale = train(False)
    probed, probed_scale = train(True)
    assert plain_scale == probed_scale
    for name, tensor in plain.items():
        assert torch.equal(tensor, probed[name]), name


def test_clip_before_unscale_is_flagged_and_correct_order_is_not(tmp_path):
    bad, _, _ = _record(tmp_path / "bad", steps=5, clip="before_unscale", config=EVERY_STEP)
    good, _, _ = _record(tmp_path / "good", steps=5, clip="after_unscale", config=EVERY_STEP)
    assert bad.steps["clip_scaled"].tolist() == [1] * 5
    assert good.steps["clip_scaled"].tolist() == [0] * 5
    assert good.steps["clip_calls"].tolist() == [1] * 5
    assert "AMP-N09" in amprobe.diagnose(bad).ids()
    assert "AMP-N09" not in amprobe.diagnose(good).ids()
    event = bad.events_of("clip_before_unscale")[0]
    assert event["function"] == "clip_grad_norm_" and "helpers.py" in event["site"]


def test_clip_grad_value_imported_before_attach_is_seen(tmp_path):
    from torch.nn.utils import clip_grad_value_  # bound before amprobe patches anything

    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu")
    with amprobe.attach(
        model=model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "r", config=EVERY_STEP
    ):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 16)).float().pow(2).mean()
            scaler.scale(loss).backward()
            clip_grad_value_(model.parameters(), 0.1)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    run = amprobe.load_run(tmp_path / "r")
    assert run.steps["clip_scaled"].tolist() == [1, 1, 1]
    assert run.events_of("clip_before_unscale")[0]["function"] == "clip_grad_value_"


def test_scaler_rebuilt_in_loop_is_recorded_with_its_site(tmp_path):
    model, opt = _setup()
    with amprobe.attach(model=model, optimizer=opt, run_dir=tmp_path / "r"):
        for _ in range(4):
            scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
            train_loop(model, opt, scaler, 1)
    run = amprobe.load_run(tmp_path / "r")
    created = run.events_of("scaler_created")
    assert len(created) == 4
    assert len({c["site"] for c in created}) == 1 and "test_attach.py" in created[0]["site"]
    assert len(run.steps) == 4, "a rebuilt scaler still ends each iteration"
    assert "AMP-N08" in amprobe.diagnose(run).ids()


def test_resume_without_scaler_state(tmp_path):
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu")
    with amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "r"):
        train_loop(model, opt, scaler, 3)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        train_loop(model, opt, scaler, 3)
    run = amprobe.load_run(tmp_path / "r")
    assert len(run.events_of("optimizer_state_loaded")) == 1
    assert "AMP-N10" in amprobe.diagnose(run).ids()

    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu")
    with amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "ok"):
        train_loop(model, opt, scaler, 3)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        scaler.load_state_dict(scaler.state_dict())
        train_loop(model, opt, scaler, 3)
    run = amprobe.load_run(tmp_path / "ok")
    assert run.events_of("scaler_state_loaded")[0]["scale"] == 65536.0
    assert "AMP-N10" not in amprobe.diagnose(run).ids()


def test_half_master_weights_and_half_loss(tmp_path):
    torch.manual_seed(0)
    model = TinyNet().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with amprobe.attach(model=model, optimizer=opt, run_dir=tmp_path / "r"):
        for _ in range(3):
            loss = model(torch.randn(4, 16, dtype=torch.bfloat16)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    run = amprobe.load_run(tmp_path / "r")
    assert set(run.steps["loss_dtype"]) == {"bfloat16"}
    ids = amprobe.diagnose(run).ids()
    assert "AMP-N14" in ids and "AMP-N13" in ids


def test_collector_failure_never_reaches_the_loop(tmp_path, monkeypatch):
    from amprobe.capture.collectors.scaler import ScalerCollector

    def boom(self, *args):
        raise RuntimeError("collector bug")

    monkeypatch.setattr(ScalerCollector, "on_scale", boom)
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu")
    with amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "r"):
        train_loop(model, opt, scaler, 4)
    run = amprobe.load_run(tmp_path / "r")
    errors = run.events_of("collector_error")
    assert len(errors) == 1 and errors[0]["collector"] == "scaler"
    assert "collector bug" in errors[0]["error"]


def test_config_errors_raise_at_attach(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'flush_every'"):
        amprobe.attach(run_dir=tmp_path / "a", config={"flush_evry": 3})
    with pytest.raises(ConfigError, match="flush_every must be a positive integer"):
        amprobe.attach(run_dir=tmp_path / "a", config={"flush_every": 0})
    with pytest.raises(ConfigError, match="unknown collector"):
        amprobe.attach(run_dir=tmp_path / "a", config={"collectors": ("scaler", "nope")})
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        amprobe.attach(run_dir=tmp_path / "file")
    with pytest.raises(ConfigError, match="model must be a torch.nn.Module"):
        amprobe.attach(model="not a model", run_dir=tmp_path / "b")
    assert amprobe.current_probe() is None


def test_one_probe_per_process_and_reuse_of_run_dir(tmp_path):
    probe = amprobe.attach(run_dir=tmp_path / "r")
    with pytest.raises(ConfigError, match="already attached"):
        amprobe.attach(run_dir=tmp_path / "other")
    probe.close()
    # the store raises StoreError (a ValueError); the probe turns it into ConfigError at attach
    with pytest.raises(ConfigError, match="already holds a recording"):
        amprobe.attach(run_dir=tmp_path / "r")
    amprobe.attach(run_dir=tmp_path / "r", config={"overwrite": True}).close()


def test_close_is_idempotent_and_restores_torch(tmp_path):
    originals = (
        torch.amp.GradScaler.update,
        torch.amp.GradScaler.step,
        torch.Tensor.backward,
        torch.optim.Optimizer.load_state_dict,
    )
    probe = amprobe.attach(run_dir=tmp_path / "r")
    assert torch.amp.GradScaler.update is not originals[0]
    probe.close()
    probe.close()
    assert (
        torch.amp.GradScaler.update,
        torch.amp.GradScaler.step,
        torch.Tensor.backward,
        torch.optim.Optimizer.load_state_dict,
    ) == originals
    end = json.loads((tmp_path / "r" / "rank0" / "end.json").read_text())
    assert end["status"] == "finished"


def test_manifest_describes_the_process(tmp_path):
    model, opt = _setup()
    with amprobe.attach(model=model, optimizer=opt, run_dir=tmp_path / "r"):
        pass
    run = amprobe.load_run(tmp_path / "r")
    assert run.manifest["schema_version"] == 1
    assert run.manifest["torch_version"] == str(torch.__version__)
    m = run.rank_manifest
    assert m["device"] == "cpu" and m["rank"] == 0 and m["world_size"] == 1
    assert "bf16_supported" in m and m["pid"] > 0


def test_flush_every_bounds_what_is_buffered(tmp_path):
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu")
    probe = amprobe.attach(
        model=model,
        optimizer=opt,
        scaler=scaler,
        run_dir=tmp_path / "r",
        config={"flush_every": 4, "flush_interval_s": 3600},
    )
    train_loop(model, opt, scaler, 10)
    # 10 steps, flush every 4: 8 steps on disk before close
    lines = (tmp_path / "r" / "rank0" / "steps.jsonl").read_text().splitlines()
    assert len(lines) == 8
    probe.close()
    assert len((tmp_path / "r" / "rank0" / "steps.jsonl").read_text().splitlines()) == 10


@pytest.mark.parametrize(
    ("flush_every", "spacing", "on_disk"),
    [
        (None, 3600.0, 0),  # default: 100 steps, but not twice within the spacing
        (None, 0.0, 200),  # default with nothing to wait for: every 100 steps
        (100, 3600.0, 200),  # a value set is followed exactly, whatever the spacing
    ],
)
def test_default_flush_waits_for_its_spacing_on_short_steps(
    tmp_path, monkeypatch, flush_every, spacing, on_disk
):
    """Short steps (a millisecond, launch-bound) flushed every 100 steps: the flush's fixed cost
    and, on a GPU, its host-device sync every 0.1 s. Unset, ``flush_every`` now also waits
    ``FLUSH_MIN_SPACING_S`` since the last flush (patched here instead of timing steps)."""
    import amprobe.config as config_module

    monkeypatch.setattr(config_module, "FLUSH_MIN_SPACING_S", spacing)
    model, opt = _setup()
    config: dict = {"flush_interval_s": 3600}
    if flush_every is not None:
        config["flush_every"] = flush_every
    probe = amprobe.attach(model=model, optimizer=opt, run_dir=tmp_path / "r", config=config)
    train_loop(model, opt, None, 250)
    steps = tmp_path / "r" / "rank0" / "steps.jsonl"
    assert (len(steps.read_text().splitlines()) if steps.exists() else 0) == on_disk
    probe.close()
    assert len(steps.read_text().splitlines()) == 250


def test_probe_flush_time_is_not_user_time(tmp_path, monkeypatch):
    import time as _time

    from amprobe.store.writer import RunWriter

    original = RunWriter.flush

    def slow_flush(self):
        _time.sleep(0.5)
        return original(self)

    monkeypatch.setattr(RunWriter, "flush", slow_flush)
    model, opt = _setup()
    with amprobe.attach(
        model=model, optimizer=opt, run_dir=tmp_path / "r", config={"flush_every": 2}
    ):
        train_loop(model, opt, None, 6, dtype=None)
    steps = amprobe.load_run(tmp_path / "r").steps
    # a planted 0.5 s flush: were it counted as user time, some step would take >= 0.5 s
    assert steps["wall_s"].max() < 0.4, "the probe's own flush was counted as a training step"
    assert steps["probe_s"].max() >= 0.5


def test_gradient_accumulation_records_the_accumulated_loss_and_one_step(tmp_path):
    """The step's loss is the sum of what was backpropagated: with the usual loss / accum_steps
    that is the mean micro-batch loss, the value frameworks log."""
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    expected = []
    with amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "r"):
        for _ in range(3):
            micro = []
            for _ in range(4):  # 4 micro-batches per optimizer step
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss / 4).backward()
                micro.append(float(loss.detach()) / 4)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            expected.append(sum(micro))
    steps = amprobe.load_run(tmp_path / "r").steps
    assert list(steps["step"]) == [0, 1, 2], "one step per optimizer update, not per micro-batch"
    assert steps["loss"].tolist() == pytest.approx(expected, rel=1e-5)


def _penalty_step(model, scaler, x, y):
    """PyTorch's AMP gradient-penalty recipe; returns the objective it backpropagates."""
    with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    params = list(model.parameters())
    if scaler is not None:
        scaled = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
        grads = [g * (1.0 / scaler.get_scale()) for g in scaled]
    else:
        grads = torch.autograd.grad(loss, params, create_graph=True)
    penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
    objective = loss + penalty
    if scaler is not None:
        scaler.scale(objective).backward()
    else:
        objective.backward()
    return float(objective.detach())


@pytest.mark.parametrize("use_scaler", [True, False])
def test_gradient_penalty_records_the_backpropagated_objective(tmp_path, use_scaler):
    """Issue 19 item 2: the scaled loss given to autograd.grad is not part of the step's loss
    (before: loss + (loss + penalty) with a GradScaler, 1.9x the objective)."""
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu") if use_scaler else None
    g = torch.Generator().manual_seed(0)
    expected = []
    with amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "r"):
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            expected.append(_penalty_step(model, scaler, x, y))
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
    steps = amprobe.load_run(tmp_path / "r").steps
    assert steps["loss"].tolist() == pytest.approx(expected, rel=1e-5)


def test_loss_computed_from_a_scaled_loss_is_unscaled(tmp_path):
    """A backward root computed from scale()'s output (not the output itself) is divided by
    the scale in use, so the step's loss stays the objective."""
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    g = torch.Generator().manual_seed(0)
    expected = []
    with amprobe.attach(model=model, optimizer=opt, scaler=scaler, run_dir=tmp_path / "r"):
        for _ in range(2):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            (scaler.scale(loss) * 0.5).backward()
            expected.append(float(loss.detach()) * 0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    steps = amprobe.load_run(tmp_path / "r").steps
    assert steps["loss"].tolist() == pytest.approx(expected, rel=1e-5)
