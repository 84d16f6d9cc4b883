"""Beats on a Redis Cluster (#17): one beat per shard, each shard's lease,
staging set and leader report on the master its hash tag maps to, jobs
dispatched to real workers (the broker is the machine's ordinary Redis)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from celery_sched.redisconn import build_client
from celery_sched.rediskeys import legacy_lease_key, shard_keys
from tests.e2e.conftest import client_for, spread_jobs
from tests.e2e.harness import wait_for
from tests.redis_topologies import ClusterSet, masters_of

pytestmark = pytest.mark.slow

SHARDS = 3


def test_one_beat_per_shard_on_a_redis_cluster_runs_every_job(
    shared_cluster_set: ClusterSet, redis_url: str, make_cluster: Any, e2e_settings: Any
) -> None:
    topology = shared_cluster_set
    settings = dataclasses.replace(
        e2e_settings,
        redis_url=topology.url,
        shards=SHARDS,
        key_prefix=topology.spread_prefix(e2e_settings.key_prefix, SHARDS),
    )
    # The Cluster is only the beats' Redis; the broker is the ordinary one.
    cluster = make_cluster(redis_url, settings)
    env = {"CELERY_SCHED_SHARDS": str(SHARDS), "CELERY_SCHED_KEY_PREFIX": settings.key_prefix}
    cluster.start_worker(concurrency=8, **env)
    for shard in range(SHARDS):
        cluster.start_beat(f"beat{shard}", CELERY_SCHED_SHARD=str(shard), **env)

    def leaders() -> dict[int, int]:
        rows = cluster.query("SELECT shard, epoch FROM {s}.leaders")
        return {int(shard): int(epoch) for shard, epoch in rows}

    wait_for(lambda: len(leaders()) == SHARDS, timeout=60, what="a leader on every shard")

    jobs = spread_jobs(900, time.time() + 2, 6, tag="cluster")
    client = client_for(settings)
    assert client.schedule_many(jobs) == len(jobs)
    expected = {job["key"] for job in jobs}
    wait_for(
        lambda: {key for _i, key, _d, _r in cluster.runs()} >= expected,
        timeout=60,
        what=f"all {len(expected)} jobs to run",
    )
    wait_for(
        lambda: client.counts_by_status() == {"succeeded": len(jobs)},
        timeout=30,
        what="every job to be reported succeeded",
    )
    # Every shard got jobs, each from its own beat.
    per_shard = cluster.query("SELECT shard, count(*) FROM {s}.jobs GROUP BY shard")
    assert {int(shard) for shard, _n in per_shard} == set(range(SHARDS))

    # Staging and the lease worked on the Cluster throughout: no beat fell
    # back to the sweep for a Redis error, none lost its lease.
    for proc in cluster.procs:
        assert "staging area (Redis" not in proc.output(), proc.name
        assert "CROSSSLOT" not in proc.output(), proc.name
    beats = [proc for proc in cluster.procs if proc.name.startswith("beat")]
    assert all(proc.output().count("leading with epoch") == 1 for proc in beats)

    redis_cluster = build_client(topology.url, socket_timeout=5)
    try:
        keys = [shard_keys(settings.key_prefix, shard) for shard in range(SHARDS)]
        # Each shard's lease and report live on a master of its own ...
        assert len(masters_of(redis_cluster, [k.lease for k in keys])) == SHARDS
        for shard, shard_key in enumerate(keys):
            token = redis_cluster.get(shard_key.lease)
            assert token is not None, f"shard {shard} has no lease"
            assert redis_cluster.exists(shard_key.leader) == 1
            # ... and no beat held a legacy key: there is none on a Cluster.
            assert redis_cluster.exists(legacy_lease_key(settings.key_prefix, shard)) == 0
    finally:
        redis_cluster.close()
