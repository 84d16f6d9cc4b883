#!/usr/bin/env bash
# Run the example end to end: the venv, the services, then
# examples/run_example.py, which schedules 100,000 jobs over the next 24 hours
# in its own schema (celery_sched_example, recreated on every run), then starts
# two beats and a worker, runs 3,000 jobs due within seconds, and stops what it
# started. Arguments go to run_example.py (--jobs N, --soon N, --dev-data-dir).
#
# Services: with no CELERY_SCHED_DATABASE_URL, CELERY_SCHED_REDIS_URL or
# CELERY_BROKER_URL set and this machine's PostgreSQL, Redis and RabbitMQ
# installed, scripts/services.sh starts any that is down, as for the tests.
# Whatever still does not answer at the configured URLs, run_example.py
# replaces with the dev server (python -m celery_sched dev: PostgreSQL and
# Redis from the celery_sched[dev] wheels, its Redis also the broker) and stops
# it at the end. So a machine with only Python 3.11+ runs this too.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

log() { printf 'example.sh: %s\n' "$*" >&2; }

# The venv with celery_sched and its dev extra; no system package, no service.
bash scripts/bootstrap.sh --python-only

configured="${CELERY_SCHED_DATABASE_URL:-}${CELERY_SCHED_REDIS_URL:-}${CELERY_BROKER_URL:-}"
if [[ -z "$configured" ]] && command -v pg_ctlcluster >/dev/null &&
    command -v redis-server >/dev/null && command -v rabbitmq-server >/dev/null; then
    bash scripts/services.sh || log "the local services did not all start; the example decides"
fi

exec "$ROOT/.venv/bin/python" examples/run_example.py "$@"
