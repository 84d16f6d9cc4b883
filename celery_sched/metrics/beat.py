"""The beat's series: a collector that reads the leader's counters at scrape time.

Series names are fixed (dashboards and alerts use them; see the README's
"Metrics and health"). Counters count since the process started, as
Prometheus expects of a counter; ``celery_sched_jobs``,
``celery_sched_oldest_due_pending_seconds`` and ``celery_sched_staged_jobs``
are the leader's last backlog reading (:mod:`celery_sched.leader.backlog`),
exported only while this process leads, so a fleet reports each once.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from celery_sched.metrics import health, server
from celery_sched.models import JobStatus

if TYPE_CHECKING:
    from celery_sched.leader import Engine
    from celery_sched.leader.fleet import Fleet
    from celery_sched.leader.stats import BatchHistogram
    from celery_sched.settings import Settings

logger = logging.getLogger(__name__)

#: Reasons of ``celery_sched_publish_failures_total`` (see ``EngineStats.publish_failures``).
PUBLISH_FAILURE_REASONS = ("broker", "rejected", "withheld", "error")
#: Reasons of ``celery_sched_requeued_total`` (see ``EngineStats.requeued_by``).
REQUEUE_REASONS = ("reconcile", "rescue", "publish_rejected")
#: The leader's duties, the reasons of ``celery_sched_pass_failures_total``
#: (``pass``: the loop itself, outside any duty).
DUTIES = (
    "pass",
    "stage",
    "pop",
    "plan",
    "sweep",
    "reconcile",
    "rescue",
    "prune",
    "rehome",
    "backlog",
)


class BeatEndpoint:
    """What a beat serves: its registry (:class:`BeatCollector` and the
    process's CPU and memory), liveness and readiness."""

    def __init__(
        self,
        source: Engine | Fleet,
        settings: Settings,
        *,
        probes: dict[str, Callable[[], None]] | None = None,
    ) -> None:
        from celery_sched.backends import build_probes

        self.registry = CollectorRegistry()
        self.registry.register(BeatCollector(source))
        ProcessCollector(registry=self.registry)
        self.liveness = health.Liveness(source.stalled_for, health.stall_limit(settings))
        self.readiness = health.Readiness(
            build_probes(settings, timeout=health.PROBE_TIMEOUT) if probes is None else probes
        )
        self.server: server.MetricsServer | None = None

    def healthz(self) -> tuple[bool, str]:
        return self.liveness.check()

    def readyz(self) -> tuple[bool, str]:
        ready, found = self.readiness.check()
        return ready, "\n".join(f"{name}: {why}" for name, why in sorted(found.items()))

    def serve(self, port: int) -> bool:
        """Serve on ``port`` (``celery_sched_metrics_port``); False, after
        logging why, when it cannot."""
        self.server = server.start(
            "celery_sched_metrics_port",
            port,
            self.registry,
            {"/healthz": self.healthz, "/readyz": self.readyz},
        )
        return self.server is not None

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        self.readiness.close()


def serve(source: Engine | Fleet, settings: Settings) -> BeatEndpoint | None:
    """Serve the beat's metrics and probes on ``settings.metrics_port``, if
    set. Never raises: what fails is logged, and the beat goes on without."""
    if not settings.metrics_port:
        return None
    try:
        endpoint = BeatEndpoint(source, settings)
    except Exception:
        logger.exception("celery_sched: cannot set up metrics; going on without them")
        return None
    if not endpoint.serve(settings.metrics_port):
        endpoint.close()
        return None
    return endpoint


def engines_of(source: Engine | Fleet) -> tuple[Callable[[], Sequence[Engine]], list[int]]:
    """What to read at each scrape: a fleet's engines (running and retired,
    one per shard this process ran) or one engine; and the shards the beat
    may lead (its leader gauge shows each, 0 while it runs no engine there)."""
    from celery_sched.leader.fleet import Fleet

    if isinstance(source, Fleet):
        shards = list(range(source.shards)) if source.pinned is None else [source.pinned]
        return source.all_engines, shards
    return (lambda: [source]), [source.shard]


class BeatCollector(Collector):
    """The series of one beat process: its engines, one sample per shard."""

    def __init__(self, source: Engine | Fleet) -> None:
        self._engines, self._shards = engines_of(source)

    def collect(self) -> Iterator[Metric]:
        engines = self._engines()
        shards = [(str(engine.shard), engine) for engine in engines]
        leading = [(shard, engine) for shard, engine in shards if engine.epoch is not None]
        led = {shard for shard, _ in leading}

        yield _per_shard(
            GaugeMetricFamily,
            "celery_sched_leader",
            "1 while this beat leads the shard.",
            [(str(shard), str(shard) in led) for shard in self._shards],
        )
        yield _per_shard(
            GaugeMetricFamily,
            "celery_sched_epoch",
            "The epoch of the last lease this beat held on the shard (0: never).",
            [(shard, engine.last_epoch) for shard, engine in shards],
        )
        yield _per_shard(
            CounterMetricFamily,
            "celery_sched_dispatched_total",
            "Jobs published to the broker.",
            [(shard, engine.stats.published) for shard, engine in shards],
        )
        yield _by_reason(
            "celery_sched_publish_failures_total",
            "Jobs not published, by reason: broker (unavailable; released), rejected "
            "(their own message), withheld (the lease ran out), error (the dispatcher raised).",
            [(shard, engine.stats.publish_failures.copy()) for shard, engine in shards],
            PUBLISH_FAILURE_REASONS,
        )
        yield _histogram(
            "celery_sched_dispatch_lag_seconds",
            "Publish time minus due time of each job published (store clock).",
            [engine.stats.dispatch_lag for engine in engines],
        )
        yield _histogram(
            "celery_sched_claim_seconds",
            "Seconds per claim statement (a batch of staged ids or of a sweep).",
            [engine.stats.claim_seconds for engine in engines],
        )
        yield _by_reason(
            "celery_sched_requeued_total",
            "Jobs put back to pending with an attempt counted, by what did it: reconcile "
            "(not started in time, or over max_runtime), rescue (their worker process "
            "stopped beating), publish_rejected (their message could not be published).",
            [(shard, engine.stats.requeued_by.copy()) for shard, engine in shards],
            REQUEUE_REASONS,
        )
        yield _per_shard(
            CounterMetricFamily,
            "celery_sched_dead_total",
            "Jobs marked dead (out of attempts).",
            [(shard, engine.stats.dead) for shard, engine in shards],
        )
        yield _per_shard(
            CounterMetricFamily,
            "celery_sched_missed_total",
            "Late periodic occurrences the misfire policy dropped at their first dispatch.",
            [(shard, engine.stats.missed) for shard, engine in shards],
        )
        planned = CounterMetricFamily(
            "celery_sched_planned_occurrences",
            "Periodic occurrences this beat's planner wrote as jobs.",
        )
        planned.add_metric([], sum(engine.stats.planned for engine in engines))
        yield planned
        failures = CounterMetricFamily(
            "celery_sched_pass_failures",
            "Failed duties of the leader loop, by duty.",
            labels=["reason"],
        )
        counted: Counter[str] = Counter()
        for engine in engines:
            counted.update(engine.stats.failures.copy())
        for duty in (*DUTIES, *sorted(set(counted) - set(DUTIES))):
            failures.add_metric([duty], counted.get(duty, 0))
        yield failures

        staged = [
            (shard, engine.backlog.staged)
            for shard, engine in leading
            if engine.backlog.staged is not None
        ]
        if staged:
            yield _per_shard(
                GaugeMetricFamily,
                "celery_sched_staged_jobs",
                "Jobs in the shard's staging set (Redis), as its leader last read.",
                staged,
            )
        for _, engine in leading:
            backlog = engine.backlog
            if backlog.jobs is not None:
                jobs = GaugeMetricFamily(
                    "celery_sched_jobs",
                    "Jobs stored, by status (read by shard 0's leader every 15 s or more).",
                    labels=["status"],
                )
                for status in JobStatus:
                    jobs.add_metric([status.value], backlog.jobs.get(status, 0))
                yield jobs
            if backlog.oldest_due_seconds is not None:
                yield GaugeMetricFamily(
                    "celery_sched_oldest_due_pending_seconds",
                    "Seconds since the oldest due pending job was due, 0 when none is "
                    "(read by shard 0's leader every few seconds).",
                    value=backlog.oldest_due_seconds,
                )


Family = TypeVar("Family", GaugeMetricFamily, CounterMetricFamily)


def _per_shard(
    kind: type[Family], name: str, doc: str, values: Sequence[tuple[str, float]]
) -> Family:
    family = kind(name, doc, labels=["shard"])
    for shard, value in values:
        family.add_metric([shard], float(value))
    return family


def _by_reason(
    name: str,
    doc: str,
    counts: Sequence[tuple[str, dict[str, int]]],
    known: Sequence[str],
) -> CounterMetricFamily:
    # Every known reason from the start, so that rate() sees the first one.
    family = CounterMetricFamily(name, doc, labels=["shard", "reason"])
    for shard, by_reason in counts:
        for reason in (*known, *sorted(set(by_reason) - set(known))):
            family.add_metric([shard, reason], by_reason.get(reason, 0))
    return family


def _histogram(name: str, doc: str, histograms: Sequence[BatchHistogram]) -> HistogramMetricFamily:
    """One histogram summing ``histograms`` (one per shard, same bounds)."""
    bounds: tuple[float, ...] = histograms[0].bounds if histograms else ()
    counts = [0] * (len(bounds) + 1)
    total = 0.0
    for histogram in histograms:
        these, their_sum = histogram.snapshot()
        counts = [a + b for a, b in zip(counts, these, strict=True)]
        total += their_sum
    buckets: list[tuple[str, float]] = []
    cumulative = 0
    for bound, count in zip(bounds, counts, strict=False):
        cumulative += count
        buckets.append((_le(bound), cumulative))
    cumulative += counts[-1]
    buckets.append(("+Inf", cumulative))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


def _le(bound: float) -> str:
    # Prometheus's own spelling of bucket bounds: 1.0, 0.005.
    return repr(float(bound))
