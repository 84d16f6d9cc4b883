"""celery_sched.Task under real worker processes: duplicates, kills, lost messages.

Each test runs real ``celery worker`` (and ``celery beat``) subprocesses of
``tests.e2e.task_app`` with a 3-second ledger lease, and reads the evidence
(side effects, deliveries, outcomes) from its own Postgres schema.
"""

from __future__ import annotations

import dataclasses
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection

from celery_sched import task as task_module
from celery_sched.client import Client
from celery_sched.dispatch.kombu import KombuDispatcher
from celery_sched.models import Job, JobStatus, LedgerState
from celery_sched.settings import Settings
from celery_sched.store.postgres import PostgresJobStore, PostgresLedger
from tests.e2e import task_app
from tests.e2e.harness import CELERY, ROOT, Cluster, Proc, wait_for

pytestmark = pytest.mark.slow

APP = "tests.e2e.task_app"
LEDGER_LEASE = 3.0


class TaskCluster(Cluster):
    """A :class:`Cluster` running ``tests.e2e.task_app``, with its evidence tables."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        with self.connect() as conn:
            for statement in task_app.TABLES:
                conn.execute(statement.replace("{s}", f'"{self.schema}"'))
        self.store = PostgresJobStore(self.settings)
        self.ledger = PostgresLedger(self.store)
        self.client = Client(task_app.app, settings=self.settings, store=self.store, staging=False)

    def start_task_worker(
        self, name: str = "worker", concurrency: int = 4, pool: str = "threads"
    ) -> Proc:
        return self._spawn(
            name,
            [
                CELERY,
                "-A",
                APP,
                "worker",
                f"--pool={pool}",
                f"--concurrency={concurrency}",
                "-Q",
                self.queue,
                "-n",
                f"{name}.{self.queue}@%h",
                "--without-heartbeat",
                "--without-gossip",
                "--without-mingle",
                "--loglevel=INFO",
            ],
        )

    def start_task_beat(self, name: str = "beat") -> Proc:
        schedule_file = str(self.tmp_path / f"{name}-schedule")
        return self._spawn(
            name,
            [
                CELERY,
                "-A",
                APP,
                "beat",
                "-S",
                "celery_sched",
                "--loglevel=INFO",
                "-s",
                schedule_file,
            ],
        )

    def sched(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [CELERY, "-A", APP, "sched", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def publisher(self) -> KombuDispatcher:
        app = Celery("e2e_publisher", broker=self.broker_url, set_as_current=False)
        app.conf.update(task_serializer="json", accept_content=["json"])
        return KombuDispatcher(app, self.settings)

    def claim(self, job: Job) -> tuple[Job, int]:
        """Claim ``job`` as a leader would (no beat runs in tests that do this)."""
        epoch = self.store.acquire_epoch(0, "e2e-test")
        (claimed,) = self.store.claim_ids([job.id], shard=0, epoch=epoch)
        return claimed, epoch

    def purge(self) -> int:
        with Connection(self.broker_url) as conn:
            return int(conn.default_channel.queue_purge(self.queue) or 0)

    def effects(self, key: str) -> list[str]:
        return [row[0] for row in self.query("SELECT note FROM {s}.effects WHERE key = %s", key)]

    def deliveries(self, key: str) -> list[tuple[bool, int]]:
        rows = self.query(
            "SELECT redelivered, retries FROM {s}.deliveries WHERE key = %s ORDER BY at", key
        )
        return [(bool(a), int(b)) for a, b in rows]

    def outcomes(self, key: str) -> list[tuple[str, str]]:
        rows = self.query("SELECT state, retval FROM {s}.outcomes WHERE key = %s", key)
        return [(str(a), str(b)) for a, b in rows]

    def job(self, key: str) -> Job:
        job = self.client.get(key)
        assert job is not None, key
        return job

    def kill_once(self, key: str) -> None:
        self.query("INSERT INTO {s}.kill_once VALUES (%s) RETURNING key", key)

    def close(self) -> None:
        self.ledger.close()
        self.store.close()


@pytest.fixture
def make_task_cluster(
    tmp_path: Path, e2e_settings: Settings
) -> Iterator[Callable[[str], TaskCluster]]:
    settings = dataclasses.replace(e2e_settings, ledger_lease=LEDGER_LEASE)
    clusters: list[TaskCluster] = []

    def make(broker_url: str) -> TaskCluster:
        store = PostgresJobStore(settings)
        store.migrate()
        store.close()
        cluster = TaskCluster(
            tmp_path=tmp_path,
            settings=settings,
            broker_url=broker_url,
            queue="q_" + uuid.uuid4().hex[:10],
            extra_env={"CELERY_SCHED_LEDGER_LEASE": str(LEDGER_LEASE)},
        )
        clusters.append(cluster)
        # Task.schedule() in this process writes to the test's schema.
        task_module.install(task_app.app, settings=settings, client=cluster.client)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop_all()
        cluster.close()
        print(cluster.dump_logs())  # shown by pytest only when the test failed


def _succeeded(cluster: TaskCluster, key: str) -> bool:
    return cluster.job(key).status == JobStatus.SUCCEEDED


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_the_same_message_published_twice_has_its_side_effect_once(
    pool: str, redis_url: str, make_task_cluster: Callable[[str], TaskCluster]
) -> None:
    cluster = make_task_cluster(redis_url)
    worker = cluster.start_task_worker(concurrency=2 if pool == "prefork" else 4, pool=pool)
    job = cluster.client.schedule("tasks.effect", ["dup", 1.5], key="dup", queue=cluster.queue)
    claimed, epoch = cluster.claim(job)
    publisher = cluster.publisher()
    try:
        # Two copies at once: the second finds the key held and waits.
        for _ in range(2):
            assert publisher.publish([claimed], epoch=epoch, now=cluster.store.now()).sent
        wait_for(
            lambda: {"SUCCESS", "RETRY"} <= {state for state, _ in cluster.outcomes("dup")},
            timeout=40,
            what="one copy to run and the other to wait",
        )
        wait_for(lambda: _succeeded(cluster, "dup"), timeout=10, what="the job to succeed")
        # The waiting copy comes back after the job succeeded, and so does a
        # third copy: the fence of the Task's ledger take acknowledges both
        # without running them.
        fenced = "not running this delivery: the job is succeeded"
        wait_for(lambda: worker.output().count(fenced) >= 1, timeout=30, what="the retry fenced")
        assert publisher.publish([claimed], epoch=epoch, now=cluster.store.now()).sent
        wait_for(lambda: worker.output().count(fenced) >= 2, timeout=30, what="a copy fenced")
    finally:
        publisher.close()
    assert cluster.effects("dup") == ["dup"]
    outcomes = cluster.outcomes("dup")
    assert sorted(state for state, _ in outcomes) == ["IGNORED", "IGNORED", "RETRY", "SUCCESS"], (
        outcomes
    )
    assert {retval for state, retval in outcomes if state == "SUCCESS"} == {'{"tag": "dup"}'}
    entry = cluster.ledger.get("dup")
    assert entry is not None and entry.state == LedgerState.COMPLETED
    assert entry.result == {"tag": "dup"} and entry.job_id == job.id
    wait_for(lambda: _succeeded(cluster, "dup"), timeout=10, what="the job to succeed")


def test_a_worker_killed_after_the_side_effect_before_the_ack_does_not_repeat_it(
    amqp_url: str, make_task_cluster: Callable[[str], TaskCluster]
) -> None:
    cluster = make_task_cluster(amqp_url)
    cluster.kill_once("kill-after")
    first = cluster.start_task_worker("worker1")
    cluster.start_task_beat()
    job = task_app.effect.schedule(args=("kill-after",), key="kill-after", queue=cluster.queue)
    wait_for(lambda: not first.alive(), timeout=40, what="worker1 to kill itself")
    assert first.popen.returncode == -9
    assert cluster.effects("kill-after") == ["kill-after"]
    # The message was never acknowledged: the broker hands it to the next worker.
    cluster.start_task_worker("worker2")
    wait_for(lambda: len(cluster.deliveries("kill-after")) >= 2, timeout=40, what="the redelivery")
    wait_for(lambda: _succeeded(cluster, "kill-after"), timeout=20, what="the job to succeed")
    assert cluster.effects("kill-after") == ["kill-after"]
    deliveries = cluster.deliveries("kill-after")
    assert deliveries[0] == (False, 0) and deliveries[-1][0] is True, deliveries
    entry = cluster.ledger.get("kill-after")
    assert entry is not None and entry.state == LedgerState.COMPLETED and entry.attempts == 1
    assert cluster.job("kill-after").id == job.id


def test_a_message_lost_from_the_broker_is_requeued_and_runs_once(
    redis_url: str, make_task_cluster: Callable[[str], TaskCluster]
) -> None:
    cluster = make_task_cluster(redis_url)
    beat = cluster.start_task_beat()
    wait_for(cluster.leader, timeout=30, what="a leader")
    job = task_app.effect_vt.schedule(args=("lost",), key="lost", queue=cluster.queue)
    assert job.visibility_timeout == 3  # the decorator's default
    wait_for(
        lambda: cluster.job("lost").status == JobStatus.DISPATCHED, timeout=20, what="dispatch"
    )
    wait_for(cluster.purge, timeout=10, what="the message to be purged from the queue")
    cluster.start_task_worker()
    wait_for(lambda: _succeeded(cluster, "lost"), timeout=40, what="the requeued job to run")
    assert cluster.effects("lost") == ["lost"]
    assert len(cluster.deliveries("lost")) == 1
    assert cluster.job("lost").attempt == 1  # dispatched twice
    assert "reconciler requeued 1, marked 0 dead" in beat.output()


def test_an_always_failing_task_is_retried_up_to_max_attempts_then_dead(
    redis_url: str, make_task_cluster: Callable[[str], TaskCluster]
) -> None:
    cluster = make_task_cluster(redis_url)
    cluster.start_task_worker()
    cluster.start_task_beat()
    task_app.always_fails.schedule(key="doomed", queue=cluster.queue)
    wait_for(lambda: cluster.job("doomed").status == JobStatus.DEAD, timeout=40, what="a dead job")
    job = cluster.job("doomed")
    assert job.max_attempts == 3  # the decorator's default
    assert job.last_error == (
        "RuntimeError: the card was declined again (attempt 3 of 3); giving up"
    )
    assert cluster.effects("doomed") == ["attempt"] * 3
    assert [retries for _, retries in cluster.deliveries("doomed")] == [0, 1, 2]
    assert cluster.ledger.get("doomed") is None  # every failure released the key


def test_a_crash_inside_ledger_transaction_leaves_nothing_and_the_redelivery_runs_once(
    amqp_url: str, make_task_cluster: Callable[[str], TaskCluster]
) -> None:
    cluster = make_task_cluster(amqp_url)
    cluster.kill_once("transfer")
    first = cluster.start_task_worker("worker1")
    cluster.start_task_beat()
    task_app.transfer.schedule(args=(250,), key="transfer", queue=cluster.queue)
    wait_for(lambda: not first.alive(), timeout=40, what="worker1 to die mid-transaction")
    # Killed between its write and the commit: neither happened.
    assert cluster.effects("transfer") == []
    entry = cluster.ledger.get("transfer")
    assert entry is not None and entry.state == LedgerState.RUNNING
    cluster.start_task_worker("worker2")
    wait_for(lambda: _succeeded(cluster, "transfer"), timeout=40, what="the redelivery to run")
    assert cluster.effects("transfer") == ["transfer 250"]
    entry = cluster.ledger.get("transfer")
    assert entry is not None and entry.state == LedgerState.COMPLETED
    assert entry.attempts == 2  # taken over from the dead worker
    assert entry.result == 250
    assert len(cluster.deliveries("transfer")) >= 2


def test_the_reconcile_command_requeues_a_job_whose_message_was_lost(
    redis_url: str, make_task_cluster: Callable[[str], TaskCluster]
) -> None:
    cluster = make_task_cluster(redis_url)
    result = cluster.sched("reconcile")
    assert result.returncode != 0
    assert "has never had a leader" in result.stderr

    job = cluster.client.schedule(
        "tasks.effect", ["cli"], key="cli", queue=cluster.queue, visibility_timeout=6
    )
    claimed, epoch = cluster.claim(job)
    publisher = cluster.publisher()
    try:
        assert publisher.publish([claimed], epoch=epoch, now=cluster.store.now()).sent
    finally:
        publisher.close()
    assert cluster.purge() == 1
    # The task's workers track their jobs (their heartbeat lists it); no worker
    # is running now, so the lost message is the reconciler's to re-send.
    cluster.store.heartbeat("worker@gone", 4242, tasks=["tasks.effect"])
    result = cluster.sched("reconcile")
    assert result.returncode == 0, result.stderr
    assert f"Shard 0 (epoch {epoch}): requeued 0 job(s)" in result.stdout  # not stale yet
    wait_for(
        lambda: "requeued 1 job(s), marked 0 dead" in cluster.sched("reconcile").stdout,
        timeout=20,
        what="the reconcile command to requeue the job",
    )
    job = cluster.job("cli")
    assert (job.status, job.attempt) == (JobStatus.PENDING, 1)
