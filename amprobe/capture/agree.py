"""The ranks of a job agree on their sampled steps through the default process group's store.

A sample taken on one rank alone stalls the others at the job's next collective, and each
rank's budget measures its own times (:mod:`amprobe.capture.budget`): ranks that decide alone
sample different steps. So in a job of several ranks rank 0 decides, and the others follow:

- at the end of each step on which a budgeted kind of sample was taken, rank 0 writes its plan
  (per kind: the next step it samples, the period, whether the next armed sample may be taken)
  under a key of the default process group's c10d store (the host TCP key-value store
  ``init_process_group`` made; ``torch.distributed.distributed_c10d._get_default_store()``);
- every other rank waits for that key (at most :data:`TIMEOUT_S`) and reads it when it first
  needs it: at the first step the plan can name (a budgeted kind's last sample plus its minimum
  period, on its grid) or an armed sample, whichever comes first; the last reader deletes it.
  By then rank 0 has usually written it long ago: the ranks met at the collectives of the
  steps in between. Between two such steps every rank's decisions are
  a pure function of the step, the config and the last plan: no store access, nothing on an
  unsampled step.

This is a store exchange, not a collective: nothing is added to the job's process group (no
all-reduce, no barrier, no device work, no device-host sync); a reader blocks on a TCP request to
the store's server, about when it would have blocked at the next collective for a rank 0 that
is still inside its step. Keys are ``amprobe/schedule/<scope>/<step>`` (the scope is the run
directory's name, the same on every rank of an ``amprobe run`` job), with a ``/read`` counter
beside each. Rank 0 also writes its scope under ``amprobe/schedule/leader`` before its first
plan, and a rank reads it before its first plan: ranks that record into run directories of
different names (``attach()`` without a ``run_dir`` names one per process) follow rank 0's. That
one key stays in the store; the plans do not. A rank whose read times out or fails (rank 0 not
recording, the store gone) decides alone from then on, and says so once
(``schedule_not_shared``; ``end.json``'s ``sampling.schedule``).
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

__all__ = ["TIMEOUT_S", "Agreement", "default_group_agreement", "multi_rank"]

#: the key under which rank 0 writes its scope before its first plan
LEADER_KEY = "amprobe/schedule/leader"

#: seconds a rank other than 0 waits for rank 0's plan before it decides alone. It reads the plan
#: at the first step the plan can name, usually steps after rank 0 wrote it; the limit covers a
#: rank 0 that is not recording or never writes (a probe that is not attached there, another run
#: directory).
TIMEOUT_S = 30.0


class Agreement:
    """One rank's side of the exchange: rank 0 publishes plans, the others read them.

    Args:
        store: a c10d ``Store`` (``set``, ``get``, ``wait``, ``add``, ``delete_key``).
        rank: this process's rank in the default process group; 0 publishes.
        world_size: ranks that read each plan (all but rank 0 do).
        scope: what every rank of the job shares (the run directory's name): the keys' prefix.
        timeout_s: how long a reader waits for a plan.
    """

    def __init__(
        self, store: Any, rank: int, world_size: int, scope: str, timeout_s: float = TIMEOUT_S
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.scope = scope
        self.prefix = f"amprobe/schedule/{scope}/"
        self.timeout = timedelta(seconds=timeout_s)
        self.cleanup_failed = False  # a store that cannot delete keys (a FileStore) keeps them
        self.leader_scope: str | None = None  # rank 0's scope, once written (rank 0) or read

    @property
    def leader(self) -> bool:
        """This rank decides (rank 0)."""
        return self.rank == 0

    def publish(self, step: int, plan: dict[str, Any]) -> None:
        """Rank 0: the plan agreed at the end of ``step``."""
        if self.leader_scope is None:
            self.store.set(LEADER_KEY, self.scope)
            self.leader_scope = self.scope
        self.store.set(f"{self.prefix}{step}", json.dumps(plan, separators=(",", ":")))

    def read(self, step: int) -> dict[str, Any]:
        """The plan rank 0 published at the end of ``step``: waits for it (raises on timeout);
        the last of the ranks that read it deletes it."""
        if self.leader_scope is None:  # the first plan: where rank 0 writes them
            self.store.wait([LEADER_KEY], self.timeout)
            self.leader_scope = self.store.get(LEADER_KEY).decode()
            self.prefix = f"amprobe/schedule/{self.leader_scope}/"
        key = f"{self.prefix}{step}"
        self.store.wait([key], self.timeout)
        plan = json.loads(self.store.get(key))
        if not isinstance(plan, dict) or plan.get("step") != step:
            raise ValueError(f"the plan under {key!r} is not step {step}'s")
        count = f"{key}/read"
        try:
            if self.store.add(count, 1) >= self.world_size - 1:
                self.store.delete_key(key)
                self.store.delete_key(count)
        except Exception:  # the plan was read: a key left behind is no reason to decide alone
            self.cleanup_failed = True
        return plan


def multi_rank() -> bool:
    """The default process group is initialized with more than one rank (a host fact: no
    communication)."""
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
    except Exception:
        return False


def default_group_agreement(scope: str) -> Agreement | None:
    """This rank's :class:`Agreement` over the default process group's store, or None in a
    single process (no process group, or one rank). Raises when the group is there but its
    store is not (the caller decides alone, and says so)."""
    if not multi_rank():
        return None
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    return Agreement(store, dist.get_rank(), dist.get_world_size(), scope)
