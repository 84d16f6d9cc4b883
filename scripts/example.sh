#!/usr/bin/env bash
# Run the example end to end: bootstrap, then examples/run_example.py, which
# schedules 100,000 jobs over the next 24 hours in its own schema
# (celery_sched_example, recreated on every run), then starts two beats and a
# worker, runs 3,000 jobs due within seconds, and stops what it started.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/bootstrap.sh
exec "$ROOT/.venv/bin/python" examples/run_example.py "$@"
