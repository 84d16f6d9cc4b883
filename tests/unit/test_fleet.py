"""Beats sharing the shards (:class:`celery_sched.leader.fleet.Fleet`) on
in-memory fakes with one fake clock: engines, leases and the membership.

The test drives every beat in small steps of fake time, doing what the
threads of a real beat do (heartbeats, lease renewals) at their period, and
checks the guarantees at every step.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest

from celery_sched.dispatch.memory import MemoryDispatcher
from celery_sched.leader import Engine, EngineStats
from celery_sched.leader.balancing import cap
from celery_sched.leader.fleet import Fleet
from celery_sched.lease.elector import LeaderElector
from celery_sched.lease.memory import MemoryLeaderBoard, MemoryLeaseBackend, MemoryMembership
from celery_sched.models import election_count
from celery_sched.settings import Settings
from celery_sched.staging.memory import MemoryStaging
from celery_sched.store.memory import MemoryJobStore
from tests.unit.test_engine import Clock

TTL = 3.0
SHARDS = 16
STEP = 0.1


class DrivenEngine(Engine):
    """An engine whose lease thread the test plays (no real thread)."""

    def start(self) -> None:
        self.elector.try_acquire()

    def stop(self) -> None:
        self.elector.release()
        self._epoch = None


@dataclasses.dataclass
class Beat:
    fleet: Fleet
    alive: bool = True
    next_tick: float = 0.0


class World:
    def __init__(self, shards: int = SHARDS) -> None:
        self.clock = Clock()
        self.shards = shards
        self.settings = Settings(
            lease_ttl=TTL, lease_safety_margin=0.3, shards=shards, batch_size=50
        )
        self.store = MemoryJobStore(clock=self.clock.wall)
        self.staging = MemoryStaging()
        self.lease = MemoryLeaseBackend(clock=self.clock.mono)
        self.membership = MemoryMembership(clock=self.clock.mono)
        self.board = MemoryLeaderBoard(self.lease)
        self.beats: dict[str, Beat] = {}
        # shard -> fake time at which it last had a leader
        self.last_led: dict[int, float] = {}
        self.longest_gap: dict[int, float] = Counter()

    def beat(self, name: str, pinned: int | None = None) -> Beat:
        settings = self.settings if pinned is None else self.settings.for_shard(pinned)

        def make_engine(shard: int, stats: EngineStats) -> Engine:
            one = settings.for_shard(shard)
            return DrivenEngine(
                store=self.store,
                staging=self.staging,
                dispatcher=MemoryDispatcher(),
                elector=LeaderElector(
                    self.lease,
                    shard=shard,
                    ttl=TTL,
                    safety_margin=one.lease_safety_margin,
                    acquire_epoch=self.store.acquire_epoch,
                    holder=name,
                    clock=self.clock.mono,
                ),
                settings=one,
                clock=self.clock.mono,
                wall=self.clock.wall,
                stats=stats,
            )

        fleet = Fleet(
            make_engine=make_engine,
            shards=self.shards,
            pinned=pinned,
            membership=None if pinned is not None else self.membership,
            # host:pid (the lease holder) then a part of its own, as beats do
            beat_id=f"{name}:1",
            leaders=lambda shards: {v.shard: v.holder for v in self.board.read(range(shards))},
            ttl=TTL,
            clock=self.clock.mono,
            background=False,
        )
        fleet.start()
        beat = Beat(fleet, next_tick=self.clock.mono() + fleet.interval)
        self.beats[name] = beat
        return beat

    def leaders(self) -> dict[int, list[str]]:
        found: dict[int, list[str]] = {s: [] for s in range(self.shards)}
        for name, beat in self.beats.items():
            if not beat.alive:
                continue
            for shard, engine in beat.fleet.engines.items():
                if engine.elector.is_leader():
                    found[shard].append(name)
        return found

    def run(self, seconds: float) -> None:
        """Drive every live beat for ``seconds`` of fake time, checking at
        every step that no shard has two leaders."""
        end = self.clock.offset + seconds
        while self.clock.offset < end:
            now = self.clock.mono()
            for beat in self.beats.values():
                if not beat.alive:
                    continue
                if now >= beat.next_tick:
                    # What the heartbeat and lease threads do every ttl/3.
                    beat.fleet.heartbeat()
                    for engine in beat.fleet.engines.values():
                        if engine.elector.current() is not None:
                            engine.elector.renew()
                        else:
                            engine.elector.try_acquire()
                    beat.next_tick = now + beat.fleet.interval
                beat.fleet.step()
            leaders = self.leaders()
            for shard, names in leaders.items():
                assert len(names) <= 1, f"shard {shard} has two leaders: {names}"
                if names:
                    previous = self.last_led.get(shard)
                    if previous is not None:
                        self.longest_gap[shard] = max(self.longest_gap[shard], now - previous)
                    self.last_led[shard] = now
            self.clock.advance(STEP)

    def spread(self) -> dict[str, int]:
        led = Counter(names[0] for names in self.leaders().values() if names)
        return {name: led.get(name, 0) for name, beat in self.beats.items() if beat.alive}

    def kill(self, name: str) -> None:
        """kill -9: the beat stops at once, releasing nothing."""
        self.beats[name].alive = False


def led_by_one(world: World) -> bool:
    return all(len(names) == 1 for names in world.leaders().values())


def test_three_beats_share_sixteen_shards_evenly() -> None:
    world = World()
    for name in ("a", "b", "c"):
        world.beat(name)
    world.run(2 * TTL)
    assert led_by_one(world)
    counts = sorted(world.spread().values())
    assert counts == [5, 5, 6]
    assert max(counts) <= cap(SHARDS, 3)


def test_a_beat_joining_takes_its_share_with_short_handovers() -> None:
    world = World()
    for name in ("a", "b", "c"):
        world.beat(name)
    world.run(2 * TTL)
    world.longest_gap.clear()
    world.beat("d")
    world.run(2 * TTL)
    assert led_by_one(world)
    assert sorted(world.spread().values()) == [4, 4, 4, 4]
    # A moved shard went unled for less than one ttl (released cleanly, then
    # won at the newcomer's next attempt).
    assert max(world.longest_gap.values()) < TTL
    # Nobody was fenced: every shard that moved was released, not stolen.
    assert all(
        engine.stats.step_downs == 0
        for beat in world.beats.values()
        for engine in beat.fleet.all_engines()
    )


def test_a_killed_beats_shards_are_led_again_within_ttl_and_the_spread_evens_out() -> None:
    world = World()
    for name in ("a", "b", "c"):
        world.beat(name)
    world.run(2 * TTL)
    orphans = {s for s, names in world.leaders().items() if names == ["c"]}
    assert orphans
    world.kill("c")
    killed_at = world.clock.mono()
    back: dict[int, float] = {}
    while len(back) < len(orphans) and world.clock.mono() - killed_at < 3 * TTL:
        world.run(STEP)
        for shard in orphans - set(back):
            if world.leaders()[shard]:
                back[shard] = world.clock.mono() - killed_at
    assert set(back) == orphans
    # The listing and the lease run out after one ttl; the next balancing
    # (every ttl/3) hands the shards on and the elector wins them at once.
    assert max(back.values()) <= TTL + TTL / 3 + 2 * STEP
    world.run(TTL)
    assert sorted(world.spread().values()) == [8, 8]
    # Restarted (a new process, a new id): the spread evens out again.
    world.beat("c2")
    world.run(2 * TTL)
    assert led_by_one(world)
    assert sorted(world.spread().values()) == [5, 5, 6]


def test_a_pinned_beat_runs_its_shard_only_and_is_not_counted() -> None:
    world = World(shards=4)
    pinned = world.beat("p", pinned=2)
    world.run(TTL)
    assert set(pinned.fleet.engines) == {2}
    assert pinned.fleet.live_beats() is None
    assert world.membership.heartbeat("probe:1", TTL) == ["probe:1"]


def test_without_the_membership_a_beat_keeps_what_it_runs() -> None:
    world = World(shards=4)
    world.beat("a")
    world.beat("b")
    world.run(2 * TTL)
    before = {name: set(beat.fleet.engines) for name, beat in world.beats.items()}
    world.membership.available = False
    world.run(2 * TTL)
    assert {name: set(beat.fleet.engines) for name, beat in world.beats.items()} == before
    assert led_by_one(world)


def test_stopping_a_fleet_releases_its_leases_and_leaves() -> None:
    world = World(shards=4)
    a = world.beat("a")
    world.beat("b")
    world.run(2 * TTL)
    a.fleet.stop()
    a.alive = False
    # Released at once: b takes a's shards at its next balancing and
    # attempt, well inside one ttl.
    world.run(TTL * 2 / 3 + 2 * STEP)
    assert world.leaders() == {s: ["b"] for s in range(4)}


def test_one_beat_leads_every_shard_and_a_standby_takes_over() -> None:
    world = World(shards=1)
    world.beat("a")
    world.beat("b")
    world.run(2 * TTL)
    (leader,) = world.leaders()[0]
    world.kill(leader)
    world.run(TTL + TTL / 3 + 2 * STEP)
    assert world.leaders()[0] == [({"a", "b"} - {leader}).pop()]


@pytest.mark.parametrize("bad", [{"pinned": None, "membership": None}])
def test_a_shared_fleet_needs_a_membership(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="membership"):
        Fleet(make_engine=lambda s, st: None, shards=2, beat_id="x", ttl=1.0, **bad)  # type: ignore[arg-type,return-value]


def test_the_metrics_of_a_fleet_show_every_shard_once() -> None:
    from celery_sched.metrics.beat import BeatCollector

    world = World(shards=4)
    a = world.beat("a")
    world.beat("b")
    world.run(2 * TTL)
    mine = set(a.fleet.leading())
    assert len(mine) == 2
    for engine in a.fleet.engines.values():
        engine.stats.published += 10 + engine.shard
        engine.stats.dispatch_lag.observe(0.01)
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in BeatCollector(a.fleet).collect()
        for sample in family.samples
    }
    # The leader gauge names every shard the beat could lead.
    assert {
        int(dict(labels)["shard"]): value
        for (name, labels), value in samples.items()
        if name == "celery_sched_leader"
    } == {s: float(s in mine) for s in range(4)}
    dispatched = {
        int(dict(labels)["shard"]): value
        for (name, labels), value in samples.items()
        if name == "celery_sched_dispatched_total"
    }
    # Shards led before b joined keep their (retired) counters.
    assert {s: dispatched[s] for s in mine} == {s: 10.0 + s for s in mine}
    assert set(dispatched) == {0, 1, 2, 3}
    # One histogram for the process, summing the shards'.
    assert samples[("celery_sched_dispatch_lag_seconds_count", ())] == 2


def test_a_standby_joining_does_not_move_a_led_shard() -> None:
    world = World(shards=1)
    world.beat("a")
    world.run(TTL)
    assert world.leaders()[0] == ["a"]
    for name in ("b", "c", "d"):
        world.beat(name)
    world.run(3 * TTL)
    assert world.leaders()[0] == ["a"]
    assert election_count(world.store.current_epoch(0)) == 1  # never handed over
