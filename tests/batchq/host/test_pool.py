"""The worker pool of `serve --workers auto`: bounds, pending workers, the lease, the end."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from batchq.client.connection import make_client
from batchq.host.autoscale import ScalePolicy
from batchq.host.pool import WorkerPool
from batchq.host.procs import cpu_seconds, group_alive, host_idle, spawn, stop_group
from batchq.protocol.keys import QueueKeys


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Every worker a test's pool started; whatever is left is stopped at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        stop_group(p, timeout_s=5.0)


def _pool(
    url: str, queue: str, started: list[subprocess.Popen[bytes]], seconds: float = 60.0, **kw: Any
) -> WorkerPool:
    # A worker that never joins the queue: a sleeping interpreter.
    argv = [sys.executable, "-c", f"import time; time.sleep({seconds})"]

    def start() -> subprocess.Popen[bytes]:
        proc = spawn(argv)
        started.append(proc)
        return proc

    return WorkerPool(make_client(url), queue, ScalePolicy(1, 4, **kw), start, tick_s=0.05)


def test_the_minimum_is_started_and_unjoined_workers_count_as_alive(
    redis_url: str, queue_name: str, started: list[subprocess.Popen[bytes]]
) -> None:
    pool = _pool(redis_url, queue_name, started)
    first = pool.tick(time.monotonic())
    assert (first.action, first.count) == ("add", 1) and len(pool.workers) == 1
    then = pool.tick(time.monotonic())
    assert then.action == "hold" and "1 started worker(s) to join" in then.reason
    figures = pool._figures(time.monotonic())
    assert figures.alive == 1 and figures.pending == 1 and figures.local == 1


def test_the_decision_lease_of_another_autoscaler_holds_changes(
    redis_url: str, redis_client: redis.Redis, queue_name: str, started: list[Any]
) -> None:
    keys = QueueKeys(queue_name)
    redis_client.set(keys.scale, "other-host-1-abc", px=60_000)
    pool = _pool(redis_url, queue_name, started)
    pool.tick(time.monotonic())  # the minimum needs no lease
    assert len(pool.workers) == 1
    assert redis_client.zrange(keys.scalers, 0, -1) == [pool.id.encode()]
    log = redis_client.lrange(keys.scalelog, 0, -1)
    assert len(log) == 1 and b'"below the minimum of 1"' in log[0]
    assert int(redis_client.hget(keys.stats, "autoscale_add") or 0) == 1
    assert pool._take_lease() is False
    redis_client.delete(keys.scale)
    assert pool._take_lease() is True and redis_client.get(keys.scale) == pool.id.encode()


def test_stopping_stops_the_workers_and_leaves_the_queue_clean(
    redis_url: str, redis_client: redis.Redis, queue_name: str, started: list[Any]
) -> None:
    keys = QueueKeys(queue_name)
    pool = _pool(redis_url, queue_name, started)
    stopping = threading.Event()
    thread = threading.Thread(target=pool.run, args=(stopping,))
    thread.start()
    deadline = time.monotonic() + 30
    while not pool.workers and time.monotonic() < deadline:
        time.sleep(0.01)
    (worker,) = pool.workers
    pool._take_lease()
    stopping.set()
    thread.join(timeout=30)
    assert not thread.is_alive() and not group_alive(worker.pid)
    assert redis_client.zcard(keys.scalers) == 0


def test_a_worker_that_exits_by_itself_ends_the_pool(
    redis_url: str, queue_name: str, started: list[Any]
) -> None:
    pool = _pool(redis_url, queue_name, started, seconds=0)
    code = pool.run(threading.Event())  # the worker exits at once: the run is over
    assert code == 0 and pool.ended and not pool.workers and pool.codes == [0]


def test_cpu_figures_read_proc() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux's")
    idle = host_idle()
    assert idle is not None and 0 <= idle[0] <= idle[1]
    spent = cpu_seconds(threading.get_native_id())
    assert spent is not None and spent >= 0
    assert cpu_seconds(2**22 + 12345) is None
