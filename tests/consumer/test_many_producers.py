"""Many producers, one trainer: exact epochs while producers join, leave and are killed."""

from __future__ import annotations

import random
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import pytest
from pipelines import FailOnExample, examples_of, numbered
from waiting import wait_until

from batchq.client.connection import make_client
from batchq.errors import PipelineMismatch, ProducerFailed
from batchq.monitoring.rows import status_rows
from batchq.protocol import producer_scripts, trainer_scripts
from batchq.protocol.calls import decode_reply
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream
from producer import Producer


def flat(batches: list[list[int]]) -> list[int]:
    return [x for b in batches for x in b]


def reference(epochs: int, **kw: Any) -> list[list[list[int]]]:
    """The in-process sequence: epochs of batches of example indices."""
    stream = numbered(**kw)
    return [[examples_of(f) for f, _ in stream.get_epoch_iterator()] for _ in range(epochs)]


def trainer(url: str, queue: str, **kw: Any) -> ServerDataStream:
    kw.setdefault("timeout_s", 30)
    return ServerDataStream(("features", "targets"), url=url, queue=queue, **kw)


def epoch(stream: ServerDataStream) -> list[list[int]]:
    return [examples_of(f) for f, _ in stream.get_epoch_iterator()]


@pytest.mark.parametrize("ordered", [True, False])
def test_four_producers_five_epochs_exact(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    redis_client: Any,
    ordered: bool,
) -> None:
    env = serve_env(examples=200, batch_size=10, slow_ms=2)
    for _ in range(4):
        spawn_proc(serve_argv("--hwm", "6"), env=env)
    expected = reference(5, examples=200, batch_size=10)
    # Every producer joined before the trainer reads: on a loaded machine the first one
    # could otherwise build all 100 batches while the others still import.
    producers = QueueKeys(queue_name).producers
    wait_until(lambda: redis_client.zcard(producers) >= 4, 60.0, "4 producers joined")
    with trainer(redis_url, queue_name, ordered=ordered) as stream:
        for e in range(5):
            got = epoch(stream)
            if ordered:
                assert got == expected[e]  # the in-process sequence
            else:
                assert sorted(map(tuple, got)) == sorted(map(tuple, expected[e]))
            assert sorted(flat(got)) == list(range(200))
        assert len(stream.producers_seen) >= 2  # the work really was shared
        stream.close(finished=True)


@pytest.mark.parametrize("queue_url", ["redis", "cluster", "stripes"], indirect=True)
def test_sigkill_producers_mid_shard_every_epoch_stays_exact(
    queue_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    queue_stripes: int,
) -> None:
    env = serve_env(examples=300, batch_size=10, slow_ms=15)
    argv = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "1")
    procs = [spawn_proc(argv, env=env) for _ in range(3)]
    rng = random.Random(20261202)
    kill_at = sorted(rng.sample(range(5, 85), 4))
    expected = reference(3, examples=300, batch_size=10)
    seen = 0
    with trainer(queue_url, queue_name, stall_s=1.0) as stream:
        for e in range(3):
            got = []
            for f, _ in stream.get_epoch_iterator():
                got.append(examples_of(f))
                seen += 1
                if kill_at and seen == kill_at[0]:
                    kill_at.pop(0)
                    victim = procs.pop(rng.randrange(len(procs)))
                    victim.send_signal(signal.SIGKILL)  # the leader: no hand-back
                    victim.wait(timeout=10)
                    procs.append(spawn_proc(argv, env=env))  # a replacement joins
            assert got == expected[e]
        if queue_stripes > 1:  # one queue over the cluster's 3 masters: data went on each
            client = make_client(queue_url)
            (row,) = status_rows(client, [queue_name])
            client.close()
            assert len({s["node"] for s in row["stripes"]}) == queue_stripes
            assert all(s["pushed"] > 0 and s["popped"] > 0 for s in row["stripes"])
        stream.close(finished=True)
    assert not kill_at


def test_producers_join_mid_epoch_and_all_but_one_leave(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    redis_client: Any,
) -> None:
    keys = QueueKeys(queue_name)
    env = serve_env(examples=400, batch_size=10, slow_ms=10)
    argv = serve_argv("--hwm", "4")
    first = spawn_proc(argv, env=env)
    expected = reference(2, examples=400, batch_size=10)
    with trainer(redis_url, queue_name) as stream:
        it = stream.get_epoch_iterator()
        got = [examples_of(next(it)[0]) for _ in range(5)]
        late = [spawn_proc(argv, env=env) for _ in range(2)]
        wait_until(lambda: redis_client.zcard(keys.producers) == 3, what="3 producers")
        while len(stream.producers_seen) < 3:  # the late ones take work
            got.append(examples_of(next(it)[0]))
        first.send_signal(signal.SIGTERM)
        late[0].send_signal(signal.SIGTERM)
        assert first.wait(timeout=20) == 0 and late[0].wait(timeout=20) == 0
        got += [examples_of(f) for f, _ in it]
        assert got == expected[0]
        assert epoch(stream) == expected[1]  # the last producer alone
        stream.close(finished=True)
    assert late[1].wait(timeout=20) == 0


def test_shard_redone_while_the_next_epoch_fills_the_queue(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    redis_client: Any,
) -> None:
    keys = QueueKeys(queue_name)
    argv = serve_argv("--hwm", "3", "--heartbeat-ttl-s", "1")
    # A producer that takes shard 0 of epoch 0 and never finishes it, then dies.
    stuck = spawn_proc(argv, env=serve_env(examples=60, batch_size=10, slow_ms=600_000))
    wait_until(lambda: redis_client.hget(keys.meta, "next") == b"1", what="shard 0 leased")
    stuck.send_signal(signal.SIGKILL)
    stuck.wait(timeout=10)
    # The same pipeline (a Slow transformer too), only quick.
    spawn_proc(argv, env=serve_env(examples=60, batch_size=10, slow_ms=1))
    expected = reference(3, examples=60, batch_size=10)
    with trainer(redis_url, queue_name, hwm=3, stall_s=1.0) as stream:
        for e in range(3):
            assert epoch(stream) == expected[e]
        window = 2 * 3
        assert stream.max_buffered <= window  # bounded by the look-ahead window
        stream.close(finished=True)


def test_poison_shard_is_retried_then_reported(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any], redis_client: Any
) -> None:
    for _ in range(2):
        producer_thread(FailOnExample(numbered(100, 10, shuffled=False), bad=42), max_attempts=3)
    with trainer(redis_url, queue_name) as stream, pytest.raises(ProducerFailed) as info:
        epoch(stream)
    assert (info.value.epoch, info.value.shard) == (0, 4)
    assert "example 42 is poisoned" in info.value.remote_traceback
    assert redis_client.hget(QueueKeys(queue_name).failures, "4") == b"3"


def test_poison_shard_skip_policy_counts_it(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(FailOnExample(numbered(100, 10, shuffled=False), bad=42), max_attempts=2)
    with trainer(redis_url, queue_name, on_producer_error="skip") as stream:
        got = flat(epoch(stream))
        assert got == [x for x in range(100) if not 40 <= x < 50]
        assert stream.skipped_shards == 1


def test_twenty_producers_racing_at_the_cap_never_exceed_hwm(
    redis_url: str, queue_name: str
) -> None:
    hwm, producers, frames_each = 5, 20, 15
    keys = QueueKeys(queue_name)
    setup = make_client(redis_url)
    inc = run = ""
    for p in range(producers):
        joined = producer_scripts.join(
            setup, keys, producer=f"p{p}", fingerprint="fp", hwm=hwm, shards=1000,
            window=1000, new_run="r", new_incarnation="i", heartbeat_ttl_ms=60_000,
            version="1", epoch_batches=1000, age_ms=3_600_000, no_create=False,
        )  # fmt: skip
        inc, run = joined.incarnation, joined.run
        producer_scripts.lease_call(
            keys, incarnation=inc, run=run, producer=f"p{p}", token="t",
            heartbeat_ttl_ms=60_000, prefetch=False, world=1,
        ).run(setup)  # fmt: skip
    token = "trainer"
    trainer_scripts.claim(
        setup, keys, op="acquire", token=token, claim_ttl_ms=60_000, run_id="r2",
        new_incarnation="i2", takeover_run="", version="1", rank=0, world=1, even="pad",
        resumed="",
    )  # fmt: skip
    stop = threading.Event()
    depths: list[int] = []
    popped: list[bytes] = []

    def producer(p: int) -> None:
        client = make_client(redis_url)
        entry = decode_reply(client.lrange(keys.lease(f"p{p}"), 0, -1))[0]
        for i in range(frames_each):
            while True:
                status = producer_scripts.push_call(
                    keys, frame_key=None, incarnation=inc, run=run,
                    producer=f"p{p}", entry=entry, element=f"{p}:{i}", last=False,
                    heartbeat_ttl_ms=60_000, frame_bytes=4, blocked_ms=0, produce_ms=0,
                ).run(client).status  # fmt: skip
                if status == "OK":
                    break
                client.blpop([keys.wake], timeout=0.05)
        client.close()

    def sampler() -> None:
        client = make_client(redis_url)
        while not stop.is_set():
            depths.append(client.llen(keys.data))
        client.close()

    def trainer_pops() -> None:
        client = make_client(redis_url)
        while len(popped) < producers * frames_each and not stop.is_set():
            reply = trainer_scripts.pop(
                client, keys, data=keys.data, trainer=keys.trainer, history=keys.history,
                incarnation=inc, run=run, token=token, room=2, floor=0, claim_ttl_ms=60_000,
                extra_popped=0, nbytes=0, figures=(0, 0, 0, "", "", ""), suffix="",
            )  # fmt: skip
            popped.extend(reply.elements)
        client.close()

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(producers)]
    threads += [threading.Thread(target=sampler), threading.Thread(target=trainer_pops)]
    for t in threads:
        t.start()
    for t in threads[:producers] + threads[-1:]:
        t.join(timeout=60)
    stop.set()
    threads[producers].join(timeout=10)
    setup.close()
    assert depths and max(depths) <= hwm
    assert sorted(popped) == sorted(f"{p}:{i}".encode() for p in range(20) for i in range(15))


def test_mismatched_pipeline_is_refused(
    redis_url: str,
    queue_name: str,
    producer_thread: Callable[..., Any],
    serve_argv: Any,
    serve_env: Any,
    redis_client: Any,
) -> None:
    producer_thread(numbered(100, 10, seed=1))
    wait_until(lambda: redis_client.hget(QueueKeys(queue_name).meta, "fingerprint"), what="run")
    other = Producer(numbered(100, 10, seed=2), redis_url, queue_name, hwm=4)
    with pytest.raises(PipelineMismatch, match="fingerprint"):
        other.serve()
    done = subprocess.run(
        serve_argv("--hwm", "4"), env=serve_env(seed=3), capture_output=True, timeout=60
    )
    assert done.returncode == 2 and b"pipeline mismatch" in done.stderr
