"""Worker throughput: a no-op ``celery_sched.Task`` against a plain task, same broker, same run.

Three modes, each a real ``celery worker`` subprocess started in turn on the
same queue, in every round:

- ``plain``: a plain ``@app.task`` no-op, no status tracking;
- ``tracking``: the same task with ``celery_sched.tracking.install(app)``;
- ``task``: a no-op with ``base=celery_sched.Task`` (ledger acquire and
  completion per execution, lease renewal, and the status tracking it installs).

For each mode ``--jobs`` jobs due now are scheduled, claimed and published
through the real dispatcher (so every message carries its job key headers)
before the worker starts; the worker records when its first task started
and its last one ended, and

    tasks/s = jobs / (end of the last task - start of the first task)

Medians over ``--rounds`` rounds. Each mode's *ratio* is plain tasks/s
divided by that mode's tasks/s in the same round (how many times the time
of a plain task it takes), and the medians of those per-round ratios are
the figures checked against the targets of issue #31: tracking (delivery
fence and status reports) at most ``TARGET_TRACKING_RATIO`` (1.05x),
``celery_sched.Task`` at most ``TARGET_RATIO`` (1.15x on prefork, 1.3x on
solo). ``tracking_cost`` is the fraction of plain throughput tracking costs.

    .venv/bin/python benchmarks/worker_overhead.py [--jobs 20000] [--rounds 5]
        [--pool prefork|threads|solo|gevent] [--concurrency N] [--broker redis|amqp]

The defaults are Celery's own: the prefork pool with one process per core
(gevent: 100 greenlets).

The module is also the worker's Celery app (``celery -A worker_overhead``),
configured from ``BENCH_*`` variables. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery, signals

import celery_sched
from celery_sched import tracking

MODES = ("plain", "tracking", "task")
TASKS = {"plain": "bench.plain", "tracking": "bench.plain", "task": "bench.task"}
#: Issue #31: celery_sched.Task at most this many times the time of a plain
#: task, per pool (``TARGET_RATIO`` for the pools not listed).
TARGET_RATIOS = {"solo": 1.3}
TARGET_RATIO = 1.15
#: Issue #31: tracking (fence on) at most this many times a plain task's time.
TARGET_TRACKING_RATIO = 1.05
#: The same target as the fraction of plain throughput tracking may cost.
TARGET_TRACKING_COST = round(1 - 1 / TARGET_TRACKING_RATIO, 3)

# -- the worker's app ------------------------------------------------------------------

MODE = os.environ.get("BENCH_MODE", "")

app = Celery("overhead", broker=os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_default_queue=os.environ.get("BENCH_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=16,
)

# Each worker registers only its mode's task: binding a celery_sched.Task
# installs status tracking, which the plain mode must not have.
if MODE in ("", "plain", "tracking"):

    @app.task(name="bench.plain")
    def plain() -> None:
        return None


if MODE in ("", "task"):

    @app.task(name="bench.task", base=celery_sched.Task)
    def sched() -> None:
        return None


if MODE == "tracking":
    tracking.install(app)


class _Stamps:
    """First task start and last task end across the worker's processes.

    The counters live in shared memory created when the app module is
    imported, which the worker's main process does before it forks its
    prefork children, so solo, threads and prefork pools report the same way.
    CPU is each process's own CPU time from its first task to its latest one.
    """

    FIRST, DONE, CPU = range(3)

    def __init__(self) -> None:
        self.expected = int(os.environ.get("BENCH_N", "0"))
        self.path = os.environ.get("BENCH_STAMP", "")
        self.shared = multiprocessing.Array("d", 3)
        self.raw = self.shared.get_obj()  # unlocked reads
        self.pid = 0
        self.cpu_seen = 0.0

    def _process(self) -> None:
        # First task in this process (a fresh prefork child, or the solo/
        # threads worker): CPU is counted from here.
        if self.pid != os.getpid():
            self.pid = os.getpid()
            self.cpu_seen = time.process_time()

    def started(self, **_: Any) -> None:
        # Only a process's first task, and the run's, take the lock here.
        if self.pid == os.getpid() and self.raw[self.FIRST] != 0.0:
            return
        with self.shared.get_lock():
            self._process()
            if self.raw[self.FIRST] == 0.0:
                self.raw[self.FIRST] = time.time()

    def finished(self, **_: Any) -> None:
        with self.shared.get_lock():
            self._process()
            now = time.process_time()
            self.raw[self.CPU] += now - self.cpu_seen
            self.cpu_seen = now
            self.raw[self.DONE] += 1
            if self.raw[self.DONE] != self.expected:
                return
            last = time.time()
            first, cpu = self.raw[self.FIRST], self.raw[self.CPU]
        Path(self.path).write_text(
            json.dumps({"first": first, "last": last, "n": self.expected, "cpu": cpu})
        )


if MODE:
    _stamps = _Stamps()
    signals.task_prerun.connect(_stamps.started, weak=False)
    signals.task_postrun.connect(_stamps.finished, weak=False)


# -- the benchmark ---------------------------------------------------------------------


def publish_jobs(run: Any, mode: int | str, jobs: int, tag: str) -> float:
    """Schedule ``jobs`` jobs due now for ``mode``'s task, claim and publish them."""
    from celery_sched.client import Client
    from celery_sched.dispatch.kombu import KombuDispatcher

    started = time.perf_counter()
    name = TASKS[str(mode)]
    with Client(app, settings=run.settings, staging=False) as client:
        client.schedule_many(
            {"task": name, "key": f"{tag}-{i}", "queue": run.queue, "check_task": False}
            for i in range(jobs)
        )
        store = client.store
        epoch = store.acquire_epoch(0, f"bench-{tag}")
        dispatcher = KombuDispatcher(app, run.settings)
        sent = 0
        try:
            while True:
                claimed = store.claim_due(shard=0, epoch=epoch, limit=5000)
                if not claimed:
                    break
                result = dispatcher.publish(claimed, epoch=epoch, now=store.now())
                sent += len(result.sent)
        finally:
            dispatcher.close()
    if sent != jobs:
        raise SystemExit(f"published {sent} of {jobs} messages")
    return time.perf_counter() - started


def run_worker(run: Any, mode: str, jobs: int, ns: argparse.Namespace) -> dict[str, Any]:
    stamp = run.tmp_path / f"{mode}-{time.monotonic_ns()}.json"
    worker = run.start_worker(
        f"worker-{mode}",
        app="worker_overhead",
        pool=ns.pool,
        concurrency=ns.concurrency,
        BENCH_MODE=mode,
        BENCH_N=str(jobs),
        BENCH_STAMP=str(stamp),
    )
    deadline = time.monotonic() + 60 + jobs / 50
    try:
        while not stamp.exists():
            if not worker.alive() or time.monotonic() > deadline:
                raise SystemExit(f"{mode} worker did not finish {jobs} tasks:\n{worker.tail()}")
            time.sleep(0.05)
        time.sleep(0.05)  # let the writer finish the file
        stamps = json.loads(stamp.read_text())
    finally:
        worker.stop()
    seconds = max(stamps["last"] - stamps["first"], 1e-6)
    return {
        "seconds": round(seconds, 3),
        "per_s": round(jobs / seconds, 1),
        # Worker process CPU (all threads) per task: where the time goes.
        "cpu_ms_per_task": round(stamps["cpu"] / jobs * 1000, 3),
    }


def run_round(ns: argparse.Namespace, index: int) -> dict[str, Any]:
    from _common import Run, progress

    run = Run("overhead", broker=ns.broker)
    try:
        from celery_sched.store.postgres import PostgresJobStore

        store = PostgresJobStore(run.settings)
        store.migrate()
        store.close()
        result: dict[str, Any] = {}
        for mode in MODES:
            publish_s = publish_jobs(run, mode, ns.jobs, f"{mode}-{index}")
            measured = run_worker(run, mode, ns.jobs, ns)
            progress(
                "round %d %-8s: %d tasks in %.2fs = %.0f tasks/s, %.2f ms CPU per task "
                "(published in %.1fs)",
                index,
                mode,
                ns.jobs,
                measured["seconds"],
                measured["per_s"],
                measured["cpu_ms_per_task"],
                publish_s,
            )
            result[mode] = measured
        plain_rate = result["plain"]["per_s"]
        progress(
            "round %d against plain: %s",
            index,
            ", ".join(f"{m} {plain_rate / result[m]['per_s']:.3f}x" for m in MODES[1:]),
        )
        completed = run.query(
            "SELECT count(*) FROM {s}.ledger WHERE state = 'completed' AND key LIKE %s",
            f"task-{index}-%",
        )[0][0]
        succeeded = run.query("SELECT count(*) FROM {s}.jobs WHERE status = 'succeeded'")[0][0]
        result["ledger_completed"] = int(completed)
        result["jobs_succeeded"] = int(succeeded)
        return result
    finally:
        run.cleanup()


def main() -> None:
    from _common import emit, load_avg, median, progress, rounded

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000, help="tasks per mode and round")
    parser.add_argument("--rounds", type=int, default=5)
    # Celery's own defaults: the prefork pool, one process per core.
    parser.add_argument(
        "--pool", default="prefork", choices=["threads", "solo", "prefork", "gevent"]
    )
    parser.add_argument(
        "--concurrency", type=int, default=None, help="default: cores (gevent: 100)"
    )
    parser.add_argument("--broker", default="redis", help="redis, amqp, or a broker URL")
    ns = parser.parse_args()
    if ns.concurrency is None:
        ns.concurrency = 100 if ns.pool == "gevent" else os.cpu_count() or 1
    target_ratio = TARGET_RATIOS.get(ns.pool, TARGET_RATIO)

    load_before = load_avg()
    rounds = []
    for index in range(1, ns.rounds + 1):
        rounds.append(run_round(ns, index))
    rates = {mode: [r[mode]["per_s"] for r in rounds] for mode in MODES}
    medians = {mode: median(values) for mode, values in rates.items()}
    # Each mode against plain in the same round (the machine's load moves
    # between rounds more than a mode's cost does).
    per_round = {
        mode: [r["plain"]["per_s"] / r[mode]["per_s"] for r in rounds] for mode in MODES[1:]
    }
    ratios = {mode: median(values) for mode, values in per_round.items()}
    ratio = ratios["task"]
    tracking_ratio = ratios["tracking"]
    tracking_cost = 1 - 1 / tracking_ratio if tracking_ratio else None
    per_round_ratio = per_round["task"]
    progress(
        "medians: plain %.0f/s, plain+tracking %.0f/s, celery_sched.Task %.0f/s; "
        "against plain in the same round: tracking %.3fx (target %.2fx), Task %.3fx "
        "(target %.2fx)",
        medians["plain"],
        medians["tracking"],
        medians["task"],
        tracking_ratio or 0,
        TARGET_TRACKING_RATIO,
        ratio or 0,
        target_ratio,
    )
    emit(
        {
            "benchmark": "worker_overhead",
            "jobs": ns.jobs,
            "rounds": ns.rounds,
            "pool": ns.pool,
            "concurrency": ns.concurrency,
            "broker": ns.broker,
            "tasks_per_s": rates,
            "cpu_ms_per_task": {
                mode: [r[mode]["cpu_ms_per_task"] for r in rounds] for mode in MODES
            },
            "median_tasks_per_s": {mode: rounded(value, 1) for mode, value in medians.items()},
            "ratios_per_round": {
                mode: [round(value, 3) for value in values] for mode, values in per_round.items()
            },
            "ratio_plain_over_task": rounded(ratio, 3),
            "ratio_per_round": [round(value, 3) for value in per_round_ratio],
            "target_ratio": target_ratio,
            "ratio_met": ratio is not None and ratio <= target_ratio,
            "rounds_under_target": sum(1 for value in per_round_ratio if value <= target_ratio),
            "tracking_ratio": rounded(tracking_ratio, 3),
            "target_tracking_ratio": TARGET_TRACKING_RATIO,
            "tracking_cost": rounded(tracking_cost, 3),
            "target_tracking_cost": TARGET_TRACKING_COST,
            "tracking_cost_met": tracking_ratio is not None
            and tracking_ratio <= TARGET_TRACKING_RATIO,
            "ledger_completed": [r["ledger_completed"] for r in rounds],
            "jobs_succeeded": [r["jobs_succeeded"] for r in rounds],
            "load_avg": [load_before, load_avg()],
        }
    )


if __name__ == "__main__":
    main()
