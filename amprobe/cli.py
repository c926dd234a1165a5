"""Command line: parses arguments and calls the package; no logic of its own.

Every user error ends in one line on stderr and a non-zero exit code, never a traceback.

The CLI loads no torch: a run copied from a cluster is read where torch is not installed, and
`amprobe run`'s launcher process, which lives as long as the job, stays small (the training
processes load torch, not the launcher; `amprobe attach RUN`/`detach RUN` only write files). The
commands that record in this process or attach to a live one (demo, attach --pid) import the
capture side (demo, control.remote: torch) inside their own function, and only there.

Each command imports what it needs inside its own functions (``_cmd_<name>`` and the private
helpers they call), so that ``import amprobe.cli`` loads the standard library, the config and
the run directory's layout only: ``amprobe --help`` and ``amprobe run``'s launcher do not load
pandas, the rules or the report, and ``amprobe diagnose`` does not load the launcher, the control
channel or the run writer.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import amprobe
from amprobe.config import ConfigError
from amprobe.store.layout import BASELINE_LEGS, RunLoadError

if TYPE_CHECKING:
    from amprobe.rules.compare import Comparison

__all__ = ["main", "build_parser"]

EXIT_FINDINGS = 1  # --fail-on threshold reached
EXIT_USAGE = 2  # bad arguments, unreadable run, bad config
EXIT_INTERNAL = 3  # an amprobe bug
EXIT_NOT_ACKNOWLEDGED = 4  # attach/detach: the job did not read (or refused) this request


class CliError(Exception):
    """A user error reported as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(EXIT_USAGE)


def _threshold(text: str) -> tuple[str, str, float]:
    try:
        key, value = text.split("=", 1)
        rule_id, name = key.rsplit(".", 1)
        return rule_id, name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected RULE.NAME=VALUE, e.g. AMP-N02.warn_below=0.97, got {text!r}"
        ) from None


def _diagnose_parser(sub: Any) -> None:
    p = sub.add_parser("diagnose", help="print the findings of a recorded run")
    p.add_argument("run", help="run directory")
    p.add_argument("--format", choices=("text", "json", "markdown"), default="text")
    p.add_argument(
        "--fail-on",
        choices=("warning", "error"),
        default=None,
        help="exit with status 1 when a finding of this severity or worse exists",
    )
    p.add_argument(
        "--threshold",
        action="append",
        type=_threshold,
        default=[],
        metavar="RULE.NAME=VALUE",
        help="override a rule threshold (repeatable)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="text format: print the evidence and references",
    )


def _report_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="write a report (HTML, Markdown or JSON by extension)")
    p.add_argument("run", help="run directory")
    p.add_argument("-o", "--output", required=True, help="report file: .html, .md or .json")
    p.add_argument(
        "--threshold", action="append", type=_threshold, default=[], metavar="RULE.NAME=VALUE"
    )


def _demo_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo", help="train a small model with planted AMP faults, diagnose it, write a report"
    )
    p.add_argument("--out", default="amprobe-demo", help="output folder (default: ./amprobe-demo)")
    p.add_argument("--steps", type=int, default=300, help="training iterations (default 300)")


def _rules_parser(sub: Any) -> None:
    sub.add_parser("rules", help="list the rules with their IDs, severities and thresholds")


def _run_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run a training command with amprobe attached to every Python process",
        usage="amprobe run [--out DIR] [--dormant] [--set KEY=VALUE] -- COMMAND [ARGS...]",
    )
    p.add_argument("--out", default=None, help="run directory (default: amprobe_runs/<time>)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="settings",
        help="a probe config field, e.g. --set flush_every=50 (repeatable)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    p.add_argument(
        "--prometheus-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve live metrics for Prometheus on PORT + local rank (= --set prometheus_port=PORT)",
    )
    p.add_argument(
        "--dormant",
        action="store_true",
        help="record nothing until `amprobe attach DIR` (negligible cost until then)",
    )
    p.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="the command, after --"
    )


def _attach_parser(sub: Any) -> None:
    p = sub.add_parser(
        "attach",
        help="start recording a live job (a --dormant run, or a PID on Python 3.14+)",
        usage="amprobe attach RUN_DIR [--steps N] | amprobe attach --pid PID --out DIR [--steps N]",
    )
    p.add_argument(
        "run",
        nargs="?",
        default=None,
        help="run directory of a job started with `amprobe run --dormant`",
    )
    p.add_argument("--steps", type=int, default=None, help="stop recording by itself after N steps")
    p.add_argument(
        "--pid",
        type=int,
        default=None,
        help="a Python process started without amprobe (CPython 3.14+)",
    )
    p.add_argument("--out", default=None, help="with --pid: run directory to record into")
    p.add_argument(
        "--overwrite", action="store_true", help="with --pid: replace an existing run in --out"
    )
    p.add_argument(
        "--wait",
        type=float,
        default=5.0,
        help="seconds to wait for the job to acknowledge (default 5)",
    )


def _detach_parser(sub: Any) -> None:
    p = sub.add_parser(
        "detach", help="stop recording a live job (the probe stays, dormant); flushes the window"
    )
    p.add_argument("run", help="run directory")
    p.add_argument(
        "--wait",
        type=float,
        default=5.0,
        help="seconds to wait for the job to acknowledge (default 5)",
    )


def _baseline_parser(sub: Any) -> None:
    p = sub.add_parser(
        "baseline",
        help="run a command twice, FP32 then as written (AMP), and compare",
        usage="amprobe baseline [--steps N] [--out DIR] -- COMMAND [ARGS...]",
    )
    p.add_argument(
        "--steps", type=int, default=200, help="optimizer iterations per run (default 200)"
    )
    p.add_argument(
        "--out",
        default=None,
        help="folder for fp32/ and amp/ (default: amprobe_runs/<time>-baseline)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND")


def _dashboard_parser(sub: Any) -> None:
    p = sub.add_parser("dashboard", help="serve the live dashboard over every run under ROOT")
    p.add_argument(
        "root", nargs="?", default=".", help="folder holding run directories (default: .)"
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind (default 127.0.0.1: this machine only; the dashboard has no "
        "authentication, so any other address lets everyone who reaches the port read every run)",
    )
    p.add_argument("--port", type=int, default=8050)


def _compare_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="compare two runs (e.g. FP32 baseline vs AMP)")
    p.add_argument("baseline", help="the reference run (FP32)")
    p.add_argument("candidate", help="the run to compare (AMP)")
    p.add_argument("--format", choices=("text", "json"), default="text")


#: subcommand -> the function that adds its parser, in the order ``--help`` lists them
_SUBCOMMANDS: dict[str, Callable[[Any], None]] = {
    "diagnose": _diagnose_parser,
    "report": _report_parser,
    "demo": _demo_parser,
    "rules": _rules_parser,
    "run": _run_parser,
    "attach": _attach_parser,
    "detach": _detach_parser,
    "baseline": _baseline_parser,
    "dashboard": _dashboard_parser,
    "compare": _compare_parser,
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with ``command``, one whose only subcommand is that one (it parses that
    command's arguments exactly as the full parser does, with the same messages, without
    building the nine others: argparse looks up translations for every parser it builds).
    """
    parser = _Parser(
        prog="amprobe", description="Diagnose mixed-precision (AMP) training in PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"amprobe {amprobe.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, add in _SUBCOMMANDS.items():
        if command is None or name == command:
            add(sub)
    return parser


def _thresholds(items: list[tuple[str, str, float]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for rule_id, name, value in items:
        out.setdefault(rule_id, {})[name] = value
    return out


def _load(path: str) -> Any:
    return _load_parts(path)[0]


def _load_parts(path: str) -> tuple[Any, list[str]]:
    """The run, with its warnings printed, and those of them that are not the diagnosis's:
    the load's and the collectors switched off (a kept diagnosis keeps neither)."""
    from amprobe.report.summary import collector_errors

    run = amprobe.load_run(path)
    loaded = list(run.warnings)
    switched_off = collector_errors(run)
    run.warnings.extend(switched_off)
    for warning in run.warnings:
        print(f"amprobe: warning: {warning}", file=sys.stderr)
    return run, loaded + switched_off


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from amprobe.analysis.whatif import compute_whatif
    from amprobe.report import render_json, render_markdown, render_text
    from amprobe.report.blockfit import block_fit_json, run_block_fit
    from amprobe.report.whatif_json import whatif_json
    from amprobe.rules.cache import diagnose_cached
    from amprobe.store.artifacts import source_entries
    from amprobe.store.run import gc_paused

    sources = source_entries(args.run)  # listed before the run is read: see diagnose_cached
    run, not_kept = _load_parts(args.run)
    # diagnose computes every time, and keeps its result for the report and the dashboard
    diagnosis = diagnose_cached(
        run,
        thresholds=_thresholds(args.threshold),
        reuse=False,
        sources=sources,
        not_kept=not_kept,
    )
    if args.format == "json":
        with gc_paused():  # the what-if of thousands of ranks: see amprobe.diagnose
            whatif = whatif_json(compute_whatif(run), diagnosis.thresholds)
            block = block_fit_json(run_block_fit(run, diagnosis))
        sys.stdout.write(render_json(diagnosis, {"whatif": whatif, "block_fit": block}))
    elif args.format == "markdown":
        sys.stdout.write(render_markdown(diagnosis))
    else:
        sys.stdout.write(render_text(diagnosis, verbose=args.verbose))
    if args.fail_on:
        levels = ("error",) if args.fail_on == "error" else ("error", "warning")
        if any(f.severity in levels for f in diagnosis.findings):
            return EXIT_FINDINGS
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from amprobe.report import write_report
    from amprobe.rules.cache import diagnose_cached
    from amprobe.store.artifacts import source_entries
    from amprobe.store.run import gc_paused

    sources = source_entries(args.run)
    run, not_kept = _load_parts(args.run)
    # the diagnosis `amprobe diagnose` (or the dashboard) kept, while the run is unchanged
    diagnosis = diagnose_cached(
        run, thresholds=_thresholds(args.threshold), sources=sources, not_kept=not_kept
    )
    with gc_paused():  # the sections of thousands of ranks: see amprobe.diagnose
        path = write_report(run, diagnosis, args.output)
    print(f"report written to {path}")
    return 0


@contextlib.contextmanager
def _as_cli_error(*errors: type[Exception]) -> Iterator[None]:
    """The capture side's user errors (imported with it, inside a command) as one-line errors."""
    try:
        yield
    except errors as exc:
        raise CliError(str(exc)) from None


def _cmd_demo(args: argparse.Namespace) -> int:
    from amprobe.demo import run_demo  # the capture side: torch
    from amprobe.report import render_text, write_report

    if args.steps < 10:
        raise CliError("--steps must be at least 10")
    run_dir = run_demo(args.out, steps=args.steps, progress=True)
    run = amprobe.load_run(run_dir)
    diagnosis = amprobe.diagnose(run)
    report = write_report(run, diagnosis, Path(args.out) / "report.html")
    sys.stdout.write(render_text(diagnosis))
    print(f"run recorded in {run_dir}")
    print(f"report written to {report}")
    return 0


def _cmd_rules(args: argparse.Namespace) -> int:
    from amprobe.rules import REGISTRY

    for spec in sorted(REGISTRY.values(), key=lambda spec: spec.id):
        th = ", ".join(f"{k}={v:g}" for k, v in spec.thresholds.items()) or "-"
        print(f"{spec.id}  {spec.name:<24} {spec.severity:<8} {spec.category:<6} thresholds: {th}")
    return 0


def _settings(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise CliError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
        if isinstance(out[key], list):
            out[key] = tuple(out[key])
    return out


def _command(args: argparse.Namespace) -> list[str]:
    command = list(args.argv)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError(
            f"no command given: amprobe {args.command_name} [options] -- python train.py"
        )
    return command


def _default_out(suffix: str = "") -> str:
    return os.path.join("amprobe_runs", time.strftime("%Y%m%d-%H%M%S") + suffix)


def _print_run_summary(run_dir: Path) -> None:
    """The one-screen summary after `amprobe run`'s job ends: the read side loads only then."""
    from amprobe.report.summary import print_run_summary

    print_run_summary(run_dir)


def _cmd_run(args: argparse.Namespace) -> int:
    from amprobe.control import launcher

    args.command_name = "run"
    command = _command(args)
    settings = _settings(args.settings)
    if args.prometheus_port is not None:
        settings["prometheus_port"] = args.prometheus_port
    if args.dormant:
        settings["dormant"] = True
    with _as_cli_error(launcher.LaunchError):
        return launcher.launch(
            command,
            Path(args.out or _default_out()),
            settings,
            overwrite=args.overwrite,
            summarize=_print_run_summary,
        )


def _cmd_attach(args: argparse.Namespace) -> int:
    from amprobe.control import sender

    if args.steps is not None and args.steps < 1:
        raise CliError("--steps must be a positive number of steps")
    if args.pid is not None:
        if args.run is not None:
            raise CliError("give either a run directory or --pid PID --out DIR, not both")
        if args.out is None:
            raise CliError("--pid needs --out DIR (where to record)")
        from amprobe.control import remote  # the capture side: torch

        with _as_cli_error(sender.ControlError):
            lines = remote.attach_pid(
                args.pid,
                args.out,
                steps=args.steps,
                wait_s=max(args.wait, 30.0),
                overwrite=args.overwrite,
            )
    else:
        if args.run is None:
            raise CliError(
                "give the run directory of a job started with `amprobe run --dormant`, or --pid PID --out DIR"
            )
        with _as_cli_error(sender.ControlError):
            reply = sender.send_control(args.run, "attach", steps=args.steps, wait_s=args.wait)
        return _print_reply(reply.lines, reply.acknowledged)
    for line in lines:
        print(line)
    return 0


def _print_reply(lines: list[str], acknowledged: bool) -> int:
    """Print a control reply; non-zero when a live rank did not acknowledge this very request."""
    for line in lines:
        print(line)
    if not acknowledged:
        print(
            "amprobe: error: the job did not acknowledge this request (see above)", file=sys.stderr
        )
        return EXIT_NOT_ACKNOWLEDGED
    return 0


def _cmd_detach(args: argparse.Namespace) -> int:
    from amprobe.control import sender

    with _as_cli_error(sender.ControlError):
        reply = sender.send_control(args.run, "detach", wait_s=args.wait)
    return _print_reply(reply.lines, reply.acknowledged)


def _cmd_baseline(args: argparse.Namespace) -> int:
    from amprobe.control import launcher
    from amprobe.report.compare import render_comparison_json
    from amprobe.rules.compare import compare_runs

    args.command_name = "baseline"
    command = _command(args)
    if args.steps < 5:
        raise CliError("--steps must be at least 5")
    out = Path(args.out or _default_out("-baseline"))
    config = {**_settings(args.settings), "max_steps": args.steps}
    codes = {}
    fp32_leg, amp_leg = BASELINE_LEGS
    for name, fp32 in ((fp32_leg, True), (amp_leg, False)):
        print(f"amprobe: baseline: {name} run, {args.steps} steps", file=sys.stderr)
        with _as_cli_error(launcher.LaunchError):
            codes[name] = launcher.launch(
                command,
                out / name,
                config,
                force_fp32=fp32,
                baseline=(out / fp32_leg) if not fp32 else None,
                overwrite=args.overwrite,
            )
        if codes[name] != 0:
            raise CliError(f"the {name} run exited with status {codes[name]}; see its output above")
    comparison = compare_runs(_load(str(out / fp32_leg)), _load(str(out / amp_leg)))
    (out / "comparison.json").write_text(render_comparison_json(comparison))
    _print_comparison(comparison, "text")
    print(
        f"amprobe: runs in {out / fp32_leg} and {out / amp_leg}; amprobe diagnose {out / amp_leg}"
    )
    return 0


def _print_comparison(comparison: Comparison, form: str) -> None:
    from amprobe.report.compare import render_comparison_json, render_comparison_text

    for warning in comparison.metrics.get("warnings", ()):
        print(f"amprobe: warning: {warning}", file=sys.stderr)
    if form == "json":
        sys.stdout.write(render_comparison_json(comparison))
    else:
        sys.stdout.write(render_comparison_text(comparison))


def _cmd_compare(args: argparse.Namespace) -> int:
    from amprobe.rules.compare import compare_runs

    _print_comparison(compare_runs(_load(args.baseline), _load(args.candidate)), args.format)
    return 0


def _cmd_dashboard(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.root):
        raise CliError(f"not a directory: {args.root}")
    if not 0 < args.port < 65536:
        raise CliError(f"--port must be in 1..65535, got {args.port}")
    try:
        from dashboard.main import DashMissingError, serve
    except ImportError:
        raise CliError("the dashboard package is not installed with this amprobe") from None
    try:
        serve(args.root, host=args.host, port=args.port)
    except DashMissingError as exc:
        raise CliError(str(exc)) from None
    return 0


COMMANDS = {
    "diagnose": _cmd_diagnose,
    "report": _cmd_report,
    "demo": _cmd_demo,
    "rules": _cmd_rules,
    "run": _cmd_run,
    "baseline": _cmd_baseline,
    "compare": _cmd_compare,
    "dashboard": _cmd_dashboard,
    "attach": _cmd_attach,
    "detach": _cmd_detach,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``amprobe`` console script.

    Called as the program (``argv`` None: the console script, ``python -m amprobe``), it
    freezes the objects the command made out of the garbage collector before it returns: the
    process exits next, and the final collection at interpreter shutdown would walk every one
    of them (pandas' modules and the run's frames: 70 ms of the 0.7 s of an ``amprobe
    diagnose`` on a 2-core Xeon) to free memory the exit frees anyway.
    """
    try:
        return _main(argv)
    finally:
        if argv is None:
            gc.freeze()


def _main(argv: Sequence[str] | None) -> int:
    args_given = sys.argv[1:] if argv is None else list(argv)
    command = args_given[0] if args_given and args_given[0] in _SUBCOMMANDS else None
    parser = build_parser(command)
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (CliError, RunLoadError, ConfigError) as exc:
        print(f"amprobe: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:  # ThresholdError (an unknown --threshold) among them
        print(f"amprobe: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return 0
    except OSError as exc:
        where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
        print(f"amprobe: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("amprobe: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # never a traceback for the user, unless asked for
        if os.environ.get("AMPROBE_DEBUG"):
            raise
        print(
            f"amprobe: internal error: {type(exc).__name__}: {exc} (set AMPROBE_DEBUG=1 for details)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
