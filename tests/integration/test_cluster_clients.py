"""Clients built from ``redis+cluster://`` URLs reach a real 3-master Redis
Cluster (#17): the readiness probe, the lease's own clone (no retries, short
timeouts, same seeds), and the refusal of legacy lease keys there."""

from __future__ import annotations

import uuid

import pytest
from redis.cluster import RedisCluster

from celery_sched.errors import StagingUnavailable
from celery_sched.lease.redis import RedisLeaseBackend
from celery_sched.redisconn import build_client, clone_client, describe
from celery_sched.staging.redis import probe
from tests.e2e.harness import delete_keys
from tests.redis_topologies import ClusterSet

pytestmark = pytest.mark.integration


def test_the_client_routes_keys_to_every_master(shared_cluster_set: ClusterSet) -> None:
    topology = shared_cluster_set
    client = build_client(topology.url, socket_timeout=2)
    prefix = f"t_cc_{uuid.uuid4().hex[:12]}"
    try:
        assert isinstance(client, RedisCluster)
        assert describe(client) == topology.url
        keys = [f"{prefix}:{n}" for n in range(30)]
        for key in keys:
            assert client.set(key, key, px=60_000)
        # The keys really are spread: each master holds some of them.
        for port in topology.ports:
            with topology.client(port) as node:
                # SCAN on one node lists that node's keys only (no redirection).
                assert any(True for _ in node.scan_iter(match=f"{prefix}:*")), port
    finally:
        delete_keys(client, prefix)
        client.close()


def test_the_lease_clone_has_no_retries_and_its_own_timeouts(
    shared_cluster_set: ClusterSet,
) -> None:
    client = build_client(shared_cluster_set.url, socket_timeout=5)
    backend = RedisLeaseBackend(client, prefix=f"t_cc_{uuid.uuid4().hex[:12]}", op_timeout=0.25)
    try:
        lease_client = backend._client  # the clone under test
        assert isinstance(lease_client, RedisCluster) and lease_client is not client
        kwargs = lease_client.get_connection_kwargs()
        assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (0.25, 0.25)
        assert lease_client.retry.get_retries() == 0
        assert describe(lease_client) == shared_cluster_set.url
        # The original keeps its own settings.
        assert client.get_connection_kwargs()["socket_timeout"] == 5
        assert backend.acquire(0, "tok", 5.0) and backend.holder(0) == "tok"
        assert backend.renew(0, "tok", 5.0) and backend.release(0, "tok")
        assert backend.holder(0) is None
    finally:
        backend.close()
        client.close()


def test_a_clone_keeps_the_urls_credentials(shared_cluster_set: ClusterSet) -> None:
    # The test Cluster has no requirepass, and Redis accepts a password for
    # the default user then; the point is that the clone carries it, and
    # that no description shows it.
    url = shared_cluster_set.url.replace("//", "//:hunter2@")
    client = build_client(url, socket_timeout=2)
    try:
        clone = clone_client(client, max_connections=2, socket_timeout=0.5)
        try:
            kwargs = clone.get_connection_kwargs()
            assert kwargs["password"] == "hunter2"
            assert "hunter2" not in describe(clone)
        finally:
            clone.close()
    finally:
        client.close()


def test_legacy_lease_keys_are_refused_on_a_cluster(shared_cluster_set: ClusterSet) -> None:
    client = build_client(shared_cluster_set.url, socket_timeout=2)
    try:
        with pytest.raises(ValueError, match="Redis Cluster"):
            RedisLeaseBackend(client, prefix="t_cc", legacy_keys=True)
    finally:
        client.close()


def test_probe_pings_the_cluster(shared_cluster_set: ClusterSet) -> None:
    probe(shared_cluster_set.url, timeout=2)


def test_probe_of_an_unreachable_cluster_fails_with_the_password_masked() -> None:
    with pytest.raises(StagingUnavailable) as info:
        probe("redis+cluster://:hunter2@127.0.0.1:1,127.0.0.1:2/", timeout=0.5)
    assert "hunter2" not in str(info.value)
