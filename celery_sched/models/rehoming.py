"""What a pass that moves job rows to the shard their key hashes to returns."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Callable, Iterable

from celery_sched.models.jobs import JobStatus


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Rehomed:
    """One unfinished job moved (or, in a dry run, that would move) to the
    shard its key hashes to under the current shard count."""

    id: uuid.UUID
    status: JobStatus
    due_at: dt.datetime
    from_shard: int
    to_shard: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RehomeResult:
    """One batch of :meth:`~celery_sched.interfaces.Jobs.rehome`.

    ``scanned``: unfinished rows read. ``moved``: the rows whose shard
    changed (a row that finished or moved meanwhile is not among them).
    ``after``: where the next batch of a full pass starts; None when this
    batch read the last rows (a stranded-only batch never has one: moved
    rows leave the set it reads).
    """

    scanned: int = 0
    moved: tuple[Rehomed, ...] = ()
    after: uuid.UUID | None = None

    def __post_init__(self) -> None:
        if self.scanned < 0:
            raise ValueError("scanned must not be negative")


#: A job row as a resharding pass reads it: ``(id, key, shard, status,
#: due_at)``, the key as the client hashed it (a keyless job's is its id's text).
RehomeRow = tuple[uuid.UUID, str, int, str, dt.datetime]


def misplaced(
    rows: Iterable[RehomeRow], *, shards: int, shard_of: Callable[[str], int]
) -> list[Rehomed]:
    """The rows of ``rows`` not in the shard ``shard_of`` gives their key,
    each with where it belongs.

    Raises :class:`ValueError` when ``shard_of`` names a shard outside
    ``[0, shards)``: a row moved there would be stranded again (and a
    stranded-only pass would never end).
    """
    found = []
    for job_id, key, shard, status, due_at in rows:
        target = shard_of(key)
        if not 0 <= target < shards:
            raise ValueError(f"shard_of({key!r}) is {target}, outside [0, {shards})")
        if target != shard:
            found.append(
                Rehomed(
                    id=job_id,
                    status=JobStatus(status),
                    due_at=due_at,
                    from_shard=int(shard),
                    to_shard=target,
                )
            )
    return found


def check_rehome(*, shards: int, limit: int) -> None:
    """Refuse arguments no resharding pass can run with."""
    if shards < 1:
        raise ValueError(f"the shard count must be at least 1, got {shards}")
    if limit < 1:
        raise ValueError(f"the batch size must be at least 1, got {limit}")
