"""The Dash app factory. Importing this module loads no run; :func:`create_app` builds the app."""

from __future__ import annotations

import os
from pathlib import Path

from dash import MATCH, Dash, Input, Output, State, callback_context
from dash import ctx as dash_ctx

from dashboard import callbacks, ids, layout

__all__ = ["create_app"]


def create_app(root: str | os.PathLike[str], refresh_ms: int = 2000) -> Dash:
    """Build the dashboard over the run directories under ``root``.

    Args:
        root: directory holding run directories (searched a few levels deep); only runs
            under it can be opened.
        refresh_ms: how often the run list and a live run's page poll for new data.

    Raises:
        NotADirectoryError: ``root`` is not a directory.
    """
    base = Path(root)
    if not base.is_dir():
        raise NotADirectoryError(f"dashboard root is not a directory: {base}")
    ctx = callbacks.Context(root=base, refresh_ms=refresh_ms)
    app = Dash(__name__, title="amprobe", suppress_callback_exceptions=True, update_title=None)  # type: ignore[arg-type]  # None turns the "Updating..." title off
    app.layout = layout.build_frame()

    @app.callback(
        Output(ids.PAGE, "children"), Input(ids.URL, "pathname"), State(ids.URL, "search")
    )
    def _page(pathname, search):  # type: ignore[no-untyped-def]
        return callbacks.render_page(ctx, pathname, search)

    @app.callback(
        Output(ids.RUN_LIST_TABLE, "data"),
        Output(ids.RUN_LIST_TABLE, "page_count"),
        Output(ids.RUN_LIST_PAGES, "children"),
        Input(ids.RUN_LIST_INTERVAL, "n_intervals"),
        Input(ids.RUN_LIST_TABLE, "page_current"),
        Input(ids.RUN_LIST_TABLE, "sort_by"),
        Input(ids.RUN_LIST_SEARCH, "value"),
        prevent_initial_call=True,
    )
    def _run_list(n, page_current, sort_by, search):  # type: ignore[no-untyped-def]
        return callbacks.refresh_run_list(ctx, n, page_current, sort_by, search)

    @app.callback(
        Output(ids.RUN_LIST_TABLE, "page_current"),
        Input(ids.RUN_LIST_SEARCH, "value"),
        Input(ids.RUN_LIST_TABLE, "sort_by"),
        prevent_initial_call=True,
    )
    def _run_list_first_page(search, sort_by):  # type: ignore[no-untyped-def]
        return callbacks.first_page(search, sort_by)

    @app.callback(
        Output(ids.RUN_TAB_BODY, "children"),
        Output(ids.RUN_TAB_SHOWN, "data"),
        Input(ids.RUN_TABS, "value"),
        Input(ids.RUN_VERSION, "data"),
        Input(ids.RUN_FOCUS, "data"),
        State(ids.RUN_NAME, "data"),
        State(ids.RUN_URL, "search"),
        State(ids.RUN_TAB_SHOWN, "data"),
    )
    def _tab(tab, _version, focus, name, search, shown):  # type: ignore[no-untyped-def]
        return callbacks.render_tab(ctx, name, tab, focus, search, shown)

    # A run page's query is written by two callbacks (tabs, filters): the second as a duplicate.
    @app.callback(
        Output(ids.RUN_URL, "search"),
        Output(ids.RUN_TABS, "value"),
        Output(ids.RUN_FOCUS, "data"),
        Input(ids.RUN_URL, "search"),
        Input(ids.RUN_TABS, "value"),
        prevent_initial_call=True,
    )
    def _url(search, tab):  # type: ignore[no-untyped-def]
        trigger = "tab" if callback_context.triggered_id == ids.RUN_TABS else "url"
        return callbacks.sync_url(search, tab, trigger)

    @app.callback(
        Output(ids.FINDINGS, "children"),
        Output(ids.RUN_URL, "search", allow_duplicate=True),
        Input(ids.SEVERITY_FILTER, "value"),
        Input(ids.CATEGORY_FILTER, "value"),
        State(ids.RUN_NAME, "data"),
        State(ids.RUN_URL, "search"),
        prevent_initial_call=True,
    )
    def _findings(severities, categories, name, search):  # type: ignore[no-untyped-def]
        return (
            callbacks.filter_findings(ctx, name, severities, categories),
            callbacks.filters_search(search, severities, categories),
        )

    @app.callback(
        Output(ids.RUN_STEPS, "children"),
        Output(ids.RUN_STATUS, "children"),
        Output(ids.RUN_VERSION, "data"),
        Output(ids.LIVE_INTERVAL, "disabled"),
        Input(ids.LIVE_INTERVAL, "n_intervals"),
        State(ids.RUN_NAME, "data"),
        State(ids.RUN_VERSION, "data"),
        prevent_initial_call=True,
    )
    def _live(n, name, version):  # type: ignore[no-untyped-def]
        return callbacks.refresh_live(ctx, n, name, version)

    @app.callback(
        Output(ids.RUN_DEVICE, "children"),
        Output(ids.RUN_WARNINGS, "children"),
        Input(ids.RUN_VERSION, "data"),
        State(ids.RUN_NAME, "data"),
        prevent_initial_call=True,
    )
    def _header(version, name):  # type: ignore[no-untyped-def]
        return callbacks.refresh_header(ctx, name, version)

    @app.callback(
        Output({"type": ids.TABLE_BODY, "key": MATCH}, "children"),
        Input({"type": ids.TABLE_PAGE, "key": MATCH}, "value"),
        State({"type": ids.TABLE_PAGE, "key": MATCH}, "id"),
        State(ids.RUN_NAME, "data"),
        prevent_initial_call=True,
    )
    def _table_page(page, table_id, name):  # type: ignore[no-untyped-def]
        return callbacks.page_table(ctx, name, table_id["key"], page)

    @app.callback(
        Output(ids.WHATIF_HEATMAP, "figure"),
        Input(ids.WHATIF_GROUP, "value"),
        State(ids.RUN_NAME, "data"),
        prevent_initial_call=True,
    )
    def _whatif(group, name):  # type: ignore[no-untyped-def]
        return callbacks.whatif_heatmap(ctx, name, group)

    @app.callback(
        Output(ids.EXPORT_DOWNLOAD, "data"),
        Output(ids.EXPORT_STATUS, "children"),
        Input(ids.EXPORT_BUTTON, "n_clicks"),
        State(ids.RUN_NAME, "data"),
        prevent_initial_call=True,
    )
    def _export(n_clicks, name):  # type: ignore[no-untyped-def]
        return callbacks.export_report(ctx, n_clicks, name)

    @app.callback(
        Output(ids.COMPARE_GRAPH, "figure"),
        Output(ids.COMPARE_NOTE, "children"),
        Input(ids.COMPARE_A, "value"),
        Input(ids.COMPARE_B, "value"),
    )
    def _compare(a, b):  # type: ignore[no-untyped-def]
        return callbacks.compare_runs(ctx, a, b)

    @app.callback(
        Output(ids.COMPARE_A, "value"),
        Output(ids.COMPARE_B, "value"),
        Output(ids.COMPARE_NUMBERS, "children"),
        Output(ids.COMPARE_GRAPH, "style"),
        Output(ids.COMPARE_URL, "search"),
        Input(ids.COMPARE_A, "value"),
        Input(ids.COMPARE_B, "value"),
        Input(ids.COMPARE_URL, "search"),
    )
    def _compare_state(a, b, search):  # type: ignore[no-untyped-def]
        from_url = dash_ctx.triggered_id == ids.COMPARE_URL
        return callbacks.compare_state(ctx, a, b, search, from_url)

    app.server.config["AMPROBE_ROOT"] = str(base)
    return app
