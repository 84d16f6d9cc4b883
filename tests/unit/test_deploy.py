"""The deployment files: .dockerignore, the Grafana dashboard and its
provisioning, the Kubernetes manifests.

Whether Prometheus answers every expression of the dashboard is
``tests/integration/test_prometheus_dashboard.py``; whether the image's
environment runs the example is ``tests/integration/test_image_env.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.integration.test_image_env import build_context, instructions
from tests.series import BEAT_SERIES, WORKER_SERIES

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "celery_sched.json"
KUBERNETES = DEPLOY / "kubernetes"
#: The oldest Kubernetes the manifests are checked against (PodDisruptionBudget
#: policy/v1 and every field used exist since 1.25).
KUBERNETES_VERSION = "1.30.0"

#: Every series of beats and workers: the dashboard shows each of them.
SERIES = (*BEAT_SERIES, *WORKER_SERIES)


# -- .dockerignore ----------------------------------------------------------------


def test_the_build_context_holds_the_package_and_example_and_nothing_local() -> None:
    context = build_context()
    for needed in (
        "pyproject.toml",
        "README.md",
        "celery_sched/__init__.py",
        "celery_sched/lease/lua/renew.lua",
        "celery_sched/store/migrations/env.py",
        "examples/proj/celery_app.py",
    ):
        assert needed in context, needed
    for top in (".venv", ".git", "tests", "benchmarks", ".mypy_cache", "deploy"):
        assert not any(path == top or path.startswith(top + "/") for path in context), top
    assert not [path for path in context if "__pycache__" in path or path.endswith(".pyc")]


def test_every_copy_of_the_dockerfile_finds_its_source_in_the_context() -> None:
    context = build_context()
    copies = [
        args.split()[:-1]
        for keyword, args in instructions(ROOT / "Dockerfile")
        if keyword == "COPY"
    ]
    assert copies, "no COPY in Dockerfile"
    for sources in copies:
        for source in sources:
            assert source in context, f"COPY {source}: excluded by .dockerignore"


def test_the_image_installs_the_extras_the_example_and_the_console_need() -> None:
    runs = [args for keyword, args in instructions(ROOT / "Dockerfile") if keyword == "RUN"]
    (pip,) = [run for run in runs if run.startswith("pip install")]
    match = re.search(r'"\.\[([a-z,]+)\]"', pip)
    assert match is not None, pip
    assert {"solar", "web"} <= set(match.group(1).split(",")), pip
    assert "solar(" in (ROOT / "examples" / "proj" / "celery_app.py").read_text()


# -- the Grafana dashboard ----------------------------------------------------------


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for panel in panels:
        found.append(panel)
        found.extend(_panels(panel.get("panels", [])))
    return found


def test_the_dashboard_has_one_datasource_variable_that_every_panel_uses() -> None:
    dashboard = _dashboard()
    (variable,) = dashboard["templating"]["list"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    panels = _panels(dashboard["panels"])
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    source = {"type": "prometheus", "uid": "${" + variable["name"] + "}"}
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == source, panel["title"]
        assert panel["targets"], panel["title"]
        assert panel["description"], panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == source, panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_the_dashboard_shows_every_series() -> None:
    exprs = " ".join(
        target["expr"]
        for panel in _panels(_dashboard()["panels"])
        for target in panel.get("targets", [])
    )
    used = set(re.findall(r"celery_sched_\w+", exprs))
    missing = [name for name in SERIES if name not in used]
    assert not missing, missing


def test_grafana_is_provisioned_with_the_dashboard_and_prometheus() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    # "host:container[:mode]" -> {container: host}
    mounts = {
        volume.split(":")[1]: volume.split(":")[0] for volume in compose["grafana"]["volumes"]
    }
    provisioning = ROOT / mounts["/etc/grafana/provisioning"].removeprefix("./")
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert "9090:9090" in compose["prometheus"]["ports"]
    boards = yaml.safe_load((provisioning / "dashboards" / "celery_sched.yml").read_text())
    (provider,) = boards["providers"]
    dashboards_dir = provider["options"]["path"]
    host_dir = ROOT / mounts[dashboards_dir].removeprefix("./")
    assert (host_dir / DASHBOARD.name).read_text() == DASHBOARD.read_text()
    home = compose["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_dir}/{DASHBOARD.name}"


# -- Kubernetes ------------------------------------------------------------------


def _manifests() -> list[tuple[Path, dict[str, Any]]]:
    found: list[tuple[Path, dict[str, Any]]] = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        found.extend((path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    return found


def _one(kind: str, component: str) -> dict[str, Any]:
    (doc,) = [
        doc
        for _path, doc in _manifests()
        if doc["kind"] == kind
        and doc["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    return doc


@pytest.mark.parametrize("path", sorted(KUBERNETES.glob("*.yaml")), ids=lambda path: path.name)
def test_each_manifest_is_valid_for_the_kubernetes_api(path: Path) -> None:
    """Strict: an unknown field (a misspelt probe) fails like a wrong type."""
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs, path
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_manifest_with_a_misspelt_field_is_refused() -> None:
    beat = json.loads(json.dumps(_one("Deployment", "beat")))
    container = beat["spec"]["template"]["spec"]["containers"][0]
    container["livenesProbe"] = container.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(beat, KUBERNETES_VERSION, strict=True)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


def test_two_beats_probe_healthz_and_readyz_on_their_metrics_port() -> None:
    beat = _one("Deployment", "beat")
    assert beat["spec"]["replicas"] == 2
    assert beat["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    template = beat["spec"]["template"]
    assert beat["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    assert container["command"][:6] == ["celery", "-A", "proj", "beat", "-S", "celery_sched"]
    port = int(_env(container)["CELERY_SCHED_METRICS_PORT"])
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": port}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port)


def test_the_disruption_budget_keeps_one_beat() -> None:
    budget = _one("PodDisruptionBudget", "beat")
    assert budget["spec"]["minAvailable"] == 1
    beat_labels = _one("Deployment", "beat")["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= beat_labels.items()


def test_every_pod_reads_the_services_from_the_secret() -> None:
    (secret,) = [doc for _path, doc in _manifests() if doc["kind"] == "Secret"]
    keys = set(secret["stringData"])
    compose_env = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["beat"][
        "environment"
    ]
    for kind, component in (("Deployment", "beat"), ("Deployment", "worker"), ("Job", "migrate")):
        (container,) = _one(kind, component)["spec"]["template"]["spec"]["containers"]
        env = _env(container)
        for name in ("CELERY_SCHED_DATABASE_URL", "CELERY_SCHED_REDIS_URL", "CELERY_BROKER_URL"):
            assert name in compose_env, name
            ref = env[name]["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"] and ref["key"] in keys, name
    worker = _one("Deployment", "worker")["spec"]["template"]
    (container,) = worker["spec"]["containers"]
    port = _env(container)["CELERY_SCHED_WORKER_METRICS_PORT"]
    assert worker["metadata"]["annotations"]["prometheus.io/port"] == port
