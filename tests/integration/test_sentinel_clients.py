"""Clients built from Sentinel URLs reach the primary of a real Sentinel set
(#17): both URL forms, and the readiness probe."""

from __future__ import annotations

import uuid

import pytest

from celery_sched.errors import StagingUnavailable
from celery_sched.redisconn import build_client
from celery_sched.staging.redis import probe
from tests.redis_topologies import SentinelSet


@pytest.mark.parametrize("form", ["url", "kombu_url"])
def test_both_forms_write_to_the_primary(shared_sentinel_set: SentinelSet, form: str) -> None:
    topology = shared_sentinel_set
    key = f"t_sentinel_{uuid.uuid4().hex[:12]}"
    with build_client(getattr(topology, form), socket_timeout=2) as client:
        assert client.set(key, form, px=60_000)
    with topology.client(topology.primary_port) as primary:
        try:
            assert primary.get(key) == form.encode()
        finally:
            primary.delete(key)


def test_probe_pings_the_primary_through_the_sentinels(shared_sentinel_set: SentinelSet) -> None:
    probe(shared_sentinel_set.url, timeout=2)


def test_probe_of_unreachable_sentinels_fails_with_the_password_masked() -> None:
    with pytest.raises(StagingUnavailable, match="MasterNotFoundError") as info:
        probe(
            "redis+sentinel://:hunter2@127.0.0.1:1,127.0.0.1:2/svc?sentinel_password=x9",
            timeout=0.5,
        )
    assert "hunter2" not in str(info.value) and "x9" not in str(info.value)
