"""Values in queue keys that batchq did not write are bad frames or clear errors (issue 11).

A foreign writer on the real redis-server: a by-reference element naming a key of
another type, the data list replaced by a hash for a while. Never a raw redis-py or Lua
error, never a hang; producers keep serving once the key is repaired.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import redis
from pipelines import Slow, examples_of, numbered
from waiting import wait_until

from batchq.errors import WrongKeyType
from batchq.protocol.keys import QueueKeys
from batchq.wire.frame import encode_ref
from consumer import ServerDataStream

EXAMPLES, BATCH = 60, 10


def reference(epochs: int, examples: int = EXAMPLES) -> list[list[int]]:
    local = numbered(examples, BATCH)
    return [examples_of(f) for _ in range(epochs) for f, _ in local.get_epoch_iterator()]


def trainer(url: str, queue: str, **kw: Any) -> ServerDataStream:
    kw.setdefault("timeout_s", 20)
    return ServerDataStream(("features", "targets"), url=url, queue=queue, **kw)


def replace(client: redis.Redis, key: str) -> None:
    """Put a hash where ``key`` is, atomically (a producer may push in between)."""
    pipe = client.pipeline(transaction=True)
    pipe.delete(key)
    pipe.hset(key, "rogue", "1")
    pipe.execute()


def dead_reasons(client: redis.Redis, queue: str) -> list[str]:
    records = client.lrange(QueueKeys(queue).dead, 0, -1)
    return [msgpack.unpackb(r)["reason"] for r in records]


@pytest.mark.parametrize("size_check", [False, True])
@pytest.mark.parametrize("kind", ["hash", "list"])
def test_reference_to_another_type_is_a_bad_frame(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    producer_thread: Callable[..., Any],
    kind: str,
    size_check: bool,
) -> None:
    # Before: a raw ResponseError (WRONGTYPE) from GETDEL (or STRLEN with
    # max_frame_bytes) killed a trainer with on_bad_frame='skip'.
    keys = QueueKeys(queue_name)
    evil = keys.frame_prefix + "evil"
    producer_thread(numbered(EXAMPLES, BATCH), hwm=2)
    extra = {"max_frame_bytes": 1 << 20} if size_check else {}
    with trainer(redis_url, queue_name, on_bad_frame="skip", **extra) as stream:
        it = stream.get_epoch_iterator()
        served = [examples_of(next(it)[0])]
        if kind == "hash":  # after the start, which deletes an older run's frame keys
            redis_client.hset(evil, "a", "1")
        else:
            redis_client.rpush(evil, "a")
        redis_client.rpush(keys.data, encode_ref(evil))  # popped next
        served += [examples_of(f) for f, _ in it]
        served += [examples_of(f) for f, _ in stream.get_epoch_iterator()]
        assert stream._reader is not None and stream._reader.bad_frames == 1
    assert served == reference(2)
    assert dead_reasons(redis_client, queue_name) == ["wrong_type"]
    assert redis_client.type(evil) == kind.encode()  # not ours: left alone


def test_data_list_replaced_then_repaired(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    producer_thread: Callable[..., Any],
) -> None:
    # Before: the trainer raised a raw ResponseError (pop.lua's LLEN, WRONGTYPE) and both
    # producers exited (push.lua) and never came back after the key was deleted.
    keys = QueueKeys(queue_name)
    # Slow, 20 batches an epoch: the producers are still pushing (and see the foreign
    # type) when the list is replaced.
    producers = [
        producer_thread(Slow(numbered(200, BATCH), slowdown=0.05), hwm=2) for _ in range(2)
    ]
    with trainer(redis_url, queue_name, stall_s=0.5) as stream:
        it = stream.get_epoch_iterator()
        served = [examples_of(next(it)[0])]
        reader = stream._reader
        assert reader is not None
        replace(redis_client, keys.data)
        wait_until(lambda: reader.guard.since is not None, what="the trainer to notice")
        # Any producer: one waiting at the look-ahead window touches no data list.
        wait_until(
            lambda: any(p._pusher._wrong_logged for p in producers),
            what="a producer to notice",
        )
        redis_client.delete(keys.data)  # repaired
        served += [examples_of(f) for f, _ in it]
        served += [examples_of(f) for f, _ in stream.get_epoch_iterator()]
    assert served == reference(2, 200)
    assert all(not p._stop.is_set() for p in producers)  # still serving


def test_data_list_never_repaired_is_a_wrong_key_type(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    producer_thread: Callable[..., Any],
) -> None:
    keys = QueueKeys(queue_name)
    # Slow, 20 batches: most of the epoch is still to come when the list is replaced.
    producer_thread(Slow(numbered(200, BATCH), slowdown=0.05), hwm=2)
    with trainer(redis_url, queue_name, timeout_s=1) as stream:
        it = stream.get_epoch_iterator()
        next(it)
        replace(redis_client, keys.data)
        with pytest.raises(WrongKeyType) as info:
            list(it)
    assert info.value.key == keys.data
    assert (info.value.expected, info.value.got) == ("list", "hash")
    assert keys.data in str(info.value)


@pytest.mark.parametrize("name", ["producers", "stats", "work", "wake", "pstats"])
def test_bookkeeping_key_replaced_then_repaired(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    producer_thread: Callable[..., Any],
    name: str,
) -> None:
    # A foreign type under a key the scripts write half-way must neither lose a popped
    # frame nor leave a shard leased by nobody; once repaired, serving goes on.
    key = getattr(QueueKeys(queue_name), name)
    producers = [
        producer_thread(Slow(numbered(200, BATCH), slowdown=0.05), hwm=2) for _ in range(2)
    ]
    with trainer(redis_url, queue_name, stall_s=0.5) as stream:
        it = stream.get_epoch_iterator()
        served = [examples_of(next(it)[0])]
        redis_client.set(key, "rogue")  # SET replaces a key of any type
        wait_until(
            lambda: any(p._pusher._wrong_logged for p in producers),
            what="a producer to notice",
        )
        redis_client.delete(key)
        served += [examples_of(f) for f, _ in it]
        served += [examples_of(f) for f, _ in stream.get_epoch_iterator()]
    assert served == reference(2, 200)
    assert all(not p._stop.is_set() for p in producers)


def test_meta_of_another_type_at_start_is_a_wrong_key_type(
    redis_url: str, redis_client: redis.Redis, queue_name: str
) -> None:
    # Before: a raw ResponseError (claim.lua's HMGET, WRONGTYPE) from the first iterator.
    keys = QueueKeys(queue_name)
    redis_client.rpush(keys.meta, "rogue")
    stream = trainer(redis_url, queue_name, timeout_s=5)
    with pytest.raises(WrongKeyType) as info:
        stream.get_epoch_iterator()
    assert (info.value.key, info.value.expected, info.value.got) == (keys.meta, "hash", "list")
    stream.close()


def test_a_foreign_type_under_the_plans_waiters_is_a_wrong_key_type(
    redis_url: str, redis_client: redis.Redis, queue_name: str
) -> None:
    # len() before any claim joins the set of the plan's waiters (keys.planwait).
    keys = QueueKeys(queue_name)
    redis_client.rpush(keys.planwait, "rogue")
    stream = trainer(redis_url, queue_name, timeout_s=5)
    with pytest.raises(WrongKeyType) as info:
        len(stream)
    assert (info.value.key, info.value.expected, info.value.got) == (keys.planwait, "set", "list")
    stream.close()
