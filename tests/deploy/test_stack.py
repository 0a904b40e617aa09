"""The docker-compose stack without Docker: its exact service commands, as processes.

The commands, environments and Redis arguments are read from docker-compose.yml (with
compose's ``${VAR:-default}`` defaults), so this test cannot drift from the stack:
a redis-server with the ``redis`` service's arguments (on a free loopback port), three
``producer`` replicas, the ``exporter`` and the ``trainer``. The trainer finishes its
epochs, every producer exits 0 by itself (what ends ``docker compose up``), and the
exporter reports the finished epochs. deploy/run_stack.sh, which does the same for a
person, runs too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from ruamel.yaml import YAML
from waiting import wait_until

from batchq.host.embedded import EmbeddedRedis

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
PRODUCERS = 3
_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?-)([^}]*))?\}")


def interpolate(value: Any) -> str:
    """Compose's ``$$``, ``${VAR}`` and ``${VAR:-default}`` with nothing set: the
    stack's defaults."""

    def sub(m: re.Match[str]) -> str:
        return "$" if m[0] == "$$" else m[3] or ""

    return _VAR.sub(sub, str(value))


def services() -> dict[str, Any]:
    loaded: dict[str, Any] = YAML(typ="safe").load(COMPOSE.read_text())["services"]
    return loaded


def command_of(service: dict[str, Any]) -> list[str]:
    """The service's command, run the way its image would: ``batchq`` is this venv's
    console script, ``python`` this interpreter."""
    argv = [interpolate(arg) for arg in service["command"]]
    if argv[0] == "batchq":
        script = shutil.which("batchq", path=os.path.dirname(sys.executable))
        argv[:1] = [script] if script else [sys.executable, "-m", "batchq.cli"]
    elif argv[0] == "python":
        argv[0] = sys.executable
    return argv


# The stack's own Redis, inside the compose network (never a Redis of this machine).
COMPOSE_REDIS_URL = "redis://redis:" + "6379/0"


def env_of(service: dict[str, Any], url: str) -> dict[str, str]:
    """The service's environment on top of ours, with Redis at ``url`` (in the stack the
    compose network's redis service) and the image's PYTHONPATH (/app there, the
    checkout here)."""
    env = dict(os.environ)
    env.update({k: interpolate(v) for k, v in (service.get("environment") or {}).items()})
    assert env["BATCHQ_URL"] == COMPOSE_REDIS_URL  # what the compose file says
    env["BATCHQ_URL"] = url
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def exporter_exists() -> bool:
    probe = [sys.executable, "-m", "batchq.cli", "exporter", "--help"]
    return subprocess.run(probe, capture_output=True, check=False, timeout=60).returncode == 0


def scrape(url: str) -> dict[str, float]:
    """The samples of a /metrics page, by their name and labels as written."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


@pytest.fixture
def stack_redis(tmp_path: Path) -> Any:
    """A redis-server started with the ``redis`` service's arguments."""
    args = [interpolate(a) for a in services()["redis"]["command"]]
    assert args[0] == "redis-server"
    with EmbeddedRedis(extra_args=args[1:], workdir=str(tmp_path / "redis")) as server:
        yield server


@dataclass
class StackRun:
    """What a run of the stack left: its settings, the trainer's output, the metrics."""

    epochs: int
    trainer_out: str
    metrics: dict[str, float] | None  # None where `batchq exporter` does not exist


def run_the_stack(
    server: EmbeddedRedis,
    tmp_path: Path,
    spawn_proc: Callable[..., Any],
    **settings: str,
) -> StackRun:
    """Run 3 producers, the exporter and the trainer with their services' exact commands
    (``settings``: environment variables, as a user's .env would set them); check that
    the trainer exits 0 and so does every producer, by itself; scrape the exporter."""
    stack = services()
    logs: dict[str, Path] = {}

    def start(name: str, service: str, argv: list[str] | None = None) -> Any:
        logs[name] = tmp_path / f"{name}.log"
        env = env_of(stack[service], server.url)
        env.update({k: v for k, v in settings.items() if k in env})
        with open(logs[name], "wb") as out:
            return spawn_proc(
                argv or command_of(stack[service]),
                env=env,
                cwd=tmp_path,  # the image's PYTHONPATH is enough to import examples/
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def log(name: str) -> str:
        return logs[name].read_text()

    producers = [start(f"producer-{i}", "producer") for i in range(1, PRODUCERS + 1)]
    exporter = None
    if exporter_exists():
        # The exact command, on loopback and a port of its own choosing (0) here.
        argv = command_of(stack["exporter"])
        argv[argv.index("--host") + 1] = "127.0.0.1"
        argv[argv.index("--port") + 1] = "0"
        exporter = start("exporter", "exporter", argv)
    trainer = start("trainer", "trainer")

    assert trainer.wait(timeout=90) == 0, log("trainer")
    for i, proc in enumerate(producers, start=1):
        assert proc.wait(timeout=30) == 0, log(f"producer-{i}")
    epochs = settings.get("BATCHQ_EPOCHS") or stack["trainer"]["environment"]["BATCHQ_EPOCHS"]
    run = StackRun(int(interpolate(epochs)), log("trainer"), None)
    if exporter is not None:
        served = wait_until(
            lambda: re.search(r"serving (http://\S+/metrics)", log("exporter")),
            timeout_s=30,
            what="the exporter to listen",
        )
        run.metrics = scrape(served[1])
    return run


def test_the_stack_runs_its_epochs_and_ends(
    stack_redis: EmbeddedRedis, tmp_path: Path, spawn_proc: Callable[..., Any]
) -> None:
    admin = redis.Redis.from_url(stack_redis.url)
    try:
        # The stack's Redis: never evicts, and its default user cannot FLUSHALL.
        assert admin.info("memory")["maxmemory_policy"] == "noeviction"
        with pytest.raises(redis.exceptions.NoPermissionError):
            admin.flushall()
    finally:
        admin.close()

    run = run_the_stack(stack_redis, tmp_path, spawn_proc)  # the compose defaults

    epochs, out = run.epochs, run.trainer_out
    for epoch in range(1, epochs + 1):
        assert re.search(rf"^epoch {epoch}/{epochs}: 10 batches in .* s, stall .*%$", out, re.M)
    assert f"finished {epochs} epochs, {10 * epochs} batches" in out
    if run.metrics is None:
        pytest.skip("`batchq exporter` does not exist here: the exporter was not checked")
    assert run.metrics["batchq_up"] == 1
    assert run.metrics['batchq_frames_popped_total{queue="tutorial"}'] >= 10 * epochs
    assert run.metrics['batchq_trainer_attached{queue="tutorial"}'] == 0
    assert run.metrics['batchq_epochs_completed_total{queue="tutorial"}'] == epochs


def test_the_exporter_counts_every_finished_epoch(
    stack_redis: EmbeddedRedis, tmp_path: Path, spawn_proc: Callable[..., Any]
) -> None:
    run = run_the_stack(stack_redis, tmp_path, spawn_proc, BATCHQ_EPOCHS="2")
    if run.metrics is None:
        pytest.skip("`batchq exporter` does not exist here")
    assert run.metrics['batchq_epochs_completed_total{queue="tutorial"}'] == run.epochs


def test_run_stack_script_runs_the_stack_for_a_person(
    tmp_path: Path, spawn_proc: Callable[..., Any]
) -> None:
    env = dict(os.environ, BATCHQ_EPOCHS="2", PYTHON=sys.executable)
    out_path = tmp_path / "run_stack.log"
    with open(out_path, "wb") as out:
        # The exporter on a port of its own choosing, never the stack's 9108.
        argv = ["bash", str(ROOT / "deploy" / "run_stack.sh"), "--producers", "2"]
        proc = spawn_proc(
            [*argv, "--exporter-port", "0"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    code = proc.wait(timeout=90)
    text = out_path.read_text()
    assert code == 0, text
    assert "trainer    | trainer: finished 2 epochs" in text
    assert "run_stack: trainer exited 0; producers exited [0, 0]; OK" in text
