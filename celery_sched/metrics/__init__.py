"""Prometheus metrics and the health endpoints (``prometheus_client``).

- :mod:`~celery_sched.metrics.beat`: the beat's series, read from the
  leader's counters (:class:`~celery_sched.leader.stats.EngineStats`) and
  its last backlog reading when Prometheus scrapes; the dispatch path never
  calls ``prometheus_client``.
- :mod:`~celery_sched.metrics.health`: ``/healthz`` (the leader loop still
  ticks) and ``/readyz`` (PostgreSQL and Redis answer).
- :mod:`~celery_sched.metrics.server`: the small threaded HTTP server that
  serves them on ``celery_sched_metrics_port``.
- :mod:`~celery_sched.metrics.worker`: the workers' series, through
  ``prometheus_client``'s multiprocess mode, on
  ``celery_sched_worker_metrics_port``.

Nothing here decides anything: a failure to serve metrics is logged and the
beat (or worker) goes on.
"""

from __future__ import annotations
