"""Shared fixtures: service URLs, a fresh schema and Redis prefix per test.

A test that needs a service it cannot reach fails (never skips): a green run
must mean the real backends were exercised.
"""

from __future__ import annotations

import os
import socket
import urllib.parse
import uuid
from collections.abc import Iterator

import pytest

from celery_sched.settings import Settings

PG_URL = os.environ.get(
    "CELERY_SCHED_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("CELERY_SCHED_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
AMQP_URL = os.environ.get("CELERY_SCHED_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def require_service(url: str, default_port: int) -> None:
    """Fail the test (also outside CI) when the service at ``url`` is down."""
    parts = urllib.parse.urlsplit(url.replace("+psycopg", ""))
    host, port = parts.hostname or "127.0.0.1", parts.port or default_port
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        pytest.fail(f"service at {host}:{port} is unreachable ({exc}); start it (see README)")


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
    return "t_" + uuid.uuid4().hex[:12]


@pytest.fixture
def pg_schema(pg_url: str, unique_name: str) -> Iterator[str]:
    """A schema name unique to this test, dropped afterwards."""
    import psycopg

    yield unique_name
    with psycopg.connect(pg_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{unique_name}" CASCADE')


@pytest.fixture
def settings(pg_url: str, redis_url: str, pg_schema: str) -> Settings:
    """Settings pointing at the real services, isolated to this test."""
    return Settings(
        database_url=pg_url,
        redis_url=redis_url,
        db_schema=pg_schema,
        key_prefix=pg_schema,
    )
