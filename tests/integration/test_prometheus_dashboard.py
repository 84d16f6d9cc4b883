"""A real Prometheus scrapes a real beat and worker, and every expression of
the Grafana dashboard returns data from it.

Grafana cannot run here, so this is what can be checked for real: Debian's
``prometheus`` (2.42; scripts/bootstrap.sh installs it) runs with the scrape
jobs of deploy/prometheus/prometheus.yml, pointed at a ``celery beat -S
celery_sched`` (``CELERY_SCHED_METRICS_PORT``) and a prefork worker of
``celery_sched.Task`` tasks (``CELERY_SCHED_WORKER_METRICS_PORT``) on the
real PostgreSQL, Redis and broker, scraping both every second while jobs are
dispatched and run. Each ``expr`` of deploy/grafana/dashboards/celery_sched.json
is then asked of Prometheus's HTTP API and must return at least one finite
sample: a healthy system shows no empty panel.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.harness import ROOT, Proc, free_port, spawn, wait_for
from tests.e2e.test_worker_side_e2e import TaskCluster, make_task_cluster  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "celery_sched.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
#: The oldest Prometheus the dashboard's PromQL is checked against (Debian 12's).
MIN_VERSION = (2, 42)
#: What Grafana would put in for its variables; a range wide enough for rate()
#: over 1 s scrapes from the first seconds of the run.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "${__rate_interval}": "1m",
    "$__interval": "15s",
    "${__interval}": "15s",
    "$__range": "1h",
    "${__range}": "1h",
}


def prometheus_binary() -> str:
    """The ``prometheus`` server, at least :data:`MIN_VERSION`; fails (never
    skips) without one."""
    found = shutil.which("prometheus") or shutil.which("prometheus", path="/usr/bin")
    if found is None:
        pytest.fail(
            "the prometheus server is not installed: scripts/bootstrap.sh installs Debian's "
            "prometheus package when run as root (or: apt-get install prometheus)"
        )
    out = subprocess.run(
        [found, "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    match = re.search(r"version (\d+)\.(\d+)", out.stdout + out.stderr)
    assert match, out.stdout + out.stderr
    version = (int(match.group(1)), int(match.group(2)))
    assert version >= MIN_VERSION, f"{found} is {version}, the dashboard needs {MIN_VERSION}+"
    return found


def dashboard_expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every target of every panel, rows' panels
    included, with Grafana's variables substituted."""
    found: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                expr = target["expr"]
                for name, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(name, value)
                assert "$" not in expr, f"a variable the test does not know in {expr!r}"
                found.append((panel["title"], expr))

    walk(dashboard["panels"])
    return found


def scrape_config(beat_port: int, worker_port: int) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with its DNS discovery replaced by
    this test's processes, scraped every second."""
    config: dict[str, Any] = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {"celery_sched_beat": beat_port, "celery_sched_worker": worker_port}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(targets), set(jobs)
    for name, port in targets.items():
        job = jobs[name]
        del job["dns_sd_configs"]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
        job["scrape_interval"] = job["scrape_timeout"] = "1s"
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    return config


class Prometheus:
    """A private ``prometheus`` on a loopback port, storing in ``tmp_path``."""

    def __init__(self, binary: str, tmp_path: Path, config: dict[str, Any]) -> None:
        config_file = tmp_path / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Proc = spawn(
            "prometheus",
            [
                binary,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            log_dir=tmp_path,
            env=dict(os.environ),
        )

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as reply:
            return json.load(reply)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def targets_up(self) -> dict[str, str]:
        """``{job: health}`` of the active targets."""
        active = self.get("/api/v1/targets")["data"]["activeTargets"]
        return {target["labels"]["job"]: target["health"] for target in active}

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one sample) ``expr`` evaluates to now."""
        answer = self.get("/api/v1/query", query=expr)
        assert answer["status"] == "success", (expr, answer)
        data = answer["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def stop(self) -> None:
        self.proc.stop(10)


def finite(samples: list[dict[str, Any]]) -> list[float]:
    values = [float(sample["value"][1]) for sample in samples]
    return [value for value in values if math.isfinite(value)]


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], Prometheus]]:
    binary = prometheus_binary()
    started: list[Prometheus] = []

    def start(config: dict[str, Any]) -> Prometheus:
        server = Prometheus(binary, tmp_path, config)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
        print(server.proc.tail())  # shown by pytest only when the test failed


def test_every_dashboard_expression_returns_data_from_a_real_beat_and_worker(
    redis_url: str,
    make_task_cluster: Callable[[str], TaskCluster],  # noqa: F811
    prometheus_factory: Callable[[dict[str, Any]], Prometheus],
) -> None:
    expressions = dashboard_expressions(json.loads(DASHBOARD.read_text()))
    assert len(expressions) >= 20, expressions

    cluster = make_task_cluster(redis_url)
    beat_port, worker_port = free_port(), free_port()
    cluster.env["CELERY_SCHED_METRICS_PORT"] = str(beat_port)
    cluster.env["CELERY_SCHED_WORKER_METRICS_PORT"] = str(worker_port)
    beat = cluster.start_task_beat()
    worker = cluster.start_task_worker(concurrency=2, pool="prefork")

    # Jobs due from a second ago to 40 s ahead, so that dispatches (and the
    # lag and claim histograms) keep moving while Prometheus scrapes, and
    # some wait staged in Redis.
    now = time.time()
    rows = [
        {
            "task": "tasks.effect",
            "args": [f"p{i}"],
            "key": f"p{i}",
            "eta": dt.datetime.fromtimestamp(now - 1 + i * 0.2, dt.UTC),
        }
        for i in range(200)
    ]
    assert cluster.client.schedule_many(rows) == 200

    prometheus = prometheus_factory(scrape_config(beat_port, worker_port))
    wait_for(prometheus.ready, timeout=20, what="prometheus /-/ready")
    wait_for(
        lambda: prometheus.targets_up() == {"celery_sched_beat": "up", "celery_sched_worker": "up"},
        timeout=30,
        what="both targets up",
    )

    def answers() -> dict[str, list[float]]:
        return {expr: finite(prometheus.query(expr)) for _title, expr in expressions}

    def all_answered() -> dict[str, list[float]] | None:
        got = answers()
        return got if all(got.values()) else None

    try:
        got = wait_for(all_answered, timeout=40, interval=1.0, what="every expression")
    except TimeoutError:
        empty = [f"{title}: {expr}" for title, expr in expressions if not answers()[expr]]
        pytest.fail(f"no data for {empty}\n--- beat\n{beat.tail()}\n--- worker\n{worker.tail()}")

    # The values say the system is healthy, not just present.
    assert got["sum(celery_sched_leader)"] == [1.0]
    assert got["sum(rate(celery_sched_dispatched_total[1m]))"][0] > 0
    outcomes = {
        sample["metric"]["outcome"]: float(sample["value"][1])
        for sample in prometheus.query("celery_sched_ledger_outcomes_total")
    }
    # Exported from the start at 0 (an outage never happened), the others run.
    assert outcomes["unavailable"] == 0, outcomes
    assert outcomes["acquired"] >= 1, outcomes
    lag_p99 = prometheus.query(
        "histogram_quantile(0.99, sum by (le) (rate(celery_sched_dispatch_lag_seconds_bucket[1m])))"
    )
    assert 0 <= finite(lag_p99)[0] < 30, lag_p99


def test_the_compose_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    """deploy/prometheus/prometheus.yml as Prometheus reads it (DNS discovery
    included, which the test above replaces); a broken copy is refused."""
    promtool = Path(prometheus_binary()).with_name("promtool")
    assert promtool.exists(), "promtool comes with Debian's prometheus package"

    def check(path: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(promtool), "check", "config", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )

    checked = check(PROMETHEUS_CONFIG)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    broken = tmp_path / "prometheus.yml"
    broken.write_text(PROMETHEUS_CONFIG.read_text().replace("type: A", "type: AAAAA", 1))
    assert check(broken).returncode != 0
