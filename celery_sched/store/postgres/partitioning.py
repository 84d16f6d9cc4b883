"""The partitions of one schema's ``jobs`` table: which exist, creating the
ones an insert needs, and dropping finished ones (issue #17).

``jobs`` is range-partitioned by ``due_at`` (migration 0012) with no DEFAULT
partition, so a row can only be written once a partition holds its due time.
Every insert path (``add_job``, the COPY of ``load_jobs``, the planner's
occurrences, a requeue by hand that moves a job to now) first asks
:meth:`Partitions.ensure` for its due times; the answer comes from a cached
list of the existing ranges (read, when cold, on the connection the caller
already holds), so the common case costs no query. What is missing is
created and committed in a transaction of its own on a connection apart
(:meth:`~celery_sched.store.postgres.connection.Database.apart`), never in
the caller's: a long bulk load holds no lock a creator needs, and a caller
holding a pooled connection never waits for a second one. Creation runs
under an advisory lock that serializes creators across processes, as a
plain table then attached: ``ATTACH PARTITION`` takes only a SHARE UPDATE
EXCLUSIVE lock on ``jobs`` (claims and inserts go on), where ``CREATE TABLE
... PARTITION OF`` would take an ACCESS EXCLUSIVE one. A partition whose
insert then rolls back stays, empty. The layout (which range holds a due
time) is :mod:`celery_sched.store.partitions`; a due time that an existing
coarser or finer partition already holds is left to it.

A partition made by hand whose name is not its range's (or that has no
range of due times) is logged once and left alone: its bounds still count
as taken, so nothing is created over them, but it is never dropped.

Retention (:meth:`Partitions.drop_finished`): a partition whose whole range
is older than the retention and whose every row finished before it is
dropped whole, with the ``job_keys`` entries of its rows, instead of
deleting its rows one by one. A partition still holding a pending or
running job is kept (its finished rows go by the batched DELETE): nothing
is lost.
"""

from __future__ import annotations

import bisect
import datetime as dt
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.engine import Connection

from celery_sched.errors import CelerySchedError
from celery_sched.models import UNFINISHED_STATUSES
from celery_sched.store.partitions import PartitionRange, parse_name, ranges_for
from celery_sched.store.postgres.connection import Database
from celery_sched.store.schema import JOBS_STORAGE
from celery_sched.timeutil import UTC

logger = logging.getLogger(__name__)

#: First key of the advisory lock serializing partition changes (the second
#: is a hash of the schema name), beside the migrations' 0x5C4ED.
PARTITION_LOCK_CLASS = 0x5C4EE
#: Longest a retention drop waits for the locks it needs (``jobs`` itself
#: while its partition list changes): claims queue behind a waiting drop, so
#: it gives up soon and tries again on the next pass.
DROP_LOCK_TIMEOUT_MS = 500
#: Days ahead of today the leader keeps partitions created.
AHEAD_DAYS = 7

#: A bulk batch spanning at most this many days makes sure of each of them;
#: a wider one of the days its rows are due.
SPAN_DAYS = 400


def _day_start(at: dt.datetime | dt.date) -> dt.datetime:
    day = at.astimezone(dt.UTC).date() if isinstance(at, dt.datetime) else at
    return dt.datetime.combine(day, dt.time(), dt.UTC)


_UNFINISHED = sorted(status.value for status in UNFINISHED_STATUSES)
_STORAGE = ", ".join(f"{name} = {value}" for name, value in JOBS_STORAGE.items())


def _literal(at: dt.datetime) -> str:
    return f"'{at.astimezone(dt.UTC).isoformat()}'"


def name_indexes(conn: Connection, schema: str, partition: str) -> None:
    """Name each index of ``partition`` after the index of ``jobs`` it
    belongs to (``jobs_pending_due_idx_20261206_20261207``), so that query
    plans and ``\\d`` read as the schema does; PostgreSQL would name them
    after their columns."""
    suffix = partition.removeprefix("jobs_")
    rows = conn.execute(
        text(
            "SELECT child.relname, parent.relname FROM pg_index x "
            "JOIN pg_class child ON child.oid = x.indexrelid "
            "JOIN pg_inherits i ON i.inhrelid = x.indexrelid "
            "JOIN pg_class parent ON parent.oid = i.inhparent "
            "WHERE x.indrelid = CAST(:table AS regclass)"
        ),
        {"table": f'"{schema}"."{partition}"'},
    ).all()
    for child, parent in rows:
        wanted = f"{parent}_{suffix}"
        if child != wanted:
            conn.exec_driver_sql(f'ALTER INDEX "{schema}"."{child}" RENAME TO "{wanted}"')


#: Each attached partition of ``jobs`` with its bounds, when they are one
#: range of due times (its ``FOR VALUES FROM (..) TO (..)`` read back as
#: timestamps in SQL, so no date format is parsed here; a bound outside what
#: Python holds, MINVALUE or DEFAULT gives NULLs).
_PARTITIONS_SQL = r"""
WITH attached AS (
    SELECT c.relname,
           regexp_match(pg_get_expr(c.relpartbound, c.oid),
                        '^FOR VALUES FROM \(''([^'']*)''\) TO \(''([^'']*)''\)$') AS b
    FROM pg_inherits i
    JOIN pg_class c ON c.oid = i.inhrelid
    JOIN pg_class p ON p.oid = i.inhparent
    JOIN pg_namespace n ON n.oid = p.relnamespace
    WHERE n.nspname = :schema AND p.relname = 'jobs'
), bounds AS (
    SELECT relname, CAST(b[1] AS timestamptz) AS lower, CAST(b[2] AS timestamptz) AS upper
    FROM attached
)
SELECT relname,
       CASE WHEN lower >= '0001-01-02' AND lower < '9999-12-31' THEN lower END,
       CASE WHEN upper >= '0001-01-02' AND upper < '9999-12-31' THEN upper END
FROM bounds
"""


@dataclass(frozen=True, slots=True)
class _Listing:
    """What one read of the catalog found."""

    #: celery_sched's partitions (named after their range), oldest first:
    #: the ones it may analyze and drop.
    own: list[PartitionRange]
    #: The bounds of every partition with a range, strays included, oldest
    #: first: the due times that have a partition already.
    held: list[PartitionRange]


class Partitions:
    """The ranges of one schema's ``jobs`` partitions, cached, and the DDL
    that creates and drops them."""

    def __init__(self, database: Database) -> None:
        self._database = database
        self._schema = database.schema
        self._lock = threading.Lock()
        #: The last listing; ``None`` until read (again).
        self._listing: _Listing | None = None
        #: Bumped whenever the listing is replaced or forgotten, so that a
        #: read begun before a change does not put the older list back.
        self._generation = 0
        #: Stray partitions already logged (once per name is enough).
        self._logged: set[str] = set()

    # -- what exists --------------------------------------------------------

    def read(self, conn: Connection) -> list[PartitionRange]:
        """The ranges of celery_sched's partitions attached to ``jobs``,
        oldest first (strays are logged and left out)."""
        return self._read(conn).own

    def _read(self, conn: Connection) -> _Listing:
        own: list[PartitionRange] = []
        held: list[PartitionRange] = []
        rows = conn.execute(text(_PARTITIONS_SQL), {"schema": self._schema}).all()
        for name, lower, upper in rows:
            bounds = None
            if lower is not None and upper is not None and lower < upper:
                bounds = PartitionRange(lower=lower.astimezone(UTC), upper=upper.astimezone(UTC))
                held.append(bounds)
            try:
                named = parse_name(name)
            except ValueError:
                named = None
            if named is not None and named == bounds:
                own.append(named)
            elif name not in self._logged:
                self._logged.add(name)
                logger.warning(
                    "jobs partition %s.%s is not one celery_sched made (its name is not the "
                    "range %s of its bounds): left alone, never dropped",
                    self._schema,
                    name,
                    "(none)" if bounds is None else f"{bounds.lower} .. {bounds.upper}",
                )
        return _Listing(own=sorted(own), held=sorted(held))

    def _current(self, conn: Connection | None) -> _Listing:
        listing = self._listing
        if listing is not None:
            return listing
        with self._lock:
            generation = self._generation
        # Read without holding the lock, on the caller's connection when it
        # has one: never a second connection for a caller holding one.
        if conn is not None:
            listing = self._read(conn)
        else:
            listing = self._database.transaction("partitions", self._read)
        with self._lock:
            if self._generation == generation:
                self._listing = listing
        return listing

    def known(self, conn: Connection | None = None) -> list[PartitionRange]:
        """celery_sched's partitions, cached (read the first time, on
        ``conn`` when given)."""
        return list(self._current(conn).own)

    def held(self, conn: Connection | None = None) -> list[PartitionRange]:
        """The bounds of every partition, strays included, cached: the due
        times a row can be written with (read the first time, on ``conn``
        when given)."""
        return list(self._current(conn).held)

    def forget(self) -> None:
        """Read the catalog again next time (after a failed write)."""
        with self._lock:
            self._generation += 1
            self._listing = None

    @staticmethod
    def covers(ranges: Sequence[PartitionRange], low: dt.datetime, high: dt.datetime) -> bool:
        """Whether contiguous ``ranges`` hold every due time in ``[low, high]``."""
        uppers = [rng.upper for rng in ranges]
        at = bisect.bisect_right(uppers, low)
        if at == len(ranges) or ranges[at].lower > low:
            return False
        while ranges[at].upper <= high:
            if at + 1 == len(ranges) or ranges[at + 1].lower != ranges[at].upper:
                return False
            at += 1
        return True

    # -- creating -----------------------------------------------------------

    def ensure(self, conn: Connection | None, due_times: Iterable[dt.datetime]) -> None:
        """Make sure a partition holds each of ``due_times``, creating and
        committing what is missing apart from ``conn`` (the caller's
        connection, if it holds one: the list is read on it), so the
        caller's next statement sees it. For a few times: a bulk batch goes
        through :meth:`ensure_span`."""
        times = list(due_times)
        if not times:
            return
        held = self.held(conn)
        missing = [at for at in times if not self.covers(held, at, at)]
        if missing:
            self._create_for(missing)

    def ensure_span(
        self,
        conn: Connection | None,
        low: dt.datetime,
        high: dt.datetime,
        due_times: Iterable[dt.datetime],
    ) -> None:
        """:meth:`ensure` for a batch whose due times lie in ``[low, high]``:
        free when the cached ranges hold that whole span. Otherwise each day
        of the span is made sure of (a few, whatever the batch's size), or,
        for a span longer than :data:`SPAN_DAYS`, each day a row is due."""
        if self.covers(self.held(conn), low, high):
            return
        first = _day_start(low)
        days = (high - first).days + 1
        if days <= SPAN_DAYS:
            self.ensure(conn, [first + dt.timedelta(days=i) for i in range(days)])
        else:
            self.ensure(conn, [_day_start(at) for at in {at.date() for at in due_times}])

    def _create_for(self, due_times: Sequence[dt.datetime]) -> None:
        try:
            listing = self._database.apart(
                "create_partitions", lambda conn: self._create(conn, due_times)
            )
        except BaseException:
            self.forget()
            raise
        # Committed: the listing is what the catalog holds now.
        with self._lock:
            self._generation += 1
            self._listing = listing

    def _create(self, conn: Connection, due_times: Sequence[dt.datetime]) -> _Listing:
        self._serialize(conn)
        found = self._read(conn)
        own, held = list(found.own), list(found.held)
        now = conn.execute(text("SELECT now()")).scalar_one()

        def attach(rng: PartitionRange) -> None:
            self._attach(conn, rng)
            own.append(rng)
            held.append(rng)
            own.sort()
            held.sort()

        for rng in ranges_for(due_times, now):
            if not any(old.lower < rng.upper and rng.lower < old.upper for old in held):
                attach(rng)
                continue
            # Another process made a coarser or finer range meanwhile:
            # fill only the days that still have no partition.
            for at in due_times:
                if rng.holds(at) and not self.covers(held, at, at):
                    lower = _day_start(at)
                    attach(PartitionRange(lower=lower, upper=lower + dt.timedelta(days=1)))
        return _Listing(own=own, held=held)

    def _serialize(self, conn: Connection) -> None:
        conn.execute(
            text("SELECT pg_advisory_xact_lock(:cls, hashtext(:schema))"),
            {"cls": PARTITION_LOCK_CLASS, "schema": self._schema},
        )

    def _attach(self, conn: Connection, rng: PartitionRange) -> None:
        schema = self._schema
        conn.exec_driver_sql(
            f'CREATE TABLE "{schema}"."{rng.name}" '
            f'(LIKE "{schema}".jobs INCLUDING DEFAULTS INCLUDING CONSTRAINTS) '
            f"WITH ({_STORAGE})"
        )
        conn.exec_driver_sql(
            f'ALTER TABLE "{schema}".jobs ATTACH PARTITION "{schema}"."{rng.name}" '
            f"FOR VALUES FROM ({_literal(rng.lower)}) TO ({_literal(rng.upper)})"
        )
        name_indexes(conn, schema, rng.name)
        logger.info("created jobs partition %s", rng.name)

    def create_ahead(self, now: dt.datetime, days: int = AHEAD_DAYS) -> None:
        """Today's and the next ``days`` days' partitions (the leader's
        housekeeping), so that the day's first inserts never wait for DDL."""
        start = _day_start(now)
        days_ahead = [start + dt.timedelta(days=i) for i in range(days + 1)]
        self.ensure(None, days_ahead)

    # -- retention ----------------------------------------------------------

    def drop_finished(self, *, older_than: float) -> list[tuple[PartitionRange, int]]:
        """Drop each partition whose whole range lies before ``now -
        older_than`` seconds and whose rows all finished before then, with
        their ``job_keys`` entries; return the dropped ranges with the
        number of jobs each held."""
        dropped: list[tuple[PartitionRange, int]] = []

        def candidates(conn: Connection) -> tuple[dt.datetime, list[PartitionRange]]:
            cutoff = conn.execute(
                text("SELECT now() - make_interval(secs => :s)"), {"s": older_than}
            ).scalar_one()
            return cutoff, [rng for rng in self.read(conn) if rng.upper <= cutoff]

        cutoff, old = self._database.transaction("partitions_to_drop", candidates)
        for rng in old:

            def drop(conn: Connection, rng: PartitionRange = rng) -> int | None:
                return self._drop(conn, rng, cutoff)

            try:
                rows = self._database.transaction("drop_partition", drop)
            except CelerySchedError as exc:  # a lock wait ran out: the next pass tries again
                logger.info("jobs partition %s not dropped this time: %s", rng.name, exc)
                continue
            if rows is not None:
                dropped.append((rng, rows))
        if dropped:
            self.forget()
        return dropped

    @staticmethod
    def _unfinished(conn: Connection, table: str, cutoff: dt.datetime) -> bool:
        """Whether ``table`` holds a job not finished, or finished since
        ``cutoff``: one EXISTS per unfinished status, each answered by that
        status's partial index, and one on ``jobs_finished_idx``."""
        probes = [
            f"EXISTS (SELECT 1 FROM {table} WHERE status = '{status}')" for status in _UNFINISHED
        ]
        probes.append(f"EXISTS (SELECT 1 FROM {table} WHERE finished_at >= :cutoff)")
        found = conn.execute(text("SELECT " + " OR ".join(probes)), {"cutoff": cutoff})
        return bool(found.scalar_one())

    def _drop(self, conn: Connection, rng: PartitionRange, cutoff: dt.datetime) -> int | None:
        """Drop ``rng``'s partition if every job in it finished before
        ``cutoff``; its number of jobs, or None when it was kept."""
        schema, name = self._schema, rng.name
        table = f'"{schema}"."{name}"'
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT_MS}ms'")
        self._serialize(conn)
        if self._unfinished(conn, table, cutoff):
            return None
        # Counted before the lock (a full read of the partition must not
        # hold up claims); finished rows before the cutoff do not change.
        rows = int(conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar_one())
        # Their keys are free again; before the lock too (it reads every
        # row), undone with the transaction should the partition be kept.
        conn.exec_driver_sql(
            f'DELETE FROM "{schema}".job_keys k USING {table} j '
            "WHERE k.key = coalesce(j.key, j.id::text) AND k.job_id = j.id"
        )
        # No insert, claim or report can touch its rows from here on (claims
        # wait behind this lock, so the check again reads indexes only).
        conn.exec_driver_sql(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        if self._unfinished(conn, table, cutoff):
            return None
        conn.exec_driver_sql(f"DROP TABLE {table}")
        logger.info("dropped jobs partition %s (its %d jobs had all finished)", name, rows)
        return rows
