"""Report sections: what each area of a run contributes to the report, as data.

Each area (loss scale, numerics, Tensor Cores, utilization, ...) registers one builder with
:func:`section`. A builder is a pure function ``(run, diagnosis) -> Section | None`` that
returns figures (plotly), tables (pandas) and text, or a Section whose ``missing`` says why
the area's data was not recorded. Renderers (HTML, Markdown, the dashboard) only consume
sections; no builder writes HTML.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import pandas as pd

from amprobe.report.escape import escape_figure_text

if TYPE_CHECKING:
    from amprobe.rules.engine import Diagnosis
    from amprobe.store.loader import Run

__all__ = ["Section", "SectionSpec", "SECTIONS", "section", "section_tabs", "build_sections"]


@dataclasses.dataclass(frozen=True)
class Section:
    """One part of a report.

    Attributes:
        key: stable identifier (used for anchors and dashboard tabs).
        title: heading.
        figures: plotly figures, in order.
        tables: (caption, frame) pairs; frames are rendered escaped.
        text: short paragraphs of plain text.
        missing: when set, the area's data was not recorded and this says why.
    """

    key: str
    title: str
    figures: tuple[Any, ...] = ()
    tables: tuple[tuple[str, pd.DataFrame], ...] = ()
    text: tuple[str, ...] = ()
    missing: str | None = None


SectionBuilder = Callable[["Run", "Diagnosis"], "Section | None"]


class SectionSpec(NamedTuple):
    """A registered section: where it comes in a report, its builder, its tab's label."""

    order: int  # lower comes first
    build: SectionBuilder
    tab: str  # the short label of its dashboard tab ("Tensor Cores")


#: key -> its :class:`SectionSpec`. The HTML report and the dashboard's tabs follow this table.
SECTIONS: dict[str, SectionSpec] = {}


def section(key: str, order: int, tab: str) -> Callable[[SectionBuilder], SectionBuilder]:
    """Register a section builder under ``key``; ``tab`` labels its dashboard tab."""

    def register(fn: SectionBuilder) -> SectionBuilder:
        SECTIONS[key] = SectionSpec(order, fn, tab)
        return fn

    return register


def _in_order() -> list[tuple[str, SectionSpec]]:
    return sorted(SECTIONS.items(), key=lambda kv: kv[1].order)


def section_tabs() -> list[tuple[str, str]]:
    """``(key, tab label)`` of every registered section, in report order: one dashboard tab each."""
    return [(key, spec.tab) for key, spec in _in_order()]


def build_sections(run: Run, diagnosis: Diagnosis) -> list[Section]:
    """Build every registered section; a failing builder becomes a section saying so.

    The sections' figures draw the run's strings (layer names, dtypes) as text: see
    :func:`~amprobe.report.escape.escape_figure_text`.
    """
    out: list[Section] = []
    for key, spec in _in_order():
        try:
            result = spec.build(run, diagnosis)
        except Exception as exc:
            result = Section(
                key=key, title=key, missing=f"could not be built: {type(exc).__name__}: {exc}"
            )
        if result is not None:
            for fig in result.figures:
                escape_figure_text(fig)  # layer and run names are drawn as text, not HTML
            out.append(result)
    return out
