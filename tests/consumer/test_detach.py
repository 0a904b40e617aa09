"""A single trainer that detaches (``close()`` without finishing) gives back what it
popped and did not yield; one resumed from the state saved right before takes the run
over as it is (issue 40: a restarted trainer's first batch without a rebuild), and any
other state resumes as before, in a new run. Producers are real processes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from pipelines import examples_of, numbered

from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream
from consumer.checkpoint import position_digest

EXAMPLES, BATCH = 240, 10  # 24 batches (shards) per epoch
PAD_BYTES = 300_000  # frames big enough to travel by shared memory where it is on
HWM = 4


def reference(epochs: int) -> list[tuple[int, list[int]]]:
    stream = numbered(EXAMPLES, BATCH)
    return [(e, examples_of(f)) for e in range(epochs) for f, _ in stream.get_epoch_iterator()]


@pytest.fixture
def producers(spawn_proc: Any, serve_argv: Any, serve_env: Any) -> Any:
    def start(n: int, transport: str) -> None:
        env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=1, pad_bytes=PAD_BYTES)
        env["BATCHQ_TRANSPORT"] = transport
        for _ in range(n):
            spawn_proc(serve_argv("--hwm", str(HWM), "--heartbeat-ttl-s", "5"), env=env)

    return start


def stream_of(url: str, queue: str) -> ServerDataStream:
    return ServerDataStream(
        ("features", "targets", "pad"), url=url, queue=queue, hwm=HWM, timeout_s=30
    )


def read(stream: ServerDataStream, epochs: int, first: int = 0) -> list[tuple[int, list[int]]]:
    """The batches of ``epochs`` epochs (``first``: batches of the first one to take
    only, then stop there)."""
    got = []
    for e in range(epochs):
        it = stream.get_epoch_iterator()
        for i, (features, *_) in enumerate(it):
            got.append((stream.epoch, examples_of(features)))
            if first and e == epochs - 1 and i + 1 == first:
                break
    return got


def meta(client: redis.Redis, queue: str, field: str) -> str | None:
    raw = client.hget(QueueKeys(queue).meta, field)
    return None if raw is None else raw.decode()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["auto", "redis"])
def test_a_trainer_resumed_where_one_detached_reads_on_in_its_run(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    producers: Any,
    monkeypatch: pytest.MonkeyPatch,
    transport: str,
) -> None:
    monkeypatch.setenv("BATCHQ_TRANSPORT", transport)  # the trainer's side reads it too
    producers(2, transport)
    first = stream_of(redis_url, queue_name)
    got = read(first, 2, first=9)  # epoch 0, then 9 batches of epoch 1
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint file holds it
    first.close()
    run = state["run"]
    assert meta(redis_client, queue_name, "detached") == f"{run}:{position_digest(state)}"
    second = stream_of(redis_url, queue_name)
    second.load_state_dict(state)
    it = second.get_epoch_iterator()
    got.append((second.epoch, examples_of(next(it)[0])))
    # Taken over as it is: the same run, nothing rebuilt, the mark gone.
    assert meta(redis_client, queue_name, "run") == run
    assert meta(redis_client, queue_name, "detached") is None
    got += [(second.epoch, examples_of(f)) for f, *_ in it]
    got += read(second, 1)
    assert second.stats["dropped_ahead"] == 0
    second.close(finished=True)
    assert got == reference(3)


@pytest.mark.timeout(120)
def test_a_state_before_the_detach_resumes_in_a_new_run(
    redis_url: str, redis_client: redis.Redis, queue_name: str, producers: Any
) -> None:
    producers(2, "redis")
    first = stream_of(redis_url, queue_name)
    it = first.get_epoch_iterator()
    got = [(0, examples_of(next(it)[0])) for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))
    for _ in range(3):  # past the state
        next(it)
    first.close()
    marked = meta(redis_client, queue_name, "detached")
    assert marked is not None and marked != f"{state['run']}:{position_digest(state)}"
    second = stream_of(redis_url, queue_name)
    second.load_state_dict(state)
    it = second.get_epoch_iterator()
    got.append((second.epoch, examples_of(next(it)[0])))
    assert meta(redis_client, queue_name, "run") != state["run"]  # rebuilt in a new run
    got += [(second.epoch, examples_of(f)) for f, *_ in it]
    got += read(second, 1)
    second.close(finished=True)
    assert got == reference(2)


@pytest.mark.timeout(120)
def test_nothing_is_given_back_past_a_hook_or_at_the_end(
    redis_url: str, redis_client: redis.Redis, queue_name: str, producers: Any
) -> None:
    producers(1, "redis")
    hooked = stream_of(redis_url, queue_name)
    hooked.configure_frames(hook=lambda frame: frame)  # may change what it gives back
    got = read(hooked, 1, first=4)
    state = json.loads(json.dumps(hooked.state_dict()))
    hooked.close()
    assert meta(redis_client, queue_name, "detached") is None
    again = stream_of(redis_url, queue_name)
    again.load_state_dict(state)
    got += read(again, 1)
    again.close(finished=True)
    assert got == reference(1)
    assert meta(redis_client, queue_name, "finished") == "1"
    assert meta(redis_client, queue_name, "detached") is None
