"""Reports: section builders (figures and tables as data) and renderers (text, JSON, Markdown, HTML)."""

from amprobe.report import compute as _compute  # noqa: F401  (registers the compute section)
from amprobe.report import numerics as _numerics  # noqa: F401  (registers the numerics section)
from amprobe.report import ranks as _ranks  # noqa: F401  (registers the ranks section)
from amprobe.report import runtime as _runtime  # noqa: F401  (registers the runtime section)
from amprobe.report import scale as _scale  # noqa: F401  (registers the loss-scale section)
from amprobe.report import whatif as _whatif  # noqa: F401  (registers the what-if section)
from amprobe.report.render import (
    render_html,
    render_json,
    render_markdown,
    render_text,
    write_report,
)
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
