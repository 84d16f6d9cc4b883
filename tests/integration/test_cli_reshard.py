"""``celery -A ... sched reshard`` as a real subprocess against PostgreSQL (issue 17)."""

from __future__ import annotations

import datetime as dt
import json
import uuid

import pytest

from celery_sched.client import Client
from celery_sched.models import JobStatus
from celery_sched.settings import Settings
from celery_sched.validation import shard_of_key
from tests.integration import cli_app
from tests.integration.test_cli import run_sched

pytestmark = pytest.mark.integration


def shards_of(client: Client, keys: list[str]) -> dict[str, int]:
    found = {}
    for key in keys:
        job = client.get(key)
        assert job is not None and job.status is JobStatus.PENDING, key
        found[key] = job.shard
    return found


def test_reshard_moves_rows_written_under_another_count(pg_url: str, pg_schema: str) -> None:
    keys = [f"r-{i}" for i in range(60)]
    old = Settings(database_url=pg_url, db_schema=pg_schema, shards=4)
    with Client(cli_app.app, settings=old, staging=False) as client:
        client.migrate()
        eta = client.store.now() + dt.timedelta(hours=1)
        client.schedule_many({"task": "cli_app.ping", "eta": eta, "key": key} for key in keys)
        # A keyless job: placed by its id's text.
        keyless = client.schedule("cli_app.ping", eta=eta)
    keys.append(keyless.key)
    misplaced = sum(1 for key in keys if shard_of_key(key, 4) != shard_of_key(key, 2))
    env = {"CELERY_SCHED_SHARDS": "2"}

    dry = run_sched(
        "reshard", "--dry-run", "--batch", "7", "--json",
        schema=pg_schema, database_url=pg_url, extra_env=env,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert (report["scanned"], report["moved"], report["dry_run"]) == (61, misplaced, True)
    with Client(cli_app.app, settings=old, staging=False) as client:
        assert shards_of(client, keys) == {key: shard_of_key(key, 4) for key in keys}
        assert client.store.placed_for() is None

    done = run_sched(
        "reshard", "--batch", "7", schema=pg_schema, database_url=pg_url, extra_env=env
    )
    assert done.returncode == 0, done.stderr
    assert f"moved {misplaced}." in done.stdout
    assert "shard 3 -> 1:" in done.stdout
    with Client(cli_app.app, settings=old, staging=False) as client:
        assert shards_of(client, keys) == {key: shard_of_key(key, 2) for key in keys}
        assert client.store.placed_for() == 2
        assert client.store.unfinished_by_shard(from_shard=2) == {}

    again = run_sched("reshard", "--json", schema=pg_schema, database_url=pg_url, extra_env=env)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["moved"] == 0


@pytest.mark.parametrize("batch", ["0", "lots"])
def test_reshard_refuses_a_bad_batch_in_one_line(pg_url: str, pg_schema: str, batch: str) -> None:
    result = run_sched("reshard", "--batch", batch, schema=pg_schema, database_url=pg_url)
    assert result.returncode == 2
    assert "Invalid value for '--batch'" in result.stderr
    assert "Traceback" not in result.stderr


def test_reshard_on_an_unreachable_database_says_so_in_one_line(pg_schema: str) -> None:
    url = f"postgresql://nobody@127.0.0.1:1/db_{uuid.uuid4().hex[:6]}"
    result = run_sched("reshard", schema=pg_schema, database_url=url)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    # (Above it, the retries logged at WARNING, as for every command.)
    assert result.stderr.strip().splitlines()[-1].startswith("Error: StoreUnavailable: ")
