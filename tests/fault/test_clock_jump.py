"""The leading beat's wall clock jumps an hour forward, then back.

The leader runs under libfaketime (``tests/faketime.py``): its wall clock
moves, its monotonic clock does not, as with a clock step on its host.
Postgres ``now()`` decides due-ness and Redis the lease's expiry, so
nothing may change: no job or periodic occurrence is sent early or late
beyond bounds, none is skipped or run twice (``celery_sched.Task``), and
leadership is never shared (no claim under an epoch no longer current).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import re
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from celery_sched.client import Client
from celery_sched.settings import Settings
from tests.e2e import task_app
from tests.e2e.harness import wait_for
from tests.faketime import FakeClock, faketime_missing

pytestmark = pytest.mark.slow

JUMP = 3600
#: How late a job may start after it is due (a loaded 2-core machine).
LATE_BOUND = 3.0


def _log_hours(output: str) -> set[int]:
    """The hours of the log lines' timestamps (its wall clock)."""
    return {int(h) for h in re.findall(r"^\[\d{4}-\d\d-\d\d (\d\d):", output, re.MULTILINE)}


def test_leader_clock_jumping_an_hour_forward_and_back_changes_nothing(
    tmp_path: Path, redis_url: str, make_effect_cluster: Any, e2e_settings: Settings
) -> None:
    problem = faketime_missing()
    if problem is not None:
        pytest.fail(problem)
    clock = FakeClock(tmp_path)
    settings = dataclasses.replace(e2e_settings, visibility_timeout=30.0)
    cluster = make_effect_cluster(redis_url, settings, extra_env={"E2E_EVERY_SECOND": "1"})
    cluster.start_worker("worker1", concurrency=4)
    # DEBUG: celery beat logs each wake-up, which shows its clock.
    jumper = cluster.start_beat("beat1", args=["--loglevel=DEBUG"], **clock.env())
    first_epoch, _ = wait_for(cluster.leader, timeout=30, what="a leader")
    assert cluster.leader_proc() is jumper
    cluster.start_beat("beat2")
    # The whole path works (a periodic occurrence ran) before anything is
    # timed: a worker still starting would make the first jobs late.
    wait_for(
        lambda: any(key.startswith("every-second@") for key in cluster.effects()),
        timeout=30,
        what="the first periodic occurrence to run",
    )

    start = time.time() + 2
    keys = [f"jump-{n:03d}" for n in range(120)]
    with Client(task_app.app, settings=settings) as client:
        client.schedule_many(
            {
                "task": "tasks.effect",
                "args": [key],
                "key": key,
                "queue": cluster.queue,
                "eta": dt.datetime.fromtimestamp(start + n * 0.2, dt.UTC),
            }
            for n, key in enumerate(keys)
        )
    time.sleep(6)
    jumped_at = time.time()
    clock.shift(JUMP)
    time.sleep(8)
    back_at = time.time()
    clock.shift(0)
    time.sleep(10)
    real_hour = dt.datetime.fromtimestamp(jumped_at).hour
    assert (real_hour + 1) % 24 in _log_hours(jumper.output()), "the clock never jumped"

    counts = cluster.wait_effects(keys, timeout=30)
    assert {key: n for key, n in counts.items() if n > 1} == {}
    with psycopg.connect(cluster.evidence_dsn, autocommit=True) as conn:
        first_start = dict(
            conn.execute(
                f'SELECT key, min("at") FROM "{cluster.schema}".deliveries GROUP BY key'
            ).fetchall()
        )
    due = {
        str(key): float(at)
        for key, at in cluster.query(
            "SELECT key, extract(epoch FROM due_at) FROM {s}.jobs "
            "WHERE due_at BETWEEN to_timestamp(%s) AND to_timestamp(%s) AND key IS NOT NULL",
            start - 1,
            back_at + 8,
        )
    }
    lags = {key: first_start[key] - due[key] for key in due if key in first_start}
    print(f"lag: min {min(lags.values()):.3f}s, max {max(lags.values()):.3f}s over {len(lags)}")
    # Never early (the worker's clock is the real one, Postgres's too), never
    # much late, one-off and periodic alike.
    assert set(due) - set(lags) <= {key for key in due if due[key] > time.time() - 2}
    assert min(lags.values()) >= -0.05, sorted(lags.items(), key=lambda item: item[1])[:5]
    assert max(lags.values()) <= LATE_BOUND, sorted(lags.items(), key=lambda item: -item[1])[:5]

    # The periodic schedule: one occurrence per second through both jumps,
    # none skipped, none doubled, each run once.
    instants = sorted(
        due[key] for key in due if key.startswith("every-second@") and due[key] < back_at + 6
    )
    assert instants[0] <= jumped_at - 3 and instants[-1] >= back_at + 3
    steps = {round(b - a, 3) for a, b in itertools.pairwise(instants)}
    assert steps == {1.0}, steps
    assert all(counts[key] == 1 for key in due if key.startswith("every-second@"))

    # Leadership: the jumper kept it or handed it over; never two at once.
    assert cluster.stale_claims() == 0
    epochs = cluster.query(
        "SELECT DISTINCT leader_epoch FROM {s}.jobs WHERE dispatched_at IS NOT NULL"
    )
    print(f"epochs {first_epoch} -> {cluster.leader()}, claims under {sorted(epochs)}")
    assert jumper.alive()
