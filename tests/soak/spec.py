"""What the soak's project defines, importable without building its Celery app
(which reads its broker and queue from the environment at import)."""

from __future__ import annotations

#: Tables of evidence, created in the soak database's ``public`` schema.
TABLES = (
    "CREATE TABLE IF NOT EXISTS soak_runs (job_id text, key text, task text, attempt int, "
    "pid int, hostname text, started double precision)",
    "CREATE TABLE IF NOT EXISTS soak_effects (key text, job_id text, pid int, at double precision)",
)

#: Periodic schedules: name -> (task, interval in seconds).
PERIODIC = {
    "soak-plain-2s": ("soak.periodic_plain", 2.0),
    "soak-task-3s": ("soak.periodic_task", 3.0),
    "soak-task-5s": ("soak.periodic_task", 5.0),
}

#: The one-off tasks of the job stream.
ONE_OFF_TASKS = ("soak.plain", "soak.task", "soak.effect")
