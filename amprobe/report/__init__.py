"""Reports: section builders (figures and tables as data) and renderers (text, JSON, Markdown, HTML).

``import amprobe.report`` loads nothing else: each public name loads with the module that
defines it, on first use (PEP 562's module ``__getattr__``), so that ``amprobe diagnose``, which
renders text, loads neither the section builders nor plotly's figures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from amprobe.lazy import lazy_names

if TYPE_CHECKING:
    from amprobe.report.document import render_html, write_report
    from amprobe.report.render import render_json, render_markdown, render_text
    from amprobe.report.sections import SECTIONS, Section, build_sections, section

__all__ = [
    "SECTIONS",
    "Section",
    "build_sections",
    "render_html",
    "render_json",
    "render_markdown",
    "render_text",
    "section",
    "write_report",
]

#: public names -> the module that defines them (imported on first access)
_LAZY = {
    "render_text": "amprobe.report.render",
    "render_json": "amprobe.report.render",
    "render_markdown": "amprobe.report.render",
    "render_html": "amprobe.report.document",
    "write_report": "amprobe.report.document",
    "SECTIONS": "amprobe.report.sections",
    "Section": "amprobe.report.sections",
    "build_sections": "amprobe.report.sections",
    "section": "amprobe.report.sections",
}
#: the package's modules, as attributes (``amprobe.report.sections`` once ``amprobe.report`` is
#: imported, as when this file imported them)
_SUBMODULES = (
    "compare",
    "compute",
    "document",
    "downsample",
    "escape",
    "numerics",
    "ranks",
    "registry",
    "render",
    "runtime",
    "scale",
    "sections",
    "summary",
    "whatif",
    "whatif_json",
)


__getattr__, __dir__ = lazy_names(__name__, _LAZY, _SUBMODULES, globals())
