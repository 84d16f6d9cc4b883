#!/usr/bin/env bash
# Make sure PostgreSQL, Redis and RabbitMQ accept connections on 127.0.0.1.
#
# A service that is down is started with this machine's own command (we run
# as root, without systemd), then every service is waited for, bounded by
# SERVICES_TIMEOUT seconds (default 60). Also makes sure the `test` database
# the test suite uses exists. Exits non-zero, naming the service, on failure.
set -euo pipefail

HOST=127.0.0.1
PG_PORT=5432
REDIS_PORT=6379
AMQP_PORT=5672
TIMEOUT="${SERVICES_TIMEOUT:-60}"

log() { printf 'services.sh: %s\n' "$*" >&2; }

# True when something accepts a TCP connection on $HOST:$1. `timeout` bounds
# the connect in case a firewall drops packets instead of refusing them.
port_open() {
    timeout 2 bash -c "exec 3<>/dev/tcp/$HOST/$1" 2>/dev/null
}

postgres_ready() {
    if command -v pg_isready >/dev/null; then
        pg_isready -q -h "$HOST" -p "$PG_PORT" -t 2
    else
        port_open "$PG_PORT"
    fi
}

# PONG, not just an open port: Redis answers LOADING while it reads a dump.
redis_ready() {
    if command -v redis-cli >/dev/null; then
        [[ "$(timeout 3 redis-cli -h "$HOST" -p "$REDIS_PORT" ping 2>/dev/null)" == PONG ]]
    else
        port_open "$REDIS_PORT"
    fi
}

# RabbitMQ opens its AMQP listener only at the end of its boot, so an open
# port means it takes connections (rabbitmq-diagnostics would cost seconds).
rabbitmq_ready() { port_open "$AMQP_PORT"; }

start_postgres() {
    # This machine has exactly one cluster version under /etc/postgresql.
    # shellcheck disable=SC2046
    pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start
}

start_redis() {
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log
}

start_rabbitmq() {
    rabbitmq-server -detached
}

# Start the service if it is down. A failing start command is only logged:
# the service may have been booting already, and wait_for decides.
# The command's output goes through a file, never our own stdout/stderr: a
# daemon that inherited them would hold the caller's pipe open (`| tee`, CI's
# log capture) long after this script exited.
ensure_started() {
    local name=$1 out status=0
    if "${name}_ready"; then
        log "$name is up"
        return 0
    fi
    log "$name is down; starting it"
    out="$(mktemp "${TMPDIR:-/tmp}/services-$name.XXXXXX")"
    "start_${name}" </dev/null >"$out" 2>&1 || status=$?
    sed "s/^/services.sh: [$name] /" "$out" >&2
    rm -f "$out"
    if ((status != 0)); then
        log "starting $name exited with status $status (waiting anyway)"
    fi
}

# All services share one deadline, so the whole wait stays within TIMEOUT.
wait_for() {
    local name=$1 deadline=$2
    until "${name}_ready"; do
        if ((SECONDS >= deadline)); then
            log "ERROR: $name did not accept connections on $HOST within ${TIMEOUT}s"
            return 1
        fi
        sleep 1
    done
}

ensure_test_database() {
    local psql=(psql -h "$HOST" -p "$PG_PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -tAq)
    if [[ "$("${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname = 'test'")" == 1 ]]; then
        return 0
    fi
    log "creating database 'test'"
    # A concurrent run may create it between the check and here; check again
    # rather than failing on "already exists".
    createdb -h "$HOST" -p "$PG_PORT" -U postgres test ||
        [[ "$("${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname = 'test'")" == 1 ]]
}

services=(postgres redis rabbitmq)
# Start everything first so the slow boots (RabbitMQ) overlap, then wait.
for name in "${services[@]}"; do
    ensure_started "$name"
done
failed=()
deadline=$((SECONDS + TIMEOUT))
for name in "${services[@]}"; do
    wait_for "$name" "$deadline" || failed+=("$name")
done
if ((${#failed[@]})); then
    log "ERROR: unreachable: ${failed[*]}"
    exit 1
fi
ensure_test_database
log "PostgreSQL :$PG_PORT, Redis :$REDIS_PORT and RabbitMQ :$AMQP_PORT are up"
