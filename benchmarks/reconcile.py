"""Reconciler throughput: requeueing 100,000 stale dispatched jobs while the live loop claims.

Per round (fresh schema): ``--jobs`` jobs (default 100,000) are written as
dispatched an hour ago by the current leader epoch (their messages were
lost), plus ``--live`` pending jobs due now for the live loop. Then:

1. baseline: one thread claims the live jobs (``claim_due``, batches of
   ``--batch``) for ``--baseline`` seconds alone;
2. reconcile: the main thread runs ``JobStore.reconcile`` passes of ``--limit``
   rows (the engine's default: 10 x batch size) until a pass moves fewer,
   while the claimer keeps claiming.

Reported: seconds to requeue all stale jobs, rows/s, pass times (each pass
is one transaction; inside the engine it is the longest the leader loop
stalls), and the claimer's rows/s alone and during the reconcile, with
their ratio. Requeued jobs are due, so the claimer picks them up too.

    .venv/bin/python benchmarks/reconcile.py [--jobs 100000] [--live 400000]
        [--rounds 3] [--limit 10000] [--batch 1000] [--baseline 3]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import threading
import time
from typing import Any

from _common import Run, emit, load_avg, median, progress, rounded

from celery_sched.store.postgres import PostgresJobStore
from tests.e2e.harness import percentile

#: Keyless rows, as ``schedule_many`` writes jobs given no key: key NULL and
#: a version-7 id (time-ordered, from the due time), which takes no
#: ``job_keys`` entry (migration 0014 refuses a raw writer's row that would
#: need one and has none).
JOBS_SQL = """
INSERT INTO {s}.jobs (id, key, task, body, content_type, content_encoding, argsrepr,
    kwargsrepr, options, due_at, due_bucket, status, attempt, max_attempts, shard,
    leader_epoch, dispatched_at)
SELECT (lpad(to_hex(floor(extract(epoch FROM due) * 1000)::bigint), 12, '0') || '7'
        || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid,
    NULL, 'bench.noop',
    convert_to('[[], {}, {}]', 'UTF8'), 'application/json', 'utf-8', '()', '{}',
    '{}'::jsonb, due, floor(extract(epoch FROM due) / 60)::int, %(status)s, 0, 5, 0,
    %(epoch)s, now() - %(dispatched_ago)s::interval
FROM (SELECT i, now() - interval '2 hours' + (i %% 3600) * interval '1 second' AS due,
             md5(i::text || random()::text) AS h
      FROM generate_series(1, %(n)s) AS i) AS g
"""


class Claimer(threading.Thread):
    """The live loop's claims, timed per batch, until stopped or out of due jobs."""

    def __init__(self, store: PostgresJobStore, epoch: int, batch: int) -> None:
        super().__init__(name="claimer", daemon=True)
        self.store = store
        self.epoch = epoch
        self.batch = batch
        self.samples: list[tuple[float, float, int]] = []  # (start, end, rows)
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                started = time.monotonic()
                rows = len(self.store.claim_due(shard=0, epoch=self.epoch, limit=self.batch))
                self.samples.append((started, time.monotonic(), rows))
                if rows == 0:
                    time.sleep(0.05)
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def rate(self, start: float, end: float) -> dict[str, Any]:
        """Rows/s of the batches that started within [start, end)."""
        window = [s for s in self.samples if start <= s[0] < end and s[2] > 0]
        if not window:
            return {"rows": 0, "per_s": None, "batch_p50_ms": None, "batch_p99_ms": None}
        rows = sum(s[2] for s in window)
        seconds = max(window[-1][1] - window[0][0], 1e-6)
        return {
            "rows": rows,
            "per_s": round(rows / seconds, 1),
            "batch_p50_ms": rounded(percentile([(s[1] - s[0]) * 1000 for s in window], 50), 1),
            "batch_p99_ms": rounded(percentile([(s[1] - s[0]) * 1000 for s in window], 99), 1),
        }


def run_round(ns: argparse.Namespace, index: int) -> dict[str, Any]:
    run = Run("reconcile", broker="redis", batch_size=ns.batch, statement_timeout=600.0)
    store = PostgresJobStore(run.settings)
    try:
        store.migrate()
        epoch = store.acquire_epoch(0, "bench")
        # The jobs table is partitioned by due time: the rows' ranges first.
        now = store.now()
        store.ensure_partitions([now - dt.timedelta(hours=2), now - dt.timedelta(hours=1)])
        started = time.perf_counter()
        sql = JOBS_SQL.replace("{s}", f'"{run.name}"')
        stale = {"status": "dispatched", "epoch": epoch, "n": ns.jobs}
        live = {"status": "pending", "epoch": None, "n": ns.live}
        with run.connect() as conn:
            # Dispatched an hour ago by this epoch; their messages were lost.
            conn.execute(sql, {**stale, "dispatched_ago": "1 hour"})
            conn.execute(sql, {**live, "dispatched_ago": None})
            if ns.in_flight:
                # Dispatched a moment ago: in flight, not stale (untracked
                # jobs stay so a whole visibility timeout).
                conn.execute(sql, {**stale, "n": ns.in_flight, "dispatched_ago": "10 seconds"})
            conn.execute(f'VACUUM ANALYZE "{run.name}".jobs')
        progress(
            "round %d: %d stale dispatched + %d live pending jobs written in %.1fs",
            index,
            ns.jobs,
            ns.live,
            time.perf_counter() - started,
        )

        # Tracked workers (a heartbeat that lists no tasks tracks every
        # task): the reconciler requeues, as in a tracked deployment.
        store.heartbeat("bench@reconcile", os.getpid())
        claimer = Claimer(store, epoch, ns.batch)
        base_start = time.monotonic()
        claimer.start()
        time.sleep(ns.baseline)
        rec_start = time.monotonic()
        passes: list[float] = []
        moved = 0
        while True:
            pass_start = time.monotonic()
            result = store.reconcile(
                shard=0, epoch=epoch, limit=ns.limit, default_visibility_timeout=300.0
            )
            passes.append(time.monotonic() - pass_start)
            moved += result.requeued + result.dead
            if result.requeued + result.dead < ns.limit:
                break
        rec_end = time.monotonic()
        # Passes that find nothing stale, the in-flight rows still there: a
        # leader's pass in the steady state.
        idle: list[float] = []
        for _ in range(ns.idle_passes):
            pass_start = time.monotonic()
            store.reconcile(shard=0, epoch=epoch, limit=ns.limit, default_visibility_timeout=300.0)
            idle.append(time.monotonic() - pass_start)
        claimer.stop_event.set()
        claimer.join(30)
        if claimer.error is not None:
            raise SystemExit(f"claimer failed: {claimer.error!r}")
        if moved != ns.jobs:
            raise SystemExit(f"reconcile moved {moved} of {ns.jobs} stale jobs")
        seconds = rec_end - rec_start
        baseline = claimer.rate(base_start, rec_start)
        during = claimer.rate(rec_start, rec_end)
        ratio = (
            during["per_s"] / baseline["per_s"] if during["per_s"] and baseline["per_s"] else None
        )
        progress(
            "round %d: requeued %d in %.2fs (%.0f/s, %d passes, max %.2fs); claims %s/s alone, "
            "%s/s during",
            index,
            moved,
            seconds,
            moved / seconds,
            len(passes),
            max(passes),
            baseline["per_s"],
            during["per_s"],
        )
        if baseline["rows"] >= ns.live:
            progress("round %d: the live backlog ran out during the baseline; raise --live", index)
        return {
            "requeue_s": round(seconds, 3),
            "requeued_per_s": round(moved / seconds, 1),
            "passes": len(passes),
            "pass_p50_s": rounded(percentile(passes, 50), 3),
            "pass_max_s": round(max(passes), 3),
            "idle_pass_p50_ms": rounded(percentile(idle, 50) * 1000, 2) if idle else None,
            "claims_alone": baseline,
            "claims_during": during,
            "claim_rate_ratio": rounded(ratio, 3),
        }
    finally:
        store.close()
        run.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000, help="stale dispatched jobs")
    parser.add_argument("--live", type=int, default=400_000, help="pending jobs for the claimer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=10_000, help="rows per reconcile pass")
    parser.add_argument("--batch", type=int, default=1000, help="rows per claim")
    parser.add_argument("--baseline", type=float, default=3.0, help="seconds of claims alone")
    parser.add_argument(
        "--in-flight", type=int, default=0, help="dispatched jobs not yet stale (10 s old)"
    )
    parser.add_argument(
        "--idle-passes", type=int, default=5, help="passes timed after the requeue (none stale)"
    )
    ns = parser.parse_args()

    load_before = load_avg()
    rounds = [run_round(ns, index) for index in range(1, ns.rounds + 1)]

    def med(key: str) -> float | None:
        return median([r[key] for r in rounds if r[key] is not None])

    emit(
        {
            "benchmark": "reconcile",
            "stale_jobs": ns.jobs,
            "live_jobs": ns.live,
            "in_flight_jobs": ns.in_flight,
            "rounds": ns.rounds,
            "limit": ns.limit,
            "batch": ns.batch,
            "requeue_s_median": rounded(med("requeue_s"), 3),
            "requeued_per_s_median": rounded(med("requeued_per_s"), 1),
            "pass_max_s_median": rounded(med("pass_max_s"), 3),
            "idle_pass_p50_ms_median": rounded(med("idle_pass_p50_ms"), 2),
            "claims_alone_per_s_median": rounded(
                median([r["claims_alone"]["per_s"] for r in rounds if r["claims_alone"]["per_s"]]),
                1,
            ),
            "claims_during_per_s_median": rounded(
                median(
                    [r["claims_during"]["per_s"] for r in rounds if r["claims_during"]["per_s"]]
                ),
                1,
            ),
            "claim_rate_ratio_median": rounded(med("claim_rate_ratio"), 3),
            "per_round": rounds,
            "load_avg": [load_before, load_avg()],
        }
    )


if __name__ == "__main__":
    main()
