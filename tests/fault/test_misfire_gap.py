"""A leader gap with real processes (issue 15, point 5): the occurrences a
2 s schedule missed while its only beat was stopped for 15 s follow the
misfire policy when the beat comes back, though they were all planned
before the gap. Under ``once`` (the default, stock beat's) exactly one of
them is sent late; the rest end ``missed``. No worker runs: what was sent
stays ``dispatched`` (visibility timeout well past the test)."""

from __future__ import annotations

import dataclasses
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from celery_sched.backends import build_store
from tests.e2e.harness import Cluster, wait_for

pytestmark = pytest.mark.slow

GAP = 15.0


def test_a_paused_beat_sends_one_late_run_of_a_two_second_schedule(
    tmp_path: Path, redis_url: str, e2e_settings: Any
) -> None:
    settings = dataclasses.replace(e2e_settings, misfire_grace=1.0, visibility_timeout=600.0)
    store = build_store(settings)
    store.migrate()
    store.close()
    cluster = Cluster(
        tmp_path=tmp_path,
        settings=settings,
        broker_url=redis_url,
        queue="q_" + uuid.uuid4().hex[:10],
        app="tests.e2e.periodic_app",
    )
    try:
        beat = cluster.start_beat("beat")
        wait_for(cluster.leader_proc, timeout=45, what="a leader")

        def sent_two_seconds() -> int:
            rows = cluster.query(
                "SELECT count(*) FROM {s}.jobs j JOIN {s}.schedules s ON s.id = j.schedule_id "
                "WHERE s.name = 'two-seconds' AND j.status = 'dispatched'"
            )
            return int(rows[0][0])

        wait_for(lambda: sent_two_seconds() >= 2, timeout=45, what="two-seconds being sent")
        beat.signal(signal.SIGSTOP)
        stopped_at = time.time()
        time.sleep(GAP)
        beat.signal(signal.SIGCONT)
        resumed_at = time.time()
        time.sleep(settings.lease_ttl * 2 + 6)

        rows = cluster.query(
            "SELECT extract(epoch FROM j.due_at), j.status, j.last_error, "
            "extract(epoch FROM j.created_at) "
            "FROM {s}.jobs j JOIN {s}.schedules s ON s.id = j.schedule_id "
            "WHERE s.name = 'two-seconds' AND j.due_at > to_timestamp(%s) "
            "AND j.due_at < to_timestamp(%s) ORDER BY j.due_at",
            stopped_at + 1.0,
            resumed_at,
        )
        in_gap = [
            (float(due), str(status), error, float(created)) for due, status, error, created in rows
        ]
        print(in_gap)
        # All of them were planned before the gap (the horizon is a minute).
        assert len(in_gap) >= 6 and all(created < stopped_at for *_x, created in in_gap)
        statuses = [status for _due, status, _error, _created in in_gap]
        missed = statuses.count("missed")
        # Missed first, then the latest missed one sent late (and at most one
        # more, due within the grace when the beat came back): never the
        # seven late runs of before.
        assert statuses == ["missed"] * missed + ["dispatched"] * (len(statuses) - missed)
        assert missed >= 5 and 1 <= len(statuses) - missed <= 2, statuses
        assert all(
            "misfire once" in str(error) for _d, status, error, _c in in_gap if status == "missed"
        )
        # After the gap the grid goes on, every occurrence sent once.
        after = cluster.query(
            "SELECT j.status FROM {s}.jobs j JOIN {s}.schedules s ON s.id = j.schedule_id "
            "WHERE s.name = 'two-seconds' AND j.due_at > to_timestamp(%s) "
            "AND j.due_at < now() - interval '2 seconds'",
            resumed_at + 3.0,
        )
        assert after and {str(status) for (status,) in after} == {"dispatched"}
    finally:
        cluster.stop_all()
        print(cluster.dump_logs())
