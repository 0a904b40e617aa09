"""docker-compose.yml: producers on the trainer's host share its /dev/shm, sized."""

from __future__ import annotations

from pathlib import Path

from ruamel.yaml import YAML

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def test_producers_share_the_trainers_ipc_namespace_and_its_sized_shm() -> None:
    services = YAML(typ="safe").load(COMPOSE.read_text())["services"]
    assert services["producer"]["ipc"] == "service:trainer"
    assert services["trainer"]["ipc"] == "shareable"
    size = str(services["trainer"]["shm_size"])
    assert size.startswith("${SHM_SIZE:-") and size != "${SHM_SIZE:-64m}"  # not docker's 64 MB
    deploy = (COMPOSE.parent / "docs" / "deploy.md").read_text()
    assert "shm_size" in deploy and "SHM_SIZE" in deploy  # the sizing is documented
