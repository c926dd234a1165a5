"""Component IDs, defined once: layout, callbacks and the browser test refer to these names."""

from __future__ import annotations

# page frame
URL = "url"
PAGE = "page"
NAV = "nav"

# run list
RUN_LIST = "run-list"
RUN_LIST_TABLE = "run-list-table"  # a DataTable, paged on the server
RUN_LIST_INTERVAL = "run-list-interval"
RUN_LIST_PAGES = "run-list-pages"  # "M runs, 50 a page"
RUN_LIST_SEARCH = "run-list-search"  # a text input: keep the runs whose name holds it

# one run
RUN_NAME = "run-name"  # dcc.Store holding the run's name relative to ROOT
RUN_TITLE = "run-title"
RUN_STATUS = "run-status"
RUN_STEPS = "run-steps"  # "N steps" text, refreshed while live
RUN_WARNINGS = "run-warnings"
RUN_DEVICE = "run-device"  # "device: ...", drawn again when a live run's version changes
FINDINGS_AS_OF = "findings-as-of"  # live run: "Findings as of step N ..."
RUN_TABS = "run-tabs"
LIVE_INTERVAL = "live-interval"
HEALTH = "health"
FINDINGS = "findings"
FINDINGS_COUNT = "findings-count"
NOT_CHECKED = "not-checked"
SEVERITY_FILTER = "severity-filter"
CATEGORY_FILTER = "category-filter"
FINDING_PREFIX = "finding-"  # + checklist ID, e.g. finding-AMP-N02
LOSS_SCALE_GRAPH = "loss-scale-graph"
LOSS_SCALE_EVENTS = "loss-scale-events"
STEP_TIME_GRAPH = "step-time-graph"
SECTION_PREFIX = "section-"  # + section key
WHATIF_PANEL = "whatif-panel"  # the precision what-if tab's body
WHATIF_GROUP = "whatif-group"  # radio: activations | gradients
WHATIF_HEATMAP = "whatif-heatmap"  # the per-layer exponent-range heatmap
BLOCK_FIT_MATRIX = "block-fit-matrix"  # the what-if tab's layer x block-format matrix
TABLE_PAGE = "table-page"  # pattern-matching type: {"type": TABLE_PAGE, "key": table key}
TABLE_BODY = "table-body"
EXPORT_BUTTON = "export-button"
EXPORT_DOWNLOAD = "export-download"
EXPORT_STATUS = "export-status"
RUN_URL = "run-url"  # the run page's own dcc.Location: its tab and filters are in the query
RUN_VERSION = "run-version"  # dcc.Store: the version of the loaded run the page shows
RUN_TAB_BODY = "run-tab-body"  # the open tab's body, built when the tab is opened
RUN_TAB_SHOWN = "run-tab-shown"  # dcc.Store: {tab, version, focus} the tab body shows
RUN_FOCUS = "run-focus"  # dcc.Store: the URL's step / layer, which the tab body marks
OVERVIEW_PANEL = "overview-panel"  # the overview tab's body: health, findings, checks not run
PLOTLY_PRELOAD = "plotly-preload"  # a hidden graph: plotly.js loads once the findings show
STEP_NOTE = "step-note"  # "Step N is marked on the chart ..." (?step=)
LAYER_NOTE = "layer-note"  # "Layer X: outlined on N chart(s)" (?layer=)
LOADING = "loading-placeholder"  # class of the text shown while a page or tab is built

# compare
COMPARE_A = "compare-a"
COMPARE_B = "compare-b"
COMPARE_GRAPH = "compare-graph"
COMPARE_NOTE = "compare-note"
COMPARE_URL = "compare-url"  # a dcc.Location (refresh off) that keeps ?a=..&b=.. in the URL
COMPARE_NUMBERS = "compare-numbers"  # the table of amprobe compare's numbers
