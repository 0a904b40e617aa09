"""Recovering work: dead producers' leases, and shards with a gap after a stall.

Both producers (on their heartbeat) and the trainer (when it stalls) call these; the
scripts re-check everything atomically, so calling them too often is harmless.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import redis

from batchq.client.connection import call, redis_errors
from batchq.errors import ConnectionLost
from batchq.protocol import recovery_scripts
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import time_ms
from batchq.protocol.words import Status

__all__ = [
    "connected_ids",
    "connected_names",
    "reap_dead",
    "reap_gone",
    "record_client",
    "requeue_gaps",
    "server_ms",
]

log = logging.getLogger(__name__)


def server_ms(client: redis.Redis) -> int:
    """Redis' clock in milliseconds (deadlines use it, never a host's clock)."""
    return time_ms(call(client.time, "reading the server's clock"))


def _members(client: redis.Redis, keys: QueueKeys, low: int | str, high: int | str) -> list[str]:
    """Producer ids whose heartbeat deadline lies in [low, high]."""
    found: list[bytes] = call(
        lambda: client.zrangebyscore(keys.producers, low, high),  # type: ignore[arg-type,return-value]
        "listing producers",
    )
    return [p.decode() for p in found]


def reap_dead(
    client: redis.Redis, keys: QueueKeys, incarnation: str, now_ms: int | None = None
) -> tuple[int, int]:
    """Hand the leases of producers whose heartbeat deadline passed back to the work list.

    Args:
        now_ms: the server's clock if the caller just read it (saves a round trip).

    Returns:
        (producers reaped, shards returned).
    """
    if now_ms is None:
        now_ms = server_ms(client)
    dead = _members(client, keys, "-inf", now_ms)
    if not dead:
        return 0, 0
    reply = recovery_scripts.reap(client, keys, incarnation=incarnation, why="dead", producers=dead)
    if reply.status != Status.OK:
        return 0, 0
    if reply.first:
        log.info("queue %s: reaped %d dead producer(s), %d shard(s) back", keys.queue,
                 reply.first, reply.second)  # fmt: skip
    return reply.first, reply.second


def requeue_gaps(
    client: redis.Redis,
    keys: QueueKeys,
    incarnation: str,
    run: str,
    shards: Sequence[int],
    *,
    rank: tuple[str, str, Sequence[int]] | None = None,
    mask: int = 1,
) -> list[int]:
    """Return shards with a gap to the work list, if nobody can still deliver them.

    Args:
        shards: candidate global shard numbers (incomplete in the trainer's ledger).
        rank: a data-parallel rank's or a group slot's (data list, its cursor field,
            the candidates' local shard numbers), see requeue.lua.
        mask: the caller's group slot as a mask: its shards go back for it alone.

    Returns:
        The shards requeued.
    """
    if not shards:
        return []
    now_ms = server_ms(client)
    alive = _members(client, keys, now_ms, "+inf")
    reply = recovery_scripts.requeue(
        client,
        keys,
        incarnation=incarnation,
        run=run,
        data=keys.data if rank is None else rank[0],
        shards=shards,
        alive=alive,
        rank=None if rank is None else (rank[1], rank[2]),
        mask=mask,
    )
    requeued = reply.requeued
    if requeued:
        log.warning("queue %s: shards with a gap handed back: %s", keys.queue, requeued)
    return requeued


_ID_RE = re.compile(rb"(?:^|\n)id=(\d+) ")
_NAME_RE = re.compile(rb" name=(\S*)")


def record_client(client: redis.Redis, keys: QueueKeys, field: str) -> bool:
    """Record the CLIENT ID of ``client``'s connection under ``field`` (a producer id, or
    '<id>:hb' for its heartbeat): closed connections then tell that it died.

    Returns:
        False if the server refuses CLIENT ID (ACL): death is then told by the TTL only.
    """
    try:
        ident = int(client.execute_command("CLIENT", "ID"))  # type: ignore[no-untyped-call]
        call(lambda: client.hset(keys.clients, field, ident), "recording", client)
    except redis.ResponseError as e:
        log.debug("queue %s: CLIENT ID refused (%s): death by TTL only", keys.queue, e)
        return False
    except redis_errors as e:
        raise ConnectionLost(f"Redis connection lost while recording the client id: {e}") from e
    return True


def connected_ids(client: redis.Redis) -> set[int] | None:
    """The ids of every connection the server has open, or None if CLIENT LIST is refused."""
    raw = _client_list(client)
    return None if raw is None else {int(m) for m in _ID_RE.findall(raw)}


def connected_names(client: redis.Redis) -> set[str] | None:
    """The names (CLIENT SETNAME) of the connections the server has open, or None if
    CLIENT LIST is refused."""
    raw = _client_list(client)
    return None if raw is None else {m.decode() for m in _NAME_RE.findall(raw) if m}


def _client_list(client: redis.Redis) -> bytes | None:
    try:
        raw = client.execute_command(  # type: ignore[no-untyped-call]
            "CLIENT", "LIST", NEVER_DECODE=True
        )
    except redis.ResponseError:
        return None
    except redis_errors as e:
        raise ConnectionLost(f"Redis connection lost while listing clients: {e}") from e
    return raw.encode() if isinstance(raw, str) else bytes(raw)


def _all_closed(
    alive: list[str], recorded: dict[bytes, bytes], connected: set[int]
) -> dict[str, str]:
    """Producer -> its recorded ids ('<main>,<heartbeat>') for each of ``alive`` that
    recorded a connection and has none of them among the ``connected`` ids."""
    closed: dict[str, str] = {}
    for p in alive:
        main = recorded.get(p.encode(), b"").decode()
        beat = recorded.get(f"{p}:hb".encode(), b"").decode()
        ids = [int(x) for x in (main, beat) if x.isdigit()]
        if ids and not any(i in connected for i in ids):
            closed[p] = f"{main},{beat}"
    return closed


def reap_gone(client: redis.Redis, keys: QueueKeys, incarnation: str) -> tuple[int, int] | None:
    """Reap producers whose recorded connections are all closed (killed), at once.

    A process killed by SIGKILL or a crash closes its sockets, and Redis knows: its ids
    are no longer in CLIENT LIST. A hung producer (SIGSTOP, a partition) keeps them open;
    the heartbeat TTL covers it (:func:`reap_dead`).

    Returns:
        (producers reaped, shards returned), or None if the server refuses CLIENT LIST.
    """
    now_ms = server_ms(client)
    alive = _members(client, keys, now_ms, "+inf")
    if not alive:
        return 0, 0
    recorded: dict[bytes, bytes] = call(
        lambda: client.hgetall(keys.clients),  # type: ignore[arg-type,return-value]
        "reading client ids",
        client,
    )
    connected = connected_ids(client)
    if connected is None:
        return None
    closed = _all_closed(alive, recorded, connected)
    if not closed:
        return 0, 0
    reply = recovery_scripts.gone(client, keys, incarnation=incarnation, closed=closed)
    if reply.status != Status.OK:
        return 0, 0
    if reply.first:
        log.info(
            "queue %s: reaped %s producer(s) whose connections closed, %s shard(s) back",
            keys.queue,
            reply.first,
            reply.second,
        )
    return reply.first, reply.second
