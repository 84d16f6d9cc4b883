"""The lease behind Redis Sentinel: what a failover that loses the lease key
does, and why the PostgreSQL epoch keeps it from dispatching twice (#17).

Real processes throughout: a Sentinel set of the test's own, PostgreSQL in
the test's own schema. The loss itself cannot be provoked on demand
(replication over loopback is faster than any test), so after a real
``SENTINEL FAILOVER`` the test deletes the key from the promoted primary:
the state an asynchronous replica that had not yet received the last SET
would be promoted in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from celery_sched.backends import build_lease, build_redis, build_store
from celery_sched.errors import StaleEpoch
from celery_sched.interfaces import JobStore
from celery_sched.lease.elector import LeaderElector
from celery_sched.lease.redis import lease_key
from celery_sched.rediskeys import legacy_lease_key
from celery_sched.settings import Settings
from tests.contract.conftest import new_job
from tests.e2e.harness import wait_for
from tests.redis_topologies import SERVICE, SentinelSet


@pytest.fixture
def sentinel_settings(own_sentinel_set: SentinelSet, settings: Settings) -> Settings:
    # No thread renews the electors' leases here, and the sentinels take ~10 s
    # to turn the old primary into a replica: a ttl that outlasts the test.
    return dataclasses.replace(settings, redis_url=own_sentinel_set.url, lease_ttl=30.0)


@pytest.fixture
def store(sentinel_settings: Settings) -> Iterator[JobStore]:
    store = build_store(sentinel_settings)
    store.migrate()
    yield store
    store.close()


def _elector(settings: Settings, store: JobStore, holder: str) -> LeaderElector:
    # The beat's own construction: one Sentinel client, the lease on a clone of it.
    return LeaderElector(
        build_lease(settings, build_redis(settings)),
        shard=0,
        ttl=settings.lease_ttl,
        safety_margin=settings.lease_safety_margin,
        acquire_epoch=store.acquire_epoch,
        holder=holder,
    )


def test_a_failover_that_loses_the_lease_key_is_fenced_by_the_epoch(
    own_sentinel_set: SentinelSet, sentinel_settings: Settings, store: JobStore
) -> None:
    topology = own_sentinel_set
    key = lease_key(sentinel_settings.key_prefix, 0)
    old, new = (_elector(sentinel_settings, store, name) for name in ("old:1", "new:2"))
    first = old.try_acquire()
    assert first is not None
    with topology.client(topology.primary_port) as primary:
        assert primary.get(key) == first.token.encode()
    store.add_job(new_job("after-failover", store.now()))

    with topology.client(topology.sentinel_ports[0]) as sentinel:
        assert sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE)
    wait_for(
        lambda: topology.primary_address() == ("127.0.0.1", topology.replica_port),
        timeout=20,
        what="the replica to be promoted",
    )
    with topology.client(topology.replica_port) as promoted:
        wait_for(
            lambda: promoted.info("replication")["role"] == "master",
            timeout=10,
            what="the replica to take the primary role",
        )
        # The writes the replica never received: the lease key, and the
        # legacy one beats hold too by default (celery_sched_legacy_lease_keys).
        promoted.delete(key, legacy_lease_key(sentinel_settings.key_prefix, 0))

    # Through the sentinels, the newcomer finds the promoted primary and a
    # free key, so it leads with a new epoch...
    second = new.try_acquire()
    assert second is not None and second.epoch > first.epoch
    # ... while the old leader still trusts its lease: Redis alone would let
    # both dispatch until the old one's next renewal.
    assert old.is_leader() and new.is_leader()

    # The epoch fence: the old leader claims nothing, the new one the job.
    with pytest.raises(StaleEpoch):
        store.claim_due(shard=0, epoch=first.epoch, limit=10)
    claimed = store.claim_due(shard=0, epoch=second.epoch, limit=10)
    assert [job.key for job in claimed] == ["after-failover"]

    # Until the sentinels turn the old primary into a replica, it still takes
    # writes, and the old leader's renewals, sent over its open connection,
    # may succeed there: only the fence stands between the two leaders then.
    # Once it is demoted, the old leader's renewal gets READONLY, which the
    # Sentinel client turns into a reconnect to the new primary, where the
    # key holds the newcomer's token: the renewal fails and it steps down.
    with topology.client(topology.primary_port) as demoted:
        wait_for(
            lambda: demoted.info("replication").get("master_link_status") == "up",
            timeout=20,
            what="the old primary to replicate from the new one",
        )
    with topology.client(topology.replica_port) as promoted:
        assert promoted.get(key) == second.token.encode()
    assert old.renew() is False
    assert not old.is_leader()
    assert new.renew() is True
    new.release()
