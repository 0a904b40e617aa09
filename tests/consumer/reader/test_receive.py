"""Frames stored by reference, received straight into buffers of their own."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import redis

from batchq.client.connection import make_client
from consumer.reader.receive import getdel_into


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
