"""The memory job store: every role of it in one object."""

from __future__ import annotations

from celery_sched.interfaces import JobStore
from celery_sched.store.memory.jobs import MemoryJobs
from celery_sched.store.memory.schedules import MemoryScheduleStore
from celery_sched.store.memory.worker_reports import MemoryWorkerReports


class MemoryJobStore(MemoryJobs, MemoryWorkerReports, MemoryScheduleStore, JobStore):
    """:class:`~celery_sched.interfaces.JobStore` in memory, for unit tests.

    ``clock`` returns the store's "now" (aware UTC); tests pass a fake clock
    to move time without sleeping. ``ledger``: the ledger whose entries the
    rescuer reads (PostgreSQL reads the ledger table of the jobs' database).
    """
