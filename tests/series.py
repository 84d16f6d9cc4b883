"""The series celery_sched exports (README, "Metrics and health"), named once
for the tests that look for them: in a beat's /metrics, in the dashboard."""

from __future__ import annotations

#: What a leading beat serves; histograms by the name of their buckets.
BEAT_SERIES = (
    "celery_sched_leader",
    "celery_sched_epoch",
    "celery_sched_dispatched_total",
    "celery_sched_publish_failures_total",
    "celery_sched_dispatch_lag_seconds_bucket",
    "celery_sched_claim_seconds_bucket",
    "celery_sched_staged_jobs",
    "celery_sched_requeued_total",
    "celery_sched_dead_total",
    "celery_sched_missed_total",
    "celery_sched_planned_occurrences_total",
    "celery_sched_pass_failures_total",
    "celery_sched_jobs",
    "celery_sched_oldest_due_pending_seconds",
)

#: What a worker with tracking installed serves.
WORKER_SERIES = (
    "celery_sched_ledger_outcomes_total",
    "celery_sched_status_reports_held",
)
