"""Redis Cluster failover under dispatching leaders (#17).

The lease and staging live on a Redis Cluster of the test's own (three
masters, a replica each); the broker is the machine's ordinary Redis and a
real Celery worker runs the jobs. Two beats' engines, built as a beat builds
them (:func:`celery_sched.backends.build_leader`: one Cluster client, the
lease on a clone of it), run in this process, so that a sampler can read
both electors at one instant. The master holding shard 0's slot is killed
with -9 mid-stream: the Cluster promotes its replica, the clients find it by
refreshing their slot maps, a beat leads again, staging works on the
promoted node, and every job scheduled before, during and after the
failover runs once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from redis.crc import key_slot

from celery_sched.backends import build_leader, build_redis, build_store
from celery_sched.leader import Engine
from celery_sched.rediskeys import shard_keys
from celery_sched.settings import Settings
from tests.e2e.conftest import client_for, spread_jobs
from tests.e2e.harness import wait_for
from tests.redis_topologies import ClusterSet

pytestmark = pytest.mark.slow

#: Statuses that mean "not finished": none may remain once every job ran.
UNFINISHED = ("pending", "dispatched", "running", "retrying")
#: Seconds between two samples of who leads.
SAMPLE_EVERY = 0.01


class InProcessBeat:
    """One beat's engine, driven as ``celery beat`` drives it (``step()``,
    then sleep what it returns), on a thread of this process."""

    def __init__(self, app: Any, settings: Settings, name: str) -> None:
        self.name = name
        self.store = build_store(settings)
        self.engine: Engine = build_leader(app, settings, store=self.store, static=())
        #: (monotonic time, job ids) of every non-empty pop from staging.
        self.pops: list[tuple[float, list[uuid.UUID]]] = []
        staging = self.engine.staging
        pop_due = staging.pop_due

        def counted(*args: Any, **kwargs: Any) -> list[uuid.UUID]:
            ids = pop_due(*args, **kwargs)
            if ids:
                self.pops.append((time.monotonic(), ids))
            return ids

        # A spy on the real backend: the claimer pops through this attribute.
        staging.pop_due = counted  # type: ignore[method-assign]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def popped_since(self, at: float) -> set[uuid.UUID]:
        return {job_id for when, ids in list(self.pops) if when >= at for job_id in ids}

    def start(self) -> None:
        self.engine.start()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._stop.wait(min(self.engine.step(), 1.0))

    def epoch(self) -> int | None:
        """The epoch of the lease this beat holds right now (locally valid), if any."""
        lease = self.engine.elector.current()
        return None if lease is None else lease.epoch

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.engine.stop()
        self.store.close()


@dataclasses.dataclass(frozen=True)
class Sample:
    at: float
    #: (beat name, epoch) of every beat holding a locally valid lease.
    leaders: tuple[tuple[str, int], ...]


class Sampler:
    """Reads every beat's elector every :data:`SAMPLE_EVERY` seconds."""

    def __init__(self, beats: list[InProcessBeat]) -> None:
        self.beats = beats
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            leaders = []
            for beat in self.beats:
                epoch = beat.epoch()
                if epoch is not None:
                    leaders.append((beat.name, epoch))
            self.samples.append(Sample(time.monotonic(), tuple(leaders)))
            self._stop.wait(SAMPLE_EVERY)

    def led_after(self, since: float, above: int) -> float | None:
        """When a beat first held a lease of an epoch above ``above`` after ``since``."""
        for sample in list(self.samples):
            if sample.at >= since and any(epoch > above for _n, epoch in sample.leaders):
                return sample.at
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Records(logging.Handler):
    """Every celery_sched log record of this process, with its monotonic time."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[float, logging.LogRecord]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((time.monotonic(), record))

    def since(self, at: float, text: str) -> list[str]:
        return [
            record.getMessage()
            for when, record in list(self.records)
            if when >= at and text in record.getMessage()
        ]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("celery_sched")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def _statuses(cluster: Any) -> dict[str, int]:
    rows = cluster.query("SELECT status, count(*) FROM {s}.jobs GROUP BY status")
    return {str(status): int(count) for status, count in rows}


def test_kill_9_of_the_master_of_the_shards_slot_promotes_its_replica_and_loses_no_job(
    own_cluster_set: ClusterSet,
    redis_url: str,
    make_cluster: Any,
    e2e_settings: Settings,
    records: Records,
) -> None:
    # The Cluster is set up first, so it is torn down after the beats.
    topology = own_cluster_set
    settings = dataclasses.replace(e2e_settings, redis_url=topology.url)
    keys = shard_keys(settings.key_prefix, 0)
    master = topology.port_of_slot(key_slot(keys.lease.encode()))
    replica = topology.replica_of(master)
    cluster = make_cluster(redis_url, settings)  # the broker is not the Cluster
    cluster.start_worker(concurrency=8)
    app = Celery("cluster_failover", broker=redis_url)
    app.conf.update(task_default_queue=cluster.queue, task_serializer="json")

    beats = [InProcessBeat(app, settings, name) for name in ("beat1", "beat2")]
    sampler = Sampler(beats)
    client = client_for(settings)
    try:
        for beat in beats:
            beat.start()
        sampler.start()
        wait_for(lambda: any(b.epoch() for b in beats), timeout=30, what="a leader")
        # The lease is on the master of the shard's slot, and on its replica.
        with topology.client(master) as node:
            token = node.get(keys.lease)
        assert token is not None
        with topology.replica_client(replica) as node:
            wait_for(
                lambda: node.get(keys.lease) == token,
                timeout=10,
                what="the lease to reach the replica",
            )

        before = spread_jobs(1000, time.time() + 1, 14, tag="before")
        assert client.schedule_many(before) == len(before)
        wait_for(lambda: cluster.run_count() >= 100, timeout=30, what="dispatch to start")

        epoch_at_kill = max(epoch for b in beats if (epoch := b.epoch()) is not None)
        topology.kill(master)
        killed_at = time.monotonic()
        # Scheduled while the shard's master is down: the client's best-effort
        # staging fails, quickly (the rows are in PostgreSQL).
        during = spread_jobs(300, time.time() + 0.5, 6, tag="during")
        started = time.monotonic()
        assert client.schedule_many(during) == len(during)
        scheduling = time.monotonic() - started
        assert scheduling < 2.0, f"schedule_many took {scheduling:.1f}s on a dead master"

        wait_for(
            lambda: (
                topology.role(replica) == "master"
                and topology.port_of_slot(key_slot(keys.lease.encode())) == replica
            ),
            timeout=30,
            what="the Cluster to promote the replica",
        )
        promoted = time.monotonic() - killed_at
        led_at = wait_for(
            lambda: sampler.led_after(killed_at, epoch_at_kill),
            timeout=30,
            interval=0.05,
            what="a beat to lead again",
        )
        print(
            f"replica promoted {promoted:.1f}s after the kill; "
            f"shard led again after {led_at - killed_at:.1f}s"
        )
        # The lease now lives on the promoted replica, and names the leader.
        with topology.client(replica) as node:
            assert node.get(keys.lease) is not None

        # Staging works on the promoted node: jobs scheduled now are staged
        # there (read on that node itself, no redirection) and popped.
        recovered_at = time.monotonic()
        after = spread_jobs(300, time.time() + 3, 5, tag="after")
        assert client.schedule_many(after) == len(after)
        with topology.client(replica) as node:
            wait_for(
                lambda: node.zcard(keys.staging) > 0,
                timeout=10,
                interval=0.05,
                what="jobs staged on the promoted replica",
            )

        jobs = before + during + after
        expected = {job["key"] for job in jobs}
        wait_for(
            lambda: {key for _i, key, _d, _r in cluster.runs()} >= expected,
            timeout=90,
            what=f"all {len(expected)} jobs to run",
        )
        wait_for(
            lambda: not any(_statuses(cluster).get(status) for status in UNFINISHED),
            timeout=30,
            what="no job left unfinished",
        )
    finally:
        sampler.stop()
        for beat in beats:
            beat.stop()

    assert _statuses(cluster) == {"succeeded": len(jobs)}
    runs = cluster.runs()
    assert {key for _i, key, _d, _r in runs} == expected
    # Nothing was published twice, or a second delivery was fenced off.
    assert len(runs) == len(jobs), f"{len(runs) - len(jobs)} duplicate runs"

    # At most one beat held a locally valid lease at any sampled instant,
    # and the lease was really lost and won again.
    assert sampler.samples
    assert max(len(sample.leaders) for sample in sampler.samples) <= 1
    assert any(not s.leaders for s in sampler.samples if s.at > killed_at)

    # After the failover, jobs were popped from staging again, without a Redis error.
    after_ids = {
        uuid.UUID(str(job_id))
        for (job_id,) in cluster.query("SELECT id FROM {s}.jobs WHERE key LIKE 'after-%%'")
    }
    popped = set().union(*(beat.popped_since(recovered_at) for beat in beats))
    assert after_ids <= popped, f"{len(after_ids - popped)} later jobs were never staged"
    assert records.since(recovered_at, "staging unavailable") == []
    # (A standby's acquisition attempts, every ttl / 6, may still meet the
    # dead node until its client refreshes the slot map; they do not count.)
    unreachable = records.since(recovered_at, "cannot be reached")
    assert [message for message in unreachable if "to acquire" not in message] == []

    # The fence: once the current epoch was taken, no older epoch claimed anything.
    epoch, _holder = cluster.leader()
    assert epoch > epoch_at_kill
    assert cluster.stale_claims() == 0
    assert all(proc.alive() for proc in cluster.procs), "the worker may not exit"


def test_a_command_on_a_dead_masters_slot_fails_fast_then_reaches_the_promoted_replica(
    own_cluster_set: ClusterSet, settings: Settings
) -> None:
    topology = own_cluster_set
    settings = dataclasses.replace(settings, redis_url=topology.url, lease_ttl=2.0)
    client = build_redis(settings)  # the beat's shared client (staging, board)
    key = shard_keys(settings.key_prefix, 0).staging
    slot = key_slot(key.encode())
    master = topology.port_of_slot(slot)
    replica = topology.replica_of(master)
    try:
        client.zadd(key, {"before": 1.0})
        with topology.replica_client(replica) as node:
            wait_for(lambda: node.zcard(key) == 1, timeout=10, what="replication")
        topology.kill(master)
        killed_at = time.monotonic()
        slowest = 0.0
        while True:
            started = time.monotonic()
            try:
                members = client.zrange(key, 0, -1)
            except redis.RedisError:
                slowest = max(slowest, time.monotonic() - started)
                assert time.monotonic() - killed_at < 30, "the replica was never reached"
                time.sleep(0.1)
                continue
            break
        print(f"reached the promoted replica {time.monotonic() - killed_at:.1f}s after the kill")
        # Each failed command gave up quickly (redis-py's default retry
        # would hold it for seconds), and the slot map was refreshed.
        assert slowest < 1.0, f"a command on the dead master took {slowest:.1f}s"
        assert members == [b"before"]
        assert int(client.nodes_manager.get_node_from_slot(slot).port) == replica
        assert client.zadd(key, {"after": 2.0}) == 1
    finally:
        client.close()
