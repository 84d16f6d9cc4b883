"""What workers report, on PostgreSQL: heartbeats and their jobs' transitions.

Reports run on an autocommit connection of the hot-path pool
(:meth:`~celery_sched.store.postgres.connection.Database.run_raw`): a worker
sends them for every task. The statements are named in
:mod:`~celery_sched.store.postgres.statements`.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
from sqlalchemy import delete, func

from celery_sched.interfaces import WorkerReports
from celery_sched.models import DueSpan, JobStatus, WorkerUpdate, check_retry_in
from celery_sched.settings import Settings
from celery_sched.store.postgres.base import PostgresStoreBase
from celery_sched.store.postgres.connection import RawStatement
from celery_sched.store.postgres.statements import seconds_param


class PostgresWorkerReports(PostgresStoreBase, WorkerReports):
    """:class:`~celery_sched.interfaces.WorkerReports` on PostgreSQL."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        s = self.statements
        self._heartbeat = RawStatement(s.heartbeat)
        # By due time (run unprepared: see statements.due_between), and by
        # the margin for reports of messages without the due header.
        self._dated = _ReportStatements(s)
        self._undated = _ReportStatements(s.by_margin)
        workers = s.tables.workers
        self._prune_workers = delete(workers).where(
            workers.c.seen_at < func.now() - seconds_param("older_than")
        )

    def heartbeat(
        self,
        hostname: str,
        pid: int,
        *,
        first: bool = False,
        tasks: Sequence[str] | None = None,
    ) -> None:
        stmt = self._heartbeat
        listed = None if tasks is None else list(tasks)
        params = stmt.params(p_hostname=hostname, p_pid=pid, p_first=first, p_tasks=listed)
        self.database.run_raw("heartbeat", lambda cur: cur.execute(stmt.sql, params))

    def mark_running(
        self,
        job_id: uuid.UUID,
        *,
        worker: str,
        worker_pid: int | None = None,
        due_at: dt.datetime | None = None,
    ) -> bool:
        params = {"p_id": job_id, "p_worker": worker, "p_worker_pid": worker_pid}
        return self._transition("mark_running", params, due_at)

    def mark_finished(
        self,
        job_id: uuid.UUID,
        status: JobStatus,
        *,
        error: str | None = None,
        due_at: dt.datetime | None = None,
    ) -> bool:
        status = JobStatus(status)
        if not status.finished:
            raise ValueError(f"mark_finished needs a finished status, got {status.value!r}")
        params = {"p_id": job_id, "p_status": status.value, "error": error}
        return self._transition("mark_finished", params, due_at)

    def mark_retrying(
        self,
        job_id: uuid.UUID,
        *,
        error: str | None = None,
        retry_in: float | None = None,
        due_at: dt.datetime | None = None,
    ) -> bool:
        params = {"p_id": job_id, "error": error, "p_retry_in": check_retry_in(retry_in)}
        return self._transition("mark_retrying", params, due_at)

    def _transition(self, name: str, params: dict[str, Any], due_at: dt.datetime | None) -> bool:
        """Run the single transition ``name`` on one job; whether it moved."""
        if due_at is None:
            stmt = getattr(self.statements.by_margin, name)
            return self.database.rowcount(name, stmt, params) > 0
        raw: RawStatement = getattr(self._dated, name)
        span = DueSpan.of([due_at])
        values = raw.params(**params, p_due_from=span.earliest, p_due_to=span.latest)
        return self.database.run_raw(
            name, lambda cur: cur.execute(raw.sql, values, prepare=False).rowcount > 0
        )

    def apply_worker_updates(self, updates: Sequence[WorkerUpdate]) -> int:
        # Reports that name their job's due time (every message sent since
        # the celery_sched_due header) are applied by due time, within the
        # span of their due times; the others (messages sent before it) by
        # the margin. A job's reports come from its message, so they are in
        # one group, in their order.
        dated = [u for u in updates if u.due_at is not None]
        undated = [u for u in updates if u.due_at is None]
        batches = self._batches(self._undated, undated, {})
        if dated:
            span = DueSpan.of(u.due_at for u in dated if u.due_at is not None)
            due = {"p_due_from": span.earliest, "p_due_to": span.latest}
            batches += self._batches(self._dated, dated, due)
        if not batches:
            return 0

        def apply(cursor: psycopg.Cursor[Any]) -> int:
            # One transaction, sent in one round trip (pipeline mode); one
            # cursor per statement, each keeps its own row count.
            conn = cursor.connection
            with conn.pipeline():
                cursors = [
                    conn.execute(stmt.sql, params, prepare=prepare)
                    for stmt, params, prepare in batches
                ]
            changed = 0
            for (stmt, _, _), cur in zip(batches, cursors, strict=True):
                changed += max(0, cur.rowcount)
                if stmt in (self._dated.batch_ran, self._undated.batch_ran):
                    # A combined row counts its start and its finish, as the
                    # single transitions would.
                    changed += sum(1 for (started,) in cur.fetchall() if started)
            return changed

        return self.database.run_raw("apply_worker_updates", apply)

    def _batches(
        self, kinds: _ReportStatements, updates: Sequence[WorkerUpdate], due: dict[str, Any]
    ) -> list[tuple[RawStatement, dict[str, Any], bool | None]]:
        """The statements (with their parameters and psycopg's ``prepare``)
        that apply ``updates``, all of one group (see :meth:`apply_worker_updates`)."""
        # One statement per kind of transition, applied in
        # the order a job moves: running, retrying, running again (a retry
        # that started within the same batch), finished, lost. Per job that
        # is the order the worker reported them in. Of two reports of one
        # kind for a job only one could apply (the transition's own status
        # test refuses the other), so only the first is sent (of two starts,
        # the one of the later attempt).
        # Each report's fields as text (parallel text arrays), its job's
        # due time last.
        running: dict[uuid.UUID, tuple[str, str | None, str | None, str | None]] = {}
        retrying: dict[uuid.UUID, tuple[str | None, str | None, str | None]] = {}
        finished: dict[uuid.UUID, tuple[str, str | None, str | None]] = {}
        lost: dict[uuid.UUID, tuple[str | None, str | None, str | None]] = {}
        resumed: dict[uuid.UUID, tuple[str, str | None, str | None, str | None]] = {}
        for u in updates:
            due_at = None if u.due_at is None else u.due_at.isoformat()
            if u.status == JobStatus.RUNNING:
                pid = None if u.worker_pid is None else str(u.worker_pid)
                attempt = None if u.attempt is None else str(u.attempt)
                if u.job_id in retrying:
                    # The retry started: it must not stay "retrying" (the
                    # reconciler would requeue it while it runs).
                    resumed.setdefault(u.job_id, (u.worker or "", pid, attempt, due_at))
                    continue
                earlier = running.get(u.job_id)
                # A delivery that took its job over as a new attempt reports
                # its start again: the later attempt is the one that applies.
                if earlier is None or (
                    u.attempt is not None and earlier[2] is not None and u.attempt > int(earlier[2])
                ):
                    running[u.job_id] = (u.worker or "", pid, attempt, due_at)
            elif u.status == JobStatus.RETRYING:
                retry_in = None if u.retry_in is None else repr(u.retry_in)
                retrying.setdefault(u.job_id, (u.error, retry_in, due_at))
            elif u.status.finished:
                finished.setdefault(u.job_id, (u.status.value, u.error, due_at))
            elif u.status == JobStatus.PENDING:
                attempt = None if u.attempt is None else str(u.attempt)
                error = u.error or "its worker process was lost"
                lost.setdefault(u.job_id, (error, attempt, due_at))
        # Started and finished in this batch, with no retry between: one
        # combined transition (the common case of a short task).
        ran = {
            job_id: (*started[:2], *finished.pop(job_id))
            for job_id, started in running.items()
            if job_id in finished and job_id not in retrying
        }
        for job_id in ran:
            del running[job_id]
        started = ("workers", "pids", "attempts", "dues")
        chosen: list[tuple[RawStatement, dict[str, list[Any]]]] = []
        if ran:
            ended = ("workers", "pids", "statuses", "errors", "dues")
            chosen.append((kinds.batch_ran, _arrays(ran, *ended)))
        if running:
            chosen.append((kinds.batch_running, _arrays(running, *started)))
        if retrying:
            chosen.append((kinds.batch_retrying, _arrays(retrying, "errors", "retry_ins", "dues")))
        if resumed:
            chosen.append((kinds.batch_running, _arrays(resumed, *started)))
        if finished:
            chosen.append((kinds.batch_finished, _arrays(finished, "statuses", "errors", "dues")))
        if lost:
            chosen.append((kinds.batch_lost, _arrays(lost, "errors", "attempts", "dues")))
        # Unprepared by due time (statements.due_between); psycopg's default
        # (prepared after a few runs) by the margin.
        prepare = False if due else None
        return [(stmt, stmt.params(**params, **due), prepare) for stmt, params in chosen]

    def prune_workers(self, *, older_than: float) -> int:
        return self.database.rowcount(
            "prune_workers", self._prune_workers, {"older_than": older_than}
        )


class _ReportStatements:
    """The precompiled report statements of one due-time test."""

    def __init__(self, s: Any) -> None:
        self.mark_running = RawStatement(s.mark_running)
        self.mark_finished = RawStatement(s.mark_finished)
        self.mark_retrying = RawStatement(s.mark_retrying)
        self.batch_running = RawStatement(s.batch_running)
        self.batch_retrying = RawStatement(s.batch_retrying)
        self.batch_finished = RawStatement(s.batch_finished)
        self.batch_ran = RawStatement(s.batch_ran)
        self.batch_lost = RawStatement(s.batch_lost)


def _arrays(reports: dict[uuid.UUID, tuple[Any, ...]], *names: str) -> dict[str, list[Any]]:
    """The parallel array parameters of a batched report statement: ``p_ids``,
    then ``p_<name>`` per field of the reports' tuples, in order."""
    params: dict[str, list[Any]] = {"p_ids": list(reports)}
    for at, name in enumerate(names):
        params[f"p_{name}"] = [fields[at] for fields in reports.values()]
    return params
