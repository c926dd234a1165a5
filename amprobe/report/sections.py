"""Report sections: what each area of a run contributes to the report, as data.

Each area (loss scale, numerics, Tensor Cores, utilization, ...) registers one builder with
:func:`section` (:mod:`amprobe.report.registry`). A builder is a pure function
``(run, diagnosis) -> Section | None`` that returns figures (plotly), tables (pandas) and text,
or a Section whose ``missing`` says why the area's data was not recorded. Renderers (HTML,
Markdown, the dashboard) only consume sections; no builder writes HTML.

This module imports every builder module, so :data:`SECTIONS` is complete wherever sections
are built or listed; ``amprobe diagnose``, which renders no section, does not import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from amprobe.report import compute as _compute  # noqa: F401  (registers the compute section)
from amprobe.report import numerics as _numerics  # noqa: F401  (registers the numerics section)
from amprobe.report import ranks as _ranks  # noqa: F401  (registers the ranks section)
from amprobe.report import runtime as _runtime  # noqa: F401  (registers the runtime section)
from amprobe.report import scale as _scale  # noqa: F401  (registers the loss-scale section)
from amprobe.report import whatif as _whatif  # noqa: F401  (registers the what-if section)
from amprobe.report.escape import escape_figure_text
from amprobe.report.registry import SECTIONS, Section, SectionSpec, section

if TYPE_CHECKING:
    from amprobe.rules.engine import Diagnosis
    from amprobe.store.loader import Run

__all__ = [
    "Section",
    "SectionSpec",
    "SECTIONS",
    "section",
    "section_tabs",
    "build_section",
    "build_sections",
]


def _in_order() -> list[tuple[str, SectionSpec]]:
    return sorted(SECTIONS.items(), key=lambda kv: kv[1].order)


def section_tabs() -> list[tuple[str, str]]:
    """``(key, tab label)`` of every registered section, in report order: one dashboard tab each."""
    return [(key, spec.tab) for key, spec in _in_order()]


def build_section(key: str, run: Run, diagnosis: Diagnosis) -> Section | None:
    """Build section ``key`` alone (None: no such section, or it has nothing for this run).

    A failing builder becomes a section saying so; the section's figures draw the run's strings
    (layer names, dtypes) as text: see :func:`~amprobe.report.escape.escape_figure_text`.
    """
    spec = SECTIONS.get(key)
    if spec is None:
        return None
    try:
        result = spec.build(run, diagnosis)
    except Exception as exc:
        result = Section(
            key=key, title=key, missing=f"could not be built: {type(exc).__name__}: {exc}"
        )
    if result is not None:
        for fig in result.figures:
            escape_figure_text(fig)  # layer and run names are drawn as text, not HTML
    return result


def build_sections(run: Run, diagnosis: Diagnosis) -> list[Section]:
    """Build every registered section, in report order (:func:`build_section` each)."""
    return [s for key, _ in _in_order() if (s := build_section(key, run, diagnosis)) is not None]
