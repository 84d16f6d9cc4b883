#!/usr/bin/env bash
# The chaos soak: 3 beats and 2 workers against private redis-server instances
# and a database of its own, a job stream, seeded faults, then an invariant
# check. Prints one JSON line per mode (a summary object last when several
# run); exits non-zero on any violation.
#
#   ./scripts/soak.sh --minutes 30 [--seed 7] [--settle 90] [--keep] [--mode M ...]
#
# A mode is comma-joined dimensions (tests/soak/spec.py): tracked|untracked
# workers, mixed|plain|task tasks, shards<N>, dense, clients; e.g.
# `--mode untracked,shards16 --mode dense,clients`, or `--mode all` (each alone).
#
# Needs PostgreSQL (CELERY_SCHED_TEST_DATABASE_URL, default the local server)
# and the redis-server binary; scripts/bootstrap.sh provides both.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# A fresh checkout has no .venv yet: set it up (and the services) first.
[[ -x "$ROOT/.venv/bin/python" ]] || bash "$ROOT/scripts/bootstrap.sh"
exec "$ROOT/.venv/bin/python" -m tests.soak.runner "$@"
