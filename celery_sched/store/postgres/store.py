"""The PostgreSQL job store: every role of it in one object."""

from __future__ import annotations

from celery_sched.interfaces import JobStore
from celery_sched.store.postgres.jobs import PostgresJobs
from celery_sched.store.postgres.schedules import PostgresScheduleStore
from celery_sched.store.postgres.worker_reports import PostgresWorkerReports


class PostgresJobStore(PostgresJobs, PostgresWorkerReports, PostgresScheduleStore, JobStore):
    """:class:`~celery_sched.interfaces.JobStore` on PostgreSQL (psycopg 3).

    Constructing one connects to nothing: the engine and the worker
    connections open on first use.
    """
