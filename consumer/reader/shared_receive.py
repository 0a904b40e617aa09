"""Receiving frames stored once for several groups (:mod:`batchq.protocol.groups`).

A frame push.lua listed for k > 1 groups is read by each group's trainer and deleted by
the last: the reader GETs each frame (into a buffer of its own, as
:mod:`consumer.reader.receive` does with GETDEL) and, in the same round trip, releases
them (release.lua). Redis runs the commands in order, so the bytes are read before the
count drops; a key without a count (one reader) goes at its release like a GETDEL. A
trainer killed between its pop and this round trip leaves the frames' counts up: they
go when the run ends (every frame of the queue is deleted then).
"""

from __future__ import annotations

import redis

from batchq.client.redis_internals import BulkReply, read_bulk_into
from batchq.protocol import trainer_scripts
from batchq.protocol.calls import round_trip
from batchq.protocol.keys import QueueKeys

__all__ = ["get_and_release", "release"]


def get_and_release(client: redis.Redis, keys: QueueKeys, names: list[str]) -> list[BulkReply]:
    """GET each frame key, each value received into a writable buffer of its own, then
    release them all (one round trip).

    Returns:
        One writable byte memoryview per key (None where the key was gone, the error
        where Redis refused: a key of another type).

    Raises:
        ConnectionLost: the connection failed (nothing is released twice: the reader
            does not fetch those elements again).
        redis.ResponseError: Redis refused the release (OOM is not: it deletes).
    """
    if not names:
        return []
    call = trainer_scripts.release_call(keys, names)
    replies = round_trip(
        client,
        [*(("GET", name) for name in names), call.command()],
        "fetching frames",
        keep_errors=True,
        readers=[*([read_bulk_into] * len(names)), None],
    )
    if isinstance(replies[-1], redis.ResponseError):
        raise replies[-1]
    return replies[:-1]


def release(client: redis.Redis, keys: QueueKeys, names: list[str]) -> None:
    """Release frames this reader will not read (refused unfetched: too large)."""
    if names:
        trainer_scripts.release_call(keys, names).run(client)
