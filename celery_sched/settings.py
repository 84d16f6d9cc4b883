"""Settings: the only reader of ``app.conf`` and ``CELERY_SCHED_*`` variables.

A setting ``<name>`` is given in the app's configuration under any of these
keys: ``celery_sched_<name>``, ``CELERY_SCHED_<NAME>`` (what a Django project
or an upper-case settings module writes) and, under a namespace such as
Django's ``config_from_object("django.conf:settings", namespace="CELERY")``,
Celery's own namespaced key ``CELERY_CELERY_SCHED_<NAME>``. Precedence,
first found wins:

1. keyword arguments to :meth:`Settings.from_app` / :meth:`Settings.from_mapping`;
2. the app's configuration, in Celery's order: values set in code
   (``app.conf.x = ...``, ``app.conf.update``, ``Celery(...)`` arguments),
   then the configuration object or module, then ``app.add_defaults``; within
   one of these the keys above are tried in the order written (two keys with
   different values in one place draw a warning);
3. the environment variable ``CELERY_SCHED_<NAME>``;
4. the default.

A key of the app's configuration that looks like a celery_sched setting but
names none (``celery_sched_databse_url``, ``CELERY_SCHED_REDIS_ULR``, a casing
nothing reads) draws an :class:`IgnoredSettingWarning` naming the closest
valid key. The ``doc`` metadata of every field is the line the README's
configuration table shows.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import socket
import types
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from celery_sched.errors import ConfigurationError, InvalidURL
from celery_sched.redisconn import check_url as check_redis_url
from celery_sched.redisconn import is_cluster_url
from celery_sched.rediskeys import check_prefix
from celery_sched.urls import sanitize_url as sanitize_url  # re-exported: the callers' import

PREFIX = "celery_sched_"

#: :meth:`Settings.origin` of a value nothing was read for.
DEFAULT = "default"
#: :meth:`Settings.origin` of a keyword argument to ``from_app``/``from_mapping``.
ARGUMENT = "argument"


class IgnoredSettingWarning(UserWarning):
    """A key of the app's configuration is ignored: it looks like a
    celery_sched setting but names none, or another key in the same place
    gives the same setting a different value."""


def _host_and_port(host: str) -> tuple[str, str]:
    """``("h", "5432")`` of ``"h:5432"``, ``("h", "")`` of ``"h"``; an IPv6
    address is written in brackets (``[::1]:5432``)."""
    if host.endswith("]") or ":" not in host:
        return host.strip("[]"), ""
    name, _colon, port = host.rpartition(":")
    return name.strip("[]"), port


def _field(default: Any, doc: str, *, kind: type[Any] | None = None) -> Any:
    """A setting; ``kind`` is its type when the default (``None``: unset)
    does not say it."""
    metadata: dict[str, Any] = {"doc": doc}
    if kind is not None:
        metadata["kind"] = kind
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Every knob of celery_sched, with its default."""

    database_url: str = _field(
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
        "SQLAlchemy URL of the PostgreSQL job store (`postgresql+psycopg://...`).",
    )
    redis_url: str = _field(
        "redis://127.0.0.1:6379/0",
        "Redis URL for the leader lease and the staging set: `redis://`, `rediss://`, `unix://`, "
        "or Redis Sentinel as `redis+sentinel://[[user]:password@]host1:26379,host2/SERVICE"
        "[/DB][?sentinel_password=...&ssl=true]` (preferred) or Kombu's "
        "`sentinel://host1:26379;sentinel://host2:26379?master_name=SERVICE`, "
        "or Redis Cluster as `redis+cluster://[[user]:password@]host1:7000,host2:7001/` "
        "(seed nodes).",
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
    shard: int | None = _field(
        None,
        "Pin this beat to one shard (it competes for that shard only). Unset (the default), "
        "the beats share the `shards` shards between them, each leading at most "
        "ceil(shards / live beats).",
        kind=int,
    )
    key_prefix: str = _field(
        "celery_sched",
        "Prefix of every Redis key celery_sched writes (no `{` or `}`: a shard's keys carry "
        "the hash tag `{PREFIX:SHARD}`).",
    )
    legacy_lease_keys: bool = _field(
        True,
        "Also hold each shard's lease under its key from before hash tags "
        "(`PREFIX:lease:SHARD`), so beats of earlier versions never lead a shard beside "
        "this one during a rolling upgrade. Turn off once every beat is upgraded. Always "
        "off on a Redis Cluster (setting it true there is refused).",
    )
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
        5.0,
        "Seconds late an occurrence may be planned, or first sent, and still count as on time, "
        "not missed.",
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
    pgbouncer: bool = _field(
        False,
        "Connect through PgBouncer in transaction pooling mode: no start-up `options`, no "
        "prepared statements; timeouts and TimeZone are set per transaction (`SET LOCAL`).",
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
    fast_publish: str = _field(
        "auto",
        "`auto`: publish by celery_sched's own Redis LPUSH / py-amqp basic_publish where the "
        "transport, the kombu and amqp versions and a start-up comparison with Kombu's output "
        "allow it (else Kombu's publish, with a warning); `off`: always Kombu's publish.",
    )
    publish_confirms: bool = _field(
        True,
        "On RabbitMQ (py-amqp), publish with publisher confirms: each chunk of messages is "
        "published, then the broker's acks for all of it are awaited before its jobs count as "
        "sent; a nacked message's job is released to `pending`, and a chunk left unconfirmed "
        "(timeout, lost connection) is published again. `false` counts a message as sent once "
        "written to the socket: faster, but a message lost on the way (broker restart) waits "
        "for the reconciler's visibility timeout.",
    )
    publish_confirm_timeout: float = _field(
        10.0,
        "Seconds to wait for the broker to confirm a chunk (publisher confirms) before the "
        "chunk counts as not sent and is published again on a fresh connection.",
    )
    metrics_port: int = _field(
        0,
        "TCP port on which each beat serves `/metrics` (Prometheus), `/healthz` and `/readyz`, "
        "on every interface; 0 serves nothing.",
    )
    worker_metrics_port: int = _field(
        0,
        "TCP port on which a worker's main process serves `/metrics` for its processes "
        "(prometheus_client multiprocess mode); 0 serves nothing.",
    )
    web_auth: str = _field(
        "",
        "`user:password` the web console (`sched web`) asks for with HTTP Basic auth (compared "
        "in constant time); empty asks for none, allowed only on a loopback bind or with "
        "`--insecure`. `--auth` overrides it.",
    )
    web_allowed_hosts: tuple[str, ...] = _field(
        (),
        "Host names (`name` or `name:port`, comma-separated) the web console answers besides "
        "the loopback names and its bound address; any other Host header gets 400 (a "
        "DNS-rebinding page reaches the console under a name of its own). Needed behind a "
        "proxy or on a `0.0.0.0` bind. `--allowed-host` overrides it.",
    )
    # Not a setting: where each value was read from (see ``origin``).
    _origins: Mapping[str, str] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.sqlalchemy_url()  # validates
        check_redis_url(self.redis_url)
        try:
            check_prefix(self.key_prefix)
        except ValueError as exc:
            raise ConfigurationError(f"celery_sched_key_prefix: {exc}") from None
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
        if self.shard is not None and not 0 <= self.shard < self.shards:
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
        if not self.publish_confirm_timeout > 0:
            raise ConfigurationError("celery_sched_publish_confirm_timeout must be positive")
        if self.fast_publish not in ("auto", "off"):
            raise ConfigurationError(
                f"celery_sched_fast_publish must be 'auto' or 'off', got {self.fast_publish!r}"
            )
        for name in ("metrics_port", "worker_metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigurationError(
                    f"celery_sched_{name} must be a TCP port (1-65535) or 0 (off), "
                    f"got {getattr(self, name)}"
                )
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
        conf = app.conf
        # A pending configuration reads the config object on first access;
        # its maps are only there afterwards.
        if callable(getattr(conf, "finalize", None)):
            conf.finalize()
            conf = app.conf
        return cls.from_mapping(conf, os.environ, namespace=app.namespace, **overrides)

    @classmethod
    def from_mapping(
        cls,
        conf: Mapping[str, Any],
        environ: Mapping[str, str] | None = None,
        *,
        namespace: str | None = None,
        **overrides: Any,
    ) -> Settings:
        """Read settings from ``conf`` (a mapping, or Celery's ``app.conf``
        whose maps are read one by one), then ``environ``.

        ``namespace`` is the one given to ``config_from_object``: it adds
        Celery's namespaced keys (``CELERY_CELERY_SCHED_<NAME>``).
        """
        environ = os.environ if environ is None else environ
        fields = setting_fields()
        unknown = set(overrides) - {f.name for f in fields}
        if unknown:
            raise ConfigurationError(f"unknown celery_sched settings: {sorted(unknown)}")
        places = _places(conf)
        _warn_unknown_keys(places, namespace)
        values: dict[str, Any] = {}
        origins: dict[str, str] = {}
        for field in fields:
            if field.name in overrides:
                values[field.name] = overrides[field.name]
                origins[field.name] = ARGUMENT
                continue
            found = _lookup(places, setting_keys(field.name, namespace))
            if found is None:
                variable = (PREFIX + field.name).upper()
                raw = environ.get(variable)
                if raw is None:
                    origins[field.name] = DEFAULT
                    continue
                found = (f"environment {variable}", raw)
            origins[field.name], raw = found
            values[field.name] = _coerce(field, raw)
        settings = cls(**values)
        object.__setattr__(settings, "_origins", types.MappingProxyType(origins))
        settings._refuse_legacy_keys_on_cluster()
        return settings

    def _refuse_legacy_keys_on_cluster(self) -> None:
        # Only a value somebody gave is refused: the default (true) is simply
        # not applied to a Cluster (:attr:`hold_legacy_lease_keys`).
        if (
            self.legacy_lease_keys
            and is_cluster_url(self.redis_url)
            and self.origin("legacy_lease_keys") != DEFAULT
        ):
            raise ConfigurationError(
                "celery_sched_legacy_lease_keys cannot be true with a Redis Cluster "
                f"({self.origin('legacy_lease_keys')}): the legacy lease key and the "
                "hash-tagged one are in different slots, and no beat before hash tags "
                "ran on a Cluster; leave it unset or false"
            )

    # -- shards -------------------------------------------------------------

    @property
    def engine_shard(self) -> int:
        """The shard an :class:`~celery_sched.leader.Engine` given these
        settings leads: the pinned one, else 0. A beat that shares the shards
        (no pin) gives each of its engines settings pinned by :meth:`for_shard`."""
        return 0 if self.shard is None else self.shard

    def for_shard(self, shard: int) -> Settings:
        """These settings pinned to ``shard`` (where they came from kept)."""
        pinned = dataclasses.replace(self, shard=shard)
        object.__setattr__(pinned, "_origins", self._origins)
        return pinned

    def origin(self, name: str) -> str:
        """Where setting ``name`` came from: ``app config <key>``,
        ``environment <VARIABLE>``, ``argument``, ``default``, or ``code`` for
        settings built directly (``Settings(...)``, ``dataclasses.replace``)."""
        return self._origins.get(name, "code")

    def __repr__(self) -> str:
        # Settings end up in tracebacks and debug logs: no URL shows a password.
        fields = ", ".join(
            f"{field.name}="
            + repr(
                sanitize_url(value)
                if field.name.endswith("_url") and isinstance(value, str)
                # The console's password never reaches a log either.
                else ("***" if value else "")
                if field.name == "web_auth"
                else value
            )
            for field in setting_fields()
            for value in (getattr(self, field.name),)
        )
        return f"{type(self).__name__}({fields})"

    # -- derived ------------------------------------------------------------

    def sqlalchemy_url(self) -> URL:
        """The database URL, forced onto the psycopg 3 driver."""
        try:
            url = make_url(self.database_url)
        except (ArgumentError, ValueError) as exc:
            hint = ""
            if "," in self.database_url.partition("?")[0].rpartition("@")[2]:
                # libpq's own host list (`h1:5432,h2:5432` in the authority).
                hint = (
                    "; name several hosts as query parameters: "
                    "postgresql+psycopg://user@/db?host=h1:5432&host=h2:5432"
                    "&target_session_attrs=read-write"
                )
            raise InvalidURL(
                f"celery_sched_database_url is not a valid URL: "
                f"{sanitize_url(self.database_url)}{hint}"
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
        """The database URL as a libpq URI for raw psycopg connections.

        SQLAlchemy's multi-host form (``?host=h1:5432&host=h2:5433``)
        becomes libpq's lists (``?host=h1,h2&port=5432,5433``): libpq keeps
        only the last of repeated parameters.
        """
        url = self.sqlalchemy_url().set(drivername="postgresql")
        hosts = url.query.get("host")
        if isinstance(hosts, tuple) and len(hosts) > 1:
            pairs = [_host_and_port(host) for host in hosts]
            url = url.update_query_dict(
                {
                    "host": ",".join(name for name, _port in pairs),
                    # An empty port in libpq's list means the default one.
                    "port": ",".join(port for _name, port in pairs),
                }
            )
        return url.render_as_string(hide_password=False)

    # Cached: every retried statement names its URL (the per-task ledger
    # statements included). The settings are frozen, so it cannot go stale.
    @functools.cached_property
    def safe_database_url(self) -> str:
        return sanitize_url(self.database_url)

    @functools.cached_property
    def safe_redis_url(self) -> str:
        return sanitize_url(self.redis_url)

    @property
    def hold_legacy_lease_keys(self) -> bool:
        """Whether the lease holds the legacy key too: the setting, except on
        a Redis Cluster, where it is always off."""
        return self.legacy_lease_keys and not is_cluster_url(self.redis_url)


def setting_fields() -> tuple[dataclasses.Field[Any], ...]:
    """The fields of :class:`Settings` that are settings, in declaration order."""
    return tuple(field for field in dataclasses.fields(Settings) if field.init)


def setting_keys(name: str, namespace: str | None = None) -> tuple[str, ...]:
    """The keys of the app's configuration that give setting ``name``, in the
    order they are tried."""
    keys = [PREFIX + name, (PREFIX + name).upper()]
    if namespace:
        # Celery's ConfigurationView: the namespace, then the key in the
        # namespace's case (``match_case``).
        spaced = f"{namespace.rstrip('_')}_{PREFIX}{name}"
        keys.append(spaced.upper() if f"{namespace.rstrip('_')}_".isupper() else spaced.lower())
    return tuple(keys)


def _places(conf: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The mappings of ``conf`` in Celery's order of precedence.

    Read one by one and by exact key: a Celery ``Settings`` view would answer
    ``celery_sched_x`` with ``CELERY_CELERY_SCHED_X`` under a namespace, so
    which key a value came from would be lost.
    """
    maps = getattr(conf, "maps", None)
    return list(maps) if isinstance(maps, list) else [conf]


def _lookup(places: list[Mapping[str, Any]], keys: tuple[str, ...]) -> tuple[str, Any] | None:
    """``("app config <key>", value)`` of the first key given in the first
    place that gives one; ``None`` when no place does. ``None`` values count
    as not given."""
    for place in places:
        given = [(key, place[key]) for key in keys if key in place and place[key] is not None]
        if not given:
            continue
        key, value = given[0]
        others = [other for other, other_value in given[1:] if other_value != value]
        if others:
            warnings.warn(
                f"celery_sched: {key!r} and {', '.join(map(repr, others))} are both set in "
                f"one place of the app configuration, with different values; using {key!r}",
                IgnoredSettingWarning,
                stacklevel=4,
            )
        return f"app config {key}", value
    return None


def _keys(places: list[Mapping[str, Any]]) -> Iterator[str]:
    for place in places:
        for key in place:
            if isinstance(key, str):
                yield key


def _spelled_name(key: str, namespace: str | None) -> tuple[str, bool] | None:
    """``(name, namespaced)``: the setting name ``key`` spells, lower-cased,
    and whether it carries a namespace; ``None`` for a key that is no
    celery_sched key. ``CELERY_`` counts as a namespace even when none is
    configured: it is the one Django's docs use."""
    lowered = key.lower()
    for outer in (namespace, "celery"):
        if outer and lowered.startswith(f"{outer.rstrip('_').lower()}_{PREFIX}"):
            return lowered[len(outer.rstrip("_")) + 1 + len(PREFIX) :], True
    if lowered.startswith(PREFIX):
        return lowered[len(PREFIX) :], False
    return None


def _warn_unknown_keys(places: list[Mapping[str, Any]], namespace: str | None) -> None:
    """Warn about each key that looks like a celery_sched setting and is not read."""
    names = [field.name for field in setting_fields()]
    valid = {key for name in names for key in setting_keys(name, namespace)}
    for key in sorted(set(_keys(places)) - valid):
        spelled = _spelled_name(key, namespace)
        if spelled is None:
            continue
        name, namespaced = spelled
        close = [name] if name in names else difflib.get_close_matches(name, names, n=1)
        if close:
            lower, upper, *spaced = setting_keys(close[0], namespace)
            like = upper if key.isupper() else lower
            if namespaced and spaced and spaced[0].isupper() == key.isupper():
                like = spaced[0]
            hint = f"; did you mean {like!r}?"
        else:
            hint = ""
        warnings.warn(
            f"celery_sched ignores {key!r} in the app configuration (no setting has that "
            f"key){hint}",
            IgnoredSettingWarning,
            stacklevel=4,
        )


def _coerce(field: dataclasses.Field[Any], raw: Any) -> Any:
    kind: type[Any] = field.metadata.get("kind") or type(field.default)
    if kind is tuple:
        # A list in the app's configuration, a comma-separated string anywhere.
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, (list, tuple, set, frozenset)) or not all(
            isinstance(item, str) for item in items
        ):
            raise ConfigurationError(
                f"celery_sched_{field.name} must be a list of strings or a comma-separated "
                f"string, got {raw!r}"
            )
        return tuple(item.strip() for item in items if item.strip())
    if field.default is None and (raw is None or (isinstance(raw, str) and not raw.strip())):
        return None
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
