"""Redis Sentinel: a client whose connections go to the current master.

A ``redis+sentinel://`` URL names the sentinels and the master's name; redis-py's
``Sentinel`` asks them where the master is (``SENTINEL MASTERS``: a master that is up
and seen by its sentinels). The client made for it (:func:`master_pool`) is an
ordinary ``redis.Redis`` over a :class:`MasterPool`, which is both batchq's pool (the
hot path's thread keeps its connection: :class:`batchq.client.redis_internals.HeldPool`)
and redis-py's ``SentinelConnectionPool``; its connections are :class:`MasterConnection`.

How a failover reaches batchq's code: as a lost connection, at the one boundary where
redis-py's errors become batchq's (:func:`batchq.client.connection.convert_error`), so
the reconnect loops that already survive a Redis restart carry producers and the
trainer over to the new master:

* the old master died (kill -9): its sockets close, and a reconnect asks the sentinels
  again (they name the new master once they failed over, a second or two later);
* the old master was demoted (``SENTINEL FAILOVER``): clients blocked on it are
  released with ``UNBLOCKED``, writes are refused with ``READONLY`` (inside a script
  too: ``Error running script ... -READONLY``) and, with ``min-replicas-to-write``,
  ``NOREPLICAS``. Each becomes a dropped connection (none of them wrote anything);
* a demoted master keeps its connections open, and Sentinel reconfigures it only at
  its next look (up to 10 s later): meanwhile it takes writes that will be lost. So a
  pool in use asks the sentinels where the master is every :data:`MASTER_CHECK_S` and
  drops its idle connections when the answer changed.

What a failover can lose (the last writes before it, asynchronous replication) and how
batchq repairs it is in docs/deploy.md, "Sentinel".
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any, Final

import redis
from redis.exceptions import MasterDownError, ReadOnlyError
from redis.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
)

from batchq.client.redis_internals import HeldPool
from batchq.client.urls import Target

__all__ = [
    "MASTER_CHECK_S",
    "MasterConnection",
    "MasterPool",
    "MasterSSLConnection",
    "master_pool",
    "not_written",
]

# A pool in use asks the sentinels where the master is at most this often: the longest
# a batchq client keeps writing to a demoted master that has not closed its connections.
MASTER_CHECK_S: Final = 0.5
# What a demoted (or replica-less) master answers to a write, also as a script's error
# ("Error running script ... -READONLY ..."): the write did not happen.
_NOT_WRITTEN = (
    "You can't write against a read only replica",
    "NOREPLICAS",
    "UNBLOCKED force unblock",
)


def not_written(error: BaseException) -> bool:
    """Whether a reply error says a write was refused because the server is not a
    writable master (a failover): READONLY, NOREPLICAS, MASTERDOWN, UNBLOCKED, also as
    the error of a script."""
    if isinstance(error, ReadOnlyError | MasterDownError):
        return True
    return isinstance(error, redis.ResponseError) and any(f in str(error) for f in _NOT_WRITTEN)


class MasterConnection(SentinelManagedConnection):
    """redis-py's Sentinel connection, plus: it asks for the master whenever it
    (re)connects, however it is reached (a held connection reconnects through
    ``send_packed_command``, which redis-py's class does not route through
    ``connect``), and a refused write (:func:`not_written`) drops it."""

    def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        with _short_not_found(self.connection_pool):
            if not self.is_connected and self.connection_pool.is_master:
                self.host, self.port = self.connection_pool.get_master_address()
            super().connect_check_health(check_health, retry_socket_connect)

    def connect(self) -> None:
        with _short_not_found(self.connection_pool):
            super().connect()  # type: ignore[no-untyped-call]

    def connect_to(self, address: Any) -> None:
        # The base class sets the address, then connects: ours asks for it above.
        self.connect_check_health(check_health=self.connection_pool.check_connection)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as e:
            if not (self.connection_pool.is_master and not_written(e)):
                raise
            self.disconnect()  # type: ignore[no-untyped-call]
            raise redis.ConnectionError(f"the master is no longer writable ({e})") from e


@contextlib.contextmanager
def _short_not_found(pool: Any) -> Iterator[None]:
    """redis-py's MasterNotFoundError holds each sentinel's pool repr (over 1,000
    characters for one sentinel): raised again with each sentinel's own answer, asked
    again, in a line."""
    try:
        yield
    except MasterNotFoundError:
        raise MasterNotFoundError(_not_found(pool.service_name, pool.sentinel_manager)) from None


def _not_found(service: str, manager: Sentinel) -> str:
    answers = []
    for client in manager.sentinels:
        kwargs = client.connection_pool.connection_kwargs
        where = f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
        try:
            masters: Any = client.sentinel_masters()
        except (redis.RedisError, OSError) as e:
            answers.append(f"{where}: {e}")
            continue
        state = masters.get(service)
        answers.append(
            f"{where}: no master named {service!r}" if state is None
            else f"{where}: the master is down ({state.get('flags', '?')})"
        )  # fmt: skip
    return (
        f"no sentinel knows a master {service!r} that is up ({'; '.join(answers)}); a "
        "redis+sentinel:// URL names sentinels, then the master's name: "
        "redis+sentinel://host:26379/<name>/<db>"
    )


class MasterSSLConnection(MasterConnection, redis.SSLConnection):
    """:class:`MasterConnection` over TLS (``rediss+sentinel://``)."""


class MasterPool(HeldPool, SentinelConnectionPool):
    """batchq's pool over redis-py's Sentinel pool (see the module's docstring).

    Args:
        service_name: the master's name, as the sentinels know it.
        sentinel_manager: redis-py's ``Sentinel`` of the URL's sentinels.
        **kwargs: the connections' arguments.
    """

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)
        self._checked = 0.0  # monotonic time the master was last asked for
        self._check_lock = threading.Lock()

    def _check_master(self) -> None:
        """Ask the sentinels where the master is, at most every MASTER_CHECK_S; a new
        answer drops the idle connections (redis-py's proxy does that)."""
        now = time.monotonic()
        if now - self._checked < MASTER_CHECK_S or not self._check_lock.acquire(blocking=False):
            return
        try:
            self._checked = now
            # Sentinels unreachable for a moment: the connection in hand still works.
            with contextlib.suppress(redis.RedisError, OSError):
                self.get_master_address()  # type: ignore[no-untyped-call]
        finally:
            self._check_lock.release()

    def borrow(self) -> tuple[Any, bool]:
        self._check_master()
        return super().borrow()

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        self._check_master()
        return super().get_connection(*args, **kwargs)

    def disconnect(self, inuse_connections: bool = True) -> None:
        super().disconnect(inuse_connections)
        if inuse_connections:  # the client closes: so do its links to the sentinels
            for client in self.sentinel_manager.sentinels:
                with contextlib.suppress(redis.RedisError, OSError):
                    client.connection_pool.disconnect()

    def describe(self) -> str:
        """'master <name> at host:port' as last known, for messages."""
        where = self.master_address
        at = f" at {where[0]}:{where[1]}" if where else ""
        return f"master {self.service_name!r}{at}"


def master_pool(target: Target, common: dict[str, Any]) -> MasterPool:
    """The pool of a client of ``target``'s master (a ``redis+sentinel://`` URL).

    Args:
        target: the parsed URL.
        common: batchq's connection arguments (timeouts, retries off, the packer).
    """
    options = {k: v for k, v in target.options.items() if k != "connection_class"}
    sentinel_kwargs = {
        "socket_timeout": min(common.get("socket_timeout") or 1.0, 1.0),
        "socket_connect_timeout": min(common.get("socket_connect_timeout") or 1.0, 1.0),
        **target.sentinel_options,
    }
    manager = Sentinel(list(target.nodes), sentinel_kwargs=sentinel_kwargs)
    connection_class = MasterSSLConnection if target.tls else MasterConnection
    return MasterPool(
        target.service, manager, connection_class=connection_class, **options, **common
    )
