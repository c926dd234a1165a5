"""What a training framework in this process was asked to do about mixed precision.

Read once, from framework state already in memory: a framework module that the program did not
import is never imported here. Used by the scaler collector to record, in zero-code runs, the
setting that AMP-S05 names when it had no effect (``Accelerator(mixed_precision="fp16")`` or
``TrainingArguments(fp16=True)`` on a device where no autocast region then runs). The framework
callbacks (:mod:`amprobe.integrations`) write the same manifest keys themselves.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["framework_amp_facts"]

_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def framework_amp_facts() -> dict[str, Any]:
    """Manifest facts (``framework``, ``framework_precision``, ``framework_precision_setting``,
    ``framework_amp_dtype``) when a loaded framework was asked for fp16/bf16 mixed precision;
    empty otherwise. Never raises, never imports a framework."""
    try:
        state_mod = sys.modules.get("accelerate.state")
        if state_mod is None:
            return {}
        shared = getattr(getattr(state_mod, "AcceleratorState", None), "_shared_state", None)
        precision = str((shared or {}).get("_mixed_precision") or "")
        if precision not in _DTYPES:
            return {}
        if "transformers.trainer" in sys.modules:
            flag = "fp16" if precision == "fp16" else "bf16"
            framework, setting = "transformers", f"TrainingArguments({flag}=True)"
        else:
            framework, setting = "accelerate", f'Accelerator(mixed_precision="{precision}")'
        return {
            "framework": framework,
            "framework_precision": precision,
            "framework_precision_setting": setting,
            "framework_amp_dtype": _DTYPES[precision],
        }
    except Exception:
        return {}
