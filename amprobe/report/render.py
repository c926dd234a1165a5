"""Renderers: a :class:`~amprobe.rules.Diagnosis` as text, JSON or Markdown.

Renderers only consume findings and report sections; they compute nothing. The HTML page and
the report files are :mod:`amprobe.report.document`'s: they build the sections, which this
module only receives (``amprobe diagnose`` renders none and does not load their builders).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amprobe.analysis.frames import percent_text
from amprobe.analysis.sampling import sampling_text
from amprobe.report.escape import escape_markdown
from amprobe.report.evidence import (
    FINDING_ANCHOR_PREFIX,
    Facts,
    Table,
    Text,
    evidence_lines,
    finding_anchors,
    fix_parts,
    render_evidence,
)
from amprobe.rules.engine import Diagnosis, Finding

if TYPE_CHECKING:
    from amprobe.report.registry import Section

__all__ = [
    "render_text",
    "render_json",
    "render_markdown",
    "format_cell",
    "split_ref",
]

_ICON = {"error": "E", "warning": "W", "info": "I"}


def split_ref(ref: str) -> tuple[str, str | None]:
    """A finding ref as ``(label, url)``: ``"NVIDIA guide: https://..."`` -> both parts; a bare
    link is its own label; a ref without a link (the checklist item) has ``url`` None."""
    at = ref.find("https://")
    if at < 0:
        return ref, None
    url = ref[at:].split()[0]
    label = ref[:at].rstrip().rstrip(":").strip()
    return label or url, url


def format_cell(value: Any) -> str:
    """A table cell or health value in short form (an evidence value is
    :func:`amprobe.report.evidence.format_value`'s)."""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        items = [format_cell(v) for v in value[:12]]
        more = f", ... (+{len(value) - 12})" if len(value) > 12 else ""
        return "[" + ", ".join(items) + more + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_cell(v)}" for k, v in value.items()) + "}"
    return str(value)


def _heading_note(f: Finding) -> str:
    """What follows a finding's ID and name in a report heading: ``error, category: NaN / inf``."""
    return f"{f.severity}, category: {f.category_label}"


def _health_line(key: str, metric: dict[str, Any]) -> str:
    value = metric.get("value")
    label = metric.get("label", key)
    if value is None:
        return f"{label}: {metric.get('note', 'not measured')}"
    if metric.get("unit") == "%":
        return f"{label}: {percent_text(value, space=False)}"
    if metric.get("unit") == "x":
        return f"{label}: {value:.2f}x"
    return f"{label}: {format_cell(value)}"


def _run_summary(diagnosis: Diagnosis) -> dict[str, Any]:
    run = diagnosis.to_dict()["run"]
    if "rank_ranges" in run:  # more ranks than the JSON lists: say them all, as ranges
        runs = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in run["rank_ranges"])
        run["ranks"] = f"{runs} ({run['rank_count']:,} ranks)"
    return run


def compiled_summary(targets: list[dict[str, Any]]) -> str:
    """``TinyGPT (module, inductor, mode max-autotune)``: what torch.compile compiled, how."""
    parts = []
    for t in targets:
        how = [str(t.get("kind") or "?"), str(t.get("backend") or "backend not recorded")]
        if t.get("mode"):
            how.append(f"mode {t['mode']}")
        parts.append(f"{t.get('target')} ({', '.join(how)})")
    return "; ".join(parts)


def _status(run: dict[str, Any]) -> str:
    """``finished``, or ``failed (RuntimeError: ...)`` with the recorded reason."""
    reason = run.get("end_reason")
    return f"{run['status']} ({reason})" if reason else str(run["status"])


def render_text(diagnosis: Diagnosis, verbose: bool = False) -> str:
    """The one-screen text form printed by ``amprobe diagnose``."""
    run = _run_summary(diagnosis)
    lines = [
        f"amprobe diagnosis of {run['path']}",
        f"  status {_status(run)}, {run['steps']} steps, ranks {run['ranks']}, "
        f"device {run['device']}",
    ]
    if run.get("compiled"):
        lines.append(f"  compiled: {compiled_summary(run['compiled'])}")
    if run.get("sampling"):
        lines.append(f"  sampled steps: {sampling_text(run['sampling'])}")
    for warning in run["warnings"]:
        lines.append(f"  warning: {warning}")
    lines.append("")
    if not diagnosis.findings:
        lines.append("No findings.")
    for f in diagnosis.findings:
        lines.append(f"[{_ICON[f.severity]}] {f.id} {f.name} ({f.severity}): {f.title}")
        if f.explained_by:
            lines.append(f"    explained by {', '.join(f.explained_by)}")
        lines.append(f"    fix: {f.fix}")
        if verbose:
            if f.explains:
                lines.append(f"    explains {', '.join(f.explains)}")
            lines.append(f"    category: {f.category_label}")
            for line in evidence_lines(f):
                lines.append(f"    {line}")
            for ref in f.refs:
                lines.append(f"    see: {ref}")
    lines.append("")
    lines.append("Health:")
    for key, metric in diagnosis.health.items():
        lines.append(f"  {_health_line(key, dict(metric))}")
    if diagnosis.not_checked:
        lines.append("")
        lines.append(f"Not checked ({len(diagnosis.not_checked)}):")
        for n in diagnosis.not_checked:
            lines.append(f"  {n.id} {n.name}: {n.reason}")
    return "\n".join(lines) + "\n"


def render_json(diagnosis: Diagnosis, tables: Mapping[str, Any] | None = None) -> str:
    """An object with ``run``, ``findings``, ``not_checked`` and ``health``.

    Args:
        diagnosis: the findings to render.
        tables: further top-level entries (e.g. ``{"whatif": records}``), already computed.
    """
    data = {**diagnosis.to_dict(), **dict(tables or {})}
    return json.dumps(_nan_to_none(data), indent=2, default=str, allow_nan=False) + "\n"


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    return obj


def _md_escape(text: Any) -> str:
    return escape_markdown(text)


def _fix_markdown(fix: str) -> list[str]:
    """The fix's lines: its text escaped, its code blocks fenced (a fence longer than any run
    of backticks in the code, so that nothing in it can close the block)."""
    out: list[str] = []
    for i, (part, code) in enumerate(fix_parts(fix)):
        if not code:
            out.append(f"**Fix:** {_md_escape(part)}" if i == 0 else _md_escape(part))
            continue
        fence = "`" * max(3, max((n + 1 for n in _backtick_runs(part)), default=0))
        out += ["", f"{fence}python", part, fence, ""]
    return out or ["**Fix:** "]


def _backtick_runs(text: str) -> list[int]:
    """The lengths of the runs of backticks in ``text``."""
    runs, n = [], 0
    for ch in text + " ":
        if ch == "`":
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def render_markdown(diagnosis: Diagnosis, sections: list[Section] | None = None) -> str:
    """Markdown report: findings with evidence and fixes, health, not-checked rules, tables.

    Every text that can come from the run (names, warnings, evidence, table cells) is escaped
    (:func:`~amprobe.report.escape.escape_markdown`): no raw HTML or Markdown markup from a
    module name reaches the viewer.
    """
    run = _run_summary(diagnosis)
    out = [f"# amprobe report: {_md_escape(Path(run['path']).name)}", ""]
    out.append(
        f"- status: {_md_escape(_status(run))}; steps: {run['steps']}; "
        f"ranks: {_md_escape(run['ranks'])}; device: {_md_escape(run['device'])}"
    )
    for warning in run["warnings"]:
        out.append(f"- warning: {_md_escape(warning)}")
    out += ["", "## Findings", ""]
    if not diagnosis.findings:
        out.append("No findings.")
    for f, anchor in zip(diagnosis.findings, finding_anchors(diagnosis.findings), strict=True):
        out.append(f'<a id="{anchor}"></a>')
        out.append("")
        out.append(f"### {_md_escape(f.id)} `{f.name}` ({_md_escape(_heading_note(f))})")
        out.append("")
        out.append(_md_escape(f.title))
        out.append("")
        if f.explained_by:
            out.append(f"Explained by {_md_links(f.explained_by)}.")
            out.append("")
        if f.explains:
            out.append(f"Explains {_md_links(f.explains)}.")
            out.append("")
        out += _fix_markdown(f.fix)
        out += _evidence_markdown(f)
        if f.refs:
            out.append("")
            out.append("See:")
            out.append("")
            for ref in f.refs:
                label, url = split_ref(ref)
                if url is None:
                    out.append(f"- {_md_escape(label)}")
                elif label == url:
                    out.append(f"- <{url}>")
                else:
                    out.append(f"- {_md_escape(label)}: <{url}>")
        out.append("")
    out += ["## Health", ""]
    for key, metric in diagnosis.health.items():
        out.append(f"- {_md_escape(_health_line(key, dict(metric)))}")
    if diagnosis.not_checked:
        out += ["", "## Not checked", ""]
        for n in diagnosis.not_checked:
            out.append(f"- {n.id} `{n.name}`: {_md_escape(n.reason)}")
    for sec in sections or []:
        out += ["", f"## {_md_escape(sec.title)}", ""]
        if sec.missing:
            out.append(f"Not recorded: {_md_escape(sec.missing)}")
            continue
        out += [_md_escape(t) for t in sec.text]
        for caption, frame in sec.tables:
            out += ["", f"**{_md_escape(caption)}**", ""]
            out.append(_frame_markdown(frame))
    return "\n".join(out) + "\n"


def _md_links(ids: tuple[str, ...]) -> str:
    return ", ".join(f"[{_md_escape(i)}](#{FINDING_ANCHOR_PREFIX}{i})" for i in ids)


def _evidence_markdown(f: Finding) -> list[str]:
    """The finding's evidence blocks as Markdown: paragraphs and tables, every cell escaped."""
    out: list[str] = []
    for block in render_evidence(f):
        out.append("")
        if isinstance(block, Text):
            out.append(_md_escape(block.text))
        elif isinstance(block, Facts):
            out += ["| evidence | value |", "|---|---|"]
            out += [f"| {_md_escape(k)} | {_md_escape(v)} |" for k, v in block.items]
        elif isinstance(block, Table):
            out += [f"**{_md_escape(block.caption)}**", ""]
            out.append("| " + " | ".join(_md_escape(c) for c in block.columns) + " |")
            out.append("|" + "---|" * len(block.columns))
            out += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in block.rows]
            if block.note:
                out += ["", _md_escape(f"({block.note})")]
    return out


def _frame_markdown(frame: Any, limit: int = 50) -> str:
    cols = [str(c) for c in frame.columns]
    rows = ["| " + " | ".join(_md_escape(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for record in frame.head(limit).itertuples(index=False):
        rows.append("| " + " | ".join(_md_escape(format_cell(v)) for v in record) + " |")
    if len(frame) > limit:
        rows.append(f"\n({len(frame) - limit} more rows)")
    return "\n".join(rows)
