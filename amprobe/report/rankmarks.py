"""The ranks a diagnosis singles out, as the per-rank views mark them.

Three rules name a rank as the place where something went wrong: AMP-D04 (the rank where the
first non-finite value of the job was produced, and the ranks that received it through a
collective), AMP-D05 (a data-parallel replica whose parameters differ from its group's; with
two replicas both, as the copy at fault cannot be told) and AMP-D06 (a rank whose device gave
a wrong known answer). :func:`compute_rank_marks` reads those findings' evidence (keys fixed
by the rules: ``origin``/``received``, ``divergent`` or ``groups``, ``faults``) and nothing
else: a mark appears only where the rule fired, and no view marks a rank otherwise. The
report's and the dashboard's Ranks view (:mod:`amprobe.report.ranks`) draws the marked ranks
on their own, never folded into a band or a heatmap row of other ranks.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from amprobe.rules.engine import name_ranks

if TYPE_CHECKING:
    from amprobe.rules.engine import Diagnosis, Finding
    from amprobe.store.loader import Run

__all__ = [
    "ORIGIN_FINDING",
    "DIVERGENCE_FINDING",
    "FAULT_FINDING",
    "MAX_MARKED_RANKS",
    "RankMark",
    "RankMarks",
    "compute_rank_marks",
    "finding_marked_ranks",
]

#: the findings whose evidence names ranks to mark, by checklist ID (a public contract)
ORIGIN_FINDING = "AMP-D04"
DIVERGENCE_FINDING = "AMP-D05"
FAULT_FINDING = "AMP-D06"
#: marked ranks drawn on their own (a line, a heatmap row), at most; the rest are listed in
#: the marks table and the section's text
MAX_MARKED_RANKS = 16
#: what an origin was, in words (AMP-D04's ``origin["what"]``)
_WHAT = {
    "input": "its input batch",
    "loss": "its local loss",
    "activation": "a layer's activation",
    "gradient": "its local gradient, before the reduction",
}

#: a mark's kind in a word or two (a heatmap row's label)
_SHORT = {
    "origin": "NaN origin",
    "divergent": "divergent",
    "replica-pair": "replica differs",
    "fault": "device fault",
}


@dataclass(frozen=True)
class RankMark:
    """One rank a finding singles out.

    Attributes:
        rank: the rank.
        kind: ``origin`` (AMP-D04), ``divergent`` (AMP-D05: differs from its group's
            majority), ``replica-pair`` (AMP-D05 with two replicas: one of the two differs,
            which cannot be told) or ``fault`` (AMP-D06).
        finding: the finding's ID.
        step: the step it names (None: not given).
        label: a few words for a legend, a heatmap row or a marker ("NaN/inf origin: input").
        text: the mark in a sentence, for hover text and the marks table.
        host: the rank's host, local rank and device, when known ("" else).
        received: an origin's ranks that received its value through the collective.
    """

    rank: int
    kind: str
    finding: str
    step: int | None
    label: str
    text: str
    host: str = ""
    local_rank: int | None = None
    device: str = ""
    received: tuple[int, ...] = ()


@dataclass(frozen=True)
class RankMarks:
    """The marks of one diagnosis (the singled-out ranks, each origin with the ranks that
    received its value) and the sentences that say so."""

    marks: tuple[RankMark, ...] = ()
    lines: tuple[str, ...] = ()

    @property
    def received(self) -> dict[int, tuple[int, ...]]:
        """Origin rank -> the ranks that received its value (AMP-D04's ``received``; the
        union where several findings name one origin)."""
        out: dict[int, set[int]] = {}
        for m in self.marks:
            if m.received:
                out.setdefault(m.rank, set()).update(m.received)
        return {rank: tuple(sorted(got)) for rank, got in out.items()}

    def __bool__(self) -> bool:
        return bool(self.marks)

    def ranks(self) -> list[int]:
        """The singled-out ranks, each once, in the order of their marks (at most
        :data:`MAX_MARKED_RANKS`: those are drawn on their own)."""
        return list(dict.fromkeys(m.rank for m in self.marks))[:MAX_MARKED_RANKS]

    def of(self, rank: int) -> list[RankMark]:
        """The marks of ``rank``."""
        return [m for m in self.marks if m.rank == rank]

    def short(self, rank: int) -> str:
        """``rank``'s marks in a word or two each, for a heatmap row ("NaN origin")."""
        return ", ".join(dict.fromkeys(_SHORT[m.kind] for m in self.of(rank)))

    def label(self, rank: int) -> str:
        """``rank``'s marks in a few words ("NaN/inf origin: input; device fault"), "" if none."""
        return "; ".join(dict.fromkeys(m.label for m in self.of(rank)))

    def table(self) -> pd.DataFrame:
        """One row per mark (a row more per origin whose value others received): rank, mark,
        step, what, host, local rank, device, finding."""
        rows: list[dict[str, Any]] = []
        for m in self.marks:
            rows.append(
                {
                    "rank": str(m.rank),
                    "mark": m.label,
                    "step": "" if m.step is None else str(m.step),
                    "what": m.text,
                    "host": m.host,
                    "local rank": "" if m.local_rank is None else str(m.local_rank),
                    "device": m.device,
                    "finding": m.finding,
                }
            )
            got = m.received
            if got:
                rows.append(
                    {
                        "rank": name_ranks(got),
                        "mark": f"received from rank {m.rank}",
                        "step": "" if m.step is None else str(m.step),
                        "what": f"received rank {m.rank}'s non-finite value through the "
                        "collective; did not produce it",
                        "host": "",
                        "local rank": "",
                        "device": "",
                        "finding": m.finding,
                    }
                )
        return pd.DataFrame(
            rows,
            columns=["rank", "mark", "step", "what", "host", "local rank", "device", "finding"],
        )

    def column(self, ranks: Iterable[int]) -> list[str]:
        """Per rank of ``ranks``, its marks in words ("" when none): the per-rank summary's
        ``marked`` column."""
        by_rank: dict[int, list[str]] = {}
        for m in self.marks:
            by_rank.setdefault(m.rank, []).append(f"{m.label} ({m.finding})")
        for m in self.marks:
            for rank in m.received:
                by_rank.setdefault(rank, []).append(f"received from rank {m.rank} ({m.finding})")
        return ["; ".join(dict.fromkeys(by_rank.get(int(r), []))) for r in ranks]


def _int(value: Any) -> int | None:
    """``value`` as an int (a rank, a step), None when it is not one."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, numbers.Integral):  # a NumPy integer too (a rule's frame value)
        return int(value)
    if isinstance(value, numbers.Real) and float(value).is_integer():
        return int(float(value))
    return None


def _ints(values: Any) -> list[int]:
    """The ints of a list (a finding read back from JSON holds plain lists)."""
    if not isinstance(values, list | tuple):
        return []
    return [v for v in (_int(x) for x in values) if v is not None]


def _known(value: Any) -> str:
    """A host or device name as given, "" when not given or given as not known ("unknown
    host", as AMP-D06 writes it)."""
    if not isinstance(value, str) or not value or value.lower().startswith("unknown"):
        return ""
    return value


def _where(run: Run | None, rank: int, given: Mapping[str, Any]) -> tuple[str, int | None, str]:
    """The rank's host, local rank and device: from the evidence where it names them, else
    from the rank's manifest (when the run is at hand); a negative local rank is not known."""
    manifest: Mapping[str, Any] = {}
    if run is not None and not (_known(given.get("hostname")) and _known(given.get("device"))):
        manifest = next((r.manifest for r in run.ranks if r.rank == rank), {})
    host = _known(given.get("hostname")) or _known(manifest.get("hostname"))
    local = _int(given.get("local_rank"))
    if local is None or local < 0:
        local = _int(manifest.get("local_rank"))
    device = _known(given.get("device")) or _known(manifest.get("device"))
    return host, local if local is not None and local >= 0 else None, device


def _place(host: str, local: int | None, device: str) -> str:
    """``"host n1, local rank 1, cuda:1"`` (what is known of it)."""
    parts = [f"host {host}" if host else "", f"local rank {local}" if local is not None else ""]
    parts.append(device)
    return ", ".join(p for p in parts if p)


def _origin_marks(f: Finding, run: Run | None) -> tuple[list[RankMark], list[str]]:
    origin = f.evidence.get("origin")
    if not isinstance(origin, Mapping) or _int(origin.get("rank")) is None:
        return [], []
    rank = int(origin["rank"])  # type: ignore[arg-type]
    step = _int(origin.get("step"))
    what = str(origin.get("what") or "")
    layer = origin.get("layer")
    host, local, device = _where(run, rank, origin)
    short = what or "not said"
    if what == "activation" and layer:
        short = f"layer {layer}"
    elif what == "gradient" and layer:
        short = f"gradient of {layer}"
    produced = _WHAT.get(what, "a value it computed")
    if what == "activation" and layer:
        produced = f"the activation of layer {layer}"
    elif what == "gradient" and layer:
        produced = f"the local gradient of {layer}, before the reduction"
    at = f" at step {step}" if step is not None else ""
    text = f"produced the non-finite value{at}: {produced}"
    received = tuple(sorted(set(_ints(f.evidence.get("received"))) - {rank}))
    place = _place(host, local, device)
    line = f"{f.id}: rank {rank}" + (f" ({place})" if place else "") + f" {text}."
    if received:
        line += (
            f" Rank{'s' if len(received) > 1 else ''} {name_ranks(received)} received it through "
            "the collective: a non-finite value there is not of their own making."
        )
    label = f"NaN/inf origin: {short}"
    mark = RankMark(rank, "origin", f.id, step, label, text, host, local, device, received)
    return [mark], [line]


def _divergence_groups(f: Finding) -> list[Mapping[str, Any]]:
    groups = f.evidence.get("groups")
    if isinstance(groups, list | tuple):
        return [g for g in groups if isinstance(g, Mapping)]
    one = f.evidence.get("divergent")
    return [one] if isinstance(one, Mapping) else []


def _divergence_marks(f: Finding, run: Run | None) -> tuple[list[RankMark], list[str]]:
    marks: list[RankMark] = []
    lines: list[str] = []
    for g in _divergence_groups(f):
        ranks = sorted(set(_ints(g.get("ranks"))))
        if not ranks:
            continue
        step = _int(g.get("step"))
        group = sorted(set(_ints(g.get("group"))))
        params = [str(p) for p in g.get("params") or [] if isinstance(p, str)]
        shown = ", ".join(params[:4]) + (f" and {len(params) - 4} more" if len(params) > 4 else "")
        at = f" at step {step}" if step is not None else ""
        of_group = f" of replica group {name_ranks(group)}" if group else ""
        what = f": {shown}" if shown else ""
        if g.get("majority") is False:
            pair = " and ".join(str(r) for r in ranks)
            if not group or set(group) <= set(ranks):
                of_group = " (the two replicas of their group)"
            text = (
                f"ranks {pair}{of_group} hold different parameters{at}{what}; with two replicas "
                "the copy at fault cannot be told"
            )
            kind, label = "replica-pair", "replica differs (which copy cannot be told)"
        else:
            text = f"differs from the majority{of_group}{at}{what}"
            kind, label = "divergent", "divergent replica"
        for rank in ranks:
            host, local, device = _where(run, rank, {})
            marks.append(RankMark(rank, kind, f.id, step, label, text, host, local, device))
        if kind == "replica-pair":
            lines.append(f"{f.id}: {text[0].upper()}{text[1:]}.")
        else:
            who = (
                f"Rank {ranks[0]} differs"
                if len(ranks) == 1
                else f"Ranks {name_ranks(ranks)} differ"
            )
            lines.append(f"{f.id}: {who} from the majority{of_group}{at}{what}.")
    return marks, lines


def _fault_marks(f: Finding, run: Run | None) -> tuple[list[RankMark], list[str]]:
    marks: list[RankMark] = []
    lines: list[str] = []
    faults = f.evidence.get("faults")
    for fault in faults if isinstance(faults, list | tuple) else ():
        if not isinstance(fault, Mapping) or _int(fault.get("rank")) is None:
            continue
        rank = int(fault["rank"])
        step = _int(fault.get("step"))
        host, local, device = _where(run, rank, fault)
        ids = ", ".join(
            f"{k} {fault[key]}"
            for k, key in (("UUID", "uuid"), ("PCI bus", "pci_bus_id"))
            if fault.get(key)
        )
        mismatches = _int(fault.get("mismatches"))
        at = f" at step {step}" if step is not None else ""
        wrong = f" ({mismatches} wrong value{'s' if mismatches != 1 else ''})" if mismatches else ""
        text = (
            f"its device{' ' + device if device else ''}"
            + (f" ({ids})" if ids else "")
            + (f" gave a wrong known answer{at}{wrong}")
        )
        marks.append(RankMark(rank, "fault", f.id, step, "device fault", text, host, local, device))
        on = f" on host {host}" if host else ""
        lines.append(f"{f.id}: rank {rank}{on}: {text}.")
    return marks, lines


def compute_rank_marks(diagnosis: Diagnosis | None, run: Run | None = None) -> RankMarks:
    """The ranks the diagnosis's AMP-D04, AMP-D05 and AMP-D06 findings single out, from their
    evidence alone (none without such a finding; evidence without the keys the rules write
    marks nothing). ``run`` (optional) gives the host and device of a rank the evidence does
    not place (its manifest)."""
    marks: list[RankMark] = []
    lines: list[str] = []
    for f in diagnosis.findings if diagnosis is not None else ():
        if f.id == ORIGIN_FINDING:
            more, said = _origin_marks(f, run)
        elif f.id == DIVERGENCE_FINDING:
            more, said = _divergence_marks(f, run)
        elif f.id == FAULT_FINDING:
            more, said = _fault_marks(f, run)
        else:
            continue
        marks += more
        lines += said
    return RankMarks(tuple(marks), tuple(lines))


def finding_marked_ranks(finding: Finding) -> list[int]:
    """The ranks one finding marks (its origin, divergent replicas or faulty devices; never
    the ranks that received an origin's value), each once: the finding's link to the Ranks
    view names them. Empty for any other finding."""
    if finding.id == ORIGIN_FINDING:
        marks = _origin_marks(finding, None)[0]
    elif finding.id == DIVERGENCE_FINDING:
        marks = _divergence_marks(finding, None)[0]
    elif finding.id == FAULT_FINDING:
        marks = _fault_marks(finding, None)[0]
    else:
        return []
    return list(dict.fromkeys(m.rank for m in marks))
