"""Every statement of the periodic schedules on PostgreSQL, built once per store.

A user's change and the planner's commit both lock the schedule row first
(UPDATE / FOR UPDATE), then touch its jobs; claims never lock schedule rows.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Double,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    Text,
    Uuid,
    and_,
    any_,
    bindparam,
    case,
    cast,
    delete,
    exists,
    func,
    not_,
    or_,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import insert as pg_insert

from celery_sched.models import UNFINISHED_STATUSES
from celery_sched.store.postgres.bulk import COPY_COLUMNS, SCHEDULE_COPY_COLUMNS, copy_sql
from celery_sched.store.postgres.keys import release_keys
from celery_sched.store.postgres.statements import PENDING, Tables, job_columns, text_array

#: What a user defines (the static sync compares these); the first four
#: decide *when* a schedule fires, so a change in them restarts it from now.
TIMING_COLUMNS = ("kind", "spec", "timezone", "relative")
DEFINITION_COLUMNS = (
    *TIMING_COLUMNS,
    "task",
    "body",
    "content_type",
    "content_encoding",
    "argsrepr",
    "kwargsrepr",
    "options",
    "misfire",
    "overlap",
    "catchup_window",
    "max_catchup",
    "enabled",
)

#: The job columns of an occurrence insert, those COPY writes, and the array
#: type each travels in: options as JSON text (cast on the server), shards as
#: int4.
_ARRAY_TYPES = {"jsonb": "text", "int2": "int4"}
OCCURRENCE_ARRAYS: tuple[tuple[str, str], ...] = tuple(
    (name, _ARRAY_TYPES.get(kind, kind)) for name, kind in COPY_COLUMNS
)

UNFINISHED = sorted(status.value for status in UNFINISHED_STATUSES)
#: What a user's change writes besides the change: the planner tries a broken
#: schedule again.
UNBROKEN: dict[str, Any] = {"broken_at": None, "broken_reason": None}
STAGED_TABLE = "celery_sched_static_sync"


class ScheduleQueries:
    """Every SQL statement of the schedules section, built once per store."""

    def __init__(self, tables: Tables) -> None:
        s = tables.schedules
        jobs = tables.jobs
        self.schedules = s
        self.jobs = jobs
        now = func.now()
        ids = bindparam("ids", type_=postgresql.ARRAY(BigInteger))
        self.copy_schedules_sql = copy_sql(f'"{s.schema}".schedules', SCHEDULE_COPY_COLUMNS)
        self.copy_staged_sql = copy_sql(STAGED_TABLE, SCHEDULE_COPY_COLUMNS)

        # -- reading --
        self.names_taken = (
            select(s.c.name)
            .where(s.c.name == any_(bindparam("names", type_=postgresql.ARRAY(Text))))
            .limit(1)
        )
        self.get = select(s).where(s.c.name == bindparam("p_name"))
        self.get_for_update = self.get.with_for_update()
        self.lock_by_id = select(s.c.id).where(s.c.id == bindparam("p_id")).with_for_update()
        state = case(
            (not_(s.c.enabled), "disabled"),
            (s.c.paused, "paused"),
            (s.c.broken_at.is_not(None), "broken"),
            else_="active",
        ).label("state")
        self.counts = select(state, func.count()).group_by(state)

        # Per schedule: its earliest pending occurrence not yet due, and its
        # latest occurrence due so far; both walk jobs_schedule_due_idx.
        x = func.unnest(ids).table_valued("id").render_derived(name="x")
        next_due = (
            select(func.min(jobs.c.due_at))
            .where(
                jobs.c.schedule_id == x.c.id,
                jobs.c.status == PENDING,
                jobs.c.due_at > now,
            )
            .scalar_subquery()
        )
        last = (
            select(jobs.c.due_at, jobs.c.status)
            .where(jobs.c.schedule_id == x.c.id, jobs.c.due_at <= now)
            .order_by(jobs.c.due_at.desc())
            .limit(1)
            .lateral("last")
        )
        self.runs = select(x.c.id, next_due, last.c.due_at, last.c.status).select_from(
            x.outerjoin(last, true())
        )
        # A schedule's history, newest first: a backward walk of
        # jobs_schedule_due_idx that stops after p_limit rows, however long
        # the history (the id only breaks ties of equal due times).
        self.history = (
            select(*job_columns(jobs))
            .where(jobs.c.schedule_id == bindparam("p_id", type_=BigInteger), jobs.c.due_at <= now)
            .order_by(jobs.c.due_at.desc(), jobs.c.id.desc())
            .limit(bindparam("p_limit"))
        )

        # -- planning --
        stamp = DateTime(timezone=True)
        due = (
            select(s)
            .where(
                # The predicate of schedules_plan_idx, whole, so the scan uses it.
                s.c.enabled,
                not_(s.c.paused),
                s.c.broken_at.is_(None),
                s.c.next_nominal_at <= bindparam("horizon", type_=stamp),
                (s.c.id % bindparam("p_shards", type_=BigInteger))
                == bindparam("p_shard", type_=BigInteger),
            )
            .order_by(s.c.next_nominal_at, s.c.id)
            .limit(bindparam("p_limit"))
        )
        self.due = due
        self.due_after = due.where(
            tuple_(s.c.next_nominal_at, s.c.id)
            > tuple_(bindparam("after_next", type_=stamp), bindparam("after_id", type_=BigInteger))
        )
        adv = select(
            func.unnest(bindparam("a_ids", type_=postgresql.ARRAY(BigInteger))).label("id"),
            func.unnest(bindparam("a_versions", type_=postgresql.ARRAY(BigInteger))).label(
                "version"
            ),
            func.unnest(bindparam("a_lasts", type_=postgresql.ARRAY(stamp))).label("last"),
            func.unnest(bindparam("a_nexts", type_=postgresql.ARRAY(stamp))).label("next"),
        ).subquery("adv")
        # A planner that read the row before another one advanced it (an old
        # leader) must not move the cursor back: it would only plan again
        # what exists.
        self.advance = (
            update(s)
            .where(
                s.c.id == adv.c.id,
                s.c.version == adv.c.version,
                s.c.enabled,
                not_(s.c.paused),
                s.c.broken_at.is_(None),
                or_(
                    s.c.last_nominal_at.is_(None),
                    adv.c.last.is_(None),
                    s.c.last_nominal_at <= adv.c.last,
                ),
            )
            .values(last_nominal_at=adv.c.last, next_nominal_at=adv.c.next)
            .returning(s.c.id)
        )
        # Fenced by the version the planner read, so a user's change that
        # lands first (possibly the fix) is not marked broken after it.
        self.mark_broken = (
            update(s)
            .where(
                s.c.id == bindparam("p_id", type_=BigInteger),
                s.c.version == bindparam("p_version", type_=BigInteger),
                s.c.broken_at.is_(None),
            )
            .values(broken_at=now, broken_reason=bindparam("p_reason", type_=Text))
        )
        self.busy = (
            select(jobs.c.schedule_id)
            .where(
                jobs.c.schedule_id == any_(ids),
                jobs.c.status == any_(text_array(*UNFINISHED)),
            )
            .distinct()
        )
        # Due or running: a pending occurrence not yet due does not count.
        self.running = (
            select(jobs.c.schedule_id)
            .where(
                jobs.c.schedule_id == any_(ids),
                jobs.c.status == any_(text_array(*UNFINISHED)),
                or_(jobs.c.status != PENDING, jobs.c.due_at <= now),
            )
            .limit(1)
        )
        # One short statement over array parameters, unnested in lockstep: a
        # multi-row VALUES list of a thousand rows costs more to build and
        # parse on the client than the insert costs the server.
        unnested = select(
            *(
                func.unnest(bindparam(f"u_{name}", type_=postgresql.ARRAY(sql_type(kind)))).label(
                    name
                )
                for name, kind in OCCURRENCE_ARRAYS
            )
        ).subquery("u")
        # The occurrences whose keys were free (JobKeys.free_jobs): the
        # conflict left to skip is a row written twice by a retried commit.
        self.add_occurrences = (
            pg_insert(jobs)
            .from_select(
                [name for name, _ in OCCURRENCE_ARRAYS],
                select(
                    *(
                        cast(unnested.c[name], postgresql.JSONB)
                        if name == "options"
                        else unnested.c[name]
                        for name, _ in OCCURRENCE_ARRAYS
                    )
                ),
            )
            .on_conflict_do_nothing()
            .returning(jobs.c.id, jobs.c.due_at, jobs.c.shard)
        )

        # -- changes --
        withdrawn = (
            delete(jobs)
            .where(
                jobs.c.schedule_id == any_(ids),
                jobs.c.status == PENDING,
                jobs.c.due_at > now,
            )
            .returning(jobs.c.schedule_id, jobs.c.due_at, jobs.c.key, jobs.c.id)
            .cte("withdrawn")
        )
        # Their occurrence keys are free again (planned anew on resume).
        self.withdraw = select(withdrawn.c.schedule_id, withdrawn.c.due_at).add_cte(
            release_keys(tables, withdrawn)
        )
        self.roll_back = (
            update(s)
            .where(s.c.id == bindparam("p_id"))
            .values(last_nominal_at=None, next_nominal_at=bindparam("p_next", type_=stamp))
        )
        self.delete = delete(s).where(s.c.id == bindparam("p_id"))

        # -- the static sync, through a temporary table of the code's definitions --
        kinds = {name: kind for name, kind in SCHEDULE_COPY_COLUMNS}
        t = Table(
            STAGED_TABLE,
            MetaData(),
            *(
                Column(name, sql_type(kinds[name]), nullable=name not in ("name",))
                for name, _ in SCHEDULE_COPY_COLUMNS
            ),
            prefixes=["TEMPORARY"],
            postgresql_on_commit="DROP",
        )
        self.staged = t
        same_name = s.c.name == t.c.name
        static = s.c.source == "static"
        definition_changed = tuple_(*(s.c[n] for n in DEFINITION_COLUMNS)).is_distinct_from(
            tuple_(*(t.c[n] for n in DEFINITION_COLUMNS))
        )
        timing_changed = tuple_(*(s.c[n] for n in TIMING_COLUMNS)).is_distinct_from(
            tuple_(*(t.c[n] for n in TIMING_COLUMNS))
        )
        define: dict[str, Any] = {n: t.c[n] for n in DEFINITION_COLUMNS}
        define["disabled_at"] = case((t.c.enabled, None), else_=func.coalesce(s.c.disabled_at, now))
        self.sync_conflicts = select(t.c.name).where(
            exists().where(same_name, s.c.source == "dynamic")
        )
        self.sync_insert = (
            pg_insert(s)
            .from_select(
                [name for name, _ in SCHEDULE_COPY_COLUMNS],
                select(*(t.c[name] for name, _ in SCHEDULE_COPY_COLUMNS)),
            )
            .on_conflict_do_nothing(index_elements=[s.c.name])
            .returning(s.c.id)
        )
        # A timing change, or a schedule back in the code, starts over from
        # the definition's first instant; this statement runs first, so the
        # next one only sees the rows whose timing stayed the same.
        self.sync_restart = (
            update(s)
            .where(
                same_name,
                static,
                or_(and_(not_(s.c.enabled), t.c.enabled), timing_changed),
            )
            .values(
                **define,
                **UNBROKEN,
                last_nominal_at=None,
                next_nominal_at=t.c.next_nominal_at,
                version=s.c.version + 1,
                updated_at=now,
            )
            .returning(s.c.id)
        )
        self.sync_change = (
            update(s)
            .where(same_name, static, definition_changed)
            .values(**define, **UNBROKEN, version=s.c.version + 1, updated_at=now)
            .returning(s.c.id)
        )
        self.sync_disable = (
            update(s)
            .where(static, s.c.enabled, ~exists().where(t.c.name == s.c.name))
            .values(enabled=False, disabled_at=now, version=s.c.version + 1, updated_at=now)
            .returning(s.c.id)
        )


def sql_type(kind: str) -> Any:
    """The SQLAlchemy type of a COPY / array type name."""
    return {
        "uuid": Uuid(as_uuid=True),
        "int8": BigInteger,
        "text": Text,
        "jsonb": postgresql.JSONB,
        "bytea": LargeBinary,
        "float8": Double,
        "int4": Integer,
        "bool": Boolean,
        "timestamptz": DateTime(timezone=True),
    }[kind]
