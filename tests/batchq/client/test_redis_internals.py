"""batchq.client.redis_internals: the one module on redis-py's internals fails loudly on a
redis-py that changed them, and pyproject pins the versions they were checked on; the
owner thread's round trips reuse its connection without the pool's checks, and the
client still keeps one connection (a failure half-way: tests/batchq/protocol/test_calls.py)."""

from __future__ import annotations

import os
import re
import threading
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import redis

from batchq.client import redis_internals
from batchq.client.connection import make_client
from batchq.client.redis_internals import (
    TESTED_REDIS_PY,
    HeldPool,
    check_internals,
    hold,
    release_hold,
)
from batchq.errors import ConnectionLost
from batchq.protocol.calls import round_trip

ROOT = Path(__file__).resolve().parents[3]


def _release() -> tuple[int, int]:
    major, minor = version("redis").split(".")[:2]
    return int(major), int(minor)


def test_the_internals_are_there() -> None:
    missing = check_internals()
    assert missing == [], (
        f"redis-py {version('redis')} lacks {missing}: batchq.client.redis_internals must "
        "be brought up to date before this version is allowed in pyproject.toml"
    )


def test_the_installed_redis_py_is_one_the_internals_were_checked_on() -> None:
    low, high = TESTED_REDIS_PY
    assert low <= _release() < high, (
        f"redis-py {version('redis')} is outside {low}..{high}, the releases "
        "batchq.client.redis_internals was checked on"
    )


def test_pyproject_pins_the_same_releases() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"redis\[hiredis\]>=(\d+)\.(\d+),<(\d+)\.(\d+)"', text)
    assert pin is not None, "pyproject.toml must pin redis[hiredis] to a range"
    low = (int(pin[1]), int(pin[2]))
    high = (int(pin[3]), int(pin[4]))
    assert (low, high) == TESTED_REDIS_PY


def test_every_client_has_the_held_pool(redis_url: str) -> None:
    client = make_client(redis_url)
    try:
        assert isinstance(client.connection_pool, HeldPool)
        assert isinstance(client.connection_pool, redis.ConnectionPool)
        assert client.ping()
    finally:
        client.close()


def _client_id(client: redis.Redis) -> int:
    reply: Any = round_trip(client, [("CLIENT", "ID")], "testing")[0]
    return int(reply)


def _in_other_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(timeout=10)
    assert out, "the other thread's call did not finish"
    return out[0]


def test_the_owner_and_redis_py_share_one_connection(redis_url: str) -> None:
    client = make_client(redis_url)
    try:
        hold(client)
        mine = _client_id(client)
        assert _client_id(client) == mine
        assert int(client.client_id()) == mine  # redis-py's own commands reuse it
        assert _in_other_thread(lambda: _client_id(client)) == mine  # idle: anyone's
        pool: Any = client.connection_pool
        assert len(pool._available_connections) == 1 and not pool._in_use_connections
        release_hold(client)
        release_hold(client)  # idempotent
        assert _client_id(client) == mine
    finally:
        release_hold(client)
        client.close()


def test_the_owner_takes_another_connection_while_another_thread_has_its_own(
    redis_url: str,
) -> None:
    client = make_client(redis_url)
    hold(client)
    try:
        mine = _client_id(client)
        pool: Any = client.connection_pool
        taken = pool.get_connection()  # what another thread would be using now
        taken.send_command("CLIENT", "ID")
        assert int(taken.read_response()) == mine
        other = _client_id(client)
        assert other != mine  # never the connection someone else is reading from
        pool.release(taken)
        assert _client_id(client) == other  # its last one, from now on
    finally:
        release_hold(client)
        client.close()


def test_a_killed_held_connection_is_lost_once_then_reconnects(
    redis_url: str, redis_client: redis.Redis
) -> None:
    client = make_client(redis_url)
    hold(client)
    try:
        mine = _client_id(client)
        redis_client.client_kill_filter(_id=mine)
        with pytest.raises(ConnectionLost):
            round_trip(client, [("PING",)], "testing")
        assert round_trip(client, [("PING",)], "testing") == [b"PONG"]
    finally:
        release_hold(client)
        client.close()


def test_a_forked_child_uses_the_pool_as_usual(redis_url: str) -> None:
    client = make_client(redis_url)
    hold(client)
    try:
        _client_id(client)
        pid = os.fork()
        if pid == 0:  # the child only asks which way it would go, then leaves
            os.setpgid(0, 0)
            _conn, direct = redis_internals.borrow(client)
            os._exit(1 if direct else 0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        conn, direct = redis_internals.borrow(client)
        assert direct  # the parent goes on directly
        redis_internals.give_back(client, conn, direct)
    finally:
        release_hold(client)
        client.close()


def test_a_pool_of_another_kind_is_used_the_usual_way(redis_url: str) -> None:
    client = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(redis_url))
    hold(client)
    try:
        mine = _client_id(client)
        conn, direct = redis_internals.borrow(client)
        assert not direct  # no idle list to move it out of: lent and released by the pool
        redis_internals.give_back(client, conn, direct)
        assert _client_id(client) == mine
    finally:
        release_hold(client)
        client.connection_pool.disconnect()
        client.close()
