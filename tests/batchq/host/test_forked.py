"""Workers forked from the pool's warm process: each its own process group, Redis
connections, random state and producer id; one killed is replaced; no fork while a
thread runs; the pool's objects made with the collector paused and frozen before a
fork."""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from pipelines import examples_of, numbered
from waiting import wait_until

from batchq.cli import build_parser, serve
from batchq.errors import ConfigError
from batchq.host.procs import Child, ForkedChild, fork_child, fork_refused, spawn, stop_group
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import id_pid
from consumer import ServerDataStream


def _children(pid: int) -> set[int]:
    """The live (non-zombie) children of process ``pid``, from /proc."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] not in (b"Z", b"X"):
            out.add(int(entry))
    return out


def _sockets(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds open."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _local_ports(inodes: set[int], redis_port: int) -> set[int]:
    """The local ports of the TCP connections to ``redis_port`` among ``inodes``."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            next(fh)
            for line in fh:
                cols = line.split()
                local, remote, inode = cols[1], cols[2], int(cols[9])
                if inode in inodes and int(remote.rsplit(":", 1)[1], 16) == redis_port:
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def _drawers(draws: Path) -> set[int]:
    """The pids that have logged a draw (DrawLog: one line per batch built)."""
    if not draws.exists():
        return set()
    return {json.loads(line)["pid"] for line in draws.read_text().splitlines()}


def _joined(client: redis.Redis, queue: str) -> dict[int, str]:
    """pid -> producer id of the producers that joined ``queue``."""
    ids = [p.decode() for p in client.zrange(QueueKeys(queue).producers, 0, -1)]
    return {id_pid(p): p for p in ids}


def test_a_fork_is_refused_while_another_thread_runs() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(30,), name="busy-thread")
    thread.start()
    try:
        refused = fork_refused()
        assert refused is not None and "busy-thread" in refused
    finally:
        release.set()
        thread.join(timeout=10)
    later = fork_refused()
    assert later is None or "busy-thread" not in later


def test_the_pool_spawns_instead_of_forking_while_a_thread_runs(tmp_path: Path) -> None:
    args = argparse.Namespace(
        factory="pipelines:numbered", factory_args={"examples": 40}, requests_per_shard=None
    )
    spawned: list[Child] = []

    def spawner() -> Child:
        proc = spawn([sys.executable, "-c", "import time; time.sleep(30)"])
        spawned.append(proc)
        return proc

    start = serve._forker(args, "redis://127.0.0.1:1/0", spawner, None, time.time())
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(30,))
    thread.start()
    try:
        worker = start()  # a thread runs: no fork of this process
        assert spawned == [worker] and not isinstance(worker, ForkedChild)
    finally:
        release.set()
        thread.join(timeout=10)
        for proc in spawned:
            stop_group(proc, timeout_s=5.0)


def test_a_forked_child_leads_its_own_group_and_exits_with_its_code() -> None:
    read_fd, write_fd = os.pipe()

    def target() -> int:
        os.write(write_fd, f"{os.getpgid(0)} {os.getpid()}".encode())
        return 7

    child = fork_child(target)
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as fh:
            pgid, pid = (int(v) for v in fh.read().split())
        assert pgid == pid == child.pid and os.getpgid(0) != child.pid
        assert child.wait(timeout=10) == 7
    finally:
        stop_group(child, timeout_s=5.0)
    failing = fork_child(lambda: 1 // 0)
    assert failing.wait(timeout=10) == 1  # logged, as a failed `batchq serve` exits


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    """Each test starts and ends with nothing frozen (fork_child and the pool freeze
    this process's objects): a freeze test then sees its own freeze, not an earlier
    test's."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_parent_is_frozen_before_a_fork_and_the_child_collects() -> None:
    # What the pool holds (the factory's imports) goes to the collector's permanent
    # generation before each fork: the child's collections never visit it.
    read_fd, write_fd = os.pipe()

    def target() -> int:
        os.write(write_fd, f"{gc.get_freeze_count()} {int(gc.isenabled())}".encode())
        return 0

    try:
        child = fork_child(target)
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as fh:
            frozen, enabled = (int(v) for v in fh.read().split())
        assert child.wait(timeout=10) == 0
        assert frozen > 0 and enabled == 1
    finally:
        gc.unfreeze()


def test_the_pool_builds_its_stream_with_the_collector_paused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The factory's imports and call, and the plan, run with the cyclic collector
    # paused (issue 40: its full collections over torch's objects cost 0.3-0.4 s);
    # after, it runs again, what the pool made frozen for the workers it forks.
    args = argparse.Namespace(
        factory="pipelines:numbered", factory_args={"examples": 40}, requests_per_shard=None
    )
    during: list[bool] = []
    real_call = serve.call_factory

    def call(factory: Any, spec: str, arguments: dict[str, Any]) -> Any:
        during.append(gc.isenabled())
        return real_call(factory, spec, arguments)

    monkeypatch.setattr(serve, "call_factory", call)
    try:
        serve._forker(
            args, "redis://127.0.0.1:1/0", lambda: pytest.fail("no start"), None, time.time()
        )
        assert during == [False] and gc.isenabled() and gc.get_freeze_count() > 0
        gc.disable()  # a collector the caller paused stays paused
        serve._stream(args)
        assert during == [False, False] and not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_a_single_producer_freezes_what_its_factory_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `batchq serve` without a pool: the factory's objects frozen too, or the first full
    # collections, in the first epoch, visit all of torch's (0.3-0.8 s of a producer).
    args = argparse.Namespace(
        factory="pipelines:numbered", factory_args={"examples": 40}, requests_per_shard=None
    )
    served: list[tuple[int, bool]] = []

    def serve_it(stream: Any, plan: Any, *rest: Any) -> int:
        served.append((gc.get_freeze_count(), gc.isenabled()))
        return 0

    monkeypatch.setattr(serve, "_serve", serve_it)
    args.workers, args.url = "1", "redis://127.0.0.1:1/0"
    try:
        assert serve.run_serve(args) == 0
        assert len(served) == 1 and served[0][0] > 0 and served[0][1]
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("workers", ["2", "2:2"])  # a fixed pool; an autoscaler's (a client)
def test_forked_workers_share_nothing_and_a_killed_one_is_replaced(
    workers: str,
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    draws = tmp_path / "draws.jsonl"
    env = serve_env(examples=200, batch_size=20, draw_log=draws, slow_ms=10)
    pool = spawn_proc(serve_argv("--workers", workers, "--heartbeat-ttl-s", "1"), env=env)
    joined = wait_until(
        lambda: (
            (j := _joined(redis_client, queue_name)).keys() == _children(pool.pid)
            and len(j) == 2
            and j
        ),
        what="both workers to join",
    )
    first = set(joined)
    # Forked, not spawned: a fork keeps the pool's command line.
    cmdline = Path(f"/proc/{pool.pid}/cmdline").read_bytes()
    assert all(Path(f"/proc/{pid}/cmdline").read_bytes() == cmdline for pid in first)
    assert all(os.getpgid(pid) == pid for pid in first)  # each its own group
    assert len(set(joined.values())) == 2  # producer ids
    # Redis: no socket shared (not with the pool, not with each other), distinct clients.
    inodes = {pid: _sockets(pid) for pid in first}
    a, b = first
    assert not inodes[a] & inodes[b]
    assert not (inodes[a] | inodes[b]) & _sockets(pool.pid)
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    by_port = {int(c["addr"].rsplit(":", 1)[1]): c["id"] for c in redis_client.client_list()}
    ids = {
        pid: {by_port[p] for p in _local_ports(inodes[pid], port) if p in by_port} for pid in first
    }
    assert ids[a] and ids[b] and not ids[a] & ids[b]

    # Both have built a batch (the run fills the queue before any trainer comes): each
    # has drawn from its generators, whatever the trainer's reads interleave with.
    wait_until(lambda: first <= _drawers(draws), what="both workers to build a batch")

    local = numbered(200, 20)  # in-process: the epochs served must be these
    expected = [[examples_of(f) for f, _ in local.get_epoch_iterator()] for _ in range(3)]
    stream = ServerDataStream(("features", "targets"), False, url=redis_url, queue=queue_name)
    try:
        epochs: list[list[list[int]]] = []
        it = stream.get_epoch_iterator()
        epoch = [examples_of(next(it)[0])]
        os.kill(a, signal.SIGKILL)
        replaced = wait_until(
            lambda: set(_joined(redis_client, queue_name)) & (_children(pool.pid) - first),
            what="a replacement worker to join",
        )
        epoch += [examples_of(f) for f, _ in it]
        epochs.append(epoch)
        for _ in range(2):
            epochs.append([examples_of(f) for f, _ in stream.get_epoch_iterator()])
        assert epochs == expected
        stream.close(finished=True)
    finally:
        stream.close()
    assert pool.wait(timeout=30) == 0
    # Random states: each worker's first draws are its own.
    firsts: dict[int, tuple[float, int]] = {}
    for line in draws.read_text().splitlines():
        d = json.loads(line)
        firsts.setdefault(d["pid"], (d["random"], d["numpy"]))
    assert replaced and not replaced & first  # a new worker took the killed one's place
    assert first <= set(firsts)  # a replacement draws too where it built a batch
    assert (
        len({v[0] for v in firsts.values()}) == len({v[1] for v in firsts.values()}) == len(firsts)
    )


def _finished_run(redis_url: str, queue: str, spawn_proc: Any, serve_argv: Any, env: Any) -> None:
    """A run of ``queue`` served by a `batchq serve` process and finished by its trainer."""
    producer = spawn_proc(serve_argv(), env=env)
    with ServerDataStream(("features", "targets"), url=redis_url, queue=queue) as stream:
        assert len([f for f, _ in stream.get_epoch_iterator()]) == 2
        stream.close(finished=True)
    assert producer.wait(timeout=30) == 0


def test_a_worker_forked_after_the_finish_by_a_pool_started_before_is_a_late_replica(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A pool replaces a worker killed after the run finished (or adds one): the worker
    # belongs to the pool's job, which started before the finish, so it exits 0 at its
    # join; a pool started after the finish (the next job) starts the queue's next run.
    env = serve_env(examples=40, batch_size=20)
    _finished_run(redis_url, queue_name, spawn_proc, serve_argv, env)
    finished_run = redis_client.hget(QueueKeys(queue_name).meta, "run")
    monkeypatch.setattr(sys, "path", [env["PYTHONPATH"].split(os.pathsep)[0], *sys.path])
    monkeypatch.setenv("TEST_EXAMPLES", "40")
    monkeypatch.setenv("TEST_BATCH_SIZE", "20")
    args = build_parser().parse_args(serve_argv()[3:])  # after `python -m batchq.cli`

    def no_spawn() -> Child:
        raise AssertionError(f"no spawn: this process runs no thread ({fork_refused()})")

    before = time.time() - 3600  # the pool's start, before the finish
    replica = serve._forker(args, redis_url, no_spawn, None, before)()
    try:
        assert replica.wait(timeout=60) == 0
        assert redis_client.hget(QueueKeys(queue_name).meta, "run") == finished_run
    finally:
        stop_group(replica, timeout_s=5.0)
    next_job = serve._forker(args, redis_url, no_spawn, None, time.time())()
    try:
        wait_until(
            lambda: redis_client.hget(QueueKeys(queue_name).meta, "run") != finished_run,
            what="the next job's run",
        )
    finally:
        stop_group(next_job, timeout_s=5.0)


def test_a_spawned_worker_gets_the_pools_start_as_its_jobs(
    serve_argv: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `--worker-start spawn` (or a fork refused): the fresh process is told the pool's
    # start in its environment and serves as a worker of that job.
    args = build_parser().parse_args(serve_argv()[3:])
    envs: list[dict[str, str]] = []
    monkeypatch.setattr(serve, "spawn", lambda argv, env: envs.append(env))
    serve._spawner(args, "redis://127.0.0.1:1/0", 1234.5)()
    assert float(envs[0][serve.ENV_JOB_STARTED]) == 1234.5
    served: list[float | None] = []
    monkeypatch.setenv(serve.ENV_JOB_STARTED, "1234.5")
    monkeypatch.setattr(serve, "_stream", lambda args: None)
    monkeypatch.setattr(serve, "_serve", lambda *a: served.append(a[5]) or 0)
    assert serve.run_serve(args) == 0 and served == [1234.5]
    assert serve.ENV_JOB_STARTED not in os.environ  # taken: no child of it inherits it
    assert serve.run_serve(args) == 0 and served[1] is not None and served[1] <= time.time()
    monkeypatch.setenv(serve.ENV_JOB_STARTED, "yesterday")
    with pytest.raises(ConfigError, match="BATCHQ_JOB_STARTED_S='yesterday'"):
        serve.run_serve(args)
