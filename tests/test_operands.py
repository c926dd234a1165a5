"""The GEMM operands of matmul layers (X, W, dY) and their block statistics (issue 36)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import amprobe
from amprobe.capture.collectors.blockstats import canonical, measure
from amprobe.config import ConfigError
from amprobe.store.blockformats import DEFAULT_FORMATS, STAT_FIELDS, rows_for

FP16 = torch.float16


class _Net(nn.Module):
    """Two Linear layers and a Conv2d: X [6, 2, 4, 4] -> conv -> flatten -> 2 Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc1 = nn.Linear(48, 40)
        self.fc2 = nn.Linear(40, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.relu(self.fc1(h)))


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(6, 2, 4, 4, generator=g) for _ in range(n)]


def _loop(
    model: nn.Module,
    batches: Any,
    run_dir: Path | None,
    config: dict[str, Any] | None = None,
    lr: float = 0.05,
    before_step: Any = None,
) -> list[float]:
    """fp16-autocast steps of ``model`` with a GradScaler, under a probe (numerics every 2
    steps) unless ``run_dir`` is None; ``before_step(i, x)`` may change the batch. The losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    handle = None
    if run_dir is not None:
        cfg = {"collectors": ["scaler", "numerics"], "numerics_every": 2, **(config or {})}
        handle = amprobe.attach(model, opt, scaler, run_dir=run_dir, config=cfg)
    losses = []
    try:
        for i, x in enumerate(batches):
            if before_step is not None:
                x = before_step(i, x)
            with torch.autocast("cpu", dtype=FP16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    finally:
        if handle is not None:
            handle.close()
    return losses


def _train(
    run_dir: Path | None,
    steps: int = 4,
    config: dict[str, Any] | None = None,
    grads: Any = None,
    nan_at: int = -1,
    big_at: int = -1,
) -> tuple[list[float], Any]:
    model = _Net()
    if grads is not None:  # the scaled output gradient of fc1 at every step

        def keep(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            out.register_hook(lambda g: grads.append(g.detach().clone()))

        model.fc1.register_forward_hook(keep)

    def plant(i: int, x: torch.Tensor) -> torch.Tensor:
        if i == nan_at:
            x[0, 0, 0, 0] = float("nan")  # arms the next steps' full capture
        if i == big_at:
            x = x * 3e4  # the conv's fp16 output overflows
        return x

    return _loop(model, _batches(steps), run_dir, config, before_step=plant), model


def test_operands_rows_on_sampled_steps(tmp_path: Path) -> None:
    grads: list[torch.Tensor] = []
    losses, _ = _train(tmp_path / "run", grads=grads)
    plain, _ = _train(None)
    assert losses == plain  # bit-identical with and without amprobe
    run = amprobe.load_run(tmp_path / "run")
    blocks = run.table("blockstats")
    assert sorted(blocks["step"].unique()) == [0, 2]  # sampled steps only
    expected = {(op, o, f) for op in ("x", "w", "dy") for o, f in rows_for(op, DEFAULT_FORMATS)}
    for layer in ("conv", "fc1", "fc2"):
        for step in (0, 2):
            part = blocks[(blocks["layer"] == layer) & (blocks["step"] == step)]
            got = set(zip(part["operand"], part["orientation"], part["format"], strict=True))
            assert got == expected, layer
            assert (part["calls"] == 1).all()
    # canonical shapes: X [T, K], W [N, K], dY [T, N]
    shapes = {
        (r.layer, r.operand): (r.rows, r.cols, r.approx)
        for r in blocks[blocks["step"] == 0].itertuples()
    }
    conv_approx = shapes[("conv", "x")][2]
    assert conv_approx.startswith("conv")  # blocks along channels, not the im2col patch
    assert shapes[("fc1", "x")] == (6, 48, "")
    assert shapes[("fc1", "w")] == (40, 48, "")
    assert shapes[("fc1", "dy")] == (6, 40, "")
    assert shapes[("conv", "x")] == (6 * 16, 2, conv_approx)
    assert shapes[("conv", "w")] == (3, 2 * 9, "")
    assert shapes[("conv", "dy")] == (6 * 16, 3, "")
    # dY is the output gradient divided by the loss scale, as numerics' grad_output
    numerics = run.table("numerics")
    scale = float(
        numerics[(numerics["kind"] == "grad_output") & (numerics["step"] == 2)]["loss_scale"].iloc[
            0
        ]
    )
    dy, _ = canonical("dy", grads[2], "Linear")
    want = measure(dy, "dy", DEFAULT_FORMATS, scale).tolist()
    part = blocks[(blocks["layer"] == "fc1") & (blocks["operand"] == "dy") & (blocks["step"] == 2)]
    order = {(o, f): i for i, (o, f) in enumerate(rows_for("dy", DEFAULT_FORMATS))}
    for r in part.itertuples():
        row = want[order[(r.orientation, r.format)]]
        for field, value in zip(STAT_FIELDS, row, strict=True):
            assert getattr(r, field) == pytest.approx(value, rel=1e-12), field
    # the forward operands are numerics rows of their own, on the same steps
    gemm = numerics[numerics["kind"].isin(["gemm_input", "gemm_weight"])]
    assert set(zip(gemm["module"], gemm["kind"], gemm["step"], strict=True)) == {
        (m, k, s)
        for m in ("conv", "fc1", "fc2")
        for k in ("gemm_input", "gemm_weight")
        for s in (0, 2)
    }
    w = gemm[(gemm["module"] == "fc1") & (gemm["kind"] == "gemm_weight")]
    assert (w["elements"] == 40 * 48).all() and (w["dtype"] == "float32").all()


def test_block_formats_off_and_bad_name(tmp_path: Path) -> None:
    _train(tmp_path / "run", steps=1, config={"block_formats": []})
    run = amprobe.load_run(tmp_path / "run")
    assert run.table("blockstats").empty
    numerics = run.table("numerics")
    assert not numerics["kind"].isin(["gemm_input", "gemm_weight"]).any()
    with pytest.raises(ConfigError, match="mxfp4") as err:
        amprobe.Config(block_formats=["mxfp5"])
    assert "\n" not in str(err.value)


def test_not_on_armed_steps(tmp_path: Path) -> None:
    _train(tmp_path / "run", steps=4, config={"numerics_every": 100}, nan_at=1)
    run = amprobe.load_run(tmp_path / "run")
    numerics = run.table("numerics")
    assert {2, 3} <= set(numerics["step"])  # armed samples after the NaN input
    assert sorted(run.table("blockstats")["step"].unique()) == [0]
    gemm = numerics[numerics["kind"].isin(["gemm_input", "gemm_weight"])]
    assert sorted(gemm["step"].unique()) == [0]


def test_schema_declares_stat_fields() -> None:
    from amprobe.store.schema import TABLES

    assert tuple(TABLES["blockstats"])[-len(STAT_FIELDS) :] == STAT_FIELDS


def test_operand_rows_change_no_diagnosis(tmp_path: Path) -> None:
    """The readers of layers' own numerics leave the operand kinds out: with an fp16
    overflow, the diagnosis (AMP-N11's overflow evidence included) is the same on and off."""
    from amprobe.analysis.numerics import layer_overflow_evidence

    found = {}
    for formats in ("on", "off"):
        config = {} if formats == "on" else {"block_formats": []}
        _train(tmp_path / formats, steps=4, config=config, big_at=2)
        run = amprobe.load_run(tmp_path / formats)
        evidence = layer_overflow_evidence(run, 0)
        assert evidence["overflowing_layers"][0]["module"] == "conv"
        findings = {f.id: f.evidence for f in amprobe.diagnose(run).findings}
        # the block-format rules read the block statistics: on with them only
        assert ("AMP-P04" in findings) == (formats == "on")
        skip = {"AMP-N17", "AMP-P04", "AMP-P05"}
        found[formats] = (evidence, {k: v for k, v in findings.items() if k not in skip})
    assert found["on"] == found["off"]


def test_transposed_and_grouped_convs_are_labelled_approximate() -> None:
    from amprobe.capture.collectors.operands import GROUPED_CONV, TRANSPOSED_CONV, _Layer

    transposed = nn.ConvTranspose2d(4, 6, 3)
    assert _Layer(transposed, "up", "ConvTranspose2d", 0, 1).note == dict.fromkeys(
        ("x", "w", "dy"), TRANSPOSED_CONV
    )
    grouped = _Layer(nn.Conv2d(4, 8, 3, groups=2), "g", "Conv2d", 0, 1).note
    assert grouped == {"x": GROUPED_CONV.format(groups=2), "dy": GROUPED_CONV.format(groups=2)}
    assert _Layer(nn.Conv2d(4, 8, 3), "c", "Conv2d", 0, 1).note == {}
    assert _Layer(nn.Linear(4, 8), "l", "Linear", 0, 1).note == {}


# -- review fixes: no CPU kernel, attention, unbatched convolutions, keyword inputs -------------
def _fit(
    model: nn.Module,
    batches: list[torch.Tensor],
    run_dir: Path,
    config: dict[str, Any] | None = None,
    before_step: Any = None,
) -> amprobe.Run:
    """A few fp16-autocast steps of ``model`` under a probe (numerics every 2 steps)."""

    def call(i: int, x: torch.Tensor) -> torch.Tensor:
        if before_step is not None:
            before_step(i)
        return x

    _loop(model, batches, run_dir, config, lr=0.01, before_step=call)
    return amprobe.load_run(run_dir)


def _gemm_steps(run: amprobe.Run) -> list[int]:
    numerics = run.table("numerics")
    gemm = numerics[numerics["kind"].isin(["gemm_input", "gemm_weight"])]
    return sorted(gemm["step"].unique())


def test_cpu_without_the_block_kernel_skips_the_block_statistics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU the eager reduction would make a sampled step ~18x slower: without the compiled
    kernel (building, or unavailable) a sampled step's block statistics are skipped whole, one
    event per reason; the operands' numerics rows stay; once built, the next sample has them."""
    from amprobe.capture.collectors import numkernel

    built = numkernel.wait()
    if built is None or not built.has_blocks:
        pytest.skip(f"no compiled block kernel: {numkernel.status()}")
    state = {"ready": False, "why": "building"}
    monkeypatch.setattr(numkernel, "kernel", lambda: built if state["ready"] else None)
    monkeypatch.setattr(numkernel, "status", lambda: "ready" if state["ready"] else state["why"])

    def build_done_at_2(i: int) -> None:
        state["ready"] = i >= 2

    run = _fit(_Net(), _batches(4), tmp_path / "building", before_step=build_done_at_2)
    assert sorted(run.table("blockstats")["step"].unique()) == [2]
    assert _gemm_steps(run) == [0, 2]
    events = [(e["reason"], e["step"]) for e in run.events_of("blockstats_not_measured")]
    assert events == [("the CPU block kernel is not built yet (building)", 0)]

    state.update(ready=False, why="unavailable: no C compiler (cc, gcc, clang) on PATH")
    run = _fit(_Net(), _batches(6), tmp_path / "none")  # samples 0, 2, 4: all skipped
    assert run.table("blockstats").empty
    assert _gemm_steps(run) == [0, 2, 4]
    events = [(e["reason"], e["step"]) for e in run.events_of("blockstats_not_measured")]
    reason = "the CPU block kernel is unavailable: no C compiler (cc, gcc, clang) on PATH"
    assert events == [(reason, 0)]


class _Attention(nn.Module):
    """A Linear, then nn.TransformerEncoderLayer (its self_attn an nn.MultiheadAttention)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(self.fc(x))


def test_multihead_attention_is_said_to_be_not_measured(tmp_path: Path) -> None:
    """nn.MultiheadAttention's projections run inside F.multi_head_attention_forward with
    its raw weights: one event names it (selected directly or through its out_proj), and its
    out_proj, whose forward never runs, gets no rows."""
    mha = (
        "nn.MultiheadAttention runs its projections inside F.multi_head_attention_forward "
        "(no module call to hook): not measured"
    )
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(2, 5, 8, generator=g) for _ in range(2)]
    for name, config in (("all", {}), ("proj", {"numerics_layers": ["*.out_proj", "fc"]})):
        run = _fit(_Attention(), batches, tmp_path / name, config=config)
        events = run.events_of("blockstats_not_measured")
        assert [(e["reason"], e["modules"]) for e in events] == [(mha, ["enc.self_attn"])]
        layers = set(run.table("blockstats")["layer"])
        numerics = run.table("numerics")
        gemm = set(numerics[numerics["kind"].isin(["gemm_input", "gemm_weight"])]["module"])
        assert "enc.self_attn.out_proj" not in layers | gemm
        want = {"fc", "enc.linear1", "enc.linear2"} if name == "all" else {"fc"}
        assert layers == gemm == want


class _Unbatched(nn.Module):
    """Convolutions called on unbatched inputs: Conv1d on [C, L], Conv2d on [C, H, W]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv1d(2, 3, 3)
        self.c2 = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c1(x[:, :8]).sum() + self.c2(x.reshape(2, 4, 4)).sum()


def test_unbatched_convolution_operands_are_laid_out_as_a_batch_of_one(tmp_path: Path) -> None:
    from amprobe.capture.collectors.blockstats import CONV_APPROX

    g = torch.Generator().manual_seed(3)
    run = _fit(_Unbatched(), [torch.randn(2, 16, generator=g)], tmp_path / "run")
    blocks = run.table("blockstats")
    shapes = {(r.layer, r.operand): (r.rows, r.cols, r.approx) for r in blocks.itertuples()}
    assert shapes[("c1", "x")] == (8, 2, CONV_APPROX)  # [C, L] -> [L, C]: channels reduced
    assert shapes[("c1", "dy")] == (6, 3, "")
    assert shapes[("c2", "x")] == (16, 2, CONV_APPROX)  # [C, H, W] -> [H*W, C]
    assert shapes[("c2", "dy")] == (16, 4, "")


class _Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(input=x)))


def test_an_input_passed_by_keyword_is_measured(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 8, generator=g)
    run = _fit(_Keywords(), [x], tmp_path / "run")
    blocks = run.table("blockstats")
    fc1 = blocks[(blocks["layer"] == "fc1") & (blocks["operand"] == "x")]
    assert len(fc1) == len(rows_for("x", DEFAULT_FORMATS)) and (fc1["rows"] == 6).all()
    want, _ = canonical("x", x, "Linear")
    table = measure(want, "x", DEFAULT_FORMATS)  # X as the layer got it (before autocast)
    assert fc1["nonzero"].tolist() == table[:, STAT_FIELDS.index("nonzero")].tolist()
    numerics = run.table("numerics")
    assert ((numerics["module"] == "fc1") & (numerics["kind"] == "gemm_input")).any()
    assert not run.events_of("blockstats_not_measured")


def test_a_compiled_layer_called_with_x_by_keyword_is_named(tmp_path: Path) -> None:
    """In a compiled region the in-graph hook receives positional inputs only: a layer that
    took X by keyword has no X rows, and one event names it (W and dY are measured)."""
    # as in a fresh process: amprobe takes any frame dynamo compiled before attach (its
    # process-wide counter) as "compiled before attach" and then reads no layer in the graph,
    # so under the full suite (earlier tests compiled models) this job measured nothing
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _Keywords()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    cfg = {"collectors": ["scaler", "numerics"], "numerics_every": 2}
    handle = amprobe.attach(model, opt, scaler, run_dir=tmp_path / "run", config=cfg)
    compiled = torch.compile(model, backend="eager")
    g = torch.Generator().manual_seed(4)
    try:
        for _ in range(3):
            with torch.autocast("cpu", dtype=FP16):
                loss = compiled(torch.randn(6, 8, generator=g)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    finally:
        handle.close()
    run = amprobe.load_run(tmp_path / "run")
    blocks = run.table("blockstats")
    got = set(zip(blocks["step"], blocks["layer"], blocks["operand"], strict=True))
    measured = {("fc1", "w"), ("fc1", "dy"), ("fc2", "x"), ("fc2", "w"), ("fc2", "dy")}
    assert got == {(s, *lo) for s in (0, 2) for lo in measured}
    events = [(e["modules"], e["step"]) for e in run.events_of("blockstats_not_measured")]
    assert events == [(["fc1"], 0)]
    assert "by keyword" in run.events_of("blockstats_not_measured")[0]["reason"]
