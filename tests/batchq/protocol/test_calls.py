"""batchq.protocol.calls.round_trip: the hot paths' pipeline (one write, raw replies in order)."""

from __future__ import annotations

import fakeredis
import pytest
import redis

from batchq.client import redis_internals
from batchq.client.connection import make_client
from batchq.client.redis_internals import read_bulk_into
from batchq.errors import ConnectionLost
from batchq.protocol import producer_scripts
from batchq.protocol.calls import execute_pipeline, round_trip
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
    reply = producer_scripts.lease_call(
        QueueKeys("rt"), incarnation="i", run="r", producer="p", token="t",
        heartbeat_ttl_ms=1000, prefetch=False, world=1,
    ).run(client)  # fmt: skip
    assert reply.status == "STATE_LOST"  # the script ran: no incarnation in this Redis
    client.close()


def test_only_the_commands_refused_for_noscript_are_sent_again() -> None:
    # Before: the whole round trip went again, so a command that ran (a push) ran twice.
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer(version=(6, 2)))
    lease = producer_scripts.lease_call(
        QueueKeys("rt"), incarnation="i", run="r", producer="p", token="t",
        heartbeat_ttl_ms=1000, prefetch=False, world=1,
    )  # fmt: skip
    replies = round_trip(
        client, [("RPUSH", "l", "x"), lease.command(), ("LLEN", "l")], "testing",
        keep_errors=True,
    )  # fmt: skip
    assert replies[0] == 1 and replies[2] == 1
    assert lease.parse(replies[1]).status == "STATE_LOST"  # loaded, then it ran
    assert client.lrange("l", 0, -1) == [b"x"]  # once
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
    if hold:  # the owner thread's connection (redis_internals.hold) is disconnected all the same
        redis_internals.hold(client)
    try:
        with pytest.raises(ConnectionLost, match="blocking"):
            # BRPOP blocks longer than the socket waits: its reply comes after we gave up.
            round_trip(client, [("PING",), ("BRPOP", key, 1)], "blocking")
        # Had that connection gone back, this would read the late BRPOP's nil first.
        assert round_trip(client, [("RPUSH", key, "v"), ("RPOP", key)], "testing") == [1, b"v"]
    finally:
        redis_internals.release_hold(client)
        client.delete(key)
        client.close()


def test_bulk_replies_into_own_buffers_and_parsed_replies_share_one_round_trip(
    redis_url: str,
) -> None:
    # Values read straight from the socket never take a byte of the next reply, so a
    # script's reply (here a parsed one and a raw one) can follow them in the same trip.
    client = make_client(redis_url)
    keys = [f"bq:{{rt-into}}:{i}" for i in range(3)]
    try:
        client.set(keys[0], b"v" * 1_000_000)
        client.rpush(keys[1], b"a list")
        client.hset(keys[2], "f", "1")
        replies = round_trip(
            client,
            [("GETDEL", keys[0]), ("GETDEL", keys[1]), ("HGETALL", keys[2]), ("PING",)],
            "testing",
            keep_errors=True,
            readers=[read_bulk_into, read_bulk_into, None, None],
        )
        assert bytes(replies[0]) == b"v" * 1_000_000 and not replies[0].readonly
        assert isinstance(replies[1], redis.ResponseError) and "WRONGTYPE" in str(replies[1])
        assert replies[2] in ({b"f": b"1"}, [b"f", b"1"])  # RESP3 or RESP2
        assert replies[3] == b"PONG"
        assert round_trip(client, [("PING",)], "testing") == [b"PONG"]  # still in step
    finally:
        client.delete(*keys)
        client.close()


def test_a_recorded_pipeline_is_parsed_as_redis_py_parses_it(redis_url: str) -> None:
    client = make_client(redis_url)
    key = "bq:{rt-pipe}:h"
    try:
        replies = execute_pipeline(
            client, lambda pipe: [pipe.hset(key, "a", "1"), pipe.hgetall(key), pipe.exists(key)]
        )
        assert replies == [1, {b"a": b"1"}, 1]
        client.rpush("bq:{rt-pipe}:l", b"x")
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            execute_pipeline(client, lambda pipe: [pipe.hgetall("bq:{rt-pipe}:l"), pipe.ping()])
        mixed = execute_pipeline(
            client, lambda pipe: [pipe.hgetall("bq:{rt-pipe}:l"), pipe.ping()], raise_on_error=False
        )
        assert isinstance(mixed[0], redis.ResponseError) and mixed[1] is True
    finally:
        client.delete(key, "bq:{rt-pipe}:l")
        client.close()
