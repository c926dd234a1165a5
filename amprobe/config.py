"""Probe configuration: every knob in one place, validated once at attach time.

A bad value raises :class:`ConfigError` when the probe is attached, never later inside the
training loop. This module is a leaf: collector names are checked against the registry the
capture layer passes to :func:`check_collectors`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "Config",
    "ConfigError",
    "check_collectors",
    "make_config",
    "LIST_KEYS",
    "ENV_RUN_DIR",
    "ENV_CONFIG",
    "ENV_FORCE_FP32",
    "ENV_BASELINE",
]

#: the environment `amprobe run` passes to the processes it starts (read by amprobe.control.autoattach);
#: here, in a leaf, so that the launcher's own process never loads the capture side (torch)
ENV_RUN_DIR = "AMPROBE_RUN_DIR"  # the run directory (required to activate)
ENV_CONFIG = "AMPROBE_CONFIG"  # JSON object of Config fields
ENV_FORCE_FP32 = "AMPROBE_FORCE_FP32"  # "1": autocast and GradScalers off (the FP32 baseline)
ENV_BASELINE = "AMPROBE_BASELINE"  # the FP32 baseline run, recorded in this run's manifest

#: keys whose value is a list of names; a string is read as comma-separated ("a,b,c")
LIST_KEYS = ("collectors", "numerics_layers", "block_formats")


def _as_names(value: Any) -> Any:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


#: the minimum periods of the default (budgeted) sampling schedules, in steps
DEFAULT_PERIODS = {
    "numerics_every": 100,
    "shapes_every": 200,
    "syncs_every": 50,
    "fingerprint_every": 100,
}
#: an unset ``device_check_minutes`` on an accelerator: the known-answer GEMM's period, minutes
DEFAULT_DEVICE_CHECK_MINUTES = 30.0
#: an unset ``flush_every``: this many steps, and at least FLUSH_MIN_SPACING_S since the last flush
DEFAULT_FLUSH_EVERY = 100
FLUSH_MIN_SPACING_S = 0.5


class ConfigError(ValueError):
    """A configuration mistake, raised at attach time with a message that names the fix."""


#: the names ``block_formats`` accepts: the keys of
#: :data:`amprobe.store.blockformats.FORMATS`, which holds each format's data (the store sits
#: above the configuration and imports none of it, so the names are kept here too;
#: tests/test_blockstats.py checks that the two agree)
BLOCK_FORMAT_NAMES: tuple[str, ...] = (
    "fp8_tensor",
    "fp8_block",
    "mxfp8",
    "mxfp4",
    "nvfp4",
    "mxfp8_e5m2",
    "mxfp8_ceil",
    "nvfp4_w16",
)
#: the formats measured unless ``block_formats`` names others
DEFAULT_BLOCK_FORMATS: tuple[str, ...] = ("fp8_tensor", "fp8_block", "mxfp8", "mxfp4", "nvfp4")


def _check_formats(names: Any) -> None:
    if isinstance(names, str) or not all(
        isinstance(n, str) and n in BLOCK_FORMAT_NAMES for n in names
    ):
        raise ConfigError(
            f"block_formats must be a list of format names from {', '.join(BLOCK_FORMAT_NAMES)} "
            f"(or [] for none), got {names!r}"
        )


@dataclasses.dataclass(frozen=True)
class Config:
    """What the probe records and how often.

    Attributes:
        flush_every: write buffered step records to disk every this many steps. Each flush
            reads the buffered device values back in one transfer (one host-device sync).
            Unset (the default): every :data:`DEFAULT_FLUSH_EVERY` steps, but no sooner than
            :data:`FLUSH_MIN_SPACING_S` after the last flush, so that a job of short steps
            (launch-bound, a millisecond a step) flushes about twice a second, not every 100
            steps (a sync and the flush's fixed cost every 0.1 s). A value set is followed
            exactly.
        flush_interval_s: also flush when this many seconds have passed since the last flush,
            checked at step boundaries, so a live dashboard sees a slow job move.
        capture_loss: keep the loss tensor of each step (on device) and record its value and dtype.
        collectors: names of the collectors to run; see :data:`amprobe.capture.collectors.REGISTRY`.
            ``scaler`` is always added: the loss-scale trajectory and skipped steps are the
            core of every run (step boundaries themselves come from the hub); so is
            ``compile`` (torch.compile's counters, read only in a job that compiles).
            ``discovery`` (finding the root models nobody passed) is not a collector but is
            accepted here and always on; every run's manifest lists it.
        max_buffered_rows: rows kept in memory when the run directory cannot be written
            (disk full, removed); beyond this the oldest rows are dropped and counted as lost.
        rank: process rank; ``None`` reads ``RANK`` from the environment (torchrun), else 0.
        world_size: number of ranks; ``None`` reads ``WORLD_SIZE``, else 1.
        overwrite: allow recording into a run directory that already holds this rank's data.
        max_steps: stop the training process cleanly (``SystemExit(0)`` at a step boundary,
            after the run is closed) once this many iterations are recorded; used by
            ``amprobe baseline``. ``None`` never stops the job.
        numerics_every: the ``numerics`` collector measures per-layer ranges every this many
            steps (step 0 included); other steps only run the cheap non-finite input/loss check.
            0 takes no per-layer sample at all (not even the full capture armed by an overflow).
            ``None`` (the default): at most every 100 steps, and further apart when the
            ``overhead_budget`` needs it (see :mod:`amprobe.capture.budget`).
        numerics_layers: ``fnmatch`` patterns on qualified module names (``"blocks.*.linear1"``);
            empty selects every leaf module and every module owning parameters.
        numerics_arm_steps: steps captured in full after a non-finite input, loss or gradient.
        shapes_every: with the ``compute`` collector, capture the matmul/conv/attention ops of
            one step every this many steps (first capture at step 1). A captured step runs
            under a dispatch mode and costs a few times a plain step. ``None`` (the default):
            at most every 200 steps, further apart when the ``overhead_budget`` needs it.
        shapes_captures: stop after this many captured steps (shapes rarely change);
            0 captures every ``shapes_every`` steps for the whole run.
        syncs_every: runtime collector: count host-device syncs on every this-many-th step
            (steps 1, 1 + N, ...; 1 = every step); 0 turns sync counting off. ``None`` (the
            default): at most every 50 steps, further apart when the ``overhead_budget`` needs it.
        details_every: the step's details are recorded on step 0 and on every this-many-th
            step after it (steps N-1, 2N-1, ...: not the default samples' steps), and on every
            step until the step boundary is known: the forward/backward/optimizer split of the
            host time (``fwd_s``/``bwd_s``/``opt_s``), the autocast setting in use
            (``autocast_dtype``), ``unscale_`` and gradient-clipping calls (``unscale_calls``,
            ``clip_calls``, ``clip_scaled``). Null on the other steps, which record what every
            step needs (loss, loss scale, skipped, wall time, data wait, non-finite inputs) at a
            fraction of the cost. 1 = every step; 0 = step 0 only. New autocast settings,
            optimizers and GradScalers are recorded whenever they are first seen on a detail
            step (or created).
        overhead_budget: the share of training time that sampled steps (per-layer numerics,
            shape capture, sync counting) may add, 0.01 = 1 %: amprobe measures what each
            sampled step costs and spaces the next samples of the default schedules so that
            they stay within it. Periods set explicitly are followed exactly; 0 follows the
            default periods exactly too.
        gpu_sample_hz: runtime collector: NVML samples per second (0 turns the sampler off).
        gpu_gpm: runtime collector: also read GPM metrics (Tensor Core activity, SM occupancy)
            on GPUs that support them (Hopper or newer).
        reset_peak_memory: runtime collector: reset CUDA's peak-memory counter at every step, so
            ``peak_mem_bytes`` is per step. Off by default because the counter is shared: the
            job's own ``torch.cuda.max_memory_allocated()`` would then report per-step peaks
            too. Off, ``peak_mem_bytes`` is the peak since the start (what compare needs).
        prometheus_port: serve live metrics in the Prometheus text format on this port plus the
            process's local rank (``amprobe run --prometheus-port``); setting it enables the
            ``prometheus`` collector. 0 (the default) serves nothing.
        prometheus_host: address the Prometheus endpoint binds to; loopback unless told otherwise.
        dormant: install the probe but record nothing until asked (``amprobe attach RUN``,
            :meth:`amprobe.Probe.start_recording`); steps are still counted, so a later
            recording window carries the job's true iteration numbers. A dormant probe watches
            the run's control file from a background thread.
        control_poll_s: how often (seconds) that background thread reads the control file.
        replay: ``"on"`` (the default): the first bad steps (an update skipped for inf/NaN
            gradients outside the scaler's start-up calibration, or a non-finite loss seen
            before its update) are re-run in the training process in a fixed set of variants
            (as it ran, eager, autocast off, layers pinned to fp32, a lower loss scale) to
            measure their cause (AMP-N17); ``"off"`` replays nothing and keeps nothing for it.
        replay_max: replays per run at most (0 = none, as ``replay="off"``).
        replay_time_factor: each replay may take at most this many times its bad step's own
            time; ``None`` (the default): 10. A replay that runs out records what it measured
            and says it is incomplete.
        checkpoint_guard: what a checkpoint save does while parameters or optimizer state hold
            inf/NaN (AMP-N18): ``"warn"`` (the default) records it and lets the save go on;
            ``"raise"`` refuses the save with an error before anything is written; ``"off"``
            checks nothing.
        device_check_minutes: the ``devicecheck`` collector runs a fixed known-answer GEMM in
            the job's precision on each rank's device at the first step boundary and then every
            this many minutes, and compares its result exactly with the stored answer
            (AMP-D06; a device tensor, read at the next flush: no host-device sync on the
            step). ``None`` (the default): every :data:`DEFAULT_DEVICE_CHECK_MINUTES` minutes
            on an accelerator, off on the CPU; a number turns it on for any device (the
            collector is added when it is not listed); 0 turns it off.
        fingerprint_every: the ``replicas`` collector (on by default in a job of several ranks)
            records an exact fingerprint of every parameter at the end of every this-many-th
            step (step 0 included), so that AMP-D05 can compare data-parallel replicas; 0 turns
            it off. ``None`` (the default): at most every 100 steps, further apart when the
            ``overhead_budget`` needs it.
        block_formats: block-scaled formats (:data:`amprobe.store.blockformats.FORMATS` keys)
            whose cast the ``numerics`` collector measures on every matmul layer's three GEMM
            operands (input, weight, output gradient; both orientations) on its budgeted
            sampled steps, with the operands' own range statistics (``blockstats`` table;
            ``gemm_input``/``gemm_weight`` rows of ``numerics``). Default: the
            ``DEFAULT_FORMATS`` (per-tensor fp8, blockwise fp8, MXFP8, MXFP4, NVFP4); ``[]``
            records neither.
    """

    flush_every: int | None = None
    flush_interval_s: float = 5.0
    capture_loss: bool = True
    collectors: tuple[str, ...] = ("scaler", "numerics", "compute", "runtime", "devicecheck")
    max_buffered_rows: int = 200_000
    rank: int | None = None
    world_size: int | None = None
    overwrite: bool = False
    max_steps: int | None = None
    numerics_every: int | None = None
    numerics_layers: tuple[str, ...] = ()
    numerics_arm_steps: int = 3
    shapes_every: int | None = None
    shapes_captures: int = 3
    syncs_every: int | None = None
    details_every: int = 10
    overhead_budget: float = 0.01
    gpu_sample_hz: float = 10.0
    gpu_gpm: bool = True
    reset_peak_memory: bool = False
    prometheus_port: int = 0
    prometheus_host: str = "127.0.0.1"
    dormant: bool = False
    control_poll_s: float = 0.5
    replay: str = "on"
    replay_max: int = 3
    replay_time_factor: float | None = None
    checkpoint_guard: str = "warn"
    device_check_minutes: float | None = None
    fingerprint_every: int | None = None
    block_formats: tuple[str, ...] = DEFAULT_BLOCK_FORMATS

    def __post_init__(self) -> None:
        for key in LIST_KEYS:
            object.__setattr__(self, key, _as_names(getattr(self, key)))
        if self.flush_every is not None and (
            not isinstance(self.flush_every, int) or self.flush_every < 1
        ):
            raise ConfigError(f"flush_every must be a positive integer, got {self.flush_every!r}")
        if not isinstance(self.flush_interval_s, (int, float)) or self.flush_interval_s <= 0:
            raise ConfigError(
                f"flush_interval_s must be a positive number of seconds, got {self.flush_interval_s!r}"
            )
        if not isinstance(self.max_buffered_rows, int) or self.max_buffered_rows < 1:
            raise ConfigError(
                f"max_buffered_rows must be a positive integer, got {self.max_buffered_rows!r}"
            )
        if self.shapes_every is not None and (
            isinstance(self.shapes_every, bool)
            or not isinstance(self.shapes_every, int)
            or self.shapes_every < 1
        ):
            raise ConfigError(
                f"shapes_every must be a positive integer (or None: the default schedule), "
                f"got {self.shapes_every!r}"
            )
        if (
            isinstance(self.overhead_budget, bool)
            or not isinstance(self.overhead_budget, (int, float))
            or not 0 <= self.overhead_budget <= 1
        ):
            raise ConfigError(
                "overhead_budget must be a share of training time in [0, 1] (0.01 = 1 %), "
                f"got {self.overhead_budget!r}"
            )
        if not isinstance(self.shapes_captures, int) or self.shapes_captures < 0:
            raise ConfigError(
                f"shapes_captures must be a non-negative integer (0 = no limit), got {self.shapes_captures!r}"
            )
        if self.syncs_every is not None and (
            isinstance(self.syncs_every, bool)
            or not isinstance(self.syncs_every, int)
            or self.syncs_every < 0
        ):
            raise ConfigError(
                f"syncs_every must be a non-negative integer (0 = off), got {self.syncs_every!r}"
            )
        if (
            isinstance(self.details_every, bool)
            or not isinstance(self.details_every, int)
            or self.details_every < 0
        ):
            raise ConfigError(
                f"details_every must be a non-negative integer (0 = step 0 only), got {self.details_every!r}"
            )
        if (
            isinstance(self.gpu_sample_hz, bool)
            or not isinstance(self.gpu_sample_hz, (int, float))
            or not 0 <= self.gpu_sample_hz <= 1000
        ):
            raise ConfigError(
                f"gpu_sample_hz must be a number of samples per second in [0, 1000] (0 = off), "
                f"got {self.gpu_sample_hz!r}"
            )
        port = self.prometheus_port
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ConfigError(
                f"prometheus_port must be an integer port 1-65535, or 0 for off; got {port!r}"
            )
        if not isinstance(self.prometheus_host, str) or not self.prometheus_host:
            raise ConfigError(
                f"prometheus_host must be a host name or address, got {self.prometheus_host!r}"
            )
        if not all(isinstance(name, str) and name for name in self.collectors):
            raise ConfigError(
                f"collectors must be a list of collector names, got {self.collectors!r}"
            )
        collectors = tuple(dict.fromkeys(self.collectors))
        if "scaler" not in collectors:
            collectors = ("scaler", *collectors)
        if "compile" not in collectors:  # always on: a few counter reads, and only if compiling
            collectors = (collectors[0], "compile", *collectors[1:])
        if port and "prometheus" not in collectors:
            collectors = (*collectors, "prometheus")
        if self.replay == "on" and self.replay_max and "replay" not in collectors:
            collectors = (*collectors, "replay")  # keeps only references: nothing on most steps
        minutes = self.device_check_minutes
        if minutes is not None and (
            isinstance(minutes, bool)
            or not isinstance(minutes, (int, float))
            or not 0 <= minutes < float("inf")
        ):
            raise ConfigError(
                "device_check_minutes must be a non-negative number of minutes (0 = off, None = "
                f"every {DEFAULT_DEVICE_CHECK_MINUTES:g} on an accelerator), got {minutes!r}"
            )
        if minutes and "devicecheck" not in collectors:  # asked for by its period
            collectors = (*collectors, "devicecheck")
        world = self.world_size if isinstance(self.world_size, int) else _env_int("WORLD_SIZE", 1)
        if self.fingerprint_every != 0 and world > 1 and "replicas" not in collectors:
            collectors = (*collectors, "replicas")  # AMP-D05: nothing on unsampled steps
        object.__setattr__(self, "collectors", collectors)
        if self.max_steps is not None and (
            not isinstance(self.max_steps, int) or self.max_steps < 1
        ):
            raise ConfigError(
                f"max_steps must be a positive integer or None, got {self.max_steps!r}"
            )
        if self.numerics_every is not None and (
            isinstance(self.numerics_every, bool)
            or not isinstance(self.numerics_every, int)
            or self.numerics_every < 0
        ):
            raise ConfigError(
                "numerics_every must be a non-negative integer (0 = no per-layer samples), "
                f"got {self.numerics_every!r}"
            )
        if not isinstance(self.numerics_arm_steps, int) or self.numerics_arm_steps < 0:
            raise ConfigError(
                f"numerics_arm_steps must be a non-negative integer, got {self.numerics_arm_steps!r}"
            )
        if isinstance(self.numerics_layers, str) or not all(
            isinstance(p, str) and p for p in self.numerics_layers
        ):
            raise ConfigError(
                "numerics_layers must be a list of module-name patterns such as ['blocks.*'], "
                f"got {self.numerics_layers!r}"
            )
        object.__setattr__(self, "numerics_layers", tuple(self.numerics_layers))
        if not isinstance(self.dormant, bool):
            raise ConfigError(f"dormant must be True or False, got {self.dormant!r}")
        if (
            not isinstance(self.control_poll_s, (int, float))
            or isinstance(self.control_poll_s, bool)
            or not 0.01 <= self.control_poll_s <= 60
        ):
            raise ConfigError(
                f"control_poll_s must be a number of seconds between 0.01 and 60, got {self.control_poll_s!r}"
            )
        if self.replay not in ("on", "off"):
            raise ConfigError(f"replay must be 'on' or 'off', got {self.replay!r}")
        if (
            isinstance(self.replay_max, bool)
            or not isinstance(self.replay_max, int)
            or self.replay_max < 0
        ):
            raise ConfigError(
                f"replay_max must be a non-negative integer (0 = off), got {self.replay_max!r}"
            )
        factor = self.replay_time_factor
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0
        ):
            raise ConfigError(
                f"replay_time_factor must be a positive number (or None: 10), got {factor!r}"
            )
        if self.checkpoint_guard not in ("off", "warn", "raise"):
            raise ConfigError(
                f"checkpoint_guard must be 'off', 'warn' or 'raise', got {self.checkpoint_guard!r}"
            )
        if self.fingerprint_every is not None and (
            isinstance(self.fingerprint_every, bool)
            or not isinstance(self.fingerprint_every, int)
            or self.fingerprint_every < 0
        ):
            raise ConfigError(
                "fingerprint_every must be a non-negative integer (0 = off), "
                f"got {self.fingerprint_every!r}"
            )
        _check_formats(self.block_formats)
        object.__setattr__(self, "block_formats", tuple(self.block_formats))
        for key in ("rank", "world_size"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ConfigError(f"{key} must be a non-negative integer, got {value!r}")

    def flush_schedule(self) -> tuple[int, float]:
        """``(steps, spacing_s)``: flush once this many steps are buffered and at least
        ``spacing_s`` seconds have passed since the last flush (see ``flush_every``)."""
        if self.flush_every is None:
            return DEFAULT_FLUSH_EVERY, FLUSH_MIN_SPACING_S
        return self.flush_every, 0.0

    def sample_period(self, key: str) -> tuple[int, bool]:
        """``(period, fixed)`` of a sampling schedule (``"numerics_every"``, ``"shapes_every"``,
        ``"syncs_every"``): the period set, fixed; or the default, spaced by the budget."""
        value = getattr(self, key)
        if value is None:
            return DEFAULT_PERIODS[key], False
        return int(value), True

    @property
    def resolved_rank(self) -> int:
        return self.rank if self.rank is not None else _env_int("RANK", 0)

    @property
    def resolved_world_size(self) -> int:
        return self.world_size if self.world_size is not None else _env_int("WORLD_SIZE", 1)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def check_collectors(config: Config, known: Mapping[str, Any]) -> None:
    """Raise ConfigError for a collector name that ``known`` (the registry) does not hold."""
    for name in config.collectors:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown collector {name!r}{hint}; known collectors: {', '.join(sorted(known))}"
            )


def make_config(config: Config | Mapping[str, Any] | None) -> Config:
    """Build a :class:`Config` from ``None``, a mapping of overrides, or a ``Config``.

    Raises:
        ConfigError: on an unknown key (with the closest known key suggested) or a bad value.
    """
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a dict or amprobe.Config, got {type(config).__name__}")
    known = {f.name for f in dataclasses.fields(Config)}
    for key in config:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}")
    try:
        return Config(**dict(config))
    except TypeError as exc:  # pragma: no cover - guarded by the key check above
        raise ConfigError(str(exc)) from None
