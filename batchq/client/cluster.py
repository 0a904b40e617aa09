"""Redis Cluster: where a queue's slot lives, and a client bound to its master.

Every key of a queue carries the queue's hash tag (``bq:{Q}:...``), so the whole queue
lives in one slot (:func:`key_slot`), on one master. A client made for a key of it
(``make_client(url, key=...)`` with a ``redis+cluster://`` URL) is an ordinary
``redis.Redis`` whose connections go to the master that owns that slot now
(:class:`SlotRoute`, over the cluster's :class:`Topology` and its :class:`SlotMap`: a
``CLUSTER SLOTS`` reply, read once per change of the cluster's layout): every script,
pipeline and round trip of the queue runs unchanged on that node, with batchq's own pool
and packer, and per-node commands (CLIENT LIST, CLIENT ID, SCAN of the queue's keys) ask
the node that holds the queue.

The route follows the slot: a MOVED of its slot moves it (its connections reconnect
there at their next send), and a connection refused or lost makes it read the slot map
again before its next connect (a failover moved the slot). Which refused commands go
again, and where: :mod:`batchq.client.redirects`. redis-py's own ``RedisCluster`` is not
used: it retries by default, routes every command by its keys (a pipeline per node, a
callback per reply) and has neither the pool that lends the hot path's thread its
connection nor the copy-free packer.

:func:`masters` lists the masters (a ``batchq status`` without a queue scans each);
:func:`grouped` groups queues by the master that holds each (a tool reads many queues
with one pipeline per master).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot as _crc_slot
from redis.exceptions import AskError, MovedError
from redis.retry import Retry

from batchq.client.redis_internals import HeldPool
from batchq.client.urls import Target
from batchq.errors import RedisConfigError

__all__ = [
    "SLOTS",
    "NodeConnection",
    "NodeSSLConnection",
    "Reader",
    "SlotMap",
    "SlotRoute",
    "Topology",
    "describe",
    "grouped",
    "key_slot",
    "masters",
    "route_of",
]

#: Reads one reply from a connection (as in :func:`batchq.protocol.calls.round_trip`).
Reader = Callable[[Any], Any]


SLOTS: Final = 16384  # Redis Cluster's hash slots


def key_slot(key: str | bytes) -> int:
    """The cluster slot of a key (its hash tag's, if it has one)."""
    return int(_crc_slot(key.encode() if isinstance(key, str) else key))


@dataclass(frozen=True)
class SlotMap:
    """Which master owns which slots: ``(first, last, host, port)`` ranges."""

    ranges: tuple[tuple[int, int, str, int], ...]

    @classmethod
    def from_reply(cls, reply: Any) -> SlotMap:
        """From a ``CLUSTER SLOTS`` reply."""
        ranges = []
        for entry in reply:
            host = entry[2][0]
            host = host.decode() if isinstance(host, bytes) else str(host)
            ranges.append((int(entry[0]), int(entry[1]), host, int(entry[2][1])))
        return cls(tuple(sorted(ranges)))

    def owner(self, slot: int) -> tuple[str, int] | None:
        """The master that owns ``slot``, or None (no master serves it)."""
        for first, last, host, port in self.ranges:
            if first <= slot <= last:
                return host, port
        return None

    def masters(self) -> list[tuple[str, int]]:
        """Every master that owns slots, in slot order, each once."""
        out: list[tuple[str, int]] = []
        for _, _, host, port in self.ranges:
            if (host, port) not in out:
                out.append((host, port))
        return out


class Topology:
    """One cluster as a URL names it: how to reach its nodes, and its slot map (read
    again once marked stale).

    Args:
        target: the parsed ``redis+cluster://`` URL.
        options: redis-py connection arguments for every node (credentials, TLS,
            timeouts), without host and port.
    """

    def __init__(self, target: Target, options: dict[str, Any]) -> None:
        self.target = target
        self.options = options
        self._map: SlotMap | None = None  # the last one read
        self._fresh = False  # False: read it again before its next use
        self._lock = threading.Lock()

    def node(self, host: str, port: int) -> redis.Redis:
        """A short-lived plain client of one node (no retries); the caller closes it."""
        pool = redis.ConnectionPool(
            host=host, port=port, **{**self.options, "retry": Retry(NoBackoff(), 0)}
        )
        return redis.Redis.from_pool(pool)

    def slot_map(self) -> SlotMap:
        """The slot map (read now if none is known or it was marked stale).

        Raises:
            redis.ConnectionError: no node answered CLUSTER SLOTS.
        """
        with self._lock:
            if self._map is not None and self._fresh:
                return self._map
            known = self._map.masters() if self._map is not None else []
        last: BaseException | None = None
        for host, port in [*known, *(n for n in self.target.nodes if n not in known)]:
            client = self.node(host, port)
            try:
                slot_map = SlotMap.from_reply(client.execute_command("CLUSTER", "SLOTS"))  # type: ignore[no-untyped-call]
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                last = e
                continue
            except redis.ResponseError as e:
                if "cluster support disabled" not in str(e):
                    raise
                raise RedisConfigError(
                    f"Redis at {host}:{port} is not a cluster node ({e}): a "
                    "redis+cluster:// URL names nodes of a Redis Cluster; use redis:// "
                    "for a single server"
                ) from None
            finally:
                client.close()
            if slot_map.ranges:
                with self._lock:
                    self._map, self._fresh = slot_map, True
                return slot_map
        raise redis.ConnectionError(
            f"no node of the cluster at {self.target.where()} answered CLUSTER SLOTS: {last}"
        )

    def stale(self) -> None:
        """Read the slot map again before it is next used."""
        with self._lock:
            self._fresh = False

    def owner(self, slot: int) -> tuple[str, int]:
        """The master that owns ``slot`` now.

        Raises:
            redis.ConnectionError: no node answers, or none serves the slot.
        """
        found = self.slot_map().owner(slot)
        if found is None:
            self.stale()
            found = self.slot_map().owner(slot)
        if found is None:
            raise redis.ConnectionError(
                f"no master of the cluster at {self.target.where()} serves slot {slot}"
            )
        return found

    def send(self, host: str, port: int, args: tuple[Any, ...], options: dict[str, Any],
             *, asking: bool = False) -> Any:  # fmt: skip
        """Run one command on another node (a redirect), with ASKING first if asked."""
        client = self.node(host, port)
        try:
            if not asking:
                return client.execute_command(*args, **options)  # type: ignore[no-untyped-call]
            pipe = client.pipeline(transaction=False)
            pipe.execute_command("ASKING")  # type: ignore[no-untyped-call]
            pipe.execute_command(*args, **options)  # type: ignore[no-untyped-call]
            return pipe.execute(raise_on_error=True)[1]
        finally:
            client.close()

    def send_one(
        self, host: str, port: int, command: Sequence[Any], read: Reader | None, *, asking: bool
    ) -> Any:
        """One command of a round trip on another node (a redirect), read by ``read`` (or
        raw); an error reply is returned, not raised."""
        client = self.node(host, port)
        try:
            conn = client.connection_pool.get_connection()
            try:
                commands = [("ASKING",), tuple(command)] if asking else [tuple(command)]
                packed = conn.pack_commands(commands)  # type: ignore[no-untyped-call]
                conn.send_packed_command(packed)  # type: ignore[no-untyped-call]
                if asking:
                    conn.read_response()
                try:
                    return conn.read_response() if read is None else read(conn)
                except redis.ResponseError as e:
                    return e
            finally:
                client.connection_pool.release(conn)
        finally:
            client.close()


class SlotRoute:
    """Where one slot lives now, shared by the connections of one client.

    Args:
        topology: the cluster.
        slot: the slot the client serves.
    """

    def __init__(self, topology: Topology, slot: int) -> None:
        self.topology = topology
        self.slot = slot
        self.generation = 0  # bumped when the slot moves: connections then reconnect
        self._address: tuple[str, int] | None = None
        self._lock = threading.Lock()

    def address(self) -> tuple[str, int]:
        """The master to connect to (read from the slot map when unknown)."""
        host, port, _ = self.current()
        return host, port

    def current(self) -> tuple[str, int, int]:
        """(host, port, generation) of the master to connect to, read together: a
        connection made to it is current until the generation changes."""
        with self._lock:
            if self._address is not None:
                return (*self._address, self.generation)
        found = self.topology.owner(self.slot)
        with self._lock:
            if self._address is None:
                self._address = found
            return (*self._address, self.generation)

    def moved(self, host: str, port: int) -> None:
        """A MOVED for this slot: the slot's owner is now ``host:port``; every
        connection of the route reconnects at its next send (also one that had
        connected to this address from an older slot map: it got the MOVED)."""
        with self._lock:
            self._address = (host, port)
            self.generation += 1
        self.topology.stale()

    def lost(self) -> None:
        """A connection to the slot's master failed: ask the cluster again next time."""
        with self._lock:
            self._address = None
            self.generation += 1
        self.topology.stale()

    def owns(self, redirect: object) -> bool:
        """Whether a redirect is a MOVED of this route's slot (the slot has a new owner);
        any other (an ASK, another slot's MOVED) is followed for its command alone."""
        return isinstance(redirect, MovedError) and redirect.slot_id == self.slot

    def elsewhere(self, redirect: AskError, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
        """One command a redirect sends to another node: a MOVED of another slot after
        the slot map is marked stale, an ASK with ASKING first."""
        asking = not isinstance(redirect, MovedError)
        if not asking:
            self.topology.stale()
        return self.topology.send(redirect.host, redirect.port, args, options, asking=asking)

    def describe(self) -> str:
        """'host:port' of the slot's master (the cluster's seeds if none answers), for
        messages and status."""
        try:
            host, port = self.address()
        except (redis.RedisError, OSError):
            return self.topology.target.where()
        return f"{host}:{port}"


class NodeConnection(redis.Connection):
    """A connection to the master of a :class:`SlotRoute` (kwarg ``route``): it connects
    to the slot's owner of the moment and reconnects once the slot moved."""

    def __init__(self, *, route: SlotRoute, **kwargs: Any) -> None:
        self.route = route
        self._generation = -1
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]

    def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if self.is_connected:
            return
        self.host, self.port, self._generation = self.route.current()
        try:
            super().connect_check_health(check_health, retry_socket_connect)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            self.route.lost()  # a failover, perhaps: read the slot map again
            raise

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self.is_connected and self._generation != self.route.generation:
            # The slot moved: reconnect to its new owner.
            self.disconnect()  # type: ignore[no-untyped-call]
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


class NodeSSLConnection(NodeConnection, redis.SSLConnection):
    """:class:`NodeConnection` over TLS (``rediss+cluster://``)."""


def route_of(client: redis.Redis) -> SlotRoute | None:
    """The slot route of a cluster client (:func:`batchq.client.connection.make_client`
    with a key), None for a client that is not a cluster's."""
    route = getattr(client.connection_pool, "connection_kwargs", {}).get("route")
    return route if isinstance(route, SlotRoute) else None


@contextlib.contextmanager
def grouped(
    client: redis.Redis, keyed: Mapping[str, str]
) -> Iterator[list[tuple[redis.Redis, list[str]]]]:
    """``keyed`` (name -> a key of it) grouped by the master that holds each key now,
    each group with a client bound to its first key's slot (closed after the block): a
    tool reads many queues with one pipeline per master. A client that is not a
    cluster's reads them all: ``[(client, names)]``."""
    route = route_of(client)
    if route is None or not keyed:
        yield [(client, list(keyed))]
        return
    groups: dict[tuple[str, int], list[str]] = {}
    for name, key in keyed.items():
        groups.setdefault(route.topology.owner(key_slot(key)), []).append(name)
    pool = client.connection_pool
    made: list[tuple[redis.Redis, list[str]]] = []
    try:
        for names in groups.values():
            bound = SlotRoute(route.topology, key_slot(keyed[names[0]]))
            kwargs = {**pool.connection_kwargs, "route": bound}
            # The client's own class (redirects.NodeClient): it follows redirects too.
            made.append((type(client).from_pool(HeldPool(pool.connection_class, **kwargs)), names))
        yield made
    finally:
        for node, _ in made:
            with contextlib.suppress(redis.RedisError, OSError):
                node.close()


def describe(client: redis.Redis) -> str | None:
    """'host:port' of the master a cluster client is bound to now, None for a client
    that is not a cluster's."""
    route = route_of(client)
    return route.describe() if route is not None else None


def masters(client: Any) -> Iterator[redis.Redis]:
    """A client of each master of ``client``'s cluster (each closed after its turn), or
    ``client`` itself where it is not a cluster's."""
    route = route_of(client)
    if route is None:
        yield client
        return
    topology = route.topology
    for host, port in topology.slot_map().masters():
        node = topology.node(host, port)
        try:
            yield node
        finally:
            with contextlib.suppress(redis.RedisError, OSError):
                node.close()
