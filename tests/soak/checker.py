"""The chaos soak's invariant checker: reads the soak database after the settle period.

Whether a job ran is judged from the workers' own evidence (``soak_runs``: a
row the task itself writes when it starts), never from the job row's status,
which untracked workers do not report. Invariants (each broken one is a
violation naming the job and its rows):

- ``lost``: a job the stream or a client scheduled has no row, or its row is
  finished (``succeeded``, or ``sent`` with untracked workers) and no
  execution of it started. With untracked workers, a ``sent`` job published
  at most :data:`BROKER_HOLD` seconds before a fault that empties the broker
  (:data:`BROKER_LOSSES`) and never started is counted in the figure
  ``lost_to_broker`` instead: past the broker, untracked workers get
  at-most-once delivery, as under stock beat (README, Guarantees).
- ``stuck``: a job (one-off, or a periodic occurrence due before the stream
  stopped) is still ``pending``, ``dispatched``, ``running`` or ``retrying``.
- ``not_succeeded``: such a job finished otherwise (``failed``, ``dead``,
  ``cancelled``, ``expired``; ``succeeded`` with untracked workers is fine,
  ``sent`` with tracked ones is not): faults alone must never end a job.
- ``effect_not_once``: a key whose task writes its effect inside
  ``ledger_transaction`` has that effect zero times or more than once.
- ``cancelled_ran`` / ``cancelled_not_cancelled``: a job a client cancelled
  (``cancel`` returned True) started, wrote its effect, or is not ``cancelled``.
- ``future_ran`` / ``future_not_pending``: a job due after the soak (the
  ``dense`` and ``clients`` modes schedule them) started, or its row is not
  ``pending`` (a missing row is ``lost``).
- ``periodic_duplicate`` / ``periodic_gap`` / ``periodic_none``: a schedule's
  occurrences (one row per nominal instant) repeat an instant, miss one between
  the first and the last, or do not exist.
- ``schedule_failed``: the stream could not schedule a job (the client gave up);
  ``client_failed`` / ``client_hung`` / ``client_get_wrong``: an API client's
  call gave up, never returned, or ``get`` answered wrong.
- ``too_few_partitions``: the ``dense`` mode's table has fewer partitions than
  it asked for.

Figures: counts, the duplicate runs of plain tasks (allowed: at-least-once),
the duplicate starts of ``celery_sched.Task`` tasks, the lag (first start
minus due time, or minus the stream's start for a job scheduled overdue) of
the jobs due outside every fault window, and the number of partitions of
``jobs``.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import itertools
from typing import Any

import psycopg

from tests.soak.spec import EFFECT_TASKS, PLAIN_TASKS

UNFINISHED = ("pending", "dispatched", "running", "retrying")
#: Faults that empty the broker (Redis without persistence): the messages
#: waiting in it are gone, and only a tracked worker's silence gets them sent
#: again.
BROKER_LOSSES = ("broker_restart", "broker_queue_delete")
#: How long before such a fault a published message may still have been
#: waiting in the broker (bursts queue up behind 2 workers of 2 processes).
BROKER_HOLD = 60.0
#: Violations printed in full in the JSON line; the counts cover them all.
MAX_LISTED = 40


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultWindow:
    kind: str
    start: float
    end: float
    #: Seconds after ``end`` during which recovery may still delay jobs.
    grace: float
    detail: str = ""

    def covers(self, when: float) -> bool:
        # Jobs due just before a fault were in flight when it hit.
        return self.start - 3.0 <= when <= self.end + self.grace


@dataclasses.dataclass(kw_only=True)
class Manifest:
    """What the runner did: the jobs it scheduled (key -> task) and the faults."""

    #: Jobs that must have run: key -> task.
    jobs: dict[str, str]
    stream_start: float
    stream_end: float
    faults: list[FaultWindow]
    schedule_failures: list[dict[str, Any]]
    #: Periodic schedules of the mode: name -> (task, interval in seconds).
    periodic: dict[str, tuple[str, float]]
    #: Untracked workers: a finished row says ``sent``, not ``succeeded``.
    tracked: bool = True
    #: Jobs a client cancelled (must not run) and jobs due after the soak
    #: (must be pending, not run): key -> task.
    cancelled: dict[str, str] = dataclasses.field(default_factory=dict)
    future: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Violations the API clients saw themselves (``client_*``), as entries.
    client_problems: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: The partitions of ``jobs`` the mode asked for (``dense``).
    min_partitions: int = 0


@dataclasses.dataclass(frozen=True)
class JobRow:
    id: str
    key: str
    task: str
    status: str
    attempt: int
    due: float
    schedule: str | None
    last_error: str | None
    worker: str | None
    worker_pid: int | None
    #: When it was last claimed (epoch seconds), if it was.
    dispatched: float | None = None

    def shown(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": self.status,
            "attempt": self.attempt,
            "due": round(self.due, 3),
            "worker": self.worker,
            "worker_pid": self.worker_pid,
            "last_error": (self.last_error or "")[:200] or None,
        }


def _percentiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)

    def at(q: float) -> float | None:
        if not ordered:
            return None
        index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
        return round(ordered[index], 3)

    return {"count": len(ordered), "p50": at(50), "p99": at(99), "max": at(100)}


def _nominal(key: str) -> dt.datetime | None:
    _name, sep, instant = key.rpartition("@")
    if not sep:
        return None
    try:
        return dt.datetime.fromisoformat(instant)
    except ValueError:
        return None


def check(
    dsn: str, manifest: Manifest, *, schema: str = "celery_sched", evidence: str = "public"
) -> dict[str, Any]:
    """Every invariant over the soak database at ``dsn`` (job rows in
    ``schema``, the workers' evidence tables in ``evidence``); returns the report."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        jobs = [
            JobRow(str(r[0]), str(r[1]), *r[2:])
            for r in conn.execute(
                "SELECT j.id::text, coalesce(j.key, j.id::text), j.task, j.status, j.attempt, "
                "extract(epoch FROM j.due_at)::float8, s.name, j.last_error, j.worker, "
                "j.worker_pid, extract(epoch FROM j.dispatched_at)::float8 "
                f'FROM "{schema}".jobs j '
                f'LEFT JOIN "{schema}".schedules s ON s.id = j.schedule_id'
            ).fetchall()
        ]
        runs = conn.execute(
            f'SELECT job_id, key, task, attempt, pid, hostname, started FROM "{evidence}".soak_runs'
        ).fetchall()
        effects = collections.Counter(
            str(key)
            for (key,) in conn.execute(f'SELECT key FROM "{evidence}".soak_effects').fetchall()
        )
        ledger = {
            str(r[0]): {"state": r[1], "owner": r[2], "attempts": r[3], "job_id": r[4]}
            for r in conn.execute(
                f'SELECT key, state, owner, attempts, job_id::text FROM "{schema}".ledger'
            ).fetchall()
        }
        partitions = int(
            conn.execute(
                "SELECT count(*) FROM pg_inherits WHERE inhparent = %s::regclass",
                (f'"{schema}".jobs',),
            ).fetchone()[0]  # type: ignore[index]
        )

    runs_by_job: dict[str, list[tuple[Any, ...]]] = collections.defaultdict(list)
    for row in runs:
        runs_by_job[str(row[0])].append(row)
    by_key = {job.key: job for job in jobs}
    violations: list[dict[str, Any]] = []

    def violation(invariant: str, key: str, job: JobRow | None = None, **detail: Any) -> None:
        entry: dict[str, Any] = {"invariant": invariant, "job": key}
        if job is not None:
            entry["row"] = job.shown()
            entry["runs"] = [
                {"attempt": r[3], "pid": r[4], "host": r[5], "started": round(r[6], 3)}
                for r in runs_by_job.get(job.id, [])
            ]
            entry["effects"] = effects.get(key, 0)
            if key in ledger:
                entry["ledger"] = ledger[key]
        entry.update(detail)
        violations.append(entry)

    for failure in manifest.schedule_failures:
        violation("schedule_failed", failure["key"], error=failure["error"])
    violations.extend(manifest.client_problems)
    if partitions < manifest.min_partitions:
        violation(
            "too_few_partitions", "jobs", partitions=partitions, wanted=manifest.min_partitions
        )

    # The jobs that must have finished: every one-off the stream scheduled and
    # every occurrence due before the stream stopped (later ones may still be
    # pending in the plan horizon when the beats stop).
    checked: list[JobRow] = []
    for key, task in manifest.jobs.items():
        job = by_key.get(key)
        if job is None:
            violation("lost", key, task=task, why="no row")
        else:
            checked.append(job)
    occurrences = [j for j in jobs if j.schedule is not None and j.due <= manifest.stream_end]
    checked.extend(occurrences)

    finished = ("succeeded",) if manifest.tracked else ("sent", "succeeded")
    losses = [f for f in manifest.faults if f.kind in BROKER_LOSSES]

    def lost_in_broker(job: JobRow) -> bool:
        when = job.dispatched
        return (
            not manifest.tracked
            and job.status == "sent"
            and when is not None
            and any(f.start - BROKER_HOLD <= when <= f.end for f in losses)
        )

    lost_to_broker = 0
    for job in checked:
        ran = bool(runs_by_job.get(job.id))
        if job.status in UNFINISHED:
            violation("stuck", job.key, job)
        elif job.status not in finished:
            violation("not_succeeded", job.key, job)
        elif not ran and lost_in_broker(job):
            lost_to_broker += 1
        elif not ran:
            violation("lost", job.key, job, why=f"row {job.status}, no execution started")
        if job.task in EFFECT_TASKS and effects.get(job.key, 0) != 1:
            violation("effect_not_once", job.key, job)

    for key, task in manifest.cancelled.items():
        job = by_key.get(key)
        if job is None:
            violation("lost", key, task=task, why="no row (cancelled)")
            continue
        if runs_by_job.get(job.id) or effects.get(key, 0):
            violation("cancelled_ran", key, job)
        if job.status != "cancelled":
            violation("cancelled_not_cancelled", key, job)

    for key, task in manifest.future.items():
        job = by_key.get(key)
        if job is None:
            violation("lost", key, task=task, why="no row (due after the soak)")
            continue
        if runs_by_job.get(job.id):
            violation("future_ran", key, job)
        if job.status != "pending":
            violation("future_not_pending", key, job)

    periodic: dict[str, Any] = {}
    for name, (_task, every) in manifest.periodic.items():
        mine = [j for j in occurrences if j.schedule == name]
        instants: collections.Counter[dt.datetime] = collections.Counter()
        for job in mine:
            nominal = _nominal(job.key)
            if nominal is None:
                violation("periodic_bad_key", job.key, job)
                continue
            instants[nominal] += 1
        for instant, count in instants.items():
            if count > 1:
                violation("periodic_duplicate", f"{name}@{instant.isoformat()}", count=count)
        ordered = sorted(instants)
        missing: list[dict[str, Any]] = []
        for before, after in itertools.pairwise(ordered):
            gap = (after - before).total_seconds()
            if abs(gap - every) > 1e-3:
                missing.append(
                    {"after": before.isoformat(), "before": after.isoformat(), "gap": gap}
                )
        for hole in missing:
            violation("periodic_gap", name, **hole)
        if not ordered:
            violation("periodic_none", name)
        periodic[name] = {
            "occurrences": len(mine),
            "first": ordered[0].isoformat() if ordered else None,
            "last": ordered[-1].isoformat() if ordered else None,
        }

    # Figures.
    duplicate_plain = sum(
        max(0, len(runs_by_job.get(j.id, [])) - 1) for j in checked if j.task in PLAIN_TASKS
    )
    duplicate_task_starts = sum(
        max(0, len(runs_by_job.get(j.id, [])) - 1) for j in checked if j.task not in PLAIN_TASKS
    )
    lags_all: list[float] = []
    lags_quiet: list[float] = []
    for job in checked:
        starts = [float(r[6]) for r in runs_by_job.get(job.id, [])]
        if not starts:
            continue
        # A job scheduled already overdue (the dense layout's past days) is
        # late from when it was scheduled, not from its due time.
        lag = min(starts) - max(job.due, manifest.stream_start)
        lags_all.append(lag)
        if not any(window.covers(job.due) for window in manifest.faults):
            lags_quiet.append(lag)
    statuses = collections.Counter(job.status for job in checked)
    counts = collections.Counter(v["invariant"] for v in violations)
    return {
        "jobs_scheduled": len(manifest.jobs),
        "jobs_cancelled": len(manifest.cancelled),
        "jobs_future": len(manifest.future),
        "partitions": partitions,
        "occurrences_checked": len(occurrences),
        "statuses": dict(sorted(statuses.items())),
        "runs": len(runs),
        "effects": sum(effects.values()),
        "lost_to_broker": lost_to_broker,
        "duplicate_plain_runs": duplicate_plain,
        "duplicate_task_starts": duplicate_task_starts,
        "lag_outside_faults_s": _percentiles(lags_quiet),
        "lag_all_s": _percentiles(lags_all),
        "periodic": periodic,
        "faults": [
            {
                "kind": f.kind,
                "at": round(f.start - manifest.stream_start, 1),
                "seconds": round(f.end - f.start, 2),
                "detail": f.detail,
            }
            for f in manifest.faults
        ],
        "violation_counts": dict(sorted(counts.items())),
        "violations": violations[:MAX_LISTED],
    }
