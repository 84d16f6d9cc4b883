"""Redis Sentinel failover under a dispatching beat (#17).

The lease and staging live on a Sentinel set of the test's own (one primary,
one replica, three sentinels); the broker is the machine's ordinary Redis.
The primary is killed with -9 mid-stream: the sentinels promote the replica,
a beat leads again through the new primary, and every job runs, none left
pending or dispatched. Replication is asynchronous, so the lease key may
not survive the failover; then the second beat may take the lease while the
first still trusts it, and the PostgreSQL epoch fence must keep the old
leader from claiming anything after the new epoch was taken.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from celery_sched.lease.elector import token_holder
from celery_sched.lease.redis import lease_key
from tests.e2e.conftest import client_for, spread_jobs
from tests.e2e.harness import wait_for
from tests.redis_topologies import SentinelSet

pytestmark = pytest.mark.slow

#: Statuses that mean "not finished": none may remain once every job ran.
UNFINISHED = ("pending", "dispatched", "running", "retrying")


def _lease_on(topology: SentinelSet, port: int, prefix: str) -> str | None:
    with topology.client(port) as client:
        value = client.get(lease_key(prefix, 0))
    return None if value is None else value.decode()


def _statuses(cluster: Any) -> dict[str, int]:
    rows = cluster.query("SELECT status, count(*) FROM {s}.jobs GROUP BY status")
    return {str(status): int(count) for status, count in rows}


def test_kill_9_of_the_redis_primary_mid_stream_promotes_the_replica_and_loses_no_job(
    own_sentinel_set: SentinelSet, redis_url: str, make_cluster: Any, e2e_settings: Any
) -> None:
    # The Sentinel set is set up first, so it is torn down after the beats.
    topology = own_sentinel_set
    settings = dataclasses.replace(e2e_settings, redis_url=topology.url)
    cluster = make_cluster(redis_url, settings)  # the broker is not the Sentinel set
    cluster.start_worker(concurrency=8)
    cluster.start_beat("beat1")
    wait_for(cluster.leader, timeout=30, what="a leader")
    cluster.start_beat("beat2")
    assert topology.primary_address() == ("127.0.0.1", topology.primary_port)
    # The lease went through the sentinels to the primary, and the replica has it too.
    holder = wait_for(
        lambda: _lease_on(topology, topology.replica_port, settings.key_prefix),
        timeout=10,
        what="the lease to reach the replica",
    )
    assert _lease_on(topology, topology.primary_port, settings.key_prefix) == holder

    jobs = spread_jobs(1500, time.time() + 1, 14, tag="sentinel")
    client_for(settings).schedule_many(jobs)
    wait_for(lambda: cluster.run_count() >= 150, timeout=30, what="dispatch to start")

    topology.kill_primary()
    killed_at = time.monotonic()
    wait_for(
        lambda: topology.primary_address() == ("127.0.0.1", topology.replica_port),
        timeout=20,
        what="the sentinels to promote the replica",
    )
    promoted = time.monotonic() - killed_at
    runs_at_promotion = cluster.run_count()

    # A beat leads through the new primary: the lease key there names the
    # holder of the shard's current epoch.
    def leading_through_new_primary() -> bool:
        token = _lease_on(topology, topology.replica_port, settings.key_prefix)
        current = cluster.leader()
        return token is not None and current is not None and token_holder(token) == current[1]

    wait_for(leading_through_new_primary, timeout=20, what="a leader on the new primary")
    print(f"replica promoted {promoted:.1f}s after the kill; {runs_at_promotion} runs by then")

    expected = {job["key"] for job in jobs}
    wait_for(
        lambda: {key for _i, key, _d, _r in cluster.runs()} >= expected,
        timeout=60,
        what=f"all {len(expected)} jobs to run",
    )
    # Jobs kept being dispatched after the failover, not only before it.
    assert runs_at_promotion < len(jobs)
    wait_for(
        lambda: not any(_statuses(cluster).get(status) for status in UNFINISHED),
        timeout=20,
        what="no job left unfinished",
    )
    statuses = _statuses(cluster)
    assert statuses == {"succeeded": len(jobs)}
    runs = cluster.runs()
    assert {key for _i, key, _d, _r in runs} == expected
    print(f"{len(runs)} runs of {len(jobs)} jobs")

    # The fence: once the current epoch was taken, no older epoch claimed anything.
    assert cluster.stale_claims() == 0
    assert all(proc.alive() for proc in cluster.procs), "no beat or worker may exit"
