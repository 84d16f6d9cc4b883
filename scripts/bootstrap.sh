#!/usr/bin/env bash
# Set up a checkout: .venv with the package (editable) and its test, lint,
# bench and dev extras, then the local services. Idempotent; a re-run skips pip
# unless pyproject.toml changed or the package no longer imports.
#
# --python-only stops after the venv: no system package, no service. That is
# what scripts/example.sh runs, on machines where services cannot be installed
# too; the example falls back to the dev server (celery_sched[dev]).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

log() { printf 'bootstrap.sh: %s\n' "$*" >&2; }

PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
STAMP="$VENV/.celery_sched-installed"

if [[ ! -x "$VENV/bin/python" ]]; then
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        log "ERROR: celery_sched needs Python >= 3.11; $PYTHON is $("$PYTHON" -V 2>&1)"
        log "set PYTHON=/path/to/python3.11 and re-run"
        exit 1
    fi
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi

# The stamp records which pyproject.toml the venv was installed from, so a
# dependency change re-installs and an unchanged checkout costs nothing.
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$wanted" ]] ||
    ! "$VENV/bin/python" -c 'import celery_sched' 2>/dev/null; then
    log "installing celery_sched[test,lint,bench,dev,web] into $VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        -e '.[test,lint,bench,dev,web]'
    printf '%s\n' "$wanted" >"$STAMP"
fi

if [[ "${1:-}" == "--python-only" ]]; then
    exit 0
fi

# The compose file is checked with `docker compose config` (or the standalone
# docker-compose) by the tests; no Docker engine is needed for that. Install
# Debian's docker-compose when neither is here and we may.
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null 2>&1; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "installing docker-compose (Debian package) to validate docker-compose.yml"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null
    else
        log "WARNING: neither 'docker compose' nor 'docker-compose' is installed;" \
            "the compose file test will fail until one is"
    fi
fi

# tests/integration/test_postgres_connections.py starts a private PgBouncer
# (transaction pooling) in front of the test database, and fails without one.
# Debian's package; its system service is not used (nor started here).
if ! command -v pgbouncer >/dev/null 2>&1 && [[ ! -x /usr/sbin/pgbouncer ]]; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "installing pgbouncer (Debian package) for the PgBouncer tests"
        # A fresh image may have no package lists yet.
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >/dev/null 2>&1 || {
            apt-get update -qq >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >/dev/null
        }
    else
        log "WARNING: pgbouncer is not installed; the PgBouncer tests will fail until it is"
    fi
fi

# tests/integration/test_prometheus_dashboard.py runs a private Prometheus
# server (Debian's, 2.42 on Debian 12) on a port and data directory of its own,
# and fails without one. Its system service is not used (nor started here).
if ! command -v prometheus >/dev/null 2>&1 && [[ ! -x /usr/bin/prometheus ]]; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "installing prometheus (Debian package) for the dashboard test"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            prometheus >/dev/null 2>&1 || {
            apt-get update -qq >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                prometheus >/dev/null
        }
    else
        log "WARNING: prometheus is not installed; the dashboard test will fail until it is"
    fi
fi

# The fault tests and the soak's extra faults (tests/fault, tests/soak/faults.py):
# iptables drops a beat's packets to Redis (a partition), libfaketime moves a
# beat's wall clock (gcc builds the small sleep fix tests/faketime.py preloads
# with it), and the PostgreSQL failover test runs the server's own binaries
# (initdb, pg_ctl, pg_basebackup of the PostgreSQL server services.sh starts).
missing_fault_tools=()
command -v iptables >/dev/null 2>&1 || [[ -x /usr/sbin/iptables ]] || missing_fault_tools+=(iptables)
[[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1 ]] || missing_fault_tools+=(faketime)
command -v gcc >/dev/null 2>&1 || missing_fault_tools+=(gcc libc6-dev)
if ((${#missing_fault_tools[@]})); then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "installing ${missing_fault_tools[*]} (Debian packages) for the fault tests"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing_fault_tools[@]}" \
            >/dev/null 2>&1 || {
            apt-get update -qq >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing_fault_tools[@]}" >/dev/null
        }
    else
        log "WARNING: ${missing_fault_tools[*]} not installed; the fault tests will fail until they are"
    fi
fi

# The web console's browser test drives a real headless Chromium.
bash "$ROOT/scripts/browser.sh"

bash "$ROOT/scripts/services.sh"
