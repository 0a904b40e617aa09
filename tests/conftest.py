"""Fixtures for the whole suite: one real redis-server per session, fakeredis, processes.

The real server is a private :class:`~batchq.host.embedded.EmbeddedRedis` on a free loopback
port (never 6379); tests share it, so a test only ever deletes its own queue's keys
(never FLUSHALL/FLUSHDB). Processes started through ``spawn_proc`` are stopped, with
their whole process group, when the test ends, even when it fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar
from uuid import uuid4

import fakeredis
import pytest
import redis

from batchq.client.connection import make_client
from batchq.errors import ConfigError
from batchq.host.embedded import EmbeddedRedis
from batchq.host.procs import StdSpec, spawn, stop_group
from batchq.protocol.admin import delete_queue
from batchq.protocol.keys import QueueKeys
from batchq.wire.shm import DEFAULT_SHM_DIR, remove_segments

TESTS_DIR = Path(__file__).resolve().parent
# Modules the tests and their producer processes import (tests/support/pipelines.py);
# a folder of its own, so that tests/producer and tests/consumer never shadow the
# packages of the same names.
SUPPORT_DIR = TESTS_DIR / "support"
sys.path.insert(0, str(SUPPORT_DIR))

from redis_cluster import LocalCluster  # noqa: E402  (tests/support, on the path above)
from redis_sentinel import LocalSentinel  # noqa: E402

SpawnFn = Callable[..., subprocess.Popen[bytes]]

with contextlib.suppress(ImportError):  # installed with `datasets`, which shows progress
    import tqdm

    # No monitor thread, which would live on in this test worker once any bar ran: the
    # fork tests refuse to fork a process running a thread (batchq.host.procs).
    tqdm.tqdm.monitor_interval = 0


@pytest.fixture(autouse=True)
def _no_batchq_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the user's ``BATCHQ_URL`` out of the tests (and out of their children)."""
    monkeypatch.delenv("BATCHQ_URL", raising=False)


Startable = TypeVar("Startable", EmbeddedRedis, LocalCluster, LocalSentinel)


@contextlib.contextmanager
def _running(deployment: Startable) -> Iterator[Startable]:
    """Start ``deployment`` (a test without a redis-server binary fails, saying so) and
    stop it after the block, whatever happened."""
    missing = ""
    try:
        deployment.start()
    except ConfigError as e:
        missing = str(e)
    if missing:  # outside the except block: no chained traceback, just the message
        pytest.fail(f"the tests need a redis-server: {missing}", pytrace=False)
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """The session's redis-server (started on first use, stopped at the session's end)."""
    with _running(EmbeddedRedis()) as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: EmbeddedRedis) -> str:
    """The URL of the session's redis-server, ``redis://127.0.0.1:<port>/0``."""
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """The session's local Redis Cluster: 3 masters of the suite's redis-server binary,
    each with a third of the slots (started on first use, stopped at the session's end;
    tests/support/redis_cluster.py)."""
    with _running(LocalCluster(3)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def redis_sentinel() -> Iterator[LocalSentinel]:
    """A master, its replica and three sentinels of the suite's redis-server binary, for
    one test file (its failovers change the deployment; tests/support/redis_sentinel.py)."""
    with _running(LocalSentinel()) as deployment:
        yield deployment


#: The kinds of Redis ``queue_url`` serves: the fixture each needs ("stripes": the cluster,
#: the queue striped over its 3 masters).
_DEPLOYMENTS = {
    "redis": "redis_url", "cluster": "redis_cluster", "stripes": "redis_cluster",
    "sentinel": "redis_sentinel",
}  # fmt: skip


@pytest.fixture
def queue_url(request: pytest.FixtureRequest, queue_name: str) -> Iterator[str]:
    """Where a scenario test's queue lives: the session's redis-server, or, for a test
    parametrized with ``pytest.mark.parametrize("queue_url", ["redis", "cluster"],
    indirect=True)``, the session's cluster (``redis+cluster://``), or with
    ``"sentinel"`` the file's Sentinel deployment (``redis+sentinel://``), or with
    ``"stripes"`` the cluster with the queue striped over its masters
    (:func:`queue_stripes`); the queue's keys (every stripe's) are deleted from it
    afterwards. ``serve_argv`` and ``producer_thread`` use it."""
    kind = getattr(request, "param", "redis")
    if kind not in _DEPLOYMENTS:
        raise ValueError(f"queue_url: expected one of {sorted(_DEPLOYMENTS)}, not {kind!r}")
    deployment = request.getfixturevalue(_DEPLOYMENTS[kind])
    if kind == "redis":
        yield deployment
        return
    url: str = deployment.url
    yield url
    for count in range(1, MAX_STRIPES_CLEANED + 1):
        for k in range(count):
            keys = QueueKeys(queue_name).stripe(k, count)
            client = make_client(url, key=keys.meta)
            try:
                delete_queue(client, keys.queue)
            finally:
                client.close()


MAX_STRIPES_CLEANED = 4  # a test's queue may be striped this many ways at most


@pytest.fixture
def queue_stripes(request: pytest.FixtureRequest) -> int:
    """How many stripes the producers of ``serve_argv`` and ``producer_thread`` serve:
    3 where ``queue_url`` is parametrized "stripes", else 1."""
    callspec = getattr(request.node, "callspec", None)
    return 3 if callspec is not None and callspec.params.get("queue_url") == "stripes" else 1


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the session's server (bytes replies), closed after the test."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


def _delete_queue_keys(url: str, queue: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        delete_queue(client, queue)
    finally:
        client.close()


@pytest.fixture
def queue_name(request: pytest.FixtureRequest) -> Iterator[str]:
    """A queue name no other test uses; its ``bq:{name}:*`` keys are deleted afterwards.

    The keys are deleted from the session's server only when the test used that server,
    so fakeredis-only tests do not need a redis-server.
    """
    name = f"t{uuid4().hex[:12]}"
    yield name
    remove_segments(DEFAULT_SHM_DIR, name)  # shared-memory frames left by a stopped run
    if "redis_server" in request.fixturenames:
        server: EmbeddedRedis = request.getfixturevalue("redis_server")
        if server.running:
            _delete_queue_keys(server.url, name)


@pytest.fixture
def fake_redis() -> Iterator[fakeredis.FakeRedis]:
    """A fresh, private fakeredis (emulating Redis 6.2, like the embedded server).

    A private ``FakeServer`` is needed: ``FakeRedis()`` alone shares one server between
    all instances created with the same arguments, so data would leak between tests.
    """
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer(version=(6, 2)))
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def spawn_proc() -> Iterator[SpawnFn]:
    """A :func:`batchq.host.procs.spawn` that stops every group it started when the test ends.

    Yields:
        ``spawn_proc(argv, *, env=None, cwd=None, stdout=None, stderr=None) -> Popen``.
    """
    procs: list[subprocess.Popen[bytes]] = []

    def _spawn(
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdout: StdSpec = None,
        stderr: StdSpec = None,
    ) -> subprocess.Popen[bytes]:
        proc = spawn(argv, env=env, cwd=cwd, stdout=stdout, stderr=stderr)
        procs.append(proc)
        return proc

    yield _spawn
    for proc in reversed(procs):
        stop_group(proc, timeout_s=5.0, sig=signal.SIGTERM)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def serve_argv(queue_url: str, queue_name: str, queue_stripes: int) -> Callable[..., list[str]]:
    """The argv of `batchq serve tests.pipelines:numbered` for this test's queue."""

    def argv(*extra: str, factory: str = "pipelines:numbered") -> list[str]:
        return [
            sys.executable,
            "-m",
            "batchq.cli",
            "--log-level",
            "WARNING",
            "serve",
            factory,
            "--url",
            queue_url,
            "--queue",
            queue_name,
            *(["--stripes", str(queue_stripes)] if queue_stripes > 1 else []),
            *extra,
        ]

    return argv


@pytest.fixture
def serve_env() -> Callable[..., dict[str, str]]:
    """An environment for producer processes that can import tests/pipelines.py."""

    def env(**test_vars: Any) -> dict[str, str]:
        out = dict(os.environ)
        out["PYTHONPATH"] = os.pathsep.join([str(SUPPORT_DIR), out.get("PYTHONPATH", "")])
        out.update({f"TEST_{k.upper()}": str(v) for k, v in test_vars.items()})
        return out

    return env


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A redis-server of this test's own (which it may kill and restart empty)."""
    server = EmbeddedRedis(workdir=str(tmp_path / "redis"))
    server.start()
    yield server
    server.stop()


# The slowest files (15-31 s a test on 2 cores) run first: with two xdist workers, one of
# them started near the end of the run kept the other worker idle for its length.
_SLOW_FIRST = (
    "tests/consumer/test_lightning.py",
    "tests/consumer/test_sentinel_failover.py",
    "tests/consumer/test_hf_trainer.py",
    "tests/consumer/test_ddp.py",
    "tests/batchq/host/test_autoscale.py",
    "tests/consumer/test_accelerate.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the slowest files first (a stable sort: every other test keeps its place)."""
    items.sort(key=lambda item: not item.nodeid.startswith(_SLOW_FIRST))
