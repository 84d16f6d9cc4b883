"""Settings: every name a user may write, their precedence, misspelled names,
and where each value came from (issue 15, point 2).

A Django project configures Celery with ``config_from_object(
"django.conf:settings", namespace="CELERY")`` and writes
``CELERY_SCHED_DATABASE_URL``; a plain upper-case settings module writes the
same name without a namespace. Both used to be ignored without a word.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import warnings
from typing import Any

import pytest
from celery import Celery

from celery_sched.beat import Scheduler
from celery_sched.errors import ConfigurationError
from celery_sched.settings import IgnoredSettingWarning, Settings

#: A valid value, different from the default, for the settings whose
#: non-default value cannot be derived from their type.
SPECIAL = {
    "database_url": "postgresql+psycopg://jobs:hunter2@db.example:5433/jobs",
    "redis_url": "redis://:hunter3@cache.example:6380/4",
    "db_schema": "custom_schema",
    "misfire_policy": "all",
    "shards": 3,
    "shard": 2,
    "fast_publish": "off",
    "web_allowed_hosts": ("console.example.com", "10.0.0.5:8808"),
}


def _setting_fields() -> list[dataclasses.Field[Any]]:
    return [field for field in dataclasses.fields(Settings) if field.init]


def _custom_values() -> dict[str, Any]:
    """A valid, non-default value for every setting."""
    values: dict[str, Any] = {}
    for field in _setting_fields():
        default = field.default
        if field.name in SPECIAL:
            values[field.name] = SPECIAL[field.name]
        elif isinstance(default, bool):
            values[field.name] = not default
        elif isinstance(default, int):
            values[field.name] = default + 2
        elif isinstance(default, float):
            values[field.name] = default + 1.5
        else:
            values[field.name] = f"custom_{field.name}"
    return values


@pytest.fixture(autouse=True)
def _no_settings_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for field in _setting_fields():
        monkeypatch.delenv(f"CELERY_SCHED_{field.name.upper()}", raising=False)


def _app(config: dict[str, Any] | None = None, namespace: str | None = None) -> Celery:
    """An app configured as ``config_from_object`` does it: from an object
    whose attributes are the settings (a module, Django's settings)."""
    app = Celery("sources_test", set_as_current=False)
    if config is not None:
        app.config_from_object(types.SimpleNamespace(**config), namespace=namespace)
    return app


def _read(app: Celery, **overrides: Any) -> Settings:
    # Any warning here is a failure unless the test expects it.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return Settings.from_app(app, **overrides)


# -- every form is read ---------------------------------------------------------------


FORMS = [
    # (namespace, how a setting name is written)
    pytest.param(None, "celery_sched_{name}", id="lower-case"),
    pytest.param(None, "CELERY_SCHED_{NAME}", id="upper-case module"),
    pytest.param("CELERY", "CELERY_SCHED_{NAME}", id="django CELERY namespace"),
    pytest.param("CELERY", "CELERY_CELERY_SCHED_{NAME}", id="celery's namespaced key"),
    pytest.param("CELERY", "celery_sched_{name}", id="lower-case under a namespace"),
]


@pytest.mark.parametrize(("namespace", "form"), FORMS)
def test_every_setting_is_read_in_every_form(namespace: str | None, form: str) -> None:
    values = _custom_values()
    config = {form.format(name=name, NAME=name.upper()): value for name, value in values.items()}
    settings = _read(_app({"broker_url": "memory://", **config}, namespace))
    for name, value in values.items():
        assert getattr(settings, name) == value, name
        assert settings.origin(name) == "app config " + form.format(name=name, NAME=name.upper())


def test_a_plain_upper_case_settings_module_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """``config_from_object("proj.celeryconfig")`` with upper-case names."""
    module = types.ModuleType("proj_celeryconfig_test")
    module.CELERY_SCHED_DATABASE_URL = "postgresql+psycopg://u:pw@db.example/app"  # type: ignore[attr-defined]
    module.CELERY_SCHED_REDIS_URL = "redis://cache.example:6379/7"  # type: ignore[attr-defined]
    module.CELERY_SCHED_LEASE_TTL = 20  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    app = Celery("module_test", set_as_current=False)
    app.config_from_object(module.__name__)
    settings = _read(app)
    assert settings.database_url == "postgresql+psycopg://u:pw@db.example/app"
    assert settings.redis_url == "redis://cache.example:6379/7"
    assert settings.lease_ttl == 20.0


def test_a_list_setting_reads_a_list_or_a_comma_separated_string() -> None:
    hosts = ("console.example.com", "10.0.0.5:8808")
    env = {"CELERY_SCHED_WEB_ALLOWED_HOSTS": " console.example.com , 10.0.0.5:8808,"}
    assert Settings.from_mapping({}, env).web_allowed_hosts == hosts
    listed = {"celery_sched_web_allowed_hosts": list(hosts)}
    assert Settings.from_mapping(listed, {}).web_allowed_hosts == hosts
    assert Settings.from_mapping({}, {}).web_allowed_hosts == ()
    with pytest.raises(ConfigurationError, match="web_allowed_hosts must be a list of strings"):
        Settings.from_mapping({"celery_sched_web_allowed_hosts": [1, 2]}, {})


# -- precedence -------------------------------------------------------------------------


def test_django_style_app_config_beats_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELERY_SCHED_BATCH_SIZE", "250")
    monkeypatch.setenv("CELERY_SCHED_LEASE_TTL", "20")
    app = _app({"CELERY_SCHED_BATCH_SIZE": 50}, namespace="CELERY")
    settings = _read(app, max_attempts=9)
    assert settings.batch_size == 50
    assert settings.origin("batch_size") == "app config CELERY_SCHED_BATCH_SIZE"
    assert settings.lease_ttl == 20.0
    assert settings.origin("lease_ttl") == "environment CELERY_SCHED_LEASE_TTL"
    assert settings.max_attempts == 9
    assert settings.origin("max_attempts") == "argument"
    assert settings.origin("visibility_timeout") == "default"


def test_a_value_set_in_code_beats_the_config_object() -> None:
    """Celery's own rule: ``app.conf`` assignments override the config object,
    whatever form either is written in."""
    app = _app({"CELERY_SCHED_BATCH_SIZE": 50}, namespace="CELERY")
    app.conf.celery_sched_batch_size = 5
    settings = _read(app)
    assert settings.batch_size == 5
    assert settings.origin("batch_size") == "app config celery_sched_batch_size"


def test_two_forms_with_different_values_in_one_place_warn() -> None:
    app = _app(
        {"celery_sched_batch_size": 5, "CELERY_SCHED_BATCH_SIZE": 6, "CELERY_SCHED_SHARDS": 2},
        namespace="CELERY",
    )
    with pytest.warns(IgnoredSettingWarning) as caught:
        settings = Settings.from_app(app)
    assert settings.batch_size == 5
    assert settings.shards == 2
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 1, messages
    assert "celery_sched_batch_size" in messages[0]
    assert "CELERY_SCHED_BATCH_SIZE" in messages[0]


# -- misspelled names -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("namespace", "key", "suggestion"),
    [
        (None, "celery_sched_databse_url", "celery_sched_database_url"),
        (None, "CELERY_SCHED_REDIS_ULR", "CELERY_SCHED_REDIS_URL"),
        ("CELERY", "CELERY_SCHED_REDIS_ULR", "CELERY_SCHED_REDIS_URL"),
        ("CELERY", "CELERY_CELERY_SCHED_LEASE_TL", "CELERY_CELERY_SCHED_LEASE_TTL"),
        ("CELERY", "celery_sched_batchsize", "celery_sched_batch_size"),
        # The right words in a casing nothing reads.
        (None, "Celery_Sched_Database_Url", "celery_sched_database_url"),
        ("CELERY", "celery_celery_sched_shards", "celery_sched_shards"),
        # Celery's namespaced form without the namespace.
        (None, "CELERY_CELERY_SCHED_DATABASE_URL", "CELERY_SCHED_DATABASE_URL"),
    ],
)
def test_a_misspelled_name_warns_with_the_closest_valid_one(
    namespace: str | None, key: str, suggestion: str
) -> None:
    app = _app({"broker_url": "memory://", key: "x"}, namespace)
    with pytest.warns(IgnoredSettingWarning) as caught:
        Settings.from_app(app)
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 1, messages
    assert repr(key) in messages[0]
    assert f"did you mean {suggestion!r}" in messages[0]


def test_a_misspelled_name_set_in_code_warns() -> None:
    app = Celery("typo_test", set_as_current=False)
    app.conf.celery_sched_lease_tll = 3
    with pytest.warns(
        IgnoredSettingWarning, match="'celery_sched_lease_tll'.*'celery_sched_lease_ttl'"
    ):
        Settings.from_app(app)


def test_a_name_close_to_nothing_still_warns() -> None:
    app = _app({"celery_sched_frobnicate": 1})
    with pytest.warns(IgnoredSettingWarning, match="ignores 'celery_sched_frobnicate'") as caught:
        Settings.from_app(app)
    assert "did you mean" not in str(caught[0].message)


def test_environment_variables_are_not_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the app configuration's keys are: the environment holds every
    process's variables, celery_sched's or not."""
    monkeypatch.setenv("CELERY_SCHED_DATABSE_URL", "postgresql://u@db/app")
    app = _app({"CELERY_SCHED_BATCH_SIZ": 5}, namespace="CELERY")
    with pytest.warns(IgnoredSettingWarning) as caught:
        Settings.from_app(app)
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 1, messages
    assert "'CELERY_SCHED_BATCH_SIZ'" in messages[0]


def test_other_settings_draw_no_warning() -> None:
    config = {
        "CELERY_BROKER_URL": "memory://",
        "CELERY_BEAT_SCHEDULER": "celery_sched",
        "CELERY_SCHEDULE_EXTRA": 1,
        "CELERY_SCHED_REDIS_URL": "redis://cache:6379/1",
    }
    settings = _read(_app(config, namespace="CELERY"))
    assert settings.redis_url == "redis://cache:6379/1"


# -- the beat banner --------------------------------------------------------------------


def test_beat_banner_says_where_each_url_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELERY_SCHED_REDIS_URL", "redis://:hunter3@cache.example:6379/2")
    app = _app(
        {"CELERY_SCHED_DATABASE_URL": "postgresql+psycopg://u:hunter2@db.example/app"},
        namespace="CELERY",
    )
    info = Scheduler(app, lazy=True).info
    store = next(line for line in info.splitlines() if ". store ->" in line)
    redis = next(line for line in info.splitlines() if ". redis ->" in line)
    assert "postgresql+psycopg://u:***@db.example/app" in store
    assert "from app config CELERY_SCHED_DATABASE_URL" in store
    assert "redis://:***@cache.example:6379/2" in redis
    assert "from environment CELERY_SCHED_REDIS_URL" in redis
    assert "hunter" not in info


def test_beat_banner_says_when_a_url_is_the_default() -> None:
    info = Scheduler(_app({"broker_url": "memory://"}), lazy=True).info
    store = next(line for line in info.splitlines() if ". store ->" in line)
    redis = next(line for line in info.splitlines() if ". redis ->" in line)
    assert "from default" in store
    assert "from default" in redis
