"""The rules engine: a table of rules, each a pure function from a loaded run to findings.

A rule is registered with :func:`rule`, which records its checklist ID, severity, category,
the data it requires (its skip condition) and its default thresholds. :func:`diagnose` runs
every rule whose data is present and lists the others as "not checked" with the reason.

A rule may name other rules in ``after``: it then runs once they have, and reads their
findings in :attr:`RuleContext.prior` (AMP-S06 lists which speed findings explain a missing
speedup this way). No rule calls :func:`diagnose`.

A rule may also declare ``explained_by``: the rules whose findings, when present in the same
diagnosis, are the cause of which this rule's finding is a symptom (AMP-N02's skipped steps
are explained by AMP-N05's overflowing layer). :func:`diagnose` then lists findings cause
first (:func:`order_cause_first`) and records on each finding which present findings it is
explained by and which it explains.

Evidence keys follow one vocabulary, documented in ``docs/evidence.md``: ``*_steps`` are
lists of step numbers (at most the first 20) and ``*_step_ranges`` the runs of all of them
(``[[120, 179]]``), counts end in ``_count``, ``rank`` is the rank
a finding is about (``ranks`` when several), and a threshold is reported under its own name.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import marshal
import re
import traceback
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from amprobe.analysis.compiled import compiled_targets
from amprobe.analysis.frames import step_ranges
from amprobe.analysis.health import compute_health
from amprobe.analysis.sampling import sampling_summary
from amprobe.analysis.scaler import distinct_step_count
from amprobe.rules.refs import checklist_ref
from amprobe.store.loader import Run
from amprobe.store.run import gc_paused

__all__ = [
    "Severity",
    "SEVERITIES",
    "CATEGORY_LABELS",
    "Finding",
    "NotChecked",
    "RuleSpec",
    "Diagnosis",
    "REGISTRY",
    "REQUIREMENTS",
    "rule",
    "requirement",
    "diagnose",
    "ThresholdError",
    "format_ranks",
    "name_ranks",
    "rank_fields",
    "group_rank_findings",
    "order_cause_first",
]


class Severity(str, enum.Enum):
    """How bad a finding is. A ``str``: compares equal to, and serializes as, its value."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def rank(self) -> int:
        """Sort key: 0 for the most severe."""
        return _SEVERITY_RANK[self]


SEVERITIES = tuple(s.value for s in Severity)
_SEVERITY_RANK = {severity: i for i, severity in enumerate(Severity)}


#: A finding's category (the checklist question it answers) -> how reports name it.
CATEGORY_LABELS: Mapping[str, str] = MappingProxyType(
    {"nan": "NaN / inf", "speed": "speed", "distributed": "distributed"}
)


class ThresholdError(ValueError):
    """An override names an unknown rule or threshold."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """One diagnosis. Immutable; renderers only read it.

    Attributes:
        id: checklist ID, e.g. ``AMP-N02`` (a public contract).
        name: the checklist's slug, e.g. ``skip-rate``.
        severity: a :class:`Severity` (``error`` | ``warning`` | ``info``).
        category: ``nan`` (why is my loss NaN), ``speed`` (why is AMP not faster),
            ``distributed``.
        title: one line with the measured value.
        evidence: measured values, thresholds, steps, layer names, ranks (keys: see
            ``docs/evidence.md``).
        fix: what the user should do.
        refs: the checklist item (``NaN checklist #9 (AMP-N09): unscale_ before clipping``)
            first, then links to the PyTorch / NVIDIA documentation that explain the fix.
        explained_by: IDs of the findings of the same diagnosis that cause this one (its rule's
            ``explained_by`` that fired), set by :func:`diagnose`; empty for a root cause.
        explains: IDs of the findings of the same diagnosis that this one causes.
    """

    id: str
    name: str
    severity: Severity
    category: str
    title: str
    evidence: Mapping[str, Any]
    fix: str
    refs: tuple[str, ...] = ()
    explained_by: tuple[str, ...] = ()
    explains: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            severity = Severity(self.severity)
        except ValueError:
            raise ValueError(f"unknown severity {self.severity!r}") from None
        object.__setattr__(self, "severity", severity)
        object.__setattr__(self, "evidence", MappingProxyType(dict(self.evidence)))
        object.__setattr__(self, "refs", tuple(self.refs))
        object.__setattr__(self, "explained_by", tuple(self.explained_by))
        object.__setattr__(self, "explains", tuple(self.explains))

    @property
    def category_label(self) -> str:
        """The category as reports name it (``NaN / inf`` for ``nan``)."""
        return CATEGORY_LABELS.get(self.category, self.category)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "severity": self.severity.value,
            "category": self.category,
            "title": self.title,
            "evidence": dict(self.evidence),
            "fix": self.fix,
            "refs": list(self.refs),
            "explained_by": list(self.explained_by),
            "explains": list(self.explains),
        }


#: how a not-checked reason starts when the rule raised (its error follows)
RULE_FAILED = "rule failed"


@dataclasses.dataclass(frozen=True)
class NotChecked:
    """A rule that could not run, and why."""

    id: str
    name: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "reason": self.reason}


RuleFn = Callable[["RuleContext"], Iterable[Finding]]


@dataclasses.dataclass(frozen=True)
class RuleSpec:
    """A registered rule: its identity, requirements and thresholds as data."""

    id: str
    name: str
    severity: Severity  # the default / highest severity it emits, for the catalogue
    category: str
    requires: tuple[str, ...]
    thresholds: Mapping[str, float]
    refs: tuple[str, ...]  # the checklist item first, then documentation links
    fn: RuleFn
    doc: str
    after: tuple[str, ...] = ()  # rules whose findings this one reads (RuleContext.prior)
    #: rules whose findings, present in the same diagnosis, cause this rule's (a symptom of them)
    explained_by: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class RuleContext:
    """What a rule function receives: the run, its thresholds and a finding factory.

    ``prior`` holds the findings of the rules named in the spec's ``after`` (empty otherwise).
    """

    run: Run
    spec: RuleSpec
    thresholds: Mapping[str, float]
    prior: tuple[Finding, ...] = ()

    def finding(
        self,
        title: str,
        evidence: Mapping[str, Any],
        fix: str,
        severity: Severity | str | None = None,
        refs: Iterable[str] = (),
    ) -> Finding:
        return Finding(
            id=self.spec.id,
            name=self.spec.name,
            severity=Severity(severity) if severity else self.spec.severity,
            category=self.spec.category,
            title=title,
            evidence=evidence,
            fix=fix,
            refs=tuple(self.spec.refs) + tuple(refs),
        )


REGISTRY: dict[str, RuleSpec] = {}

#: requirement name -> function(run) returning None when met, else the reason it is not.
REQUIREMENTS: dict[str, Callable[[Run], str | None]] = {}


def requirement(name: str) -> Callable[[Callable[[Run], str | None]], Callable[[Run], str | None]]:
    """Register a named data requirement that rules can list in ``requires``.

    A requirement is registered once, before the first rule that lists it (its module is
    imported first: the shared ones live in :mod:`amprobe.rules.data`).

    Raises:
        ValueError: ``name`` is registered already.
    """

    def register(fn: Callable[[Run], str | None]) -> Callable[[Run], str | None]:
        if name in REQUIREMENTS:
            raise ValueError(f"requirement {name!r} registered twice")
        REQUIREMENTS[name] = fn
        return fn

    return register


def rule(
    id: str,
    name: str,
    severity: Severity | str,
    category: str,
    requires: Iterable[str] = ("steps",),
    thresholds: Mapping[str, float] | None = None,
    refs: Iterable[str] = (),
    after: Iterable[str] = (),
    explained_by: Iterable[str] = (),
) -> Callable[[RuleFn], RuleFn]:
    """Register a rule function under its checklist ID.

    Args:
        requires: names of data requirements registered with :func:`requirement`.
        refs: documentation links for the fix; the checklist item
            (:func:`~amprobe.rules.refs.checklist_ref`) is put first automatically.
        after: rule IDs whose findings this rule reads from :attr:`RuleContext.prior`.
        explained_by: rule IDs whose findings, when any fired in the same run, are the cause
            of this rule's finding (it is their symptom); reports list the cause first.

    Raises:
        ValueError: at registration (import time): the ID is registered twice, the severity is
            unknown, or a name in ``requires`` is not a registered requirement.
    """
    needs = tuple(requires)
    causes = tuple(explained_by)

    def register(fn: RuleFn) -> RuleFn:
        if id in REGISTRY:
            raise ValueError(f"rule {id} registered twice")
        if id in causes:
            raise ValueError(f"rule {id} names itself in explained_by")
        unknown = [name for name in needs if name not in REQUIREMENTS]
        if unknown:
            raise ValueError(
                f"rule {id} requires {', '.join(map(repr, unknown))}, not a registered "
                f"requirement (known: {', '.join(sorted(REQUIREMENTS)) or 'none'}); register it "
                "with @requirement, or import the module that does, before the rule"
            )
        try:
            level = Severity(severity)
        except ValueError:
            raise ValueError(f"rule {id}: unknown severity {severity!r}") from None
        REGISTRY[id] = RuleSpec(
            id=id,
            name=name,
            severity=level,
            category=category,
            requires=needs,
            thresholds=MappingProxyType(dict(thresholds or {})),
            refs=(checklist_ref(id), *refs),
            fn=fn,
            doc=(fn.__doc__ or "").strip(),
            after=tuple(after),
            explained_by=causes,
        )
        return fn

    return register


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """The result of :func:`diagnose`: findings (cause first, :func:`order_cause_first`),
    skipped rules, health, and the thresholds each rule ran with (registered defaults merged
    with the overrides), so that a view judging by a rule's threshold uses the same one."""

    run: Run
    findings: tuple[Finding, ...]
    not_checked: tuple[NotChecked, ...]
    health: Mapping[str, Mapping[str, Any]]
    thresholds: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)

    def worst(self) -> Severity | None:
        """The most severe finding's severity (findings are listed cause first, not by it)."""
        return min((f.severity for f in self.findings), key=lambda s: s.rank, default=None)

    def ids(self) -> list[str]:
        return [f.id for f in self.findings]

    def step_facts(self) -> tuple[int, list[dict[str, Any]]]:
        """The run's distinct step count and compiled targets, as :meth:`to_dict` writes them
        (read from every rank's summary here; a cached diagnosis holds them)."""
        return distinct_step_count(self.run), compiled_targets(self.run)

    def to_dict(self) -> dict[str, Any]:
        run = self.run
        steps, compiled = self.step_facts()
        return {
            "run": {
                "path": str(run.path),
                "status": run.status,
                "end_reason": run.end_reason,
                **rank_fields(r.rank for r in run.ranks),
                "steps": steps,
                "device": run.rank_manifest.get("device") or "not recorded",
                "gpu_name": run.rank_manifest.get("gpu_name"),
                "compiled": compiled,
                "sampling": sampling_summary(run),
                "warnings": list(run.warnings),
            },
            "findings": [f.to_dict() for f in self.findings],
            "not_checked": [n.to_dict() for n in self.not_checked],
            "health": {k: dict(v) for k, v in self.health.items()},
        }


# a number standing alone in a text (not part of a name such as fc1 or blocks.3): 20, 27,152,
# 5.0%, 2.27e-13, -4
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[+-]?\d+)?%?(?!\w)")
#: a merged finding's ``ranks`` lists at most this many; ``rank_ranges`` then holds them all
MAX_LISTED_RANKS = 20
#: runs of ranks a title names one by one where it says which ranks differ (then a count)
MAX_NAMED_RANKS = 16
#: rows of a merged finding's ``by_rank`` (one per distinct set of values; the rest counted)
MAX_RANK_ROWS = 16
#: layer names a merged title lists where the ranks named different layers
MAX_NAMED_LAYERS = 3


def format_ranks(ranks: Iterable[int]) -> str:
    """Ranks as compact ranges: ``0-3, 7, 9-10`` (the runs of :func:`step_ranges`, written with
    a hyphen as finding titles have always named ranks)."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in step_ranges(ranks, limit=None))


def name_ranks(ranks: Iterable[int], limit: int = MAX_NAMED_RANKS) -> str:
    """Ranks as :func:`format_ranks` writes them, at most ``limit`` runs of them, then how many
    ranks there are in all: ``1, 22`` or ``3, 5-7, 9, … (40 ranks)``."""
    values = sorted(set(ranks))
    runs = step_ranges(values, limit=None)
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit])
    return text if len(runs) <= limit else f"{text}, … ({len(values):,} ranks)"


def rank_fields(ranks: Iterable[int]) -> dict[str, Any]:
    """The evidence (and run) fields naming a set of ranks, bounded at any rank count.

    ``{"ranks": [...]}`` with every rank when there are at most :data:`MAX_LISTED_RANKS`; else
    ``ranks`` holds the first of them, ``rank_ranges`` every rank as ``[first, last]`` runs (as
    ``*_step_ranges`` do for steps: a few runs when only a few ranks are left out) and
    ``rank_count`` how many there are.
    """
    values = sorted(set(ranks))
    if len(values) <= MAX_LISTED_RANKS:
        return {"ranks": values}
    return {
        "ranks": values[:MAX_LISTED_RANKS],
        "rank_ranges": step_ranges(values, limit=None),
        "rank_count": len(values),
    }


def data_key(value: Any) -> bytes | str:
    """A key equal for two plain values (dicts, lists, numbers, strings, as a summary section
    loads) only when they are equal, order included: their ``marshal`` bytes (a fifth of the
    time of ``repr``), or ``repr`` for a value marshal cannot write. Rules judge once per class
    of ranks keyed by the data they read, never by file identity."""
    try:
        return marshal.dumps(value)
    except ValueError:
        return repr(value)


def _rank_of(finding: Finding) -> int | None:
    """The rank a finding is about: its ``evidence["rank"]``, unless it already names several."""
    rank = finding.evidence.get("rank")
    if "ranks" in finding.evidence or isinstance(rank, bool) or not isinstance(rank, int):
        return None
    return rank


def _layer_names(value: Any, key: str = "") -> set[str]:
    """The layer names in a finding's evidence: every ``module`` string at any depth, and the
    strings of ``*_modules`` lists (``offending_modules``)."""
    names: set[str] = set()
    if isinstance(value, Mapping):
        for k, v in value.items():
            names |= _layer_names(v, str(k))
    elif isinstance(value, list | tuple):
        for v in value:
            if isinstance(v, str) and key.endswith("modules"):
                names.add(v)
            else:
                names |= _layer_names(v, key)
    elif isinstance(value, str) and key == "module" and value:
        names.add(value)
    return names


def _template(text: str, names: Iterable[str] = ()) -> tuple[str, list[str]]:
    """``text`` with every standalone number and every layer name in ``names`` replaced by a
    placeholder, and the replaced words in order."""
    words = sorted({n for n in names if n}, key=len, reverse=True)
    if not words:
        return _NUMBER.sub("\0", text), _NUMBER.findall(text)
    names_re = "|".join(re.escape(n) for n in words)
    pattern = re.compile(rf"(?<![\w.])(?:{names_re})(?![\w.])|{_NUMBER.pattern}")
    return pattern.sub("\0", text), [m.group(0) for m in pattern.finditer(text)]


def _number_value(text: str) -> float:
    return float(text.replace(",", "").rstrip("%"))


def _is_number(text: str) -> bool:
    return _NUMBER.fullmatch(text) is not None


def _merge_numbers(template: str, numbers: list[list[str]]) -> str:
    """Fill ``template``'s placeholders: a word shared by every rank as is, a number that
    differs as its range, layer names that differ as the first few of them."""
    parts = template.split("\0")
    out = [parts[0]]
    for i, rest in enumerate(parts[1:]):
        values = [nums[i] for nums in numbers]
        if len(set(values)) == 1:
            out.append(values[0])
        elif all(_is_number(v) for v in values):
            lo = min(values, key=_number_value)
            hi = max(values, key=_number_value)
            out.append(lo if _number_value(lo) == _number_value(hi) else f"{lo} to {hi}")
        else:
            distinct = list(dict.fromkeys(values))
            shown = distinct[:MAX_NAMED_LAYERS]
            out.append(" / ".join(shown) + (" / …" if len(distinct) > len(shown) else ""))
        out.append(rest)
    return "".join(out)


def _differ_text(ranks: list[int]) -> str:
    word = "rank" if len(ranks) == 1 else "ranks"
    verb = "differs" if len(ranks) == 1 else "differ"
    return f"{word} {name_ranks(ranks)} {verb}"


def _by_rank(group: list[Finding], ranks: list[int], differ: list[str]) -> dict[str, Any]:
    """``by_rank`` and what bounds it: one row per distinct set of the differing values, keyed
    by its ranks (``"0-21, 23-63"``), largest first; past :data:`MAX_RANK_ROWS` rows the rest
    are counted in ``by_rank_left_off`` and each numeric key's range over all ranks, with the
    ranks holding its extremes, is in ``by_rank_range``."""
    rows: dict[str, tuple[list[int], dict[str, Any]]] = {}
    for rank, f in zip(ranks, group, strict=True):
        values = {k: f.evidence.get(k) for k in differ}
        key = json.dumps(values, sort_keys=True, default=str)
        rows.setdefault(key, ([], values))[0].append(rank)
    ordered = sorted(rows.values(), key=lambda row: (-len(row[0]), row[0][0]))
    out: dict[str, Any] = {
        "by_rank": {format_ranks(rs): values for rs, values in ordered[:MAX_RANK_ROWS]}
    }
    if len(ordered) > MAX_RANK_ROWS:
        rest = [r for rs, _ in ordered[MAX_RANK_ROWS:] for r in rs]
        out["by_rank_left_off"] = {
            "row_count": len(ordered) - MAX_RANK_ROWS,
            "rank_count": len(rest),
        }
        spans: dict[str, Any] = {}
        for k in differ:
            pairs = [
                (v, r)
                for r, f in zip(ranks, group, strict=True)
                if isinstance(v := f.evidence.get(k), int | float) and not isinstance(v, bool)
            ]
            if not pairs:
                continue
            lo = min(v for v, _ in pairs)
            hi = max(v for v, _ in pairs)
            spans[k] = {
                "min": lo,
                "min_ranks": name_ranks(r for v, r in pairs if v == lo),
                "max": hi,
                "max_ranks": name_ranks(r for v, r in pairs if v == hi),
            }
        if spans:
            out["by_rank_range"] = spans
    return out


def group_rank_findings(
    findings: list[Finding], name_rank: bool = False, run_ranks: Iterable[int] | None = None
) -> list[Finding]:
    """Merge the per-rank findings of one kind into one finding naming the ranks.

    A job of hundreds of ranks whose ranks all overflow at the same steps would otherwise list
    the same finding hundreds of times. The rank a finding is about is a field of its
    evidence (``evidence["rank"]``), never read from its title: rules write titles without
    the rank and this function says where. Findings are of one kind when their ID and severity
    agree and their titles and fixes agree once every standalone number and every layer name
    of their evidence (``module``, ``*_modules``) is set aside. The merged finding names its
    ranks in ``evidence["ranks"]`` (bounded: :func:`rank_fields`) and its title ends with "on
    ranks 0-255". Where the ranks measured different numbers, the title gives each number's
    range over the ranks ("cut 2 to 5 time(s)"), layer names that differ are listed ("fc1 /
    fc2"), and ``evidence["by_rank"]`` holds the evidence values that differ, one row per
    distinct set of them keyed by its ranks (:func:`_by_rank`). When more than half of the
    run's ranks (``run_ranks``, else the group's) agree on every number and name but not all
    of them, the title is theirs and names the others: "... on 1,020 of 1,024 ranks; ranks
    17, 301 differ: cut 6 time(s) ...; ranks 555, 880 differ" (first the ranks of this kind
    with other numbers, then the ranks without this finding); the evidence is then that of
    the lowest agreeing rank. A kind only one rank reported keeps its finding, its title
    ending with "on rank N" when ``name_rank`` (a run of several ranks). Findings without a
    ``rank`` in their evidence, or that already name their ``ranks``, are returned unchanged.
    """
    groups: dict[tuple[Any, ...], list[Finding]] = {}
    order: list[tuple[Any, ...] | int] = []
    # each finding's layer names, and each (text, names) template, worked out once: thousands
    # of ranks' findings mostly share their words (the findings live through the call, so
    # their ids stay theirs)
    names_of: dict[int, frozenset[str]] = {}
    templates: dict[tuple[str, frozenset[str]], tuple[str, list[str]]] = {}

    def layer_names(f: Finding) -> frozenset[str]:
        if id(f) not in names_of:
            names_of[id(f)] = frozenset(_layer_names(f.evidence))
        return names_of[id(f)]

    def template(text: str, names: frozenset[str] = frozenset()) -> tuple[str, list[str]]:
        """:func:`_template` (its words a fresh list for each caller)."""
        key = (text, names)
        if key not in templates:
            templates[key] = _template(text, names)
        done = templates[key]
        return done[0], list(done[1])

    for i, f in enumerate(findings):
        if _rank_of(f) is None:
            order.append(i)
            continue
        names = layer_names(f)
        key = (f.id, f.severity, template(f.title, names)[0], template(f.fix, names)[0])
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(f)
    every = sorted(set(run_ranks)) if run_ranks is not None else None
    # the ranks each rule found something on, in any group: a rank with another finding of the
    # same rule (other words, a layer of its own) is not one "without this finding"
    with_id: dict[str, set[int]] = {}
    for f in findings:
        if (r := _rank_of(f)) is not None:
            with_id.setdefault(f.id, set()).add(r)
    out: list[Finding] = []
    for item in order:
        if isinstance(item, int):
            out.append(findings[item])
            continue
        group = groups[item]
        ranks = [_rank_of(f) for f in group]
        if len(set(ranks)) == len(ranks):
            out += _merge_group(
                group, True, name_rank, every, with_id.get(group[0].id), layer_names, template
            )
            continue
        # a rank with several of this kind (one per layer): merge only the same layers' findings
        split: dict[tuple[str, str], list[Finding]] = {}
        for f in group:
            split.setdefault((template(f.title)[0], template(f.fix)[0]), []).append(f)
        for part in split.values():
            out += _merge_group(
                part, False, name_rank, every, with_id.get(part[0].id), layer_names, template
            )
    return out


def _merge_group(
    group: list[Finding],
    by_name: bool,
    name_rank: bool,
    every: list[int] | None,
    with_id: set[int] | None = None,
    layer_names: Callable[[Finding], Iterable[str]] = lambda f: _layer_names(f.evidence),
    template: Callable[..., tuple[str, list[str]]] = _template,
) -> list[Finding]:
    """:func:`group_rank_findings` for one kind: ``group`` holds findings of one template (with
    the layer names set aside when ``by_name``); ``with_id``: the ranks with any finding of
    this rule, in this group or another; ``layer_names`` and ``template``:
    :func:`_layer_names` of a finding's evidence and :func:`_template` (the caller's cached
    ones)."""
    members = []
    title_t = fix_t = ""
    for f in sorted(group, key=lambda f: _rank_of(f) or 0):
        names = layer_names(f) if by_name else frozenset()
        title_t, title_words = template(f.title, names)
        fix_t, fix_words = template(f.fix, names)
        members.append((f, title_words, fix_words))
    ranks = [_rank_of(f) or 0 for f, _, _ in members]
    if len(group) == 1 or len(set(ranks)) < len(ranks):
        # one rank, or several of one kind on a rank (not per-rank copies): each its own
        return [
            dataclasses.replace(f, title=f"{f.title} on rank {_rank_of(f)}") if name_rank else f
            for f in group
        ]
    variants: dict[tuple[str, ...], list[int]] = {}
    for i, (_, words, _) in enumerate(members):
        variants.setdefault(tuple(words), []).append(i)
    major = max(variants.values(), key=len)  # the first largest: its lowest rank first
    total = sorted(set(every) | set(ranks)) if every is not None else ranks
    if len(major) * 2 > len(total) and len(major) < len(total):
        first = members[major[0]][0]
        title = _merge_numbers(title_t, [members[major[0]][1]])
        title += f" on {len(major):,} of {len(total):,} ranks"
        in_major = set(major)
        others = [i for i in range(len(members)) if i not in in_major]
        if others:
            title += f"; {_differ_text([ranks[i] for i in others])}: "
            title += _merge_numbers(title_t, [members[i][1] for i in others])
        absent = sorted(set(total) - set(ranks) - (with_id or set()))
        if absent:
            # a rank without this finding is not known to differ (the rule may not have
            # judged it there): say only that the finding is not on it
            word = "rank" if len(absent) == 1 else "ranks"
            title += f"; not on {word} {name_ranks(absent)}"
    else:
        first = members[0][0]
        title = _merge_numbers(title_t, [words for _, words, _ in members])
        title += f" on ranks {format_ranks(ranks)}"
    fix = _merge_numbers(fix_t, [words for _, _, words in members])
    found = [f for f, _, _ in members]
    evidence: dict[str, Any] = {**first.evidence, "rank": _rank_of(first), **rank_fields(ranks)}
    keys = [k for k in first.evidence if k != "rank"]
    keys += [k for f in found for k in f.evidence if k != "rank" and k not in keys]

    def differs(k: str) -> bool:
        values = [f.evidence.get(k) for f in found]
        if all(v is values[0] for v in values):
            return False  # one object (findings copied per class of ranks): written alike
        # JSON written once per distinct value: equal marshal bytes load back to equal values
        texts: set[str] = set()
        distinct: dict[bytes, Any] = {}
        for v in values:
            try:
                distinct.setdefault(marshal.dumps(v), v)
            except ValueError:  # not a plain value (marshal cannot write it)
                texts.add(json.dumps(v, sort_keys=True, default=str))
        texts |= {json.dumps(v, sort_keys=True, default=str) for v in distinct.values()}
        return len(texts) > 1

    differ = [k for k in dict.fromkeys(keys) if differs(k)]
    if differ:
        evidence.update(_by_rank(found, ranks, differ))
    return [dataclasses.replace(first, title=title, fix=fix, evidence=evidence)]


def _severity_key(finding: Finding) -> tuple[int, str]:
    return finding.severity.rank, finding.id


def order_cause_first(findings: Iterable[Finding]) -> list[Finding]:
    """Findings ordered cause first, each carrying its present causes and symptoms.

    A finding is explained by the present findings whose IDs its rule declares in
    ``explained_by`` (:func:`rule`); a root is a finding that none explains. Roots come in
    severity order (most severe first; of one severity, those that explain a present finding
    first; then by ID), each followed by the findings it explains,
    in severity order too. A symptom with several present causes comes after the last of them,
    so that every cause stands above its symptoms. Findings caught in a cycle of causes (none
    a root) follow in severity order. Every finding gets ``explained_by`` and ``explains``: the
    IDs of the present findings that cause it and that it causes.
    """
    ordered = sorted(findings, key=_severity_key)
    present = {f.id for f in ordered}
    causes = {
        f.id: tuple(
            c
            for c in (REGISTRY[f.id].explained_by if f.id in REGISTRY else ())
            if c in present and c != f.id
        )
        for f in ordered
    }
    effects: dict[str, list[str]] = {rid: [] for rid in present}
    for rid in dict.fromkeys(f.id for f in ordered):  # severity order, one per ID
        for cause in causes[rid]:
            effects[cause].append(rid)
    by_id: dict[str, list[Finding]] = {}
    for f in ordered:
        by_id.setdefault(f.id, []).append(f)
    out: list[Finding] = []
    placed: set[str] = set()

    def place(rid: str) -> None:
        placed.add(rid)
        out.extend(
            dataclasses.replace(f, explained_by=causes[rid], explains=tuple(effects[rid]))
            for f in by_id[rid]
        )
        for symptom in effects[rid]:
            if symptom not in placed and all(c in placed for c in causes[symptom]):
                place(symptom)

    # roots of one severity: those that explain a present finding first (a cause with its
    # symptoms above a finding that stands alone)
    for f in sorted(ordered, key=lambda f: (f.severity.rank, not effects[f.id], f.id)):
        if f.id not in placed and not causes[f.id]:
            place(f.id)
    for f in ordered:  # a cycle of causes has no root: keep severity order
        if f.id not in placed:
            place(f.id)
    return out


def _rank_count(run: Run) -> int:
    """How many ranks the run has: its rank folders, or the ranks its steps came from."""
    with_steps = sum(1 for s in run.summaries().values() if (s.get("steps") or {}).get("rows"))
    return max(len(run.ranks), with_steps)


def resolve_thresholds(
    overrides: Mapping[str, Mapping[str, float]] | None,
) -> dict[str, dict[str, float]]:
    """Merge user overrides into the registered defaults.

    Raises:
        ThresholdError: an override names an unknown rule or threshold.
    """
    merged = {rid: dict(spec.thresholds) for rid, spec in REGISTRY.items()}
    for rid, values in (overrides or {}).items():
        if rid not in merged:
            raise ThresholdError(f"unknown rule {rid!r} in threshold overrides")
        for key, value in values.items():
            if key not in merged[rid]:
                known = ", ".join(sorted(merged[rid])) or "none"
                raise ThresholdError(f"rule {rid} has no threshold {key!r} (known: {known})")
            merged[rid][key] = float(value)
    return merged


def _ordered(wanted: set[str] | None) -> tuple[list[str], set[str]]:
    """Rule IDs in run order (a rule after the rules it reads) and the IDs to report.

    Rules named in a wanted rule's ``after`` run too, so that it can read their findings, but
    are reported only when wanted themselves.
    """
    report = set(REGISTRY) if wanted is None else set(wanted) & set(REGISTRY)
    needed = set(report)
    for rid in list(report):
        needed.update(r for r in REGISTRY[rid].after if r in REGISTRY)
    first = [rid for rid in REGISTRY if rid in needed and not REGISTRY[rid].after]
    later = [rid for rid in REGISTRY if rid in needed and REGISTRY[rid].after]
    return first + later, report


def diagnose(
    run: Run,
    thresholds: Mapping[str, Mapping[str, float]] | None = None,
    only: Iterable[str] | None = None,
) -> Diagnosis:
    """Run the rules over a loaded run.

    Args:
        run: from :func:`amprobe.load_run`.
        thresholds: ``{rule_id: {threshold: value}}`` overriding the defaults.
        only: restrict to these rule IDs.

    Returns:
        A :class:`Diagnosis`; a rule that fails is reported as not checked, never raised.
    """
    # the cyclic collector paused for the diagnosis: the summaries of thousands of ranks are
    # millions of small containers, and each collection the rules' allocations set off would
    # walk them all again (3 s of 13 at 4,096 ranks); nothing the rules build is kept in cycles
    with gc_paused():
        return _diagnose(run, thresholds, only)


def _diagnose(
    run: Run,
    thresholds: Mapping[str, Mapping[str, float]] | None,
    only: Iterable[str] | None,
) -> Diagnosis:
    merged = resolve_thresholds(thresholds)
    order, report = _ordered(set(only) if only is not None else None)
    by_rule: dict[str, list[Finding]] = {}
    skipped: list[NotChecked] = []
    cache: dict[str, str | None] = {}
    several_ranks = _rank_count(run) > 1
    run_ranks = [r.rank for r in run.ranks]
    for rid in order:
        spec = REGISTRY[rid]
        reason = None
        for req in spec.requires:
            if req not in cache:
                cache[req] = REQUIREMENTS[req](run)
            if cache[req]:
                reason = cache[req]
                break
        if reason:
            if rid in report:
                skipped.append(NotChecked(rid, spec.name, reason))
            continue
        prior = tuple(f for r in spec.after for f in by_rule.get(r, ()))
        ctx = RuleContext(run=run, spec=spec, thresholds=MappingProxyType(merged[rid]), prior=prior)
        try:
            by_rule[rid] = group_rank_findings(
                list(spec.fn(ctx)), name_rank=several_ranks, run_ranks=run_ranks or None
            )
        except Exception as exc:  # a rule bug must not hide the other findings
            where = traceback.extract_tb(exc.__traceback__)[-1]
            if rid in report:
                skipped.append(
                    NotChecked(
                        rid,
                        spec.name,
                        f"{RULE_FAILED}: {type(exc).__name__}: {exc} (line {where.lineno})",
                    )
                )
    findings = [f for rid in REGISTRY if rid in report for f in by_rule.get(rid, ())]
    findings = order_cause_first(findings)
    skipped.sort(key=lambda n: list(REGISTRY).index(n.id))
    return Diagnosis(
        run=run,
        findings=tuple(findings),
        not_checked=tuple(skipped),
        health=compute_health(run),
        thresholds=MappingProxyType({rid: MappingProxyType(v) for rid, v in merged.items()}),
    )
