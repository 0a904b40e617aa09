"""Auth and configuration errors are their own classes, never retried (issue 11).

Before: a wrong password read ``ConnectionLost: Redis connection lost while running
claim: invalid username-password pair`` (no host named, a type callers retry), and a
database index out of range was a raw ``redis.ResponseError``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from pipelines import numbered

from batchq.errors import AuthFailed, ConfigError, ConnectionLost, RedisConfigError
from consumer import ServerDataStream
from producer import Producer


def with_user(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}").geturl()


def with_db(url: str, db: int) -> str:
    return urlsplit(url)._replace(path=f"/{db}").geturl()


# A 60 s reconnect budget and a 20 s test limit: a retried auth error would time out.
@pytest.mark.timeout(20)
def test_trainer_with_a_wrong_password_gets_auth_failed_at_once(
    redis_url: str, queue_name: str
) -> None:
    url = with_user(redis_url, "ghost", "wrong")
    stream = ServerDataStream(("features",), url=url, queue=queue_name, timeout_s=60)
    with pytest.raises(AuthFailed) as info:
        stream.get_epoch_iterator()
    error = info.value
    assert not isinstance(error, ConnectionLost)
    port = urlsplit(redis_url).port
    assert (error.host, error.port, error.user) == ("127.0.0.1", port, "ghost")
    assert f"127.0.0.1:{port}" in str(error) and "'ghost'" in str(error)
    assert "wrong" not in str(error)  # the password is never shown
    stream.close()


@pytest.mark.timeout(20)
def test_producer_with_a_wrong_password_gets_auth_failed_at_once(
    redis_url: str, queue_name: str
) -> None:
    producer = Producer(
        numbered(20, 10), with_user(redis_url, "ghost", "wrong"), queue_name,
        reconnect_timeout_s=60,
    )  # fmt: skip
    with pytest.raises(AuthFailed, match="ghost"):
        producer.serve()


@pytest.mark.timeout(20)
def test_database_index_out_of_range_is_a_config_error(redis_url: str, queue_name: str) -> None:
    url = with_db(redis_url, 99)
    stream = ServerDataStream(("features",), url=url, queue=queue_name, timeout_s=60)
    with pytest.raises(RedisConfigError) as info:
        stream.get_epoch_iterator()
    assert isinstance(info.value, ConfigError)
    assert str(urlsplit(redis_url).port) in str(info.value)
    assert "database index 99:" in str(info.value)  # the index the URL asked for
    stream.close()
    with pytest.raises(RedisConfigError, match="database index 99:"):
        Producer(numbered(20, 10), url, queue_name, reconnect_timeout_s=60).serve()
