"""batchq.protocol.calls.round_trip: the hot paths' pipeline (one write, raw replies in order)."""

from __future__ import annotations

import fakeredis
import pytest
import redis

from batchq.client import held
from batchq.client.connection import make_client
from batchq.errors import ConnectionLost
from batchq.protocol import scripts
from batchq.protocol.calls import round_trip
from batchq.protocol.keys import QueueKeys


def test_replies_come_raw_and_in_order(fake_redis: fakeredis.FakeRedis) -> None:
    replies = round_trip(
        fake_redis,
        [("SET", "a", b"1", "PX", 60_000), ("RPUSH", "l", "x", "y"), ("LRANGE", "l", 0, -1)],
        "testing",
    )
    assert replies == [b"OK", 2, [b"x", b"y"]]


def test_a_script_unknown_to_the_server_is_loaded_and_sent_again() -> None:
    # A private server has never seen batchq's scripts: EVALSHA answers NOSCRIPT.
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer(version=(6, 2)))
    reply = scripts.lease_call(
        QueueKeys("rt"), incarnation="i", run="r", producer="p", token="t",
        heartbeat_ttl_ms=1000, prefetch=False, world=1,
    ).run(client)  # fmt: skip
    assert reply.status == "STATE_LOST"  # the script ran: no incarnation in this Redis
    client.close()


def test_an_error_reply_is_raised_after_every_reply_is_read(redis_url: str) -> None:
    client = make_client(redis_url)
    key = "bq:{rt-error}:s"
    try:
        client.set(key, b"a string")
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            round_trip(client, [("LPUSH", key, "x"), ("PING",), ("GET", key)], "testing")
        # The connection went back to the pool in step: the next replies are these.
        assert round_trip(client, [("GET", key), ("PING",)], "testing") == [b"a string", b"PONG"]
    finally:
        client.delete(key)
        client.close()


@pytest.mark.parametrize("hold", [False, True], ids=["pooled", "held"])
def test_a_connection_that_fails_half_way_is_never_reused(redis_url: str, hold: bool) -> None:
    client = make_client(redis_url, socket_timeout_s=0.2)
    key = "bq:{rt-timeout}:empty"
    if hold:  # the owner thread's connection (batchq.client.held) is disconnected all the same
        held.hold(client)
    try:
        with pytest.raises(ConnectionLost, match="blocking"):
            # BRPOP blocks longer than the socket waits: its reply comes after we gave up.
            round_trip(client, [("PING",), ("BRPOP", key, 1)], "blocking")
        # Had that connection gone back, this would read the late BRPOP's nil first.
        assert round_trip(client, [("RPUSH", key, "v"), ("RPOP", key)], "testing") == [1, b"v"]
    finally:
        held.release(client)
        client.delete(key)
        client.close()
