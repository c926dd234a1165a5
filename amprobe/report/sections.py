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
from typing import TYPE_CHECKING, Any

import pandas as pd

from amprobe.report.escape import escape_figure_text

if TYPE_CHECKING:
    from amprobe.rules.engine import Diagnosis
    from amprobe.store.loader import Run

__all__ = ["Section", "SECTIONS", "section", "build_sections"]


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

#: key -> (order, builder). Lower order comes first.
SECTIONS: dict[str, tuple[int, SectionBuilder]] = {}


def section(key: str, order: int) -> Callable[[SectionBuilder], SectionBuilder]:
    """Register a section builder."""

    def register(fn: SectionBuilder) -> SectionBuilder:
        SECTIONS[key] = (order, fn)
        return fn

    return register


def build_sections(run: Run, diagnosis: Diagnosis) -> list[Section]:
    """Build every registered section; a failing builder becomes a section saying so.

    The sections' figures draw the run's strings (layer names, dtypes) as text: see
    :func:`~amprobe.report.escape.escape_figure_text`.
    """
    out: list[Section] = []
    for key, (_, fn) in sorted(SECTIONS.items(), key=lambda kv: kv[1][0]):
        try:
            result = fn(run, diagnosis)
        except Exception as exc:
            result = Section(
                key=key, title=key, missing=f"could not be built: {type(exc).__name__}: {exc}"
            )
        if result is not None:
            for fig in result.figures:
                escape_figure_text(fig)  # layer and run names are drawn as text, not HTML
            out.append(result)
    return out
