"""Run text (module names, run names, dtypes, warnings) made inert for the formats that render it.

A run is written by the training job, so its strings are untrusted: a module can be named
``<img src=x onerror=alert(1)>``. Markdown viewers render raw HTML, and plotly renders a subset
of HTML (``<b>``, ``<a href>``, ``<span style>``) in trace names, tick labels and hover text.
The HTML report escapes with :func:`html.escape`; Dash components take text, never HTML.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["escape_markdown", "escape_plotly_text", "escape_figure_text"]

#: Markdown's inline syntax, escaped with a backslash (CommonMark allows it before any punctuation).
_MARKDOWN_PUNCTUATION = "\\`*_[]!|"
#: Trace properties whose strings plotly draws as text (legend, ticks, hover labels, labels).
_TRACE_TEXT = ("name", "text", "hovertext", "x", "y", "labels", "customdata")


def escape_markdown(text: Any) -> str:
    """``text`` as one line of inline Markdown that renders as itself.

    ``&``, ``<`` and ``>`` become entities (no raw HTML reaches the viewer), Markdown's inline
    punctuation is backslash-escaped (no link, image, emphasis or code span), ``|`` cannot end
    a table cell and line breaks become spaces.
    """
    out = str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    for ch in _MARKDOWN_PUNCTUATION:
        out = out.replace(ch, "\\" + ch)
    return out.replace("\r", " ").replace("\n", " ")


def escape_plotly_text(text: str) -> str:
    """``text`` as plotly draws it literally (plotly decodes ``&amp;``, ``&lt;``, ``&gt;``)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _escape_values(value: Any) -> Any:
    if isinstance(value, str):
        return escape_plotly_text(value)
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "OU":
            return value
        return np.array([_escape_values(v) for v in value.tolist()], dtype=object)
    if isinstance(value, (list, tuple)):
        if not any(isinstance(v, (str, list, tuple, np.ndarray)) for v in value):
            return value
        return [_escape_values(v) for v in value]
    return value


def escape_figure_text(fig: Any) -> Any:
    """Escape, in place, every string a figure's traces draw as text; returns ``fig``.

    Trace names, text, hover text, category labels (``x``/``y`` strings) and pie labels come
    from the run (layer names, run names, dtypes); layout titles and annotations are amprobe's
    own and are left as they are. Calling it twice on one figure escapes once.
    """
    if getattr(fig, "_amprobe_text_escaped", False):
        return fig
    for trace in fig.data:
        for key in _TRACE_TEXT:
            if key not in trace:
                continue
            value = trace[key]
            if value is None:
                continue
            escaped = _escape_values(value)
            if escaped is not value:
                trace[key] = escaped
    fig._amprobe_text_escaped = True
    return fig
