"""amprobe as a Hugging Face ``TrainerCallback``: ``Trainer(..., callbacks=[AmprobeCallback()])``.

Needs ``transformers`` (and ``accelerate``, which the ``Trainer`` itself needs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers import __version__ as _TRANSFORMERS_VERSION

import amprobe
from amprobe.capture.probe import Probe
from amprobe.config import Config
from amprobe.integrations._common import check_config, live_metrics, print_summary

__all__ = ["AmprobeCallback"]


def _precision(args: TrainingArguments) -> tuple[str, str, str | None]:
    """``(framework_precision, the setting as the user wrote it, autocast dtype asked for)``."""
    if getattr(args, "fp16", False):
        return "fp16", "TrainingArguments(fp16=True)", "float16"
    if getattr(args, "bf16", False):
        return "bf16", "TrainingArguments(bf16=True)", "bfloat16"
    return "no", "TrainingArguments(fp16=False, bf16=False)", None


class AmprobeCallback(TrainerCallback):  # type: ignore[misc]
    """Records a Hugging Face ``Trainer.train()`` with amprobe and reports what it found.

    ``config`` is checked when the callback is built (a bad one raises
    :class:`amprobe.ConfigError` before the ``Trainer`` exists). ``on_train_begin`` attaches the
    probe to the model, the optimizer the ``Trainer`` prepared (the user's optimizer inside
    accelerate's wrapper) and the accelerator's GradScaler, and writes the ``fp16``/``bf16``
    setting and the global step to the run's manifest (``framework``, ``framework_precision``,
    ``framework_amp_dtype``, ``framework_step_offset``: amprobe's step ``s`` is the trainer's
    global step ``s + framework_step_offset``). ``on_train_end`` closes the probe and prints the
    run directory and the findings (main process only), as ``amprobe run`` does. Under
    ``amprobe run`` the callback joins the launcher's probe and leaves closing and the summary to it.

    Logged metrics (added to the ``logs`` of ``on_log``, only when the probe provides them):

    - ``amprobe/loss_scale``: the GradScaler's loss scale after the last recorded update.
    - ``amprobe/skipped_steps``: iterations whose update the GradScaler skipped so far (count).
    - ``amprobe/nonfinite_layers``: layers with inf/NaN outputs or gradients on sampled
      steps (count).

    The ``Trainer`` calls reporting callbacks (TensorBoard, W&B, ...) in the order they were
    registered, its own before the user's; to have them see these keys, put this callback
    first: ``trainer.callback_handler.callbacks.insert(0, AmprobeCallback())``.

    Args:
        run_dir: where the run is written; default ``amprobe_runs/<time>-<pid>``.
        config: an :class:`amprobe.Config` or a dict of its fields.
        summary: print the findings at the end of training.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        config: Config | Mapping[str, Any] | None = None,
        *,
        summary: bool = True,
    ) -> None:
        self.run_dir = run_dir
        self.config = check_config(config)
        self.summary = summary
        self.probe: Probe | None = None
        self._owns = False
        self._offset = 0
        self._mismatch_seen = False

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if self.probe is not None:
            return
        # accelerate's AcceleratedOptimizer wraps the user's optimizer and holds the scaler
        inner = getattr(optimizer, "optimizer", optimizer)
        scaler = getattr(optimizer, "scaler", None)
        probe = amprobe.attach(
            model=model if isinstance(model, torch.nn.Module) else None,
            optimizer=inner if isinstance(inner, torch.optim.Optimizer) else None,
            scaler=scaler if isinstance(scaler, torch.amp.GradScaler) else None,
            run_dir=self.run_dir,
            config=self.config,
        )
        self.probe = probe
        self._owns = not probe.adoptable
        self._offset = int(state.global_step) - probe.step
        precision, setting, dtype = _precision(args)
        probe.annotate_manifest(
            framework="transformers",
            framework_version=_TRANSFORMERS_VERSION,
            framework_precision=precision,
            framework_precision_setting=setting,
            framework_amp_dtype=dtype,
            framework_step_offset=self._offset,
            framework_accumulate_grad_batches=int(args.gradient_accumulation_steps),
        )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        probe = self.probe
        if probe is None or self._mismatch_seen:
            return
        if probe.step + self._offset != state.global_step:
            self._mismatch_seen = True
            probe.event(
                "framework_step_mismatch",
                framework="transformers",
                global_step=int(state.global_step),
                amprobe_step=probe.step,
                offset=self._offset,
            )

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs is not None:
            logs.update(live_metrics(self.probe))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        probe, self.probe = self.probe, None
        if probe is None or not self._owns:
            return
        probe.close()
        if self.summary and state.is_world_process_zero:
            print_summary(probe.run_dir)
