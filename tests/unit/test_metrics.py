"""The beat's series, liveness and readiness, on the in-memory fakes."""

from __future__ import annotations

import datetime as dt
import logging
import socket
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from celery_sched.errors import StagingUnavailable, StoreUnavailable
from celery_sched.leader.stats import LAG_BUCKETS, BatchHistogram
from celery_sched.metrics import health, server
from celery_sched.metrics.beat import BeatCollector, BeatEndpoint
from celery_sched.models import JobStatus, election_count
from tests.unit.test_engine import Rig, rig  # noqa: F401  (the fixture)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    from prometheus_client import generate_latest

    samples: Samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def collected(collector: BeatCollector) -> Samples:
    registry = CollectorRegistry()
    registry.register(collector)
    return scrape(registry)


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def test_a_leader_exports_every_series_with_its_values(rig: Rig) -> None:  # noqa: F811
    overdue = [rig.add(-2.0) for _ in range(3)]
    rejected = rig.add(-1.0, max_attempts=5)
    rig.add(10.0)  # staged, not yet due
    rig.dispatcher.reject(rejected)
    elector = rig.elector("a")
    assert elector.try_acquire() is not None
    engine = rig.engine(elector)
    collector = BeatCollector(engine)

    before = collected(collector)
    assert value(before, "celery_sched_leader", shard="0") == 0
    assert value(before, "celery_sched_epoch", shard="0") == 0
    assert value(before, "celery_sched_dispatched_total", shard="0") == 0
    # The leader's readings are not there until it leads.
    assert "celery_sched_jobs" not in names(before)

    engine.step()
    engine._backlog.wait(5)  # the reading runs on a thread of its own
    samples = collected(collector)
    assert set(rig.dispatcher.sent_ids()) == set(overdue)
    assert value(samples, "celery_sched_leader", shard="0") == 1
    assert value(samples, "celery_sched_epoch", shard="0") == engine.epoch
    assert election_count(engine.epoch) == 1
    assert value(samples, "celery_sched_dispatched_total", shard="0") == 3
    assert value(samples, "celery_sched_publish_failures_total", shard="0", reason="rejected") == 1
    assert value(samples, "celery_sched_publish_failures_total", shard="0", reason="broker") == 0
    assert value(samples, "celery_sched_requeued_total", shard="0", reason="publish_rejected") == 1
    assert value(samples, "celery_sched_requeued_total", shard="0", reason="reconcile") == 0
    assert value(samples, "celery_sched_dead_total", shard="0") == 0
    assert value(samples, "celery_sched_missed_total", shard="0") == 0
    assert value(samples, "celery_sched_planned_occurrences_total") == 0
    assert value(samples, "celery_sched_pass_failures_total", reason="sweep") == 0
    # The three jobs sent were published 2 s late (the rejected one was not sent).
    assert value(samples, "celery_sched_dispatch_lag_seconds_count") == 3
    assert value(samples, "celery_sched_dispatch_lag_seconds_sum") == pytest.approx(6.0)
    assert value(samples, "celery_sched_dispatch_lag_seconds_bucket", le="1.0") == 0
    assert value(samples, "celery_sched_dispatch_lag_seconds_bucket", le="2.5") == 3
    assert value(samples, "celery_sched_dispatch_lag_seconds_bucket", le="+Inf") == 3
    assert value(samples, "celery_sched_claim_seconds_count") >= 1
    assert value(samples, "celery_sched_staged_jobs", shard="0") == 1
    jobs = {s: value(samples, "celery_sched_jobs", status=s.value) for s in JobStatus}
    assert jobs[JobStatus.DISPATCHED] == 3
    assert jobs[JobStatus.PENDING] == 2  # the staged one, and the rejected one requeued
    assert jobs[JobStatus.SUCCEEDED] == 0
    # The requeued job was due a second before the pass.
    assert value(samples, "celery_sched_oldest_due_pending_seconds") == pytest.approx(1.0)


def test_counters_split_by_reason_and_standby_exports_no_readings(rig: Rig) -> None:  # noqa: F811
    rig.add(-1.0)
    elector = rig.elector("a")
    assert elector.try_acquire() is not None
    engine = rig.engine(elector)
    rig.dispatcher.set_down()
    engine.step()
    samples = collected(BeatCollector(engine))
    assert value(samples, "celery_sched_publish_failures_total", shard="0", reason="broker") == 1
    assert value(samples, "celery_sched_pass_failures_total", reason="sweep") == 1
    assert value(samples, "celery_sched_dispatched_total", shard="0") == 0

    # The lease ran out (nothing renewed it): no longer leading, and the
    # shard's readings go with it.
    rig.clock.advance(rig.settings.lease_ttl * 2)
    engine.step()
    assert engine.role == "standby"
    samples = collected(BeatCollector(engine))
    assert value(samples, "celery_sched_leader", shard="0") == 0
    held = value(samples, "celery_sched_epoch", shard="0")  # the last one held
    assert held == rig.store.current_epoch(0) and election_count(int(held)) == 1
    assert "celery_sched_staged_jobs" not in names(samples)
    assert "celery_sched_oldest_due_pending_seconds" not in names(samples)


def test_lag_buckets_per_batch_match_one_by_one() -> None:
    now = dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
    lags = [0.0, 0.005, 0.0051, 0.3, 1.0, 7.5, 59.0, 301.0, 1000.0, 0.02]
    batch, single = BatchHistogram(LAG_BUCKETS), BatchHistogram(LAG_BUCKETS)
    batch.observe_lags(now, [now - dt.timedelta(seconds=lag) for lag in lags])
    for lag in lags:
        single.observe(lag)
    assert batch.snapshot()[0] == single.snapshot()[0]
    assert batch.snapshot()[1] == pytest.approx(sum(lags))


def test_liveness_fails_once_the_loop_stalls_for_longer_than_the_limit(rig: Rig) -> None:  # noqa: F811
    engine = rig.engine(rig.elector("a"))
    limit = health.stall_limit(rig.settings)
    # 3 x max(max_tick 1, lease_ttl/3 1, backoff 5) + margin
    assert limit == 3 * 5.0 + health.STALL_MARGIN
    liveness = health.Liveness(engine.stalled_for, limit)
    assert liveness.check()[0]
    engine.step()
    rig.clock.advance(limit - 1)
    assert liveness.check()[0]
    rig.clock.advance(2)
    alive, why = liveness.check()
    assert not alive
    assert "has not ticked" in why
    engine.step()  # ticking again: alive again
    assert liveness.check()[0]


def test_readiness_names_the_service_that_is_down_and_caches_its_answer() -> None:
    calls = {"postgresql": 0, "redis": 0}
    redis_down = threading.Event()
    now = [0.0]

    def postgres() -> None:
        calls["postgresql"] += 1

    def redis() -> None:
        calls["redis"] += 1
        if redis_down.is_set():
            raise StagingUnavailable("Redis at redis://x is unavailable: refused")

    readiness = health.Readiness(
        {"postgresql": postgres, "redis": redis}, ttl=1.0, clock=lambda: now[0]
    )
    try:
        assert readiness.check() == (True, {"postgresql": "ok", "redis": "ok"})
        redis_down.set()
        assert readiness.check()[0]  # cached for a second
        assert calls == {"postgresql": 1, "redis": 1}
        now[0] = 1.5
        ready, found = readiness.check()
        assert not ready
        assert found["postgresql"] == "ok"
        assert "StagingUnavailable" in found["redis"]
        assert calls == {"postgresql": 2, "redis": 2}
    finally:
        readiness.close()


def test_a_probe_that_hangs_counts_as_down_and_is_not_piled_up() -> None:
    release = threading.Event()
    started = []

    def hangs() -> None:
        started.append(1)
        release.wait(10)

    readiness = health.Readiness({"postgresql": hangs}, ttl=0.0, timeout=0.05)
    try:
        ready, found = readiness.check()
        assert not ready
        assert found == {"postgresql": "no answer within 0.05s"}
        readiness.check()
        assert len(started) == 1
    finally:
        release.set()
        readiness.close()


def test_the_endpoint_serves_metrics_and_probes_over_http(rig: Rig) -> None:  # noqa: F811
    import dataclasses

    def down() -> None:
        raise StoreUnavailable("PostgreSQL at postgresql://x is unavailable (test)")

    engine = rig.engine(rig.elector("a"))
    endpoint = BeatEndpoint(
        engine,
        dataclasses.replace(rig.settings, metrics_port=0),
        probes={"postgresql": down, "redis": lambda: None},
    )
    assert endpoint.serve(0)
    assert endpoint.server is not None
    base = f"http://127.0.0.1:{endpoint.server.port}"
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=5) as reply:
            text = reply.read().decode()
        assert "celery_sched_dispatched_total" in text
        assert "process_cpu_seconds_total" in text
        with urllib.request.urlopen(base + "/healthz", timeout=5) as reply:
            assert reply.status == 200
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(base + "/readyz", timeout=5)
        assert caught.value.code == 503
        assert "postgresql: StoreUnavailable" in caught.value.read().decode()
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(base + "/nothing", timeout=5)
        assert caught.value.code == 404
    finally:
        endpoint.close()


def test_a_port_in_use_is_logged_naming_the_setting_and_nothing_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="celery_sched.metrics.server"):
            started = server.start("celery_sched_metrics_port", port, CollectorRegistry(), {})
        assert started is None
        assert f"port {port} (celery_sched_metrics_port)" in caplog.text
        assert "set celery_sched_metrics_port to a free port" in caplog.text
    finally:
        taken.close()
