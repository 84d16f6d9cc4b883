"""A beat whose Redis Cluster does not answer at start-up (#17): it comes up,
says why it cannot lead, keeps trying, and leads once the Cluster is there,
as it does when a plain Redis is down."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import client_for, spread_jobs
from tests.e2e.harness import wait_for
from tests.redis_topologies import unstarted_cluster_set

pytestmark = pytest.mark.slow


def test_a_beat_started_before_its_cluster_waits_for_it_and_then_leads(
    tmp_path: Path, redis_url: str, make_cluster: Any, e2e_settings: Any
) -> None:
    directory = tmp_path / "cluster"
    directory.mkdir()
    with unstarted_cluster_set(directory) as topology:
        settings = dataclasses.replace(e2e_settings, redis_url=topology.url)
        cluster = make_cluster(redis_url, settings)  # the broker is not the Cluster
        cluster.start_worker(concurrency=4)
        beat = cluster.start_beat("beat")
        wait_for(
            lambda: beat.output().count("Redis Cluster cannot be connected") >= 2,
            timeout=30,
            what="the beat to say, twice, that the Cluster cannot be reached",
        )
        output = beat.output()
        assert beat.alive(), output
        # It cannot list itself among the live beats, so it leads nothing yet.
        assert "cannot list this beat as alive" in output
        assert "sharing 1 shard(s)" in output
        assert cluster.leader() is None

        topology.start()
        wait_for(cluster.leader, timeout=30, what="a leader once the Cluster is up")
        jobs = spread_jobs(50, time.time() + 1, 2, tag="late-cluster")
        assert client_for(settings).schedule_many(jobs) == len(jobs)
        wait_for(
            lambda: {key for _i, key, _d, _r in cluster.runs()} >= {j["key"] for j in jobs},
            timeout=60,
            what="every job to run",
        )
        assert beat.alive()
        assert beat.output().count("leading with epoch") == 1
