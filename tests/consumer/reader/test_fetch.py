"""consumer.reader.fetch: popped elements resolved into frame bytes; what cannot be is a bad
frame with its reason, never an exception out of the round."""

from __future__ import annotations

from typing import Any

import fakeredis
import numpy as np
import pytest
import redis

from batchq.client.connection import make_client
from batchq.errors import FrameError
from batchq.protocol.keys import QueueKeys
from batchq.wire.frame import REF_MAGIC, encode_ref
from batchq.wire.shm import encode_descriptor, segment_name
from consumer.reader.fetch import Fetcher, getdel_into
from consumer.reader.shm_frames import TrainerShm

KEYS = QueueKeys("fq")


def fetcher(
    client: fakeredis.FakeRedis, max_frame_bytes: int | None = None
) -> tuple[Fetcher, list]:
    dead: list[tuple[bytes, str]] = []
    shm = TrainerShm(KEYS, "redis", None)  # this trainer maps nothing
    return Fetcher(
        client, KEYS, shm.resolve, max_frame_bytes, lambda e, err: dead.append((e, err.reason))
    ), dead


def test_inline_frames_pass_and_stored_ones_are_fetched_once(
    fake_redis: fakeredis.FakeRedis,
) -> None:
    f, dead = fetcher(fake_redis)
    key = f"{KEYS.frame_prefix}1"
    fake_redis.set(key, b"stored frame")
    element = encode_ref(key)
    out = f.fetch([b"inline frame", element])
    assert [(bytes(raw), el, k) for raw, el, k in out] == [
        (b"inline frame", b"inline frame", ""),
        (b"stored frame", element, key),
    ]
    assert not dead and not fake_redis.exists(key)  # GETDEL: fetched once


def test_a_missing_or_foreign_stored_frame_is_a_bad_frame(fake_redis: fakeredis.FakeRedis) -> None:
    f, dead = fetcher(fake_redis)
    gone, foreign = f"{KEYS.frame_prefix}gone", f"{KEYS.frame_prefix}list"
    fake_redis.rpush(foreign, "x")
    out = f.fetch([encode_ref(gone), encode_ref(foreign), b"ok"])
    assert [raw for raw, _, _ in out] == [None, None, b"ok"]
    assert [reason for _, reason in dead] == ["missing_ref", "wrong_type"]


def test_an_oversized_stored_frame_is_dropped_unfetched(fake_redis: fakeredis.FakeRedis) -> None:
    f, dead = fetcher(fake_redis, max_frame_bytes=4)
    key = f"{KEYS.frame_prefix}big"
    fake_redis.set(key, b"x" * 100)
    ((raw, _, _),) = f.fetch([encode_ref(key)])
    assert raw is None and [reason for _, reason in dead] == ["too_large"]
    assert not fake_redis.exists(key)


@pytest.mark.parametrize(
    "element, reason",
    [
        (REF_MAGIC + b"\xff not a key", "bad_ref"),
        (encode_descriptor(segment_name("fq", "ab12", "p", 1), 1, 10, "host"), "shm_unavailable"),
    ],
)
def test_hostile_elements_are_bad_frames(
    fake_redis: fakeredis.FakeRedis, element: bytes, reason: str
) -> None:
    f, dead = fetcher(fake_redis)
    ((raw, el, _),) = f.fetch([element])
    assert raw is None and el == element
    assert [r for _, r in dead] == [reason]


def test_a_policy_that_raises_stops_the_round(fake_redis: fakeredis.FakeRedis) -> None:
    def raising(_element: bytes, error: FrameError) -> None:
        raise error

    f = Fetcher(fake_redis, KEYS, TrainerShm(KEYS, "redis", None).resolve, None, raising)
    with pytest.raises(FrameError, match="gone"):
        f.fetch([encode_ref(f"{KEYS.frame_prefix}gone")])


@pytest.fixture
def client(redis_url: str, queue_name: str) -> Any:
    out = make_client(redis_url)
    yield out
    out.delete(*[f"{queue_name}:{i}" for i in range(8)])
    out.close()


def test_values_land_in_writable_buffers_and_keys_are_deleted(client: Any, queue_name: str) -> None:
    big = np.arange(3_000_000, dtype=np.uint8).tobytes()  # several socket reads
    keys = [f"{queue_name}:{i}" for i in range(4)]
    client.set(keys[0], big)
    client.set(keys[1], b"")
    client.set(keys[3], b"x\r\n$5\r\n")  # RESP-looking bytes inside a value
    got = getdel_into(client, keys)
    assert got[0] is not None and bytes(got[0]) == big
    assert got[1] is not None and bytes(got[1]) == b""
    assert got[2] is None  # missing key
    assert got[3] is not None and bytes(got[3]) == b"x\r\n$5\r\n"
    assert not got[0].readonly
    np.frombuffer(got[0], dtype=np.uint8)[0] = 7  # writable, and its own memory
    assert client.exists(*keys) == 0
    assert client.ping()  # the connection is still in step


def test_an_error_reply_raises_after_every_reply_was_read(client: Any, queue_name: str) -> None:
    keys = [f"{queue_name}:{i}" for i in range(3)]
    client.set(keys[0], b"a")
    client.rpush(keys[1], b"not a string")
    client.set(keys[2], b"c")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        getdel_into(client, keys)
    assert client.exists(keys[0], keys[2]) == 0  # both GETDELs ran
    assert client.get(keys[2]) is None and client.ping()


def test_fakeredis_takes_the_pipeline_and_copies_once(fake_redis: Any) -> None:
    fake_redis.set("k", b"hello")
    (got,) = getdel_into(fake_redis, ["k"])
    assert got is not None and bytes(got) == b"hello" and not got.readonly
    assert fake_redis.exists("k") == 0
