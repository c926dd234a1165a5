"""Was a checkpoint saved while the weights or the optimizer state held inf/NaN: AMP-N18.

Reads the events of :mod:`amprobe.capture.checkpoints` (``checkpoint_saved``,
``checkpoint_nonfinite``, ``checkpoint_check_failed``) of every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from amprobe.rules.data import step_ranges
from amprobe.rules.engine import Finding, RuleContext, name_ranks, rank_fields, requirement, rule
from amprobe.store.loader import Run

__all__: list[str] = []

#: rows of the evidence's ``tensors`` table (several ranks' first tensors together)
MAX_TENSOR_ROWS = 10
#: tensor names a title lists
MAX_TITLE_TENSORS = 3


@requirement("checkpoint_saves")
def _has_checkpoint_saves(run: Run) -> str | None:
    """Met when a checkpoint save was checked; else why none was."""
    if run.events_of("checkpoint_saved") or run.events_of("checkpoint_nonfinite"):
        return None
    config = run.rank_manifest.get("config") or {}
    failed = run.events_of("checkpoint_check_failed")
    if failed:
        return (
            f"the checkpoint check failed ({failed[0].get('error')}); the saves went on unchecked"
        )
    if "checkpoint_guard" not in config:
        return "the run was recorded by an amprobe that did not check checkpoint saves"
    if config.get("checkpoint_guard") == "off":
        return 'checkpoint_guard was "off": no checkpoint save was checked'
    return (
        "no checkpoint save was seen while amprobe was attached (torch.save of a module, an "
        "optimizer or a state dict; torch.distributed.checkpoint.save; the Hugging Face "
        "Trainer's or Lightning's checkpoint save)"
    )


def _save_key(e: dict[str, Any]) -> tuple[int, str, str]:
    return int(e.get("step") or 0), str(e.get("path")), str(e.get("function"))


@rule(
    "AMP-N18",
    "poisoned-checkpoint",
    "error",
    "nan",
    requires=("checkpoint_saves",),
)
def check_poisoned_checkpoint(ctx: RuleContext) -> Iterator[Finding]:
    """A checkpoint was saved (or refused) while parameters or optimizer state held inf/NaN.

    Algorithm: the saves are grouped across ranks by (step, path, save function); the first
    save (lowest step) any rank of which held a non-finite floating tensor is the finding: its
    file, step, ranks and first tensors (names as key paths, inf and NaN counts). The last good
    checkpoint is the last save, at or before that step and before it in its rank's order, that
    every rank wrote with finite tensors (a save that was poisoned on any rank, or refused, is
    not good) and that checked at least one floating tensor over its ranks (a save of RNG state
    or of ZeRO-3's empty placeholders proves nothing). Assumes each rank's events are in
    recording order.
    """
    run = ctx.run
    poisoned = run.events_of("checkpoint_nonfinite")
    if not poisoned:
        return
    clean = run.events_of("checkpoint_saved")
    saves: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for e in poisoned:
        saves.setdefault(_save_key(e), []).append(e)
    first_key = min(saves, key=lambda k: (k[0], min(e["t"] for e in saves[k])))
    first = sorted(saves[first_key], key=lambda e: e["rank"])
    step, path, function = first_key
    ranks = [int(e["rank"]) for e in first]
    first_t = {int(e["rank"]): float(e["t"]) for e in first}
    bad_saves = set(saves)
    refused = any(bool(e.get("refused")) for e in first)
    # a collective save refused on every rank: the ranks whose own tensors were finite too
    refused_ranks = sorted(
        {int(e["rank"]) for e in first if e.get("refused")}
        | {int(e["rank"]) for e in clean if _save_key(e) == first_key and e.get("written") is False}
    )
    # the last good checkpoint: written, finite on every rank, before the first poisoned one,
    # and checked at least one tensor (over its ranks): an RNG-state dict or ZeRO-3's empty
    # placeholders prove nothing
    checked: dict[tuple[int, str, str], int] = {}
    for e in clean:
        key = _save_key(e)
        checked[key] = checked.get(key, 0) + int(e.get("tensor_count") or 0)
    good: tuple[int, float, dict[str, Any]] | None = None
    for e in clean:
        key = _save_key(e)
        if key in bad_saves or e.get("written") is False or key[0] > step or not checked[key]:
            continue
        before = first_t.get(int(e["rank"]))
        if before is not None and float(e["t"]) >= before:
            continue
        order = (key[0], float(e["t"]))
        if good is None or order > good[:2]:
            good = (key[0], float(e["t"]), e)
    last_good = good[2] if good is not None else None

    rows: list[dict[str, Any]] = []
    several = len(ranks) > 1
    for e in first:
        for t in e.get("tensors") or []:
            if len(rows) < MAX_TENSOR_ROWS:
                row = {"rank": int(e["rank"])} if several else {}
                row.update(
                    tensor=t.get("tensor"),
                    inf_count=t.get("inf_count"),
                    nan_count=t.get("nan_count"),
                    element_count=t.get("numel"),
                )
                rows.append(row)
    names = list(dict.fromkeys(str(r.get("tensor")) for r in rows))
    nonfinite = sum(int(e.get("nonfinite_tensor_count") or 0) for e in first)
    shown = ", ".join(names[:MAX_TITLE_TENSORS]) + (", …" if len(names) > MAX_TITLE_TENSORS else "")
    where = ""
    if len(run.ranks) > 1:  # (the rule names its ranks itself: the findings are not per rank)
        where = f" on {'rank' if len(ranks) == 1 else 'ranks'} {name_ranks(ranks)}"
    if refused:
        title = f"checkpoint save to {path} at step {step} refused: {nonfinite} tensor(s) held inf/NaN ({shown}){where}"
    else:
        title = f"checkpoint {path} saved at step {step} holds inf/NaN in {nonfinite} tensor(s) ({shown}){where}"
    poisoned_steps = sorted({k[0] for k in saves})
    evidence: dict[str, Any] = {
        "path": path,
        "step": step,
        "function": function,
        "refused": refused,
        "refused_ranks": refused_ranks if refused and len(run.ranks) > 1 else None,
        "nonfinite_tensor_count": nonfinite,
        "checked_tensor_count": sum(int(e.get("tensor_count") or 0) for e in first),
        "tensors": rows,
        "poisoned_save_count": len(saves),
        "poisoned_steps": poisoned_steps[:20],
        "poisoned_step_ranges": step_ranges(poisoned_steps),
        "last_good_path": last_good.get("path") if last_good else None,
        "last_good_step": int(last_good["step"]) if last_good else None,
        **rank_fields(ranks),
    }
    if last_good is not None:
        keep = (
            f"The last good checkpoint is {last_good.get('path')} (step {last_good['step']}): "
            "resume from it, not from a later one, and keep it (checkpoint rotation such as "
            "save_total_limit or ModelCheckpoint(save_top_k) may delete it)."
        )
    else:
        keep = (
            "No checkpoint with finite values was saved while amprobe was attached: resume from "
            "one saved before this run, and keep it."
        )
    guard = (
        'checkpoint_guard="raise" refused the save: nothing was written.'
        if refused
        else 'Set checkpoint_guard="raise" to refuse such saves before anything is written.'
    )
    yield ctx.finding(
        title=title,
        evidence=evidence,
        fix=(
            f"{keep} Find why the weights went non-finite (the NaN findings of this run) before "
            f"training on. {guard}"
        ),
    )
