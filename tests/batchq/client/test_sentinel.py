"""batchq.client.sentinel: what a failover looks like to a Sentinel client (the failover
itself: tests/consumer/test_sentinel_failover.py)."""

from __future__ import annotations

import pytest
import redis
from redis.exceptions import MasterDownError, ReadOnlyError

from batchq.client.connection import call, convert_error, make_client, server_of
from batchq.client.redis_internals import HeldPool
from batchq.client.sentinel import MasterConnection, MasterPool, not_written
from batchq.errors import ConnectionLost

SCRIPT_READONLY = (
    "Error running script (call to f_9405b057): @user_script:1: @user_script: 1: "
    "-READONLY You can't write against a read only replica."
)


@pytest.mark.parametrize(
    "error",
    [
        ReadOnlyError("You can't write against a read only replica."),
        redis.ResponseError(SCRIPT_READONLY),  # a script's write refused by a replica
        redis.ResponseError("NOREPLICAS Not enough good replicas to write."),
        MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
        redis.ResponseError(
            "UNBLOCKED force unblock from blocking operation, instance state changed"
        ),
    ],
)
def test_a_write_refused_by_a_demoted_master_is_told(error: redis.ResponseError) -> None:
    assert not_written(error)


@pytest.mark.parametrize(
    "error",
    [
        redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"),
        redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'."),
        redis.ConnectionError("reset"),
    ],
)
def test_other_errors_are_not_a_failover(error: redis.RedisError) -> None:
    assert not not_written(error)


def test_a_sentinel_client_is_batchqs_pool_over_redis_pys_sentinel_pool() -> None:
    client = make_client("redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/jobs/3")
    pool = client.connection_pool
    assert isinstance(pool, MasterPool) and isinstance(pool, HeldPool)
    assert pool.connection_class is MasterConnection
    assert pool.connection_kwargs["db"] == 3 and pool.connection_kwargs["password"] == "pw"
    assert pool.service_name == "jobs"
    assert server_of(client) == "master 'jobs'"  # not asked yet: no address
    # No sentinel answers: a lost connection, the reconnect loops' business.
    with pytest.raises(redis.ConnectionError) as info:
        client.ping()
    lost = convert_error(info.value, "pinging", client)
    assert isinstance(lost, ConnectionLost)
    client.close()


def test_a_refused_write_raised_anywhere_is_a_lost_connection() -> None:
    # The reconnect loops retry ConnectionLost: after a failover, on the new master.
    lost = convert_error(redis.ResponseError(SCRIPT_READONLY), "pushing a frame")
    assert isinstance(lost, ConnectionLost) and "not a master now" in str(lost)
    assert convert_error(redis.ResponseError("WRONGTYPE ..."), "pushing a frame") is None


def test_a_sentinel_url_at_a_plain_server_says_so_in_a_line(redis_url: str) -> None:
    # redis-py's MasterNotFoundError held each sentinel's pool repr (1,200 characters).
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    client = make_client(f"redis+sentinel://127.0.0.1:{port}/mymaster/0")
    try:
        with pytest.raises(ConnectionLost) as info:
            call(client.ping, "pinging", client)
    finally:
        client.close()
    said = str(info.value)
    assert f"no sentinel knows a master 'mymaster' that is up (127.0.0.1:{port}: unknown" in said
    assert "redis+sentinel://host:26379/<name>/<db>" in said
    assert len(said) < 400 and "ConnectionPool" not in said
