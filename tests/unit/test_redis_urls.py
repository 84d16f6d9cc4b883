"""Redis URLs (#17): both Sentinel forms parsed, bad ones refused with the
problem named and the password masked, and nothing built from them."""

from __future__ import annotations

import pytest
import redis
from redis.sentinel import SentinelConnectionPool

from celery_sched.errors import InvalidURL
from celery_sched.lease.redis import RedisLeaseBackend
from celery_sched.redisconn import (
    SentinelTarget,
    build_client,
    check_url,
    clone_client,
    describe,
    sentinel_target,
)
from celery_sched.settings import Settings, sanitize_url


def test_preferred_form_with_every_part() -> None:
    target = sentinel_target(
        "redis+sentinel://app:hunter2@s1:26380,s2,[::1]:5000/mymaster/3"
        "?sentinel_password=hunter3&ssl=true"
    )
    assert target == SentinelTarget(
        sentinels=(("s1", 26380), ("s2", 26379), ("::1", 5000)),
        service_name="mymaster",
        db=3,
        username="app",
        password="hunter2",
        sentinel_password="hunter3",
        ssl=True,
    )
    assert "hunter" not in repr(target)
    assert target.describe() == "redis+sentinel://s1:26380,s2:26379,[::1]:5000/mymaster/3"


def test_preferred_form_defaults() -> None:
    target = sentinel_target("redis+sentinel://s1/svc")
    assert target.sentinels == (("s1", 26379),)
    assert (target.db, target.username, target.password, target.ssl) == (0, None, None, False)
    assert sentinel_target("redis+sentinel://:p%40ss@s1/svc/").password == "p@ss"


def test_kombu_form() -> None:
    target = sentinel_target(
        "sentinel://:hunter2@s1:26380/2;sentinel://:hunter2@s2/2;sentinel://s3?master_name=cache"
    )
    assert target.sentinels == (("s1", 26380), ("s2", 26379), ("s3", 26379))
    assert (target.service_name, target.db, target.password) == ("cache", 2, "hunter2")


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis+sentinel://:hunter2@s1:26379", "names no Sentinel service"),
        ("redis+sentinel://:hunter2@s1:26379/", "names no Sentinel service"),
        ("redis+sentinel://:hunter2@/svc", "names an empty sentinel host"),
        ("redis+sentinel://:hunter2@s1,,s2/svc", "names an empty sentinel host"),
        ("redis+sentinel://:hunter2@s1:port/svc", "bad port in sentinel 's1:port'"),
        ("redis+sentinel://:hunter2@s1:99999/svc", "bad port in sentinel 's1:99999'"),
        ("redis+sentinel://:hunter2@s1/svc/one", "bad database number 'one'"),
        ("redis+sentinel://:hunter2@s1/svc/-1", "bad database number '-1'"),
        ("redis+sentinel://:hunter2@s1/svc/0/x", "more than /<service>/<db>"),
        ("redis+sentinel://:hunter2@s1/svc?sentinel_pasword=x", "unknown parameter"),
        ("redis+sentinel://:hunter2@s1/svc?ssl=maybe", "ssl='maybe'"),
        ("redis+sentinel://:hunter2@s1/svc?master_name=other", "master_name is for sentinel://"),
        ("sentinel://:hunter2@s1;sentinel://s2", "add ?master_name=<service>"),
        ("sentinel://:hunter2@s1;redis://s2?master_name=m", "mixes sentinel:// with other URLs"),
        ("sentinel://:hunter2@s1/1;sentinel://s2/2?master_name=m", "different databases"),
        ("sentinel://:hunter2@s1;sentinel://:other@s2?master_name=m", "different databases or cr"),
        ("sentinel://:hunter2@s1:x?master_name=m", "bad port in sentinel 's1:x'"),
    ],
)
def test_bad_sentinel_urls_name_the_problem_and_mask_the_password(url: str, problem: str) -> None:
    assert_refused(url, problem)


def assert_refused(url: str, problem: str) -> None:
    """Settings, the client builder and the URL check each refuse ``url``
    with an InvalidURL naming the setting and ``problem``, its password
    (``hunter2``) masked."""
    for check in (
        lambda: Settings(redis_url=url),
        lambda: build_client(url),
        lambda: check_url(url),
    ):
        with pytest.raises(InvalidURL, match="celery_sched_redis_url") as info:
            check()
        assert problem in str(info.value)
        assert "hunter2" not in str(info.value)
        assert ":***@" in str(info.value)


def test_settings_accept_both_forms() -> None:
    settings = Settings(redis_url="redis+sentinel://:hunter2@s1,s2/svc/1")
    assert settings.safe_redis_url == "redis+sentinel://:***@s1,s2/svc/1"
    assert "hunter2" not in repr(settings)
    Settings(redis_url="sentinel://s1:26379;sentinel://s2:26379?master_name=svc")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "redis+sentinel://app:hunter2@s1:26379,s2:26379/svc/0?sentinel_password=hunter3",
            "redis+sentinel://app:***@s1:26379,s2:26379/svc/0?sentinel_password=***",
        ),
        (
            "sentinel://:hunter2@s1:26379;sentinel://u:hunter3@s2:26379?master_name=svc",
            "sentinel://:***@s1:26379;sentinel://u:***@s2:26379?master_name=svc",
        ),
        (
            "sentinel://s1;sentinel://s2?master_name=svc",
            "sentinel://s1;sentinel://s2?master_name=svc",
        ),
    ],
)
def test_sanitize_url_masks_sentinel_forms(url: str, expected: str) -> None:
    assert sanitize_url(url) == expected


def test_plain_urls_still_go_to_from_url() -> None:
    client = build_client("redis://:hunter2@cache:6380/4", socket_timeout=3)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"], kwargs["password"]) == (
        "cache",
        6380,
        4,
        "hunter2",
    )
    assert kwargs["socket_timeout"] == 3
    assert describe(client) == "redis://cache:6380/4"
    client.close()


def test_sentinel_client_is_a_master_client_with_the_url_settings() -> None:
    client = build_client(
        "redis+sentinel://u:hunter2@s1:26380,s2/svc/5?sentinel_password=hunter3",
        socket_timeout=2.5,
        health_check_interval=30,
    )
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.is_master and pool.service_name == "svc"
    kwargs = pool.connection_kwargs
    assert (kwargs["db"], kwargs["username"], kwargs["password"]) == (5, "u", "hunter2")
    assert kwargs["health_check_interval"] == 30
    manager = pool.sentinel_manager
    assert manager.sentinel_kwargs["password"] == "hunter3"
    assert manager.sentinel_kwargs["socket_timeout"] == 2.5
    assert describe(client) == "redis+sentinel://s1:26380,s2:26379/svc/5"
    client.close()


def test_clone_of_a_sentinel_client_asks_the_same_sentinels_on_a_pool_of_its_own() -> None:
    client = build_client("redis+sentinel://:hunter2@s1:26380,s2/svc/5", socket_timeout=3)
    clone = clone_client(client, max_connections=8, socket_timeout=0.2)
    pool = clone.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool is not client.connection_pool
    assert pool.service_name == "svc" and pool.max_connections == 8
    assert pool.connection_kwargs["socket_timeout"] == 0.2
    assert pool.connection_kwargs["password"] == "hunter2"
    # Its connections belong to its own pool, not the original's.
    assert pool.connection_kwargs["connection_pool"] is pool.proxy
    assert pool.sentinel_manager is not client.connection_pool.sentinel_manager
    assert pool.sentinel_manager.sentinel_kwargs["socket_timeout"] == 0.2
    assert describe(clone) == describe(client)
    clone.close()
    client.close()


def test_lease_backend_on_a_sentinel_client_uses_a_sentinel_pool_without_retries() -> None:
    client = build_client("redis+sentinel://127.0.0.1:1/svc")
    backend = RedisLeaseBackend(client, prefix="p", op_timeout=0.2)
    lease_client = backend._client
    pool = lease_client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    connection = pool.make_connection()
    assert connection.retry._retries == 0
    assert connection.socket_timeout == 0.2
    backend.close()
    client.close()


def test_closing_a_sentinel_client_closes_its_sentinel_connections() -> None:
    client = build_client("redis+sentinel://127.0.0.1:1/svc")
    sentinels = client.connection_pool.sentinel_manager.sentinels
    closed: list[redis.Redis] = []
    for sentinel in sentinels:
        sentinel.close = lambda s=sentinel: closed.append(s)  # type: ignore[method-assign]
    client.close()
    assert closed == sentinels
