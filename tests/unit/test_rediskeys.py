"""Every key of a shard, from one function (#17): one hash tag per shard and
prefix, so a shard's scripts are single-slot on a Redis Cluster."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from celery_sched.rediskeys import (
    key_patterns,
    legacy_lease_key,
    legacy_staging_key,
    shard_keys,
)


def test_layout() -> None:
    keys = shard_keys("celery_sched", 3)
    assert (keys.lease, keys.staging, keys.leader) == (
        "{celery_sched:3}:lease",
        "{celery_sched:3}:staging",
        "{celery_sched:3}:leader",
    )
    # What beats before hash tags used (and hold during an upgrade).
    assert legacy_lease_key("celery_sched", 3) == "celery_sched:lease:3"
    assert legacy_staging_key("celery_sched", 3) == "celery_sched:staging:3"


def test_a_shards_keys_share_a_slot_and_shards_and_prefixes_spread() -> None:
    for shard in range(8):
        keys = shard_keys("celery_sched", shard)
        assert len({key_slot(k.encode()) for k in (keys.lease, keys.staging, keys.leader)}) == 1
    slots = {key_slot(shard_keys("celery_sched", shard).lease.encode()) for shard in range(8)}
    assert len(slots) == 8
    # The prefix is inside the tag: shard 0 of two deployments hash apart.
    assert key_slot(shard_keys("a", 0).lease.encode()) != key_slot(
        shard_keys("b", 0).lease.encode()
    )


def test_patterns_cover_new_and_legacy_keys() -> None:
    import fnmatch

    patterns = key_patterns("p")
    for key in (*vars(shard_keys("p", 2)).values(), legacy_lease_key("p", 2)):
        assert any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)
    assert not any(fnmatch.fnmatchcase("px:lease:2", pattern) for pattern in patterns)


@pytest.mark.parametrize(("prefix", "shard"), [("", 0), ("a{b", 0), ("a}b", 0), ("p", -1)])
def test_bad_prefix_or_shard_is_refused(prefix: str, shard: int) -> None:
    with pytest.raises(ValueError):
        shard_keys(prefix, shard)
