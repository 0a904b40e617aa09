"""A round trip's replies that a Redis Cluster refused (MOVED, ASK, TRYAGAIN), sent
again where they belong.

:func:`batchq.protocol.calls.round_trip` reads every reply of its commands in place;
where one is a redirect (:data:`REDIRECTS`) it hands them to :func:`follow_redirects`,
which sends again only the refused commands (the others ran), in their order, and
returns the replies with theirs in place. What each redirect means and how the client
follows the slot: :mod:`batchq.client.cluster`.
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
    PAUSE_FIRST_S,
    PAUSE_MAX_S,
    TRYAGAIN_S,
    Reader,
    SlotRoute,
    Topology,
)

__all__ = ["REDIRECTS", "Reader", "Send", "follow_redirects", "is_redirect"]

#: Sends commands on a client's own connection, reading each with its reader (or raw);
#: error replies in place.
Send = Callable[[list[Any], list[Reader | None]], list[Any]]

#: The replies that refuse a command without running it (MOVED, a kind of ASK; ASK,
#: TRYAGAIN, CLUSTERDOWN): it may be sent again where it belongs.
REDIRECTS: Final = (AskError, TryAgainError, ClusterDownError)


def is_redirect(reply: object) -> bool:
    """Whether a reply is one of :data:`REDIRECTS`."""
    return isinstance(reply, REDIRECTS)


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
    route = getattr(client.connection_pool, "connection_kwargs", {}).get("route")
    if not isinstance(route, SlotRoute):
        return replies
    reads = list(readers) if readers is not None else [None] * len(commands)
    pauses = _Pauses(time.monotonic() + TRYAGAIN_S)
    while (pending := _pending(replies)) and pauses.wait():
        again = _place(route, commands, replies, reads, pending, load)
        if any(isinstance(replies[i], NoScriptError) for i in again):
            load(client)  # on the node the client is bound to now (after any MOVED)
        if again:
            resent = send([commands[i] for i in again], [reads[i] for i in again])
            for i, reply in zip(again, resent, strict=True):
                replies[i] = reply
    return replies


class _Pauses:
    """The waits between rounds of redirects: the first round goes at once, the next
    after a pause that doubles up to a cap, none past the deadline (a moving slot's
    nodes may disagree for a moment)."""

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline
        self._pause_s = 0.0

    def wait(self) -> bool:
        """Sleeps before the next round; False where the deadline would pass."""
        if self._pause_s:
            if time.monotonic() + self._pause_s > self._deadline:
                return False
            time.sleep(self._pause_s)
        self._pause_s = min(2 * self._pause_s, PAUSE_MAX_S) if self._pause_s else PAUSE_FIRST_S
        return True


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
        ours = isinstance(reply, MovedError) and reply.slot_id == route.slot
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
