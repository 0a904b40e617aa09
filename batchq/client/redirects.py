"""Commands a Redis Cluster refused (MOVED, ASK, TRYAGAIN, CLUSTERDOWN), sent again
where they belong: redis-py's own commands (:class:`NodeClient`, the client of
:func:`batchq.client.connection.make_client` for a cluster's queue) and batchq's round
trips (:func:`follow_redirects`).

A refused command is sent again only where the node says it did not run:

* ``MOVED <slot> <host>:<port>``: the slot has a new owner (a resharding finished, a
  failover). The route takes it (:meth:`batchq.client.cluster.SlotRoute.moved`) and the
  command goes again. A MOVED for another slot (a tool reading several queues through
  one node's client) is followed for that command alone.
* ``ASK <slot> <host>:<port>``: the slot is migrating and this key has left already:
  ``ASKING`` and the command on the target, once.
* ``TRYAGAIN`` (a command on several keys of a slot in the middle of a migration) and
  ``CLUSTERDOWN``: the command goes again after a pause, for up to
  :data:`TRYAGAIN_S`; so does a second MOVED for the same command
  (the nodes may disagree for a moment while a slot changes owner).

None of these ran the command, so sending it again is not a retry of a command that
may have run: batchq's clients keep redis-py's retries off (docs/design.md, "Client
settings that matter").

:func:`batchq.protocol.calls.round_trip` reads every reply of its commands in place;
where one is a redirect (:data:`REDIRECTS`) it hands them to :func:`follow_redirects`,
which sends again only the refused commands (the others ran), in their order, and
returns the replies with theirs in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import redis
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    TryAgainError,
)

from batchq.client.cluster import (
    Reader,
    SlotRoute,
    Topology,
    route_of,
)

__all__ = [
    "PAUSE_FIRST_S",
    "PAUSE_MAX_S",
    "REDIRECTS",
    "TRYAGAIN_S",
    "NodeClient",
    "Pauses",
    "Send",
    "follow_redirects",
    "is_redirect",
]

TRYAGAIN_S: Final = 10.0  # how long a command refused mid-migration is sent again
PAUSE_FIRST_S, PAUSE_MAX_S = 0.005, 0.2  # TRYAGAIN's pauses: a migration takes ms

#: Sends commands on a client's own connection, reading each with its reader (or raw);
#: error replies in place.
Send = Callable[[list[Any], list[Reader | None]], list[Any]]

#: The replies that refuse a command without running it (MOVED, a kind of ASK; ASK,
#: TRYAGAIN, CLUSTERDOWN): it may be sent again where it belongs.
REDIRECTS: Final = (AskError, TryAgainError, ClusterDownError)


def is_redirect(reply: object) -> bool:
    """Whether a reply is one of :data:`REDIRECTS`."""
    return isinstance(reply, REDIRECTS)


class NodeClient(redis.Redis):
    """A ``redis.Redis`` bound to the master of one slot (its pool's connections are
    :class:`NodeConnection` s of one :class:`SlotRoute`), following redirects."""

    @property
    def route(self) -> SlotRoute:
        """The slot this client serves, and where it is."""
        route: SlotRoute = self.connection_pool.connection_kwargs["route"]
        return route

    def execute_command(self, *args: Any, **options: Any) -> Any:
        route = self.route
        pauses = Pauses(time.monotonic() + TRYAGAIN_S)
        while True:
            try:
                return super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
            except AskError as e:  # MOVED is a kind of ASK
                if not route.owns(e):  # ASK, or another queue's key: that command alone
                    return route.elsewhere(e, args, options)
                route.moved(e.host, e.port)
                if not pauses.wait():
                    raise
            except (TryAgainError, ClusterDownError):
                if not pauses.wait(at_once=False):
                    raise


class Pauses:
    """The waits between rounds of redirects: the first round goes at once (unless told
    otherwise), the next after a pause that doubles up to a cap, none past the deadline
    (a moving slot's nodes may disagree for a moment).

    Args:
        deadline: ``time.monotonic()`` past which no round goes.
    """

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline
        self._pause_s = 0.0

    def wait(self, *, at_once: bool = True) -> bool:
        """Sleeps before the next round (none before the first where ``at_once``: TRYAGAIN
        pauses from the first); False where the deadline would pass."""
        if not at_once:
            self._pause_s = self._pause_s or PAUSE_FIRST_S
        if self._pause_s:
            if time.monotonic() + self._pause_s > self._deadline:
                return False
            time.sleep(self._pause_s)
        self._pause_s = min(2 * self._pause_s, PAUSE_MAX_S) if self._pause_s else PAUSE_FIRST_S
        return True


_REFUSED: Final = (*REDIRECTS, NoScriptError)


def _pending(replies: Sequence[object]) -> list[int]:
    """The indexes of the redirects and NOSCRIPTs: commands that did not run, to send
    again alone."""
    return [i for i, reply in enumerate(replies) if isinstance(reply, _REFUSED)]


def follow_redirects(
    client: redis.Redis,
    commands: Sequence[Sequence[Any]],
    replies: list[Any],
    readers: Sequence[Reader | None] | None,
    send: Send,
    load: Callable[[redis.Redis], None],
) -> list[Any]:
    """The replies of a round trip, with every command the cluster refused with a
    redirect (:func:`is_redirect`) sent again where it belongs and its reply in place.

    Only the refused commands go again, in their order: the others ran. ``send`` sends
    on the client's own connection (the slot's master, after a MOVED for its slot);
    a command for another node (ASK, another slot's MOVED) goes alone on a connection of
    that node, where ``load`` loads the scripts on NOSCRIPT. A NOSCRIPT among the
    replies (a node that never ran batchq's scripts) is refused the same way: the
    scripts are loaded there and that command alone goes again, never the whole round
    trip, some of whose commands ran on another node. A client that is not a cluster's
    gets ``replies`` back as they are.
    """
    route = route_of(client)
    if route is None:
        return replies
    reads = list(readers) if readers is not None else [None] * len(commands)
    pauses = Pauses(time.monotonic() + TRYAGAIN_S)
    while (pending := _pending(replies)) and pauses.wait():
        again = _place(route, commands, replies, reads, pending, load)
        if again:
            _send_again(client, again, commands, replies, reads, send, load)
    return replies


def _send_again(
    client: redis.Redis,
    again: Sequence[int],
    commands: Sequence[Sequence[Any]],
    replies: list[Any],
    reads: Sequence[Reader | None],
    send: Send,
    load: Callable[[redis.Redis], None],
) -> None:
    """The refused commands of the client's own node sent again, in their order (the
    scripts loaded there first where one was refused with NOSCRIPT), their replies put
    in place."""
    if any(isinstance(replies[i], NoScriptError) for i in again):
        load(client)  # on the node the client is bound to now (after any MOVED)
    resent = send([commands[i] for i in again], [reads[i] for i in again])
    for i, reply in zip(again, resent, strict=True):
        replies[i] = reply


def _place(
    route: SlotRoute,
    commands: Sequence[Sequence[Any]],
    replies: list[Any],
    reads: Sequence[Reader | None],
    pending: Sequence[int],
    load: Callable[[redis.Redis], None],
) -> list[int]:
    """Follows each refused reply: one for another node is sent there at once (its reply
    put in place); the indexes of the others, to send again on the client's own
    connection, are returned (NOSCRIPT, a MOVED of the route's slot, which moves the
    route, TRYAGAIN, CLUSTERDOWN: a migration or a failover in progress)."""
    again = []
    for i in pending:
        reply = replies[i]
        ours = route.owns(reply)
        if isinstance(reply, AskError) and not ours:  # MOVED for another slot, or ASK
            asking = not isinstance(reply, MovedError)
            replies[i] = _elsewhere(route.topology, reply, commands[i], reads[i], asking, load)
            continue
        if ours:
            route.moved(reply.host, reply.port)
        again.append(i)
    return again


def _elsewhere(
    topology: Topology,
    redirect: AskError,
    command: Sequence[Any],
    read: Reader | None,
    asking: bool,
    load: Callable[[redis.Redis], None],
) -> Any:
    """One redirected command on its node; NOSCRIPT there loads the scripts, once."""
    if not asking:
        topology.stale()
    reply = topology.send_one(redirect.host, redirect.port, command, read, asking=asking)
    if isinstance(reply, redis.exceptions.NoScriptError):
        node = topology.node(redirect.host, redirect.port)
        try:
            load(node)
        finally:
            node.close()
        reply = topology.send_one(redirect.host, redirect.port, command, read, asking=asking)
    return reply
