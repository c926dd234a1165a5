"""The ranks of a job agree on their sampled steps through the default process group's store.

A sample taken on one rank alone stalls the others at the job's next collective, and each
rank's budget measures its own times (:mod:`amprobe.capture.budget`): ranks that decide alone
sample different steps. So in a job of several ranks rank 0 decides, and the others follow:

- at the end of each step on which a budgeted kind of sample was taken, rank 0 writes its plan
  (per kind: the next step it samples, the period, whether the next armed sample may be taken)
  under a key of the default process group's c10d store (the host TCP key-value store
  ``init_process_group`` made; ``torch.distributed.distributed_c10d._get_default_store()``),
  and the same plan under a fixed key, ``latest``;
- every other rank reads the plan of its own sampled step when it first needs it: at the first
  step the plan can name (a budgeted kind's last sample plus its minimum period, on its grid)
  or an armed sample, whichever comes first; the last reader deletes it. By then rank 0 has
  usually written it long ago: the ranks met at the collectives of the steps in between.
  Where rank 0 did not sample that step (the ranks' recording windows opened at different
  steps: each rank's control watcher polls on its own) and its ``latest`` plan is of a later
  step, the rank adopts that one at once. Otherwise it waits for the key, at most
  :data:`TIMEOUT_S`: one wait per plan, never one on an unsampled step. Between two such steps
  every rank's decisions are a pure function of the step, the config and the last plan: no
  store access, nothing on an unsampled step.

This is a store exchange, not a collective: nothing is added to the job's process group (no
all-reduce, no barrier, no device work, no device-host sync); a reader blocks on a TCP request to
the store's server, about when it would have blocked at the next collective for a rank 0 that
is still inside its step. Keys are ``amprobe/schedule/<n>/<step>`` with a ``/read`` counter
beside each, and ``amprobe/schedule/<n>/latest``, where ``n`` counts the probes this process
made (:func:`next_generation`): the same on every rank of a job whose ranks attach the same
probes, different for a second probe in the same process group, whatever the run directories
are called. A read that times out or fails loses that one plan: the rank decides alone until
it can adopt rank 0's next plan (it does not wait again before it has: it takes a plan already
written, or decides alone), and says so once (``schedule_not_shared``; ``end.json``'s
``sampling.schedule``: ``fell_back``, ``plans_lost``).

What stays in the store: while the job runs, the plans a rank has not read yet and rank 0's
``latest``; plans of steps no other rank sampled (a window opened later there) until rank 0
closes. At close rank 0 deletes every plan it wrote still in the store but its last (a rank
that is slower may still read it: its last steps, after the job's last collective, run after
rank 0 closed), each other rank counts itself a reader of the plan it had not read (the last
deletes it), and the last rank to close (a ``closed`` counter) deletes ``latest``, the plan it
names and the counter: nothing is left once every rank closed, except with a store that cannot
delete keys (a ``FileStore``: ``keys_left``) or a rank that dies before it closes.
"""

from __future__ import annotations

import itertools
import json
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["TIMEOUT_S", "Agreement", "default_group_agreement", "multi_rank", "next_generation"]

#: seconds a rank other than 0 waits for the plan of its own sampled step when rank 0 wrote no
#: later one. It reads the plan at the first step the plan can name, at least one step and one
#: of the job's collectives after rank 0 ended the sampled step (and wrote the plan): a key
#: missing then is almost always one rank 0 will never write (it did not sample that step, or
#: does not record), and the wait stalls every rank at the next collective. 5 s covers a store
#: answering slowly on a loaded host and a job with no collective between the steps; what a
#: timeout costs is one plan (this rank decides alone until the next), not the agreement.
TIMEOUT_S = 5.0

_GENERATIONS = itertools.count()


def next_generation() -> int:
    """The count of probes this process made before this one (each budget takes one): the same
    on every rank of a job whose ranks attach the same probes, so it namespaces one probe's
    keys and tells them from a later probe's in the same process group."""
    return next(_GENERATIONS)


class Agreement:
    """One rank's side of the exchange: rank 0 publishes plans, the others read them.

    Args:
        store: a c10d ``Store`` (``set``, ``get``, ``check``, ``wait``, ``add``,
            ``delete_key``).
        rank: this process's rank in the default process group; 0 publishes.
        world_size: ranks that read each plan (all but rank 0 do).
        timeout_s: how long a reader waits for a plan.
        generation: the probe's :func:`next_generation`, the keys' namespace.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float = TIMEOUT_S,
        generation: int = 0,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.prefix = f"amprobe/schedule/{generation}/"
        self.latest_key = f"{self.prefix}latest"
        self.timeout = timedelta(seconds=timeout_s)
        self.cleanup_failed = False  # a store that cannot delete keys (a FileStore) keeps them
        self._written: list[int] = []  # rank 0: plans it wrote that may still be in the store

    @property
    def leader(self) -> bool:
        """This rank decides (rank 0)."""
        return self.rank == 0

    def publish(self, step: int, plan: dict[str, Any]) -> None:
        """Rank 0: the plan agreed at the end of ``step``."""
        text = json.dumps(plan, separators=(",", ":"))
        self.store.set(f"{self.prefix}{step}", text)
        self.store.set(self.latest_key, text)
        try:  # forget the plans every other rank read (they deleted them)
            self._written = [s for s in self._written if self.store.check([f"{self.prefix}{s}"])]
        except Exception:
            self.cleanup_failed = True
        self._written.append(step)

    def read(self, step: int, *, wait: bool = True) -> dict[str, Any]:
        """The plan rank 0 published at the end of ``step`` (the last of the ranks that read it
        deletes it), or, when there is none, rank 0's latest plan if it is of a later step
        (rank 0 did not sample ``step``). Else waits for ``step``'s plan (raises on timeout),
        or with ``wait`` False raises at once."""
        key = f"{self.prefix}{step}"
        if not self.store.check([key]):
            latest = self._latest()
            if latest is not None and int(latest.get("step", -1)) > step:
                return latest  # (``latest`` stays: rank 0 deletes it at close)
            if not wait:
                seen = "none" if latest is None else f"step {latest.get('step')}'s"
                raise LookupError(f"no plan for step {step} (rank 0's latest: {seen})")
            self.store.wait([key], self.timeout)
        plan = json.loads(self.store.get(key))
        if not isinstance(plan, dict) or plan.get("step") != step:
            raise ValueError(f"the plan under {key!r} is not step {step}'s")
        self._count_read(key)
        return plan

    def _latest(self) -> dict[str, Any] | None:
        if not self.store.check([self.latest_key]):
            return None
        plan = json.loads(self.store.get(self.latest_key))
        return plan if isinstance(plan, dict) else None

    def _count_read(self, key: str) -> None:
        """This rank is done with the plan under ``key``: the last of its readers deletes it."""
        count = f"{key}/read"
        try:
            if self.store.add(count, 1) >= self.world_size - 1:
                self._drop(key)
        except Exception:  # the plan was read: a key left behind is no reason to decide alone
            self.cleanup_failed = True

    def _drop(self, key: str) -> None:
        """Delete the plan under ``key`` and its readers' counter."""
        self.store.delete_key(key)
        self.store.delete_key(f"{key}/read")

    def close(self, pending: int | None = None) -> None:
        """The probe closes. Rank 0 deletes the plans it wrote that are still in the store but
        its last (another rank may still read that one: its steps after the job's last
        collective run on after rank 0 closed); another rank counts itself a reader of
        ``pending``, the plan it had not read; and the last rank to close deletes ``latest``
        and the plan it names. Never raises (a key left behind is said in ``keys_left``)."""
        store = self.store
        try:
            if self.leader:
                for step in self._written[:-1]:
                    self._drop(f"{self.prefix}{step}")
                self._written = self._written[-1:]
            elif pending is not None:
                key = f"{self.prefix}{pending}"
                if store.check([key]):
                    self._count_read(key)
            closed = f"{self.prefix}closed"
            if store.add(closed, 1) >= self.world_size:
                latest = self._latest()
                if latest is not None:
                    self._drop(f"{self.prefix}{latest.get('step')}")
                    store.delete_key(self.latest_key)
                store.delete_key(closed)
        except Exception:
            self.cleanup_failed = True


def multi_rank() -> bool:
    """The default process group is initialized with more than one rank (a host fact: no
    communication)."""
    try:
        return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
    except Exception:
        return False


def default_group_agreement(generation: int = 0) -> Agreement | None:
    """This rank's :class:`Agreement` over the default process group's store, or None in a
    single process (no process group, or one rank). Raises when the group is there but its
    store is not (the caller decides alone, and says so)."""
    if not multi_rank():
        return None
    store = dist.distributed_c10d._get_default_store()
    return Agreement(store, dist.get_rank(), dist.get_world_size(), generation=generation)
