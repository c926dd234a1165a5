"""What every benchmark prints beside its ratios: the CPU model (no torch import); and a
count of the bytecodes a package's frames execute (deterministic, load-independent)."""

from __future__ import annotations

import contextlib
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["cpu_model", "opcodes_in"]


@contextlib.contextmanager
def opcodes_in(root: str | None) -> Iterator[tuple[dict[str, int], set[tuple[str, int]]]]:
    """Count, while the block runs, the bytecode instructions executed in frames of files
    under ``root`` (every frame when None: torch's own, and generated code such as a
    dataclass's ``__init__``, whose file is ``<string>``): yields ``(per "file:function" count,
    distinct (file, line) set)``, filled as the block runs (``sys.settrace`` with opcode
    events)."""
    cut = len(root) if root is not None else 0
    per: dict[str, int] = {}
    lines: set[tuple[str, int]] = set()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            key = f"{code.co_filename[cut:]}:{code.co_name}"
            per[key] = per.get(key, 0) + 1
        elif event == "line":
            lines.add((frame.f_code.co_filename, frame.f_lineno))
        return local

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if root is not None and not frame.f_code.co_filename.startswith(root):
            return None
        frame.f_trace_opcodes = True
        return local

    sys.settrace(trace)
    try:
        yield per, lines
    finally:
        sys.settrace(None)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
