"""docker-compose.yml, the Dockerfile and Prometheus' config, checked without Docker.

The compose file is validated offline against the compose-spec JSON schema that
check-jsonschema bundles (no network: proxies pointing nowhere prove it), then its
structure is checked against what docs/deploy.md promises. tests/deploy/test_stack.py
runs its commands.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from batchq.cli.factory_args import load_factory
from batchq.client.urls import parse_target

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
SERVICES = {"redis", "producer", "trainer", "exporter", "prometheus", "grafana"}
CLUSTER_NODES = {"redis-node-1", "redis-node-2", "redis-node-3"}
CLUSTER = {*CLUSTER_NODES, "cluster-init", "producer-cluster", "trainer-cluster"}


def load_yaml(path: Path) -> Any:
    return YAML(typ="safe").load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = load_yaml(COMPOSE)
    return loaded


def check_compose(path: Path) -> subprocess.CompletedProcess[str]:
    """Validate ``path`` with check-jsonschema's bundled compose-spec schema, offline."""
    env = dict(os.environ)
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        env[proxy] = "http://127.0.0.1:9"  # any download attempt fails at once
    argv = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
    return subprocess.run(
        [*argv, str(path)], capture_output=True, text=True, env=env, timeout=60, check=False
    )


# -- the schema ----------------------------------------------------------------------------


def test_the_compose_file_follows_the_compose_spec() -> None:
    result = check_compose(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_schema_check_catches_mistakes(tmp_path: Path) -> None:
    text = COMPOSE.read_text()
    broken = {
        "unknown key": text.replace("  producer:\n", "  producer:\n    replicas_typo: 4\n", 1),
        "wrong type": text.replace(
            "\n    restart: on-failure\n", "\n    restart: [on-failure]\n", 1
        ),
    }
    for what, content in broken.items():
        assert content != text, what
        path = tmp_path / "docker-compose.yml"
        path.write_text(content)
        result = check_compose(path)
        assert result.returncode == 1, f"{what} was not caught: {result.stdout}{result.stderr}"


# -- the structure -------------------------------------------------------------------------


def _after(command: list[str], flag: str) -> str:
    assert flag in command, f"{flag} missing from {command}"
    return command[command.index(flag) + 1]


def test_the_services_and_the_monitoring_profile(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == SERVICES | CLUSTER
    profiled = {name for name, s in services.items() if s.get("profiles")}
    assert profiled == {"prometheus", "grafana"} | CLUSTER
    assert all(services[n]["profiles"] == ["monitoring"] for n in ("prometheus", "grafana"))
    assert all(services[n]["profiles"] == ["cluster"] for n in CLUSTER)


def test_redis_never_evicts_persists_nothing_by_default_and_has_a_healthcheck(
    compose: dict[str, Any],
) -> None:
    redis = compose["services"]["redis"]
    assert re.fullmatch(r"redis:7(\.\d+)*(-\w+)?", redis["image"])
    command = redis["command"]
    assert command[0] == "redis-server"
    assert _after(command, "--maxmemory-policy") == "noeviction"
    assert _after(command, "--maxmemory").startswith("${REDIS_MAXMEMORY:-")
    assert _after(command, "--save") == ""
    assert _after(command, "--appendonly") == "no"
    # The append-only option is there, commented out, with the volume it needs.
    assert re.search(r'#\s*- --appendonly\n\s*#\s*- "yes"', COMPOSE.read_text())
    assert "#   - redis-data:/data" in COMPOSE.read_text()
    health = redis["healthcheck"]
    assert health["test"] == ["CMD", "redis-cli", "ping"]
    assert {"interval", "timeout", "retries"} <= set(health)
    assert "ports" not in redis  # only the stack's network reaches Redis


def test_the_batchq_services(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))  # /app on the image's PYTHONPATH
    services = compose["services"]
    for name in ("producer", "trainer", "exporter"):
        service = services[name]
        assert service["build"] == {"context": ".", "dockerfile": "Dockerfile"}
        assert service["depends_on"] == {"redis": {"condition": "service_healthy"}}
        assert service["environment"]["BATCHQ_URL"] == "${BATCHQ_URL:-redis://redis:6379/0}"
        assert service["init"] is True

    producer = services["producer"]
    assert producer["command"][:2] == ["batchq", "serve"]
    assert callable(load_factory(producer["command"][2]))
    assert producer["restart"] == "on-failure"  # exit 0 (run finished) stays down
    assert str(producer["deploy"]["replicas"]).startswith("${PRODUCERS:-")

    trainer = services["trainer"]
    assert trainer["command"] == ["python", "-m", "examples.train"]
    assert trainer["restart"] == "no"
    assert {"BATCHQ_EPOCHS", "BATCHQ_TRAIN_MS"} <= set(trainer["environment"])

    exporter = services["exporter"]["command"]
    assert exporter[:2] == ["batchq", "exporter"]
    assert _after(exporter, "--port") == "9108"
    assert _after(exporter, "--host") == "0.0.0.0"  # reachable by Prometheus' container


def test_the_cluster_profile_runs_the_job_on_three_masters_striped(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = compose["services"]
    for name in CLUSTER_NODES:  # as the single server, with cluster mode on
        node = services[name]
        command = node["command"]
        assert re.fullmatch(r"redis:7(\.\d+)*(-\w+)?", node["image"])
        assert _after(command, "--cluster-enabled") == "yes"
        assert _after(command, "--maxmemory-policy") == "noeviction"
        assert _after(command, "--save") == "" and _after(command, "--appendonly") == "no"
        assert "+cluster" in command and "-@dangerous" in command
        assert node["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
        assert "ports" not in node
    init = services["cluster-init"]
    script = " ".join(init["command"])
    assert "redis-cli --cluster create --cluster-yes" in script
    assert all(f"getent hosts {n} " in script for n in CLUSTER_NODES)  # MEET wants addresses
    assert set(init["depends_on"]) == CLUSTER_NODES
    monkeypatch.syspath_prepend(str(ROOT))
    for name in ("producer-cluster", "trainer-cluster"):
        service = services[name]
        assert service["depends_on"] == {
            "cluster-init": {"condition": "service_completed_successfully"}
        }
        env = service["environment"]
        default_url = re.fullmatch(r"\$\{BATCHQ_CLUSTER_URL:-(.+)\}", env["BATCHQ_URL"])
        assert default_url is not None
        target = parse_target(default_url.group(1))
        assert target.kind == "cluster"
        assert {host for host, _ in target.nodes} == CLUSTER_NODES
        assert env["BATCHQ_STRIPES"] == "${BATCHQ_STRIPES:-3}"
    producer = services["producer-cluster"]
    assert producer["command"] == services["producer"]["command"]
    assert callable(load_factory(producer["command"][2]))
    assert producer["ipc"] == "service:trainer-cluster"
    assert services["trainer-cluster"]["command"] == services["trainer"]["command"]


def test_published_ports_are_on_loopback_only(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port}"


def test_monitoring_mounts_prometheus_and_grafana_config_from_deploy(
    compose: dict[str, Any],
) -> None:
    mounts = {}
    for name in ("prometheus", "grafana"):
        for volume in compose["services"][name]["volumes"]:
            source, target, mode = volume.split(":")
            assert mode == "ro"
            mounts[source] = target
    assert mounts == {
        "./deploy/prometheus/prometheus.yml": "/etc/prometheus/prometheus.yml",
        "./deploy/prometheus/alerts.yml": "/etc/prometheus/alerts.yml",
        "./deploy/grafana/provisioning": "/etc/grafana/provisioning",
        "./deploy/grafana/dashboards": "/var/lib/grafana/dashboards",
    }
    missing = [source for source in mounts if not (ROOT / source).exists()]
    assert not missing, f"compose mounts {missing}, which do not exist"


def test_prometheus_scrapes_the_exporter_and_loads_the_alerts(compose: dict[str, Any]) -> None:
    config = load_yaml(PROMETHEUS)
    port = _after(compose["services"]["exporter"]["command"], "--port")
    (job,) = config["scrape_configs"]
    assert [t for s in job["static_configs"] for t in s["targets"]] == [f"exporter:{port}"]
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]


# -- the image -----------------------------------------------------------------------------


def test_the_image_is_slim_runs_as_a_user_and_has_no_test_extras() -> None:
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM (\S+)", text, flags=re.MULTILINE)
    assert stages and all(re.fullmatch(r"python:3\.\d+-slim(-\w+)?", s.split()[0]) for s in stages)
    runtime = text[text.rindex("\nFROM ") :]
    users = re.findall(r"^USER (\S+)", runtime, flags=re.MULTILINE)
    assert users and users[-1] not in ("root", "0")
    assert not re.search(r"\[[^\]]*\b(test|dev)\b", text)  # no test or dev extras
    assert "PYTHONPATH=/app" in runtime  # `batchq serve examples.tutorial:...` imports


def test_the_build_context_holds_what_the_dockerfile_copies() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "**"  # everything else stays out
    included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied: set[str] = set()
    for line in re.findall(r"^COPY (?!--from)(.+)$", DOCKERFILE.read_text(), flags=re.MULTILINE):
        copied.update(part.rstrip("/") for part in line.split()[:-1])
    assert copied == included
    assert all((ROOT / path).exists() for path in copied)
