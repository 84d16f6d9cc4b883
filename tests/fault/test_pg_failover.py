"""PostgreSQL fails over to its promoted streaming replica under real beats and workers.

Each test starts its own primary and hot standby (``tests/pg_cluster.py``);
the beats, the workers and the client reach whichever accepts writes
through one multi-host URL (``target_session_attrs=read-write``). The
primary is killed (``pg_ctl stop -m immediate``) and the standby promoted
while jobs are being scheduled, dispatched and run. The evidence of each
run is written to the shared test database, which no fault touches.

- Synchronous replication: every job whose ``schedule()`` returned runs,
  exactly once (``celery_sched.Task``).
- Asynchronous replication: the commits the standby had not received are
  lost; what the README promises still holds (every job committed before
  the standby replayed it runs; a job whose success the standby had
  replayed never runs again), and the loss is confined to that tail.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_sched.settings import Settings
from tests.e2e.harness import wait_for
from tests.fault.conftest import ScheduleStream
from tests.pg_cluster import PgError, PgPair, pg_pair

pytestmark = pytest.mark.slow


def _pair(synchronous: bool) -> Iterator[PgPair]:
    try:
        with pg_pair(synchronous=synchronous) as pair:
            yield pair
            print(pair.logs())
    except PgError as exc:
        pytest.fail(f"cannot start a PostgreSQL primary and standby: {exc}")


@pytest.fixture
def sync_pair() -> Iterator[PgPair]:
    yield from _pair(True)


@pytest.fixture
def async_pair() -> Iterator[PgPair]:
    yield from _pair(False)


def _on_pair(e2e_settings: Settings, pair: PgPair) -> Settings:
    # A short visibility timeout: messages published while the primary was
    # dying may be requeued within the test.
    return dataclasses.replace(
        e2e_settings, database_url=pair.database_url(), visibility_timeout=8.0
    )


def _start(make_effect_cluster: Any, redis_url: str, settings: Settings, evidence: str) -> Any:
    cluster = make_effect_cluster(redis_url, settings, evidence_dsn=evidence)
    cluster.start_worker("worker1", concurrency=4)
    cluster.start_worker("worker2", concurrency=4)
    cluster.start_beat("beat1")
    cluster.start_beat("beat2")
    wait_for(cluster.leader, timeout=30, what="a leader")
    return cluster


def _job_keys(cluster: Any, keys: list[str]) -> set[str]:
    rows = cluster.query("SELECT key FROM {s}.jobs WHERE key = ANY(%s)", keys)
    return {str(key) for (key,) in rows}


def test_synchronous_failover_runs_every_returned_job_exactly_once(
    sync_pair: PgPair, redis_url: str, make_effect_cluster: Any, e2e_settings: Settings
) -> None:
    settings = _on_pair(e2e_settings, sync_pair)
    cluster = _start(make_effect_cluster, redis_url, settings, e2e_settings.libpq_conninfo())
    stream = ScheduleStream(cluster, "sync").start()
    try:
        time.sleep(4)
        failed_at = time.monotonic()
        sync_pair.failover()
        print(f"promoted after {time.monotonic() - failed_at:.2f}s")
        time.sleep(5)
    finally:
        stream.stop()
    assert len(stream.returned) > 40, "the stream must have scheduled jobs around the failover"

    counts = cluster.wait_effects(stream.returned, timeout=60)
    twice = {key: n for key, n in counts.items() if n > 1}
    assert twice == {}, f"celery_sched.Task ran these twice: {twice}"
    # Every row that committed (a raising schedule() may have too) is run.
    committed = _job_keys(cluster, stream.returned + stream.failed)
    assert set(stream.returned) <= committed
    cluster.wait_effects(committed, timeout=30)
    print(f"{len(stream.returned)} returned, {len(stream.failed)} raised during the failover")


def test_asynchronous_failover_loses_only_the_unreplicated_tail(
    async_pair: PgPair, redis_url: str, make_effect_cluster: Any, e2e_settings: Settings
) -> None:
    settings = _on_pair(e2e_settings, async_pair)
    cluster = _start(make_effect_cluster, redis_url, settings, e2e_settings.libpq_conninfo())
    stream = ScheduleStream(cluster, "async").start()
    try:
        time.sleep(3)
        # Checkpoint: every commit returned before it is on the standby.
        replicated = list(stream.returned)
        async_pair.wait_replayed()
        # The standby stops receiving: what commits from here on is the tail
        # an asynchronous failover loses (on loopback the lag is otherwise
        # milliseconds, and the loss would be left to chance).
        async_pair.detach_standby()
        time.sleep(2)
        # What the standby will be promoted with.
        succeeded = {
            str(key)
            for (key,) in async_pair.standby.query(
                f'SELECT key FROM "{settings.db_schema}".jobs WHERE status = %s',
                "succeeded",
            )
        }
        async_pair.failover()
        time.sleep(4)
    finally:
        stream.stop()
    assert len(replicated) > 30 and succeeded, "jobs must have run before the failover"

    survived = _job_keys(cluster, stream.returned + stream.failed)
    lost = set(stream.returned) - survived
    print(
        f"{len(stream.returned)} returned, {len(replicated)} before the checkpoint, "
        f"{len(lost)} rows lost, {len(succeeded)} succeeded on the standby"
    )
    # The loss is real, and confined to what committed after the checkpoint.
    assert lost, "the detached standby missed commits; the failover must lose them"
    assert not lost & set(replicated)
    # Every job whose row survived runs: the replicated ones, and those
    # scheduled after the promotion.
    counts = cluster.wait_effects(survived, timeout=60)
    # A job whose success the standby had replayed never runs again. (One
    # that ran in the lost tail may: its claim and its ledger row are gone.)
    again = {key: counts[key] for key in succeeded if counts[key] > 1}
    assert again == {}, f"ran again after a replicated success: {again}"
    twice = sorted(key for key, n in counts.items() if n > 1)
    print(f"ran twice (allowed only for the lost tail): {twice}")
