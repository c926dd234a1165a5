"""Report documents: the self-contained HTML page and the report files (HTML, Markdown, JSON).

Both build the report's sections (:func:`~amprobe.report.sections.build_sections`); the text,
JSON and Markdown renderers they share are :mod:`amprobe.report.render`'s.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

from amprobe.report.evidence import (
    FINDING_ANCHOR_PREFIX,
    Block,
    Facts,
    Table,
    Text,
    finding_anchors,
    finding_layer,
    finding_step,
    fix_parts,
    render_evidence,
)
from amprobe.report.rankmarks import finding_marked_ranks
from amprobe.report.registry import Section
from amprobe.report.render import (
    _heading_note,
    _health_line,
    _run_summary,
    _status,
    compiled_summary,
    render_json,
    render_markdown,
    split_ref,
)
from amprobe.report.sections import build_sections
from amprobe.rules.engine import Diagnosis, Finding, format_ranks

__all__ = ["render_html", "write_report"]

_COLOR = {"error": "#c62828", "warning": "#ef6c00", "info": "#1565c0"}

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
.finding{border-left:6px solid #999;padding:.5em 1em;margin:1em 0;background:#fafafa}
.badge{display:inline-block;color:#fff;border-radius:3px;padding:0 .5em;font-size:.85em;margin-right:.5em}
table{border-collapse:collapse;font-size:.9em;margin:.5em 0} td,th{border:1px solid #ddd;padding:2px 8px;text-align:left}
.muted{color:#777} .fix{margin:.4em 0} .cause{margin:.3em 0} .evidence{margin:.4em 0}
table.facts th{font-weight:normal;color:#555} caption{text-align:left;color:#555;font-size:.9em}
table.dataframe{display:block;max-width:100%;overflow-x:auto}
.notchecked{background:#f4f4f4;border:1px solid #ddd;padding:.4em 1em;font-size:.9em} .notchecked ul{margin:.2em 0}
"""

#: report sections a finding links to: its step on the loss-scale chart, its layer's numerics
SCALE_SECTION = "scale"
NUMERICS_SECTION = "numerics"
RANKS_SECTION = "ranks"


def evidence_html(blocks: list[Block]) -> str:
    """Evidence blocks (:func:`~amprobe.report.evidence.render_evidence`) as escaped HTML."""
    e = html.escape
    out = []
    for block in blocks:
        if isinstance(block, Text):
            out.append(f"<p class='evidence'>{e(block.text)}</p>")
        elif isinstance(block, Facts):
            rows = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in block.items)
            out.append(f"<table class='facts'>{rows}</table>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{e(c)}</th>" for c in block.columns)
            body = "".join(
                "<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in block.rows
            )
            note = f"<p class='muted'>{e(block.note)}</p>" if block.note else ""
            out.append(
                f"<table><caption>{e(block.caption)}</caption><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table>{note}"
            )
    return "".join(out)


def _id_links(ids: tuple[str, ...]) -> str:
    e = html.escape
    return ", ".join(f"<a href='#{FINDING_ANCHOR_PREFIX}{e(i)}'>{e(i)}</a>" for i in ids)


def _where_html(f: Finding, sections: set[str]) -> str:
    """Links to the report sections that show the finding's step, layer and marked ranks."""
    e = html.escape
    parts = []
    step = finding_step(f)
    if step is not None and SCALE_SECTION in sections:
        parts.append(f"<a href='#{SCALE_SECTION}'>step {step} on the loss-scale chart</a>")
    layer = finding_layer(f)
    if layer is not None and NUMERICS_SECTION in sections:
        parts.append(f"<a href='#{NUMERICS_SECTION}'>layer {e(layer)} in the numerics view</a>")
    marked = finding_marked_ranks(f)
    if marked and RANKS_SECTION in sections:
        word = "rank" if len(marked) == 1 else "ranks"
        parts.append(
            f"<a href='#{RANKS_SECTION}'>{word} {e(format_ranks(marked))} in the ranks view</a>"
        )
    return f"<div class='muted'>look at: {' · '.join(parts)}</div>" if parts else ""


def _finding_html(f: Finding, anchor: str = "", sections: set[str] | None = None) -> str:
    e = html.escape
    color = _COLOR[f.severity]
    cause = ""
    if f.explained_by:
        cause += f"<div class='cause'>Explained by {_id_links(f.explained_by)}.</div>"
    if f.explains:
        cause += f"<div class='cause muted'>Explains {_id_links(f.explains)}.</div>"
    links = []
    for ref in f.refs:
        label, url = split_ref(ref)
        links.append(
            e(label)
            if url is None
            else f'<a href="{e(url)}" target="_blank" rel="noopener">{e(label)}</a>'
        )
    refs = f"<div class='muted'>see: {' · '.join(links)}</div>" if links else ""
    return (
        f"<div class='finding' id='{e(anchor or FINDING_ANCHOR_PREFIX + f.id)}' "
        f"style='border-left-color:{color}'>"
        f"<div><span class='badge' style='background:{color}'>{e(f.severity)}</span>"
        f"<b>{e(f.id)}</b> <code>{e(f.name)}</code> ({e(_heading_note(f))})</div>"
        f"<div>{e(f.title)}</div>{cause}<div class='fix'><b>Fix:</b> {_fix_html(f.fix)}</div>"
        f"{evidence_html(render_evidence(f))}{_where_html(f, sections or set())}{refs}</div>"
    )


def _fix_html(fix: str) -> str:
    """A fix's text escaped, its fenced code blocks as ``<pre><code>``."""
    return "".join(
        f"<pre><code>{html.escape(part)}</code></pre>" if code else html.escape(part)
        for part, code in fix_parts(fix)
    )


def render_html(run: Any, diagnosis: Diagnosis, sections: list[Section] | None = None) -> str:
    """A self-contained HTML report (plotly.js embedded once; all run text escaped)."""
    e = html.escape
    sections = build_sections(run, diagnosis) if sections is None else sections
    info = _run_summary(diagnosis)
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>amprobe report: {e(Path(info['path']).name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>amprobe report: {e(Path(info['path']).name)}</h1>",
        f"<p class='muted'>status {e(_status(info))} &middot; {info['steps']} steps &middot; "
        f"ranks {e(str(info['ranks']))} &middot; device {e(str(info['device']))}"
        + (f" ({e(str(info['gpu_name']))})" if info.get("gpu_name") else "")
        + (
            f" &middot; compiled: {e(compiled_summary(info['compiled']))}"
            if info.get("compiled")
            else ""
        )
        + "</p>",
    ]
    for warning in info["warnings"]:
        parts.append(f"<p class='muted'>warning: {e(warning)}</p>")
    if diagnosis.not_checked:  # on the first screen: not checked is not healthy
        parts.append(
            f"<div class='notchecked' id='not-checked'><b>Not checked "
            f"({len(diagnosis.not_checked)})</b>, so these findings cannot appear below:<ul>"
        )
        for n in diagnosis.not_checked:
            parts.append(f"<li><b>{e(n.id)}</b> <code>{e(n.name)}</code>: {e(n.reason)}</li>")
        parts.append("</ul></div>")
    parts.append("<h2>Findings</h2>")
    if not diagnosis.findings:
        parts.append("<p>No findings.</p>")
    shown = {sec.key for sec in sections if not sec.missing}
    anchors = finding_anchors(diagnosis.findings)
    parts += [
        _finding_html(f, anchor, shown)
        for f, anchor in zip(diagnosis.findings, anchors, strict=True)
    ]
    parts.append("<h2>Health</h2><ul>")
    for key, metric in diagnosis.health.items():
        parts.append(f"<li>{e(_health_line(key, dict(metric)))}</li>")
    parts.append("</ul>")
    plotly_included = False
    for sec in sections:
        parts.append(f"<h2 id='{e(sec.key)}'>{e(sec.title)}</h2>")
        if sec.missing:
            parts.append(f"<p class='muted'>Not recorded: {e(sec.missing)}</p>")
            continue
        for text in sec.text:
            parts.append(f"<p>{e(text)}</p>")
        for fig in sec.figures:
            parts.append(fig.to_html(full_html=False, include_plotlyjs=not plotly_included))
            plotly_included = True
        for caption, frame in sec.tables:
            parts.append(f"<h3>{e(caption)}</h3>")
            parts.append(frame.head(500).to_html(index=False, escape=True, border=0))
    parts.append("<p class='muted'>Generated by amprobe.</p></body></html>")
    return "\n".join(parts)


def write_report(run: Any, diagnosis: Diagnosis, path: str | os.PathLike[str]) -> Path:
    """Write the report; the format follows the extension (``.html``/``.htm``, ``.md``, ``.json``).

    Raises:
        ValueError: unknown extension.
        OSError: the file cannot be written.
    """
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix in (".html", ".htm"):
        text = render_html(run, diagnosis)
    elif suffix in (".md", ".markdown"):
        text = render_markdown(diagnosis, build_sections(run, diagnosis))
    elif suffix == ".json":
        text = render_json(diagnosis)
    else:
        raise ValueError(f"unknown report format {suffix or '(none)'!r}: use .html, .md or .json")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, target)
    return target
