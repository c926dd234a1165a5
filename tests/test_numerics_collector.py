"""Collector tests for per-layer numerics on tiny models under CPU fp16 autocast."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import amprobe
from amprobe.analysis.compute import latest_capture
from amprobe.rules import diagnose

FP16 = torch.float16


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def _batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 8, generator=g) for _ in range(n)]


def _train(
    tmp_path: Path,
    model: nn.Module,
    batches: list[torch.Tensor],
    use_scaler: bool = True,
    loss_factor: float = 1.0,
    config: dict | None = None,
    probe: bool = True,
) -> amprobe.Run | None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if use_scaler else None
    handle = None
    if probe:
        cfg = {"collectors": ["scaler", "numerics"], **(config or {})}
        handle = amprobe.attach(model, opt, scaler, run_dir=tmp_path / "run", config=cfg)
    try:
        for x in batches:
            with torch.autocast("cpu", dtype=FP16):
                loss = model(x).float().pow(2).mean() * loss_factor
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        if handle is not None:
            handle.close()
    return amprobe.load_run(tmp_path / "run") if probe else None


def _finding(diagnosis, rule_id: str):
    found = [f for f in diagnosis.findings if f.id == rule_id]
    return found[0] if found else None


def test_overflowing_layer_is_first_offender(tmp_path: Path) -> None:
    model = _model()
    with torch.no_grad():
        model[2].weight.fill_(30000.0)  # fp16 output ~ 30000 * sum(h) overflows 65504
    batches = _batches(3)
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        h = model[1](model[0](batches[0].clone()))
        assert torch.isfinite(h).all()
        expected_inf = int(torch.isinf(model[2](h)).sum())
    assert expected_inf > 0
    run = _train(tmp_path, model, batches, config={"numerics_every": 100})
    offenders = run.table("offenders")
    forward = offenders[offenders["kind"] == "forward"].sort_values("step")
    assert forward["module"].iloc[0] == "2" and forward["module_type"].iloc[0] == "Linear"
    diagnosis = diagnose(run)
    n05 = _finding(diagnosis, "AMP-N05")
    assert n05 is not None
    assert n05.evidence["module"] == "2" and n05.evidence["step"] == 0
    assert n05.evidence["inf_count"] == expected_inf and n05.evidence["nan_count"] == 0
    assert n05.evidence["output_dtype"] == "float16"
    assert _finding(diagnosis, "AMP-N04") is None
    # the always-on check saw the skipped step and armed full capture of the next steps
    assert run.steps["numerics_sampled"].tolist() == [True, True, True]
    n03 = diagnose(run, thresholds={"AMP-N03": {"max_consecutive_cuts": 2}})
    n03f = _finding(n03, "AMP-N03")
    assert n03f is not None and n03f.evidence["first_forward_offender"]["module"] == "2"


def test_output_projection_role_is_named(tmp_path: Path) -> None:
    model = _model()
    with torch.no_grad():
        model[4].weight.fill_(3000.0)
        model[2].weight.abs_()
        model[2].bias.fill_(1.0)
    run = _train(tmp_path, model, _batches(1), config={"numerics_every": 1})
    n05 = _finding(diagnose(run), "AMP-N05")
    assert n05 is not None and n05.evidence["module"] == "4"
    assert n05.evidence["role"] == "output projection"
    assert "output projection" in n05.title


def test_nan_batch_is_nonfinite_input_not_overflow(tmp_path: Path) -> None:
    batches = _batches(6)
    batches[2][1, 3] = float("nan")
    batches[2][0, 0] = float("inf")
    run = _train(tmp_path, _model(), batches, config={"numerics_every": 100})
    diagnosis = diagnose(run)
    n04 = _finding(diagnosis, "AMP-N04")
    assert n04 is not None
    assert n04.evidence["nonfinite_steps"] == [2] and n04.evidence["nonfinite_elements"] == [2]
    assert _finding(diagnosis, "AMP-N05") is None
    assert _finding(diagnosis, "AMP-N11") is None  # a data problem is not blamed on fp16
    # step 2 was not sampled; the check armed steps 3..5
    assert run.steps["numerics_sampled"].tolist() == [True, False, False, True, True, True]


def test_nan_batch_on_sampled_step_names_the_input(tmp_path: Path) -> None:
    batches = _batches(2)
    batches[1][0, 0] = float("nan")
    run = _train(tmp_path, _model(), batches, config={"numerics_every": 1})
    n04 = _finding(diagnose(run), "AMP-N04")
    assert n04 is not None and n04.evidence["inputs"] == ["<input 0>[0]"]
    offenders = run.table("offenders")
    assert set(offenders["kind"]) <= {"input", "backward"}


def test_fp16_underflow_without_scaler(tmp_path: Path) -> None:
    model = _model()
    grads: list[torch.Tensor] = []

    def keep(_: nn.Module, __: object, out: torch.Tensor) -> None:
        out.register_hook(lambda g: grads.append(g.detach().clone()))

    handle = model[4].register_forward_hook(keep)
    run = _train(
        tmp_path,
        model,
        _batches(1),
        use_scaler=False,
        loss_factor=1e-3,
        config={"numerics_every": 1},
    )
    handle.remove()
    (g,) = grads
    assert g.dtype == FP16
    a = g.float().abs()
    expected = float(((a > 0) & (a < 2.0**-14)).sum() / (a > 0).sum())
    assert expected > 0.01
    n06 = _finding(diagnose(run), "AMP-N06")
    assert n06 is not None
    layers = {(x["module"], x["kind"]): x for x in n06.evidence["layers"]}
    assert layers[("4", "grad_output")]["share"] == pytest.approx(expected, abs=1e-4)
    assert layers[("4", "grad_output")]["measure"] == "subnormal"
    hint = n06.evidence["scale_hint"]
    assert hint["current_scale"] == 1.0 and hint["hint_scale"] > 1.0
    table = run.table("numerics")
    row = table[(table["module"] == "4") & (table["kind"] == "grad_output")].iloc[0]
    assert row["zeros"] == int((g == 0).sum()) and row["elements"] == g.numel()
    assert row["below_normal"] == int(((a > 0) & (a < 2.0**-14)).sum())
    assert row["amax"] == pytest.approx(float(a.max()))


def test_grad_stats_are_unscaled(tmp_path: Path) -> None:
    model = _model()
    grads: list[torch.Tensor] = []
    for p in (model[4].weight, model[4].bias):
        p.register_post_accumulate_grad_hook(lambda p: grads.append(p.grad.detach().clone()))
    run = _train(tmp_path, model, _batches(1), config={"numerics_every": 1})
    table = run.table("numerics")
    row = table[(table["module"] == "4") & (table["kind"] == "grad_param")].iloc[0]
    amax = max(float(g.abs().max()) for g in grads) / 2.0**10
    assert row["loss_scale"] == 2.0**10
    assert row["amax"] == pytest.approx(amax, rel=1e-6)
    assert row["elements"] == sum(g.numel() for g in grads)
    hist = {int(k): v for k, v in json.loads(row["exp_hist"]).items()}
    assert sum(hist.values()) == row["elements"]


def test_healthy_run_has_no_numerics_findings(tmp_path: Path) -> None:
    run = _train(tmp_path, _model(), _batches(4), config={"numerics_every": 1})
    ids = set(diagnose(run).ids())
    assert not ids & {"AMP-N04", "AMP-N05", "AMP-N06", "AMP-N16"}
    assert len(run.table("numerics")) > 0 and run.table("offenders").empty


def test_layer_selection_and_sampling(tmp_path: Path) -> None:
    run = _train(
        tmp_path, _model(), _batches(5), config={"numerics_every": 2, "numerics_layers": ["4", "0"]}
    )
    table = run.table("numerics")
    assert set(table["module"]) - {"<input 0>[0]"} == {"0", "4"}
    assert sorted(set(table["step"])) == [0, 2, 4]


def test_probe_does_not_change_numerics(tmp_path: Path) -> None:
    plain, probed = _model(), _model()
    _train(tmp_path / "a", plain, _batches(3), probe=False)
    _train(tmp_path / "b", probed, _batches(3), config={"numerics_every": 1})
    for (name, a), (_, b) in zip(plain.named_parameters(), probed.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_hooks_removed_on_close(tmp_path: Path) -> None:
    model = _model()
    _train(tmp_path, model, _batches(1), config={"numerics_every": 1})
    for mod in model.modules():
        assert not mod._forward_hooks and not mod._forward_pre_hooks
    assert not model[0].weight._post_accumulate_grad_hooks
    assert torch.amp.GradScaler.scale.__module__ == "torch.amp.grad_scaler"


class _CountScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten._local_scalar_dense: every tensor-to-host read (a sync on an accelerator)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _scalar_reads(tmp_path: Path, probe: bool) -> int:
    model = _model()
    batches = _batches(4)
    batches[1][0, 0] = float("nan")  # the non-finite check must not read its flag on the hot path
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    handle = None
    if probe:
        handle = amprobe.attach(
            model,
            opt,
            scaler,
            run_dir=tmp_path / "run",
            config={
                "collectors": ["scaler", "numerics"],
                "numerics_every": 1,
                "flush_every": 1000,
                "flush_interval_s": 1e6,
                # the bad step's replay reads values by design (bad steps only; its own tests)
                "replay": "off",
            },
        )
        numerics = next(c for c in handle.collectors if c.name == "numerics")
        numerics._device = torch.device("meta")  # take the accelerator path: arm only at flush
        handle.device = torch.device("meta")  # and the hub's input check: a device count
    counter = _CountScalarReads()
    try:
        with counter:
            for x in batches:
                with torch.autocast("cpu", dtype=FP16):
                    loss = model(x).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
    finally:
        if handle is not None:
            handle.close()
    return counter.count


def test_no_host_reads_on_the_hot_path(tmp_path: Path, monkeypatch) -> None:
    from amprobe.capture import boundary as boundary_mod

    plain = _scalar_reads(tmp_path / "plain", probe=False)
    assert plain == 4  # GradScaler's own found_inf read, once per step
    # a CPU job: the hub reads the step's scalars (loss, scale before and after, growth
    # tracker, found-inf) from host memory at once, 5 a step: item() there is no device sync
    assert _scalar_reads(tmp_path / "cpu", probe=True) == plain + 5 * 4
    # an accelerator job keeps device copies (read back at flush): no read on the hot path
    monkeypatch.setattr(boundary_mod, "_on_host", lambda t: False)
    assert _scalar_reads(tmp_path / "probe", probe=True) == plain


def test_device_variant(tmp_path: Path, device: torch.device) -> None:
    torch.manual_seed(0)
    model = _model().to(device)
    with torch.no_grad():
        model[2].weight.fill_(30000.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    with amprobe.attach(
        model,
        opt,
        scaler,
        run_dir=tmp_path / "run",
        config={"collectors": ["scaler", "numerics"], "numerics_every": 1},
    ):
        for x in _batches(2):
            with torch.autocast(device.type, dtype=FP16):
                loss = model(x.to(device)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    n05 = _finding(diagnose(amprobe.load_run(tmp_path / "run")), "AMP-N05")
    assert n05 is not None and n05.evidence["module"] == "2"


def test_cuda_arming_reads_a_pinned_flag_once_its_event_has_passed(
    tmp_path: Path, monkeypatch
) -> None:
    """On CUDA the non-finite flag travels by a non-blocking copy; arming waits for its event.

    Faked at the narrowest seams: the pinned allocation and ``torch.cuda.Event``.
    """
    from amprobe.capture.collectors import numerics as numerics_mod

    class FakeEvent:
        landed = False

        def record(self) -> None:
            return None

        def query(self) -> bool:
            return FakeEvent.landed

    monkeypatch.setattr(numerics_mod, "_pinned_flag", lambda: torch.zeros((), dtype=torch.bool))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    model = _model()
    probe = amprobe.attach(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        run_dir=tmp_path / "r",
        config={"collectors": ["scaler", "numerics"], "numerics_every": 1000},
    )
    try:
        collector = next(c for c in probe.collectors if c.name == "numerics")
        collector._device = torch.device("cuda")  # pretend the model lives on a GPU
        collector._watch_async(
            7, {"found_inf": torch.tensor(1.0), "input_nonfinite": torch.tensor(0)}
        )
        collector._watch_async(
            8, {"found_inf": torch.tensor(0.0), "loss_nonfinite": torch.tensor(False)}
        )
        collector._poll_in_flight()
        assert collector._armed_until == -1, "nothing is read before the copy has landed"
        FakeEvent.landed = True
        collector._poll_in_flight()
        assert collector._armed_until == 7 + collector.arm_steps
        assert collector._in_flight == []
    finally:
        probe.close()


class _Booster(nn.Module):
    """Multiplies by 1e5 on the steps listed: beyond fp16's range in the next half matmul."""

    def __init__(self, at: set[int]) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 1e5 if self.calls - 1 in self.at else x


@pytest.mark.parametrize("scaled", [False, True], ids=["no-scaler", "scaler"])
def test_update_that_wrote_nan_into_the_weights_is_named_not_the_next_layer(tmp_path, scaled):
    """No GradScaler: the overflow step's NaN update reaches the weights, and the next step's
    first Linear outputs NaN from finite inputs. N05 must say so, not blame that Linear; with a
    scaler the step is skipped and the overflowing module is named as before."""
    torch.manual_seed(0)
    model = nn.Sequential(_Booster({3, 4, 5}), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=scaled)
    with amprobe.attach(
        model, opt, scaler, run_dir=tmp_path / "run", config={"numerics_every": 50}
    ):
        for x in _batches(6):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    run = amprobe.load_run(tmp_path / "run")
    n05 = next(f for f in diagnose(run).findings if f.id == "AMP-N05")
    weights = run.events_of("nonfinite_weights")
    if scaled:
        assert not weights, "the scaler skipped the NaN update: the weights stay finite"
        assert n05.evidence["module"] == "0" and "cause" not in n05.evidence
    else:
        assert [(e["at_step"], e["params"][0]) for e in weights][:1] == [(4, "1.weight")]
        assert n05.evidence["cause"] == "nonfinite_weights"
        assert n05.evidence["applied_update_step"] == 3 and n05.evidence["step"] == 4
        assert "the update of step 3 applied non-finite values" in n05.title
        assert "GradScaler" in n05.fix


class _Checkpointed(nn.Module):
    """A block (Linear, ReLU, LayerNorm) run under activation checkpointing."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.LayerNorm(16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recomputation_is_not_a_second_call(tmp_path: Path, reentrant: bool) -> None:
    """Issue 19 item 5: the recomputed forward of a checkpointed block is counted once, and
    its output gradient is still measured (reentrant checkpointing has no graph in forward)."""
    torch.manual_seed(0)
    model = _Checkpointed(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    config = {"collectors": ("scaler", "numerics", "compute"), "numerics_every": 1}
    with amprobe.attach(model, opt, run_dir=tmp_path / "run", config=config):
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    run = amprobe.load_run(tmp_path / "run")
    rows = run.table("numerics")
    rows = rows[rows["step"] == 1].set_index(["module", "kind"])
    for layer in ("block.0", "block.1", "block.2"):
        assert rows.loc[(layer, "output"), "calls"] == 1, layer
        assert rows.loc[(layer, "output"), "elements"] == 4 * 16, layer
        assert rows.loc[(layer, "grad_output"), "calls"] == 1, layer
    # the compute profile books the recomputed matmul as recompute, to its layer
    ops, _ = latest_capture(run)
    recomputed = ops[ops["phase"] == "recompute"]
    assert list(recomputed["module"]) == ["block.0"] and list(recomputed["op"]) == ["addmm"]
    assert set(ops.loc[ops["phase"] == "backward", "module"]) == {"head", "block.0", "inp"}


def test_a_discovered_model_gets_its_first_per_layer_sample_at_once(tmp_path: Path) -> None:
    """Zero-code attach (no model passed): discovery finds the model at the first step
    boundary, and the first per-layer sample is the next step (before: it was spent at that
    boundary with nothing hooked, its cost taken as the sample's, and a 130-step run had none)."""
    import amprobe.capture.probe

    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = {"collectors": (*amprobe.Config().collectors, "discovery")}
    probe = amprobe.capture.probe.attach(
        run_dir=tmp_path / "run", config=config, adoptable=True, lazy=True
    )
    try:
        for x in _batches(30):
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        probe.close()
    run = amprobe.load_run(tmp_path / "run")
    sampled = run.steps.loc[run.steps["numerics_sampled"].fillna(False).astype(bool), "step"]
    assert sampled.tolist()[:1] == [1]
    numerics = run.table("numerics")
    assert set(numerics.loc[numerics["step"] == 1, "module"]) >= {"0", "2"}


def _run_every_step(tmp_path: Path, script: str) -> tuple[Any, Any]:
    """``script`` as ``train.py`` under ``amprobe run`` with per-layer numerics on every step:
    (the finished process, its loaded run)."""
    from tests.helpers import amprobe_cli

    (tmp_path / "train.py").write_text(script)
    proc = amprobe_cli(
        "run", "--out", "run", "--set", "numerics_every=1", "--", "python", "train.py",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, amprobe.load_run(tmp_path / "run")


_SUBCLASS_SCRIPT = """
import torch
from torch.testing._internal.two_tensor import TwoTensor


class Pair(torch.nn.Module):  # its output is a wrapper subclass: no memory of its own
    def forward(self, x):
        return TwoTensor(x, x * 2)


class Unpair(torch.nn.Module):
    def forward(self, x):
        return x.a + x.b


model = torch.nn.Sequential(
    torch.nn.Linear(4, 4), Pair(), torch.nn.Linear(4, 4), Unpair(), torch.nn.Linear(4, 1)
)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(0)
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
print("trained")
"""


def test_wrapper_subclass_tensors_are_skipped_not_read_as_memory(tmp_path):
    """A layer whose output is a wrapper tensor subclass (float8/NF4 training tensors; torch's
    ``TwoTensor`` here) has a null data pointer: the compiled kernel read it and the training
    process died of a segmentation fault. Such tensors are now skipped with one event, and the
    other layers are measured."""
    proc, run = _run_every_step(tmp_path, _SUBCLASS_SCRIPT)
    assert "trained" in proc.stdout
    assert len(run.steps) == 3
    skipped = [e for e in run.events_of("numerics_not_checked") if e["what"] == "subclass_tensors"]
    assert [e["tensor_type"] for e in skipped] == ["torch.testing._internal.two_tensor.TwoTensor"]
    assert skipped[0]["first_at"] == "1"
    assert not run.events_of("collector_error")
    outputs = run.table("numerics").query("kind == 'output'")
    # the plain layers are measured every step; the pair's output, and the Linear's that takes
    # it (a TwoTensor too), are not
    assert set(outputs["module"]) == {"0", "3", "4"}
    assert (outputs.groupby("module")["step"].nunique() == 3).all()


_SPARSE_SCRIPT = """
import torch

model = torch.nn.Sequential(
    torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(0)
for _ in range(3):
    model(torch.randint(0, 50, (4, 3))).sum().backward()
    opt.step()
    opt.zero_grad()
print("trained")
"""


def test_a_sparse_gradient_is_skipped_and_the_other_layers_measured(tmp_path):
    """``Embedding(sparse=True)`` gives its weight a sparse COO gradient; measuring it raised
    (``is_contiguous`` of a sparse tensor) and switched the numerics collector off at step 0:
    no per-layer row at all for the whole job. It is now skipped with one event."""
    _, run = _run_every_step(tmp_path, _SPARSE_SCRIPT)
    assert not run.events_of("collector_error")
    skipped = [e for e in run.events_of("numerics_not_checked") if e["what"] == "sparse_tensors"]
    assert [(e["tensor_type"], e["first_at"]) for e in skipped] == [("torch.sparse_coo", "0")]
    rows = run.table("numerics")
    params = rows.query("kind == 'grad_param'")
    assert set(params["module"]) == {"1", "2"}  # the embedding's sparse gradient is not
    assert (params.groupby("module")["step"].nunique() == 3).all()
    assert {"0", "1", "2"} <= set(rows.query("kind == 'output'")["module"])


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_count_nonfinite_of_a_sparse_tensor_counts_its_stored_entries():
    from amprobe.capture.collectors.numstats import count_nonfinite

    dense = torch.zeros(6, 4)
    dense[1, 2], dense[4, 0], dense[4, 3] = float("inf"), float("nan"), 1.0
    for x in (dense.to_sparse(), dense.to_sparse_csr()):
        assert int(count_nonfinite(x, sync_free=False)) == 2
        assert int(count_nonfinite(x, sync_free=True)) == 2


_KINDS_SCRIPT = """import warnings
import torch
warnings.simplefilter("ignore")

class Kind(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
    def forward(self, x):
        return self.fn(x)

KINDS = {
    "expanded": lambda x: x[:, :1].expand(-1, 8),
    "fp64": lambda x: x.double(),
    "fp8": lambda x: x.detach().to(torch.float8_e4m3fn),
    "channels_last": lambda x: x.reshape(2, 2, 2, 4).contiguous(memory_format=torch.channels_last),
    "empty": lambda x: x[:0],
    "complex": lambda x: torch.complex(x.float(), x.float()),
    "nested": lambda x: torch.nested.nested_tensor([x.detach()[:1], x.detach()[1:3]]),
    "jagged": lambda x: torch.nested.nested_tensor([x.detach()[:1], x.detach()[1:3]], layout=torch.jagged),
    "sparse": lambda x: x.detach().to_sparse(),
    "integer": lambda x: x.long(),
    "tuple": lambda x: (x * 2, x),
    "dict": lambda x: {"a": x * 3},
    "offset_view": lambda x: x[1:],
    "transposed": lambda x: x.t(),
    "nan": lambda x: x * float("nan"),
}

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.kinds = torch.nn.ModuleDict({k: Kind(f) for k, f in KINDS.items()})
        self.out = torch.nn.Linear(8, 1)
    def forward(self, x):
        h = self.inp(x)
        total = 0.0
        for name, mod in self.kinds.items():
            y = mod(h)
            if name in ("expanded", "offset_view", "tuple", "dict", "fp64", "channels_last"):
                t = y[0] if isinstance(y, tuple) else y["a"] if isinstance(y, dict) else y
                total = total + t.float().sum() * 1e-3
        return self.out(h).sum() + total

model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
for _ in range(4):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 8))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
print("trained")
"""


@pytest.mark.parametrize("reduction", ["kernel", "eager"])
def test_every_kind_of_module_output_is_measured_or_skipped_under_amprobe_run(
    tmp_path, monkeypatch, reduction
):
    """Module outputs of every layout and dtype torch makes (expanded, offset and transposed
    views, channels_last, empty, fp64, fp8, complex, integer, NaN, nested strided and jagged,
    sparse, in a tuple or a dict: a Hugging Face ``ModelOutput`` is one) through a bf16 GradScaler job with numerics on every step:
    the job ends as it does alone, no collector error, the strided floating ones measured;
    with the compiled counting kernel and with the eager reduction (a GPU's, or no compiler)."""
    if reduction == "eager":
        monkeypatch.setenv("AMPROBE_NO_KERNEL", "1")
    proc, run = _run_every_step(tmp_path, _KINDS_SCRIPT)
    assert "trained" in proc.stdout
    assert len(run.steps) == 4
    assert not run.events_of("collector_error") and not run.events_of("hub_error")
    skipped = {e["tensor_type"]: e["what"] for e in run.events_of("numerics_not_checked")}
    assert skipped == {
        "nested torch.strided": "nested_tensors",
        "nested torch.jagged": "nested_tensors",
        "torch.sparse_coo": "sparse_tensors",
    }
    measured = set(run.table("numerics").query("kind == 'output'")["module"])
    kinds = {"expanded", "fp64", "fp8", "channels_last", "tuple", "dict", "offset_view"}
    assert {f"kinds.{k}" for k in (*kinds, "transposed", "nan")} <= measured
    # nothing floating to measure (complex, integer), nothing at all (empty), not taken
    # (nested and sparse: the events above)
    unmeasured = ("complex", "integer", "empty", "nested", "jagged", "sparse")
    assert not {f"kinds.{k}" for k in unmeasured} & measured


_OWN_CODE_SCRIPT = """import torch
from torch import nn

class Attn(nn.Module):  # no parameters of its own: a container
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, x, gain=1.0):
        q = self.q(x)
        scores = (q @ q.transpose(-1, -2)) * gain  # its own code: overflows fp16 when gained
        return self.proj(torch.softmax(scores, -1) @ x)

class Boost(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = 1.0

    def forward(self, x):
        return x * self.gain

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 16)
        self.boost = Boost()
        self.after = nn.Linear(16, 16)

    def forward(self, x):
        return self.after(self.boost(self.inner(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.attn = Attn()
        self.block = Block()
        self.head = nn.Linear(16, 4)
        self.step = 0

    def forward(self, x):
        h = self.inp(x)
        if self.step == 3:
            h = h * 1e6  # the root's own code; the next module gets it as a keyword
        h = self.attn(x=h, gain=1e6 if self.step == 1 else 1.0)
        self.block.boost.gain = 1e6 if self.step == 2 else 1.0
        return self.head(self.block(h))

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(4):
    model.step = step
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(2, 8, 16)).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
print("trained")
"""


def test_the_first_nonfinite_output_made_by_a_modules_own_code_is_named(tmp_path):
    """A module with children and no parameters of its own (attention written as tensor ops,
    a block, the root) is checked too: when its own code between its children makes the first
    inf/NaN, it is the offender (AMP-N05 named nothing before: every later layer's input was
    already non-finite). A child that overflows itself is still named before its container,
    and a container whose keyword input was already non-finite is not named."""
    proc, run = _run_every_step(tmp_path, _OWN_CODE_SCRIPT)
    assert "trained" in proc.stdout
    assert not run.events_of("collector_error")
    offenders = run.table("offenders")
    forward = offenders[offenders["kind"] == "forward"].set_index("step")
    assert 0 not in forward.index
    assert forward.loc[1, "module"] == "attn" and forward.loc[1, "module_type"] == "Attn"
    assert json.loads(forward.loc[1, "detail"])["own_code"] is True
    assert forward.loc[2, "module"] == "block.boost"
    assert "own_code" not in json.loads(forward.loc[2, "detail"])
    assert forward.loc[3, "module"] == "<root>"
    # containers are checked, not tabled: the numerics table keeps one row per layer
    layers = set(run.table("numerics").query("kind == 'output'")["module"])
    assert not {"attn", "block", "<root>"} & layers
    assert {"attn.q", "attn.proj", "block.boost", "head"} <= layers
    n05 = next(f for f in amprobe.diagnose(run).findings if f.id == "AMP-N05")
    assert n05.title.startswith("attn (Attn) is the first module whose output is non-finite")
    assert "its own code" in n05.title and n05.evidence["own_code"] is True
    assert "scaled_dot_product_attention" in n05.fix
