"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_sched.settings import Settings
from celery_sched.store.postgres import PostgresJobStore


@pytest.fixture
def store(settings: Settings) -> Iterator[PostgresJobStore]:
    """A PostgreSQL job store on the test's own schema, migrated."""
    backend = PostgresJobStore(settings)
    backend.migrate()
    yield backend
    backend.close()
