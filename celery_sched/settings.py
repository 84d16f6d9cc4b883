"""Settings: the only reader of ``app.conf`` and ``CELERY_SCHED_*`` variables.

Each setting is looked up as ``app.conf.celery_sched_<name>``, then the
environment variable ``CELERY_SCHED_<NAME>``, then its default. The ``doc``
metadata of every field is the line the README's configuration table shows.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import socket
import urllib.parse
from collections.abc import Mapping
from typing import Any

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from celery_sched.errors import ConfigurationError, InvalidURL

PREFIX = "celery_sched_"


def _field(default: Any, doc: str) -> Any:
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Every knob of celery_sched, with its default."""

    database_url: str = _field(
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
        "SQLAlchemy URL of the PostgreSQL job store (`postgresql+psycopg://...`).",
    )
    redis_url: str = _field(
        "redis://127.0.0.1:6379/0", "Redis URL for the leader lease and the staging set."
    )
    db_schema: str = _field("celery_sched", "PostgreSQL schema holding every celery_sched table.")
    lease_ttl: float = _field(10.0, "Leader lease time-to-live in seconds; renewed every ttl/3.")
    lease_safety_margin: float = _field(
        0.5, "Seconds before the lease's expiry at which a leader stops trusting it."
    )
    visibility_timeout: float = _field(
        300.0,
        "Seconds a dispatched job (or a retry past its ETA) may go untaken before the "
        "reconciler requeues it.",
    )
    batch_size: int = _field(1000, "Jobs claimed and published per batch.")
    max_attempts: int = _field(5, "Dispatch attempts before a job is marked dead.")
    max_payload_bytes: int = _field(
        262_144, "Largest serialized task body accepted by `schedule`, in bytes."
    )
    shards: int = _field(1, "Number of shards jobs are spread over (by key hash).")
    shard: int = _field(0, "The shard this beat process competes to lead.")
    key_prefix: str = _field("celery_sched", "Prefix of every Redis key celery_sched writes.")
    staging_window: float = _field(
        60.0, "Seconds ahead of now that the leader stages due jobs into Redis."
    )
    sweep_interval: float = _field(
        5.0, "Seconds between fallback sweeps that claim due jobs straight from PostgreSQL."
    )
    max_tick: float = _field(1.0, "Longest the leader loop sleeps between checks, in seconds.")
    reconcile_interval: float = _field(5.0, "Seconds between reconciler passes in the leader.")
    worker_timeout: float = _field(
        180.0,
        "Seconds a worker process may go without a heartbeat before the leader's rescuer "
        "requeues its running jobs (marks succeeded those the idempotency ledger records "
        "as completed).",
    )
    # -- periodic schedules (the planner) --
    plan_horizon: float = _field(
        120.0,
        "Seconds ahead of now that the leader materializes periodic occurrences as jobs "
        "(keep it above staging_window).",
    )
    plan_batch_size: int = _field(1000, "Periodic schedules planned per planner transaction.")
    misfire_policy: str = _field(
        "once",
        "Default misfire policy of periodic schedules: `skip`, `once` (beat's behaviour) or `all`.",
    )
    misfire_grace: float = _field(
        5.0, "Seconds late an occurrence may be planned and still count as on time, not missed."
    )
    catchup_window: float = _field(
        3600.0, "With misfire `all`: missed occurrences older than this many seconds are not run."
    )
    max_catchup: int = _field(
        100, "With misfire `all`: the most missed occurrences of one schedule run after downtime."
    )
    retention: float = _field(
        7 * 86400.0, "Seconds finished jobs are kept before pruning (0 keeps them)."
    )
    prune_batch: int = _field(5000, "Rows deleted per pruning batch.")
    ledger_lease: float = _field(
        30.0,
        "Seconds a worker's hold on an idempotency key lasts unless renewed "
        "(renewed every lease/3 while the task runs); a dead worker's key is taken over after it.",
    )
    ledger_retention: float = _field(
        7 * 86400.0,
        "Seconds completed idempotency-ledger entries are kept before pruning (0 keeps them).",
    )
    ledger_max_result_bytes: int = _field(
        4096,
        "Largest JSON-encoded task result the ledger records for duplicates; "
        "larger or non-JSON results are not recorded.",
    )
    worker_fence: bool = _field(
        True,
        "Workers with tracking installed skip a delivery whose job is cancelled, dead, "
        "expired or succeeded, or was requeued since (one job-row read per delivery).",
    )
    pool_min_size: int = _field(1, "Minimum PostgreSQL connections kept in the pool.")
    pool_max_size: int = _field(
        8,
        "Maximum PostgreSQL connections in the pool. A leading beat claims a backlog on up to "
        "three of them at once, always leaving one free.",
    )
    connect_retries: int = _field(
        4, "Attempts for a transient database or Redis failure before giving up."
    )
    retry_backoff: float = _field(0.25, "First retry delay in seconds; doubles per attempt.")
    statement_timeout: float = _field(
        30.0, "PostgreSQL statement timeout in seconds for celery_sched's queries."
    )
    hostname: str = _field(
        "", "Name this dispatcher reports in task-sent events (default: celery_sched@<host>)."
    )

    def __post_init__(self) -> None:
        self.sqlalchemy_url()  # validates
        _check_redis_url(self.redis_url)
        if not self.db_schema.isidentifier():
            raise ConfigurationError(
                f"celery_sched_db_schema must be a plain identifier, got {self.db_schema!r}"
            )
        for name in (
            "lease_ttl",
            "visibility_timeout",
            "staging_window",
            "max_tick",
            "worker_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"celery_sched_{name} must be positive")
        for name in ("batch_size", "max_attempts", "max_payload_bytes", "shards", "prune_batch"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"celery_sched_{name} must be at least 1")
        self._check_planner()
        if not 0 <= self.shard < self.shards:
            raise ConfigurationError(
                f"celery_sched_shard must be in [0, {self.shards}), got {self.shard}"
            )
        if self.lease_safety_margin >= self.lease_ttl:
            raise ConfigurationError("celery_sched_lease_safety_margin must be below lease_ttl")
        # -- idempotency ledger --
        if not self.ledger_lease > 0:
            raise ConfigurationError("celery_sched_ledger_lease must be positive")
        if not self.ledger_retention >= 0:
            raise ConfigurationError("celery_sched_ledger_retention must be >= 0")
        if self.ledger_max_result_bytes < 0:
            raise ConfigurationError("celery_sched_ledger_max_result_bytes must be >= 0")
        if not self.hostname:
            object.__setattr__(self, "hostname", f"celery_sched@{socket.gethostname()}")

    def _check_planner(self) -> None:
        if self.plan_horizon <= 0:
            raise ConfigurationError("celery_sched_plan_horizon must be positive")
        if self.plan_batch_size < 1:
            raise ConfigurationError("celery_sched_plan_batch_size must be at least 1")
        if self.misfire_policy not in ("skip", "once", "all"):
            raise ConfigurationError(
                "celery_sched_misfire_policy must be 'skip', 'once' or 'all', "
                f"got {self.misfire_policy!r}"
            )
        for name in ("misfire_grace", "catchup_window", "max_catchup"):
            if getattr(self, name) < 0:
                raise ConfigurationError(f"celery_sched_{name} must not be negative")

    # -- construction -------------------------------------------------------

    @classmethod
    def from_app(cls, app: Any, **overrides: Any) -> Settings:
        """Read settings from a Celery app's configuration and the environment."""
        return cls.from_mapping(app.conf, os.environ, **overrides)

    @classmethod
    def from_mapping(
        cls,
        conf: Mapping[str, Any],
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> Settings:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            if field.name in overrides:
                values[field.name] = overrides[field.name]
                continue
            key = PREFIX + field.name
            raw = conf.get(key)
            if raw is None:
                raw = environ.get(key.upper())
            if raw is None:
                continue
            values[field.name] = _coerce(field, raw)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigurationError(f"unknown celery_sched settings: {sorted(unknown)}")
        return cls(**values)

    def __repr__(self) -> str:
        # Settings end up in tracebacks and debug logs: no URL shows a password.
        fields = ", ".join(
            f"{field.name}="
            + repr(
                sanitize_url(value)
                if field.name.endswith("_url") and isinstance(value, str)
                else value
            )
            for field in dataclasses.fields(self)
            for value in (getattr(self, field.name),)
        )
        return f"{type(self).__name__}({fields})"

    # -- derived ------------------------------------------------------------

    def sqlalchemy_url(self) -> URL:
        """The database URL, forced onto the psycopg 3 driver."""
        try:
            url = make_url(self.database_url)
        except (ArgumentError, ValueError) as exc:
            raise InvalidURL(
                f"celery_sched_database_url is not a valid URL: {sanitize_url(self.database_url)}"
            ) from exc
        backend = url.get_backend_name()
        if backend not in ("postgresql", "postgres"):
            raise InvalidURL(
                f"celery_sched_database_url must be a PostgreSQL URL, got {backend!r} in "
                f"{sanitize_url(self.database_url)}"
            )
        if not url.database:
            raise InvalidURL(
                f"celery_sched_database_url names no database: {sanitize_url(self.database_url)}"
            )
        return url.set(drivername="postgresql+psycopg")

    def libpq_conninfo(self) -> str:
        """The database URL as a libpq URI for raw psycopg connections."""
        return (
            self.sqlalchemy_url().set(drivername="postgresql").render_as_string(hide_password=False)
        )

    # Cached: every retried statement names its URL (the per-task ledger
    # statements included). The settings are frozen, so it cannot go stale.
    @functools.cached_property
    def safe_database_url(self) -> str:
        return sanitize_url(self.database_url)

    @functools.cached_property
    def safe_redis_url(self) -> str:
        return sanitize_url(self.redis_url)


def _coerce(field: dataclasses.Field[Any], raw: Any) -> Any:
    kind: type[Any] = type(field.default)
    if isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
        return raw
    try:
        if kind is bool:
            return str(raw).strip().lower() in ("1", "true", "yes", "on")
        return kind(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"celery_sched_{field.name} must be {kind.__name__}, got {raw!r}"
        ) from exc


def _check_redis_url(url: str) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix") or (
        parts.scheme != "unix" and not parts.hostname
    ):
        raise InvalidURL(f"celery_sched_redis_url is not a Redis URL: {sanitize_url(url)}")
    try:
        parts.port  # noqa: B018  (raises on a malformed port)
    except ValueError as exc:
        raise InvalidURL(f"celery_sched_redis_url has a bad port: {sanitize_url(url)}") from exc


#: A ``key=value`` parameter of a URL query or a libpq conninfo string.
_PARAMETER = re.compile(r"(?P<key>[^\s?&;=#]+)=(?P<value>[^\s&;#]*)")

#: Parameter names (case-insensitive substrings) whose values are secrets:
#: libpq's ``password`` and ``sslpassword``, redis-py's ``password``, and the
#: like of other drivers.
_SECRET_NAMES = ("password", "passwd", "pwd", "passphrase", "secret", "token")


def _mask_parameter(match: re.Match[str]) -> str:
    key = urllib.parse.unquote_plus(match["key"]).lower()
    if any(name in key for name in _SECRET_NAMES):
        return f"{match['key']}=***"
    return match.group()


def sanitize_url(url: str) -> str:
    """``url`` with every password replaced by ``***``; safe to log.

    Masks the password of the user part and the value of every
    password-like parameter (``?password=``, ``sslpassword=``, ...), in the
    query and wherever else ``key=value`` appears.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparsable url>"
    if password is not None:
        netloc = parts.netloc.rsplit("@", 1)[-1]
        user = parts.username or ""
        url = urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))
    if "=" not in url:
        return url
    return _PARAMETER.sub(_mask_parameter, url)
