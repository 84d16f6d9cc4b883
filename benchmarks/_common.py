"""Helpers shared by the dispatch, lag, failover, periodic, reconcile and
worker-overhead benchmarks.

Each benchmark run owns a :class:`Run`: a fresh Postgres schema, a Redis key
prefix and a queue name, all unique, and removes them in :meth:`Run.cleanup`
(drop schema, delete only its own Redis keys, delete its queue; never a
FLUSHALL). Beat and worker processes are real ``celery`` subprocesses of the
apps in this directory, configured through the environment. The process
harness, the isolation helpers and the polling are those of the end-to-end
tests (``tests/e2e/harness.py``); run the benchmarks with the project's
virtualenv, where ``tests`` is importable (an editable install).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import psycopg.sql
import redis

from celery_sched.settings import Settings
from tests.e2e.harness import (
    CELERY,
    ROOT,
    Proc,
    ProcessGroup,
    delete_keys,
    drop_schema,
    unique_name,
)

HERE = Path(__file__).resolve().parent

PG_URL = os.environ.get(
    "CELERY_SCHED_BENCH_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("CELERY_SCHED_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
AMQP_URL = os.environ.get("CELERY_SCHED_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def progress(message: str, *args: Any) -> None:
    """One human-readable progress line (the JSON object is always printed last)."""
    print(f"[{time.strftime('%H:%M:%S')}] " + (message % args if args else message), flush=True)


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def broker_url(name: str) -> str:
    return {"redis": REDIS_URL, "amqp": AMQP_URL}.get(name, name)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def median_of(runs: Sequence[dict[str, Any]], name: str, digits: int = 3) -> float | None:
    """The median of field ``name`` over ``runs`` (those that have it), rounded."""
    return rounded(median([run[name] for run in runs if run[name] is not None]), digits)


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


# -- one run's isolated resources ---------------------------------------------------


class Run(ProcessGroup):
    """A schema, Redis prefix, queue and temp dir unique to one benchmark run.

    ``name`` is all three: the schema, the key prefix (redbeat's keys too) and
    the stem of the queue's name.
    """

    def __init__(self, name: str, *, broker: str, **settings: Any) -> None:
        self.name = unique_name(f"bench_{name}")
        self.broker = broker_url(broker)
        self.queue = self.name + "_q"
        self.redis = redis.Redis.from_url(REDIS_URL)
        run_settings = Settings(
            database_url=PG_URL,
            redis_url=REDIS_URL,
            db_schema=self.name,
            key_prefix=self.name,
            hostname=f"celery_sched@{self.name}",
            **settings,
        )
        super().__init__(
            tmp_path=Path(tempfile.mkdtemp(prefix=self.name + "_")),
            settings=run_settings,
            env={
                "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
                "BENCH_BROKER_URL": self.broker,
                "BENCH_QUEUE": self.queue,
                "BENCH_REDIS_URL": REDIS_URL,
                "BENCH_REDBEAT_PREFIX": self.name + ":redbeat:",
                "CELERY_SCHED_HOSTNAME": run_settings.hostname,
            },
        )

    # -- processes --

    def start_beat(
        self,
        name: str,
        *,
        app: str = "legacy_app",
        scheduler: str = "celery_sched",
        loglevel: str = "INFO",
        **env: str,
    ) -> Proc:
        """A real ``celery -A <app> beat -S <scheduler>`` subprocess."""
        return self._spawn(
            name,
            [
                CELERY,
                "-A",
                app,
                "beat",
                "-S",
                scheduler,
                f"--loglevel={loglevel}",
                "-s",
                str(self.tmp_path / f"{name}-schedule"),
                "--pidfile=",
            ],
            env,
        )

    def start_worker(self, name: str, *, app: str, pool: str, concurrency: int, **env: str) -> Proc:
        """A real ``celery -A <app> worker`` subprocess consuming the run's queue."""
        return self._spawn(
            name,
            [
                CELERY,
                "-A",
                app,
                "worker",
                f"--pool={pool}",
                f"--concurrency={concurrency}",
                "-Q",
                self.queue,
                "-n",
                f"{name}.{self.name}@%h",
                "--without-heartbeat",
                "--without-gossip",
                "--without-mingle",
                "--loglevel=WARNING",
            ],
            env,
        )

    # -- Postgres --

    def dispatched_span(self) -> tuple[dt.datetime | None, dt.datetime | None, int]:
        row = self.query(
            "SELECT min(dispatched_at), max(dispatched_at), count(dispatched_at) FROM {s}.jobs"
        )[0]
        return row[0], row[1], int(row[2])

    # -- cleanup --

    def cleanup(self, *, keep_logs: bool = False) -> None:
        """Remove everything this run created (best effort, never FLUSHALL)."""
        self.stop_all()
        with contextlib.suppress(Exception):
            drop_schema(self.dsn, self.schema)
        with contextlib.suppress(Exception):
            delete_keys(self.redis, self.name)
        with contextlib.suppress(Exception):
            delete_queue(self.broker, self.queue)
        with contextlib.suppress(Exception):
            # Kombu's Redis transport keeps the queue's exchange bindings in
            # keys of its own, which queue_delete leaves behind.
            self.redis.delete(
                f"_kombu.binding.{self.queue}", f"_kombu.binding_permanent.{self.queue}"
            )
        with contextlib.suppress(Exception):
            self.redis.close()
        if not keep_logs:
            shutil.rmtree(self.tmp_path, ignore_errors=True)


# -- the broker side -----------------------------------------------------------------


def delete_queue(broker: str, queue: str) -> None:
    from kombu import Connection

    with Connection(broker) as conn:
        channel: Any = conn.default_channel
        with contextlib.suppress(Exception):
            channel.queue_purge(queue)
        channel.queue_delete(queue)


class QueueDepth:
    """How many messages sit in ``queue``: LLEN on Redis, a passive declare on AMQP."""

    def __init__(self, broker: str, queue: str) -> None:
        self.queue = queue
        self._redis: redis.Redis | None = None
        self._conn: Any = None
        if broker.startswith(("redis://", "rediss://")):
            self._redis = redis.Redis.from_url(broker)
        else:
            from kombu import Connection

            self._conn = Connection(broker)
            self._conn.connect()
            self._channel = self._conn.channel()

    def __call__(self) -> int:
        if self._redis is not None:
            return int(self._redis.llen(self.queue))
        try:
            ok = self._channel.queue_declare(self.queue, passive=True)
        except Exception:  # the queue is not declared yet
            self._channel = self._conn.channel()
            return 0
        return int(ok.message_count)

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.release()


def watch_depth(
    depth: QueueDepth,
    *,
    target: int,
    start_timeout: float,
    window: float,
    interval: float = 0.02,
    alive: Any = None,
) -> list[tuple[float, int]]:
    """Sample the queue depth every ``interval`` s until ``target`` messages arrived,
    ``window`` s passed since the first one, or none came within ``start_timeout``.

    Returns ``(monotonic time, depth)`` samples from the last empty sample on.
    """
    samples: list[tuple[float, int]] = []
    started = time.monotonic()
    first: float | None = None
    last_empty = (started, 0)
    while True:
        now = time.monotonic()
        count = depth()
        if count == 0 and first is None:
            last_empty = (now, 0)
        else:
            if first is None:
                first = now
                samples.append(last_empty)
            samples.append((now, count))
            if count >= target or now - first >= window:
                return samples
        if first is None and now - started > start_timeout:
            return samples
        if alive is not None and not alive() and first is None:
            return samples
        time.sleep(interval)


def arrival_window(samples: list[tuple[float, int]]) -> tuple[float, float, int]:
    """``(first arrival, last arrival, final depth)`` of at least two ``samples``."""
    final = samples[-1][1]
    t_first = (samples[0][0] + samples[1][0]) / 2
    t_last = next(t for t, count in samples if count == final)
    return t_first, t_last, final


class CpuSampler:
    """Samples a process's CPU time (user + system, from /proc) every ``interval`` s.

    ``used(t0, t1)``: CPU seconds the process spent between two monotonic
    times, from the nearest samples. CPU per job is steadier than wall-clock
    throughput on a shared 2-core machine.
    """

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self._stat = Path(f"/proc/{pid}/stat")
        self._tick = os.sysconf("SC_CLK_TCK")
        self._interval = interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _cpu(self) -> float | None:
        try:
            fields = self._stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        # After the command name: state is field 3, utime 14 and stime 15.
        return (int(fields[11]) + int(fields[12])) / self._tick

    def _run(self) -> None:
        while not self._stop.is_set():
            cpu = self._cpu()
            if cpu is not None:
                self.samples.append((time.monotonic(), cpu))
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def used(self, t0: float, t1: float) -> float | None:
        def at(t: float) -> float | None:
            before = [cpu for when, cpu in self.samples if when <= t]
            return before[-1] if before else None

        start, end = at(t0), at(t1)
        return None if start is None or end is None else end - start


def arrival_rate(samples: list[tuple[float, int]], target: int) -> dict[str, Any]:
    """Messages per second between the first and the last arrival seen in ``samples``.

    The first arrival is placed halfway between the last empty sample and the
    first non-empty one; the end is the first sample at the final depth.
    """
    if len(samples) < 2:
        return {"messages": 0, "seconds": None, "per_s": 0.0}
    t_first, t_last, final = arrival_window(samples)
    seconds = max(t_last - t_first, 1e-3)
    return {
        "messages": final,
        "complete": final >= target,
        "seconds": round(seconds, 3),
        "per_s": round(final / seconds, 1),
    }


# -- a raw consumer ------------------------------------------------------------------


class Received:
    """One message as the raw consumer saw it."""

    __slots__ = ("args", "epoch", "job_id", "received")

    def __init__(self, received: float, job_id: str, epoch: int | None, args: list[Any]) -> None:
        self.received = received
        self.job_id = job_id
        self.epoch = epoch
        self.args = args


def decode(payload: bytes, received: float) -> Received:
    """Decode one Kombu-over-Redis envelope into what the benchmarks need."""
    envelope = json.loads(payload)
    body = envelope["body"]
    if envelope["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args, _kwargs, _embed = json.loads(body)
    headers = envelope.get("headers") or {}
    epoch = headers.get("celery_sched_epoch")
    return Received(received, str(headers.get("id")), None if epoch is None else int(epoch), args)


class RawConsumer(threading.Thread):
    """Pops the queue's Redis list as fast as it can, stamping receive times.

    Decoding is deferred to :meth:`messages`, so the loop only pops and
    timestamps; a batch popped in one RPOP shares one receive time.
    """

    def __init__(self, queue: str, url: str = REDIS_URL) -> None:
        super().__init__(name="raw-consumer", daemon=True)
        self.queue = queue
        self.client = redis.Redis.from_url(url)
        self._raw: list[tuple[float, list[bytes]]] = []
        self._stop_event = threading.Event()
        self.count = 0
        self.on_batch: Any = None

    def run(self) -> None:
        client, queue, raw = self.client, self.queue, self._raw
        while not self._stop_event.is_set():
            items: Any = client.rpop(queue, 1000)
            if not items:
                popped: Any = client.brpop([queue], timeout=0.05)
                if not popped:
                    continue
                items = [popped[1]]
            now = time.time()
            raw.append((now, items))
            self.count += len(items)
            if self.on_batch is not None:
                self.on_batch(now, items)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)
        self.client.close()

    def messages(self) -> Iterator[Received]:
        for received, items in self._raw:
            for payload in items:
                yield decode(payload, received)


def drop_indexes(conninfo: str, schema: str, names: Sequence[str]) -> None:
    """Drop these indexes of ``schema`` (an A/B of what an index costs); each must exist."""
    if not names:
        return
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for name in names:
            conn.execute(
                psycopg.sql.SQL("DROP INDEX {}.{}").format(
                    psycopg.sql.Identifier(schema), psycopg.sql.Identifier(name)
                )
            )
    progress("dropped index(es) %s of %s", ", ".join(names), schema)


def emit(result: dict[str, Any]) -> None:
    """The benchmark's one JSON object, as the last line of stdout."""
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


# -- CPU of the services, from /proc ---------------------------------------------------


def proc_cpu(pid: int) -> float | None:
    """CPU seconds process ``pid``'s live threads have used, or None if it is gone.

    From each thread's ``schedstat`` (nanoseconds; /proc's ``stat`` counts
    10 ms ticks, too coarse for a few thousand jobs), else from ``stat``
    (which also counts threads that ended).
    """
    try:
        total = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0])
        return total / 1e9
    except (OSError, IndexError, ValueError):
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_server_pid(url: str = REDIS_URL) -> int | None:
    """The pid of the Redis server at ``url`` when it runs on this machine."""
    client = redis.Redis.from_url(url)
    try:
        pid = int(client.info("server")["process_id"])
    except (redis.RedisError, KeyError, ValueError):
        return None
    finally:
        client.close()
    return pid if proc_cpu(pid) is not None else None


class ServiceCpu:
    """CPU the services spend for one run: the PostgreSQL backends whose
    ``application_name`` contains ``marker`` (celery_sched names its
    connections after the schema) and the whole redis-server process.

    :meth:`snapshot` reads them all; :meth:`since` gives the seconds used
    since an earlier snapshot. A backend that appeared between the two counts
    from zero, one that ended is lost (keep connections pooled across a
    measured stretch). redis-server serves every client of the machine, so
    its figure holds only while nothing else uses it much.
    """

    def __init__(self, conninfo: str, marker: str, redis_url: str = REDIS_URL) -> None:
        self.conninfo = conninfo
        self.marker = marker
        self.redis_pid = redis_server_pid(redis_url)

    def backends(self) -> list[int]:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE strpos(application_name, %s) > 0",
                (self.marker,),
            ).fetchall()
        return [int(row[0]) for row in rows]

    def snapshot(self) -> dict[str, Any]:
        pg = {pid: cpu for pid in self.backends() if (cpu := proc_cpu(pid)) is not None}
        redis_cpu = None if self.redis_pid is None else proc_cpu(self.redis_pid)
        return {"pg": pg, "redis": redis_cpu, "at": time.monotonic()}

    def since(self, before: dict[str, Any]) -> dict[str, float | None]:
        """``{"pg": seconds, "redis": seconds}`` used since ``before``."""
        now = self.snapshot()
        pg = sum(cpu - before["pg"].get(pid, 0.0) for pid, cpu in now["pg"].items())
        redis_used = (
            None
            if now["redis"] is None or before["redis"] is None
            else now["redis"] - before["redis"]
        )
        return {"pg": pg, "redis": redis_used}
