"""Short chaos soaks in the suite, in two modes that between them cover every
dimension but one (``task`` alone: ``dense,clients`` mixes plain tasks and
``celery_sched.Task``): every invariant holds under seeded faults. The long
runs of every mode are by hand (``scripts/soak.sh --mode all``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.e2e.harness import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.integration]

MINUTES = 1.5
SEED = 13


@pytest.mark.timeout(330)
@pytest.mark.parametrize("mode", ["untracked,shards16", "tracked,dense,clients"])
def test_short_soak_has_no_violation(pg_url: str, mode: str) -> None:
    # The soak starts redis-server instances of its own: a missing binary is a
    # failure, as a missing service is (tests/conftest.py).
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; scripts/bootstrap.sh installs it")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.soak.runner",
            "--mode",
            mode,
            "--minutes",
            str(MINUTES),
            "--seed",
            str(SEED),
            "--settle",
            "60",
            # Faults closer together, so that 90 s still sees most kinds.
            "--fault-min",
            "6",
            "--fault-max",
            "10",
        ],
        cwd=ROOT,
        env={**os.environ, "CELERY_SCHED_TEST_DATABASE_URL": pg_url},
        capture_output=True,
        text=True,
        timeout=315,
        check=False,
    )
    lines = run.stdout.strip().splitlines()
    assert lines, f"the soak printed nothing (rc {run.returncode}):\n{run.stderr[-5000:]}"
    result = json.loads(lines[-1])
    print(run.stdout[-20000:])  # shown when the test fails
    assert result["mode"] == mode
    assert result["violations"] == [], json.dumps(result["violation_counts"])
    assert run.returncode == 0, run.stderr[-5000:]
    # The run exercised what it claims to.
    assert result["jobs_scheduled"] > 250
    assert len(result["faults"]) >= 5
    assert result["periodic"] and all(n["occurrences"] > 10 for n in result["periodic"].values())
    if "shards16" in mode:
        assert result["settings"]["shards"] == 16
    if "dense" in mode:
        assert result["partitions"] >= 150
    if "clients" in mode:
        assert result["clients"]["threads"] == 3 * result["settings"]["pool_max_size"]
        assert result["jobs_cancelled"] > 0 and result["jobs_future"] > 0
