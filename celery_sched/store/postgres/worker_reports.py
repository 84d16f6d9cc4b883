"""What workers report, on PostgreSQL: heartbeats and their jobs' transitions.

Reports run on an autocommit connection of the hot-path pool
(:meth:`~celery_sched.store.postgres.connection.Database.run_raw`): a worker
sends them for every task. The statements are named in
:mod:`~celery_sched.store.postgres.statements`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
from sqlalchemy import delete, func

from celery_sched.interfaces import WorkerReports
from celery_sched.models import JobStatus, WorkerUpdate, check_retry_in
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
        self._batch_running = RawStatement(s.batch_running)
        self._batch_retrying = RawStatement(s.batch_retrying)
        self._batch_finished = RawStatement(s.batch_finished)
        self._batch_ran = RawStatement(s.batch_ran)
        self._batch_lost = RawStatement(s.batch_lost)
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
        self, job_id: uuid.UUID, *, worker: str, worker_pid: int | None = None
    ) -> bool:
        params = {"p_id": job_id, "p_worker": worker, "p_worker_pid": worker_pid}
        return self.database.rowcount("mark_running", self.statements.mark_running, params) > 0

    def mark_finished(
        self, job_id: uuid.UUID, status: JobStatus, *, error: str | None = None
    ) -> bool:
        status = JobStatus(status)
        if not status.finished:
            raise ValueError(f"mark_finished needs a finished status, got {status.value!r}")
        params = {"p_id": job_id, "p_status": status.value, "error": error}
        return self.database.rowcount("mark_finished", self.statements.mark_finished, params) > 0

    def mark_retrying(
        self, job_id: uuid.UUID, *, error: str | None = None, retry_in: float | None = None
    ) -> bool:
        params = {"p_id": job_id, "error": error, "p_retry_in": check_retry_in(retry_in)}
        return self.database.rowcount("mark_retrying", self.statements.mark_retrying, params) > 0

    def apply_worker_updates(self, updates: Sequence[WorkerUpdate]) -> int:
        # One transaction, one statement per kind of transition, applied in
        # the order a job moves: running, retrying, running again (a retry
        # that started within the same batch), finished, lost. Per job that
        # is the order the worker reported them in. Of two reports of one
        # kind for a job only one could apply (the transition's own status
        # test refuses the other), so only the first is sent (of two starts,
        # the one of the later attempt).
        running: dict[uuid.UUID, tuple[str, str | None, str | None]] = {}
        retrying: dict[uuid.UUID, tuple[str | None, str | None]] = {}
        finished: dict[uuid.UUID, tuple[str, str | None]] = {}
        lost: dict[uuid.UUID, tuple[str | None, str | None]] = {}
        resumed: dict[uuid.UUID, tuple[str, str | None, str | None]] = {}
        for u in updates:
            if u.status == JobStatus.RUNNING:
                pid = None if u.worker_pid is None else str(u.worker_pid)
                attempt = None if u.attempt is None else str(u.attempt)
                if u.job_id in retrying:
                    # The retry started: it must not stay "retrying" (the
                    # reconciler would requeue it while it runs).
                    resumed.setdefault(u.job_id, (u.worker or "", pid, attempt))
                    continue
                earlier = running.get(u.job_id)
                # A delivery that took its job over as a new attempt reports
                # its start again: the later attempt is the one that applies.
                if earlier is None or (
                    u.attempt is not None and earlier[2] is not None and u.attempt > int(earlier[2])
                ):
                    running[u.job_id] = (u.worker or "", pid, attempt)
            elif u.status == JobStatus.RETRYING:
                retry_in = None if u.retry_in is None else repr(u.retry_in)
                retrying.setdefault(u.job_id, (u.error, retry_in))
            elif u.status.finished:
                finished.setdefault(u.job_id, (u.status.value, u.error))
            elif u.status == JobStatus.PENDING:
                attempt = None if u.attempt is None else str(u.attempt)
                lost.setdefault(u.job_id, (u.error or "its worker process was lost", attempt))
        # Started and finished in this batch, with no retry between: one
        # combined transition (the common case of a short task).
        ran = {
            job_id: (*started[:2], *finished.pop(job_id))
            for job_id, started in running.items()
            if job_id in finished and job_id not in retrying
        }
        for job_id in ran:
            del running[job_id]
        batches: list[tuple[RawStatement, dict[str, Any]]] = []
        if ran:
            batches.append((self._batch_ran, _arrays(ran, "workers", "pids", "statuses", "errors")))
        if running:
            batches.append((self._batch_running, _arrays(running, "workers", "pids", "attempts")))
        if retrying:
            batches.append((self._batch_retrying, _arrays(retrying, "errors", "retry_ins")))
        if resumed:
            batches.append((self._batch_running, _arrays(resumed, "workers", "pids", "attempts")))
        if finished:
            batches.append((self._batch_finished, _arrays(finished, "statuses", "errors")))
        if lost:
            batches.append((self._batch_lost, _arrays(lost, "errors", "attempts")))

        if not batches:
            return 0

        def apply(cursor: psycopg.Cursor[Any]) -> int:
            # One transaction, sent in one round trip (pipeline mode); one
            # cursor per statement, each keeps its own row count.
            conn = cursor.connection
            with conn.pipeline():
                cursors = [
                    conn.execute(stmt.sql, stmt.params(**params)) for stmt, params in batches
                ]
            changed = sum(max(0, cur.rowcount) for cur in cursors)
            if ran:
                # A combined row counts its start and its finish, as the
                # single transitions would.
                changed += sum(1 for (started,) in cursors[0].fetchall() if started)
            return changed

        return self.database.run_raw("apply_worker_updates", apply)

    def prune_workers(self, *, older_than: float) -> int:
        return self.database.rowcount(
            "prune_workers", self._prune_workers, {"older_than": older_than}
        )


def _arrays(reports: dict[uuid.UUID, tuple[Any, ...]], *names: str) -> dict[str, list[Any]]:
    """The parallel array parameters of a batched report statement: ``p_ids``,
    then ``p_<name>`` per field of the reports' tuples, in order."""
    params: dict[str, list[Any]] = {"p_ids": list(reports)}
    for at, name in enumerate(names):
        params[f"p_{name}"] = [fields[at] for fields in reports.values()]
    return params
