"""Redis Cluster failover: kill -9 the master of shard 0's slot; time until the shard is led again.

Per run: a Redis Cluster of three masters with a replica each on loopback
ports (``tests/redis_topologies.py``, ``cluster-node-timeout`` 2000 ms), two
real ``celery beat -S celery_sched`` processes on it (lease TTL
``--lease-ttl``, default 10 s, the setting's default), the broker the
machine's ordinary Redis. Once a beat leads, the master holding the slot of
shard 0's keys gets SIGKILL, at a random point of a lease renewal period
(``ttl / 3``). Reported per run: seconds from the kill until
the Cluster serves the slot from the promoted replica (``CLUSTER SLOTS``,
polled every 20 ms) and until a beat holds the shard under a new epoch (the
``leaders`` row in PostgreSQL, polled every 20 ms); ``--runs`` runs (default
3), medians.

    .venv/bin/python benchmarks/redis_failover.py [--runs 3] [--lease-ttl 10]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import Run, emit, load_avg, median_of, progress, rounded
from legacy_app import app
from redis.crc import key_slot

from celery_sched.client import Client
from celery_sched.rediskeys import shard_keys
from tests.e2e.harness import wait_for
from tests.redis_topologies import NODE_TIMEOUT_MS, ClusterSet


def run_once(ns: argparse.Namespace, index: int) -> dict[str, Any]:
    topology = ClusterSet(Path(tempfile.mkdtemp(prefix="redis_failover_")), replicas=1)
    try:
        topology.start()
        return _measure(ns, index, topology)
    finally:
        topology.stop()


def _measure(ns: argparse.Namespace, index: int, topology: ClusterSet) -> dict[str, Any]:
    run = Run("redis_failover", broker="redis", lease_ttl=ns.lease_ttl)
    try:
        with Client(app, settings=run.settings) as client:
            client.migrate()
        slot = key_slot(shard_keys(run.name, 0).lease.encode())
        master = topology.port_of_slot(slot)
        replica = topology.replica_of(master)
        beats = [
            run.start_beat(name, CELERY_SCHED_REDIS_URL=topology.url)
            for name in ("beat-a", "beat-b")
        ]
        old = wait_for(run.leader, timeout=60, interval=0.05, what="a leader")
        # At a random point of a renewal period: the beats' lease threads
        # act every ttl/3, so when the kill falls in that period matters.
        time.sleep(1.0 + random.uniform(0, ns.lease_ttl / 3))
        old = run.leader() or old
        topology.kill(master)
        killed_at = time.monotonic()
        promoted_s: float | None = None
        led_s: float | None = None
        deadline = killed_at + 120
        while (promoted_s is None or led_s is None) and time.monotonic() < deadline:
            now = time.monotonic()
            if promoted_s is None:
                try:
                    if topology.port_of_slot(slot) == replica:
                        promoted_s = now - killed_at
                except Exception:  # a node busy failing over: poll again
                    pass
            current = run.leader()
            if led_s is None and current is not None and current[0] > old[0]:
                led_s = now - killed_at
            time.sleep(0.02)
        alive = all(beat.alive() for beat in beats)
        result = {
            "promoted_s": rounded(promoted_s, 3),
            "led_again_s": rounded(led_s, 3),
            "old_epoch": old[0],
            "new_epoch": (run.leader() or (None,))[0],
            "beats_alive": alive,
        }
        progress("run %d: %s", index, result)
        return result
    finally:
        run.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--lease-ttl", type=float, default=10.0)
    ns = parser.parse_args()

    load_start = load_avg()
    runs = [run_once(ns, i + 1) for i in range(ns.runs)]

    def med(name: str) -> float | None:
        return median_of(runs, name, 3)

    emit(
        {
            "benchmark": "redis_failover",
            "topology": "Redis Cluster, 3 masters + 1 replica each, loopback",
            "cluster_node_timeout_ms": NODE_TIMEOUT_MS,
            "lease_ttl": ns.lease_ttl,
            "runs": runs,
            "promoted_s": med("promoted_s"),
            "led_again_s": med("led_again_s"),
            "beats_alive": all(r["beats_alive"] for r in runs),
            "load_avg_1m_start": load_start,
            "load_avg_1m_end": load_avg(),
        }
    )


if __name__ == "__main__":
    main()
