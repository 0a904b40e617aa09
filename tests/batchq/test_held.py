"""batchq.held: the owner thread's round trips reuse one connection, others use the pool."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import pytest
import redis

from batchq import held
from batchq.connection import make_client
from batchq.errors import ConnectionLost
from batchq.lua_scripts import round_trip


def _client_id(client: redis.Redis) -> int:
    reply: Any = round_trip(client, [("CLIENT", "ID")], "testing")[0]
    return int(reply)


def _in_other_thread(client: redis.Redis) -> int:
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(_client_id(client)))
    t.start()
    t.join(timeout=10)
    assert out, "the other thread's round trip did not finish"
    return out[0]


def test_the_owner_reuses_one_connection_and_other_threads_use_the_pool(redis_url: str) -> None:
    client = make_client(redis_url)
    try:
        held.hold(client)
        mine = _client_id(client)
        assert _client_id(client) == mine
        pool: Any = client.connection_pool
        assert len(pool._in_use_connections) == 1  # held: out of the pool between trips
        other = _in_other_thread(client)
        assert other != mine  # the held connection is never lent to another thread
        assert _client_id(client) == mine
        held.release(client)
        held.release(client)  # idempotent
        assert len(pool._in_use_connections) == 0
        assert {_client_id(client), _in_other_thread(client)} <= {mine, other}
    finally:
        held.release(client)
        client.close()


def test_a_held_connection_that_fails_half_way_is_reconnected_in_step(redis_url: str) -> None:
    client = make_client(redis_url, socket_timeout_s=0.2)
    key = "bq:{held-timeout}:empty"
    held.hold(client)
    try:
        first = _client_id(client)
        with pytest.raises(ConnectionLost, match="blocking"):
            # BRPOP blocks longer than the socket waits: its reply comes after we gave up.
            round_trip(client, [("PING",), ("BRPOP", key, 1)], "blocking")
        # Had the held connection stayed open, this would read the late BRPOP's nil.
        assert round_trip(client, [("RPUSH", key, "v"), ("RPOP", key)], "testing") == [1, b"v"]
        assert _client_id(client) != first  # a new connection, authenticated again
    finally:
        held.release(client)
        client.delete(key)
        client.close()


def test_a_killed_held_connection_is_lost_once_then_reconnects(
    redis_url: str, redis_client: redis.Redis
) -> None:
    client = make_client(redis_url)
    held.hold(client)
    try:
        mine = _client_id(client)
        redis_client.client_kill_filter(_id=mine)
        with pytest.raises(ConnectionLost):
            round_trip(client, [("PING",)], "testing")
        assert round_trip(client, [("PING",)], "testing") == [b"PONG"]
    finally:
        held.release(client)
        client.close()


def test_a_dropped_client_takes_its_entry_along(redis_url: str) -> None:
    client = make_client(redis_url)
    held.hold(client)
    _client_id(client)
    before = len(held._HELD)
    client.close()
    del client
    gc.collect()
    assert len(held._HELD) == before - 1


def test_a_forked_child_uses_the_pool_not_its_parents_connection(redis_url: str) -> None:
    client = make_client(redis_url)
    held.hold(client)
    try:
        _client_id(client)
        pid = os.fork()
        if pid == 0:  # the child only asks which connection it would get, then leaves
            os.setpgid(0, 0)
            _conn, is_held = held.borrow(client)
            os._exit(1 if is_held else 0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert held.borrow(client)[1]  # the parent keeps its own
    finally:
        held.release(client)
        client.close()
