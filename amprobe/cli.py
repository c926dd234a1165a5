"""Command line: parses arguments and calls the package; no logic of its own.

Every user error ends in one line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["main", "build_parser"]

EXIT_FINDINGS = 1  # --fail-on threshold reached
EXIT_USAGE = 2  # bad arguments, unreadable run, bad config
EXIT_INTERNAL = 3  # an amprobe bug


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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="amprobe", description="Diagnose mixed-precision (AMP) training in PyTorch.")
    from amprobe import __version__

    parser.add_argument("--version", action="version", version=f"amprobe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("diagnose", help="print the findings of a recorded run")
    p.add_argument("run", help="run directory")
    p.add_argument("--format", choices=("text", "json", "markdown"), default="text")
    p.add_argument("--fail-on", choices=("warning", "error"), default=None,
                   help="exit with status 1 when a finding of this severity or worse exists")
    p.add_argument("--threshold", action="append", type=_threshold, default=[], metavar="RULE.NAME=VALUE",
                   help="override a rule threshold (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true", help="text format: print the evidence")

    p = sub.add_parser("report", help="write a report (HTML, Markdown or JSON by extension)")
    p.add_argument("run", help="run directory")
    p.add_argument("-o", "--output", required=True, help="report file: .html, .md or .json")
    p.add_argument("--threshold", action="append", type=_threshold, default=[], metavar="RULE.NAME=VALUE")

    p = sub.add_parser("demo", help="train a small model with planted AMP faults, diagnose it, write a report")
    p.add_argument("--out", default="amprobe-demo", help="output folder (default: ./amprobe-demo)")
    p.add_argument("--steps", type=int, default=300, help="training iterations (default 300)")

    p = sub.add_parser("rules", help="list the rules with their IDs, severities and thresholds")
    return parser


def _thresholds(items: list[tuple[str, str, float]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for rule_id, name, value in items:
        out.setdefault(rule_id, {})[name] = value
    return out


def _load(path: str) -> Any:
    import amprobe

    run = amprobe.load_run(path)
    for warning in run.warnings:
        print(f"amprobe: warning: {warning}", file=sys.stderr)
    return run


def _cmd_diagnose(args: argparse.Namespace) -> int:
    import amprobe
    from amprobe.report import render_json, render_markdown, render_text

    run = _load(args.run)
    diagnosis = amprobe.diagnose(run, thresholds=_thresholds(args.threshold))
    if args.format == "json":
        sys.stdout.write(render_json(diagnosis))
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
    import amprobe
    from amprobe.report import write_report

    run = _load(args.run)
    diagnosis = amprobe.diagnose(run, thresholds=_thresholds(args.threshold))
    path = write_report(run, diagnosis, args.output)
    print(f"report written to {path}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    import amprobe
    from amprobe.demo import run_demo
    from amprobe.report import render_text

    if args.steps < 10:
        raise CliError("--steps must be at least 10")
    run_dir, report = run_demo(args.out, steps=args.steps, progress=True)
    diagnosis = amprobe.diagnose(amprobe.load_run(run_dir))
    sys.stdout.write(render_text(diagnosis))
    print(f"run recorded in {run_dir}")
    print(f"report written to {report}")
    return 0


def _cmd_rules(args: argparse.Namespace) -> int:
    from amprobe.rules import REGISTRY

    for spec in REGISTRY.values():
        th = ", ".join(f"{k}={v:g}" for k, v in spec.thresholds.items()) or "-"
        print(f"{spec.id}  {spec.name:<24} {spec.severity:<8} {spec.category:<6} thresholds: {th}")
    return 0


COMMANDS = {
    "diagnose": _cmd_diagnose,
    "report": _cmd_report,
    "demo": _cmd_demo,
    "rules": _cmd_rules,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``amprobe`` console script."""
    from amprobe.config import ConfigError
    from amprobe.rules import ThresholdError
    from amprobe.store import RunLoadError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (CliError, RunLoadError, ConfigError, ThresholdError) as exc:
        print(f"amprobe: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:
        print(f"amprobe: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
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
        print(f"amprobe: internal error: {type(exc).__name__}: {exc} (set AMPROBE_DEBUG=1 for details)",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
