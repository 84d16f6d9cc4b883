"""``benchmarks/cost.py``'s stages at a tiny size against the real PostgreSQL and Redis.

Not a timing test: it checks that every stage runs the project's own code to
the end (each stage asserts what it did: every job built, written, claimed,
published, checked, taken, reported succeeded) and that the table and the
JSON carry every stage with a positive figure, so an entry point that
changes breaks this test instead of the cost table.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def cost() -> Iterator[ModuleType]:
    # Loaded once: its Celery app registers its task name once per process.
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("cost_benchmark", BENCHMARKS / "cost.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("cost_benchmark", None)
        sys.path.remove(str(BENCHMARKS))


def test_every_stage_has_a_positive_cost(cost: ModuleType, pg_url: str, redis_url: str) -> None:
    stages = cost.measure(300, pg_url=pg_url, redis_url=redis_url)

    assert list(stages) == list(cost.STAGES)
    assert set(cost.STAGES) == {
        "client_build",
        "copy",
        "staging",
        "claim",
        "publish",
        "broker",
        "fence",
        "status",
        "ledger",
    }
    for name, stage in stages.items():
        assert stage.jobs >= 300, name
        assert stage.row()["us_per_job"] > 0, name
        assert stage.client_cpu >= 0, name
    # The PostgreSQL stages found the run's backends (by application name).
    for name in ("copy", "staging", "claim", "fence", "status", "ledger"):
        assert stages[name].pg_cpu is not None, name
    assert stages["broker"].push_wall is not None and stages["broker"].push_wall > 0


def test_the_table_and_the_json_name_every_stage(
    cost: ModuleType, pg_url: str, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cost.main(["--jobs", "200", "--pg-url", pg_url, "--redis-url", redis_url])
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])

    assert result["benchmark"] == "cost"
    assert list(result["us_per_job"]) == list(cost.STAGES)
    assert all(value > 0 for value in result["us_per_job"].values()), result["us_per_job"]
    assert result["raw_lpush_us_per_job"] > 0
    table = "\n".join(lines[:-1])
    for stage in cost.STAGES:
        assert any(line.startswith(stage) for line in table.splitlines()), stage
