"""Identical beats share the shards (issue 17): three real beats, sixteen
shards, real Celery workers, jobs flowing throughout.

Who leads what is read from each beat's own ``celery_sched_leader{shard}``
gauge, so the test sees what every beat *believes*, not only what Redis
says. A sampling round scrapes the beats in one order and then in the
reverse one: a handover (one beat stops, then another starts) can look like
two leaders in one of the two sweeps, never in both, while a real overlap
longer than a round shows in both.
"""

from __future__ import annotations

import collections
import dataclasses
import signal
import threading
import time
from typing import Any

import pytest

from celery_sched.settings import Settings
from tests.e2e.conftest import client_for, spread_jobs
from tests.e2e.harness import Cluster, Proc, free_port, wait_for
from tests.e2e.test_reshard_e2e import assert_every_job_ran_once
from tests.integration.test_metrics_beat import get

pytestmark = pytest.mark.slow

SHARDS = 16


def led_by(port: int) -> set[int] | None:
    """The shards the beat on ``port`` says it leads (``None``: not answering)."""
    status, text = get(f"http://127.0.0.1:{port}/metrics")
    if status != 200:
        return None
    shards = set()
    for line in text.splitlines():
        if line.startswith("celery_sched_leader{") and line.endswith(" 1.0"):
            shards.add(int(line.split('shard="', 1)[1].split('"', 1)[0]))
    return shards


class Monitor:
    """Samples every beat's leadership in the background."""

    def __init__(self, ports: dict[str, int]) -> None:
        self.ports = ports
        self.rounds: list[tuple[float, dict[str, set[int]], dict[str, set[int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sweep(self, names: list[str]) -> dict[str, set[int]]:
        seen = {}
        for name in names:
            shards = led_by(self.ports[name])  # (ports only grow)
            if shards is not None:
                seen[name] = shards
        return seen

    def _run(self) -> None:
        while not self._stop.is_set():
            names = sorted(list(self.ports))
            forward = self._sweep(names)
            backward = self._sweep(names[::-1])
            self.rounds.append((time.monotonic(), forward, backward))
            self._stop.wait(0.1)

    def start(self) -> Monitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def double_leaders(self) -> list[tuple[float, int, list[str]]]:
        """(when, shard, beats) where two beats led one shard in both sweeps."""
        found = []
        for at, forward, backward in self.rounds:
            for shard in range(SHARDS):
                one = [n for n, s in forward.items() if shard in s]
                other = [n for n, s in backward.items() if shard in s]
                if len(one) > 1 and len(other) > 1:
                    found.append((at, shard, one))
        return found

    def longest_gaps(self, since: float, until: float) -> dict[int, float]:
        """Per shard, the longest run of rounds in [since, until] in which no
        beat said it led the shard in either sweep."""
        gaps: dict[int, float] = collections.defaultdict(float)
        last_led: dict[int, float] = {}
        for at, forward, backward in self.rounds:
            if not since <= at <= until:
                continue
            for shard in range(SHARDS):
                led = any(shard in s for s in (*forward.values(), *backward.values()))
                if led:
                    start = last_led.get(shard, at)
                    gaps[shard] = max(gaps[shard], at - start)
                    last_led[shard] = at
        return dict(gaps)


def spread(ports: dict[str, int]) -> dict[str, int]:
    counts = {}
    for name, port in list(ports.items()):
        shards = led_by(port)
        if shards is not None:
            counts[name] = len(shards)
    return counts


def all_led_evenly(ports: dict[str, int], beats: int) -> bool:
    counts = spread(ports)
    return (
        len(counts) == beats
        and sum(counts.values()) == SHARDS
        and max(counts.values()) - min(counts.values()) <= 1
    )


def start_beat(cluster: Cluster, name: str, ports: dict[str, int]) -> Proc:
    ports[name] = free_port()
    return cluster.start_beat(
        name,
        CELERY_SCHED_SHARDS=str(SHARDS),
        CELERY_SCHED_METRICS_PORT=str(ports[name]),
    )


def test_three_beats_share_sixteen_shards_and_a_killed_one_is_covered(
    redis_url: str, make_cluster: Any, e2e_settings: Settings
) -> None:
    # A short visibility timeout lets the reconciler requeue, within the
    # test, what the killed beat had claimed but not published.
    settings = dataclasses.replace(e2e_settings, shards=SHARDS, visibility_timeout=8.0)
    ttl = settings.lease_ttl
    cluster = make_cluster(redis_url, settings)
    cluster.start_worker(concurrency=8)
    ports: dict[str, int] = {}
    start_beat(cluster, "a", ports)
    wait_for(lambda: spread(ports) == {"a": SHARDS}, timeout=40, what="a to lead every shard")

    jobs = spread_jobs(1600, time.time() + 1, 45, tag="flow")
    assert client_for(settings).schedule_many(jobs) == len(jobs)
    monitor = Monitor(ports).start()
    try:
        joins_from = time.monotonic()
        start_beat(cluster, "b", ports)
        wait_for(lambda: all_led_evenly(ports, 2), timeout=30, what="a and b to share")
        start_beat(cluster, "c", ports)
        wait_for(lambda: all_led_evenly(ports, 3), timeout=30, what="a, b and c to share")
        joins_until = time.monotonic()
        assert sorted(spread(ports).values()) == [5, 5, 6]

        victim = next(p for p in cluster.procs if p.name == "c")
        orphans = led_by(ports["c"])
        assert orphans
        victim.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(
            lambda: orphans <= set().union(*(led_by(ports[n]) or set() for n in ("a", "b"))),
            timeout=ttl + 10,
            interval=0.05,
            what="the killed beat's shards to be led again",
        )
        covered_after = time.monotonic() - killed_at
        print(f"shards of the killed beat led again after {covered_after:.2f}s (ttl {ttl}s)")
        assert covered_after <= ttl + 5
        wait_for(lambda: all_led_evenly(ports, 2), timeout=30, what="a and b to share again")

        rejoin_from = time.monotonic()
        start_beat(cluster, "c2", ports)
        wait_for(lambda: all_led_evenly(ports, 3), timeout=30, what="the spread to even out")
        rejoin_until = time.monotonic()
        assert sorted(spread(ports).values()) == [5, 5, 6]
    finally:
        monitor.stop()

    assert monitor.double_leaders() == []
    # Shards handed over when a beat joined went unled for less than a ttl.
    for since, until in ((joins_from, joins_until), (rejoin_from, rejoin_until)):
        gaps = monitor.longest_gaps(since, until)
        assert len(gaps) == SHARDS
        assert max(gaps.values()) < ttl, gaps
    # Handovers were clean releases: no beat was fenced off a shard.
    for proc in cluster.procs:
        if proc.name in ("a", "b", "c2"):
            assert "stepping down" not in proc.output(), proc.tail(3000)
            assert "StaleEpoch" not in proc.output()

    keys = {job["key"] for job in jobs}
    wait_for(lambda: cluster.run_count() >= len(keys), timeout=90, what="every job to run")
    time.sleep(1)  # a duplicate would show up now
    assert_every_job_ran_once(cluster, keys)
    # Every shard dispatched some of them, under epochs of more than one beat.
    per_shard = dict(cluster.query("SELECT shard, count(*) FROM {s}.jobs GROUP BY shard"))
    assert sorted(per_shard) == list(range(SHARDS))
