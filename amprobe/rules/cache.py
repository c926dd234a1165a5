"""The cached diagnosis: a run's :class:`~amprobe.rules.engine.Diagnosis` kept as a derived
artifact of the run (:mod:`amprobe.store.artifacts`), and read back instead of diagnosing again
while nothing it depends on changed.

:func:`diagnose_cached` is what the readers call (the dashboard's run page, ``amprobe report``);
``amprobe diagnose`` computes every time and writes the artifact for them
(``reuse=False``). The artifact is ``derived/diagnosis-<options>.json`` next to the derived
Parquet files (the user cache when the run folder is read-only), one per set of options.

**The key.** An artifact is read only under the key it was written with, a hash of:

- every file of the run its readers read (:func:`amprobe.store.artifacts.source_entries`: the
  run manifest; each rank's manifest, end marker, summary record and tables, by path relative
  to the run, size and ``mtime_ns``; a ``stat`` each, nothing read), and the same of the FP32
  baseline run a run names (AMP-S06 and the health metrics read it);
- amprobe's version, and its code as imported (size and ``mtime_ns`` of each module of the
  package: a development tree changes without a new version);
- the rules' registry as data: each rule's ID, name, severity, category, requirements,
  references, ``after`` and ``explained_by``, and the requirements registered;
- the options that change findings: the thresholds each rule runs with (the defaults merged
  with the user's overrides) and ``only``.

A live run (a rank's process still running) is neither read from nor written to the cache: its
files change at every flush, and its page diagnoses it again as before.

**What is kept.** The findings (every field; the evidence with its Python types: tuples, maps
with other than string keys, NumPy scalars and NaN come back as they were), the rules not
checked, the health metrics, the thresholds, the warnings the diagnosis added to the run's
(:attr:`Run.warnings` after loading), and the facts of the run its readers show next to the
findings, which are read from every rank's summary (:func:`compute_run_facts`: step count, last
step, autocast dtypes, compiled targets, why no step can be read). A value of any other type in
a finding makes the diagnosis uncacheable: it is returned, never stored, so that what is read
back is always what was computed. The what-if records of ``diagnose --format json`` are not
kept: no reader takes them from here (``diagnose`` computes them; the dashboard's and the
report's what-if views read the what-if frame, not the records).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from amprobe.analysis.compare import baseline_path
from amprobe.analysis.compiled import compiled_targets
from amprobe.analysis.overview import autocast_dtype_text, distinct_step_count, lost_steps
from amprobe.rules.engine import (
    REGISTRY,
    REQUIREMENTS,
    RULE_FAILED,
    Diagnosis,
    Finding,
    NotChecked,
    diagnose,
    resolve_thresholds,
)
from amprobe.store.artifacts import (
    code_fingerprint,
    fingerprint,
    read_artifact,
    source_entries,
    write_artifact,
)
from amprobe.store.run import Run, gc_paused
from amprobe.version import __version__

__all__ = [
    "CACHE_VERSION",
    "CachedDiagnosis",
    "UncacheableError",
    "artifact_name",
    "compute_run_facts",
    "diagnose_cached",
    "diagnosis_key",
    "decode_diagnosis",
    "encode_diagnosis",
    "load_diagnosis",
    "run_facts",
    "store_diagnosis",
]

#: Version of the cached diagnosis's payload; an artifact of another version is never read.
CACHE_VERSION = 1
_ARTIFACT_PREFIX = "diagnosis"

#: Sources entries: ``(path relative to the run, size, mtime_ns, ctime_ns)``
Sources = Sequence[tuple[str, int, int, int]]


class UncacheableError(ValueError):
    """A diagnosis holds a value the cache cannot give back as it was (it is not stored)."""


@dataclasses.dataclass(frozen=True)
class CachedDiagnosis(Diagnosis):
    """A :class:`Diagnosis` with the run's facts its readers show beside it
    (:func:`compute_run_facts`), computed with it or read from the cache (``from_cache``).

    :meth:`to_dict` gives what :meth:`Diagnosis.to_dict` gives, the facts read from
    :attr:`facts` instead of every rank's summary."""

    facts: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    from_cache: bool = False

    def step_facts(self) -> tuple[int, list[dict[str, Any]]]:
        return self.facts["steps"], [dict(t) for t in self.facts["compiled"]]


# -- the facts shown beside the findings -------------------------------------------------------
def compute_run_facts(run: Run) -> dict[str, Any]:
    """What a run's readers show beside its findings that every rank's summary (or events) is
    read for: ``steps`` (distinct steps), ``last_step``, ``dtype`` (the autocast dtypes as
    text), ``compiled`` (the compiled targets), ``lost_steps`` (why a run without a readable
    step has none; empty when it has steps). Computed once per run."""

    def compute(run: Run) -> dict[str, Any]:
        steps = distinct_step_count(run)
        return {
            "steps": steps,
            "last_step": run.last_step,
            "dtype": autocast_dtype_text(run),
            "compiled": compiled_targets(run),
            "lost_steps": [] if steps else lost_steps(run),
        }

    facts: dict[str, Any] = run.cached("run_facts", compute)
    return facts


def run_facts(diagnosis: Diagnosis) -> Mapping[str, Any]:
    """The facts of :func:`compute_run_facts` for a diagnosis: kept with it when it is a
    :class:`CachedDiagnosis`, else computed from its run."""
    if isinstance(diagnosis, CachedDiagnosis) and diagnosis.facts:
        return diagnosis.facts
    return compute_run_facts(diagnosis.run)


# -- values with their types, as JSON ----------------------------------------------------------
# a JSON object of one key that is one of these tags stands for a value JSON has no form for
_TUPLE, _MAP, _PROXY, _NUMPY, _FLOAT = "\x00tuple", "\x00map", "\x00proxy", "\x00numpy", "\x00float"
_TAGS = frozenset({_TUPLE, _MAP, _PROXY, _NUMPY, _FLOAT})
_NUMPY_KINDS = frozenset("biuf")  # bool, signed and unsigned integers, floats


def _encode(value: Any) -> Any:
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {_FLOAT: repr(value)}
    if kind is list:
        return [_encode(v) for v in value]
    if kind is tuple:
        return {_TUPLE: [_encode(v) for v in value]}
    if kind is dict or kind is MappingProxyType:
        items = value.items()
        if (
            kind is dict
            and all(type(k) is str for k in value)
            and not (len(value) == 1 and next(iter(value)) in _TAGS)
        ):
            return {k: _encode(v) for k, v in items}
        pairs = [[_encode(k), _encode(v)] for k, v in items]
        return {(_MAP if kind is dict else _PROXY): pairs}
    if isinstance(value, np.generic) and value.dtype.kind in _NUMPY_KINDS:
        item = value.item()
        text = repr(item) if isinstance(item, float) else item
        return {_NUMPY: [value.dtype.str, text]}
    raise UncacheableError(f"a value of type {kind.__module__}.{kind.__qualname__}")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, body),) = value.items()
        if tag == _TUPLE:
            return tuple(_decode(v) for v in body)
        if tag == _MAP:
            return {_key(k): _decode(v) for k, v in body}
        if tag == _PROXY:
            return MappingProxyType({_key(k): _decode(v) for k, v in body})
        if tag == _FLOAT:
            return float(body)
        if tag == _NUMPY:
            dtype = np.dtype(body[0])
            if dtype.kind not in _NUMPY_KINDS:
                raise ValueError(f"not a numeric dtype: {body[0]!r}")
            item = float(body[1]) if dtype.kind == "f" else body[1]
            return dtype.type(item)
    return {k: _decode(v) for k, v in value.items()}


def _key(value: Any) -> Any:
    key = _decode(value)
    hash(key)  # a map key must be hashable (a list is not): a damaged artifact raises here
    return key


def encode_diagnosis(
    diagnosis: Diagnosis, facts: Mapping[str, Any], warnings: Sequence[str]
) -> dict[str, Any]:
    """The payload of a cached diagnosis (JSON-encodable).

    Raises:
        UncacheableError: a finding, a health metric or a fact holds a value whose type the
            cache cannot give back (anything but None, bool, int, float, str, list, tuple,
            dict, mapping proxy and NumPy bool, integer and float scalars).
    """
    return {
        "version": CACHE_VERSION,
        "findings": [
            {
                "id": f.id,
                "name": f.name,
                "severity": f.severity.value,
                "category": f.category,
                "title": f.title,
                "evidence": _encode(dict(f.evidence)),
                "fix": f.fix,
                "refs": list(f.refs),
                "explained_by": list(f.explained_by),
                "explains": list(f.explains),
            }
            for f in diagnosis.findings
        ],
        "not_checked": [[n.id, n.name, n.reason] for n in diagnosis.not_checked],
        "health": _encode(diagnosis.health),
        "thresholds": _encode({rid: dict(v) for rid, v in diagnosis.thresholds.items()}),
        "warnings": list(warnings),
        "facts": _encode(dict(facts)),
    }


def decode_diagnosis(payload: Any, run: Run) -> CachedDiagnosis:
    """The diagnosis of ``run`` that :func:`encode_diagnosis` gave ``payload`` for (the run's
    warnings are not touched: see :func:`load_diagnosis`).

    Raises:
        ValueError, TypeError, KeyError: ``payload`` is not such a payload (damaged).
    """
    if not isinstance(payload, dict) or payload.get("version") != CACHE_VERSION:
        raise ValueError("not a cached diagnosis of this version")
    findings = tuple(
        Finding(
            id=str(f["id"]),
            name=str(f["name"]),
            severity=f["severity"],
            category=str(f["category"]),
            title=str(f["title"]),
            evidence=_decode(f["evidence"]),
            fix=str(f["fix"]),
            refs=tuple(map(str, f["refs"])),
            explained_by=tuple(map(str, f["explained_by"])),
            explains=tuple(map(str, f["explains"])),
        )
        for f in payload["findings"]
    )
    not_checked = tuple(NotChecked(str(a), str(b), str(c)) for a, b, c in payload["not_checked"])
    thresholds = MappingProxyType(
        {str(rid): MappingProxyType(dict(v)) for rid, v in _decode(payload["thresholds"]).items()}
    )
    health = _decode(payload["health"])
    facts = _decode(payload["facts"])
    _check_shape(health, facts)
    return CachedDiagnosis(
        run=run,
        findings=findings,
        not_checked=not_checked,
        health=health,
        thresholds=thresholds,
        facts=facts,
        from_cache=True,
    )


def _check_shape(health: Any, facts: Any) -> None:
    """What the readers take from a cached diagnosis without checking is what a computed one
    holds (a damaged or forged file must be computed again, not fail a page later)."""

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    ok = (
        isinstance(health, Mapping)
        and all(isinstance(k, str) and isinstance(v, Mapping) for k, v in health.items())
        and isinstance(facts, dict)
        and is_int(facts.get("steps"))
        and (facts.get("last_step") is None or is_int(facts.get("last_step")))
        and isinstance(facts.get("dtype"), str)
        and isinstance(facts.get("compiled"), list)
        and all(isinstance(t, dict) for t in facts["compiled"])
        and isinstance(facts.get("lost_steps"), list)
        and all(isinstance(line, str) for line in facts["lost_steps"])
    )
    if not ok:
        raise ValueError("damaged cached diagnosis")


# -- the key -----------------------------------------------------------------------------------
def _registry_fingerprint() -> str:
    """The rules' registry as data (the thresholds are in the options)."""
    return fingerprint(
        {
            "rules": [
                [
                    spec.id,
                    spec.name,
                    spec.severity.value,
                    spec.category,
                    list(spec.requires),
                    list(spec.refs),
                    list(spec.after),
                    list(spec.explained_by),
                ]
                for spec in REGISTRY.values()
            ],
            "requirements": sorted(REQUIREMENTS),
        }
    )


def _options(
    thresholds: Mapping[str, Mapping[str, float]] | None, only: Iterable[str] | None
) -> dict[str, Any]:
    return {
        "thresholds": _encode(resolve_thresholds(thresholds)),
        "only": None if only is None else sorted(set(only)),
    }


def artifact_name(
    thresholds: Mapping[str, Mapping[str, float]] | None = None, only: Iterable[str] | None = None
) -> str:
    """The artifact's name for these options: ``diagnosis-<hash of the options>`` (a diagnosis
    with other thresholds is kept beside, not over, the default one)."""
    return f"{_ARTIFACT_PREFIX}-{fingerprint(_options(thresholds, only))[:16]}"


def diagnosis_key(
    run: Run,
    thresholds: Mapping[str, Mapping[str, float]] | None = None,
    only: Iterable[str] | None = None,
    sources: Sources | None = None,
) -> str:
    """The key a diagnosis of ``run`` with these options is kept under (see the module's
    docstring). ``sources``: the run's :func:`~amprobe.store.artifacts.source_entries`, when
    listed already (best before the run was loaded: a file written after the listing then
    makes the key stale, never the diagnosis older than its key).

    Raises:
        ThresholdError: an override names an unknown rule or threshold.
    """
    if sources is None:
        sources = source_entries(run.path)
    baseline = baseline_path(run)
    return fingerprint(
        {
            "cache_version": CACHE_VERSION,
            "amprobe": __version__,
            "code": code_fingerprint(),
            "registry": _registry_fingerprint(),
            "options": _options(thresholds, only),
            "sources": fingerprint([list(e) for e in sources]),
            "baseline": (
                None
                if baseline is None
                else [str(baseline), fingerprint([list(e) for e in source_entries(baseline)])]
            ),
        }
    )


# -- reading, writing, and the readers' entry point -------------------------------------------
def _add_warnings(run: Run, warnings: Iterable[str]) -> None:
    for line in warnings:
        if line not in run.warnings:
            run.warnings.append(line)


def load_diagnosis(
    run: Run,
    thresholds: Mapping[str, Mapping[str, float]] | None = None,
    only: Iterable[str] | None = None,
    sources: Sources | None = None,
) -> CachedDiagnosis | None:
    """The cached diagnosis of ``run`` with these options, when one is fresh (its key is the
    key of the run's files now), else None. The warnings the diagnosis added to the run's are
    added to ``run.warnings`` (each once). A live run has none.

    Raises:
        ThresholdError: an override names an unknown rule or threshold.
    """
    if run.status == "live":
        return None
    key = diagnosis_key(run, thresholds, only, sources)
    return _read(run, artifact_name(thresholds, only), key)


def _read(run: Run, name: str, key: str) -> CachedDiagnosis | None:
    payload = read_artifact(run, name, key)
    if payload is None:
        return None
    try:
        with gc_paused():
            diagnosis = decode_diagnosis(payload, run)
        warnings = [str(w) for w in payload["warnings"]]
    except (
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        IndexError,
        RecursionError,
        OverflowError,
    ):
        return None  # damaged: computed again, and replaced
    _add_warnings(run, warnings)
    return diagnosis


def store_diagnosis(
    diagnosis: Diagnosis,
    facts: Mapping[str, Any],
    warnings: Sequence[str],
    thresholds: Mapping[str, Mapping[str, float]] | None = None,
    only: Iterable[str] | None = None,
    key: str | None = None,
) -> Path | None:
    """Keep ``diagnosis`` (of ``diagnosis.run``, with these options) and the ``warnings`` it
    added to the run's as the run's cached diagnosis under ``key`` (default: the key of the
    run's files now). Returns the file, or None when nothing was written: a live run, a value
    the cache cannot give back as it was (:class:`UncacheableError`), no folder writable."""
    run = diagnosis.run
    if run.status == "live":
        return None
    try:
        payload = encode_diagnosis(diagnosis, facts, warnings)
    except UncacheableError:
        return None
    if key is None:
        key = diagnosis_key(run, thresholds, only)
    return write_artifact(run, artifact_name(thresholds, only), key, payload)


def diagnose_cached(
    run: Run,
    thresholds: Mapping[str, Mapping[str, float]] | None = None,
    only: Iterable[str] | None = None,
    *,
    reuse: bool = True,
    store: bool = True,
    sources: Sources | None = None,
    compute: Callable[[Run], Diagnosis] | None = None,
    not_kept: Iterable[str] | None = None,
) -> CachedDiagnosis:
    """:func:`amprobe.diagnose` of ``run``, read from the cache when a fresh one is there
    (``reuse``), else computed and then kept there (``store``; never for a live run).

    Args:
        sources: the run's :func:`~amprobe.store.artifacts.source_entries`, listed before the
            run was loaded (listed here when not given).
        compute: what diagnoses the run when the cache has no fresh diagnosis (default:
            :func:`~amprobe.rules.engine.diagnose` with ``thresholds`` and ``only``); it must
            diagnose with the same options.
        not_kept: the run's warnings that are not the diagnosis's, so not kept with it
            (default: the run's warnings now): those of its load, and the caller's own (the
            CLI adds the collectors switched off, which the dashboard does not show); a
            warning the caller's reads added since the load (a damaged line in a table)
            is kept, as the diagnosis would have added it.

    Raises:
        ThresholdError: an override names an unknown rule or threshold.
    """
    # the cyclic collector paused throughout, as for the diagnosis: what the run read before
    # (a CLI reads every rank's events first) or the diagnosis left are millions of objects,
    # and a full collection that the key's or the facts' allocations set off would walk them
    # all (2.5 s at 4,096 ranks)
    with gc_paused():
        return _diagnose_cached(run, thresholds, only, reuse, store, sources, compute, not_kept)


def _diagnose_cached(
    run: Run,
    thresholds: Mapping[str, Mapping[str, float]] | None,
    only: Iterable[str] | None,
    reuse: bool,
    store: bool,
    sources: Sources | None,
    compute: Callable[[Run], Diagnosis] | None,
    not_kept: Iterable[str] | None,
) -> CachedDiagnosis:
    live = run.status == "live"
    key = None
    if not live and (reuse or store):
        key = diagnosis_key(run, thresholds, only, sources)
    if reuse and key is not None:
        cached = _read(run, artifact_name(thresholds, only), key)
        if cached is not None:
            return cached
    before = set(run.warnings if not_kept is None else not_kept)
    if compute is None:
        diagnosis = diagnose(run, thresholds=thresholds, only=only)
    else:
        diagnosis = compute(run)
    facts = compute_run_facts(run)
    added = [w for w in run.warnings if w not in before]
    computed = CachedDiagnosis(
        run=run,
        findings=diagnosis.findings,
        not_checked=diagnosis.not_checked,
        health=diagnosis.health,
        thresholds=diagnosis.thresholds,
        facts=facts,
    )
    # a rule that failed (a transient error: files, memory) is not kept, so the next read
    # runs it again rather than showing 'rule failed' until the run changes
    failed = any(n.reason.startswith(RULE_FAILED) for n in diagnosis.not_checked)
    if store and key is not None and not failed:
        store_diagnosis(computed, facts, added, thresholds, only, key)
    return computed
