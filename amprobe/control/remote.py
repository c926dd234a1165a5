"""Attach to a training process that was started without amprobe.

* :func:`attach_live`, in the process itself: find the live model, optimizers and GradScalers
  through the garbage collector (:func:`amprobe.capture.discovery.find_live_training_objects`)
  and start recording at the next step; the probe it attaches is dormant-capable (it starts a
  :class:`~amprobe.control.watcher.ControlWatcher`), so ``amprobe detach`` and
  ``amprobe attach RUN`` work on it afterwards.
* ``amprobe attach --pid PID --out DIR`` (:func:`attach_pid`): on CPython 3.14+ the script built
  by :func:`build_remote_script` is run inside the target by ``sys.remote_exec`` (PEP 768); it
  calls :func:`attach_live`.

The training thread is never blocked. Who may attach is decided by the operating system:
``sys.remote_exec`` needs the same rights as a debugger (ptrace) over the target process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from amprobe.capture.discovery import find_live_training_objects
from amprobe.capture.probe import attach, current_probe
from amprobe.config import Config, ConfigError, make_config
from amprobe.control.sender import ControlError
from amprobe.control.watcher import start_control
from amprobe.store.layout import StoreError, prepare_run_dir
from amprobe.store.writer import write_json_atomic

__all__ = [
    "STATUS_FILE",
    "attach_live",
    "attach_pid",
    "build_remote_script",
    "remote_exec_disabled",
    "remote_exec_unsupported",
]

STATUS_FILE = "attach_status.json"  # written by attach_live for `amprobe attach --pid`
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the folder that holds amprobe/
_NEXT_TIME = "start the job with `amprobe run --dormant --out DIR -- ...` next time, then `amprobe attach DIR`"


def attach_live(
    run_dir: str | os.PathLike[str],
    steps: int | None = None,
    config: Config | Mapping[str, Any] | None = None,
    status_file: str | os.PathLike[str] | None = None,
) -> Any:
    """Start recording this (already running) training process from its next step.

    The live optimizers, GradScalers and root model are found through the garbage collector
    (the root model is the module holding parameters an optimizer updates, not contained in
    another such module). Callable from any thread while the training loop runs in another;
    the training thread is never blocked. If this process already has a probe (``amprobe run
    --dormant``), that probe is asked to record instead and ``run_dir`` is not used.

    Args:
        run_dir: where to write the run (must be new or empty).
        steps: stop recording after this many steps (the probe stays attached, dormant, and
            can be restarted with ``amprobe attach RUN``); ``None`` records until detached.
        config: :class:`amprobe.Config` fields; ``dormant`` is forced on.
        status_file: if given, a JSON file written with the outcome (used by ``attach --pid``).

    Returns:
        The :class:`amprobe.Probe`.

    Raises:
        ConfigError: nothing is being trained here, or a bad config or run directory.
    """
    try:
        probe, facts = _attach_live(Path(run_dir), steps, config)
    except Exception as exc:
        if status_file is not None:
            with contextlib.suppress(Exception):
                write_json_atomic(
                    Path(status_file), {"ok": False, "pid": os.getpid(), "error": f"{exc}"}
                )
        raise
    if status_file is not None:
        with contextlib.suppress(Exception):
            write_json_atomic(Path(status_file), {"ok": True, "pid": os.getpid(), **facts})
    return probe


def _attach_live(
    run_dir: Path, steps: int | None, config: Config | Mapping[str, Any] | None
) -> tuple[Any, dict[str, Any]]:
    existing = current_probe()
    if existing is not None and not existing.closed:
        if existing.recording and existing.window == 0:
            raise ConfigError(
                f"this process is already recorded by amprobe into {existing.run_dir}"
            )
        existing.start_recording(steps, source="attach_live")
        return existing, {"run_dir": str(existing.run_dir), "joined_existing": True}
    cfg = make_config(config)
    cfg = dataclasses.replace(cfg, dormant=True)
    live = find_live_training_objects()
    if not live.optimizers:
        raise ConfigError(
            "no torch.optim.Optimizer holding parameters was found in this process: "
            "nothing to record (is it training yet?)"
        )
    probe = attach(
        live.models[0] if live.models else None,
        live.optimizers[0],
        live.scalers[0] if live.scalers else None,
        run_dir=run_dir,
        config=cfg,
        adoptable=True,
        lazy=True,
        on_announce=start_control,
    )
    for obj in (*live.optimizers[1:], *live.scalers[1:]):
        probe.add_object(obj)
    for model in live.models[1:]:
        probe.add_model(model)
    probe.annotate_manifest(
        launched_by="amprobe attach (live)",
        attached_live=True,
        steps_counted_from="attach",  # the job's earlier iterations are unknown
    )
    probe.start_recording(steps, source="attach_live")
    facts = {
        "run_dir": str(run_dir),
        "joined_existing": False,
        "models": [
            f"{type(m).__name__} ({sum(p.numel() for p in m.parameters())} parameters)"
            for m in live.models
        ],
        "optimizers": [type(o).__name__ for o in live.optimizers],
        "scalers": len(live.scalers),
    }
    return probe, facts


def remote_exec_unsupported() -> str | None:
    """Why this interpreter cannot inject code into another process, or ``None`` if it can."""
    if not hasattr(sys, "remote_exec"):
        version = ".".join(str(v) for v in sys.version_info[:3])
        return (
            f"attaching to a process started without amprobe needs CPython 3.14 or newer "
            f"(sys.remote_exec, PEP 768), on both sides; this is Python {version}: {_NEXT_TIME}"
        )
    return None


def remote_exec_disabled(pid: int) -> str | None:
    """Why process ``pid`` refuses remote execution (as far as /proc shows), or ``None``.

    Checks ``PYTHON_DISABLE_REMOTE_DEBUG`` in its environment and ``-X disable-remote-debug``
    on its command line. Where /proc is unreadable, returns ``None`` (``sys.remote_exec`` then
    reports the refusal itself).
    """
    proc = Path("/proc") / str(pid)
    with contextlib.suppress(OSError):
        for entry in (proc / "environ").read_bytes().split(b"\0"):
            name, _, value = entry.partition(b"=")
            if name == b"PYTHON_DISABLE_REMOTE_DEBUG" and value:
                return (
                    f"process {pid} disabled remote execution (PYTHON_DISABLE_REMOTE_DEBUG is set): "
                    f"{_NEXT_TIME}"
                )
    with contextlib.suppress(OSError):
        args = [a.decode("utf-8", "replace") for a in (proc / "cmdline").read_bytes().split(b"\0")]
        for i, arg in enumerate(args):
            option = (
                arg[2:]
                if arg.startswith("-X") and len(arg) > 2
                else (args[i + 1] if arg == "-X" and i + 1 < len(args) else "")
            )
            if option.replace("_", "-") == "disable-remote-debug":
                return f"process {pid} disabled remote execution (-X disable-remote-debug): {_NEXT_TIME}"
    return None


def build_remote_script(
    run_dir: Path, steps: int | None, status_file: Path, config: Mapping[str, Any] | None = None
) -> str:
    """The Python source that ``sys.remote_exec`` runs inside the target: attach, never raise."""
    return f"""# amprobe: live attach, run inside this process by `amprobe attach --pid`
def _amprobe_attach():
    import sys
    try:
        parent = {str(_PACKAGE_PARENT)!r}
        if parent not in sys.path:
            sys.path.append(parent)
        from amprobe.control.remote import attach_live
        attach_live({str(run_dir)!r}, steps={steps!r}, config={dict(config or {})!r},
                    status_file={str(status_file)!r})
    except Exception as exc:
        try:
            import json, os
            with open({str(status_file)!r}, "w") as fh:
                json.dump({{"ok": False, "pid": os.getpid(), "error": f"{{type(exc).__name__}}: {{exc}}"}}, fh)
        except Exception:
            pass


_amprobe_attach()
del _amprobe_attach
"""


def attach_pid(
    pid: int,
    out: str | os.PathLike[str],
    steps: int | None = None,
    wait_s: float = 30.0,
    overwrite: bool = False,
    config: Mapping[str, Any] | None = None,
) -> list[str]:
    """Attach to process ``pid`` (started without amprobe) with ``sys.remote_exec``; record into ``out``.

    Returns:
        Lines describing the outcome.

    Raises:
        ControlError: the interpreter, the process or the OS does not allow it, or the attach
            failed inside the target (which keeps running unchanged).
    """
    reason = remote_exec_unsupported()
    if reason:
        raise ControlError(reason)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise ControlError(f"no process with pid {pid}") from None
    except PermissionError:
        raise ControlError(
            f"process {pid} belongs to another user: only its owner (or root) can attach"
        ) from None
    reason = remote_exec_disabled(pid)
    if reason:
        raise ControlError(reason)
    out_dir = Path(out).resolve()
    try:
        prepare_run_dir(out_dir, overwrite)
    except StoreError as exc:
        raise ControlError(str(exc)) from None
    make_config(config)
    status = out_dir / STATUS_FILE
    script = out_dir / f".amprobe_attach_{pid}.py"
    script.write_text(build_remote_script(out_dir, steps, status, config), encoding="utf-8")
    try:
        sys.remote_exec(pid, str(script))  # type: ignore[attr-defined]
    except PermissionError as exc:
        raise ControlError(
            f"not permitted to attach to process {pid} ({exc}): the OS allows it only to the "
            "process owner with debugger (ptrace) rights; see Yama ptrace_scope"
        ) from None
    except Exception as exc:
        raise ControlError(f"cannot run code in process {pid}: {exc}; {_NEXT_TIME}") from None
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if status.exists():
            break
        time.sleep(0.1)
    else:
        return [
            f"amprobe: request delivered to process {pid}; it has not run it within {wait_s:g} s "
            f"(it runs when the process next executes Python code); outcome will be in {status}"
        ]
    with contextlib.suppress(OSError):
        script.unlink()
    try:
        result = json.loads(status.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ControlError(f"cannot read the attach outcome {status}: {exc}") from None
    if not result.get("ok"):
        raise ControlError(
            f"attach failed inside process {pid} (it keeps running unchanged): {result.get('error')}"
        )
    if result.get("joined_existing"):
        return [
            f"amprobe: process {pid} already had a dormant probe; recording into {result.get('run_dir')}"
        ]
    models = ", ".join(result.get("models") or []) or "no model found (layer data needs one)"
    return [
        f"amprobe: attached to process {pid}: {models}; optimizers: {', '.join(result.get('optimizers') or [])}; "
        f"{result.get('scalers', 0)} GradScaler(s); recording into {out_dir} from its next step"
    ]
