"""Leader failover: kill -9 the leading beat mid-stream; time the takeover, count losses.

Two ``celery beat -S celery_sched`` processes compete for the lease (TTL
``--lease-ttl``, default 3 s; visibility timeout ``--visibility``, default
5 s). ``--rate`` x ``--seconds`` jobs (default 500/s for 30 s) are scheduled
due from T0 + ``--lead`` s. A raw consumer pops every message from the Redis
list and records its task id (= job id) and the ``celery_sched_epoch``
header; like a worker's status tracking, it marks received jobs finished in
Postgres, so the reconciler only requeues jobs that never reached the
broker. ``--kill-after`` s into the stream the leader (found from the
``leaders`` table holder ``host:pid``) gets SIGKILL.

Reported per run: seconds from the kill until the first message published
under the new epoch arrived (and until ``min(dispatched_at)`` of the new
epoch, Postgres' clock), jobs lost (stored job ids never received once
everything settled; must be 0) and duplicate deliveries. ``--runs`` runs
(default 3); medians, and the max of lost.

    .venv/bin/python benchmarks/failover.py [--runs 3] [--rate 500] [--seconds 30]
        [--kill-after 10] [--lease-ttl 3] [--visibility 5]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import queue
import threading
import time
from typing import Any

import psycopg
from _common import (
    RawConsumer,
    Run,
    decode,
    emit,
    load_avg,
    median_of,
    progress,
    rounded,
)
from legacy_app import TASK, app

from celery_sched.client import Client
from tests.e2e.harness import wait_for

TARGET_LOST = 0

# What celery_sched.tracking does on a worker, in bulk: any unfinished job
# that was delivered is finished.
FINISH_SQL = """
UPDATE {s}.jobs SET status = 'succeeded', started_at = coalesce(started_at, now()),
    finished_at = now()
WHERE id = ANY(%s::uuid[])
    AND status IN ('pending', 'dispatched', 'running', 'retrying')
"""


class Finisher(threading.Thread):
    """Marks received jobs finished, in batches, as a worker's tracking would."""

    def __init__(self, run: Run) -> None:
        super().__init__(name="finisher", daemon=True)
        self.sql = FINISH_SQL.replace("{s}", f'"{run.name}"')
        self.dsn = run.dsn
        self.inbox: queue.Queue[list[bytes] | None] = queue.Queue()

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            done = False
            while not done:
                batch: list[str] = []
                item = self.inbox.get()
                while True:
                    if item is None:
                        done = True
                        break
                    batch.extend(decode(p, 0.0).job_id for p in item)
                    try:
                        item = self.inbox.get_nowait()
                    except queue.Empty:
                        break
                if batch:
                    conn.execute(self.sql, (batch,))
                time.sleep(0.1)

    def stop(self) -> None:
        self.inbox.put(None)
        self.join(30)


def run_once(ns: argparse.Namespace, index: int) -> dict[str, Any]:
    run = Run(
        "failover",
        broker="redis",
        lease_ttl=ns.lease_ttl,
        visibility_timeout=ns.visibility,
        reconcile_interval=1.0,
        sweep_interval=1.0,
    )
    consumer = RawConsumer(run.queue)
    finisher = Finisher(run)
    consumer.on_batch = lambda _now, items: finisher.inbox.put(items)
    try:
        with Client(app, settings=run.settings) as client:
            client.migrate()
            finisher.start()
            consumer.start()
            beats = [run.start_beat("beat-a"), run.start_beat("beat-b")]
            wait_for(run.leader_proc, timeout=60, interval=0.1, what="a leader")
            total = int(ns.rate * ns.seconds)
            t0 = time.time()
            first_due = t0 + ns.lead
            utc = dt.UTC
            from_ts = dt.datetime.fromtimestamp
            written = client.schedule_many(
                {"task": TASK, "args": [due, "f"], "eta": from_ts(due, utc)}
                for due in (first_due + i / ns.rate for i in range(total))
            )
        progress(
            "run %d: %d jobs scheduled (%s), due from T0+%ss for %ss",
            index,
            written,
            run.name,
            ns.lead,
            ns.seconds,
        )
        kill_at = first_due + ns.kill_after
        time.sleep(max(0.0, kill_at - time.time()))
        old = run.leader()
        victim = run.leader_proc()
        if old is None or victim is None:
            raise SystemExit("no leader to kill")
        killed_at = time.time()
        victim.kill_group()
        progress(
            "run %d: killed leader %s (pid %d, epoch %d)", index, victim.name, victim.pid, old[0]
        )
        new = wait_for(
            lambda: (lambda cur: cur if cur and cur[0] > old[0] else None)(run.leader()),
            timeout=60,
            interval=0.05,
            what="a new leader",
        )
        elected_s = time.time() - killed_at
        last_due = first_due + (total - 1) / ns.rate
        time.sleep(max(0.0, last_due - time.time()))
        stored = {str(r[0]) for r in run.query("SELECT id FROM {s}.jobs")}
        deadline = time.time() + ns.settle
        received: set[str] = set()
        while time.time() < deadline:
            received = {m.job_id for m in consumer.messages()}
            if stored <= received:
                break
            time.sleep(0.5)
        time.sleep(1.0)  # late duplicates from a requeue still in flight
        for beat in beats:
            beat.stop()
        consumer.stop()
        finisher.stop()

        messages = list(consumer.messages())
        counts = collections.Counter(m.job_id for m in messages)
        lost = stored - set(counts)
        duplicates = sum(n - 1 for n in counts.values() if n > 1)
        new_epoch_first = min(
            (m.received for m in messages if m.epoch is not None and m.epoch > old[0]),
            default=None,
        )
        pg_first = run.query(
            "SELECT extract(epoch FROM min(dispatched_at))::float8 FROM {s}.jobs"
            " WHERE leader_epoch = %s",
            new[0],
        )[0][0]
        statuses = dict(run.query("SELECT status, count(*) FROM {s}.jobs GROUP BY status"))
        result = {
            "jobs": len(stored),
            "received": len(messages),
            "lost": len(lost),
            "duplicates": duplicates,
            "failover_s": rounded(
                None if new_epoch_first is None else new_epoch_first - killed_at, 3
            ),
            "pg_failover_s": rounded(None if pg_first is None else float(pg_first) - killed_at, 3),
            "new_epoch_elected_s": round(elected_s, 3),
            "old_epoch": old[0],
            "new_epoch": new[0],
            "statuses": {str(k): int(v) for k, v in statuses.items()},
        }
        progress("run %d: %s", index, result)
        if lost:
            progress("run %d: lost ids (first 10): %s", index, sorted(lost)[:10])
            for beat in beats:
                progress("%s log tail:\n%s", beat.name, beat.tail())
        return result
    finally:
        if consumer.is_alive():
            consumer.stop()
        if finisher.is_alive():
            finisher.stop()
        run.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--lead", type=float, default=5.0, help="T0 to the first due job, s")
    parser.add_argument("--kill-after", type=float, default=10.0, help="s into the stream")
    parser.add_argument("--lease-ttl", type=float, default=3.0)
    parser.add_argument("--visibility", type=float, default=5.0)
    parser.add_argument("--settle", type=float, default=45.0, help="max wait for stragglers, s")
    ns = parser.parse_args()

    load_start = load_avg()
    runs = [run_once(ns, i + 1) for i in range(ns.runs)]
    lost_max = max(r["lost"] for r in runs)

    def med(name: str) -> float | None:
        return median_of(runs, name, 3)

    emit(
        {
            "benchmark": "failover",
            "broker": "redis",
            "rate": ns.rate,
            "seconds": ns.seconds,
            "lease_ttl": ns.lease_ttl,
            "visibility_timeout": ns.visibility,
            "runs": runs,
            "failover_s": med("failover_s"),
            "pg_failover_s": med("pg_failover_s"),
            "lost_max": lost_max,
            "duplicates": med("duplicates"),
            "targets": {"lost": TARGET_LOST},
            "met": {"lost": lost_max <= TARGET_LOST},
            "load_avg_1m_start": load_start,
            "load_avg_1m_end": load_avg(),
        }
    )


if __name__ == "__main__":
    main()
