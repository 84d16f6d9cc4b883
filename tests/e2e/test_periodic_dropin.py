"""Drop-in: an existing project's periodic tasks under ``celery beat -S celery_sched``.

``tests/e2e/periodic_app.py`` declares interval (seconds, timedelta,
``schedule``, ``add_periodic_task``), crontab, solar and clocked entries in
``beat_schedule`` plus two decorator-declared tasks. Two real beat processes
and a real worker run it; the leader is killed with SIGKILL halfway. Every
occurrence due before the end must have run exactly once, on the nominal
grid: none lost, none duplicated.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import signal
import statistics
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from celery.schedules import solar

from celery_sched import schedules
from celery_sched.settings import Settings
from tests.e2e.harness import Cluster, Proc, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.e2e.periodic_app"
INTERVALS = {
    "every-second": 1.0,
    "two-seconds": 2.0,
    "added-3s": 3.0,
    "periodic.decorated_interval": 2.0,
}
MINUTELY = ("cron-minute", "decorated-cron")


class PeriodicCluster(Cluster):
    """The harness's cluster, running the periodic project instead of ``tests.e2e.app``."""

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        return super()._spawn(name, [APP if arg == "tests.e2e.app" else arg for arg in args], env)


def solar_noon_longitude(target: dt.datetime) -> float:
    """A longitude (on the equator) where the sun transits at ``target``, to the second,
    found with the schedule module itself (a few Newton steps)."""
    app = Celery("probe", set_as_current=False)
    hours = target.hour + target.minute / 60 + target.second / 3600
    lon = (12 - hours) * 15
    for _ in range(8):
        lon = (lon + 180) % 360 - 180
        spec = schedules.make_spec("probe", "x", solar("solar_noon", 0.0, lon), app=app)
        event = schedules.next_after(spec, target - dt.timedelta(hours=12))
        assert event is not None
        error = (event - target).total_seconds()
        if abs(error) <= 1:
            break
        lon += error * 360 / 86_400  # east of here the sun transits earlier
    return lon


@pytest.fixture
def cluster(tmp_path: Path, e2e_settings: Settings, redis_url: str) -> Iterator[PeriodicCluster]:
    from celery_sched.backends import build_store

    # A job claimed by the killed leader but not published comes back after
    # the visibility timeout; keep it well inside the test.
    # A takeover (lease_ttl 2 s) stays well inside the misfire grace on a
    # loaded machine too, so every occurrence across the failover is owed a
    # run; a longer gap follows the misfire policy (tests/unit/test_misfire_dispatch.py).
    settings = dataclasses.replace(e2e_settings, visibility_timeout=10.0, misfire_grace=30.0)
    store = build_store(settings)
    store.migrate()
    store.close()
    start = dt.datetime.now(dt.UTC).replace(microsecond=0)
    clocked_at = start + dt.timedelta(seconds=25)
    noon_at = start + dt.timedelta(seconds=40)
    built = PeriodicCluster(
        tmp_path=tmp_path,
        settings=settings,
        broker_url=redis_url,
        queue="q_" + uuid.uuid4().hex[:10],
        extra_env={
            "E2E_CLOCKED_AT": clocked_at.isoformat(),
            "E2E_SOLAR_LON": repr(solar_noon_longitude(noon_at)),
        },
    )
    built.clocked_at = clocked_at  # type: ignore[attr-defined]
    yield built
    built.stop_all()
    print(built.dump_logs())  # shown only when the test failed


def unfinished_before(cluster: Cluster, cutoff: float) -> int:
    rows = cluster.query(
        "SELECT count(*) FROM {s}.jobs WHERE schedule_id IS NOT NULL "
        "AND due_at <= to_timestamp(%s) "
        "AND status NOT IN ('succeeded', 'failed', 'dead', 'expired', 'cancelled')",
        cutoff,
    )
    return int(rows[0][0])


def test_periodic_dropin_survives_leader_kill(cluster: PeriodicCluster) -> None:
    cluster.start_worker(concurrency=8)
    beats = [cluster.start_beat("beat-a"), cluster.start_beat("beat-b")]
    leader = wait_for(cluster.leader_proc, timeout=45, what="a leader")
    wait_for(lambda: cluster.run_count() >= 5, timeout=45, what="periodic tasks running")
    time.sleep(12)

    killed_at = time.time()
    leader.signal(signal.SIGKILL)
    leader.popen.wait(10)
    survivor = wait_for(
        lambda: (proc := cluster.leader_proc()) is not None and proc is not leader and proc,
        timeout=30,
        what="the other beat taking over",
    )
    assert survivor in beats
    # Long enough after the first sync that a minute boundary lies inside.
    [(synced,)] = cluster.query("SELECT extract(epoch FROM min(created_at)) FROM {s}.schedules")
    synced = float(synced)
    time.sleep(max(25.0, synced + 64 - time.time()))
    cutoff = time.time() - 3
    wait_for(
        lambda: unfinished_before(cluster, cutoff) == 0,
        timeout=60,
        what="every occurrence due before the cutoff to finish",
    )

    jobs = cluster.query(
        "SELECT j.key, s.name, extract(epoch FROM j.due_at), j.status, j.leader_epoch "
        "FROM {s}.jobs j JOIN {s}.schedules s ON s.id = j.schedule_id "
        "WHERE j.due_at <= to_timestamp(%s)",
        cutoff,
    )
    created = {
        str(name): float(at)
        for name, at in cluster.query(
            "SELECT name, extract(epoch FROM created_at) FROM {s}.schedules"
        )
    }
    runs = cluster.query("SELECT job_key, tag, due, ran FROM {s}.e2e_runs")
    run_counts = Counter(str(row[0]) for row in runs)

    # None duplicated: each occurrence ran once; every run was an occurrence.
    duplicated = {key: n for key, n in run_counts.items() if n > 1}
    assert duplicated == {}
    assert all("@" in key for key in run_counts)
    # None lost: every occurrence due before the cutoff succeeded and ran.
    assert {str(row[3]) for row in jobs} == {"succeeded"}
    assert {str(row[0]) for row in jobs} <= set(run_counts)

    by_schedule: dict[str, list[float]] = defaultdict(list)
    for _key, name, due, _status, _epoch in jobs:
        by_schedule[str(name)].append(float(due))
    # The nominal grid, with no gap across the failover.
    for name, every in INTERVALS.items():
        dues = sorted(by_schedule[name])
        assert dues, name
        assert dues[0] < killed_at - 5 and dues[-1] > cutoff - every - 1, name
        steps = {round(b - a, 6) for a, b in itertools.pairwise(dues)}
        assert steps == {every}, (name, steps)
    for name in MINUTELY:
        # Every minute boundary after the schedule was stored, none skipped.
        first = (int(created[name]) // 60 + 1) * 60
        expected = [float(m) for m in range(first, int(cutoff) + 1, 60)]
        assert expected, (name, created[name], cutoff)
        assert sorted(by_schedule[name]) == expected, name
    clocked_at: dt.datetime = cluster.clocked_at  # type: ignore[attr-defined]
    assert by_schedule["clocked-once"] == [clocked_at.timestamp()]
    [noon] = by_schedule["solar-noon"]
    assert abs(noon - (clocked_at.timestamp() + 15)) <= 2

    # Both leaders dispatched occurrences.
    assert len({row[4] for row in jobs}) >= 2
    # Outside the failover, occurrences ran close to their nominal time.
    lags = [
        float(ran) - float(due)
        for _key, _tag, due, ran in runs
        if due is not None and not killed_at - 2 <= float(due) <= killed_at + 8
    ]
    assert statistics.median(lags) < 1.5, statistics.median(lags)
