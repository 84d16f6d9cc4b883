"""Bulk loads with psycopg 3's binary COPY: new jobs, and new schedule rows.

COPY writes rows without a statement per row or per chunk, which is what
``load_jobs`` (millions of jobs) and the static sync (thousands of
schedules) need; the rows come as tuples already in column order.

Keyed loads (issue #31, target 5; ``benchmarks/bulk_schedule.py --jobs
200000 --keys``). A load of 200k jobs is bound by its PostgreSQL backend,
keyless or not: the client builds rows in 3.3 us of CPU per job while the
backend stores them in 3.55 us (the ANALYZE after the load included), and
the two overlap. A caller key adds backend work that nothing on the client
can hide: its ``jobs_key_idx`` entry (0.95 us per job, measured as the
difference with the index dropped) and its ``job_keys`` entry (about
1.0 us: 0.15 for the heap, the rest for the unique index), 5.8 us in all,
so keyed/keyless is about 0.6-0.65 on this machine. Measured and kept:
entries kept as a key list and an integer id list (a pair or a UUID kept
per key set off hundreds of garbage collection passes over the caller's
input: client CPU 5.0 -> 3.8 us per keyed job) and COPYed in key order (the
lock order of two loads sharing keys). Measured and not taken: INSERT ...
SELECT FROM unnest(keys, ids), sorted or not, or from a staging table
(1.25-1.6 us of backend CPU per key against 0.7-1.05 for COPY); ``COLLATE
"C"`` or a uuid (hash of the key) instead of the key text in ``job_keys``
(0.90-1.00 against 1.05 us: comparisons are not the cost);
``deduplicate_items = off`` on ``jobs_key_idx`` (no change). Without
``jobs_key_idx`` (reads by key through ``job_keys`` instead, a change of
the read path and a migration) the ratio measured 0.72-0.75; 0.9 would need
a key to cost the backend under 0.4 us, less than one B-tree entry, while
keys unique across partitions need one in ``job_keys`` in the load's
transaction.
"""

from __future__ import annotations

import bisect
import datetime as dt
import itertools
import json
import logging
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import psycopg
from psycopg import pq
from psycopg.adapt import Dumper
from psycopg.types.string import BytesBinaryDumper
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection

from celery_sched.errors import DuplicateJob, MissingPartition
from celery_sched.models import NEW_JOB_ROW, NewJobRow
from celery_sched.store.postgres.connection import Database, is_transient
from celery_sched.store.postgres.partitioning import Partitions

logger = logging.getLogger(__name__)

#: Bulk loads of at least this many rows refresh the table's statistics.
ANALYZE_AFTER_ROWS = 10_000
#: Rows of caller-chosen ids a segment holds back (in memory) at most: they
#: are written after their keys' entries (see :meth:`_Load.run`).
HELD_ROWS = 10_000
#: One due time in every SAMPLE_MASK + 1 rows of a bulk load is kept, to
#: know which partitions it wrote to (and ANALYZE them).
SAMPLE_MASK = 1023

# The columns COPY writes, in order, with their binary COPY types. The rest
# (status, attempt, created_at, ...) take their server defaults.
COPY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "uuid"),
    ("key", "text"),
    ("task", "text"),
    ("body", "bytea"),
    ("content_type", "text"),
    ("content_encoding", "text"),
    ("argsrepr", "text"),
    ("kwargsrepr", "text"),
    ("options", "jsonb"),
    ("due_at", "timestamptz"),
    ("due_bucket", "int4"),
    ("expires_at", "timestamptz"),
    ("max_attempts", "int4"),
    ("shard", "int2"),
    ("schedule_id", "int8"),
    ("visibility_timeout", "float8"),
    ("max_runtime", "float8"),
)
assert tuple(name for name, _ in COPY_COLUMNS) == NEW_JOB_ROW
_DUE = NEW_JOB_ROW.index("due_at")
_UUID_TEXT = 36
#: The ``job_keys`` columns a bulk load writes, with their binary COPY types.
KEY_COPY_COLUMNS: tuple[tuple[str, str], ...] = (("key", "text"), ("job_id", "uuid"))

#: The columns a new schedule row is written with (COPY), with their binary
#: COPY types. The rest (id, paused, version, timestamps) take their defaults.
SCHEDULE_COPY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("name", "text"),
    ("task", "text"),
    ("kind", "text"),
    ("spec", "jsonb"),
    ("body", "bytea"),
    ("content_type", "text"),
    ("content_encoding", "text"),
    ("argsrepr", "text"),
    ("kwargsrepr", "text"),
    ("options", "jsonb"),
    ("timezone", "text"),
    ("misfire", "text"),
    ("overlap", "text"),
    ("catchup_window", "float8"),
    ("max_catchup", "int4"),
    ("relative", "bool"),
    ("enabled", "bool"),
    ("source", "text"),
    ("next_nominal_at", "timestamptz"),
)


def copy_sql(table: str, columns: tuple[tuple[str, str], ...]) -> str:
    """``COPY <table> (<columns>) FROM STDIN (FORMAT BINARY)``; ``table`` is
    rendered as given (quote it)."""
    names = ", ".join(f'"{name}"' for name, _ in columns)
    return f"COPY {table} ({names}) FROM STDIN (FORMAT BINARY)"


class _OptionsDumper(Dumper):
    """Binary jsonb for the options column of the bulk load.

    psycopg's own jsonb dumper runs ``json.dumps`` per row; almost every
    bulk-loaded job has no options, and their value is a constant.
    """

    format = pq.Format.BINARY
    oid = psycopg.adapters.types["jsonb"].oid

    def dump(self, obj: Any) -> bytes:
        if not obj:
            return b"\x01{}"
        # jsonb's binary input: format version 1, then the JSON text.
        return b"\x01" + json.dumps(dict(obj)).encode()


class _UuidIntDumper(Dumper):
    """Binary uuid from a UUID's integer (``UUID.int``): the key entries of a
    bulk load keep their job ids as integers (see :meth:`_Load.run`)."""

    format = pq.Format.BINARY
    oid = psycopg.adapters.types["uuid"].oid

    def dump(self, obj: Any) -> bytes:
        result: bytes = obj.to_bytes(16, "big")
        return result


class JobCopy:
    """COPY of new job rows into one schema's ``jobs`` table, and of their
    keys into ``job_keys``.

    The rows come from an iterator read once, and streamed: the caller
    builds row ``n + 1`` while PostgreSQL stores row ``n`` (two cores
    working, not one after the other). A partition must exist before COPY
    routes a row to it, so each row's due time is checked against the
    contiguous spans of the known partitions (a comparison of two
    datetimes in the common case); a row no partition holds ends the COPY,
    its partition (and the other days of its neighbourhood) is created and
    committed apart (:meth:`Partitions.ensure`: the load holds no lock a
    creator needs), and a new COPY goes on. Keys are collected and COPYed
    after each segment; the rows whose id the caller chose are held back
    and COPYed after their keys (the lock order of ``add_job``). One
    transaction: all or nothing.
    """

    def __init__(self, database: Database, partitions: Partitions) -> None:
        self._database = database
        self._partitions = partitions
        schema = database.schema
        self.schema = schema
        self.sql = copy_sql(f'"{schema}".jobs', COPY_COLUMNS)
        self.keys_sql = copy_sql(f'"{schema}".job_keys', KEY_COPY_COLUMNS)
        self.types = [kind for _, kind in COPY_COLUMNS]
        self.key_types = [kind for _, kind in KEY_COPY_COLUMNS]
        self.twice_sql = (
            f'SELECT id FROM "{schema}".jobs WHERE id = ANY(%s) GROUP BY id HAVING count(*) > 1 '
            "LIMIT 1"
        )

    def write(self, rows: Iterable[NewJobRow]) -> int:
        """COPY ``rows`` (``NEW_JOB_ROW`` tuples, keys as stored) in one
        transaction; return how many. All or nothing."""
        db = self._database
        # Only checking out a connection is retried: once COPY has consumed
        # part of a (possibly one-shot) iterator, it cannot be replayed.
        conn = db.retry(lambda: db.engine.connect(), "load_jobs")
        load = _Load(self, conn)
        try:
            with conn.begin():
                raw: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
                # What another process created or dropped since the last load.
                self._partitions.forget()
                with raw.cursor() as cur:
                    # A bulk load lasts as long as the caller's input takes to
                    # produce, so the per-statement timeout does not fit it; a
                    # lock wait (a concurrent insert of the same key) still
                    # must not hang forever.
                    lock_ms = str(round(db.settings.statement_timeout * 1000))
                    cur.execute(
                        "SELECT set_config('statement_timeout', '0', true), "
                        "set_config('lock_timeout', %s, true)",
                        (lock_ms,),
                    )
                    cur.adapters.register_dumper(None, _OptionsDumper)
                    # By type oid, bytea maps to psycopg's DB-API dumper, a
                    # Python subclass; the plain bytes dumper runs in C.
                    cur.adapters.register_dumper(None, BytesBinaryDumper)
                    load.run(cur, iter(rows))
        except (sa_exc.SQLAlchemyError, psycopg.Error) as exc:
            self._partitions.forget()
            raw_conn = conn.connection.driver_connection if not conn.closed else None
            if isinstance(raw_conn, psycopg.Connection) and raw_conn.closed:
                conn.invalidate()
            if is_transient(exc):
                raise db.unavailable(exc) from exc
            raise db.translate(exc, "load_jobs") from exc
        except BaseException:
            self._partitions.forget()
            raise
        finally:
            conn.close()
        logger.debug("inserted %d jobs with COPY", load.count)
        if load.count >= ANALYZE_AFTER_ROWS:
            self._analyze(load.sampled)
        return load.count

    def _analyze(self, sampled: list[dt.datetime]) -> None:
        """Fresh statistics for the partitions the load wrote to (found from
        a sample of its due times), which keep the planner on the indexes the
        claims were written for (ANALYZE samples a fixed number of rows, so
        each costs well under a second; the other partitions did not change)."""
        known = self._partitions.known()
        touched = sorted({rng.name for at in sampled for rng in known if rng.holds(at)})
        for name in touched:

            def analyze(conn: Connection, name: str = name) -> None:
                conn.exec_driver_sql(f'ANALYZE "{self.schema}"."{name}"')

            self._database.transaction("analyze", analyze)


class _Load:
    """One bulk load's segments: COPY while the partitions hold the rows."""

    def __init__(self, copy: JobCopy, conn: Connection) -> None:
        self._copy = copy
        self._conn = conn
        self._partitions = copy._partitions
        self.count = 0
        #: One due time per :data:`SAMPLE_EVERY` rows (which partitions to ANALYZE).
        self.sampled: list[dt.datetime] = []
        self._spans: list[tuple[dt.datetime, dt.datetime]] = []
        self._lowers: list[dt.datetime] = []

    def _read_spans(self) -> None:
        """The known ranges merged into contiguous spans."""
        spans: list[tuple[dt.datetime, dt.datetime]] = []
        for rng in self._partitions.held(self._conn):
            if spans and spans[-1][1] == rng.lower:
                spans[-1] = (spans[-1][0], rng.upper)
            else:
                spans.append((rng.lower, rng.upper))
        self._spans = spans
        self._lowers = [low for low, _ in spans]

    def _span_of(self, due: dt.datetime) -> tuple[dt.datetime, dt.datetime] | None:
        at = bisect.bisect_right(self._lowers, due) - 1
        if at >= 0 and due < self._spans[at][1]:
            return self._spans[at]
        return None

    def run(self, cur: psycopg.Cursor[Any], source: Iterator[NewJobRow]) -> None:
        self._read_spans()
        pending: NewJobRow | None = None
        while True:
            # Entries as two lists, the ids as integers: no object the
            # garbage collector tracks is kept per key (a pair, or the row's
            # UUID, would be), so a large load sets off no collection passes
            # over the caller's input (measured: 266 of them, 0.1 s, in a
            # keyed load of 200k jobs).
            keys: list[str] = []
            ids: list[int] = []
            chosen: list[uuid.UUID] = []
            held: list[NewJobRow] = []
            low = high = None
            count = self.count
            sampled = self.sampled
            take_key, take_id = keys.append, ids.append
            with cur.copy(self._copy.sql) as copy:
                copy.set_types(self._copy.types)
                write_row = copy.write_row
                if pending is not None:
                    row, pending = pending, None
                    source = itertools.chain([row], source)
                for row in source:
                    due = row[_DUE]
                    if low is None or not low <= due < high:
                        span = self._span_of(due)
                        if span is None:
                            pending = row  # its partition is missing: end this COPY
                            break
                        low, high = span
                    count += 1
                    if not count & SAMPLE_MASK:
                        sampled.append(due)
                    # key_entry inlined (once per row on the bulk path).
                    key = row[1]
                    if key is not None:
                        if len(key) != _UUID_TEXT or key != str(row[0]):
                            take_key(key)  # a caller's key: its own entry
                            take_id(row[0].int)
                            write_row(row)
                            continue
                        # Its id is the caller's (the key is the id's text).
                        chosen.append(row[0])
                    elif (row[0].int >> 76) & 0xF == 7:
                        write_row(row)  # a generated id: no entry
                        continue
                    # Keyed by its id, chosen by the caller: another writer of
                    # this id (add_job, due the same time) takes the entry
                    # before the row, so this row waits for its entry too;
                    # the other order deadlocks on the two.
                    take_key(str(row[0]))
                    take_id(row[0].int)
                    held.append(row)
                    if len(held) >= HELD_ROWS:
                        break
                # The entries' order (see _finish_segment), sorted while
                # PostgreSQL still works through the rows in flight.
                order = sorted(range(len(keys)), key=keys.__getitem__)
            self.count = count
            self._finish_segment(cur, keys, ids, order, held, chosen)
            if pending is None and len(held) < HELD_ROWS:
                return
            if pending is None:
                continue
            due = pending[_DUE]
            self._partitions.ensure_span(self._conn, due, due, [due])
            self._read_spans()
            if self._span_of(due) is None:
                raise MissingPartition(f"load_jobs: no partition holds due time {due.isoformat()}")

    def _finish_segment(
        self,
        cur: psycopg.Cursor[Any],
        keys: list[str],
        ids: list[int],
        order: list[int],
        held: list[NewJobRow],
        chosen: list[uuid.UUID],
    ) -> None:
        if keys:
            # In key order, whatever the caller's: two loads sharing keys then
            # take them in one order, so the second waits for the first and
            # fails with DuplicateJob instead of deadlocking with it (within a
            # segment; a load whose rows need new partitions has one segment
            # per such stop). A key taken before, or twice in the load (then
            # side by side here), fails the load on the unique index.
            # Measured: into a fresh job_keys alone, 0.70 against 1.05 us of
            # backend CPU per key; in a whole 200k keyed load, no change
            # beyond the noise (the benchmark's keys come nearly in order),
            # for 0.08 us per key of sorting.
            # A cursor of its own: its uuid dumper takes the ids as integers.
            with cur.connection.cursor() as key_cur:
                key_cur.adapters.register_dumper(None, _UuidIntDumper)
                with key_cur.copy(self._copy.keys_sql) as copy:
                    copy.set_types(self._copy.key_types)
                    write_row = copy.write_row
                    for at in order:
                        write_row((keys[at], ids[at]))
        if held:
            with cur.copy(self._copy.sql) as copy:
                copy.set_types(self._copy.types)
                write_row = copy.write_row
                for row in held:
                    write_row(row)
        # Ids a caller chose (a key that is a UUID's text): no other job,
        # due any day, may have them; a generated id takes no entry of its
        # own, so it is looked up in every partition.
        if chosen:
            cur.execute(self._copy.twice_sql, (chosen,))
            twice = cur.fetchone()
            if twice is not None:
                raise DuplicateJob(key=str(twice[0]))


def copy_schedule_rows(conn: Connection, sql: str, rows: Sequence[dict[str, Any]]) -> None:
    """COPY schedule rows (``SCHEDULE_COPY_COLUMNS`` keys) with ``sql``
    inside ``conn``'s transaction."""
    raw: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
    names = [name for name, _ in SCHEDULE_COPY_COLUMNS]
    types = [kind for _, kind in SCHEDULE_COPY_COLUMNS]
    with raw.cursor() as cur:
        cur.adapters.register_dumper(None, _OptionsDumper)
        with cur.copy(sql) as copy:
            copy.set_types(types)
            for row in rows:
                copy.write_row([row[name] for name in names])
