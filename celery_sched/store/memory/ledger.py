"""An in-memory :class:`~celery_sched.interfaces.Ledger` for unit tests.

It mirrors :class:`~celery_sched.store.postgres.ledger.PostgresLedger`
(``tests/contract/test_ledger_contract.py`` runs against both): one lock
stands in for row locks and transactions, the injectable ``clock`` plays
Postgres ``now()``, and results are kept as JSON text, as JSONB keeps them.
:meth:`MemoryLedger.transaction` yields a :class:`MemoryTransaction` instead
of a database connection: it has nothing to roll back but the completion.
Given the memory job store (``jobs``), it applies the delivery fence as the
PostgreSQL ledger does by reading the job row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence

from celery_sched.errors import LedgerConflict
from celery_sched.interfaces import Jobs, Ledger
from celery_sched.models import (
    ClaimOutcome,
    DeliveryCheck,
    LedgerClaim,
    LedgerEntry,
    LedgerState,
    delivery_fence,
)
from celery_sched.store.memory.jobs import MemoryJobs
from celery_sched.timeutil import UTC


def _utcnow() -> dt.datetime:
    return dt.datetime.now(UTC)


@dataclasses.dataclass
class _Row:
    key: str
    state: LedgerState
    job_id: uuid.UUID | None
    owner: str | None
    lease_expires_at: dt.datetime | None
    attempts: int
    result: str | None
    created_at: dt.datetime
    completed_at: dt.datetime | None = None


@dataclasses.dataclass
class MemoryTransaction:
    """What :meth:`MemoryLedger.transaction` yields in place of a connection."""

    key: str
    owner: str


class MemoryLedger(Ledger):
    """Ledger rows in a dict, guarded by one lock.

    ``jobs``: the job store whose rows the delivery fence reads (without
    it, no delivery is fenced).
    """

    def __init__(
        self, clock: Callable[[], dt.datetime] | None = None, *, jobs: Jobs | None = None
    ) -> None:
        self._clock = clock or _utcnow
        self._lock = threading.RLock()
        self._rows: dict[str, _Row] = {}
        self.jobs = jobs

    def _now(self) -> dt.datetime:
        value = self._clock()
        if value.tzinfo is None:
            raise ValueError("MemoryLedger clock must return an aware datetime")
        return value.astimezone(UTC)

    def acquire(
        self,
        key: str,
        *,
        owner: str,
        lease: float,
        job_id: uuid.UUID | None = None,
        attempt: int | None = None,
        take_completed: bool = False,
        due_at: dt.datetime | None = None,
    ) -> LedgerClaim:
        with self._lock:
            check = DeliveryCheck() if job_id is None else self._check(job_id, attempt, due_at)
            if check.reason is not None:
                return LedgerClaim(outcome=ClaimOutcome.FENCED, reason=check.reason)
            claim = self._take(key, owner, lease, job_id, take_completed)
            if check.adopted is None:
                return claim
            return dataclasses.replace(claim, adopted=check.adopted)

    def _take(
        self,
        key: str,
        owner: str,
        lease: float,
        job_id: uuid.UUID | None,
        take_completed: bool,
    ) -> LedgerClaim:
        with self._lock:
            now = self._now()
            until = now + dt.timedelta(seconds=lease)
            row = self._rows.get(key)
            if row is None or (
                take_completed
                and row.state == LedgerState.COMPLETED
                and job_id is not None
                and row.job_id is not None
                and row.job_id != job_id
            ):
                self._rows[key] = _Row(key, LedgerState.RUNNING, job_id, owner, until, 1, None, now)
                return LedgerClaim(outcome=ClaimOutcome.ACQUIRED, attempts=1)
            if row.state == LedgerState.COMPLETED:
                return LedgerClaim(
                    outcome=ClaimOutcome.COMPLETED,
                    attempts=row.attempts,
                    holder=row.owner,
                    result=None if row.result is None else json.loads(row.result),
                    result_recorded=row.result is not None,
                    completed_at=row.completed_at,
                )
            assert row.lease_expires_at is not None
            if row.lease_expires_at <= now:
                row.owner = owner
                row.lease_expires_at = until
                row.attempts += 1
                row.job_id = job_id if job_id is not None else row.job_id
                return LedgerClaim(outcome=ClaimOutcome.ACQUIRED, attempts=row.attempts)
            if row.owner == owner:
                return LedgerClaim(outcome=ClaimOutcome.ACQUIRED, attempts=row.attempts)
            return LedgerClaim(
                outcome=ClaimOutcome.HELD,
                attempts=row.attempts,
                holder=row.owner,
                retry_in=max(0.0, (row.lease_expires_at - now).total_seconds()),
            )

    def check_delivery(
        self, job_id: uuid.UUID, attempt: int | None, *, due_at: dt.datetime | None = None
    ) -> DeliveryCheck:
        check = self._check(job_id, attempt, due_at)
        if due_at is None or self.jobs is None:
            return check
        # No row at the message's due time: looked for as a message without
        # the header is (the PostgreSQL ledger's second statement).
        job = self.jobs.get_by_id(job_id)
        if job is None or job.due_at == due_at:
            return check
        moved = self._check(job_id, attempt, None)
        return dataclasses.replace(moved, due_at=job.due_at)

    def _check(
        self, job_id: uuid.UUID, attempt: int | None, due_at: dt.datetime | None
    ) -> DeliveryCheck:
        """The fence by ``due_at`` only (``acquire``'s single statement)."""
        if self.jobs is None:
            return DeliveryCheck()
        if isinstance(self.jobs, MemoryJobs):
            job, adopted = self.jobs.adopt_delivery(job_id, attempt, due_at)
        else:
            job = self.jobs.get_by_id(job_id)
            if job is not None and due_at is not None and job.due_at != due_at:
                job = None
            adopted = None
        if job is None or adopted is not None:
            return DeliveryCheck(adopted=adopted)
        return DeliveryCheck(reason=delivery_fence(job.status, job.attempt, attempt))

    def renew(self, held: Sequence[tuple[str, str]], *, lease: float) -> set[str]:
        with self._lock:
            until = self._now() + dt.timedelta(seconds=lease)
            owners = {owner for _, owner in held}
            renewed: set[str] = set()
            for key, _ in held:
                row = self._rows.get(key)
                if row is not None and row.state == LedgerState.RUNNING and row.owner in owners:
                    row.lease_expires_at = until
                    renewed.add(key)
            return renewed

    def complete(
        self,
        key: str,
        *,
        owner: str,
        result: str | None = None,
        job_id: uuid.UUID | None = None,
    ) -> bool:
        if result is not None:
            json.loads(result)  # JSONB refuses what is not JSON
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                # The take was lost: this owner ran, so record it.
                now = self._now()
                row = self._rows[key] = _Row(
                    key, LedgerState.RUNNING, job_id, owner, None, 1, None, now
                )
            if row.owner != owner:
                return False
            row.state = LedgerState.COMPLETED
            row.lease_expires_at = None
            row.completed_at = row.completed_at or self._now()
            if result is not None:
                row.result = result
            return True

    def release(self, key: str, *, owner: str) -> bool:
        with self._lock:
            row = self._rows.get(key)
            if row is None or row.owner != owner or row.state != LedgerState.RUNNING:
                return False
            del self._rows[key]
            return True

    @contextlib.contextmanager
    def transaction(
        self, key: str, *, owner: str, job_id: uuid.UUID | None = None
    ) -> Iterator[MemoryTransaction]:
        yield MemoryTransaction(key=key, owner=owner)
        if not self.complete(key, owner=owner, job_id=job_id):
            raise LedgerConflict(
                f"idempotency key {key!r} was taken over by another execution (this "
                "one's lease expired); its transaction was rolled back"
            )

    def get(self, key: str) -> LedgerEntry | None:
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                return None
            return LedgerEntry(
                key=row.key,
                state=row.state,
                job_id=row.job_id,
                owner=row.owner,
                lease_expires_at=row.lease_expires_at,
                attempts=row.attempts,
                result=None if row.result is None else json.loads(row.result),
                result_recorded=row.result is not None,
                created_at=row.created_at,
                completed_at=row.completed_at,
            )

    def prune(self, *, older_than: float, batch: int, max_batches: int | None = None) -> int:
        if batch < 1:
            raise ValueError("prune batch must be at least 1")
        total = 0
        batches = 0
        for state in (LedgerState.COMPLETED, LedgerState.RUNNING):
            while max_batches is None or batches < max_batches:
                with self._lock:
                    cutoff = self._now() - dt.timedelta(seconds=older_than)
                    victims = [
                        row.key
                        for row in self._rows.values()
                        if row.state == state and _older(row, cutoff)
                    ][:batch]
                    for key in victims:
                        del self._rows[key]
                total += len(victims)
                batches += 1
                if len(victims) < batch:
                    break
        return total

    def close(self) -> None:
        """Nothing to release; present for interface parity."""


def _older(row: _Row, cutoff: dt.datetime) -> bool:
    """Whether a row aged past ``cutoff``, measured as the Postgres prune does."""
    stamp = row.completed_at if row.state == LedgerState.COMPLETED else row.lease_expires_at
    return stamp is not None and stamp < cutoff
