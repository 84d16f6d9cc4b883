"""The leader's counters: every duty adds to one :class:`EngineStats`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
    """Counters since start; read by ``info``, the CLI and metrics."""

    published: int = 0
    released: int = 0
    expired: int = 0
    requeued: int = 0
    dead: int = 0
    timed_out: int = 0
    #: Dispatched jobs no worker tracks, marked sent instead of requeued.
    untracked: int = 0
    staged: int = 0
    claims: int = 0
    elections: int = 0
    step_downs: int = 0
    errors: int = 0
    planned: int = 0
    pruned_jobs: int = 0
    pruned_ledger: int = 0
    #: Running jobs of worker processes that stopped beating (the rescuer);
    #: the requeued and dead among them are in ``requeued`` / ``dead`` too.
    rescued: int = 0
    #: Rescued jobs the idempotency ledger records as completed: succeeded.
    rescued_succeeded: int = 0
    pruned_workers: int = 0
    #: Jobs whose own message could not be published (each counted an attempt).
    rejected: int = 0
    #: Late occurrences the misfire policy dropped at their first dispatch.
    missed: int = 0
    #: Jobs left dispatched because the lease ran out while publishing.
    withheld: int = 0
    #: Failed duties by name (``stage``, ``pop``, ``sweep``, ...): ``errors`` split up.
    failures: dict[str, int] = dataclasses.field(default_factory=dict)
