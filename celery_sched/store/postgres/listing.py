"""Listing jobs and requeueing them by hand on PostgreSQL: the statements of
``sched jobs``, ``sched dead`` and ``sched requeue`` (and the web console).

How a listing finds its rows, so that a page costs about its own size on a
table of millions, with no index added on the insert path:

- **Pending only** (``--status pending``, the big set): the partial index
  ``jobs_pending_due_idx (shard, due_bucket, due_at) WHERE status =
  'pending'`` is ordered by due time within each shard, not across shards.
  So the statement first finds the shards that have pending jobs with a
  loose index scan (a recursive CTE of ``min(shard) ... WHERE shard >
  previous``, one index probe per shard), then reads at most ``limit``
  rows per shard through a ``LATERAL`` index scan in due order (backwards
  for ``--newest``), and sorts those ``shards x limit`` rows. The due range
  and the page cursor are turned into bounds on ``due_bucket`` and
  ``due_at``, so each shard's scan starts where the page starts.
- **Dead only** (``sched dead``, ``requeue --all-dead``): the partial index
  ``jobs_dead_idx (due_at, id) WHERE status = 'dead'`` (migration 0008)
  gives the order and the cursor's row comparison directly. Rows enter it
  only when they die, so neither COPY nor claims pay for it (a partial
  index takes no entry for a row version outside its predicate).
- **Any other filter**: the matching rows are read (the dispatched,
  running and retrying statuses have small partial indexes; one status is
  rendered as a literal so the planner can prove them) and sorted top-N.
  A listing of every job, or of finished ones, reads those rows once per
  page: an index on ``due_at`` over the whole table would cost every
  insert and every claim an entry, for a command run by hand.
- **Key prefix**: the key index ``jobs_key_idx`` (per partition) is a B-tree in the
  database's collation. Under a code-point collation (``C``, ``POSIX``,
  ``C.UTF-8``) every key starting with ``p`` sorts in ``[p, p')`` with
  ``p'`` the prefix with its last character incremented, so that range is
  searched in the index; under any other collation the range would miss
  keys and only ``starts_with`` is used (a scan). A keyless job's key is
  its id's text, so a prefix that can begin a UUID's text also searches
  the primary key over the ids it can begin.

Task filters are applied to the rows the index gives (a rare task makes the
scan longer, never wrong).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Integer,
    Select,
    Table,
    Text,
    Uuid,
    and_,
    any_,
    bindparam,
    column,
    func,
    literal_column,
    or_,
    select,
    table,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from celery_sched.models import (
    REQUEUABLE_STATUSES,
    Job,
    JobQuery,
    JobStatus,
    PageCursor,
    RequeueResult,
    id_of_key,
    requeued_allowance,
)
from celery_sched.store.postgres.statements import (
    PENDING,
    _minute_of,
    job_columns,
    job_key,
)
from celery_sched.timeutil import to_bucket

#: Database collations under which text sorts by code point, as the key
#: prefix's index range needs.
CODE_POINT_COLLATIONS = frozenset({"C", "POSIX", "C.UTF-8", "C.utf8", "ucs_basic"})

_DEAD: ColumnElement[str] = literal_column("'dead'")
_UUID_TEMPLATE = "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
_HEX = frozenset("0123456789abcdef")
_MAX_INT32 = 2**31 - 1


def status_literal(status: JobStatus) -> ColumnElement[str]:
    """``status`` rendered into the SQL, so a partial index can be proven."""
    return literal_column(f"'{status.value}'")


def prefix_end(prefix: str) -> str | None:
    """The least string above every string starting with ``prefix`` in
    code-point order (``None``: there is none)."""
    chars = list(prefix)
    while chars:
        code = ord(chars[-1]) + 1
        if 0xD800 <= code <= 0xDFFF:  # no surrogates in PostgreSQL text
            code = 0xE000
        if code <= 0x10FFFF:
            chars[-1] = chr(code)
            return "".join(chars)
        chars.pop()
    return None


def uuid_bounds(prefix: str) -> tuple[uuid.UUID, uuid.UUID] | None:
    """The least and greatest UUID whose canonical text starts with
    ``prefix``, or ``None`` when no UUID's text does."""
    if len(prefix) > len(_UUID_TEMPLATE):
        return None
    for char, slot in zip(prefix, _UUID_TEMPLATE, strict=False):
        if (slot == "-") != (char == "-") or (slot == "x" and char not in _HEX):
            return None
    rest = _UUID_TEMPLATE[len(prefix) :]
    return uuid.UUID(prefix + rest.replace("x", "0")), uuid.UUID(prefix + rest.replace("x", "f"))


class Listing:
    """The listing and requeue statements of one schema's ``jobs`` table."""

    def __init__(self, jobs: Table) -> None:
        self.jobs = jobs
        self.columns = job_columns(jobs)
        c = jobs.c
        now = func.now()
        allowance = bindparam("p_allowance", type_=Integer)
        self.requeue_values: dict[str, Any] = {
            "status": PENDING,
            "attempt": c.attempt + 1,
            # requeued_allowance in SQL (capped at the column's range).
            "max_attempts": func.least(
                c.attempt + 1 + func.coalesce(allowance, c.max_attempts), _MAX_INT32
            ),
            "due_at": now,
            "due_bucket": _minute_of(now),
            "dispatched_at": None,
            "started_at": None,
            "finished_at": None,
        }
        requeuable = c.status.in_([status_literal(s) for s in sorted(REQUEUABLE_STATUSES)])
        self.requeue_keys = (
            update(jobs)
            .where(
                or_(
                    c.key == any_(bindparam("p_keys", type_=ARRAY(Text))),
                    and_(c.key.is_(None), c.id == any_(bindparam("p_ids", type_=ARRAY(Uuid)))),
                ),
                requeuable,
            )
            .values(**self.requeue_values)
            .returning(*self.columns)
        )
        self.statuses_of_keys = select(job_key(jobs), c.status).where(
            or_(
                c.key == any_(bindparam("p_keys", type_=ARRAY(Text))),
                and_(c.key.is_(None), c.id == any_(bindparam("p_ids", type_=ARRAY(Uuid)))),
            )
        )

        # -- the web console's overview --
        # A range of jobs_due_idx: the jobs due in the window, whatever their
        # status, grouped by due minute.
        minute = func.date_trunc("minute", c.due_at, "UTC")
        lag = func.greatest(func.extract("epoch", c.dispatched_at - c.due_at), 0)
        self.dispatches_by_minute = (
            select(minute, func.count(), func.avg(lag))
            .where(
                c.due_at >= bindparam("p_since"),
                c.due_at < bindparam("p_until"),
                c.dispatched_at.is_not(None),
                c.status != status_literal(JobStatus.RETRYING),
            )
            .group_by(minute)
        )
        # jobs_failed_idx read backwards (0011): only failing rows are in it.
        self.recent_failures = (
            select(*self.columns)
            .where(
                c.status.in_([status_literal(s) for s in sorted(REQUEUABLE_STATUSES)]),
                c.finished_at.is_not(None),
            )
            .order_by(c.finished_at.desc(), c.id.desc())
            .limit(bindparam("p_limit"))
        )

    # -- listing --------------------------------------------------------------

    def conditions(
        self,
        query: JobQuery,
        after: PageCursor | None,
        *,
        code_point_keys: bool,
        buckets: bool,
    ) -> list[ColumnElement[bool]]:
        """The WHERE terms of ``query`` past ``after`` (statuses excepted).

        ``buckets``: also bound ``due_bucket``, the leading due column of
        the pending index, so that its scan starts and ends at the page.
        """
        c = self.jobs.c
        terms: list[ColumnElement[bool]] = []
        if query.task is not None:
            terms.append(c.task == query.task)
        if query.key_prefix is not None:
            terms.append(self._key_prefix(query.key_prefix, code_point_keys))
        low, high = query.due_after, query.due_before
        if after is not None:
            mark = tuple_(c.due_at, c.id)
            at = tuple_(
                bindparam("p_after_due", after.due_at, type_=c.due_at.type),
                bindparam("p_after_id", after.id, type_=c.id.type),
            )
            if query.newest:
                terms.append(mark < at)
                high = after.due_at if high is None else min(high, after.due_at)
                terms.append(c.due_at <= after.due_at)
            else:
                terms.append(mark > at)
                low = after.due_at if low is None else max(low, after.due_at)
        if low is not None:
            terms.append(c.due_at >= low)
            if buckets:
                terms.append(c.due_bucket >= to_bucket(low))
        if query.due_before is not None:
            terms.append(c.due_at < query.due_before)
        if high is not None and buckets:
            terms.append(c.due_bucket <= to_bucket(high))
        return terms

    def _key_prefix(self, prefix: str, code_point_keys: bool) -> ColumnElement[bool]:
        c = self.jobs.c
        chosen: list[ColumnElement[bool]] = [func.starts_with(c.key, prefix)]
        if code_point_keys:
            chosen.append(c.key >= prefix)
            end = prefix_end(prefix)
            if end is not None:
                chosen.append(c.key < end)
        matches: ColumnElement[bool] = and_(*chosen)
        bounds = uuid_bounds(prefix)
        if bounds is not None:
            matches = or_(matches, and_(c.key.is_(None), c.id.between(*bounds)))
        return matches

    def order(self, table: Any, newest: bool) -> list[Any]:
        if newest:
            return [table.c.due_at.desc(), table.c.id.desc()]
        return [table.c.due_at, table.c.id]

    def select_page(
        self, query: JobQuery, after: PageCursor | None, limit: int, *, code_point_keys: bool
    ) -> Select[Any]:
        """The statement of one page (see the module's docstring for the plan)."""
        jobs = self.jobs
        c = jobs.c
        if query.statuses == {JobStatus.PENDING}:
            return self._pending_page(query, after, limit, code_point_keys=code_point_keys)
        terms = self.conditions(query, after, code_point_keys=code_point_keys, buckets=False)
        if len(query.statuses) == 1:
            (only,) = query.statuses
            terms.append(c.status == status_literal(only))
        elif query.statuses:
            terms.append(c.status.in_([status_literal(s) for s in sorted(query.statuses)]))
        return (
            select(*self.columns)
            .where(*terms)
            .order_by(*self.order(jobs, query.newest))
            .limit(limit)
        )

    def _pending_page(
        self, query: JobQuery, after: PageCursor | None, limit: int, *, code_point_keys: bool
    ) -> Select[Any]:
        jobs = self.jobs
        c = jobs.c
        # The shards holding pending jobs, one index probe each.
        other = jobs.alias("other")
        shards = select(func.min(c.shard).label("shard")).where(c.status == PENDING)
        shards_cte = shards.cte("shards", recursive=True)
        following = (
            select(other.c.shard)
            .where(other.c.status == PENDING, other.c.shard > shards_cte.c.shard)
            .order_by(other.c.shard)
            .limit(1)
            .scalar_subquery()
        )
        shards_cte = shards_cte.union_all(select(following).where(shards_cte.c.shard.is_not(None)))
        terms = self.conditions(query, after, code_point_keys=code_point_keys, buckets=True)
        bucket_order = [c.due_bucket.desc()] if query.newest else [c.due_bucket]
        per_shard = (
            select(*self.columns)
            .where(c.status == PENDING, c.shard == shards_cte.c.shard, *terms)
            .order_by(*bucket_order, *self.order(jobs, query.newest))
            .limit(limit)
            .lateral("page")
        )
        return (
            select(*per_shard.c)
            .select_from(shards_cte.join(per_shard, true()))
            .order_by(*self.order(per_shard, query.newest))
            .limit(limit)
        )

    # -- requeues by hand ---------------------------------------------------------

    def requeue_dead(self, task: str | None) -> Any:
        """The requeue of one batch of dead jobs (``p_died_by``, ``p_limit``,
        ``p_allowance``): soonest due first through ``jobs_dead_idx``, rows
        locked by anybody else skipped."""
        c = self.jobs.c
        batch = (
            select(c.id)
            .where(c.status == _DEAD, c.finished_at <= bindparam("p_died_by"))
            .order_by(c.due_at, c.id)
            .limit(bindparam("p_limit"))
            .with_for_update(skip_locked=True)
        )
        if task is not None:
            batch = batch.where(c.task == bindparam("p_task"))
        # A CTE, run once: as an IN subquery the planner may run it again
        # per row, each time past the rows this statement already moved.
        chosen = batch.cte("batch")
        return (
            update(self.jobs)
            .where(c.id == chosen.c.id, c.status == _DEAD)
            .values(**self.requeue_values)
            .returning(*self.columns)
        )


def key_arrays(keys: Sequence[str]) -> dict[str, list[Any]]:
    """``p_keys`` / ``p_ids`` of ``keys``: a key that is a UUID's text is
    also looked up as a keyless job's id (see ``statements.key_matches``)."""
    ids = [job_id for key in keys if (job_id := id_of_key(key)) is not None]
    return {"p_keys": list(keys), "p_ids": ids}


def requeue_result(
    keys: Sequence[str], requeued: list[Job], statuses: dict[str, str]
) -> RequeueResult:
    """The :class:`RequeueResult` of ``keys`` given the jobs moved and the
    statuses of the keys found."""
    moved = {job.key for job in requeued}
    result = RequeueResult(requeued=requeued)
    for key in dict.fromkeys(keys):
        if key in moved:
            continue
        status = statuses.get(key)
        if status is None:
            result.unknown.append(key)
        else:
            result.refused[key] = JobStatus(status)
    return result


def check_allowance(allowance: int | None) -> None:
    if allowance is not None:
        requeued_allowance(0, 1, allowance)


def read_collation(conn: Connection) -> str:
    """The database's default collation (the key column has no other)."""
    databases = table("pg_database", column("datname"), column("datcollate"), schema="pg_catalog")
    value: Any = conn.execute(
        select(databases.c.datcollate).where(databases.c.datname == func.current_database())
    ).scalar_one()
    return str(value)
