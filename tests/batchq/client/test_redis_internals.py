"""batchq.client.redis_internals: the one module on redis-py's internals fails loudly on a
redis-py that changed them, and pyproject pins the versions they were checked on."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import redis

from batchq.client.connection import make_client
from batchq.client.redis_internals import TESTED_REDIS_PY, HeldPool, check_internals

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
