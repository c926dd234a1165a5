"""The dashboard's layout, built by ``build_*`` functions from loaded runs.

All text that comes from a run (names, layer names, evidence, fixes, warnings) is passed as
component children or table cells, which Dash renders as text (escaped), never as HTML.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

import pandas as pd
from dash import dash_table, dcc, html

from amprobe.analysis.whatif import compute_whatif
from amprobe.report.compare import comparison_rows
from amprobe.report.downsample import thin_figure
from amprobe.report.escape import escape_markdown
from amprobe.report.evidence import (
    Block,
    Facts,
    Table,
    Text,
    finding_anchors,
    finding_layer,
    finding_step,
    render_evidence,
)
from amprobe.report.render import split_ref
from amprobe.report.sections import section_tabs
from amprobe.rules.engine import CATEGORY_LABELS, Severity
from dashboard import ids
from dashboard.figures import (
    make_loss_scale_figure,
    make_step_time_figure,
    make_whatif_figure,
    scale_events,
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
#: the numerics tab: a finding links to its layer there (``?tab=numerics&layer=...``)
NUMERICS_SECTION = "numerics"

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
            html.Div(id=ids.PAGE, style={"padding": "12px 18px"}),
        ],
        style={"fontFamily": _FONT, "color": "#222"},
    )


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
    if not listing.total:
        return "No amprobe run directory under this root yet."
    if listing.matched is not None and listing.search:
        if not listing.matched:
            return f"No run name holds {listing.search!r} ({listing.total} runs)."
        return (
            f"{listing.matched} of {listing.total} runs match {listing.search!r}, "
            f"{PAGE_ROWS} a page"
        )
    return f"{listing.total} runs, {PAGE_ROWS} a page"


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
        return f"{100 * float(value):.1f} %"
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
    """Links to the finding's first step on the loss-scale chart and its layer's numerics."""
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
    return html.Small(["look at: ", *links], style={"color": "#666"}) if links else None


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
            html.P(["Fix: ", finding.fix], style={"margin": "4px 0"}),
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


def build_section(section: Any, key: str | None = None) -> html.Div:
    """A report section: its text, figures (thinned for display), tables, or why it is missing."""
    key = key or section.key
    children: list[Any] = [html.H3(section.title)]
    if section.missing:
        children.append(
            html.P(_missing_text(section.missing), className="missing", style={"color": "#777"})
        )
    children.extend(html.P(t) for t in section.text)
    for i, fig in enumerate(section.figures):
        shown = thin_figure(copy.deepcopy(fig))
        children.append(dcc.Graph(figure=shown, id=f"{ids.SECTION_PREFIX}{key}-fig{i}"))
    for i, (caption, frame) in enumerate(section.tables):
        children.append(build_table(caption, frame, f"{key}/{i}"))
    return html.Div(children, id=f"{ids.SECTION_PREFIX}{key}", className="section")


def build_whatif(section: Any, figure: Any, group: str, groups: Sequence[str]) -> html.Div:
    """The precision what-if tab: a group switch, the heatmap, then the section's text and table.

    Args:
        section: the report's ``whatif`` section (its figures are replaced by ``figure``).
        figure: the heatmap of ``group`` (from ``amprobe.report.whatif.make_exponent_heatmap``).
        group: the heatmap group shown first.
        groups: the groups the switch offers.
    """
    if section.missing:
        return html.Div(build_section(section, WHATIF_SECTION), id=ids.WHATIF_PANEL)
    rest = dataclasses.replace(section, figures=())
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
            build_section(rest, WHATIF_SECTION),
        ],
        id=ids.WHATIF_PANEL,
    )


def _whatif_tab(run: Any, section: Any, label: str) -> html.Div:
    if section is None:
        return _absent_section(WHATIF_SECTION, label)
    if section.missing:
        return build_whatif(section, None, "", ())

    numerics = run.table("numerics")
    groups = whatif_groups(numerics)
    group = groups[0] if groups else "activations"
    return build_whatif(
        section, make_whatif_figure(numerics, compute_whatif(run), group), group, groups
    )


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


def _steps_text(steps: pd.DataFrame) -> str:
    n = int(steps["step"].nunique()) if len(steps) else 0
    last = int(steps["step"].max()) if len(steps) else None
    return f"{n} steps" + (f" (last step {last})" if last is not None else "")


def build_status(status: str) -> html.Span:
    return _badge(status, _STATUS_COLORS.get(status, "#555"))


def build_loss_scale(steps: pd.DataFrame, section: Any = None) -> html.Div:
    """The loss-scale tab: the live figure, the report's ``scale`` section text, the events."""
    events = scale_events(steps)
    notes: list[Any] = []
    if section is not None:
        if section.missing:
            notes.append(
                html.P(_missing_text(section.missing), className="missing", style={"color": "#777"})
            )
        notes.extend(html.P(t) for t in section.text)
    counts = events["event"].value_counts().to_dict() if len(events) else {}
    summary = (
        f"{counts.get('growth', 0)} growth, {counts.get('backoff', 0)} backoff event(s)"
        if len(events)
        else "no change of the loss scale recorded"
    )
    return html.Div(
        [
            *notes,
            dcc.Graph(figure=make_loss_scale_figure(steps), id=ids.LOSS_SCALE_GRAPH),
            html.H4("Growth and backoff events"),
            html.P(summary),
            html.Div(
                build_table("scale changes", events, LOSS_SCALE_TABLE) if len(events) else None,
                id=ids.LOSS_SCALE_EVENTS,
            ),
        ]
    )


def build_section_tab(run: Any, key: str, label: str, section: Any) -> Any:
    """The body of report section ``key``'s tab: the section (``None``: it built nothing for
    this run), with the live parts of the loss-scale, what-if and runtime tabs."""
    if key == SCALE_SECTION:
        return build_loss_scale(run.steps, section)
    if key == WHATIF_SECTION:
        return _whatif_tab(run, section, label)
    body = build_section(section, key) if section is not None else _absent_section(key, label)
    if key != RUNTIME_SECTION:
        return body
    live = html.Div(
        [
            html.H3("Step time and the probe's own time (live)"),
            dcc.Graph(figure=make_step_time_figure(run.steps), id=ids.STEP_TIME_GRAPH),
        ]
    )
    return html.Div([live, body])


def build_run_page(loaded: LoadedRun, refresh_ms: int) -> html.Div:
    """One run: status, health and findings, loss scale, and a tab per report section."""
    run, diagnosis = loaded.run, loaded.diagnosis
    steps = run.steps
    sections = {s.key: s for s in loaded.sections}
    tabs = [
        dcc.Tab(
            label="Overview",
            value="overview",
            children=html.Div(
                [
                    build_health(diagnosis.health),
                    html.H3("Findings"),
                    html.Div(
                        [
                            dcc.Checklist(
                                id=ids.SEVERITY_FILTER,
                                options=list(SEVERITIES),
                                value=list(SEVERITIES),
                                inline=True,
                                inputStyle={"marginRight": "4px", "marginLeft": "10px"},
                            ),
                            dcc.Checklist(
                                id=ids.CATEGORY_FILTER,
                                options=[{"label": lbl, "value": v} for v, lbl in CATEGORIES],
                                value=[v for v, _ in CATEGORIES],
                                inline=True,
                                inputStyle={"marginRight": "4px", "marginLeft": "10px"},
                            ),
                        ]
                    ),
                    html.Div(build_findings(diagnosis.findings), id=ids.FINDINGS),
                    html.Details(
                        [
                            html.Summary(f"{len(diagnosis.not_checked)} check(s) not run"),
                            html.Ul(
                                [
                                    html.Li([html.Code(n.id), f" {n.name}: {n.reason}"])
                                    for n in diagnosis.not_checked
                                ]
                            ),
                        ],
                        id=ids.NOT_CHECKED,
                    ),
                ]
            ),
        ),
    ]
    for key, label in section_tabs():
        tabs.append(
            dcc.Tab(
                label=label,
                value=key,
                children=build_section_tab(run, key, label, sections.get(key)),
            )
        )
    warnings = [html.Li(w) for w in run.warnings]
    return html.Div(
        [
            dcc.Store(id=ids.RUN_NAME, data=loaded.name),
            html.H2(loaded.name, id=ids.RUN_TITLE),
            html.Div(
                [
                    html.Span(build_status(run.status), id=ids.RUN_STATUS),
                    html.Span(_steps_text(steps), id=ids.RUN_STEPS, style={"marginRight": "14px"}),
                    html.Span(
                        f"device: {run.rank_manifest.get('gpu_name') or run.rank_manifest.get('device') or 'not recorded'}",
                        style={"marginRight": "14px"},
                    ),
                    html.Button("Download HTML report", id=ids.EXPORT_BUTTON),
                    html.Span(id=ids.EXPORT_STATUS, style={"marginLeft": "8px", "color": "#777"}),
                    dcc.Download(id=ids.EXPORT_DOWNLOAD),
                ]
            ),
            html.Ul(warnings, id=ids.RUN_WARNINGS, style={"color": "#a15c00"})
            if warnings
            else html.Div(id=ids.RUN_WARNINGS),
            html.P(
                "live: findings are as of page load; reload to re-run the rules"
                if run.status == "live"
                else "",
                style={"color": "#777"},
            ),
            dcc.Interval(id=ids.LIVE_INTERVAL, interval=refresh_ms, disabled=run.status != "live"),
            dcc.Tabs(id=ids.RUN_TABS, value="overview", children=tabs),
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
