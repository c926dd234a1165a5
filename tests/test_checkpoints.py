"""Poisoned checkpoints (issue 34, part 4): AMP-N18 and ``checkpoint_guard``.

Saves through ``torch.save``, DCP (one process, and 2 gloo ranks with one rank poisoned), the
Hugging Face Trainer and Lightning, on tiny CPU models: a poisoned save is named (file, step,
tensors), a clean one is the last good checkpoint, ``checkpoint_guard="raise"`` leaves no file
behind and the training goes on, and amprobe's patches are gone after close.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import amprobe
from amprobe.capture import checkpoints as ckpt_mod
from tests.helpers import fake_run, run_gloo_job, torchrun_argv

ROOT = Path(__file__).resolve().parent.parent


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _n18(run: amprobe.Run):
    diagnosis = amprobe.diagnose(run, only=["AMP-N18"])
    found = [f for f in diagnosis.findings if f.id == "AMP-N18"]
    return (found[0] if found else None), diagnosis


@pytest.fixture
def attached(tmp_path):
    """``attach(config)`` for a test; closed at its end (also when the test fails)."""
    probes = []

    def attach(**config):
        probe = amprobe.attach(run_dir=tmp_path / "run", config=config)
        probes.append(probe)
        return probe

    yield attach
    for probe in probes:
        probe.close()


# -- torch.save --------------------------------------------------------------------------------
def test_poisoned_state_dict_named_with_the_last_good_checkpoint(tmp_path, attached):
    model, opt = _model()
    probe = attached()
    _train(model, opt)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "a.pt")
    _train(model, opt)
    with torch.no_grad():
        model[2].weight[1, 2] = float("nan")
        model[2].weight[0, 0] = float("inf")
    torch.save(model.state_dict(), tmp_path / "b.pt")
    torch.save(model.state_dict(), tmp_path / "c.pt")  # a later poisoned one: not the first
    torch.save(torch.full((3,), float("nan")), tmp_path / "data.pt")  # a bare tensor: data
    probe.close()
    assert (tmp_path / "b.pt").exists(), "warn lets the save go on"
    run = amprobe.load_run(tmp_path / "run")
    finding, _ = _n18(run)
    assert finding is not None and finding.severity == "error"
    ev = finding.evidence
    assert ev["path"] == str(tmp_path / "b.pt") and ev["step"] == 4
    assert ev["function"] == "torch.save" and ev["refused"] is False
    assert ev["tensors"] == [
        {"tensor": "2.weight", "inf_count": 1, "nan_count": 1, "element_count": 32}
    ]
    assert ev["last_good_path"] == str(tmp_path / "a.pt") and ev["last_good_step"] == 2
    assert ev["poisoned_save_count"] == 2
    assert str(tmp_path / "b.pt") in finding.title and "2.weight" in finding.title
    assert str(tmp_path / "a.pt") in finding.fix
    # the clean save was checked (parameters and Adam's state), the bare tensor was not
    saved = run.events_of("checkpoint_saved")
    assert [e["path"] for e in saved] == [str(tmp_path / "a.pt")]
    assert saved[0]["tensor_count"] == 4 + 4 * 3  # 4 parameters; step, exp_avg, exp_avg_sq
    assert not [e for e in run.events_of("checkpoint_nonfinite") if "data" in e["path"]]


def test_poisoned_optimizer_state_dict_named(tmp_path, attached):
    model, opt = _model()
    probe = attached()
    _train(model, opt)
    opt.state[model[0].bias]["exp_avg_sq"][3] = float("inf")
    with open(tmp_path / "opt.pt", "wb") as f:  # a file object: its name is the path
        torch.save(opt.state_dict(), f)
    probe.close()
    finding, _ = _n18(amprobe.load_run(tmp_path / "run"))
    assert finding is not None
    assert finding.evidence["path"] == str(tmp_path / "opt.pt")
    assert finding.evidence["step"] == 2
    assert [t["tensor"] for t in finding.evidence["tensors"]] == ["state.1.exp_avg_sq"]
    assert finding.evidence["last_good_path"] is None
    assert "No checkpoint with finite values" in finding.fix


def test_clean_saves_give_no_finding(tmp_path, attached):
    model, opt = _model()
    probe = attached()
    _train(model, opt)
    # objects, not state dicts (a root model is not pickled: amprobe's hooks on it are local
    # functions, which pickle refuses, as it refuses any local forward hook)
    head = nn.Linear(4, 2)
    torch.save({"model": model.state_dict(), "head": head, "optimizer": opt}, tmp_path / "o.pt")
    probe.close()
    run = amprobe.load_run(tmp_path / "run")
    finding, diagnosis = _n18(run)
    assert finding is None
    assert [e["tensor_count"] for e in run.events_of("checkpoint_saved")] == [4 + 2 + 4 * 3]
    assert "AMP-N18" not in {n.id for n in diagnosis.not_checked}, "it was checked"


def test_raise_leaves_no_file_and_the_training_goes_on(tmp_path, attached):
    model, opt = _model()
    probe = attached(checkpoint_guard="raise")
    _train(model, opt)
    torch.save(model.state_dict(), tmp_path / "good.pt")
    opt.state[model[2].weight]["exp_avg"][0, 0] = float("nan")
    with pytest.raises(amprobe.PoisonedCheckpointError) as raised:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "bad.pt")
    assert not (tmp_path / "bad.pt").exists()
    err = raised.value
    assert isinstance(err, RuntimeError)
    assert err.path == str(tmp_path / "bad.pt") and err.step == 2
    assert [t["tensor"] for t in err.tensors] == ["opt.state.2.exp_avg"]
    assert "bad.pt" in str(err) and "step 2" in str(err) and "opt.state.2.exp_avg" in str(err)
    # it names the last clean save it saw, and claims nothing about the disk
    assert err.last_good_path == str(tmp_path / "good.pt") and err.last_good_step == 2
    assert repr(str(tmp_path / "good.pt")) in str(err) and "if it is still there" in str(err)
    assert "still on disk" not in str(err)
    opt.state[model[2].weight]["exp_avg"].nan_to_num_(0.0)
    _train(model, opt)  # the user caught it: training and saving go on
    torch.save(model.state_dict(), tmp_path / "later.pt")
    assert (tmp_path / "later.pt").exists()
    probe.close()
    run = amprobe.load_run(tmp_path / "run")
    assert run.status == "finished" and len(run.steps) == 4
    finding, _ = _n18(run)
    assert finding is not None and finding.evidence["refused"] is True
    assert "refused" in finding.title and "nothing was written" in finding.fix
    assert finding.evidence["last_good_path"] == str(tmp_path / "good.pt")


def test_raise_names_no_last_good_when_no_save_checked_a_tensor(tmp_path, attached):
    """An RNG-state save checks no floating tensor: it is no clean checkpoint to name."""
    model, opt = _model()
    probe = attached(checkpoint_guard="raise")
    _train(model, opt)
    torch.save({"rng": torch.get_rng_state()}, tmp_path / "rng.pt")
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(amprobe.PoisonedCheckpointError) as raised:
        torch.save(model.state_dict(), tmp_path / "bad.pt")
    probe.close()
    assert raised.value.last_good_path is None and raised.value.last_good_step is None
    assert "saw no clean save on this rank" in str(raised.value)
    assert "rng.pt" not in str(raised.value)


def test_close_removes_the_patches_and_off_installs_none(tmp_path):
    originals = (torch.save, torch.serialization.save)
    probe = amprobe.attach(run_dir=tmp_path / "run")
    assert torch.save is not originals[0] and torch.serialization.save is not originals[1]
    probe.close()
    assert (torch.save, torch.serialization.save) == originals
    probe = amprobe.attach(run_dir=tmp_path / "off", config={"checkpoint_guard": "off"})
    try:
        assert (torch.save, torch.serialization.save) == originals
    finally:
        probe.close()
    _, diagnosis = _n18(amprobe.load_run(tmp_path / "off"))
    reasons = {n.id: n.reason for n in diagnosis.not_checked}
    assert 'checkpoint_guard was "off"' in reasons["AMP-N18"]


def test_no_save_is_not_checked_with_the_reason(tmp_path, attached):
    model, opt = _model()
    probe = attached()
    _train(model, opt)
    probe.close()
    _, diagnosis = _n18(amprobe.load_run(tmp_path / "run"))
    reasons = {n.id: n.reason for n in diagnosis.not_checked}
    assert reasons["AMP-N18"].startswith("no checkpoint save was seen")


def test_a_failed_check_is_recorded_once_and_the_save_goes_on(tmp_path, attached, monkeypatch):
    def broken(obj, skip=frozenset()):
        raise RuntimeError("boom")

    monkeypatch.setattr(ckpt_mod, "scan", broken)
    model, opt = _model()
    probe = attached(checkpoint_guard="raise")
    for name in ("a.pt", "b.pt"):
        torch.save(model.state_dict(), tmp_path / name)
        assert (tmp_path / name).exists()
    probe.close()
    run = amprobe.load_run(tmp_path / "run")
    failed = run.events_of("checkpoint_check_failed")
    assert len(failed) == 1 and "boom" in failed[0]["error"]
    _, diagnosis = _n18(run)
    assert "check failed" in {n.id: n.reason for n in diagnosis.not_checked}["AMP-N18"]


def test_the_check_syncs_once_per_device():
    """scan() reads its flags back once per device, whatever the tensor count."""
    state = {f"w{i}": torch.randn(3) for i in range(50)}
    state["w7"][1] = float("nan")
    calls = []
    real = torch.Tensor.tolist

    def counting(self):
        calls.append(self.shape)
        return real(self)

    torch.Tensor.tolist = counting  # type: ignore[method-assign]
    try:
        result = ckpt_mod.scan(state)
    finally:
        torch.Tensor.tolist = real  # type: ignore[method-assign]
    assert len(calls) == 1 and calls[0] == (50,)
    assert result.tensor_count == 50 and [n for n, _ in result.nonfinite] == ["w7"]


class _Observer(nn.Module):
    """A torch.ao MinMaxObserver before calibration: min_val=+inf, max_val=-inf."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Masked(nn.Module):
    """A causal-mask buffer of -inf above the diagonal and an uncalibrated observer: both
    legitimate, neither a parameter nor optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))
        self.obs = _Observer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.obs(self.fc(x).unsqueeze(-1) + self.mask.exp()).sum(-1)


@pytest.mark.parametrize("guard", ["warn", "raise"])
def test_inf_buffers_are_no_poison(tmp_path, attached, guard):
    """±inf buffers (a causal mask, an uncalibrated observer) of a model amprobe knows are
    skipped in its state dict, and a module saved whole is checked by its parameters only;
    a NaN parameter is still found."""
    torch.manual_seed(0)
    model = _Masked()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    probe = attached(checkpoint_guard=guard)
    for _ in range(2):
        model(torch.randn(2, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert any(ref() is model for ref in probe.models), "amprobe knows the model"
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "both.pt")
    torch.save(model, tmp_path / "whole.pt")
    unknown = _Masked()  # never run: not known to amprobe, saved whole
    torch.save(unknown, tmp_path / "unknown.pt")
    for name in ("sd.pt", "both.pt", "whole.pt", "unknown.pt"):
        assert (tmp_path / name).exists()
    with torch.no_grad():
        model.fc.weight[0, 0] = float("nan")
    if guard == "raise":
        with pytest.raises(amprobe.PoisonedCheckpointError) as raised:
            torch.save(model.state_dict(), tmp_path / "bad.pt")
        assert [t["tensor"] for t in raised.value.tensors] == ["fc.weight"]
        assert raised.value.last_good_path == str(tmp_path / "unknown.pt")
    else:
        torch.save(model.state_dict(), tmp_path / "bad.pt")
    probe.close()
    run = amprobe.load_run(tmp_path / "run")
    saved = run.events_of("checkpoint_saved")
    assert [e["tensor_count"] for e in saved] == [2, 2 + 2 * 3, 2, 2]  # parameters; Adam state
    finding, _ = _n18(run)
    assert finding is not None
    ev = finding.evidence
    assert ev["path"] == str(tmp_path / "bad.pt")
    assert [t["tensor"] for t in ev["tensors"]] == ["fc.weight"]
    assert ev["last_good_path"] == str(tmp_path / "unknown.pt")


# -- torch.distributed.checkpoint ------------------------------------------------------------
@pytest.mark.parametrize("function", ["save", "async_save"])
@pytest.mark.parametrize("guard", ["warn", "raise"])
def test_dcp_save_single_process(tmp_path, attached, guard, function):
    import torch.distributed.checkpoint as dcp

    def save(state, checkpoint_id):
        done = getattr(dcp, function)(state, checkpoint_id=checkpoint_id)
        if function == "async_save":
            done.result()

    model, opt = _model()
    probe = attached(checkpoint_guard=guard)
    _train(model, opt)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "good"))  # (plain)
    with torch.no_grad():
        model[0].bias[2] = float("nan")
    target = tmp_path / "bad"
    if guard == "raise":
        with pytest.raises(amprobe.PoisonedCheckpointError):
            save({"model": model.state_dict()}, checkpoint_id=str(target))
        assert not target.exists(), "no directory, no shard file"
    else:
        save({"model": model.state_dict()}, checkpoint_id=str(target))
        assert target.exists()
    probe.close()
    finding, _ = _n18(amprobe.load_run(tmp_path / "run"))
    assert finding is not None
    assert finding.evidence["path"] == str(target)
    assert finding.evidence["function"] == f"torch.distributed.checkpoint.{function}"
    assert [t["tensor"] for t in finding.evidence["tensors"]] == ["model.0.bias"]
    assert finding.evidence["last_good_path"] == str(tmp_path / "good")


def test_dcp_two_ranks_one_poisoned_both_refuse(tmp_path):
    """2 gloo ranks under `amprobe run`; only rank 1's DTensor shard holds a NaN: both ranks
    raise, no file is written on either, both train on and save again."""
    out = tmp_path / "run"
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "amprobe", "run", "--out", str(out)]
    cmd += ["--set", "checkpoint_guard=raise", "--", *torchrun_argv("dcp_gloo.py"), str(ck)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = run_gloo_job(cmd, out, cwd=tmp_path, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [(tmp_path / f"result{r}.txt").read_text().splitlines() for r in (0, 1)]
    assert results == [
        ["refused elsewhere=True", "trained on"],
        ["refused elsewhere=False", "trained on"],
    ]
    assert not (ck / "poisoned").exists()
    assert sorted(p.name for p in ck.iterdir()) == ["after", "good"]
    run = amprobe.load_run(out)
    finding, _ = _n18(run)
    assert finding is not None
    ev = finding.evidence
    assert ev["ranks"] == [1] and ev["refused_ranks"] == [0, 1] and ev["refused"] is True
    assert ev["path"] == str(ck / "poisoned") and ev["step"] == 2
    assert [t["tensor"] for t in ev["tensors"]] == ["sharded"]
    assert ev["tensors"][0]["element_count"] == 16  # rank 1's local shard of the 4x8 DTensor
    assert ev["last_good_path"] == str(ck / "good")
    assert finding.title.endswith("on rank 1")


# -- frameworks ------------------------------------------------------------------------------
def _hf_trainer(tmp_path: Path, poison_at: int):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    try:
        from train_hf import RandomTokens, build_model
    finally:
        sys.path.remove(str(ROOT / "tests" / "scripts"))

    class Poison(TrainerCallback):  # before the Trainer's save of that step
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == poison_at:
                with torch.no_grad():
                    model.lm_head.weight[0, 0] = float("nan")

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=2,
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = build_model("no", None, 1, embd=16)
    return Trainer(model=model, args=args, train_dataset=RandomTokens(4), callbacks=[Poison()])


@pytest.mark.parametrize("guard", ["warn", "raise"])
def test_hf_trainer_save(tmp_path, attached, guard):
    trainer = _hf_trainer(tmp_path, poison_at=2)
    probe = attached(checkpoint_guard=guard)
    if guard == "raise":
        with pytest.raises(amprobe.PoisonedCheckpointError):
            trainer.train()
    else:
        trainer.train()
    probe.close()
    poisoned = tmp_path / "hf" / "checkpoint-2"
    good = tmp_path / "hf" / "checkpoint-1"
    assert (good / "model.safetensors").exists()
    assert poisoned.exists() == (guard == "warn")
    finding, _ = _n18(amprobe.load_run(tmp_path / "run"))
    assert finding is not None
    ev = finding.evidence
    assert ev["path"] == str(poisoned) and ev["function"].endswith("Trainer._save_checkpoint")
    assert [t["tensor"] for t in ev["tensors"]][0] == "model.transformer.wte.weight"  # tied
    assert ev["last_good_path"] == str(good)
    saved = amprobe.load_run(tmp_path / "run").events_of("checkpoint_saved")
    assert len(saved) == 1, "the Trainer's own torch.save calls are not checked twice"


@pytest.mark.parametrize("sharded", [False, True])
def test_hf_save_model_agrees_across_ranks_when_sharded(tmp_path, attached, monkeypatch, sharded):
    """A distributed Trainer with sharded weights (FSDP, DeepSpeed) gathers them in save_model on
    every rank: the ranks all-reduce the flag as for _save_checkpoint, so a rank whose shard
    is clean raises with the one whose shard holds the NaN (no rank left in the gather). On
    DDP (same weights everywhere; save_model may run on rank 0 only) each rank decides alone.
    The world of 2 and the other rank's verdict are simulated."""
    trainer = _hf_trainer(tmp_path, poison_at=-1)
    asked = []

    def other_rank_poisoned(poisoned, group):
        asked.append(group)
        return True

    monkeypatch.setattr(ckpt_mod, "_any_rank", other_rank_poisoned)
    monkeypatch.setattr(ckpt_mod, "_world_size", lambda trainer: 2, raising=False)
    trainer.is_fsdp_enabled = sharded
    probe = attached(checkpoint_guard="raise")
    target = tmp_path / "final"
    if sharded:
        with pytest.raises(amprobe.PoisonedCheckpointError) as raised:
            trainer.save_model(str(target))
        assert raised.value.elsewhere is True and raised.value.tensors == []
        assert not target.exists()
        assert asked == [True], "one all-reduce over the default group"
    else:
        trainer.save_model(str(target))
        assert (target / "model.safetensors").exists()
        assert asked == []
    probe.close()


def test_save_model_collective_decision():
    from types import SimpleNamespace as NS

    def trainer(world, fsdp=False, deepspeed=False):
        return NS(args=NS(world_size=world), is_fsdp_enabled=fsdp, is_deepspeed_enabled=deepspeed)

    decide = ckpt_mod._save_model_collective
    assert decide(trainer(2, fsdp=True)) and decide(trainer(8, deepspeed=True))
    assert not decide(trainer(2)), "DDP: the same weights on every rank, decided alone"
    assert not decide(trainer(1, fsdp=True)), "one process: nothing to agree with"
    assert not decide(NS()), "not a Trainer it can read: alone"


def test_lightning_save_checkpoint(tmp_path, attached):
    try:
        import lightning.pytorch as pl
    except ImportError:
        pytest.skip("lightning is not installed")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 4)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=4
    )
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    module = Module()
    probe = attached(checkpoint_guard="raise")
    trainer.fit(module, data)
    trainer.save_checkpoint(tmp_path / "good.ckpt")
    trainer.optimizers[0].state[module.net.weight]["exp_avg"][0, 0] = float("inf")
    with pytest.raises(amprobe.PoisonedCheckpointError):
        trainer.save_checkpoint(tmp_path / "bad.ckpt")
    assert not (tmp_path / "bad.ckpt").exists()
    trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)  # no optimizer state
    assert (tmp_path / "weights.ckpt").exists()
    probe.close()
    finding, _ = _n18(amprobe.load_run(tmp_path / "run"))
    assert finding is not None
    ev = finding.evidence
    assert ev["path"] == str(tmp_path / "bad.ckpt") and ev["refused"] is True
    assert [t["tensor"] for t in ev["tensors"]] == ["optimizer.0.state.0.exp_avg"]
    assert ev["last_good_path"] == str(tmp_path / "good.ckpt")


# -- the rule on hand-built events -----------------------------------------------------------
def _event(rank, step, t, kind, **detail):
    return {"rank": rank, "step": step, "t": t, "kind": kind, **detail}


def test_rule_merges_ranks_and_skips_saves_poisoned_anywhere():
    """A save clean on rank 0 but poisoned on rank 1 is no good checkpoint; a refused one
    neither; the finding names the first poisoned save and its ranks."""
    t = {"tensor": "w", "inf_count": 0, "nan_count": 2, "numel": 8}

    def poisoned(rank, step):
        return _event(
            rank,
            step,
            step / 10,
            "checkpoint_nonfinite",
            path=f"ck/{step}",
            function="f",
            tensor_count=3,
            nonfinite_tensor_count=1,
            tensors=[t],
            refused=False,
        )

    events = [
        _event(0, 10, 1.0, "checkpoint_saved", path="ck/10", function="f", tensor_count=3),
        _event(1, 10, 1.0, "checkpoint_saved", path="ck/10", function="f", tensor_count=3),
        _event(0, 20, 2.0, "checkpoint_saved", path="ck/20", function="f", tensor_count=3),
        poisoned(1, 20),
        poisoned(0, 30),
        poisoned(1, 30),
    ]
    run = fake_run(events=events, ranks=(0, 1), manifest={"config": {"checkpoint_guard": "warn"}})
    finding, _ = _n18(run)
    assert finding is not None
    ev = finding.evidence
    assert ev["path"] == "ck/20" and ev["step"] == 20 and ev["ranks"] == [1]
    assert ev["last_good_path"] == "ck/10" and ev["last_good_step"] == 10
    assert ev["poisoned_save_count"] == 2 and ev["poisoned_steps"] == [20, 30]
    assert finding.title.endswith("on rank 1")


def test_rule_last_good_checked_a_tensor():
    """A clean save that checked no tensor (RNG state, ZeRO-3 placeholders) on any rank is no
    good checkpoint; one whose tensors lie on one rank only is."""
    t = {"tensor": "w", "inf_count": 1, "nan_count": 0, "numel": 8}

    def saved(rank, step, path, count):
        return _event(
            rank, step, step / 10, "checkpoint_saved", path=path, function="f", tensor_count=count
        )

    events = [
        saved(0, 10, "ck/10", 0),
        saved(1, 10, "ck/10", 3),  # rank 1 holds the tensors: good
        saved(0, 20, "rng/20", 0),
        saved(1, 20, "rng/20", 0),  # checked nothing anywhere
        _event(
            0,
            30,
            3.0,
            "checkpoint_nonfinite",
            path="ck/30",
            function="f",
            tensor_count=3,
            nonfinite_tensor_count=1,
            tensors=[t],
            refused=False,
        ),
    ]
    run = fake_run(events=events, ranks=(0, 1), manifest={"config": {"checkpoint_guard": "warn"}})
    finding, _ = _n18(run)
    assert finding is not None
    assert finding.evidence["last_good_path"] == "ck/10"
    assert finding.evidence["last_good_step"] == 10
    assert "ck/10" in finding.fix and "rng/20" not in finding.fix


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({}, "did not check checkpoint saves"),
        ({"checkpoint_guard": "off"}, 'checkpoint_guard was "off"'),
        ({"checkpoint_guard": "warn"}, "no checkpoint save was seen"),
    ],
)
def test_rule_not_checked_reasons(config, reason):
    run = fake_run(events=[], manifest={"config": config})
    _, diagnosis = _n18(run)
    assert reason in {n.id: n.reason for n in diagnosis.not_checked}["AMP-N18"]
