"""amprobe as a Lightning callback: ``Trainer(callbacks=[AmprobeCallback()])``.

Needs ``lightning`` (or the older ``pytorch_lightning`` package when ``lightning`` is absent).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

import amprobe
from amprobe.capture.probe import Probe
from amprobe.config import Config
from amprobe.integrations._common import check_config, live_metrics, print_summary

try:
    import lightning.pytorch as pl
    from lightning import __version__ as _LIGHTNING_VERSION
except ImportError:  # the standalone package of Lightning < 2 naming
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from pytorch_lightning import __version__ as _LIGHTNING_VERSION  # type: ignore[no-redef]

__all__ = ["AmprobeCallback"]

#: Lightning precision settings -> the autocast dtype they ask for.
_MIXED = {
    "16-mixed": "float16",
    "16": "float16",
    "bf16-mixed": "bfloat16",
    "bf16": "bfloat16",
    "transformer-engine": "float8",
    "transformer-engine-float16": "float8",
}


class AmprobeCallback(pl.Callback):
    """Records a Lightning ``fit`` with amprobe and reports what it found at the end.

    Everything is checked once in ``setup`` (a bad ``config`` raises
    :class:`amprobe.ConfigError` there, before training starts). At ``on_fit_start`` the probe
    is attached to the LightningModule, the trainer's optimizers and the precision plugin's
    GradScaler; the trainer's precision setting (``"16-mixed"``, ``"bf16-mixed"``, ...) and
    global step are written to the run's manifest (``framework``, ``framework_precision``,
    ``framework_amp_dtype``, ``framework_step_offset``: amprobe's step ``s`` is the trainer's
    global step ``s + framework_step_offset``). ``teardown`` closes the probe and prints the
    run directory and the findings, as ``amprobe run`` does. Under ``amprobe run`` the
    callback joins the launcher's probe and leaves closing and the summary to it.

    Logged metrics (written to the trainer's loggers on Lightning's logging steps, as
    ``DeviceStatsMonitor`` does, only when the probe provides them; they reach whatever logger
    the trainer has, TensorBoard, W&B, CSV; as plain numbers, so logging them adds no tensor and
    no host-device sync to the job):

    - ``amprobe/loss_scale``: the GradScaler's loss scale after the last recorded update.
    - ``amprobe/skipped_steps``: iterations whose update the GradScaler skipped so far (count).
    - ``amprobe/nonfinite_layers``: layers with inf/NaN outputs or gradients on sampled
      steps (count).

    The per-batch hook is an integer comparison on batches without an optimizer step, and
    reads no device value (no host-device sync).

    Args:
        run_dir: where the run is written; default ``amprobe_runs/<time>-<pid>``.
        config: an :class:`amprobe.Config` or a dict of its fields.
        log_metrics: write the live metrics to the trainer's loggers.
        summary: print the findings at the end of training (global rank 0 only).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        config: Config | Mapping[str, Any] | None = None,
        *,
        log_metrics: bool = True,
        summary: bool = True,
    ) -> None:
        self.run_dir = run_dir
        self.config = config
        self.log_metrics = log_metrics
        self.summary = summary
        self.probe: Probe | None = None
        self._config: Config | None = None
        self._owns = False
        self._offset = 0
        self._last_global_step = -1
        self._mismatch_seen = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._config = check_config(self.config)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._config is None or self.probe is not None:
            return
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if not isinstance(scaler, torch.amp.GradScaler):
            scaler = None
        optimizers = [o for o in trainer.optimizers if isinstance(o, torch.optim.Optimizer)]
        probe = amprobe.attach(
            model=pl_module,
            optimizer=optimizers[0] if optimizers else None,
            scaler=scaler,
            run_dir=self.run_dir,
            config=self._config,
        )
        self.probe = probe
        self._owns = not probe.adoptable
        self._offset = int(trainer.global_step) - probe.step
        self._last_global_step = int(trainer.global_step)
        precision = str(trainer.precision)
        probe.annotate_manifest(
            framework="lightning",
            framework_version=_LIGHTNING_VERSION,
            framework_precision=precision,
            framework_precision_setting=f"Trainer(precision={precision!r})",
            framework_amp_dtype=_MIXED.get(precision),
            framework_step_offset=self._offset,
            framework_accumulate_grad_batches=int(trainer.accumulate_grad_batches),
        )

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        probe = self.probe
        step = trainer.global_step
        if probe is None or step == self._last_global_step:
            return  # accumulating: no optimizer step in this batch
        self._last_global_step = step
        if not self._mismatch_seen and probe.step + self._offset != step:
            self._mismatch_seen = True
            probe.event(
                "framework_step_mismatch",
                framework="lightning",
                global_step=int(step),
                amprobe_step=probe.step,
                offset=self._offset,
            )
        # log when Lightning logs (every `log_every_n_steps`), as DeviceStatsMonitor does
        connector = getattr(trainer, "_logger_connector", None)
        loggers = trainer.loggers
        if self.log_metrics and loggers and getattr(connector, "should_update_logs", True):
            metrics = live_metrics(probe)
            if metrics:
                at = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", step)
                for logger in loggers:
                    logger.log_metrics(metrics, step=at)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        probe, self.probe = self.probe, None
        if probe is None or not self._owns:
            return
        probe.close()
        if self.summary and trainer.is_global_zero:
            print_summary(probe.run_dir)
