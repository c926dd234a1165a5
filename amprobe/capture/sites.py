"""Where code runs, and dtype names: the small helpers the hub and the collectors share.

A leaf module (torch only), so a collector never imports the hub for them: the hub imports the
collectors' protocol, and a collector importing the hub back made ``import amprobe.capture.hub``, done
first, fail halfway through.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["TORCH_DIR", "dtype_name", "is_own_frame", "user_call_site"]

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
#: amprobe's capture code (this package: hub, probe, discovery, collectors): frames from these
#: files are the probe's, never the user's
_OWN_PATHS = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """``torch.bfloat16`` -> ``"bfloat16"`` (remembered: called on every autocast entry)."""
    if dtype is None:
        return None
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def user_call_site(depth: int = 2) -> str | None:
    """``file:line`` of the first caller outside torch and amprobe's capture code (no tensor work)."""
    try:
        frame = sys._getframe(depth)
    except ValueError:
        return None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(TORCH_DIR) or filename.startswith(_OWN_PATHS)):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def is_own_frame(filename: str) -> bool:
    """True for a frame of amprobe's capture code."""
    return filename.startswith(_OWN_PATHS)
