"""Job keys, unique across the partitions of ``jobs``.

A partitioned table's unique indexes must hold its partition key, so
``jobs`` can only promise ``(id, due_at)`` unique. ``job_keys (key PRIMARY
KEY, job_id)`` (migration 0012) makes keys unique across partitions. Which
jobs take an entry (:func:`key_entry`):

- every job with a caller-chosen key (``order:42``, an occurrence's
  ``name@instant``): the entry is the key;
- a job keyed by its id whose id is not a version-7 UUID: a caller's UUID
  given as the key (Celery task ids are version 4); the entry is the id's
  text;
- not a job keyed by a version-7 id in a bulk load: celery_sched generates
  those (time ordered, 74 random bits), unique by construction, for every
  job scheduled without a key, the bulk case. ``add_job`` of such an id
  looks it up in every partition (a job loaded in bulk has no entry) and
  then takes the id's entry, which a single insert can afford; the entry
  serializes it with any other writer of the id, in bulk or not. A
  version-7 UUID a caller chose as the key is not generated:
  ``Client.schedule_many``'s rows keep its text (``JobBuilder.build_row``),
  so it takes an entry like any caller key. Only ``JobStore.load_jobs`` of
  bare :class:`NewJob` values, which cannot tell a chosen id from a
  generated one, treats it as generated.

Each insert path takes the entry first, in the job's transaction:
``add_job`` inserts it (a taken key is a unique violation on
``job_keys_pkey``: :class:`~celery_sched.errors.DuplicateJob`; with
``if_exists="return"`` ``ON CONFLICT DO NOTHING``, then the job holding it is
read); ``load_jobs`` COPYs a segment's entries after its jobs, in key order (a
taken key fails the load, as the unique index did; two loads sharing keys
take them in one order, so they wait for each other, never deadlock), except the jobs whose id the
caller chose, which it holds back and COPYs after their entries: two
writers of one such id due the same time also meet on its row (the primary
key), and in opposite orders they would deadlock; periodic occurrences take theirs
with ``ON CONFLICT DO NOTHING`` and only the jobs whose key was free are
inserted. Two writers of one key serialize on its entry, as they did on the
old unique index.

Deleting a job deletes its entry (prune, withdrawn occurrences, a dropped
partition), matched on both key and job id so that an entry a new job took
after the old one finished is never removed with it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Text, Uuid, bindparam, cast, delete, func, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from celery_sched.models import NewJob, id_of_key
from celery_sched.store.postgres.statements import Tables


def key_entry(key: str | None, job_id: uuid.UUID) -> str | None:
    """The ``job_keys`` entry of a job row with ``key`` (as stored: None
    when keyed by its id) and ``job_id``; None when it takes none."""
    if key is not None:
        return key
    # The version nibble, read off the integer: cheaper than UUID.version.
    return None if (job_id.int >> 76) & 0xF == 7 else str(job_id)


def entry_of(jobs: Any) -> ColumnElement[str]:
    """:func:`key_entry` in SQL, for rows (or a CTE of deleted rows) of jobs
    (a row keyed by its v7 id has no entry; matching its text finds none)."""
    return func.coalesce(jobs.c.key, cast(jobs.c.id, Text))


def stored_key(job: NewJob) -> str | None:
    """What ``jobs.key`` holds for ``job``: None when the key is its id's text
    (``NewJob`` guarantees that a key which is a UUID's text is its id)."""
    return None if id_of_key(job.key) is not None else job.key


class JobKeys:
    """The ``job_keys`` statements of one schema."""

    def __init__(self, tables: Tables) -> None:
        keys = tables.job_keys
        self.table = keys
        self.take = pg_insert(keys).values(key=bindparam("p_key"), job_id=bindparam("p_id"))
        self.take_if_free = self.take.on_conflict_do_nothing().returning(keys.c.key)
        pairs = select(
            func.unnest(bindparam("p_keys", type_=ARRAY(Text))).label("key"),
            func.unnest(bindparam("p_ids", type_=ARRAY(Uuid))).label("job_id"),
        )
        # A job keyed by its v7 id: ids are unique only with their due time
        # in jobs, and a bulk load's generated ids take no entry, so a single
        # insert looks the id up in every partition before taking its entry.
        jobs = tables.jobs
        self.id_taken = select(jobs.c.id).where(jobs.c.id == bindparam("p_id")).limit(1)
        self.take_free = (
            pg_insert(keys)
            .from_select(["key", "job_id"], pairs)
            .on_conflict_do_nothing()
            .returning(keys.c.key)
        )

    def is_free(self, conn: Connection, job: NewJob, *, or_raise: bool) -> bool:
        """Take ``job``'s entry (keyed by a v7 id: the id's text, once no
        partition holds the id); whether its key was free. ``or_raise``: a
        taken key raises the unique violation (DuplicateJob) instead. Two
        writers of one key, whichever the path, serialize on the entry."""
        entry = key_entry(stored_key(job), job.id)
        if entry is None:
            if conn.execute(self.id_taken, {"p_id": job.id}).first() is not None:
                return False
            entry = str(job.id)
        params = {"p_key": entry, "p_id": job.id}
        if or_raise:
            conn.execute(self.take, params)
            return True
        return conn.execute(self.take_if_free, params).first() is not None

    def take_free_keys(self, conn: Connection, pairs: Sequence[tuple[str, uuid.UUID]]) -> set[str]:
        """Take the free keys of ``(key, job_id)`` pairs; return those taken now."""
        if not pairs:
            return set()
        params = {"p_keys": [key for key, _ in pairs], "p_ids": [job_id for _, job_id in pairs]}
        return set(conn.execute(self.take_free, params).scalars())

    def free_jobs(self, conn: Connection, jobs: Sequence[NewJob]) -> list[NewJob]:
        """``jobs`` whose key was free, now taken for them (and those keyed
        by their id); a job whose key is taken is left out."""
        keyed = [(entry, job.id) for job in jobs if (entry := key_entry(stored_key(job), job.id))]
        taken = self.take_free_keys(conn, keyed)
        free: list[NewJob] = []
        for job in jobs:
            key = key_entry(stored_key(job), job.id)
            if key is None:
                free.append(job)
            elif key in taken:
                taken.discard(key)  # one job per key, should a batch repeat one
                free.append(job)
        return free


def release_keys(tables: Tables, gone: Any) -> Any:
    """The CTE deleting the ``job_keys`` entries of the jobs of ``gone`` (a
    CTE of deleted jobs returning ``key`` and ``id``); add it to the
    statement with ``add_cte`` (PostgreSQL runs every data-changing CTE)."""
    keys = tables.job_keys
    return (
        delete(keys)
        .where(keys.c.key == entry_of(gone), keys.c.job_id == gone.c.id)
        .returning(keys.c.key)
        .cte("released")
    )
