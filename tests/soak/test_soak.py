"""A 3-minute chaos soak in the suite: every invariant holds under seeded faults."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.e2e.harness import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.integration]

MINUTES = 3
SEED = 13


@pytest.mark.timeout(330)
def test_three_minute_soak_has_no_violation(pg_url: str) -> None:
    # The soak starts redis-server instances of its own: a missing binary is a
    # failure, as a missing service is (tests/conftest.py).
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; scripts/bootstrap.sh installs it")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.soak.runner",
            "--minutes",
            str(MINUTES),
            "--seed",
            str(SEED),
            "--settle",
            "60",
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
    assert result["violations"] == [], json.dumps(result["violation_counts"])
    assert run.returncode == 0, run.stderr[-5000:]
    # The run exercised what it claims to.
    assert result["jobs_scheduled"] > 300
    assert len(result["faults"]) >= 7
    assert all(n["occurrences"] > 10 for n in result["periodic"].values())
