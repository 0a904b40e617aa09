"""Receiving frames stored by reference into buffers the trainer owns.

redis-py hands a reply over as an immutable ``bytes`` object, so an array over it can
only be writable after a copy. The reader's pipelined ``GETDEL`` commands go through the
one path commands take (:func:`batchq.protocol.calls.round_trip`), each reply read
straight from the socket into a fresh, uninitialised numpy buffer of that frame's size
(:func:`batchq.client.redis_internals.read_bulk_into`): one buffer per frame, never
pooled, so the arrays decoded over it are writable without a copy and no later frame can
write into them. Where the socket cannot be read that way (TLS, fakeredis in unit tests)
each reply is copied once into a buffer of its own.
"""

from __future__ import annotations

import redis

from batchq.client.redis_internals import BulkReply, read_bulk_into
from batchq.protocol.calls import round_trip

__all__ = ["Reply", "getdel_into"]

Reply = BulkReply


def getdel_into(
    client: redis.Redis, keys: list[str], *, raise_on_error: bool = True
) -> list[Reply]:
    """GETDEL each key, each value received into a writable buffer of its own.

    Args:
        client: the reader's client.
        keys: the frame keys to fetch and delete.
        raise_on_error: raise the first error Redis answered (after reading every reply);
            False: return it in that key's place (a key of another type, WRONGTYPE).

    Returns:
        One writable byte memoryview per key (None where the key was gone, the error where
        Redis refused and ``raise_on_error`` is False).

    Raises:
        ConnectionLost: the connection failed (it is dropped, never handed back out of
            step with its replies).
        redis.ResponseError: Redis refused a command (after all replies were read).
    """
    if not keys:
        return []
    replies: list[Reply] = round_trip(
        client,
        [("GETDEL", key) for key in keys],
        "fetching frames",
        keep_errors=True,
        readers=[read_bulk_into] * len(keys),
    )
    if raise_on_error:
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                raise reply
    return replies
