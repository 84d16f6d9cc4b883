"""Redis Cluster URLs (#17): parsed into seed nodes, bad ones refused with the
problem named and the password masked, before anything is built; and the
``celery_sched_legacy_lease_keys`` rule on a Cluster."""

from __future__ import annotations

import pytest

from celery_sched.errors import ConfigurationError
from celery_sched.redisconn import (
    ClusterTarget,
    check_url,
    cluster_target,
    is_cluster_url,
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
