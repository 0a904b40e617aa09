"""Where to connect, and Redis clients tuned for moving MB-sized values.

Where both sides connect, first match wins: an explicit ``url``; an explicit
``host``/``port``; the environment's ``BATCHQ_URL``; ``redis://localhost:6379/0``.

The clients made here differ from redis-py's defaults in three ways, each measured:

* The pure-Python command packer is used instead of hiredis' one: hiredis' packer copies
  every value into one new string, about a third of the speed for 1 MiB values, while
  the Python packer sends large values as separate buffers without copying.
* Automatic retries are off (redis-py 8 retries a failed command up to 10 times): on the
  hot path a retried push or pop could apply twice, so batchq handles errors itself.
* glibc's malloc returns multi-MB blocks to the OS after each command and takes them back
  on the next; :func:`tune_malloc` raises those thresholds once per process.

The reconnect and retry loops pause with :class:`Backoff`; a producer's loops end when
its :class:`StopEvent` is set, which a SIGTERM handler may do.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from batchq.client import cluster, urls
from batchq.client.cluster import NodeConnection, NodeSSLConnection, SlotRoute, Topology
from batchq.client.redirects import NodeClient
from batchq.client.redis_internals import HeldPool, pieces_packer
from batchq.client.sentinel import MasterPool, master_pool, not_written
from batchq.client.urls import parse_target
from batchq.errors import (
    AuthFailed,
    BatchQueueError,
    ConfigError,
    ConnectionLost,
    RedisConfigError,
    WrongKeyType,
)
from batchq.wire.frame import Pieces

__all__ = [
    "BACKOFF_FIRST_S",
    "BACKOFF_MAX_S",
    "DEFAULT_SOCKET_TIMEOUT_S",
    "DEFAULT_URL",
    "ENV_URL",
    "Backoff",
    "Pieces",
    "StopEvent",
    "call",
    "client_name",
    "convert_error",
    "describe_url",
    "is_wrong_type",
    "make_client",
    "name_client",
    "reconnect",
    "redis_errors",
    "resolve_url",
    "retrying",
    "server_of",
    "tune_malloc",
    "wrong_type_error",
]

log = logging.getLogger(__name__)

ENV_URL = "BATCHQ_URL"
DEFAULT_URL = "redis://localhost:6379/0"
# Blocking commands (BLPOP/BRPOP) always use timeouts well below this.
DEFAULT_SOCKET_TIMEOUT_S = 10.0

T = TypeVar("T")

redis_errors: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ConnectionResetError,
    BrokenPipeError,
)


def resolve_url(url: str | None = None, host: str | None = None, port: int | None = None) -> str:
    """Pick the Redis URL to use: explicit url, explicit host/port, BATCHQ_URL, localhost.

    Args:
        url: a ``redis://``, ``rediss://`` or ``unix://`` URL, or a cluster's or a
            Sentinel deployment's (:mod:`batchq.client.urls`).
        host: a host name; with or without ``port``.
        port: a TCP port; with or without ``host``.

    Returns:
        The URL to connect to.

    Raises:
        ConfigError: the URL is not one of those forms (naming it, password masked, and
            what was expected), or the port is not a valid TCP port.
    """
    if url:
        chosen = url
    elif host is not None or port is not None:
        if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
            raise ConfigError(f"port {port!r} is not valid: expected an integer in 1..65535")
        chosen = f"redis://{host or 'localhost'}:{port or 6379}/0"
    else:
        chosen = os.environ.get(ENV_URL) or DEFAULT_URL
    parse_target(chosen)
    return chosen


def describe_url(url: str) -> str:
    """The URL with any password masked, for messages and logs."""
    return urls.describe_url(url)


def make_client(
    url: str, *, key: str | None = None, socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S
) -> redis.Redis:
    """A redis-py client for batchq's hot paths: no automatic retry, no copying packer.

    Args:
        url: where to connect (see :func:`resolve_url`).
        key: a key the client is for. On a cluster (``redis+cluster://``) the client is
            bound to the master that holds this key's slot, and follows it there
            (:mod:`batchq.client.cluster`; every key of a queue is in one slot); without
            a key, the master of slot 0. Elsewhere it changes nothing.
        socket_timeout_s: the socket timeout; blocking commands must use less.

    Returns:
        A client returning bytes (decode_responses off); on Sentinel its connections go
        to the current master (:mod:`batchq.client.sentinel`).
    """
    common: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": min(socket_timeout_s, 5.0),
        "retry": Retry(NoBackoff(), 0),
        "command_packer": pieces_packer(),
        "health_check_interval": 0,
    }
    target = parse_target(url)
    if target.kind == "sentinel":
        return redis.Redis.from_pool(master_pool(target, common))
    if target.kind == "cluster":
        topology = Topology(target, {**target.options, **common})
        options = {k: v for k, v in target.options.items() if k != "connection_class"}
        route = SlotRoute(topology, cluster.key_slot(key) if key is not None else 0)
        pool = HeldPool(
            connection_class=NodeSSLConnection if target.tls else NodeConnection,
            route=route,
            **options,
            **common,
        )
        return NodeClient.from_pool(pool)
    pool = HeldPool.from_url(url, **common)
    # from_pool: the client owns its pool, so close() really closes its connections
    # (a client given connection_pool= leaves them open).
    return redis.Redis.from_pool(pool)


def name_client(client: redis.Redis, name: str) -> bool:
    """Name ``client``'s connections ``name`` (CLIENT SETNAME, sent again by every
    reconnect): CLIENT LIST then tells whether the process holding them is alive (a
    killed process's connections close at once).

    Returns:
        False where the server refuses CLIENT SETNAME (ACL): the client stays unnamed.

    Raises:
        ConnectionLost, AuthFailed, RedisConfigError: as :func:`call`.
    """

    def setname() -> bool:
        try:
            client.execute_command("CLIENT", "SETNAME", name)  # type: ignore[no-untyped-call]
        except redis.ResponseError as e:  # NOPERM (ACL); refused credentials are not one
            log.debug("CLIENT SETNAME refused (%s): connections stay unnamed", e)
            return False
        return True

    if not call(setname, "naming the client", client):
        return False
    client.connection_pool.connection_kwargs["client_name"] = name
    return True


def client_name(client: redis.Redis) -> str:
    """The name :func:`name_client` gave ``client``'s connections ('' for none)."""
    return str(client.connection_pool.connection_kwargs.get("client_name") or "")


def is_wrong_type(error: BaseException) -> bool:
    """True for Redis' WRONGTYPE: a key holds another type than the command needs (a
    foreign writer replaced a queue key)."""
    return isinstance(error, redis.ResponseError) and "WRONGTYPE" in str(error)


def wrong_type_error(
    client: Any, expected: dict[str, str], error: BaseException
) -> BatchQueueError:
    """The :class:`WrongKeyType` naming the first of ``expected``'s keys (key -> Redis
    type) that holds another type, after a WRONGTYPE ``error``; ``error`` converted if
    the keys look right again (a transient writer) or cannot be read."""
    try:
        for key, want in expected.items():
            got = client.type(key)
            got = got.decode() if isinstance(got, bytes) else str(got)
            if got not in (want, "none"):
                return WrongKeyType(key, want, got)
    except (redis.RedisError, OSError) as e:
        return convert_error(e, "checking key types", client) or BatchQueueError(str(e))
    return BatchQueueError(f"a queue key held another type for a moment: {error}")


def _where(client: Any) -> tuple[str, int | None, str]:
    """(host or socket path, port or None, user) of a client, for messages (a
    cluster's: the slot's master as last known; Sentinel's: the master's name)."""
    kwargs: dict[str, Any] = {}
    pool = getattr(client, "connection_pool", None)
    with contextlib.suppress(AttributeError):
        kwargs = client.connection_pool.connection_kwargs
    user = str(kwargs.get("username") or "default")
    if "path" in kwargs:
        return str(kwargs["path"]), None, user
    if isinstance(kwargs.get("route"), SlotRoute):
        return kwargs["route"].describe(), None, user
    if isinstance(pool, MasterPool):
        return pool.describe(), None, user
    port = kwargs.get("port")
    return str(kwargs.get("host", "?")), int(port) if port is not None else None, user


def server_of(client: Any) -> str:
    """Where a client's commands go, for messages and status: 'host:port' (a cluster
    client's: the master of its slot; Sentinel's: the master's name and address), or a
    socket's path."""
    host, port, _ = _where(client)
    return host if port is None else f"{host}:{port}"


def _db(client: Any) -> object:
    """The database index a client's URL asked for (None when it cannot be read)."""
    try:
        return client.connection_pool.connection_kwargs.get("db")
    except AttributeError:
        return None


def _config_problem(error: BaseException) -> bool:
    text = str(error)
    return (
        "DB index is out of range" in text
        or "invalid DB index" in text
        or ("Invalid Database" in text)
    )


def convert_error(error: BaseException, what: str, client: Any = None) -> BatchQueueError | None:
    """The batchq error for a redis-py error, or None when it is not about the connection.

    Credentials refused (or a permission missing) become :class:`AuthFailed`, a database
    index the server does not have :class:`RedisConfigError`: both name host, port and
    user (the latter also the index the URL asked for) and are never retried. Drops and
    timeouts become :class:`ConnectionLost`, and so does a write refused by a server that
    is not a writable master any more (READONLY, NOREPLICAS, UNBLOCKED: a failover,
    :func:`batchq.client.sentinel.not_written`): the reconnect loops retry it.

    Args:
        error: what redis-py raised.
        what: what batchq was doing, for the message.
        client: the client, to name the server and user.
    """
    if isinstance(
        error, redis.exceptions.AuthenticationError | redis.exceptions.AuthorizationError
    ) or (
        isinstance(error, redis.ResponseError)
        and str(error).startswith(("WRONGPASS", "NOAUTH", "NOPERM"))
    ):
        host, port, user = _where(client)
        return AuthFailed(host, port, user, f"{error} (while {what})")
    if isinstance(error, redis.RedisError) and _config_problem(error):
        host, port, user = _where(client)
        place = f"{host}:{port}" if port is not None else host
        # The server's reply does not say which index it refused: the URL's is named,
        # as the wrong-password error names host, port and user.
        db = _db(client)
        asked = f" database index {db}" if db is not None else " the connection's settings"
        return RedisConfigError(
            f"Redis at {place} (user {user!r}) refused{asked}: {error}; "
            "check the database index in the URL (redis://host:port/<db>)"
        )
    if isinstance(error, redis_errors):
        return ConnectionLost(f"Redis connection lost while {what}: {error}")
    if not_written(error):  # a failover demoted the master: the write did not happen
        return ConnectionLost(f"Redis refused a write while {what} (not a master now): {error}")
    return None


def call(fn: Callable[[], T], what: str, client: Any = None) -> T:
    """Run one Redis interaction, converting redis-py's connection errors.

    Args:
        fn: the interaction.
        what: what it does, for the error message.
        client: the client it uses (names the server in auth errors).

    Raises:
        ConnectionLost: the connection failed or timed out.
        AuthFailed: the server refused the credentials.
        RedisConfigError: the server refused the connection's settings.
    """
    try:
        return fn()
    except (redis.RedisError, OSError) as e:
        converted = convert_error(e, what, client)
        if converted is None:
            raise
        raise converted from e


BACKOFF_FIRST_S = 0.05  # the first pause of a reconnect or wait loop, then doubled
BACKOFF_MAX_S = 1.0  # ... up to this: Redis back from a restart is noticed within 1 s


class Backoff:
    """The pauses of every reconnect and retry loop: doubling from
    :data:`BACKOFF_FIRST_S` to :data:`BACKOFF_MAX_S`, until ``timeout_s`` has passed.

    Args:
        timeout_s: the loop gives up once its next pause would end past this.
        wait: how to pause (``Event.wait`` makes the loop stoppable).
    """

    def __init__(self, timeout_s: float, wait: Callable[[float], object] = time.sleep) -> None:
        self.timeout_s = timeout_s
        self.delay_s = BACKOFF_FIRST_S
        self._wait = wait
        self._deadline = time.monotonic() + timeout_s

    def pause(self) -> bool:
        """Wait the next pause; False (at once) if it would end past the deadline."""
        if time.monotonic() + self.delay_s > self._deadline:
            return False
        self._wait(self.delay_s)
        self.delay_s = min(2 * self.delay_s, BACKOFF_MAX_S)
        return True


class StopEvent:
    """A stop flag that threads wait on, safe to set from a signal handler.

    :class:`threading.Event` is not: a Python signal handler runs in the main thread
    between two bytecodes, possibly inside ``Event.wait`` while that holds the event's
    lock, and ``Event.set`` there waits for that lock for ever (a producer stopped with
    SIGTERM while it waited for room in the queue hung until SIGKILL). Here ``set`` takes
    no lock: it sets a flag and writes a byte to a pipe, which wakes every thread that
    waits (``poll`` on its read end; the byte is never read, so they all see it). Once
    set, it stays set. Its two descriptors close with it. A forked child gets a pipe of
    its own for each (``os.register_at_fork``): the kernel's pipe is shared across a
    fork, and a child's set() left a byte that turned every wait of the parent into a
    busy loop with its flag unset (a pool's supervisor at 100% CPU).
    """

    def __init__(self) -> None:
        self._flag = False
        self._read_fd, self._write_fd = -1, -1
        self._new_pipe()
        _STOP_EVENTS.add(self)

    def _new_pipe(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        if self._flag:  # a child's copy of a set event: set there too
            os.write(self._write_fd, b"\0")

    def renew_after_fork(self) -> None:
        """In a forked child (``os.register_at_fork`` calls it): a pipe of its own, the
        parent's left to the parent."""
        self._close()
        self._new_pipe()

    def set(self) -> None:
        """Set the flag and wake every waiter (any thread, or a signal handler)."""
        if self._flag:
            return
        self._flag = True
        with contextlib.suppress(OSError):  # a full pipe holds a byte already
            os.write(self._write_fd, b"\0")

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until set, at most ``timeout`` seconds (None: no limit); the flag."""
        if self._flag:
            return True
        poller = select.poll()
        poller.register(self._read_fd, select.POLLIN)
        # poll() takes milliseconds in a C int: a day or more is no limit.
        forever = timeout is None or timeout >= _DAY_S
        poller.poll(None if forever else max(timeout or 0.0, 0.0) * 1000.0)
        return self._flag

    def _close(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._read_fd = self._write_fd = -1

    def __del__(self) -> None:
        if hasattr(self, "_write_fd"):
            self._close()


_DAY_S = 86_400.0
# Every StopEvent alive, for a forked child to give each a pipe of its own.
_STOP_EVENTS: weakref.WeakSet[StopEvent] = weakref.WeakSet()


def _stop_events_after_fork() -> None:
    for event in list(_STOP_EVENTS):
        event.renew_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_stop_events_after_fork)


def retrying(
    fn: Callable[[], T],
    what: str,
    timeout_s: float,
    *,
    client: Any = None,
    halt: Callable[[], bool] | None = None,
) -> T:
    """Run ``fn`` and, while the connection is lost, again: bounded backoff, logged.

    The trainer's calls outside its reader (start, claim, resume, plan waits, close) go
    through this, as the reader's own calls go through its reconnect: a drop anywhere is
    survived if Redis answers again within ``timeout_s``. ``fn`` must be safe to run
    twice (the scripts it calls are idempotent for a repeated token or run id).

    Raises:
        ConnectionLost: Redis did not answer for ``timeout_s``.
        AuthFailed, RedisConfigError: at once (retrying cannot help).
    """
    backoff = Backoff(timeout_s)
    logged = False
    while True:
        try:
            return call(fn, what, client)
        except ConnectionLost as e:
            if (halt is not None and halt()) or not backoff.pause():
                raise ConnectionLost(
                    f"Redis unreachable for {timeout_s:g} s while {what}: {e}"
                ) from e
            if not logged:
                log.warning("%s; retrying for up to %g s", e, timeout_s)
                logged = True


def reconnect(client: redis.Redis, timeout_s: float, halt: threading.Event | StopEvent) -> bool:
    """Wait until ``client`` answers PING again (the reconnect loop of the producer and
    the trainer's reader).

    Returns:
        True once it answers; False if ``halt`` was set meanwhile.

    Raises:
        ConnectionLost: no answer for ``timeout_s``.
        AuthFailed, RedisConfigError: at once (retrying cannot help).
    """
    backoff = Backoff(timeout_s, halt.wait)
    while not halt.is_set():
        try:
            call(client.ping, "reconnecting", client)
            return True
        except ConnectionLost as e:
            if not backoff.pause():
                raise ConnectionLost(f"Redis unreachable for {timeout_s:g} s: {e}") from e
    return False


_tuned = False


def tune_malloc() -> None:
    """Keep glibc from returning multi-MB blocks to the OS after every command.

    Measured on 2 cores: moving 1.5-5 MB values, the mmap/munmap and page faults of each
    block cost about as much as the copy itself. Raising M_MMAP_THRESHOLD and
    M_TRIM_THRESHOLD keeps those blocks in the heap for reuse. A no-op on other C
    libraries and after the first call.
    """
    global _tuned
    if _tuned or not sys.platform.startswith("linux"):
        return
    _tuned = True
    try:
        # The process's own symbols (libc is loaded already), not find_library: that
        # runs ldconfig in a subprocess, milliseconds on a trainer's first batch.
        libc: Any = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 256 * 1024 * 1024)
    mallopt(m_trim_threshold, 1024 * 1024 * 1024)
    log.debug("malloc thresholds raised for large values")
