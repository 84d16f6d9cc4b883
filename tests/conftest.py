"""Shared fixtures: the services, a fresh schema and Redis prefix per test, and
the process clusters of the end-to-end and fault tests.

A test that needs a service carries a marker saying so: ``needs_postgres``,
``needs_redis`` or ``needs_rabbitmq``. It gets the marker by asking for the
service, not by spelling it: requesting ``pg_url``, ``redis_url`` or
``amqp_url`` (directly or through ``settings``, ``make_cluster``, ...) adds
it, and so does a parametrized backend fixture whose parameter is
``"postgres"``, ``"redis"`` or ``"amqp"`` (the contract suites'
convention). ``-m 'not needs_rabbitmq'`` selects the tests a machine without
RabbitMQ can run.

A test that needs a service it cannot reach fails, never skips, in CI (``CI``
set) and everywhere else: a green run must mean the real backends were
exercised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import socket
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from celery_sched.settings import Settings
from tests.e2e import harness
from tests.e2e.harness import Cluster
from tests.redis_topologies import ClusterSet, SentinelSet, cluster_set, sentinel_set

PG_URL = os.environ.get(
    "CELERY_SCHED_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("CELERY_SCHED_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
AMQP_URL = os.environ.get("CELERY_SCHED_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")

#: Marker -> (service, URL, default port).
SERVICES: dict[str, tuple[str, str, int]] = {
    "needs_postgres": ("PostgreSQL", PG_URL, 5432),
    "needs_redis": ("Redis", REDIS_URL, 6379),
    "needs_rabbitmq": ("RabbitMQ", AMQP_URL, 5672),
}
#: The fixtures that hand out a service's URL, by the marker they imply.
SERVICE_FIXTURES = {
    "pg_url": "needs_postgres",
    "redis_url": "needs_redis",
    "amqp_url": "needs_rabbitmq",
}
#: A backend fixture's parameter naming a real backend, by the marker it implies.
BACKEND_PARAMS = {"postgres": "needs_postgres", "redis": "needs_redis", "amqp": "needs_rabbitmq"}


def pytest_configure(config: pytest.Config) -> None:
    # pyproject.toml runs pytest with --strict-markers.
    for marker, (service, _url, _port) in SERVICES.items():
        config.addinivalue_line(
            "markers", f"{marker}: needs a reachable {service}; fails (never skips) without it"
        )


def _implied_markers(item: pytest.Item) -> set[str]:
    needs = {
        SERVICE_FIXTURES[name]
        for name in getattr(item, "fixturenames", ())
        if name in SERVICE_FIXTURES
    }
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return needs
    # Only the parameters of fixtures declared with ``params=`` name a
    # backend; a test's own ``parametrize`` values are just data.
    definitions = item._fixtureinfo.name2fixturedefs  # type: ignore[attr-defined]
    for name, value in callspec.params.items():
        if not isinstance(value, str) or value not in BACKEND_PARAMS:
            continue
        defs = definitions.get(name)
        if defs and defs[-1].params is not None:
            needs.add(BACKEND_PARAMS[value])
    return needs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        present = {mark.name for mark in item.iter_markers()}
        for marker in sorted(_implied_markers(item) - present):
            item.add_marker(marker)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before any fixture: a backend fixture that reaches its service through
    # ``request.getfixturevalue`` fails here with the same message.
    for mark in item.iter_markers():
        if mark.name in SERVICES:
            _, url, port = SERVICES[mark.name]
            require_service(url, port)


@functools.cache
def _unreachable(host: str, port: int) -> str | None:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        return str(exc)
    return None


def require_service(url: str, default_port: int) -> None:
    """Fail the test (also outside CI) when the service at ``url`` is down."""
    parts = urllib.parse.urlsplit(url.replace("+psycopg", ""))
    host, port = parts.hostname or "127.0.0.1", parts.port or default_port
    error = _unreachable(host, port)
    if error is not None:
        pytest.fail(f"service at {host}:{port} is unreachable ({error}); start it (see README)")


@pytest.fixture(scope="session")
def pg_url() -> str:
    require_service(PG_URL, 5432)
    return PG_URL


@pytest.fixture(scope="session")
def redis_url() -> str:
    require_service(REDIS_URL, 6379)
    return REDIS_URL


@pytest.fixture(scope="session")
def amqp_url() -> str:
    require_service(AMQP_URL, 5672)
    return AMQP_URL


@pytest.fixture
def unique_name() -> str:
    return harness.unique_name()


@pytest.fixture
def pg_schema(pg_url: str, unique_name: str) -> Iterator[str]:
    """A schema name unique to this test, dropped afterwards."""
    yield unique_name
    harness.drop_schema(pg_url, unique_name)


@pytest.fixture
def settings(pg_url: str, redis_url: str, pg_schema: str) -> Iterator[Settings]:
    """Settings pointing at the real services, isolated to this test: its own
    schema, and a Redis key prefix whose keys are deleted afterwards."""
    yield Settings(
        database_url=pg_url,
        redis_url=redis_url,
        db_schema=pg_schema,
        key_prefix=pg_schema,
    )
    # Best effort: a fault test may have left Redis down, and the keys are
    # only litter.
    with contextlib.suppress(redis.RedisError), redis.Redis.from_url(redis_url) as client:
        harness.delete_keys(client, pg_schema)


# -- Redis Sentinel (tests/redis_topologies.py) ----------------------------------------


@pytest.fixture(scope="session")
def shared_sentinel_set(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSet]:
    """A primary, a replica and three sentinels shared by the tests that only
    use them (each with a key prefix of its own); none may fault them."""
    with sentinel_set(tmp_path_factory.mktemp("sentinel")) as topology:
        yield topology


@pytest.fixture
def own_sentinel_set(tmp_path: Path) -> Iterator[SentinelSet]:
    """A Sentinel set of this test's own, for a test that kills its primary."""
    directory = tmp_path / "sentinel"
    directory.mkdir()
    with sentinel_set(directory) as topology:
        yield topology


# -- Redis Cluster (tests/redis_topologies.py) -----------------------------------------


@pytest.fixture(scope="session")
def shared_cluster_set(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterSet]:
    """Three masters of a Redis Cluster shared by the tests that only use
    them (each with a key prefix of its own); none may fault them."""
    with cluster_set(tmp_path_factory.mktemp("cluster")) as topology:
        yield topology


@pytest.fixture
def own_cluster_set(tmp_path: Path) -> Iterator[ClusterSet]:
    """A Redis Cluster of this test's own, three masters with a replica
    each, for a test that kills a master."""
    directory = tmp_path / "cluster"
    directory.mkdir()
    with cluster_set(directory, replicas=1) as topology:
        yield topology


# -- real beat and worker processes (tests/e2e, tests/fault) --------------------------


@pytest.fixture
def e2e_settings(settings: Settings) -> Settings:
    """Short timings so failover and reconciliation fit in a test."""
    return dataclasses.replace(
        settings,
        lease_ttl=2.0,
        lease_safety_margin=0.3,
        visibility_timeout=120.0,
        sweep_interval=1.0,
        reconcile_interval=1.0,
        staging_window=20.0,
        batch_size=500,
    )


@pytest.fixture
def make_cluster(tmp_path: Path, e2e_settings: Settings) -> Iterator[Callable[..., Cluster]]:
    """``make_cluster(broker_url, settings=None)``: a migrated schema and a
    :class:`~tests.e2e.harness.Cluster` on a queue of its own; every process
    it started is stopped afterwards."""
    clusters: list[Cluster] = []

    def make(broker_url: str, settings: Settings | None = None) -> Cluster:
        from celery_sched.backends import build_store

        settings = settings or e2e_settings
        store = build_store(settings)
        store.migrate()
        store.close()
        cluster = Cluster(
            tmp_path=tmp_path,
            settings=settings,
            broker_url=broker_url,
            queue="q_" + uuid.uuid4().hex[:10],
        )
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop_all()
        # Shown by pytest only when the test failed.
        print(cluster.dump_logs())
