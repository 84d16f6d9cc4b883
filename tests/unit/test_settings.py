"""Settings: precedence, coercion, validation and password hiding."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from celery import Celery

from celery_sched.errors import ConfigurationError, InvalidURL
from celery_sched.settings import Settings, sanitize_url


def test_defaults() -> None:
    settings = Settings.from_mapping({}, {})
    assert settings.db_schema == "celery_sched"
    assert settings.lease_ttl == 10.0
    assert settings.visibility_timeout == 300.0
    assert settings.batch_size == 1000
    assert settings.hostname.startswith("celery_sched@")


def test_conf_beats_env_beats_default() -> None:
    env = {"CELERY_SCHED_BATCH_SIZE": "250", "CELERY_SCHED_LEASE_TTL": "20"}
    conf = {"celery_sched_batch_size": 50}
    settings = Settings.from_mapping(conf, env)
    assert settings.batch_size == 50  # conf wins over env
    assert settings.lease_ttl == 20.0  # env wins over default
    assert settings.visibility_timeout == 300.0  # default


def test_env_values_are_coerced() -> None:
    settings = Settings.from_mapping(
        {},
        {
            "CELERY_SCHED_VISIBILITY_TIMEOUT": "12.5",
            "CELERY_SCHED_SHARDS": "4",
            "CELERY_SCHED_SHARD": "3",
            "CELERY_SCHED_DB_SCHEMA": "jobs_x",
        },
    )
    assert settings.visibility_timeout == 12.5
    assert (settings.shards, settings.shard) == (4, 3)
    assert settings.db_schema == "jobs_x"


def test_overrides_beat_everything() -> None:
    settings = Settings.from_mapping(
        {"celery_sched_batch_size": 50}, {"CELERY_SCHED_BATCH_SIZE": "7"}, batch_size=3
    )
    assert settings.batch_size == 3


def test_unknown_override_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="unknown celery_sched settings"):
        Settings.from_mapping({}, {}, batchsize=3)


def test_from_app_reads_celery_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELERY_SCHED_MAX_ATTEMPTS", "8")
    monkeypatch.setenv("CELERY_SCHED_DB_SCHEMA", "from_env")
    app = Celery("settings_test", set_as_current=False)
    app.conf.celery_sched_db_schema = "from_conf"
    settings = Settings.from_app(app)
    assert settings.db_schema == "from_conf"
    assert settings.max_attempts == 8


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"CELERY_SCHED_BATCH_SIZE": "many"}, "celery_sched_batch_size must be int"),
        ({"CELERY_SCHED_LEASE_TTL": "ten"}, "celery_sched_lease_ttl must be float"),
        ({"CELERY_SCHED_BATCH_SIZE": "0"}, "batch_size must be at least 1"),
        ({"CELERY_SCHED_LEASE_TTL": "-1"}, "lease_ttl must be positive"),
        ({"CELERY_SCHED_SHARD": "2"}, r"shard must be in \[0, 1\)"),
        ({"CELERY_SCHED_DB_SCHEMA": "bad-name; drop"}, "plain identifier"),
        ({"CELERY_SCHED_LEASE_SAFETY_MARGIN": "11"}, "below lease_ttl"),
    ],
)
def test_bad_values_give_clear_errors(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        Settings.from_mapping({}, env)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("not a url", "not a valid URL"),
        ("mysql://root:hunter2@db/app", "must be a PostgreSQL URL"),
        ("postgresql+psycopg://u:hunter2@db:5432/", "names no database"),
    ],
)
def test_bad_database_urls(url: str, match: str) -> None:
    with pytest.raises(InvalidURL, match=match) as info:
        Settings(database_url=url)
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    "url", ["http://h:6379/0", "redis://:hunter2@/0", "redis://u:hunter2@h:port/0"]
)
def test_bad_redis_urls(url: str) -> None:
    with pytest.raises(InvalidURL, match="celery_sched_redis_url") as info:
        Settings(redis_url=url)
    assert "hunter2" not in str(info.value)


def test_database_url_is_forced_onto_psycopg() -> None:
    settings = Settings(database_url="postgresql://u:pw@db:5433/app")
    assert settings.sqlalchemy_url().drivername == "postgresql+psycopg"
    assert settings.libpq_conninfo() == "postgresql://u:pw@db:5433/app"


def test_multi_host_database_url_reaches_every_host_over_libpq() -> None:
    # SQLAlchemy's multi-host form (one `host=` per server): libpq keeps only
    # the last of repeated `host=` parameters, so the raw connections (the
    # worker's hot pool, the probe) must get comma-separated lists instead.
    url = (
        "postgresql+psycopg://u:hunter2@/app?host=db1:5432&host=db2:5433"
        "&target_session_attrs=read-write"
    )
    settings = Settings(database_url=url)
    params = psycopg.conninfo.conninfo_to_dict(settings.libpq_conninfo())
    assert params == {
        "user": "u",
        "password": "hunter2",
        "dbname": "app",
        "host": "db1,db2",
        "port": "5432,5433",
        "target_session_attrs": "read-write",
    }
    assert "hunter2" not in settings.safe_database_url


def test_multi_host_database_url_without_ports_keeps_default_port() -> None:
    settings = Settings(database_url="postgresql://u@/app?host=db1&host=db2:6000")
    params = psycopg.conninfo.conninfo_to_dict(settings.libpq_conninfo())
    assert (params["host"], params["port"]) == ("db1,db2", ",6000")


def test_libpq_multi_host_authority_gets_a_clear_error() -> None:
    # libpq's own list in the authority is no SQLAlchemy URL; say which form is.
    with pytest.raises(InvalidURL, match=r"host=h1:5432&host=h2:5432") as info:
        Settings(database_url="postgresql+psycopg://u:hunter2@db1:5432,db2:5432/app")
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql+psycopg://u:hunter2@db:5432/app", "postgresql+psycopg://u:***@db:5432/app"),
        ("redis://:hunter2@cache:6379/0", "redis://:***@cache:6379/0"),
        ("amqp://guest:p%40ss@mq//", "amqp://guest:***@mq//"),
        ("postgresql://u@db/app", "postgresql://u@db/app"),
        # Passwords given as query parameters (issue 13, defect 9).
        (
            "postgresql+psycopg://u@db/app?password=hunter2&sslmode=require",
            "postgresql+psycopg://u@db/app?password=***&sslmode=require",
        ),
        (
            "postgresql://u:hunter2@db/app?sslpassword=hunter2&application_name=x",
            "postgresql://u:***@db/app?sslpassword=***&application_name=x",
        ),
        ("redis://cache:6379/0?password=hunter2", "redis://cache:6379/0?password=***"),
        ("rediss://cache/0?db=1&PASSWORD=hunter2", "rediss://cache/0?db=1&PASSWORD=***"),
        ("redis://cache/0?pass%77ord=hunter2", "redis://cache/0?pass%77ord=***"),
        ("unix:///tmp/r.sock?db=0&password=hunter2", "unix:///tmp/r.sock?db=0&password=***"),
        ("amqp://mq//?auth_token=hunter2;heartbeat=5", "amqp://mq//?auth_token=***;heartbeat=5"),
        ("host=db password=hunter2 dbname=app", "host=db password=*** dbname=app"),
        ("postgresql://db/app?options=-c%20x%3Dy", "postgresql://db/app?options=-c%20x%3Dy"),
    ],
)
def test_sanitize_url_hides_passwords(url: str, expected: str) -> None:
    assert sanitize_url(url) == expected


def test_safe_urls_hide_passwords() -> None:
    settings = Settings(
        database_url="postgresql+psycopg://u:hunter2@db/app",
        redis_url="redis://:hunter2@cache:6379/0",
    )
    for text in (
        settings.safe_database_url,
        settings.safe_redis_url,
        repr(settings.safe_redis_url),
    ):
        assert "hunter2" not in text
        assert "***" in text


def test_safe_urls_hide_query_passwords() -> None:
    """Before: ``?password=`` went to the beat banner, the CLI and every log line."""
    settings = Settings(
        database_url="postgresql+psycopg://u@db/app?password=hunter2&sslpassword=hunter3",
        redis_url="redis://cache:6379/0?password=hunter4",
    )
    for text in (settings.safe_database_url, settings.safe_redis_url, repr(settings)):
        for secret in ("hunter2", "hunter3", "hunter4"):
            assert secret not in text
    assert settings.safe_database_url.endswith("?password=***&sslpassword=***")


def test_settings_repr_hides_passwords() -> None:
    settings = Settings(database_url="postgresql://u:hunter2@db/app", redis_url="redis://:x9@h/0")
    text = repr(settings)
    assert "hunter2" not in text and "x9" not in text
    assert "database_url='postgresql://u:***@db/app'" in text and "db_schema=" in text


def test_settings_are_frozen() -> None:
    settings = Settings()
    with pytest.raises(AttributeError):
        settings.batch_size = 5  # type: ignore[misc]


def _conf(**values: Any) -> dict[str, Any]:
    return {f"celery_sched_{k}": v for k, v in values.items()}


def test_conf_values_of_the_right_type_are_kept() -> None:
    settings = Settings.from_mapping(_conf(lease_ttl=3, retention=0.0, hostname="beat-1"), {})
    assert settings.lease_ttl == 3
    assert settings.retention == 0.0
    assert settings.hostname == "beat-1"
