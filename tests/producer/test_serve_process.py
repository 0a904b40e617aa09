"""Producers as processes (`batchq serve`): exit 0 when finished, SIGTERM, SIGKILL."""

from __future__ import annotations

import signal
import subprocess
from typing import Any

import pytest
from pipelines import examples_of, numbered
from waiting import read_until, wait_until

from batchq.errors import ProducersLost
from batchq.host.embedded import EmbeddedRedis
from batchq.host.procs import group_alive
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream


def test_finished_run_makes_every_producer_exit_0(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    proc = spawn_proc(serve_argv("--workers", "2"), env=serve_env(examples=100, batch_size=10))
    with ServerDataStream(("features", "targets"), url=redis_url, queue=queue_name) as stream:
        assert sum(1 for _ in stream.get_epoch_iterator()) == 10
        stream.close(finished=True)
    assert proc.wait(timeout=30) == 0


def test_sigterm_hands_leases_back_and_leaves_no_process(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    redis_client: Any,
) -> None:
    keys = QueueKeys(queue_name)
    proc = spawn_proc(serve_argv("--workers", "2", "--hwm", "2"), env=serve_env(examples=400))
    # No trainer: the list fills to the hwm and both producers block holding a lease.
    wait_until(lambda: redis_client.zcard(keys.producers) == 2, what="two producers")
    producers = [p.decode() for p in redis_client.zrange(keys.producers, 0, -1)]
    # With the list at the cap and no trainer, held leases stay held: stable once the
    # window (2 x hwm = 4 shards) is all minted, 2 listed and 2 held (by one producer or
    # both: a producer whose shards build quickly holds one ahead, producer/serving/ahead.py).
    wait_until(
        lambda: (
            redis_client.llen(keys.data) == 2
            and sum(redis_client.llen(keys.lease(p)) for p in producers) == 2
        ),
        what="a full list and the rest of the window leased",
    )
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert redis_client.zcard(keys.producers) == 0
    assert all(redis_client.llen(keys.lease(p)) == 0 for p in producers)
    assert redis_client.llen(keys.work) >= 2  # the held shards, back for someone else
    wait_until(lambda: not group_alive(proc.pid), what="the process group to exit")


def test_killed_producer_becomes_producers_lost(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    redis_client: Any,
) -> None:
    proc: subprocess.Popen[bytes] = spawn_proc(
        serve_argv("--hwm", "2", "--heartbeat-ttl-s", "1"), env=serve_env(examples=400)
    )
    keys = QueueKeys(queue_name)
    wait_until(lambda: redis_client.zcard(keys.producers) == 1, what="the producer to join")
    stream = ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, timeout_s=1.0, hwm=2
    )
    it = stream.get_epoch_iterator()
    next(it)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    with pytest.raises(ProducersLost) as info:
        for _ in it:
            pass
    assert info.value.epoch == 0
    assert info.value.missing_shards and info.value.missing_shards[-1] == 19
    stream.close()


def test_bad_factory_is_a_clear_error(serve_argv: Any, serve_env: Any) -> None:
    done = subprocess.run(
        serve_argv(factory="pipelines:no_such_factory"),
        env=serve_env(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert b"has no callable 'no_such_factory'" in done.stderr


def test_a_producer_started_before_redis_waits_for_it_and_serves(
    own_redis: EmbeddedRedis, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    # As a pool's replacement for a worker killed during an outage: its first join finds
    # no Redis. It waits (reconnect_timeout_s) as a drop mid-run is waited for; before,
    # it exited 2 at once, and the pool stopped replacing workers.
    own_redis.kill()  # its port is known and nothing answers there
    argv = serve_argv()
    argv[argv.index("--url") + 1] = own_redis.url
    proc = spawn_proc(argv, env=serve_env(examples=100, batch_size=10), stderr=subprocess.PIPE)
    read_until(proc.stderr, b"reconnecting")
    own_redis.restart(wipe=True)
    with ServerDataStream(("features", "targets"), url=own_redis.url, queue=queue_name) as stream:
        got = [examples_of(f) for f, _ in stream.get_epoch_iterator()]
        stream.close(finished=True)
    assert got == [examples_of(f) for f, _ in numbered(100, 10).get_epoch_iterator()]
    assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_while_the_factory_runs_exits_0(
    spawn_proc: Any, serve_argv: Any, serve_env: Any, workers: str
) -> None:
    # Before the producer (or the pool) installs its handlers: nothing is held yet, so a
    # stop is an exit 0, as later (Python's default action made it -15).
    proc = spawn_proc(
        serve_argv("--workers", workers, factory="pipelines:slow_start"),
        env=serve_env(),
        stderr=subprocess.PIPE,
    )
    read_until(proc.stderr, b"factory called")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_a_pool_whose_workers_are_refused_says_why_in_one_line_and_exits_2(
    redis_client: Any, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    # A forked worker's error never reaches the CLI's main(): each printed a traceback
    # of ~80 lines and the pool exited 1, where one producer says one line and exits 2.
    spawn_proc(serve_argv(), env=serve_env(seed=1))
    keys = QueueKeys(queue_name)
    wait_until(lambda: redis_client.zcard(keys.producers) == 1, what="the run's producer")
    other = spawn_proc(serve_argv("--workers", "2"), env=serve_env(seed=2), stderr=subprocess.PIPE)
    _, err = other.communicate(timeout=60)
    assert other.returncode == 2
    assert err.count(b"batchq serve: pipeline mismatch") == 2, err
    assert b"Traceback" not in err
