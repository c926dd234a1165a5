"""Compute collector on tiny CPU models: captured ops, FLOPs, module names, and the S-rules end to end."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import amprobe
from amprobe.analysis.compute import fp32_modules, latest_capture

COLLECTORS = ("scaler", "compute")


class Misaligned(nn.Module):
    """Hidden sizes 100 and 250, vocabulary 1003: none is a multiple of 8."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1003, 64)
        self.fc1 = nn.Linear(64, 100)
        self.fc2 = nn.Linear(100, 250)
        self.head = nn.Linear(250, 1003)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(self.embed(idx)))
        return self.head(torch.relu(self.fc2(x)))


class WellFormedGPT(nn.Module):
    """A small but sensibly sized transformer: every dimension a multiple of 64."""

    def __init__(self, vocab: int = 1024, d: int = 256, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(
            d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(
            self.blocks(
                self.embed(idx),
                is_causal=True,
                mask=nn.Transformer.generate_square_subsequent_mask(idx.shape[1]),
            )
        )


class Elementwise(nn.Module):
    """One small matmul followed by many elementwise ops on the activations."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        for _ in range(40):
            y = torch.tanh(y) * 0.9 + 0.1
        return y


def _tokens(
    vocab: int, batch: int = 4, seq: int = 16
) -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def make(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return idx[:, :-1], idx[:, 1:]

    return make


def _run(
    tmp_path,
    model: nn.Module,
    make_batch,
    dtype: torch.dtype | None,
    scaler: bool = False,
    steps: int = 3,
    lm: bool = True,
    config: dict | None = None,
):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    grad_scaler = torch.amp.GradScaler("cpu") if scaler else None
    cfg = {"collectors": COLLECTORS, **(config or {})}
    g = torch.Generator().manual_seed(0)
    with amprobe.attach(model, opt, grad_scaler, run_dir=tmp_path / "run", config=cfg):
        for _ in range(steps):
            x, y = make_batch(g)
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                out = model(x)
                if lm:
                    loss = nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten())
                else:
                    loss = nn.functional.mse_loss(out.float(), y)
            if grad_scaler is not None:
                grad_scaler.scale(loss).backward()
                grad_scaler.step(opt)
                grad_scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
    run = amprobe.load_run(tmp_path / "run")
    assert not run.events_of("collector_error"), run.events_of("collector_error")
    return run


def _ids(run) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in amprobe.diagnose(run).findings:
        out.setdefault(f.id, []).append(f)
    return out


def test_misaligned_layers_get_s04_with_padded_sizes(tmp_path):
    run = _run(tmp_path, Misaligned(), _tokens(1003), torch.bfloat16, steps=2)
    findings = _ids(run)
    s04 = [f for f in findings["AMP-S04"] if f.severity == "warning"]
    assert len(s04) == 1
    layers = {d["module"]: d["dims"] for d in s04[0].evidence["layers"]}
    assert layers["fc1"] == {"100": 104}
    assert layers["fc2"] == {"100": 104, "250": 256}
    assert layers["head"] == {"250": 256, "1003": 1008}
    assert "head (250 -> 256, 1003 -> 1008)" in s04[0].title
    assert any("Matrix Multiplication Background" in r for r in s04[0].refs)
    assert "AMP-S05" not in findings


def test_scaler_without_autocast_gets_s05(tmp_path):
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))

    def batch(g):
        return torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)

    run = _run(tmp_path, model, batch, dtype=None, scaler=True, lm=False)
    findings = _ids(run)
    assert len(findings["AMP-S05"]) == 1
    ev = findings["AMP-S05"][0].evidence
    assert ev["half_flop_share"] == 0.0
    # the loop runs its forward inside torch.autocast(..., enabled=False): said as it is
    assert {m["reason"] for m in ev["fp32_modules"]} == {
        "autocast disabled (inside autocast(enabled=False))"
    }
    assert {m["module"] for m in ev["fp32_modules"]} == {"0", "2"}
    assert "AMP-S04" not in findings  # fp32 on CPU: no Tensor Core alignment to check


def test_disabled_autocast_region_is_named_as_reason(tmp_path):
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)

        def forward(self, x):
            x = self.a(x)
            with torch.autocast("cpu", enabled=False):
                return self.b(x.float())

    def batch(g):
        return torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)

    run = _run(tmp_path, Mixed(), batch, torch.bfloat16, lm=False)
    ops, _ = latest_capture(run)
    fwd = ops[ops["phase"] == "forward"].set_index("module")
    assert fwd.loc["a", "in_dtype"] == "bfloat16" and fwd.loc["a", "autocast"] == "enabled"
    assert fwd.loc["b", "in_dtype"] == "float32" and fwd.loc["b", "autocast"] == "disabled"
    mods = fp32_modules(ops)
    assert list(mods["module"]) == ["b"]
    assert mods["reason"].iloc[0].startswith("autocast disabled")


def test_elementwise_model_gets_s02(tmp_path):
    def batch(g):
        return torch.randn(256, 64, generator=g), torch.randn(256, 64, generator=g)

    run = _run(tmp_path, Elementwise(), batch, torch.bfloat16, lm=False)
    findings = _ids(run)
    assert len(findings["AMP-S02"]) == 1
    assert findings["AMP-S02"][0].evidence["flops_per_byte"] < 8


@pytest.mark.slow
def test_well_formed_transformer_gets_no_compute_findings(tmp_path):
    run = _run(tmp_path, WellFormedGPT(), _tokens(1024, batch=4, seq=32), torch.bfloat16, steps=2)
    diagnosis = amprobe.diagnose(run)
    assert not {"AMP-S02", "AMP-S04", "AMP-S05"} & set(diagnosis.ids())
    checked = {n.id for n in diagnosis.not_checked}
    assert not {"AMP-S02", "AMP-S04", "AMP-S05"} & checked
    ops, _ = latest_capture(run)
    assert any(op.startswith("_scaled_dot_product") for op in ops["op"])  # attention is captured
    assert diagnosis.health["mfu"]["value"] is None
    assert diagnosis.health["mfu"]["achieved_flops_per_s"] > 0
    assert "MFU not available" in diagnosis.health["mfu"]["note"]


def test_linear_flops_match_hand_count(tmp_path):
    model = nn.Linear(32, 48)

    def batch(g):
        return torch.randn(16, 32, generator=g), torch.randn(16, 48, generator=g)

    run = _run(tmp_path, model, batch, torch.bfloat16, lm=False)
    ops, steps = latest_capture(run)
    per_gemm = 2 * 16 * 32 * 48
    fwd = ops[ops["phase"] == "forward"]
    assert list(fwd["op"]) == ["addmm"]
    assert (fwd["m"].iloc[0], fwd["n"].iloc[0], fwd["k"].iloc[0]) == (16, 48, 32)
    assert fwd["flops"].iloc[0] == per_gemm
    assert fwd["in_dtype"].iloc[0] == "bfloat16"
    bwd = ops[ops["phase"] == "backward"]
    assert bwd["flops"].sum() == per_gemm  # input needs no grad: only the weight-gradient GEMM
    assert steps["matmul_flops"].iloc[0] == 2 * per_gemm


def test_conv_flops_match_hand_count(tmp_path):
    model = nn.Conv2d(3, 8, 3, padding=1)

    def batch(g):
        return torch.randn(2, 3, 16, 16, generator=g), torch.randn(2, 8, 16, 16, generator=g)

    run = _run(tmp_path, model, batch, torch.bfloat16, lm=False)
    ops, _ = latest_capture(run)
    fwd = ops[ops["phase"] == "forward"].iloc[0]
    assert fwd["op"] == "convolution"
    assert (fwd["cin"], fwd["cout"], fwd["kernel"]) == (3, 8, "3x3")
    hand = 2 * (2 * 8 * 16 * 16) * (3 * 3 * 3)  # 2 x output elements x (Cin x kh x kw)
    assert fwd["flops"] == hand
    bwd = ops[ops["phase"] == "backward"]
    assert list(bwd["op"]) == ["convolution_backward"]
    assert bwd["flops"].iloc[0] == hand  # weight gradient only


def test_capture_schedule_and_limit(tmp_path):
    model = nn.Linear(16, 16)

    def batch(g):
        return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)

    run = _run(
        tmp_path,
        model,
        batch,
        torch.bfloat16,
        lm=False,
        steps=8,
        config={"shapes_every": 3, "shapes_captures": 2},
    )
    assert sorted(run.table("compute_steps")["step"]) == [1, 4]
    assert sorted(run.table("compute_ops")["step"].unique()) == [1, 4]
    params = run.events_of("model_params")
    assert params[0]["params"] == 16 * 16 + 16
    assert torch.amp.autocast_mode.autocast.__enter__.__name__ == "__enter__"


def test_no_capture_without_root_model_still_records(tmp_path):
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with amprobe.attach(optimizer=opt, run_dir=tmp_path / "run", config={"collectors": COLLECTORS}):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(8, 16)).float().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    run = amprobe.load_run(tmp_path / "run")
    ops = run.table("compute_ops")
    assert list(run.table("compute_steps")["step"]) == [1]
    assert set(ops["op"]) == {"addmm", "mm"}


def test_config_validation():
    with pytest.raises(amprobe.ConfigError, match="shapes_every"):
        amprobe.Config(shapes_every=0)
    with pytest.raises(amprobe.ConfigError, match="shapes_captures"):
        amprobe.Config(shapes_captures=-1)


def test_collector_off_means_not_checked(tmp_path):
    model = nn.Linear(16, 16)

    def batch(g):
        return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)

    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with amprobe.attach(model, opt, run_dir=tmp_path / "run", config={"collectors": ("scaler",)}):
        for _ in range(2):
            x, y = batch(g)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    diagnosis = amprobe.diagnose(amprobe.load_run(tmp_path / "run"))
    reasons = {n.id: n.reason for n in diagnosis.not_checked}
    assert "compute collector was not enabled" in reasons["AMP-S04"]
    assert diagnosis.health["mfu"]["value"] is None


def test_backward_ops_booked_to_their_layer_whatever_the_users_hooks(tmp_path):
    """Issue 19 item 6: a user's forward hook that registers a tensor hook doing an op in
    backward must not move the last layer's backward matmuls to the root model."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

    def hook(module, args, out):
        out.register_hook(lambda grad: grad * 1.0)

    model[2].register_forward_hook(hook)

    def batch(g):
        return torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)

    run = _run(tmp_path, model, batch, None, steps=2, lm=False)
    ops, _ = latest_capture(run)
    backward = ops[ops["phase"] == "backward"]
    assert set(backward["module"]) == {"0", "2"}, backward[["module", "op", "m", "n", "k"]]
    assert int(backward.loc[backward["module"] == "2", "count"].sum()) == 2  # dX and dW
    assert int(backward.loc[backward["module"] == "0", "count"].sum()) == 1  # dW only


class _Attention(nn.Module):
    """nanoGPT's attention: fused SDPA, then an output projection and its dropout."""

    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.resid_dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


def test_attention_backward_is_booked_to_the_attention_module(tmp_path):
    """Issue 19 item 6: SDPA's backward belongs to the module that ran SDPA, not to the
    dropout after it (which then counted as a matmul layer)."""
    model = nn.Sequential(nn.Embedding(64, 32), _Attention(), nn.Linear(32, 64))
    run = _run(tmp_path, model, _tokens(64), torch.bfloat16, steps=2)
    ops, _ = latest_capture(run)
    attention = ops[ops["op"].astype(str).str.startswith("_scaled_dot_product")]
    assert set(attention["phase"]) == {"forward", "backward"}
    assert set(attention["module"]) == {"1"}, attention[["module", "op", "phase"]]
    assert not ops["module"].astype(str).str.contains("dropout").any()


def test_module_hooks_are_the_hubs_and_only_on_captured_steps(tmp_path):
    """The global module hooks naming ops' modules are installed by the hub on the captured
    steps only, removed at the step end, and all gone at close; compute installs none itself."""
    from torch.nn.modules import module as torch_module

    def global_hooks() -> int:
        return len(torch_module._global_forward_pre_hooks) + len(torch_module._global_forward_hooks)

    before = global_hooks()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    probe = amprobe.attach(
        model,
        opt,
        run_dir=tmp_path / "r",
        config={"collectors": list(COLLECTORS), "shapes_every": 3},
    )
    seen: list[tuple[int, bool, int, str | None]] = []

    def on_forward(module: nn.Module, args: tuple) -> None:
        stack = probe.hub.modules
        seen.append((probe.step, stack.active, global_hooks(), stack.innermost()))

    handle = model[2].register_forward_pre_hook(on_forward)
    try:
        for _ in range(5):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        handle.remove()
        probe.close()
    assert global_hooks() == before
    captured = [step for step, active, _, _ in seen if active]
    assert captured == [1, 4], seen  # step 1, then every third
    for step, active, hooks, inner in seen:
        if step > 0:  # on step 0 discovery's own global hooks look for more root models
            assert hooks == (before + 3 if active else before), (step, hooks)
        assert inner == ("Sequential.2" if active else None), (step, inner)
