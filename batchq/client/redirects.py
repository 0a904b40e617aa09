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


def _refused(reply: object) -> bool:
    """A redirect, or NOSCRIPT: a command that did not run, to send again alone."""
    return isinstance(reply, _REFUSED)


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
    deadline = time.monotonic() + TRYAGAIN_S
    pause_s = 0.0  # the first redirect is followed at once, the next after a pause
    while True:
        pending = [i for i, reply in enumerate(replies) if _refused(reply)]
        if not pending:
            break
        if pause_s:  # the slot is moving: its nodes may disagree for a moment
            if time.monotonic() + pause_s > deadline:
                break
            time.sleep(pause_s)
        pause_s = min(2 * pause_s, PAUSE_MAX_S) if pause_s else PAUSE_FIRST_S
        again = []
        noscript = any(isinstance(replies[i], NoScriptError) for i in pending)
        for i in pending:
            reply, read = replies[i], readers[i] if readers is not None else None
            if isinstance(reply, NoScriptError):
                again.append(i)
            elif isinstance(reply, MovedError) and reply.slot_id == route.slot:
                route.moved(reply.host, reply.port)
                again.append(i)
            elif isinstance(reply, AskError):  # MOVED for another slot, or ASK
                asking = not isinstance(reply, MovedError)
                replies[i] = _elsewhere(route.topology, reply, commands[i], read, asking, load)
            else:  # TRYAGAIN, CLUSTERDOWN: a migration or a failover in progress
                again.append(i)
        if noscript:
            load(client)  # on the node the client is bound to now (after any MOVED)
        if again:
            resent = send([commands[i] for i in again], [
                readers[i] if readers is not None else None for i in again
            ])  # fmt: skip
            for i, reply in zip(again, resent, strict=True):
                replies[i] = reply
    return replies


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
