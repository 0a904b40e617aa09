"""``on_sample_error='quarantine'`` for a Fuel pipeline served by producer processes against
the real redis-server (issue 42): a DataStream over an indexable dataset of 200 examples
read by a shuffled batch scheme, whose examples 5, 77 and 150 raise when read.

Every batch is compared by its bytes with the batch this process builds by the same shard
plan (substitutes included), and its indices with the scheme's plan where each bad example
is replaced by the first of its drawn substitutes that is not bad. Quarantine is set by
``batchq serve``'s flags, by ``start_server``'s arguments and by the stream's own.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest
import redis
from built_bytes import Batch, as_bytes, built
from fuel_quarantine import FEATURES, iterable_stream, quarantine_stream

from batchq.errors import ConfigError, ProducerFailed
from batchq.host.procs import stop_group
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import parse_quarantine_record
from consumer import ServerDataStream
from producer import start_server
from producer.quarantine import MAX_DRAWS, substitute_draw

EXAMPLES, BATCH = 200, 10  # 20 batches an epoch: 10 per rank
BAD = (5, 77, 150)
EPOCHS = 2
SOURCES = ("features", "targets", "noise")


def planned_indices(stream: Any, epochs: int) -> list[list[list[int]]]:
    """The scheme's plan with every bad example replaced by its substitute: the first
    draw that is not bad (and not itself)."""
    scheme = stream.data_stream.iteration_scheme

    def substitute(e: int, i: int) -> int:
        for t in range(MAX_DRAWS):
            j = substitute_draw(scheme.seed, e, i, t, EXAMPLES)
            if j not in BAD:
                return j
        raise AssertionError(f"no substitute for {i}")

    return [
        [[substitute(e, i) if i in BAD else i for i in r] for r in scheme.get_request_iterator(e)]
        for e in range(epochs)
    ]


def expected(monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[Batch]], list[list[list[int]]]]:
    """What every producer builds (bytes), and the plan's indices with substitutes."""
    monkeypatch.setenv("TEST_BAD", ",".join(map(str, BAD)))
    local = quarantine_stream(EXAMPLES, BATCH)
    want, plan = built(local, EPOCHS), planned_indices(local, EPOCHS)
    for e in range(EPOCHS):
        got = [(np.frombuffer(x[0], np.int64)[::FEATURES] // FEATURES).tolist() for x in want[e]]
        assert got == plan[e]  # the plan, every batch full, substitutes where bad
        assert all(len(batch) == BATCH for batch in got)
        assert not set(BAD) & {i for batch in got for i in batch}
    return want, plan


def read_ranks(url: str, queue: str, world: int) -> dict[int, list[list[Batch]]]:
    """``world`` ranks in threads, each reading EPOCHS epochs, then finishing."""
    shares: dict[int, list[list[Batch]]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with ServerDataStream(
                SOURCES, False, url=url, queue=queue, timeout_s=60, rank=r, world_size=world
            ) as s:
                shares[r] = [[as_bytes(b) for b in s.get_epoch_iterator()] for _ in range(EPOCHS)]
                assert s.stats["quarantined"] == len(BAD)
                s.close(finished=True)
        except BaseException as e:  # reported by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not errors, errors
    return shares


def check_records(client: redis.Redis, url: str, queue: str) -> None:
    """The run's quarantine hash, its counters and `batchq dead` list the bad examples."""
    keys = QueueKeys(queue)
    fields = client.hgetall(keys.quarantine)
    records = {
        r["index"]: r
        for r in (parse_quarantine_record(v) for k, v in fields.items() if k[:2] == b"i:")
    }
    assert sorted(records) == sorted(BAD)
    for i, r in records.items():
        assert r["error_type"] == "ValueError" and r["message"] == f"example {i}: corrupt record"
        assert "raise ValueError" in r["traceback"] and r["substitute"] not in BAD
        assert r["epoch"] in range(EPOCHS)
    assert int(fields[b"count"]) == len(BAD)
    assert int(client.hget(keys.stats, "quarantined") or 0) == len(BAD)
    cli = [sys.executable, "-m", "batchq.cli", "dead", "--url", url, "--queue", queue]
    listed = json.loads(subprocess.run([*cli, "--json"], check=True, capture_output=True).stdout)
    assert listed["count"] == len(BAD)
    assert sorted(r["index"] for r in listed["examples"]) == sorted(BAD)


def test_two_ranks_read_exact_epochs_with_substitutes_set_by_serve_flags(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, bad=",".join(map(str, BAD)))
    # Two workers forked by one `batchq serve`, quarantine set by its flags.
    argv = serve_argv("--hwm", "4", "--workers", "2", factory="fuel_quarantine:broken_stream")
    spawn_proc([*argv, "--on-sample-error", "quarantine", "--max-quarantined", "0.02"], env=env)
    shares = read_ranks(redis_url, queue_name, 2)
    want, _ = expected(monkeypatch)
    for e in range(EPOCHS):
        a, b = shares[0][e], shares[1][e]
        assert len(a) == len(b) == 10  # equal counts per rank, every batch there
        assert a == want[e][0::2] and b == want[e][1::2]  # slot s: rank s % 2
    check_records(redis_client, redis_url, queue_name)


@pytest.mark.timeout(60)
def test_the_same_bytes_after_a_producer_is_killed_and_another_takes_over(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, bad=",".join(map(str, BAD)))
    # The first producer: start_server's arguments (the pipeline as it is).
    code = (
        "from fuel_quarantine import broken_stream; from producer import start_server; "
        f"start_server(broken_stream(), url={redis_url!r}, queue={queue_name!r}, hwm=2, "
        "heartbeat_ttl_s=1, on_sample_error='quarantine', max_quarantined=0.02)"
    )
    first = spawn_proc([sys.executable, "-c", code], env=env)
    want, _ = expected(monkeypatch)
    got: list[list[Batch]] = []
    with ServerDataStream(SOURCES, False, url=redis_url, queue=queue_name, timeout_s=60) as s:
        for e in range(EPOCHS):
            epoch = []
            for batch in s.get_epoch_iterator():
                epoch.append(as_bytes(batch))
                if e == 0 and len(epoch) == 5:
                    stop_group(first, timeout_s=5.0, sig=signal.SIGKILL)  # its leases lapse
                    # The next: the stream's own arguments (the same fingerprint).
                    argv = serve_argv(
                        "--hwm", "2", "--heartbeat-ttl-s", "1",
                        factory="fuel_quarantine:quarantine_stream",
                    )  # fmt: skip
                    spawn_proc(argv, env=env)
            got.append(epoch)
        assert s.stats["quarantined"] == len(BAD)
        s.close(finished=True)
    assert got == want  # every batch full, in plan order, the same bytes
    check_records(redis_client, redis_url, queue_name)


@pytest.mark.timeout(60)
def test_without_quarantine_the_trainer_gets_producer_failed_naming_the_example(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, bad=",".join(map(str, BAD)))
    argv = serve_argv("--hwm", "4", factory="fuel_quarantine:broken_stream")
    spawn_proc(argv, env=env, stderr=subprocess.DEVNULL)
    with (
        ServerDataStream(SOURCES, False, url=redis_url, queue=queue_name, timeout_s=60) as s,
        pytest.raises(ProducerFailed) as caught,
    ):
        for _ in range(EPOCHS):
            for _ in s.get_epoch_iterator():
                pass
    text = str(caught.value)
    assert any(f"ValueError: example {i}: corrupt record" in text for i in BAD), text


def test_quarantine_of_a_stream_without_example_reads_is_refused(
    redis_url: str, queue_name: str, serve_argv: Any, serve_env: Any
) -> None:
    with pytest.raises(ConfigError, match="expected an iteration scheme whose requests are"):
        start_server(
            iterable_stream(), url=redis_url, queue=queue_name, on_sample_error="quarantine"
        )
    argv = serve_argv(factory="fuel_quarantine:iterable_stream")
    done = subprocess.run(
        [*argv, "--on-sample-error", "quarantine"], env=serve_env(), capture_output=True,
        text=True, timeout=30, start_new_session=True,
    )  # fmt: skip
    assert done.returncode == 2
    assert "over IterableDataset without an iteration scheme: expected" in done.stderr


ABORT = 33  # its read kills the producer (os.abort)


@pytest.mark.timeout(60)
def test_an_example_that_kills_its_producer_is_found_and_quarantined(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, bad=",".join(map(str, BAD)), abort=ABORT)
    argv = serve_argv(
        "--hwm", "4", "--workers", "2", "--heartbeat-ttl-s", "2", "--on-sample-error",
        "quarantine", "--max-quarantined", "0.02", factory="fuel_quarantine:broken_stream",
    )  # fmt: skip
    spawn_proc(argv, env=env, stderr=subprocess.DEVNULL)
    with ServerDataStream(SOURCES, False, url=redis_url, queue=queue_name, timeout_s=60) as s:
        got = [as_bytes(b) for b in s.get_epoch_iterator()]
        assert s.stats["quarantined"] == len(BAD) + 1
        s.close(finished=True)
    # What every producer builds where the aborting example raises: the same substitute.
    monkeypatch.setenv("TEST_BAD", ",".join(map(str, (*BAD, ABORT))))
    assert got == built(quarantine_stream(EXAMPLES, BATCH), 1)[0]
    fields = redis_client.hgetall(QueueKeys(queue_name).quarantine)
    killed = parse_quarantine_record(fields[f"i:{ABORT}".encode()])
    assert killed["error_type"] == "ExampleKilled"
    assert killed["message"] == f"the producer died (SIGABRT) building example {ABORT}"


@pytest.mark.timeout(60)
def test_without_quarantine_an_aborting_example_is_producer_failed_naming_it(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, abort=ABORT)
    argv = serve_argv(
        "--hwm", "4", "--workers", "2", "--heartbeat-ttl-s", "2",
        factory="fuel_quarantine:broken_stream",
    )  # fmt: skip
    spawn_proc(argv, env=env, stderr=subprocess.DEVNULL)
    with (
        ServerDataStream(SOURCES, False, url=redis_url, queue=queue_name, timeout_s=60) as s,
        pytest.raises(ProducerFailed) as caught,
    ):
        for _ in s.get_epoch_iterator():
            pass
    assert f"ExampleKilled: the producer died (SIGABRT) building example {ABORT}" in str(
        caught.value
    )


HANG = 120  # the batch holding it never leaves the transformer above the root


@pytest.mark.timeout(90)
def test_a_transformer_that_hangs_on_a_retried_shard_is_still_bounded(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    # A retried shard is built isolated: the root's reads are bounded in the forked
    # child, but the transformer above it runs in the producer, still under the build's
    # watch; so every attempt ends in BuildTimeout and the trainer gets ProducerFailed
    # after max_attempts, never a producer stuck for good.
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, hang=HANG)
    argv = serve_argv(
        "--hwm", "4", "--workers", "2", "--heartbeat-ttl-s", "2", "--build-timeout-s", "1",
        factory="fuel_quarantine:hanging_stream",
    )  # fmt: skip
    spawn_proc(argv, env=env, stderr=subprocess.DEVNULL)
    with (
        ServerDataStream(("features", "targets"), False, url=redis_url, queue=queue_name,
                         timeout_s=80) as s,
        pytest.raises(ProducerFailed) as caught,
    ):  # fmt: skip
        for _ in s.get_epoch_iterator():
            pass
    assert "BuildTimeout" in str(caught.value)
    assert "no batch after build_timeout_s=1" in str(caught.value)
