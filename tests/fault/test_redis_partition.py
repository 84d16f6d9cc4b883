"""A network partition between the leading beat and Redis, PostgreSQL still reachable.

The lease's Redis is a private ``redis-server`` listening on three loopback
addresses; each beat reaches it through one of its own, and iptables drops
every packet to and from the leader's (``tests/netfault.py``), so the other
beat, the workers and the client keep their connections. The partitioned
leader must stop claiming once its lease runs out locally, the other beat
takes over, no job is lost or run twice (``celery_sched.Task``), and once
the partition heals the old leader is a working standby again: it takes
over when the new leader dies.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_sched.settings import Settings
from tests.e2e.harness import RedisServer, wait_for
from tests.fault.conftest import ScheduleStream
from tests.netfault import Partition, iptables_missing

pytestmark = pytest.mark.slow

#: The beats' own addresses of the lease Redis; the client uses 127.0.0.1.
BEAT_ADDRESSES = ("127.0.0.2", "127.0.0.3")


@pytest.fixture
def lease_redis(tmp_path: Path) -> Iterator[RedisServer]:
    problem = iptables_missing()
    if problem is not None:
        pytest.fail(f"cannot partition: {problem}")
    server = RedisServer("redis-lease", tmp_path, binds=("127.0.0.1", *BEAT_ADDRESSES))
    server.start()
    yield server
    server.stop()


def test_leader_cut_off_from_redis_is_replaced_and_rejoins_after_healing(
    lease_redis: RedisServer, redis_url: str, make_effect_cluster: Any, e2e_settings: Settings
) -> None:
    settings = dataclasses.replace(e2e_settings, redis_url=lease_redis.url, visibility_timeout=20.0)
    cluster = make_effect_cluster(redis_url, settings)  # the broker is the shared Redis
    cluster.start_worker("worker1", concurrency=4)
    address_of = {}
    for n, address in enumerate(BEAT_ADDRESSES, 1):
        beat = cluster.start_beat(f"beat{n}", CELERY_SCHED_REDIS_URL=lease_redis.url_at(address))
        address_of[beat.pid] = address
    old_epoch, _holder = wait_for(cluster.leader, timeout=30, what="a leader")
    cut_off = cluster.leader_proc()
    assert cut_off is not None
    stream = ScheduleStream(cluster, "part").start()
    try:
        time.sleep(2)
        partition = Partition(address_of[cut_off.pid], lease_redis.port)
        try:
            partition.cut()
            cut_at = time.monotonic()
            cut_wall = time.time()
            new_epoch, _ = wait_for(
                lambda: (cluster.leader() or (old_epoch,))[0] > old_epoch and cluster.leader(),
                timeout=30,
                interval=0.1,
                what="the other beat to take over",
            )
            takeover = time.monotonic() - cut_at
            successor = cluster.leader_proc()
            assert successor is not None and successor.pid != cut_off.pid
            # It notices on its own, without Redis: its lease ran out locally.
            wait_for(
                lambda: (
                    "lost leadership" in cut_off.output() or "stepping down" in cut_off.output()
                ),
                timeout=15,
                what="the partitioned leader to step down",
            )
            time.sleep(settings.lease_ttl)
        finally:
            partition.heal()
        time.sleep(3)
    finally:
        stream.stop()
    print(f"taken over {takeover:.2f}s after the cut (lease ttl {settings.lease_ttl}s)")
    assert takeover <= 2 * settings.lease_ttl + 2.0
    assert cut_off.alive(), "a partitioned beat must not exit"

    counts = cluster.wait_effects(stream.returned, timeout=60)
    assert {key: n for key, n in counts.items() if n > 1} == {}
    # Its lease ran out locally within a ttl of the cut (it was last renewed
    # before it), and it claimed nothing after that (the half second: a claim
    # committing as the deadline passed). The fence was not needed, but holds.
    late_claims = cluster.query(
        "SELECT count(*) FROM {s}.jobs WHERE leader_epoch = %s "
        "AND dispatched_at > to_timestamp(%s)",
        old_epoch,
        cut_wall + settings.lease_ttl + 0.5,
    )[0][0]
    assert late_claims == 0
    assert cluster.stale_claims() == 0

    # Healed, the old leader is a standby again: it takes over from a dead leader.
    successor.signal(signal.SIGKILL)
    wait_for(
        lambda: (
            (cluster.leader() or (new_epoch,))[0] > new_epoch and cluster.leader_proc() is cut_off
        ),
        timeout=30,
        interval=0.1,
        what="the healed beat to lead again",
    )
