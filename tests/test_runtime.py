"""Runtime collector on real tiny training loops: data-loader stalls, phases, syncs, memory."""

from __future__ import annotations

import inspect
import os
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler, TensorDataset
from torch.utils.data import dataloader as dl

import amprobe
from amprobe.config import ConfigError
from amprobe.report import build_sections
from tests.helpers import TinyNet

RUNTIME = {
    "collectors": ("scaler", "runtime"),
    "syncs_every": 1,
    "details_every": 1,
    "gpu_sample_hz": 0,
}
SLEEP = 0.004
# A planted slow flush, much longer than the scheduling delays of a step's own sleeps (a loaded
# 2-core machine wakes a 10 ms sleep tens of ms late): a step-time bound that leaves room for
# those delays still fails if the flush were counted as step time.
FLUSH_S = 0.5


class SlowDataset(Dataset):
    """Each item takes ``SLEEP`` seconds, like a decode-heavy ``__getitem__``."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(SLEEP)
        return torch.randn(16), torch.randn(4)


def _line(marker: str) -> int:
    """Line number in this file of the source line containing ``marker``."""
    lines, start = inspect.getsourcelines(inspect.getmodule(_line))
    return next(
        i for i, text in enumerate(lines, start or 1) if marker in text and "_line(" not in text
    )


def _model(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyNet().to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_sleepy_dataset_is_input_bound(tmp_path):
    model, opt = _model(torch.device("cpu"))
    with amprobe.attach(model, opt, run_dir=tmp_path, config=RUNTIME):
        for x, y in DataLoader(SlowDataset(), batch_size=4):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    run = amprobe.load_run(tmp_path)
    steps = run.steps
    assert len(steps) == 6 and list(steps["batches"]) == [1] * 6
    assert (steps["data_wait_s"] >= 4 * SLEEP * 0.9).all(), "each batch sleeps 4 x SLEEP"
    assert (steps["data_wait_s"] <= steps["wall_s"]).all()
    finding = next(f for f in amprobe.diagnose(run).findings if f.id == "AMP-S01")
    share = finding.evidence["data_wait_share"]
    later = steps[steps["step"] >= 1]
    assert share == pytest.approx(later["data_wait_s"].sum() / later["wall_s"].sum())
    assert share > 0.2 and f"{share:.0%}" in finding.title
    assert finding.evidence["dataloader"]["num_workers"] == 0
    assert finding.evidence["gpu_util"].startswith("not checked: ")


def test_item_calls_give_host_sync_naming_lines(tmp_path):
    model, opt = _model(torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amprobe.attach(model, opt, scaler, run_dir=tmp_path, config=RUNTIME):
        for _ in range(4):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
            log_loss = loss.item()  # SYNC-A
            log_max = float(out.detach().max())  # SYNC-B
            if (out.float().abs() > 1e6).any():  # SYNC-C
                print("big")
            positives = out[out > 0]  # SYNC-D
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    del log_loss, log_max, positives
    run = amprobe.load_run(tmp_path)
    assert list(run.steps["syncs"]) == [4, 4, 4, 4], (
        "AdamW counters and GradScaler's check excluded"
    )
    syncs = run.table("syncs")
    user = syncs[syncs["kind"] == "user"]
    here = __file__
    expected = {
        (f"{here}:{_line('SYNC-' + k)}", op)
        for k, op in (("A", "item"), ("B", "item"), ("C", "item"), ("D", "bool-mask-index"))
    }
    assert set(zip(user["site"], user["op"], strict=True)) == expected
    # AdamW's step counters are host tensors on a GPU run too: not counted on a CPU run
    assert set(syncs["kind"]) == {"user", "scaler"}
    scaler_rows = syncs[syncs["kind"] == "scaler"]
    assert scaler_rows["count"].sum() == 4 and set(scaler_rows["op"]) == {"item"}
    finding = next(f for f in amprobe.diagnose(run).findings if f.id == "AMP-S03")
    assert finding.evidence["syncs_per_step"] == 4.0
    assert "would synchronize on a GPU" in finding.title
    assert finding.evidence["gradscaler_checks_per_step"] == 1.0
    assert any(f":{_line('SYNC-A')} (item, 1/step)" in s for s in finding.evidence["top_sites"])
    section = next(s for s in build_sections(run, amprobe.diagnose(run)) if s.key == "runtime")
    caption, table = section.tables[1]
    assert "would synchronize on a GPU" in caption
    assert table[table["kind"] == "user"]["per_step"].tolist() == [1.0] * 4


def test_cpu_run_counts_only_syncs_on_tensors_derived_from_the_model(tmp_path):
    """Issue 19 item 7: nanoGPT's get_batch indexes a numpy memmap with CPU index tensors
    (``.item()`` through ``__index__``); on a GPU run those stay on the host and never sync, so
    a CPU run counts only syncs on tensors derived from the model (before: 8 more per step,
    top source numpy's memmap.py)."""
    import numpy as np

    data = np.memmap(tmp_path / "train.bin", dtype=np.float32, mode="w+", shape=(4096,))
    data[:] = np.linspace(-1.0, 1.0, 4096, dtype=np.float32)
    torch.manual_seed(0)

    def get_batch() -> torch.Tensor:
        ix = torch.randint(len(data) - 16, (4,))
        return torch.stack([torch.from_numpy(np.array(data[i : i + 16])) for i in ix])

    model, opt = _model(torch.device("cpu"))
    with amprobe.attach(model, opt, run_dir=tmp_path / "run", config=RUNTIME):
        x = get_batch()
        for _ in range(4):
            out = model(x)
            loss = out.float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            d = out.detach()
            total = float(loss.detach()) + float(d.abs().max()) + float(d.mean())  # SYNC-M1
            if (out > 0).any() and not torch.isnan(loss):  # SYNC-M2
                total += 1.0
            x = get_batch()  # prefetch the next batch, as nanoGPT does
    del total, d
    run = amprobe.load_run(tmp_path / "run")
    sampled = run.steps[run.steps["syncs_sampled"].fillna(False).astype(bool)]
    # the optimizer step ends a step: an iteration's logging syncs belong to the next step
    assert list(sampled["syncs"]) == [0, 5, 5, 5]
    syncs = run.table("syncs")
    user = syncs[syncs["kind"] == "user"]
    assert set(user["site"]) == {f"{__file__}:{_line(f'SYNC-M{k}')}" for k in (1, 2)}
    finding = next(f for f in amprobe.diagnose(run).findings if f.id == "AMP-S03")
    assert finding.evidence["syncs_per_step"] == 3.75
    assert "memmap" not in " ".join(finding.evidence["top_sites"])
    assert "counted on tensors derived from the model's parameters, outputs or loss" in (
        finding.title
    )


def test_nonzero_and_equal_are_counted(tmp_path):
    model, opt = _model(torch.device("cpu"))
    with amprobe.attach(model, opt, run_dir=tmp_path, config=RUNTIME):
        for _ in range(2):
            out = model(torch.randn(4, 16))
            idx = torch.nonzero(out > 0)
            same = torch.equal(out, out)
            out.sum().backward()
            opt.step()
    del idx, same
    syncs = amprobe.load_run(tmp_path).table("syncs")
    assert set(syncs[syncs["kind"] == "user"]["op"]) == {"nonzero", "equal"}


def test_clean_loop_is_neither_input_bound_nor_syncing(tmp_path):
    # steps long enough (tens of ms) that the process being preempted during a sub-millisecond
    # fetch on a busy machine cannot make the 7 measured steps look input-bound (AMP-S01)
    model = nn.Sequential(
        nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 8)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(1024, 128), torch.randn(1024, 8))
    # batched fetches: one __getitem__ per batch, as a fast pipeline would do
    loader = DataLoader(
        data, batch_size=None, sampler=BatchSampler(SequentialSampler(data), 256, False)
    )
    with amprobe.attach(model, opt, run_dir=tmp_path, config=RUNTIME):
        for _ in range(2):
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
    run = amprobe.load_run(tmp_path)
    assert run.steps["syncs"].tolist() == [0] * 8
    ids = set(amprobe.diagnose(run).ids())
    assert not {"AMP-S01", "AMP-S03"} & ids


def test_phase_times_and_probe_time_excluded(tmp_path, monkeypatch):
    class Sleepy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.01)
            return self.fc(x)

    model = Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_pre_hook(lambda *a: time.sleep(0.01))
    probe = amprobe.attach(
        model, opt, run_dir=tmp_path, config={**RUNTIME, "syncs_every": 0, "flush_every": 1}
    )
    orig_flush = probe.writer.flush

    def slow_flush():
        time.sleep(FLUSH_S)
        return orig_flush()

    monkeypatch.setattr(probe.writer, "flush", slow_flush)
    for _ in range(3):
        out = model(torch.randn(2, 4))
        out.register_hook(lambda g: time.sleep(0.01))
        out.sum().backward()
        opt.step()
    probe.close()
    steps = amprobe.load_run(tmp_path).steps
    assert (steps["fwd_s"] >= 0.009).all() and (steps["bwd_s"] >= 0.009).all()
    assert (steps["opt_s"] >= 0.009).all()
    # a flush that follows step k's end is the probe's time during step k + 1
    assert (steps["probe_s"].iloc[1:] >= FLUSH_S).all()
    parts = steps["fwd_s"] + steps["bwd_s"] + steps["opt_s"] + steps["data_wait_s"]
    assert (parts <= steps["wall_s"] + 1e-3).all()
    # each step sleeps 3 x 0.01 s; were the flush counted too, it would take FLUSH_S more
    assert (steps["wall_s"] < 0.03 + FLUSH_S).all(), "flush time is not step time"
    assert steps["rss_bytes"].gt(1 << 20).all()
    assert steps["peak_mem_bytes"].isna().all(), "no device memory on a CPU run"


def test_patches_and_mode_removed_at_close(tmp_path):
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    nxt, backward = dl._BaseDataLoaderIter.__next__, torch.autograd.backward
    model, opt = _model(torch.device("cpu"))
    probe = amprobe.attach(model, opt, run_dir=tmp_path, config=RUNTIME)
    assert dl._BaseDataLoaderIter.__next__ is not nxt and torch.autograd.backward is not backward
    model(torch.randn(2, 16)).sum().backward()
    opt.step()  # step 0 ends; step 1 is sampled: the counting mode is pushed
    assert _get_current_dispatch_mode() is not None
    probe.close()
    assert _get_current_dispatch_mode() is None
    assert dl._BaseDataLoaderIter.__next__ is nxt and torch.autograd.backward is backward


def test_sampling_schedule(tmp_path):
    model, opt = _model(torch.device("cpu"))
    with amprobe.attach(model, opt, run_dir=tmp_path, config={**RUNTIME, "syncs_every": 3}):
        for _ in range(7):
            loss = model(torch.randn(2, 16)).sum()
            loss.item()
            loss.backward()
            opt.step()
    steps = amprobe.load_run(tmp_path).steps
    assert steps[steps["syncs_sampled"].fillna(False)]["step"].tolist() == [1, 4]
    assert steps["syncs"].isna().tolist() == [True, False, True, True, False, True, True]
    assert steps["syncs"].dropna().tolist() == [1, 1]


@pytest.mark.parametrize(
    "every, timed", [(None, [0, 9, 19]), (4, [0, 3, 7, 11, 15, 19]), (0, [0]), (1, list(range(22)))]
)
def test_phase_split_on_the_steps_details_every_selects(tmp_path, every, timed):
    """The forward/backward/optimizer split is timed on step 0 and steps N-1, 2N-1, ...
    (default N=10), null on the others, whose wall time and data wait are recorded as always."""
    config = {**RUNTIME, "syncs_every": 0}
    if every is None:
        del config["details_every"]
    else:
        config["details_every"] = every
    model, opt = _model(torch.device("cpu"))
    with amprobe.attach(model, opt, run_dir=tmp_path, config=config):
        for _ in range(22):
            model(torch.randn(2, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    steps = amprobe.load_run(tmp_path).steps
    assert len(steps) == 22
    for col in ("fwd_s", "bwd_s", "opt_s"):
        assert steps.loc[steps[col].notna(), "step"].tolist() == timed
        assert (steps[col].dropna() > 0).all()
    assert steps["wall_s"].notna().all() and steps["data_wait_s"].notna().all()


@pytest.mark.parametrize(
    "bad",
    [
        {"syncs_every": -1},
        {"syncs_every": 1.5},
        {"details_every": -1},
        {"details_every": True},
        {"gpu_sample_hz": -1},
        {"gpu_sample_hz": "10"},
    ],
)
def test_config_errors(tmp_path, bad):
    with pytest.raises(ConfigError):
        amprobe.attach(run_dir=tmp_path, config={"collectors": ("runtime",), **bad})


def test_device_phases_and_memory(tmp_path, device):
    model, opt = _model(device)
    with amprobe.attach(model, opt, run_dir=tmp_path, config=RUNTIME):
        for _ in range(3):
            loss = model(torch.randn(8, 16, device=device)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    run = amprobe.load_run(tmp_path)
    steps = run.steps
    assert (steps["fwd_s"] > 0).all() and (steps["bwd_s"] > 0).all() and (steps["opt_s"] > 0).all()
    if device.type == "cuda":
        assert (steps["peak_mem_bytes"] > 0).all()
        phases = run.table("cuda_phases")
        assert sorted(phases["step"]) == [0, 1, 2] and (phases["fwd_s"] > 0).all()
        assert steps["syncs"].fillna(0).sum() == 0, "no user sync in this loop"
    else:
        assert run.table("cuda_phases").empty and steps["peak_mem_bytes"].isna().all()


def test_phase_clock_counts_the_innermost_phase_and_closes_what_is_open(monkeypatch):
    """The hub's phase clock: only the innermost open phase accumulates (a forward and backward
    inside ``optimizer.step(closure)`` are not optimizer time), a phase entered again while open
    counts once, and the step's end closes the phases still open."""
    from amprobe.capture import phases

    now = [0.0]
    monkeypatch.setattr(phases.time, "perf_counter", lambda: now[0])
    clock = phases.PhaseClock()
    assert clock.take() is None  # off: nothing timed
    clock.on = True

    def at(t: float) -> None:
        now[0] = t

    clock.begin("opt")  # optimizer.step(closure) at 0
    at(1.0)
    clock.begin("fwd")  # the closure's forward: 1 .. 3, a nested root inside it counts once
    clock.begin("fwd")
    at(2.0)
    clock.end("fwd")
    at(3.0)
    clock.end("fwd")
    clock.begin("bwd")  # its backward: 3 .. 6
    at(6.0)
    clock.end("bwd")
    at(7.0)  # the optimizer's own work: 0 .. 1 and 6 .. 7, still open at the step's end
    taken = clock.take()
    assert taken is not None
    seconds, events = taken
    assert seconds == {"fwd": 2.0, "bwd": 3.0, "opt": 2.0} and events == []
    clock.end("opt")  # closed at the boundary already: a late end changes nothing
    at(8.0)
    clock.begin("fwd")
    at(8.5)
    again = clock.take()
    assert again is not None and again[0] == {"fwd": 0.5, "bwd": 0.0, "opt": 0.0}


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux /proc only")
def test_rss_reader_keeps_its_file_open_and_a_forked_child_reads_its_own():
    from amprobe.capture.collectors.runtime import read_rss_bytes

    def fresh() -> int:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    first = read_rss_bytes()
    assert first is not None and abs(first - fresh()) < 64 << 20
    ballast = bytearray(256 << 20)  # 256 MiB touched: the kept-open file sees it
    ballast[::4096] = b"x" * len(range(0, len(ballast), 4096))
    assert read_rss_bytes() - first > 200 << 20
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child drops the ballast's pages: its own reading must show that
        try:
            del ballast
            import gc

            gc.collect()
            os.write(write, f"{read_rss_bytes()} {fresh()}".encode())
        finally:
            os._exit(0)
    os.close(write)
    got, want = (int(v) for v in os.read(read, 100).split())
    os.waitpid(pid, 0)
    assert abs(got - want) < 16 << 20, (got, want)


def test_the_step_end_is_called_only_once_the_device_is_known_to_be_cuda(tmp_path, monkeypatch):
    """The runtime collector folds its records at flush; its live step end (the CUDA
    allocator's peak, which a later read would lose) is muted on CPU and unmuted when the
    training device turns out to be CUDA, noted after the objects were seen (faked here at the
    probe's device and the allocator read)."""
    from amprobe.capture.collectors.runtime import RuntimeCollector

    monkeypatch.setattr(RuntimeCollector, "_peak_memory", lambda self: 123)
    monkeypatch.setattr(RuntimeCollector, "_maybe_start_sampler", lambda self, force=False: None)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    with amprobe.attach(
        model, opt, run_dir=tmp_path, config={"collectors": ["runtime"], "syncs_every": 0}
    ) as probe:
        runtime = next(c for c in probe.collectors if isinstance(c, RuntimeCollector))
        subs = probe.hub.dispatch.subs  # event -> its subscribers now
        step()
        assert not any(c is runtime for c, _ in subs["on_step_end"])  # CPU: nothing at the end
        runtime._noted_device = None
        probe.device = torch.device("cuda", 0)  # noted late (after the objects were seen)
        runtime.on_step_begin(probe.step)
        assert any(c is runtime for c, _ in subs["on_step_end"])
        probe.device = torch.device("cpu")  # the rest of the step runs on this machine
        step()
    steps = amprobe.load_run(tmp_path).steps
    assert steps["peak_mem_bytes"].isna().tolist() == [True, False]
    assert steps["peak_mem_bytes"].iloc[1] == 123


def _param_device(monkeypatch, obj: Any, device: torch.device) -> None:
    """Fake, at the probe's seam, that ``obj``'s parameters live on ``device``."""
    from amprobe.capture import probe as probe_mod

    real = probe_mod._first_param_device
    monkeypatch.setattr(probe_mod, "_first_param_device", lambda o: device if o is obj else real(o))


class _FakeSampler:
    """``GpuSampler`` at its constructor: what it was started for, and whether it was stopped
    (and waited for)."""

    made: list[_FakeSampler] = []

    def __init__(self, indices, uuids, **kwargs):
        self.indices, self.started, self.stopped = list(indices), False, None
        _FakeSampler.made.append(self)

    def start(self) -> None:
        self.started = True

    def stop(self, timeout: float = 2.0) -> None:
        self.stopped = timeout

    def drain(self):
        return [], []

    dropped = 0


def test_a_root_models_device_replaces_an_optimizers(tmp_path, monkeypatch):
    """An optimizer may hold CPU master copies of a model on an accelerator (ZeRO-Offload), and
    a zero-code run can meet the optimizer before the model. The CPU then stayed the job's
    device: the hub read the model's device values on the host every step (a sync each) and
    the runtime collector recorded no GPU. A root model's accelerator now replaces an
    optimizer's CPU, and the GPU sampler is restarted for it without waiting on the old one;
    faked at the seam that reads a model's parameter device and at the sampler."""
    from amprobe.capture.collectors import runtime as runtime_mod

    monkeypatch.setattr(runtime_mod, "GpuSampler", _FakeSampler)
    monkeypatch.setattr(_FakeSampler, "made", [])
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    accel = torch.device("cuda", 0)
    _param_device(monkeypatch, model, accel)
    probe = amprobe.attach(
        optimizer=opt,
        run_dir=tmp_path,
        config={"collectors": ["runtime", "numerics"], "syncs_every": 0},
    )
    try:
        runtime = next(c for c in probe.collectors if isinstance(c, runtime_mod.RuntimeCollector))
        numerics = next(c for c in probe.collectors if c.name == "numerics")
        subs = probe.hub.dispatch.subs
        assert probe.device == torch.device("cpu")
        assert not any(c is runtime for c, _ in subs["on_step_end"])
        assert [(m.indices, m.started) for m in _FakeSampler.made] == [([], True)]
        probe.add_model(model)
        assert probe.device == accel
        assert probe.rank_manifest["device"] == "cuda:0"
        assert any(c is runtime for c, _ in subs["on_step_end"])  # the allocator's peak
        old, new = _FakeSampler.made
        assert old.stopped == 0.0  # stopped, not waited for (this may be the user's forward)
        assert (new.indices, new.started, new.stopped) == ([0], True, None)
        assert numerics._sync_free()  # and nothing of the model's is read on the host
        probe.note_device(torch.device("cpu"))  # another optimizer's device: no way back
        assert probe.device == accel
    finally:
        probe.close()


def test_the_cpu_never_replaces_an_accelerator(tmp_path, monkeypatch):
    """A model whose first parameter stays on the host (an embedding kept on the CPU) while it
    trains on a GPU, its optimizer seen first: the device stays the accelerator, or the input
    check would read the GPU inputs back every step. Same at attach with both objects."""
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    accel = torch.device("cuda", 0)
    _param_device(monkeypatch, opt, accel)
    monkeypatch.setattr(
        "amprobe.capture.collectors.runtime.GpuSampler", _FakeSampler
    )  # (no NVML thread on this machine)
    config = {"collectors": ["runtime"], "syncs_every": 0}
    probe = amprobe.attach(optimizer=opt, run_dir=tmp_path / "a", config=config)
    try:
        probe.add_model(model)
        assert probe.device == accel
    finally:
        probe.close()
    probe = amprobe.attach(model, opt, run_dir=tmp_path / "b", config=config)
    try:
        assert probe.device == accel
    finally:
        probe.close()


def test_the_phase_clock_follows_a_device_noted_after_it_started(tmp_path):
    """With ``details_every=1`` the phase clock stays on from step 0; whether it times CUDA
    events was decided only when it switched on, so a device noted later (a model found at its
    first forward, an accelerator replacing an optimizer's CPU) never got device timings."""
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = amprobe.attach(
        model, opt, run_dir=tmp_path, config={"collectors": ["runtime"], "details_every": 1}
    )
    try:
        boundary = probe.hub.boundary
        assert boundary.clock.on and not boundary.clock.cuda
        probe.device = torch.device("cuda", 0)  # noted late (faked: no step runs after this)
        boundary.begin_step(probe.step + 1)
        assert boundary.clock.on and boundary.clock.cuda
        probe.device = torch.device("cpu")
        boundary.begin_step(probe.step + 2)
        assert not boundary.clock.cuda
    finally:
        probe.close()
