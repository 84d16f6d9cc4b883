"""The workers' series, through ``prometheus_client``'s multiprocess mode.

With ``celery_sched_worker_metrics_port`` set, a worker whose app installed
tracking (:func:`celery_sched.tracking.install`) serves ``/metrics`` from its
main process, summing what every process of the worker (prefork children
included) counted:

- ``celery_sched_ledger_outcomes_total{outcome}``: ``celery_sched.Task``
  deliveries by what the idempotency ledger said: ``acquired`` (ran),
  ``completed`` (a duplicate: the recorded result returned), ``held``
  (another live worker holds the key: retried later), ``fenced`` (a stale
  delivery: skipped), ``unavailable`` (the ledger could not be reached:
  retried later).
- ``celery_sched_status_reports_held``: job status reports waiting to be
  written (a database outage makes them pile up, up to
  ``celery_sched.tracking.MAX_HELD`` per process), summed over live processes.

Multiprocess mode keeps each process's values in files of the directory
``PROMETHEUS_MULTIPROC_DIR``. When the user has not set one, a private one is
made at ``worker_init`` (before the pool forks, so every child inherits it)
and removed at shutdown. ``prometheus_client`` chooses its mode on import:
imported earlier in the worker's main process without the variable, it
is switched to multiprocess values then, with a warning: metrics created
before (the user's own) keep counting in their process alone.

With the port unset nothing here imports ``prometheus_client``, and counting
is one ``None`` check.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from celery_sched.models import ClaimOutcome

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge

    from celery_sched.metrics.server import MetricsServer

logger = logging.getLogger(__name__)

MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
#: Values of ``outcome`` besides the ledger's own (``ClaimOutcome``).
UNAVAILABLE = "unavailable"
#: Every value of ``outcome``, exported at 0 until first counted.
OUTCOMES = (*(outcome.value for outcome in ClaimOutcome), UNAVAILABLE)

_outcomes: Counter | None = None
_held: Gauge | None = None
_server: MetricsServer | None = None
_private_dir: str | None = None
_main_pid: int | None = None


def setup(port: int) -> None:
    """Prepare counting on ``port`` (``worker_init``, in the worker's main
    process, before the pool forks). Never raises."""
    global _outcomes, _held, _private_dir, _main_pid
    if not port or _outcomes is not None:
        return
    try:
        if not os.environ.get(MULTIPROC_DIR):
            _private_dir = tempfile.mkdtemp(prefix="celery_sched-metrics-")
            os.environ[MULTIPROC_DIR] = _private_dir
        if "prometheus_client.values" in sys.modules:
            from prometheus_client import values

            if not getattr(values.ValueClass, "_multiprocess", False):
                # Imported before the variable was set: switch to the
                # multiprocess values as prometheus_client's docs do for a
                # custom process identifier. Metrics made before stay per process.
                values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
                logger.warning(
                    "celery_sched: prometheus_client was imported before %s was set; "
                    "metrics created before now count in their own process only",
                    MULTIPROC_DIR,
                )
        from prometheus_client import Counter, Gauge

        # Not registered anywhere: the main process's MultiProcessCollector
        # reads every process's files.
        _outcomes = Counter(
            "celery_sched_ledger_outcomes",
            "celery_sched.Task deliveries by what the idempotency ledger said.",
            ["outcome"],
            registry=None,
        )
        # Every outcome from the start, at 0: a dashboard's rate() then has a
        # series to show before the first of each (unavailable: an outage).
        for outcome in OUTCOMES:
            _outcomes.labels(outcome)
        _held = Gauge(
            "celery_sched_status_reports_held",
            "Job status reports waiting to be written, over the worker's live processes.",
            registry=None,
            multiprocess_mode="livesum",
        )
        _main_pid = os.getpid()
    except Exception:
        logger.exception("celery_sched: cannot set up worker metrics; going on without them")
        _outcomes = _held = None


def serve(port: int) -> None:
    """Serve ``/metrics`` on ``port`` from this (the main) process
    (``worker_ready``). Never raises; a taken port is logged."""
    global _server
    if _outcomes is None or _server is not None:
        return
    try:
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        from celery_sched.metrics import server

        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        _server = server.start("celery_sched_worker_metrics_port", port, registry, {})
    except Exception:
        logger.exception("celery_sched: cannot serve worker metrics; going on without them")


def process_exiting() -> None:
    """A pool process ends (``worker_process_shutdown``): its live gauges go."""
    if _held is None or os.getpid() == _main_pid:
        return
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]
    except Exception:
        logger.debug("celery_sched: could not retire this process's metrics", exc_info=True)


def shutdown() -> None:
    """The worker stops (``worker_shutdown``, main process): stop serving and
    remove the private directory."""
    global _server, _private_dir
    if os.getpid() != _main_pid:
        return
    server, _server = _server, None
    if server is not None:
        server.stop()
    private, _private_dir = _private_dir, None
    if private is not None:
        shutil.rmtree(private, ignore_errors=True)


def count_outcome(outcome: str) -> None:
    """Count one delivery's ledger outcome (no-op with metrics off)."""
    counter = _outcomes
    if counter is not None:
        try:
            counter.labels(outcome).inc()
        except Exception:  # a metrics file we cannot write must not fail the task
            logger.debug("celery_sched: could not count a ledger outcome", exc_info=True)


def reports_held(count: int) -> None:
    """Record how many status reports this process holds (no-op with metrics off)."""
    gauge = _held
    if gauge is not None:
        try:
            gauge.set(count)
        except Exception:
            logger.debug("celery_sched: could not record held reports", exc_info=True)


def reset_for_tests() -> dict[str, Any]:
    """Forget every setup of this process (tests); what was set up, for inspection."""
    global _outcomes, _held, _server, _private_dir, _main_pid
    state = {"dir": _private_dir, "server": _server}
    if _server is not None:
        _server.stop()
    _outcomes = _held = _server = None
    _private_dir = _main_pid = None
    return state
