"""Per-job cost of every stage a job passes through, in µs per job (issue #31, target 7).

One run schedules ``--jobs`` jobs (default 20,000) due a minute ago into a
fresh schema, then takes the same jobs through each stage in turn, calling
the project's own entry points in this process against the real PostgreSQL
and Redis (no celery worker or beat process):

- ``client_build``: ``Client.schedule_many``'s validation and row building,
  into a store whose ``load_job_rows`` only collects the rows;
- ``copy``: the store's ``load_job_rows`` of those rows (the COPY);
- ``staging``: the leader's stager reading the jobs by due time
  (``due_soon``) into the Redis staging set (``Staging.add``), and its
  claimer popping them, ``batch_size`` ids at a time (``pop_due``);
- ``claim``: ``claim_ids`` of each popped batch (a leader's claim in
  steady state; the sweep's ``claim_due`` of overdue jobs is not timed),
  plus ``record_published`` per batch after it is sent;
- ``publish``: the beat's dispatcher (``backends.build_dispatcher``)
  ``publish`` of each claimed batch: envelopes and the Redis pipeline;
- ``broker``: redis-server's side of a message: the same envelopes pushed
  raw (pipelined ``LPUSH`` per batch) and popped (``RPOP`` 1,000 at a time),
  repeated for at least half a second; its wall figure is client round
  trips, its redis column the server's CPU per message in and out;
- ``fence``: ``DeliveryFence.check`` per delivery, one at a time, as a
  worker's main process checks each message today;
- ``status``: a ``StatusWriter`` given a ``running`` and a ``succeeded``
  report per job, written by its own flushes (every job ends succeeded);
- ``ledger``: ``Ledger.acquire`` and ``complete`` per job, what
  ``celery_sched.Task`` adds around a task (run before ``status``: a
  succeeded job fences the acquire).

Each stage prints its wall time per job in this process (the figure the
table and the JSON's ``us_per_job`` give), this process's CPU (all threads),
the CPU of the run's PostgreSQL backends (found by ``application_name``)
and of redis-server (it serves the whole machine, so its column holds only
while nothing else is busy with it), both from /proc (each thread's
``schedstat``, in nanoseconds). Not covered: Kombu consuming and Celery's
request handling in a worker, the prefork pool, the client's Redis staging
of jobs due soon (the client runs with ``staging=False``), the sweep's
``claim_due`` and the leader's loop around its claims. The fence is
measured where it runs today (one read per message); a fence that moves or
batches its reads needs this stage changed with it.

    .venv/bin/python benchmarks/cost.py [--jobs 20000] [--runs 1]

With ``--runs`` above 1 every figure is the median over runs. The last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import functools
import os
import statistics
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import redis
from celery import Celery

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import PG_URL, REDIS_URL, ServiceCpu, emit, load_avg  # noqa: E402

from celery_sched import backends  # noqa: E402
from celery_sched.client import Client  # noqa: E402
from celery_sched.fence import DeliveryFence  # noqa: E402
from celery_sched.leader.staging import STAGE_BATCHES, STAGE_LIMIT_MIN  # noqa: E402
from celery_sched.models import ClaimOutcome, Job, JobStatus, WorkerUpdate  # noqa: E402
from celery_sched.settings import Settings  # noqa: E402
from celery_sched.tracking import StatusWriter  # noqa: E402
from tests.e2e.harness import delete_keys, drop_schema, unique_name  # noqa: E402

STAGES = (
    "client_build",
    "copy",
    "staging",
    "claim",
    "publish",
    "broker",
    "fence",
    "status",
    "ledger",
)
TASK = "cost.noop"
#: The broker stage repeats its push and pop until this many seconds passed.
BROKER_MIN_SECONDS = 0.5


@dataclasses.dataclass
class StageCost:
    """What one stage cost for ``jobs`` jobs, in seconds (wall and CPU)."""

    name: str
    jobs: int
    wall: float
    client_cpu: float
    pg_cpu: float | None = None
    redis_cpu: float | None = None
    #: Broker only: the wall time of the raw LPUSH alone (the publish reference).
    push_wall: float | None = None

    def per_job(self, seconds: float | None) -> float | None:
        return None if seconds is None else seconds / self.jobs * 1e6

    def row(self) -> dict[str, float | None]:
        return {
            "us_per_job": self.per_job(self.wall),
            "client_cpu_us": self.per_job(self.client_cpu),
            "pg_cpu_us": self.per_job(self.pg_cpu),
            "redis_cpu_us": self.per_job(self.redis_cpu),
        }


class _Meter:
    """Times one stretch: wall, this process's CPU, and the services' CPU."""

    def __init__(self, services: ServiceCpu) -> None:
        self.services = services

    @contextlib.contextmanager
    def measure(self, name: str, jobs: int, out: list[StageCost]) -> Iterator[None]:
        before = self.services.snapshot()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        yield
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        used = self.services.since(before)
        out.append(StageCost(name, jobs, wall, cpu, used["pg"], used["redis"]))


class _CollectingStore:
    """A job store whose bulk write only collects the rows it is given (so
    ``Client.schedule_many`` can be timed without its write)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.rows: list[Any] = []

    def load_job_rows(self, rows: Iterable[Any]) -> int:
        before = len(self.rows)
        self.rows.extend(rows)
        return len(self.rows) - before

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@functools.cache
def make_app(redis_url: str) -> Celery:
    """The Celery app of the jobs (one per process: a task name registers once)."""
    app = Celery("cost", broker=redis_url, set_as_current=False)
    app.conf.task_send_sent_event = False

    @app.task(name=TASK)
    def noop(*args: Any) -> None:
        return None

    return app


def measure(
    jobs: int = 20_000, *, pg_url: str = PG_URL, redis_url: str = REDIS_URL
) -> dict[str, StageCost]:
    """One pass of ``jobs`` jobs through every stage; each stage's cost."""
    name = unique_name("bench_cost")
    queue = name + "_q"
    settings = Settings(
        database_url=pg_url,
        redis_url=redis_url,
        db_schema=name,
        key_prefix=name,
        hostname=f"celery_sched@{name}",
    )
    app = make_app(redis_url)
    costs: list[StageCost] = []
    meter = _Meter(ServiceCpu(settings.libpq_conninfo(), name, redis_url))
    store = backends.build_store(settings)
    raw = redis.Redis.from_url(redis_url)
    dispatcher = backends.build_dispatcher(app, settings)
    ledger = backends.build_ledger(settings, store)
    staging = backends.build_staging(settings)
    try:
        store.migrate()
        due = store.now() - dt.timedelta(minutes=1, milliseconds=jobs)
        # A millisecond apart, due a minute ago (the staging reads go by due time).
        rows = [
            {
                "task": TASK,
                "args": [i, "x" * 16],
                "eta": due + dt.timedelta(milliseconds=i),
                "queue": queue,
            }
            for i in range(jobs)
        ]
        collector = _CollectingStore(store)
        # The client closes no store it was given.
        client = Client(app, settings=settings, store=collector, staging=False)
        with meter.measure("client_build", jobs, costs):
            built = client.schedule_many(rows)
        assert built == jobs, built

        # Warm the pools, so no stage pays for opening connections.
        store.counts_by_status()
        with meter.measure("copy", jobs, costs):
            written = store.load_job_rows(collector.rows)
        assert written == jobs, written
        with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
            conn.execute(f'VACUUM ANALYZE "{name}".jobs')

        epoch = store.acquire_epoch(0, "cost")
        popped = _staging(meter, store, staging, settings, jobs, costs)
        claimed: list[list[Job]] = []
        claim_costs: list[StageCost] = []
        with meter.measure("claim", jobs, claim_costs):
            for ids in popped:
                claimed.append(store.claim_ids(ids, shard=0, epoch=epoch))
        delivered = [job for batch in claimed for job in batch]
        assert len(delivered) == jobs, len(delivered)

        now = store.now()
        with meter.measure("publish", jobs, costs):
            for batch in claimed:
                result = dispatcher.publish(batch, epoch=epoch, now=now)
                if len(result.sent) != len(batch):
                    raise RuntimeError(f"published {len(result.sent)} of {len(batch)}")
        with meter.measure("claim", jobs, claim_costs):
            for batch in claimed:
                store.record_published(
                    sorted({job.claim_id for job in batch if job.claim_id is not None}), shard=0
                )
        costs.append(_sum("claim", claim_costs))

        envelopes: list[bytes] = raw.lrange(queue, 0, -1)  # type: ignore[assignment]
        assert len(envelopes) == jobs, len(envelopes)
        raw.delete(queue)
        costs.append(_broker(meter, raw, queue, envelopes, settings.batch_size))

        fence = DeliveryFence(ledger)
        check = fence.check
        with meter.measure("fence", jobs, costs):
            refused = sum(
                check(job.id, job.attempt, job.due_at).reason is not None for job in delivered
            )
        assert refused == 0, f"the fence refused {refused} fresh deliveries"

        runtime_owner = f"cost:{os.getpid()}:"
        lease = settings.ledger_lease
        taken = 0
        with meter.measure("ledger", jobs, costs):
            for i, job in enumerate(delivered):
                owner = runtime_owner + str(i)
                claim = ledger.acquire(
                    job.key,
                    owner=owner,
                    lease=lease,
                    job_id=job.id,
                    attempt=job.attempt,
                    take_completed=True,
                    due_at=job.due_at,
                )
                taken += claim.outcome is ClaimOutcome.ACQUIRED
                ledger.complete(job.key, owner=owner, result=None, job_id=job.id)
        assert taken == jobs, f"the ledger gave {taken} of {jobs} keys"

        costs.append(_status(meter, store, delivered, settings.hostname))
        succeeded = store.counts_by_status().get(JobStatus.SUCCEEDED, 0)
        assert succeeded == jobs, f"{succeeded} of {jobs} jobs succeeded"
    finally:
        with contextlib.suppress(Exception):
            raw.delete(queue)
        dispatcher.close()
        ledger.close()
        store.close()
        delete_keys(raw, name)
        raw.close()
        drop_schema(settings.libpq_conninfo(), name)
    by_name = {cost.name: cost for cost in costs}
    return {stage: by_name[stage] for stage in STAGES}


def _sum(name: str, parts: list[StageCost]) -> StageCost:
    def total(values: list[float | None]) -> float | None:
        return None if any(v is None for v in values) else sum(v for v in values if v is not None)

    return StageCost(
        name,
        parts[0].jobs,
        sum(p.wall for p in parts),
        sum(p.client_cpu for p in parts),
        total([p.pg_cpu for p in parts]),
        total([p.redis_cpu for p in parts]),
    )


def _staging(
    meter: _Meter,
    store: Any,
    staging: Any,
    settings: Settings,
    jobs: int,
    out: list[StageCost],
) -> list[list[Any]]:
    """The leader's staging of every job (read from PostgreSQL by due time,
    added to the Redis set) and its pops of due ids, a batch at a time;
    returns the popped batches of ids."""
    limit = max(settings.batch_size * STAGE_BATCHES, STAGE_LIMIT_MIN)
    window = settings.staging_window
    popped: list[list[Any]] = []
    with meter.measure("staging", jobs, out):
        after = None
        staged = 0
        while items := store.due_soon(shard=0, within=window, limit=limit, after=after):
            staging.add(0, items)
            staged += len(items)
            after = items[-1][1]
            if len(items) < limit:
                break
        now = store.now()
        while ids := staging.pop_due(0, now, settings.batch_size):
            popped.append(ids)
    count = sum(len(ids) for ids in popped)
    if staged != jobs or count != jobs:
        raise RuntimeError(f"staged {staged} and popped {count} of {jobs} jobs")
    return popped


def _broker(
    meter: _Meter, raw: redis.Redis, queue: str, envelopes: list[bytes], batch: int
) -> StageCost:
    """Push the envelopes raw and pop them, round after round; the cost per message."""
    rounds: list[StageCost] = []
    push_wall = 0.0
    started = time.perf_counter()
    while not rounds or (time.perf_counter() - started < BROKER_MIN_SECONDS and len(rounds) < 20):
        with meter.measure("broker", len(envelopes), rounds):
            t0 = time.perf_counter()
            for i in range(0, len(envelopes), batch):
                pipe = raw.pipeline(transaction=False)
                pipe.lpush(queue, *envelopes[i : i + batch])
                pipe.execute()
            push_wall += time.perf_counter() - t0
            popped = 0
            while items := raw.rpop(queue, 1000):
                popped += len(items)  # type: ignore[arg-type]
        assert popped == len(envelopes), popped
    total = _sum("broker", rounds)
    return dataclasses.replace(total, jobs=total.jobs * len(rounds), push_wall=push_wall)


def _status(meter: _Meter, store: Any, delivered: list[Job], hostname: str) -> StageCost:
    """A running and a succeeded report per job, as a worker's signals make them."""
    pid = os.getpid()
    out: list[StageCost] = []
    # A long interval: the writer flushes when FLUSH_SIZE reports wait, and
    # close() writes the rest.
    with meter.measure("status", len(delivered), out):
        writer = StatusWriter(store, interval=3600.0, tasks=[TASK])
        report = writer.report
        for job in delivered:
            report(
                WorkerUpdate(
                    job_id=job.id,
                    status=JobStatus.RUNNING,
                    worker=hostname,
                    worker_pid=pid,
                    attempt=job.attempt,
                    due_at=job.due_at,
                )
            )
        writer.flush()
        for job in delivered:
            report(WorkerUpdate(job_id=job.id, status=JobStatus.SUCCEEDED, due_at=job.due_at))
        writer.close()
    return out[0]


# -- the table -----------------------------------------------------------------------

COLUMNS = ("us_per_job", "client_cpu_us", "pg_cpu_us", "redis_cpu_us")


def table(rows: dict[str, dict[str, float | None]]) -> str:
    """The stages as a readable table (µs per job)."""

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    header = f"{'stage':<14}" + "".join(f"{c:>15}" for c in COLUMNS)
    lines = [header, "-" * len(header)]
    for stage, row in rows.items():
        lines.append(f"{stage:<14}" + "".join(f"{cell(row[c]):>15}" for c in COLUMNS))
    return "\n".join(lines)


def median_rows(runs: list[dict[str, StageCost]]) -> dict[str, dict[str, float | None]]:
    """Each stage's figures: the median over runs, rounded."""
    out: dict[str, dict[str, float | None]] = {}
    for stage in STAGES:
        rows = [run[stage].row() for run in runs]
        out[stage] = {}
        for column in COLUMNS:
            values = [row[column] for row in rows if row[column] is not None]
            out[stage][column] = (
                round(statistics.median(values), 2) if len(values) == len(rows) else None
            )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs through every stage")
    parser.add_argument("--runs", type=int, default=1, help="passes; figures are medians")
    parser.add_argument("--pg-url", default=PG_URL, help="PostgreSQL (SQLAlchemy URL)")
    parser.add_argument("--redis-url", default=REDIS_URL, help="Redis, also the broker")
    ns = parser.parse_args(argv)
    load_start = load_avg()
    started = time.perf_counter()
    runs: list[dict[str, StageCost]] = []
    for index in range(ns.runs):
        runs.append(measure(ns.jobs, pg_url=ns.pg_url, redis_url=ns.redis_url))
        print(f"run {index + 1}: {time.perf_counter() - started:.1f}s", flush=True)
    rows = median_rows(runs)
    print(f"µs per job, {ns.jobs:,} jobs, median of {ns.runs} run(s)")
    print(table(rows))
    publish = rows["publish"]["us_per_job"]
    raw_lpush = statistics.median(
        run["broker"].per_job(run["broker"].push_wall) or 0.0 for run in runs
    )
    print(
        f"raw pipelined LPUSH of the same envelopes: {raw_lpush:.2f} µs per job; "
        f"publish's rate is {raw_lpush / publish if publish else 0:.2f}x its rate"
    )
    emit(
        {
            "benchmark": "cost",
            "jobs": ns.jobs,
            "runs": ns.runs,
            "us_per_job": {stage: rows[stage]["us_per_job"] for stage in STAGES},
            "stages": rows,
            "per_run_us_per_job": [
                {stage: round(run[stage].per_job(run[stage].wall) or 0.0, 2) for stage in STAGES}
                for run in runs
            ],
            "total_us_per_job": round(sum(rows[s]["us_per_job"] or 0.0 for s in STAGES), 2),
            "raw_lpush_us_per_job": round(raw_lpush, 2),
            # The dispatch ratio: publish rate / raw LPUSH rate.
            "publish_vs_raw_lpush": round(raw_lpush / publish, 2) if publish else None,
            "seconds": round(time.perf_counter() - started, 1),
            "load_avg_1m_start": load_start,
            "load_avg_1m_end": load_avg(),
        }
    )


if __name__ == "__main__":
    main()
