"""Redis Cluster URLs (#17): parsed into seed nodes, bad ones refused with the
problem named and the password masked, before anything is built; the
``celery_sched_legacy_lease_keys`` rule on a Cluster; and the client built
from a Cluster URL, which connects on first use and retries briefly."""

from __future__ import annotations

import pytest

from celery_sched.errors import ConfigurationError
from celery_sched.redisconn import (
    CLUSTER_RETRIES,
    ClusterTarget,
    build_client,
    check_url,
    clone_client,
    cluster_target,
    describe,
    is_cluster_client,
    is_cluster_url,
    is_connected,
)
from celery_sched.settings import Settings, sanitize_url
from tests.unit.test_redis_urls import assert_refused

CLUSTER = "redis+cluster://127.0.0.1:7000,127.0.0.1:7001/"


def test_every_part() -> None:
    target = cluster_target("redis+cluster://app:hunter2@n1:7000,n2,[::1]:7002/?ssl=true")
    assert target == ClusterTarget(
        nodes=(("n1", 7000), ("n2", 6379), ("::1", 7002)),
        username="app",
        password="hunter2",
        ssl=True,
    )
    assert "hunter2" not in repr(target)
    assert target.describe() == "redis+cluster://n1:7000,n2:6379,[::1]:7002/"


def test_defaults_and_optional_path() -> None:
    for url in ("redis+cluster://n1:7000", "redis+cluster://n1:7000/", "redis+cluster://n1:7000/0"):
        target = cluster_target(url)
        assert target.nodes == (("n1", 7000),)
        assert (target.username, target.password, target.ssl) == (None, None, False)
        check_url(url)
    assert cluster_target("redis+cluster://:p%40ss@n1/").password == "p@ss"
    assert is_cluster_url(CLUSTER) and not is_cluster_url("redis://n1:7000/0")


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis+cluster://:hunter2@/", "names no seed node"),
        ("redis+cluster://:hunter2@n1,,n2/", "names an empty seed node host"),
        ("redis+cluster://:hunter2@n1:port/", "bad port in seed node 'n1:port'"),
        ("redis+cluster://:hunter2@n1:99999/", "bad port in seed node 'n1:99999'"),
        ("redis+cluster://:hunter2@n1:7000/3", "a Redis Cluster has no databases"),
        ("redis+cluster://:hunter2@n1:7000/?ssl=maybe", "has ssl='maybe'"),
        ("redis+cluster://:hunter2@n1:7000/?sll=true", "unknown parameter 'sll'"),
        ("redis+cluster://:hunter2@n1:7000/?ssl=true&ssl=true", "gives ssl twice"),
    ],
)
def test_bad_cluster_urls_name_the_problem_and_mask_the_password(url: str, problem: str) -> None:
    assert_refused(url, problem)


def test_settings_mask_the_cluster_password() -> None:
    settings = Settings(redis_url="redis+cluster://:hunter2@n1:7000,n2:7001/")
    assert settings.safe_redis_url == "redis+cluster://:***@n1:7000,n2:7001/"
    assert "hunter2" not in repr(settings)


def test_legacy_lease_keys_default_on_except_on_a_cluster() -> None:
    assert Settings().legacy_lease_keys is True
    assert Settings().hold_legacy_lease_keys is True
    sentinel = Settings(redis_url="redis+sentinel://s1/svc")
    assert sentinel.hold_legacy_lease_keys is True
    assert Settings(legacy_lease_keys=False).hold_legacy_lease_keys is False
    # The default is simply not applied to a Cluster...
    cluster = Settings.from_mapping({}, {"CELERY_SCHED_REDIS_URL": CLUSTER})
    assert cluster.hold_legacy_lease_keys is False
    off = Settings.from_mapping(
        {}, {"CELERY_SCHED_REDIS_URL": CLUSTER, "CELERY_SCHED_LEGACY_LEASE_KEYS": "false"}
    )
    assert off.hold_legacy_lease_keys is False


@pytest.mark.parametrize(
    ("conf", "environ", "origin"),
    [
        ({"celery_sched_legacy_lease_keys": True}, {}, "app config"),
        ({}, {"CELERY_SCHED_LEGACY_LEASE_KEYS": "yes"}, "environment"),
    ],
)
def test_legacy_lease_keys_set_true_on_a_cluster_is_refused(
    conf: dict[str, object], environ: dict[str, str], origin: str
) -> None:
    with pytest.raises(ConfigurationError, match="legacy_lease_keys cannot be true") as info:
        Settings.from_mapping(
            {**conf, "celery_sched_redis_url": CLUSTER.replace("//", "//:hunter2@")}, environ
        )
    assert origin in str(info.value)
    assert "hunter2" not in str(info.value)


def test_sanitize_url_masks_the_cluster_form() -> None:
    assert sanitize_url("redis+cluster://u:hunter2@n1:7000,n2:7001/") == (
        "redis+cluster://u:***@n1:7000,n2:7001/"
    )


@pytest.mark.parametrize("prefix", ["a{b", "a}b", "{x}"])
def test_a_prefix_with_a_brace_is_refused(prefix: str) -> None:
    with pytest.raises(ConfigurationError, match="celery_sched_key_prefix"):
        Settings(key_prefix=prefix)


# -- the client built from a Cluster URL -------------------------------------------------


def _dead_url() -> str:
    """A Cluster URL whose seeds are loopback ports nothing listens on."""
    from tests.e2e.harness import free_port

    return f"redis+cluster://:hunter2@127.0.0.1:{free_port()},127.0.0.1:{free_port()}/"


def test_a_cluster_client_is_built_without_a_reachable_seed_and_fails_on_use() -> None:
    from redis.cluster import RedisCluster
    from redis.exceptions import RedisClusterException

    url = _dead_url()
    client = build_client(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        assert isinstance(client, RedisCluster) and is_cluster_client(client)
        assert not is_connected(client)
        # What needs no server works: describing, scripts, clones.
        assert describe(client) == url.replace(":hunter2@", "")
        client.register_script("return 1")
        clone = clone_client(client, max_connections=2, socket_timeout=0.1)
        assert not is_connected(clone)
        assert clone.get_connection_kwargs()["password"] == "hunter2"
        assert clone.get_connection_kwargs()["socket_timeout"] == 0.1
        clone.close()
        # A use raises redis-py's error, every time (each use tries again).
        for _ in range(2):
            with pytest.raises(RedisClusterException, match="cannot be connected"):
                client.get("k")
        assert not is_connected(client)
    finally:
        client.close()


def test_a_cluster_client_retries_a_failed_command_briefly() -> None:
    client = build_client(_dead_url())
    try:
        assert client.retry.get_retries() == CLUSTER_RETRIES
        backoff = client.retry._backoff
        # Whatever the jitter, all retries together take well under a second.
        assert sum(backoff.compute(n) for n in range(1, CLUSTER_RETRIES + 1)) <= 0.5
    finally:
        client.close()


def test_a_lease_and_staging_on_an_unreachable_cluster_raise_unavailable() -> None:
    from celery_sched.errors import LeaseUnavailable, StagingUnavailable
    from celery_sched.lease.redis import RedisLeaseBackend
    from celery_sched.staging.redis import RedisStaging

    client = build_client(_dead_url(), socket_timeout=0.5, socket_connect_timeout=0.5)
    lease = RedisLeaseBackend(client, prefix="t", op_timeout=0.5)
    try:
        with pytest.raises(LeaseUnavailable, match="cannot be reached"):
            lease.acquire(0, "token", 5.0)
        with pytest.raises(StagingUnavailable, match="cannot be connected"):
            RedisStaging(client, prefix="t").size(0)
    finally:
        lease.close()
        client.close()


def test_building_a_cluster_client_that_reads_its_own_unset_attributes_neither_hangs_nor_recurses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from redis.cluster import RedisCluster

    seen: list[object] = []

    def init(self: RedisCluster, **kwargs: object) -> None:
        # As a redis-py version might: read an attribute before setting it.
        seen.append(getattr(self, "not_set_yet", "missing"))
        raise ConnectionError("no seed (test)")

    client = build_client(_dead_url())
    monkeypatch.setattr(RedisCluster, "__init__", init)
    for _ in range(2):
        with pytest.raises(ConnectionError, match="no seed"):
            client.get("k")
    assert seen == ["missing", "missing"]
    assert not is_connected(client)


def test_a_cluster_that_is_down_or_unreachable_is_the_lease_backend_unavailable() -> None:
    from redis.exceptions import ClusterDownError, RedisClusterUnreachableError, ResponseError

    from celery_sched.errors import LeaseUnavailable
    from celery_sched.lease.redis import translate

    for error in (
        ClusterDownError("The cluster is down"),
        RedisClusterUnreachableError("Redis Cluster cannot be connected"),
    ):
        assert isinstance(translate(error), LeaseUnavailable), error
    assert not isinstance(translate(ResponseError("WRONGTYPE")), LeaseUnavailable)
