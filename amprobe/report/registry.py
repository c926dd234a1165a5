"""What a report section is, and the table section builders register into.

Each area (loss scale, numerics, Tensor Cores, utilization, ...) registers one builder with
:func:`section`. A builder is a pure function ``(run, diagnosis) -> Section | None`` that
returns figures (plotly), tables (pandas) and text, or a Section whose ``missing`` says why
the area's data was not recorded. The builders live in their own modules (compute, numerics,
ranks, runtime, scale, whatif) and import this one; :mod:`amprobe.report.sections` imports
them all, so that the table it builds from is complete.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import pandas as pd

if TYPE_CHECKING:
    from amprobe.rules.engine import Diagnosis
    from amprobe.store.loader import Run

__all__ = ["Section", "SectionSpec", "SECTIONS", "section"]


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
