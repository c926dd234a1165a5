"""The dashboard's layout, built by ``build_*`` functions from loaded runs.

All text that comes from a run (names, layer names, evidence, fixes, warnings) is passed as
component children or table cells, which Dash renders as text (escaped), never as HTML.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

import pandas as pd
from dash import dash_table, dcc, html

from amprobe.analysis.frames import percent_text
from amprobe.analysis.rankbands import StepsRelation
from amprobe.analysis.whatif import compute_whatif
from amprobe.report.compare import comparison_rows
from amprobe.report.downsample import thin_figure
from amprobe.report.escape import escape_markdown, escape_plotly_text
from amprobe.report.evidence import (
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
from amprobe.report.numerics import layer_recorded
from amprobe.report.rankmarks import compute_rank_marks, finding_marked_ranks
from amprobe.report.render import split_ref
from amprobe.report.scale import (
    ReplayMark,
    event_rows,
    many_ranks,
    rank_groups_text,
    replay_marks,
    step_ends,
    steps_of,
)
from amprobe.report.sections import section_tabs
from amprobe.rules.cache import run_facts
from amprobe.rules.engine import CATEGORY_LABELS, Severity, format_ranks
from dashboard import ids
from dashboard.figures import (
    make_loss_scale_figure,
    make_step_time_figure,
    make_whatif_figure,
    scale_events,
    split_block_fit,
    whatif_groups,
)
from dashboard.runs import PAGE_ROWS, PENDING, LoadedRun, RunPage, RunSummary

__all__ = [
    "SEVERITIES",
    "CATEGORIES",
    "build_section_tab",
    "build_frame",
    "build_run_list",
    "build_run_table",
    "run_rows",
    "pages_text",
    "format_duration",
    "build_run_page",
    "build_health",
    "build_findings",
    "build_finding",
    "finding_view_href",
    "build_refs",
    "build_section",
    "build_whatif",
    "build_table",
    "table_rows",
    "build_compare_page",
    "build_compare_numbers",
    "build_error",
    "run_href",
    "format_health_value",
    "OVERVIEW",
    "RunQuery",
    "run_tabs",
    "build_overview",
    "build_not_checked",
    "build_tab_body",
    "shown_tab",
    "loading_placeholder",
    "step_count_text",
    "header_details",
]

SEVERITIES = tuple(severity.value for severity in Severity)
CATEGORIES = tuple(CATEGORY_LABELS.items())
# A run page has one tab per registered report section (amprobe.report.sections), in report
# order; these sections' tabs add live parts to the section's own content:
#: the Loss scale tab draws its figure live and adds the scale events (the section's text joins)
SCALE_SECTION = "scale"
#: the precision what-if tab: its heatmap is switched between activations and gradients
WHATIF_SECTION = "whatif"
#: the runtime tab shows the live step-time figure above the section
RUNTIME_SECTION = "runtime"
#: the numerics tab outlines the layer a link names (``?layer=``)
NUMERICS_SECTION = "numerics"
#: the colour of what a link marks (a step, a layer)
_MARK_COLOR = "#6a1b9a"
#: the Ranks tab sets apart the sentences that mark a rank (amprobe.report.rankmarks)
RANKS_SECTION = "ranks"

_SEVERITY_COLORS = {"error": "#c62828", "warning": "#ef6c00", "info": "#1565c0"}
_STATUS_COLORS = {
    "live": "#2e7d32",
    "finished": "#555",
    "failed": "#c62828",
    "interrupted": "#c62828",
    "unreadable": "#c62828",
}
#: table key of the loss-scale events table (section tables use "<section key>/<index>").
LOSS_SCALE_TABLE = "loss-scale/0"
_FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"
TABLE_PAGE_ROWS = 25


def run_href(name: str) -> str:
    return "/run/" + quote(name, safe="/")


def _badge(text: str, color: str) -> html.Span:
    return html.Span(
        text,
        style={
            "background": color,
            "color": "white",
            "borderRadius": "4px",
            "padding": "1px 6px",
            "fontSize": "0.85em",
            "marginRight": "6px",
            "whiteSpace": "nowrap",
        },
    )


def build_frame() -> html.Div:
    """The page frame: URL, navigation and the page container that routing fills."""
    return html.Div(
        [
            dcc.Location(id=ids.URL),
            html.Div(
                [
                    html.Strong("amprobe", style={"marginRight": "18px", "fontSize": "1.2em"}),
                    dcc.Link("Runs", href="/", style={"marginRight": "12px"}),
                    dcc.Link("Compare", href="/compare"),
                ],
                id=ids.NAV,
                style={"padding": "10px 18px", "borderBottom": "1px solid #ddd"},
            ),
            html.Div(
                loading_placeholder("Loading\u2026"), id=ids.PAGE, style={"padding": "12px 18px"}
            ),
        ],
        style={"fontFamily": _FONT, "color": "#222"},
    )


def loading_placeholder(text: str) -> html.P:
    """What shows while a page or a tab is being built (class :data:`ids.LOADING`)."""
    return html.P(text, className=ids.LOADING, style={"color": "#777", "fontStyle": "italic"})


def build_error(message: str) -> html.Div:
    return html.Div([html.H3("Cannot open this page"), html.P(message, className="error")])


def _steps_cell(steps: int | None) -> str:
    return PENDING if steps is None else str(steps)


def _started_cell(started: float | None) -> str:
    if started is None:
        return "not recorded"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started))


def format_duration(seconds: float) -> str:
    """``42.1 s``, ``3 min 05 s``, ``2 h 07 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(round(seconds))
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def _duration_cell(s: RunSummary) -> str:
    if s.duration_s is None:
        if s.duration_open and s.pending:
            return PENDING  # the last step's time comes with the diagnosis
        return "not recorded"
    text = format_duration(s.duration_s)
    if not s.duration_open:
        return text
    return f"{text} so far" if s.status == "live" else f"{text} to the last step"


#: The run list's columns: (column id, heading). ``run`` is a Markdown link to the run's page.
#: Every column sorts (:data:`dashboard.runs.SORT_KEYS`).
RUN_COLUMNS = (
    ("run", "run"),
    ("status", "status"),
    ("started", "started (UTC)"),
    ("duration", "duration"),
    ("steps", "steps"),
    ("device", "device"),
    ("dtype", "autocast dtype"),
    ("worst", "worst finding"),
)
#: column widths at 1440 px: the name and the worst finding take what is left
_RUN_COLUMN_WIDTHS = {
    "status": "125px",
    "started": "200px",
    "duration": "130px",
    "steps": "70px",
    "device": "150px",
    "dtype": "110px",
}


def run_rows(summaries: Sequence[RunSummary]) -> list[dict[str, str]]:
    """The run list's table data: one dict of text cells per run.

    ``run`` is a Markdown link whose text is escaped (:func:`escape_markdown`; the table renders
    Markdown with HTML off) and whose target is percent-encoded; ``name`` holds the plain name.
    An unreadable run's ``worst`` cell says ``unreadable: <why>``.
    """
    rows = []
    for s in summaries:
        rows.append(
            {
                "name": s.name,
                "run": f"[{escape_markdown(s.name)}]({run_href(s.name)})",
                "status": s.status,
                "started": _started_cell(s.started),
                "duration": "" if s.error else _duration_cell(s),
                "device": s.device,
                "dtype": s.dtype,
                "steps": "" if s.error else _steps_cell(s.steps),
                "worst": f"unreadable: {s.error}" if s.error else s.worst,
            }
        )
    return rows


def _run_table_styles() -> list[dict[str, Any]]:
    styles: list[dict[str, Any]] = [
        {
            "if": {"filter_query": f'{{status}} = "{status}"', "column_id": "status"},
            "color": color,
            "fontWeight": "bold",
        }
        for status, color in _STATUS_COLORS.items()
    ]
    styles += [
        {
            "if": {"filter_query": f'{{worst}} contains "{severity} "', "column_id": "worst"},
            "color": color,
        }
        for severity, color in _SEVERITY_COLORS.items()
    ]
    styles.append(
        {
            "if": {"filter_query": '{worst} contains "unreadable: "', "column_id": "worst"},
            "color": _STATUS_COLORS["unreadable"],
        }
    )
    return styles


def build_run_table(listing: RunPage) -> Any:
    """The run list's table: one page of runs, paged and sorted on the server
    (``page_action`` and ``sort_action`` ``"custom"``: :meth:`RunCache.page` does both).

    One DataTable, not a component per cell, so the browser paints a page of runs at once
    (1,000 runs: 1.0-1.8 s to the first rows in headless Chromium on a loaded 2-core machine,
    against 2.3 s for an html table of the same page).
    """
    with warnings.catch_warnings():
        # Dash 4 says DataTable will leave the builtin components in a future major version
        # (dash-ag-grid replaces it); it is the one builtin table with server-side paging.
        warnings.simplefilter("ignore", DeprecationWarning)
        return _run_data_table(listing)


def _run_data_table(listing: RunPage) -> Any:
    return dash_table.DataTable(  # type: ignore[attr-defined]  # generated, untyped component
        id=ids.RUN_LIST_TABLE,
        columns=[
            {"id": key, "name": name, **({"presentation": "markdown"} if key == "run" else {})}
            for key, name in RUN_COLUMNS
        ],
        data=run_rows(listing.rows),
        page_action="custom",
        page_current=listing.page - 1,
        page_size=PAGE_ROWS,
        page_count=listing.pages,
        sort_action="custom",
        sort_mode="single",
        sort_by=[],
        markdown_options={"link_target": "_self", "html": False},
        style_as_list_view=True,
        style_table={"overflowX": "auto"},
        style_cell={
            "textAlign": "left",
            "padding": "4px 10px",
            "fontFamily": _FONT,
            "whiteSpace": "normal",
            "height": "auto",
            "maxWidth": "520px",
        },
        style_cell_conditional=[
            {"if": {"column_id": key}, "width": width, "minWidth": width, "maxWidth": width}
            for key, width in _RUN_COLUMN_WIDTHS.items()
        ]
        + [{"if": {"column_id": "run"}, "minWidth": "180px", "maxWidth": "320px"}],
        style_header={"fontWeight": "bold", "backgroundColor": "white"},
        style_data_conditional=_run_table_styles(),
        css=[{"selector": "p", "rule": "margin: 0"}],
    )


def pages_text(listing: RunPage) -> str:
    """The run list's count line; while a sort waits for diagnoses, how many runs it lacks."""
    if not listing.total:
        return "No amprobe run directory under this root yet."
    waiting = (
        f"; {listing.undiagnosed} run(s) not yet diagnosed, sorted last until they are"
        if listing.undiagnosed
        else ""
    )
    if listing.matched is not None and listing.search:
        if not listing.matched:
            return f"No run name holds {listing.search!r} ({listing.total} runs)."
        return (
            f"{listing.matched} of {listing.total} runs match {listing.search!r}, "
            f"{PAGE_ROWS} a page{waiting}"
        )
    return f"{listing.total} runs, {PAGE_ROWS} a page{waiting}"


def build_run_list(listing: RunPage, refresh_ms: int) -> html.Div:
    """The home page: a name search, then one page of the runs under ROOT (sorted by the
    column headings' arrows), refreshed while runs are being written."""
    return html.Div(
        [
            html.H2("Runs"),
            html.Div(
                [
                    dcc.Input(
                        id=ids.RUN_LIST_SEARCH,
                        type="search",
                        placeholder="search run names",
                        debounce=0.4,
                        style={"width": "320px", "marginRight": "14px"},
                    ),
                    html.Span(pages_text(listing), id=ids.RUN_LIST_PAGES, style={"color": "#777"}),
                ],
                style={"margin": "6px 0 10px"},
            ),
            build_run_table(listing),
            dcc.Interval(id=ids.RUN_LIST_INTERVAL, interval=max(refresh_ms, 1000) * 2),
        ],
        id=ids.RUN_LIST,
    )


def format_health_value(metric: Mapping[str, Any]) -> str:
    """A health metric's value with its unit, or the note that says why it is missing."""
    value = metric.get("value")
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return str(metric.get("note") or "not measured")
    unit = metric.get("unit", "")
    if unit == "%":
        return percent_text(float(value))
    if unit == "x":
        return f"{float(value):.2f}x"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def build_health(health: Mapping[str, Mapping[str, Any]]) -> html.Div:
    """The health metrics (checklist section C) as a two-column table."""
    rows = [
        html.Tr(
            [
                html.Td(str(m.get("label", key)), style={"padding": "3px 12px 3px 0"}),
                html.Td(
                    format_health_value(m),
                    id=f"{ids.HEALTH}-{key}",
                    style={"color": "#777" if m.get("value") is None else "#111"},
                ),
            ]
        )
        for key, m in health.items()
    ]
    return html.Div([html.H3("Health"), html.Table(html.Tbody(rows))], id=ids.HEALTH)


def _evidence_text(blocks: Sequence[Block]) -> list[Any]:
    """Evidence blocks (:func:`amprobe.report.evidence.render_evidence`, shared with the HTML
    report) as components: a sentence, labelled values, small tables. All of it plain text."""
    out: list[Any] = []
    for block in blocks:
        if isinstance(block, Text):
            out.append(html.P(block.text, className="evidence-text", style={"margin": "4px 0"}))
        elif isinstance(block, Facts):
            out.append(
                html.Ul(
                    [
                        html.Li([html.Span(f"{k}: ", style={"color": "#555"}), v])
                        for k, v in block.items
                    ],
                    className="evidence-facts",
                    style={"margin": "4px 0"},
                )
            )
        elif isinstance(block, Table):
            cell = {"padding": "1px 8px", "borderBottom": "1px solid #eee", "textAlign": "left"}
            out.append(
                html.Table(
                    [
                        html.Caption(block.caption, style={"textAlign": "left", "color": "#555"}),
                        html.Thead(html.Tr([html.Th(c, style=cell) for c in block.columns])),
                        html.Tbody(
                            [html.Tr([html.Td(c, style=cell) for c in row]) for row in block.rows]
                        ),
                    ],
                    className="evidence-table",
                    style={"borderCollapse": "collapse", "fontSize": "0.9em", "margin": "4px 0"},
                )
            )
            if block.note:
                out.append(html.Small(block.note, style={"color": "#777"}))
    return out


def build_refs(refs: Sequence[str]) -> html.Small:
    """A finding's refs: its checklist item, then links to the documentation."""
    parts: list[Any] = ["see: "]
    for i, ref in enumerate(refs):
        label, url = split_ref(ref)
        if i:
            parts.append(" · ")
        parts.append(label if url is None else html.A(label, href=url, target="_blank"))
    return html.Small(parts, style={"color": "#666"})


def _finding_links(ids_: Sequence[str]) -> list[Any]:
    """Links to other findings of the page (``#finding-AMP-N05``), comma-separated."""
    parts: list[Any] = []
    for i, rid in enumerate(ids_):
        if i:
            parts.append(", ")
        parts.append(html.A(rid, href=f"#{ids.FINDING_PREFIX}{rid}", className="finding-ref"))
    return parts


def finding_view_href(run_name: str | None, tab: str, key: str, value: Any) -> str:
    """``/run/<name>?tab=<tab>&<key>=<value>`` (the name and value url-quoted); relative to the
    current run page (``?tab=...``) when the run's name is not known."""
    query = f"?tab={quote(tab, safe='')}&{key}={quote(str(value), safe='')}"
    return (run_href(run_name) if run_name else "") + query


def _where(finding: Any, run_name: str | None) -> html.Small | None:
    """Links to the finding's first step on the loss-scale chart, its layer's numerics and the
    ranks it marks on the Ranks tab."""
    links: list[Any] = []
    step = finding_step(finding)
    if step is not None:
        links.append(
            dcc.Link(
                f"step {step} on the loss-scale chart",
                href=finding_view_href(run_name, SCALE_SECTION, "step", step),
                className="finding-step-link",
            )
        )
    layer = finding_layer(finding)
    if layer is not None:
        if links:
            links.append(" · ")
        links.append(
            dcc.Link(
                f"layer {layer} in the numerics view",
                href=finding_view_href(run_name, NUMERICS_SECTION, "layer", layer),
                className="finding-layer-link",
            )
        )
    marked = finding_marked_ranks(finding)
    if marked:
        if links:
            links.append(" · ")
        links.append(
            dcc.Link(
                f"{'rank' if len(marked) == 1 else 'ranks'} {format_ranks(marked)} on the Ranks tab",
                href=(run_href(run_name) if run_name else "") + f"?tab={RANKS_SECTION}",
                className="finding-rank-link",
            )
        )
    return html.Small(["look at: ", *links], style={"color": "#666"}) if links else None


def _fix_children(fix: str) -> list[Any]:
    """The fix as paragraphs of text and its fenced code blocks as preformatted code."""
    out: list[Any] = []
    for i, (part, code) in enumerate(fix_parts(fix)):
        if code:
            out.append(html.Pre(html.Code(part), className="fix-code"))
        else:
            out.append(html.P(["Fix: " if i == 0 else "", part], style={"margin": "4px 0"}))
    return out or [html.P("Fix: ", style={"margin": "4px 0"})]


def build_finding(
    index: int, finding: Any, anchor: str | None = None, run_name: str | None = None
) -> html.Div:
    """One finding: ID, severity, category, title, its causes, evidence, fix and references.

    Args:
        index: its place in the list (the anchor's fallback).
        anchor: its element ID, ``finding-AMP-N05`` (the target of cross-references).
        run_name: the run's name, for the links to its step and layer views.
    """
    color = _SEVERITY_COLORS.get(finding.severity, "#555")
    cause: list[Any] = []
    if finding.explained_by:
        cause.append(
            html.Div(
                ["Explained by ", *_finding_links(finding.explained_by), "."],
                className="finding-cause",
                style={"margin": "2px 0"},
            )
        )
    if finding.explains:
        cause.append(
            html.Div(
                ["Explains ", *_finding_links(finding.explains), "."],
                className="finding-explains",
                style={"margin": "2px 0", "color": "#666"},
            )
        )
    return html.Div(
        [
            html.Div(
                [
                    html.Code(
                        finding.id,
                        className="finding-id",
                        style={"fontWeight": "bold", "marginRight": "8px"},
                    ),
                    _badge(finding.severity, color),
                    _badge(finding.category_label, "#777"),
                    html.Span(finding.title),
                ]
            ),
            *cause,
            html.Div(_evidence_text(render_evidence(finding)), className="evidence"),
            *_fix_children(finding.fix),
            _where(finding, run_name),
            html.Br() if finding.refs else None,
            build_refs(finding.refs) if finding.refs else None,
        ],
        id=anchor or f"{ids.FINDING_PREFIX}{index}",
        className=f"finding severity-{finding.severity}",
        style={"borderLeft": f"4px solid {color}", "padding": "4px 10px", "margin": "8px 0"},
    )


def build_findings(
    findings: Iterable[Any],
    severities: Iterable[str] | None = None,
    categories: Iterable[str] | None = None,
    run_name: str | None = None,
) -> list[Any]:
    """Findings (already cause first) kept by the severity and category filters.

    Each finding's element ID is ``finding-<ID>`` (``finding-<ID>-2`` for a second one), so a
    cross-reference (``#finding-AMP-N05``) lands on it.
    """
    sev = set(SEVERITIES if severities is None else severities)
    cat = None if categories is None else set(categories)
    kept = [f for f in findings if f.severity in sev and (cat is None or f.category in cat)]
    if not kept:
        return [html.P("No finding matches these filters.", id=ids.FINDINGS_COUNT)]
    anchors = finding_anchors(kept, prefix=ids.FINDING_PREFIX)
    return [html.P(f"{len(kept)} finding(s)", id=ids.FINDINGS_COUNT)] + [
        build_finding(i, f, anchor, run_name)
        for i, (f, anchor) in enumerate(zip(kept, anchors, strict=True))
    ]


def _missing_text(missing: str) -> str:
    return (
        missing if missing.lower().startswith(("not ", "could not")) else f"not recorded: {missing}"
    )


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def table_rows(frame: pd.DataFrame, page: int = 1) -> list[Any]:
    """One page of a frame as table head and body (cells are text, escaped).

    Every Dash component costs the browser time to render, so long frames are shown a page
    of :data:`TABLE_PAGE_ROWS` at a time; the frame itself is kept whole.
    """
    pages = max(1, -(-len(frame) // TABLE_PAGE_ROWS))
    page = min(max(int(page or 1), 1), pages)
    shown = frame.iloc[(page - 1) * TABLE_PAGE_ROWS : page * TABLE_PAGE_ROWS]
    cell = {"padding": "2px 8px", "borderBottom": "1px solid #eee", "textAlign": "left"}
    head = html.Tr([html.Th(str(c), style=cell) for c in frame.columns])
    body = [
        html.Tr([html.Td(_cell(v), style=cell) for v in row])
        for row in shown.itertuples(index=False, name=None)
    ]
    return [html.Thead(head), html.Tbody(body)]


def build_table(caption: str, frame: pd.DataFrame, table_key: str) -> html.Div:
    """A captioned table, paged when long; ``table_key`` lets the page callback find the frame."""
    pages = max(1, -(-len(frame) // TABLE_PAGE_ROWS))
    pager = None
    if pages > 1:
        pager = html.Div(
            [
                "page ",
                dcc.Input(
                    id={"type": ids.TABLE_PAGE, "key": table_key},
                    type="number",
                    min=1,
                    max=pages,
                    step=1,
                    value=1,
                    debounce=True,
                    style={"width": "70px"},
                ),
                f" of {pages} ({len(frame)} rows)",
            ],
            style={"margin": "4px 0"},
        )
    return html.Div(
        [
            html.H4(caption),
            pager,
            html.Table(
                table_rows(frame),
                id={"type": ids.TABLE_BODY, "key": table_key},
                style={"borderCollapse": "collapse"},
            ),
        ],
        className="section-table",
    )


def _layer_note(layer: str, figures: Sequence[Any], recorded: bool | None) -> str:
    """Outline ``layer`` on ``figures`` (in place) and say where it is drawn, and where not."""
    shown = [_highlight_layer(fig, layer) for fig in figures]
    heatmaps = sum(h for h, _ in shown)
    histograms = [b for fig, (_, b) in zip(figures, shown, strict=True) if _has_bars(fig)]
    if not heatmaps and not any(histograms):
        if recorded is False:
            return (
                f"Layer {layer} is not drawn on this tab's charts: this run's numerics hold "
                "no row of it."
            )
        return f"Layer {layer} is not drawn on this tab's charts." + (
            " It is recorded in this run's numerics." if recorded else ""
        )
    where = [f"outlined on {heatmaps} heatmap(s)"] if heatmaps else []
    if any(histograms):
        where.append("its bars are the bright ones on the exponent histogram")
    text = f"Layer {layer}: " + "; ".join(where) + " below."
    if histograms and not any(histograms):
        text += " The exponent histogram draws only the worst layers, and this is not one of them."
    return text


def _has_bars(fig: Any) -> bool:
    return any(t.type == "bar" for t in fig.data)


def build_section(
    section: Any,
    key: str | None = None,
    layer: str | None = None,
    recorded: bool | None = None,
    marked: Sequence[str] = (),
) -> html.Div:
    """A report section: its text, figures (thinned for display), tables, or why it is missing.

    With ``layer`` (a module name, from the page's ``?layer=``), that layer's rows are outlined
    on the section's heatmaps and its bars kept opaque, and a line says where it is drawn;
    ``recorded`` says whether the run's numerics hold the layer (None: not known). The
    sentences of ``marked`` (a finding's marks of ranks) are set apart as a finding is.
    """
    key = key or section.key
    children: list[Any] = [html.H3(section.title)]
    if section.missing:
        children.append(
            html.P(_missing_text(section.missing), className="missing", style={"color": "#777"})
        )
    children.extend(
        html.P(
            t,
            className="rank-mark",
            style={
                "borderLeft": f"6px solid {_SEVERITY_COLORS['error']}",
                "paddingLeft": "8px",
                "background": "#fafafa",
            },
        )
        if t in marked
        else html.P(t)
        for t in section.text
    )
    figures = [thin_figure(copy.deepcopy(fig)) for fig in section.figures]
    if layer:
        children.insert(
            1,
            html.P(
                _layer_note(layer, figures, recorded),
                id=ids.LAYER_NOTE,
                style={"color": _MARK_COLOR},
            ),
        )
    for i, shown in enumerate(figures):
        children.append(dcc.Graph(figure=shown, id=f"{ids.SECTION_PREFIX}{key}-fig{i}"))
    for i, (caption, frame) in enumerate(section.tables):
        children.append(build_table(caption, frame, f"{key}/{i}"))
    return html.Div(children, id=f"{ids.SECTION_PREFIX}{key}", className="section")


#: a numerics row label's rank prefix in a run of several ranks: ``"r1 · module · kind"``, or
#: the ranks that share the row in a run of many (``"r0–3 · ..."``, ``"r0…9 (8 ranks) · ..."``:
#: :func:`amprobe.analysis.rankbands.rank_range_text`)
_RANK_PREFIX = re.compile(r"r[0-9]+(?:[\u2013\u2026][0-9]+(?: \([0-9]+ ranks\))?)? \u00b7 ")


def _is_layer(label: Any, target: str, ranked: bool) -> bool:
    """Whether a numerics row label (``"module · kind"``, ``"rN · module · kind"`` when
    ``ranked``) or a histogram bar's name (``"module · kind"``) is of module ``target``.

    The kind is the last part (a module name may itself hold " · "), the rank the first.
    """
    module = str(label).rpartition(" \u00b7 ")[0]
    if ranked:
        prefix = _RANK_PREFIX.match(module)
        module = module[prefix.end() :] if prefix else module
    return module == target


def _highlight_layer(fig: Any, layer: str) -> tuple[int, int]:
    """Outline ``layer``'s rows on ``fig``'s heatmaps and dim other layers' bars, in place.

    Returns how many heatmaps and how many histogram bars show it.
    """
    target = escape_plotly_text(layer)  # the figures' labels are escaped (escape_figure_text)
    heatmap = bars = 0
    for trace in fig.data:
        if trace.type == "heatmap" and trace.y is not None:
            labels = [str(y) for y in trace.y]
            # a run of several ranks labels every row "rN · ..." (amprobe.report.numerics._label)
            ranked = bool(labels) and all(_RANK_PREFIX.match(y) for y in labels)
            outlined = False
            for i, label in enumerate(labels):
                if _is_layer(label, target, ranked):
                    outlined = True
                    fig.add_shape(
                        type="rect",
                        xref=f"{trace.xaxis or 'x'} domain",
                        x0=0,
                        x1=1,
                        yref=trace.yaxis or "y",
                        y0=i - 0.5,
                        y1=i + 0.5,
                        line={"color": _MARK_COLOR, "width": 3},
                    )
            heatmap += outlined
        elif trace.type == "bar" and trace.name is not None:
            if _is_layer(trace.name, target, ranked=False):
                bars += 1
                trace.opacity = 0.9
            else:
                trace.opacity = 0.2
    return heatmap, bars


def build_whatif(section: Any, figure: Any, group: str, groups: Sequence[str]) -> html.Div:
    """The precision what-if tab: a group switch, the heatmap, the layer x block-format matrix
    (when the run has block statistics), then the section's text and table.

    Args:
        section: the report's ``whatif`` section (its figures are replaced by ``figure``).
        figure: the heatmap of ``group`` (from ``amprobe.report.whatif.make_exponent_heatmap``).
        group: the heatmap group shown first.
        groups: the groups the switch offers.
    """
    if section.missing:
        return html.Div(build_section(section, WHATIF_SECTION), id=ids.WHATIF_PANEL)
    rest = dataclasses.replace(section, figures=())
    block, _ = split_block_fit(section.figures)
    matrix = [] if block is None else [dcc.Graph(figure=block, id=ids.BLOCK_FIT_MATRIX)]
    return html.Div(
        [
            dcc.RadioItems(
                id=ids.WHATIF_GROUP,
                options=list(groups),
                value=group,
                inline=True,
                inputStyle={"marginRight": "4px", "marginLeft": "10px"},
            ),
            dcc.Graph(figure=figure, id=ids.WHATIF_HEATMAP),
            *matrix,
            build_section(rest, WHATIF_SECTION),
        ],
        id=ids.WHATIF_PANEL,
    )


def _whatif_tab(run: Any, section: Any, label: str) -> html.Div:
    if section is None:
        return _absent_section(WHATIF_SECTION, label)
    if section.missing:
        return build_whatif(section, None, "", ())

    groups = whatif_groups(run)
    group = groups[0] if groups else "activations"
    return build_whatif(section, make_whatif_figure(run, compute_whatif(run), group), group, groups)


def _absent_section(key: str, title: str) -> html.Div:
    return html.Div(
        [
            html.H3(title),
            html.P(
                f"not recorded: the '{key}' report section has nothing for this run",
                className="missing",
                style={"color": "#777"},
            ),
        ],
        id=f"{ids.SECTION_PREFIX}{key}",
        className="section",
    )


def step_count_text(
    steps: int, last: int | None, findings_step: int | None = None, live: bool = False
) -> str:
    """``"120 steps (last step 119)"`` (``steps`` distinct steps, the highest ``last``); while
    ``live``, what the findings shown were made from: ``"; findings as of step 100"``
    (``findings_step``, the diagnosed run's last step)."""
    text = f"{steps} steps" + (f" (last step {last})" if last is not None else "")
    if live:
        text += (
            "; no finding yet: no step diagnosed"
            if findings_step is None
            else f"; findings as of step {findings_step}"
        )
    return text


def build_status(status: str) -> html.Span:
    return _badge(status, _STATUS_COLORS.get(status, "#555"))


def _mark_step(fig: Any, steps: pd.DataFrame, step: int) -> str:
    """Mark ``step`` on the loss-scale figure, in place, zoomed around it; says what was done."""
    recorded = pd.to_numeric(steps["step"], errors="coerce").dropna() if len(steps) else None
    if recorded is None or recorded.empty:
        return f"Step {step} cannot be marked: no step was recorded."
    first, last = int(recorded.min()), int(recorded.max())
    if not first <= step <= last:
        return f"Step {step} was not recorded (the recorded steps are {first}\u2013{last})."
    line = {"color": _MARK_COLOR, "width": 2, "dash": "dot"}
    if getattr(fig, "_grid_ref", None) is not None:  # the loss scale over the loss
        fig.add_vline(x=step, line=line, row="all", col=1)
    else:
        fig.add_vline(x=step, line=line)
    fig.add_annotation(
        x=step,
        y=1,
        xref="x",
        yref="paper",
        text=f"step {step}",
        showarrow=False,
        xanchor="left",
        yanchor="bottom",
        font={"color": _MARK_COLOR},
    )
    half = max(10, (last - first) // 20)
    lo, hi = max(first, step - half), min(last, step + half)
    fig.update_xaxes(range=[lo - 0.5, hi + 0.5])
    return (
        f"Step {step} is marked on the chart, zoomed to steps {lo}\u2013{hi} "
        "(double-click the chart to see every step)."
    )


def _events_text(events: pd.DataFrame) -> str:
    """How many growths and backoffs, per rank (as the ``scale`` section counts them): each rank
    updates its own scaler, so a 2-rank run's events are not added up."""
    if not len(events):
        return "no change of the loss scale recorded"

    def counted(part: pd.DataFrame) -> tuple[int, int]:
        return int((part["event"] == "growth").sum()), int((part["event"] == "backoff").sum())

    ranks = {int(r): counted(part) for r, part in events.groupby("rank", sort=True)}
    if len(ranks) == 1:
        ((_, (grows, cuts)),) = ranks.items()
        return f"{grows} growth, {cuts} backoff event(s)"
    if len(set(ranks.values())) == 1:
        grows, cuts = next(iter(ranks.values()))
        return (
            f"{grows} growth, {cuts} backoff event(s) on each of {len(ranks)} ranks "
            "(the table lists each rank's)"
        )
    if many_ranks(list(ranks)):
        return rank_groups_text(ranks, lambda gc: f"{gc[0]} growth, {gc[1]} backoff event(s)")
    return "; ".join(f"rank {r}: {g} growth, {c} backoff event(s)" for r, (g, c) in ranks.items())


def scale_change_rows(steps: pd.DataFrame | StepsRelation) -> pd.DataFrame:
    """The loss scale's growths and backoffs (:func:`scale_events`); of a run of many ranks
    from the few rows of its derived store that hold them."""
    return scale_events(event_rows(steps) if isinstance(steps, StepsRelation) else steps)


def build_loss_scale(
    steps: pd.DataFrame | StepsRelation,
    section: Any = None,
    step: int | None = None,
    replays: Sequence[ReplayMark] = (),
) -> html.Div:
    """The loss-scale tab: the figure, the report's ``scale`` section text, the events.

    With ``step`` (the page's ``?step=``), that step is marked and the chart zoomed to it.
    ``steps``: the run's frame, or a run of many ranks' relation (:func:`steps_of`).
    ``replays``: the bad steps amprobe replayed (:func:`replay_marks` of the diagnosis),
    marked on the chart; the section's tables (the replay's experiments) follow the chart.
    """
    events = scale_change_rows(steps)
    notes: list[Any] = []
    if section is not None:
        if section.missing:
            notes.append(
                html.P(_missing_text(section.missing), className="missing", style={"color": "#777"})
            )
        notes.extend(html.P(t) for t in section.text)
    summary = _events_text(events)
    figure = make_loss_scale_figure(steps, replays=replays)
    if step is not None:
        notes.append(
            html.P(
                _mark_step(figure, step_ends(steps), step),
                id=ids.STEP_NOTE,
                style={"color": _MARK_COLOR},
            )
        )
    return html.Div(
        [
            *notes,
            dcc.Graph(figure=figure, id=ids.LOSS_SCALE_GRAPH),
            *(
                build_table(caption, frame, f"{SCALE_SECTION}/{i}")
                for i, (caption, frame) in enumerate(section.tables if section is not None else ())
            ),
            html.H4("Growth and backoff events"),
            html.P(summary),
            html.Div(
                build_table("scale changes", events, LOSS_SCALE_TABLE) if len(events) else None,
                id=ids.LOSS_SCALE_EVENTS,
            ),
        ]
    )


def build_section_tab(
    loaded: LoadedRun, key: str, label: str, query: RunQuery | None = None
) -> Any:
    """The body of report section ``key``'s tab (a section that has nothing for this run says
    so), with the live parts of the loss-scale, what-if and runtime tabs; ``query`` gives the
    step to mark on the loss-scale tab and the layer to outline on the numerics tab."""
    run = loaded.run
    query = query or RunQuery()
    section = loaded.section(key)
    if key == SCALE_SECTION:
        return build_loss_scale(
            steps_of(run), section, query.step, replays=replay_marks(loaded.diagnosis)
        )
    if key == WHATIF_SECTION:
        return _whatif_tab(run, section, label)
    layer = query.layer if key == NUMERICS_SECTION else None
    recorded = None
    if layer:
        recorded = layer_recorded(run, layer)
    marked: tuple[str, ...] = ()
    if key == RANKS_SECTION:
        marked = compute_rank_marks(loaded.diagnosis, run).lines
    body = (
        build_section(section, key, layer, recorded, marked)
        if section is not None
        else _absent_section(key, label)
    )
    if key != RUNTIME_SECTION:
        return body
    live = html.Div(
        [
            html.H3("Step time and the probe's own time"),
            dcc.Graph(figure=make_step_time_figure(steps_of(run)), id=ids.STEP_TIME_GRAPH),
        ]
    )
    return html.Div([live, body])


# -- the run page's state in its URL ------------------------------------------------------------

#: the first tab of a run page: health, findings, checks not run
OVERVIEW = "overview"


def run_tabs() -> list[tuple[str, str]]:
    """``(key, label)`` of a run page's tabs: the overview, then one per report section."""
    return [(OVERVIEW, "Overview"), *section_tabs()]


#: a ``?step=``: ASCII digits only (``str.isdigit`` also takes "²"), short enough for an int64
_STEP_RE = re.compile(r"[0-9]{1,18}")


@dataclasses.dataclass(frozen=True)
class RunQuery:
    """What a run page's URL asks for: ``?tab=&sev=&cat=&step=&layer=``.

    ``severities``/``categories`` are None when the URL leaves them out (all kept); ``step``
    is marked on the loss-scale tab, ``layer`` outlined on the numerics tab.
    """

    tab: str = OVERVIEW
    severities: tuple[str, ...] | None = None
    categories: tuple[str, ...] | None = None
    step: int | None = None
    layer: str | None = None

    @classmethod
    def parse(cls, search: str | None) -> RunQuery:
        """Read a URL's query string; unknown tabs, severities and categories are dropped."""
        query = parse_qs((search or "").lstrip("?"), keep_blank_values=True)

        def first(key: str) -> str | None:
            values = query.get(key)
            return values[0] if values else None

        def kept(key: str, known: Iterable[str]) -> tuple[str, ...] | None:
            value = first(key)
            if value is None:
                return None
            allowed = set(known)
            return tuple(v for v in value.split(",") if v in allowed)

        tab = first("tab") or OVERVIEW
        if tab not in dict(run_tabs()):
            tab = OVERVIEW
        step_text = first("step") or ""
        step = int(step_text) if _STEP_RE.fullmatch(step_text) else None
        return cls(
            tab=tab,
            severities=kept("sev", SEVERITIES),
            categories=kept("cat", (v for v, _ in CATEGORIES)),
            step=step,
            layer=first("layer") or None,
        )

    def search(self) -> str:
        """The query string (``""`` or ``"?..."``) that :meth:`parse` reads back as this query.

        Defaults are left out: the overview tab, every severity, every category.
        """
        params: list[tuple[str, str]] = []
        if self.tab != OVERVIEW:
            params.append(("tab", self.tab))
        if self.severities is not None and set(self.severities) != set(SEVERITIES):
            params.append(("sev", ",".join(self.severities)))
        all_categories = {v for v, _ in CATEGORIES}
        if self.categories is not None and set(self.categories) != all_categories:
            params.append(("cat", ",".join(self.categories)))
        if self.step is not None:
            params.append(("step", str(self.step)))
        if self.layer:
            params.append(("layer", self.layer))
        return "?" + urlencode(params, safe=",") if params else ""

    def on_tab(self, tab: str) -> RunQuery:
        """This query on tab ``tab``: the filters kept, the step and layer only on their tabs."""
        return dataclasses.replace(
            self,
            tab=tab,
            step=self.step if tab == SCALE_SECTION else None,
            layer=self.layer if tab == NUMERICS_SECTION else None,
        )

    @property
    def shown_severities(self) -> list[str]:
        return list(SEVERITIES if self.severities is None else self.severities)

    @property
    def shown_categories(self) -> list[str]:
        return [v for v, _ in CATEGORIES] if self.categories is None else list(self.categories)

    def focus(self) -> dict[str, Any]:
        """What of this query changes the body of its tab (beyond the run version)."""
        if self.tab == SCALE_SECTION:
            return {"step": self.step}
        if self.tab == NUMERICS_SECTION:
            return {"layer": self.layer}
        return {}


# -- the run page ---------------------------------------------------------------------------------


def build_not_checked(not_checked: Sequence[Any]) -> html.Details:
    """The checks that did not run, each with why: open, above the findings (not checked is not
    healthy, so a short list of findings must not read as a clean bill)."""
    return html.Details(
        [
            html.Summary(
                f"{len(not_checked)} check(s) not run, so their findings cannot appear below"
                if not_checked
                else "every check ran"
            ),
            html.Ul([html.Li([html.Code(n.id), f" {n.name}: {n.reason}"]) for n in not_checked]),
        ],
        id=ids.NOT_CHECKED,
        open=bool(not_checked),
        style={"background": "#f6f6f6", "padding": "4px 10px", "fontSize": "0.9em"},
    )


def _findings_as_of(loaded: LoadedRun) -> html.P | None:
    """While a run is live: the step its findings were made from (they are made again as it
    grows, not at every new step)."""
    run = loaded.run
    if run.status != "live":
        return None
    last = run_facts(loaded.diagnosis)["last_step"]  # from the ranks' summaries, never steps
    return html.P(
        "No step diagnosed yet."
        if last is None
        else f"Findings as of step {last}: the run is live, and they are made again as it grows "
        "(the step count above follows every step).",
        id=ids.FINDINGS_AS_OF,
        style={"color": "#777", "margin": "2px 0"},
    )


def build_overview(loaded: LoadedRun, query: RunQuery | None = None) -> html.Div:
    """The overview tab: health, the findings (filtered as ``query`` says), checks not run."""
    query = query or RunQuery()
    diagnosis = loaded.diagnosis
    severities, categories = query.shown_severities, query.shown_categories
    return html.Div(
        [
            build_health(diagnosis.health),
            build_not_checked(diagnosis.not_checked),
            html.H3("Findings"),
            _findings_as_of(loaded),
            html.Div(
                [
                    dcc.Checklist(
                        id=ids.SEVERITY_FILTER,
                        options=list(SEVERITIES),
                        value=severities,
                        inline=True,
                        inputStyle={"marginRight": "4px", "marginLeft": "10px"},
                    ),
                    dcc.Checklist(
                        id=ids.CATEGORY_FILTER,
                        options=[{"label": lbl, "value": v} for v, lbl in CATEGORIES],
                        value=categories,
                        inline=True,
                        inputStyle={"marginRight": "4px", "marginLeft": "10px"},
                    ),
                ]
            ),
            html.Div(build_findings(diagnosis.findings, severities, categories), id=ids.FINDINGS),
        ],
        id=ids.OVERVIEW_PANEL,
    )


def build_tab_body(loaded: LoadedRun, query: RunQuery) -> Any:
    """The body of tab ``query.tab`` of a run, built once per run version and query."""
    if query.tab == OVERVIEW:
        filters = (query.shown_severities, query.shown_categories)
        key: tuple[Any, ...] = (OVERVIEW, tuple(map(tuple, filters)))
        return loaded.part(key, lambda: build_overview(loaded, query))
    label = dict(run_tabs()).get(query.tab, query.tab)
    focus = tuple(sorted(query.focus().items()))
    # a tab reads the run: each rank's summary first, once (the page may be reading them)
    return loaded.part(
        ("tab", query.tab, focus),
        lambda: build_section_tab(loaded.prepared(), query.tab, label, query),
    )


def shown_tab(loaded: LoadedRun, query: RunQuery) -> dict[str, Any]:
    """What a run page's tab body shows: the tab, the run version, the tab's focus."""
    return {"tab": query.tab, "version": loaded.version, **query.focus()}


def header_details(loaded: LoadedRun) -> tuple[str, list[Any]]:
    """A run page header's device text and warnings (drawn again when a live run's version
    changes: :func:`dashboard.callbacks.refresh_header`)."""
    run = loaded.run
    device = run.rank_manifest.get("gpu_name") or run.rank_manifest.get("device") or "not recorded"
    return f"device: {device}", [html.Li(w) for w in run.warnings]


def _build_header(loaded: LoadedRun) -> list[Any]:
    run = loaded.run
    facts = run_facts(loaded.diagnosis)  # kept with a cached diagnosis: no summary read
    device, warnings = header_details(loaded)
    return [
        html.H2(loaded.name, id=ids.RUN_TITLE),
        html.Div(
            [
                html.Span(build_status(run.status), id=ids.RUN_STATUS),
                html.Span(
                    step_count_text(
                        facts["steps"],
                        facts["last_step"],
                        facts["last_step"],
                        run.status == "live",
                    ),
                    id=ids.RUN_STEPS,
                    style={"marginRight": "14px"},
                ),
                html.Span(device, id=ids.RUN_DEVICE, style={"marginRight": "14px"}),
                html.Button("Download HTML report", id=ids.EXPORT_BUTTON),
                html.Span(id=ids.EXPORT_STATUS, style={"marginLeft": "8px", "color": "#777"}),
                dcc.Download(id=ids.EXPORT_DOWNLOAD),
            ]
        ),
        html.Ul(warnings, id=ids.RUN_WARNINGS, style={"color": "#a15c00"}),
    ]


def build_run_page(loaded: LoadedRun, refresh_ms: int, query: RunQuery | None = None) -> html.Div:
    """One run: its header, then its tabs, the overview (health and findings) first.

    Only the tab that ``query`` opens is built, and only when it is the overview (ready as
    soon as the run is diagnosed); any other tab shows a placeholder that the tab callback
    (:func:`dashboard.callbacks.render_tab`) replaces. Built pieces are kept per run version
    (:meth:`LoadedRun.part`), so a second visit builds nothing again.
    """
    query = query or RunQuery()
    header = loaded.part("header", lambda: _build_header(loaded))
    if query.tab == OVERVIEW:
        body, shown = build_tab_body(loaded, query), shown_tab(loaded, query)
    else:
        label = dict(run_tabs()).get(query.tab, query.tab)
        body, shown = loading_placeholder(f"Loading the {label} tab\u2026"), None
    live = loaded.run.status == "live"
    return html.Div(
        [
            # the page's own location (refresh=False: written, it only pushes the history), so
            # that the tab and filters follow the URL only while a run page is open
            dcc.Location(id=ids.RUN_URL, refresh=False),
            dcc.Store(id=ids.RUN_NAME, data=loaded.name),
            dcc.Store(id=ids.RUN_VERSION, data=loaded.version),
            dcc.Store(id=ids.RUN_TAB_SHOWN, data=shown),
            dcc.Store(id=ids.RUN_FOCUS, data=query.focus()),
            *header,
            dcc.Interval(id=ids.LIVE_INTERVAL, interval=refresh_ms, disabled=not live),
            dcc.Tabs(
                id=ids.RUN_TABS,
                value=query.tab,
                children=[dcc.Tab(label=label, value=key) for key, label in run_tabs()],
            ),
            dcc.Loading(
                html.Div(body, id=ids.RUN_TAB_BODY, style={"paddingTop": "6px"}),
                type="circle",
                # a live page's quick redraw does not flash a spinner; a slower one, or a tab
                # being built, dims what is shown under the spinner
                delay_show=300,
                overlay_style={"visibility": "visible", "opacity": 0.35},
            ),
            # loads plotly.js once the findings are drawn, so that a chart tab opens drawn
            dcc.Graph(id=ids.PLOTLY_PRELOAD, style={"display": "none"}),
        ]
    )


#: the compare page's note while fewer than two runs are chosen
COMPARE_CHOOSE = "choose two runs"
#: the compare graph's style while it is hidden (fewer than two runs chosen, or one unreadable)
HIDDEN = {"display": "none"}


def build_compare_page(names: Sequence[str], a: str | None, b: str | None) -> html.Div:
    """Two runs side by side: the numbers of ``amprobe compare`` on them, then their curves
    overlaid. The choices are the runs under ROOT; they are kept in the URL
    (``/compare?a=..&b=..``) without reloading the page."""
    options = [{"label": n, "value": n} for n in names]
    chosen = a in names and b in names
    return html.Div(
        [
            dcc.Location(id=ids.COMPARE_URL, refresh=False),
            html.H2("Compare two runs"),
            html.Div(
                [
                    dcc.Dropdown(
                        id=ids.COMPARE_A,
                        options=options,
                        value=a if a in names else None,
                        placeholder="run A (e.g. FP32 baseline)",
                        style={"width": "360px"},
                    ),
                    dcc.Dropdown(
                        id=ids.COMPARE_B,
                        options=options,
                        value=b if b in names else None,
                        placeholder="run B (e.g. AMP)",
                        style={"width": "360px", "marginLeft": "12px"},
                    ),
                ],
                style={"display": "flex"},
            ),
            html.P(
                "" if chosen else COMPARE_CHOOSE,
                id=ids.COMPARE_NOTE,
                style={"color": "#777", "margin": "10px 0"},
            ),
            html.Div(id=ids.COMPARE_NUMBERS),
            dcc.Graph(id=ids.COMPARE_GRAPH, style={} if chosen else HIDDEN),
        ]
    )


def build_compare_numbers(comparison: Any, names: tuple[str, str]) -> html.Div:
    """The numbers ``amprobe compare`` prints for runs A (baseline) and B (candidate), as a
    small table (:func:`amprobe.report.compare.comparison_rows`), then the pairing warnings and
    AMP-S06's finding when the pair gives it.

    Args:
        comparison: a :class:`amprobe.rules.compare.Comparison` of A (baseline) and B.
        names: the two runs' names, A first.
    """
    cell = {"padding": "3px 12px 3px 0", "borderBottom": "1px solid #eee", "textAlign": "left"}
    heads = (
        "",
        f"A (baseline): {names[0]}",
        f"B (candidate): {names[1]}",
        "B vs A",
        "steps compared",
    )
    rows = comparison_rows(comparison.metrics)
    table = html.Table(
        [
            html.Thead(html.Tr([html.Th(h, style=cell) for h in heads])),
            html.Tbody(
                [
                    html.Tr(
                        [
                            html.Td(v, style={**cell, "fontWeight": "bold"} if i == 3 else cell)
                            for i, v in enumerate(row)
                        ],
                        className="compare-row",
                    )
                    for row in rows
                ]
            ),
        ],
        style={"borderCollapse": "collapse", "margin": "6px 0 12px"},
    )
    notes: list[Any] = [
        html.P(w, className="compare-warning", style={"color": "#a15c00", "margin": "2px 0"})
        for w in comparison.metrics.get("warnings") or ()
    ]
    for f in comparison.findings:
        notes.append(
            html.P(
                [
                    html.Code(f.id),
                    " ",
                    _badge(f.severity, _SEVERITY_COLORS.get(f.severity, "#555")),
                    f.title,
                    ". ",
                    f.fix,
                ],
                className="compare-finding",
                style={"margin": "2px 0"},
            )
        )
    return html.Div([table, *notes])
