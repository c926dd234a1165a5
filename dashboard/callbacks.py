"""Thin callbacks: each is a plain function of a :class:`Context` and the callback's inputs.

:func:`dashboard.app.create_app` wires them to components; tests call them directly.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode

import plotly.graph_objects as go
from dash import dcc, no_update

import amprobe
from amprobe.analysis.whatif import compute_whatif
from amprobe.report import render_html
from amprobe.report.scale import steps_of
from amprobe.rules.compare import compare_runs as compare_pair
from amprobe.store.loader import empty_frame
from dashboard import layout
from dashboard.figures import (
    make_compare_figure,
    make_whatif_figure,
)
from dashboard.runs import LiveTail, RunAccessError, RunCache, discover_runs

__all__ = [
    "Context",
    "render_page",
    "render_tab",
    "sync_url",
    "filters_search",
    "refresh_run_list",
    "filter_findings",
    "refresh_live",
    "page_table",
    "export_report",
    "compare_runs",
    "compare_numbers",
    "compare_state",
    "first_page",
    "whatif_heatmap",
    "refresh_header",
]


#: Consecutive failed reads of a live run after which its page stops polling.
LIVE_READ_ATTEMPTS = 5
#: A live run's page re-runs the diagnosis at most once per this share of its refresh interval
#: (when the run's files changed), so a new finding shows within two intervals.
LIVE_REDIAGNOSE_SHARE = 0.75


@dataclasses.dataclass
class Context:
    """What the callbacks share: the root, the run cache and the live tail."""

    root: Path
    refresh_ms: int = 2000
    cache: RunCache = dataclasses.field(init=False)
    tail: LiveTail = dataclasses.field(default_factory=LiveTail)
    #: consecutive failed live reads per run name (a read may fail once while a rank closes)
    live_failures: dict[str, int] = dataclasses.field(default_factory=dict)
    #: consecutive failed diagnoses of a live run's new steps per run name
    diagnose_failures: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.cache = RunCache(
            self.root,
            live_reload_s=LIVE_REDIAGNOSE_SHARE * max(self.refresh_ms, 0) / 1000,
            tail=self.tail,
        )


def render_page(ctx: Context, pathname: str | None, search: str | None = None) -> Any:
    """Route a URL to a page: ``/`` run list, ``/run/<name>`` one run, ``/compare?a=&b=``."""
    path = pathname or "/"
    if path in ("/", ""):
        return layout.build_run_list(ctx.cache.page(1), ctx.refresh_ms)
    if path.startswith("/run/"):
        name = unquote(path[len("/run/") :]).rstrip("/")
        try:
            loaded = ctx.cache.get(name)
        except (RunAccessError, amprobe.RunLoadError) as exc:
            return layout.build_error(str(exc))
        try:
            return layout.build_run_page(loaded, ctx.refresh_ms, layout.RunQuery.parse(search))
        except Exception as exc:  # one run's odd data fails its own page, nothing else
            return layout.build_error(
                f"amprobe failed while drawing this run ({type(exc).__name__}: {exc})"
            )
    if path.rstrip("/") == "/compare":
        query = parse_qs((search or "").lstrip("?"))
        first_a = query.get("a", [])
        first_b = query.get("b", [])
        return layout.build_compare_page(
            discover_runs(ctx.root),
            first_a[0] if first_a else None,
            first_b[0] if first_b else None,
        )
    return layout.build_error(f"no such page: {path}")


def refresh_run_list(
    ctx: Context,
    _n: int | None,
    page_current: int | None = 0,
    sort_by: list[dict[str, str]] | None = None,
    search: str | None = None,
) -> tuple[list[dict[str, str]], int, str]:
    """Page ``page_current`` (0-based, the table's own) of the run list, re-read.

    Args:
        sort_by: the table's ``sort_by`` (``[{"column_id": .., "direction": "asc"|"desc"}]``;
            empty: by name).
        search: keep the runs whose name holds this text.

    Only runs whose files changed are read again. Returns ``(table data, page count,
    "M runs" text)``.
    """
    order: dict[str, str] = sort_by[0] if sort_by else {}
    listing = ctx.cache.page(
        (page_current or 0) + 1,
        sort=order.get("column_id"),
        descending=order.get("direction") == "desc",
        search=search,
    )
    return layout.run_rows(listing.rows), listing.pages, layout.pages_text(listing)


def first_page(_search: str | None, _sort_by: Any) -> int:
    """The run list's page (0-based) after its search or sort changed: the first."""
    return 0


def render_tab(
    ctx: Context,
    name: str | None,
    tab: str | None,
    focus: dict[str, Any] | None = None,
    search: str | None = None,
    shown: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """The body of run ``name``'s tab ``tab``, built once per run version (and step or layer).

    Called when a tab is opened, when a live run's version changes and when the URL's step or
    layer changes (``focus``); the findings filters come from the URL (``search``). Called for
    the overview (as the page mounts), it starts reading the run for the other tabs in the
    background (:meth:`dashboard.runs.LoadedRun.prepare_in_background`). Returns
    ``(body, what it shows)``, or ``no_update`` twice when the page already shows that
    (``shown``): a live tick that changed nothing sends nothing.
    """
    if not tab:
        return no_update, no_update
    try:
        loaded = ctx.cache.get(name or "")
    except (RunAccessError, amprobe.RunLoadError) as exc:
        return layout.build_error(str(exc)), None
    focus = focus or {}
    query = dataclasses.replace(
        layout.RunQuery.parse(search), tab=tab, step=focus.get("step"), layer=focus.get("layer")
    ).on_tab(tab)
    target = layout.shown_tab(loaded, query)
    if shown == target:
        result: tuple[Any, Any] = (no_update, no_update)
    else:
        try:
            result = layout.build_tab_body(loaded, query), target
        except Exception as exc:  # one tab's odd data fails that tab, nothing else
            result = (
                layout.build_error(
                    f"amprobe failed while drawing this tab ({type(exc).__name__}: {exc})"
                ),
                None,
            )
    if query.tab == layout.OVERVIEW and loaded.run.status != "live":
        # the findings are drawn (this callback fires as the page mounts): read the run for
        # the other tabs now, in the background, not before (it would delay this first paint)
        loaded.prepare_in_background()
    return result


def sync_url(search: str | None, tab: str | None, trigger: str | None) -> tuple[Any, Any, Any]:
    """Keep a run page's tab and its URL in step, both ways.

    ``trigger`` says which changed: ``"tab"`` (a tab was clicked: the URL follows, keeping the
    filters, and the step or layer only on their tab) or the URL (a link or the back button:
    the tab, the step and the layer follow). Returns ``(URL search, tab, focus)``, each
    ``no_update`` where nothing changes.
    """
    if not tab:
        return no_update, no_update, no_update
    query = layout.RunQuery.parse(search)
    if trigger == "tab":
        if query.tab == tab:
            return no_update, no_update, no_update
        moved = query.on_tab(tab)
        return moved.search(), no_update, moved.focus()
    return no_update, (query.tab if query.tab != tab else no_update), query.focus()


def filters_search(
    search: str | None, severities: list[str] | None, categories: list[str] | None
) -> Any:
    """The URL query string with the findings filters set (``no_update`` when unchanged)."""
    query = layout.RunQuery.parse(search)
    new = dataclasses.replace(
        query, severities=tuple(severities or ()), categories=tuple(categories or ())
    ).search()
    return no_update if new == query.search() else new


def filter_findings(
    ctx: Context, name: str | None, severities: list[str] | None, categories: list[str] | None
) -> Any:
    """The findings of run ``name`` kept by the severity and category filters."""
    try:
        loaded = ctx.cache.get(name or "")
    except (RunAccessError, amprobe.RunLoadError) as exc:
        return [layout.build_error(str(exc))]
    return layout.build_findings(loaded.diagnosis.findings, severities or [], categories or [])


def refresh_live(
    ctx: Context, _n: int | None, name: str | None, version: int | None = None
) -> tuple[Any, ...]:
    """A live run's tick: each rank's summary read again, and of its files only the bytes
    appended since the last tick (:class:`dashboard.runs.LiveTail`); the run diagnosed again.

    The step count and status follow the tail at every tick. The run is loaded and diagnosed
    again when its files changed (at most as often as :class:`RunCache` allows, and once more
    when it stops being live); when that gives a version other than the page's ``version``,
    the new version is returned, and the open tab (findings, health, loss-scale text and
    chart) is drawn again from it by :func:`render_tab`.

    While the run is live, the steps text also says which step the findings shown were made
    from (``"; findings as of step N"``).

    Returns ``(steps text, status badge, new version or no_update, interval disabled)``.
    """
    key = name or ""
    try:
        path, _ = ctx.cache.check(key)
    except RunAccessError as exc:  # outside the root, not a run: asking again cannot help
        return (str(exc), no_update, no_update, True)
    try:
        update = ctx.tail.poll(path, earlier=ctx.cache.loaded(path))
    except Exception as exc:  # a run amprobe fails on stops its own page's polling, nothing else
        # a live run can be caught between two writes: keep polling a few times before giving up
        failures = ctx.live_failures[key] = ctx.live_failures.get(key, 0) + 1
        text = str(exc) if isinstance(exc, amprobe.RunLoadError) else f"{type(exc).__name__}: {exc}"
        return (
            f"cannot read this run: {text}",
            no_update,
            no_update,
            failures >= LIVE_READ_ATTEMPTS,
        )
    ctx.live_failures.pop(key, None)
    count_text = layout.step_count_text(update.steps, update.last_step)
    try:
        loaded = ctx.cache.get(key, status=update.status)
    except Exception as exc:  # the steps still follow; the page says its findings are older
        text = str(exc) if isinstance(exc, amprobe.RunLoadError) else f"{type(exc).__name__}: {exc}"
        failed = ctx.diagnose_failures[key] = ctx.diagnose_failures.get(key, 0) + 1
        return (
            f"{count_text}; the findings shown are older: cannot diagnose the new steps ({text})",
            layout.build_status(update.status),
            no_update,
            update.status != "live" and failed >= LIVE_READ_ATTEMPTS,
        )
    ctx.diagnose_failures.pop(key, None)
    # the diagnosis is redone only every so often: say which step the findings shown are from
    count_text = layout.step_count_text(
        update.steps, update.last_step, loaded.run.last_step, live=update.status == "live"
    )
    return (
        count_text,
        layout.build_status(update.status),
        loaded.version if loaded.version != version else no_update,
        update.status != "live",
    )


def refresh_header(ctx: Context, name: str | None, version: int | None) -> tuple[Any, Any]:
    """A run page header's device text and warnings, drawn again when the page's run version
    changes (a live run diagnosed again). Returns ``(device text, warnings)``."""
    try:
        loaded = ctx.cache.get(name or "")
    except Exception:  # the tick that changed the version says why; keep what is shown
        return no_update, no_update
    if version is not None and loaded.version != version:
        return no_update, no_update  # an older version than the cache holds: the next tick
    return layout.header_details(loaded)


def _failed(what: str, exc: BaseException) -> str:
    """What a callback shows in the page instead of raising into Dash."""
    if isinstance(exc, (RunAccessError, amprobe.RunLoadError)):
        return str(exc)  # one line that says why already
    return f"amprobe failed while {what} ({type(exc).__name__}: {exc})"


def _message_figure(text: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=text)
    return fig


def whatif_heatmap(ctx: Context, name: str | None, group: str | None) -> go.Figure:
    """The what-if tab's exponent-range heatmap for ``group`` (activations or gradients); a
    failure is the figure's title, never an exception into Dash."""
    try:
        run = ctx.cache.get(name or "").run
        return make_whatif_figure(run, compute_whatif(run), group or "")
    except Exception as exc:  # one run's odd data fails this figure, nothing else
        return _message_figure(_failed("drawing this heatmap", exc))


def page_table(ctx: Context, name: str | None, table_key: str, page: int | None) -> Any:
    """Page ``page`` of a run's table: the loss-scale events or a section's ``<key>/<index>``."""
    try:
        loaded = ctx.cache.get(name or "")
    except (RunAccessError, amprobe.RunLoadError) as exc:
        return [layout.build_error(str(exc))]
    try:
        if table_key == layout.LOSS_SCALE_TABLE:
            frame = layout.scale_change_rows(steps_of(loaded.run))
        else:
            key, _, index = str(table_key).rpartition("/")
            section = loaded.section(key)
            if section is None or not re.fullmatch(r"[0-9]{1,6}", index):
                return [layout.build_error(f"no table {table_key!r} in this run")]
            if int(index) >= len(section.tables):
                return [layout.build_error(f"no table {table_key!r} in this run")]
            frame = section.tables[int(index)][1]
        return layout.table_rows(frame, page or 1)
    except Exception as exc:  # one table's odd data fails that table, nothing else
        return [layout.build_error(_failed("drawing this table", exc))]


def export_report(ctx: Context, n_clicks: int | None, name: str | None) -> tuple[Any, str]:
    """The run's HTML report (the one ``amprobe report`` writes) as a download."""
    if not n_clicks:
        return no_update, ""
    try:
        loaded = ctx.cache.get(name or "").prepared()
        # the sections this run version's tabs built already, not built a second time
        text = render_html(loaded.run, loaded.diagnosis, loaded.sections)
    except Exception as exc:  # said next to the button, never an exception into Dash
        return no_update, _failed("writing the report", exc)
    filename = re.sub(r"[^A-Za-z0-9._-]+", "_", name or "run").strip("._") or "run"
    return dcc.send_string(text, filename=f"{filename}-report.html", type="text/html"), ""


def compare_runs(ctx: Context, a: str | None, b: str | None) -> tuple[go.Figure, str]:
    """Two runs overlaid (step time, loss, scale), or a note saying what is missing (the graph
    is hidden then: :func:`compare_numbers`)."""
    if not a or not b:
        return make_compare_figure(_no_steps(), _no_steps()), layout.COMPARE_CHOOSE
    try:
        run_a, run_b = ctx.cache.get(a).prepared().run, ctx.cache.get(b).prepared().run
        return make_compare_figure(run_a.steps, run_b.steps, (a, b)), ""
    except Exception as exc:  # the note says why, never an exception into Dash
        return make_compare_figure(_no_steps(), _no_steps()), _failed("comparing these runs", exc)


def _no_steps() -> Any:
    return empty_frame("steps")


def compare_numbers(ctx: Context, a: str | None, b: str | None) -> tuple[Any, dict[str, str], str]:
    """What the compare page shows besides the curves, for runs ``a`` (baseline) and ``b``.

    Returns ``(numbers, graph style, URL search)``: the numbers of ``amprobe compare``
    (:func:`amprobe.rules.compare.compare_runs`, as
    :func:`~amprobe.report.compare.comparison_rows`) or nothing; the graph's style, hidden
    unless both runs are chosen and readable; ``?a=..&b=..`` for the runs chosen.
    """
    search = "?" + urlencode({k: v for k, v in (("a", a), ("b", b)) if v}) if a or b else ""
    if not a or not b:
        return None, layout.HIDDEN, search
    try:
        run_a, run_b = ctx.cache.get(a).prepared().run, ctx.cache.get(b).prepared().run
        comparison = compare_pair(run_a, run_b)
        numbers = layout.build_compare_numbers(comparison, (a, b))
    except (RunAccessError, amprobe.RunLoadError):
        return None, layout.HIDDEN, search  # the note says why (compare_runs)
    except Exception as exc:  # in the page, never an exception into Dash
        return layout.build_error(_failed("comparing these runs", exc)), layout.HIDDEN, search
    return numbers, {}, search


def compare_state(
    ctx: Context, a: str | None, b: str | None, search: str | None, from_url: bool
) -> tuple[Any, ...]:
    """The compare page's choices, numbers, graph style and URL, kept in step both ways.

    A choice in a dropdown goes to the URL (``from_url`` False); a URL that changed under the
    page (the browser's back and forward buttons, ``from_url`` True) sets the dropdowns.
    Returns ``(a, b, numbers, graph style, URL search)``, ``no_update`` where nothing changes.
    """
    if not from_url:
        return (no_update, no_update, *compare_numbers(ctx, a, b))
    query = parse_qs((search or "").lstrip("?"))
    url_a, url_b = (query.get(k, [None])[0] for k in ("a", "b"))
    numbers, style, _ = compare_numbers(ctx, url_a, url_b)
    if (url_a, url_b) == (a, b):  # the page's own URL, read as the page mounts
        return (no_update, no_update, numbers, style, no_update)
    return (url_a, url_b, numbers, style, no_update)
