"""A producer blocked at a full list or at Redis' maxmemory: the clock of its wait
(:class:`Waiting`), and whether a data-parallel producer hands its shard back
(:func:`hand_back_reason`, :func:`hand_back`, once per :data:`HANDBACK_S`).
:mod:`producer.serving.frame_push` waits; this keeps the time and decides.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from batchq.protocol import producer_scripts
from batchq.protocol.calls import execute_pipeline
from batchq.protocol.fields import MetaField
from batchq.protocol.groups import reader_field, slots_of
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import time_ms
from producer.serving.membership import RunPosition

__all__ = ["HANDBACK_S", "Waiting", "give_back", "hand_back", "hand_back_reason"]

log = logging.getLogger(__name__)


# A data-parallel producer blocked this long at a rank's full list looks whether that
# rank's trainer is still alive; if not, the shard goes back to the work list so that
# one stopped rank never holds the producers serving the others.
HANDBACK_S = 1.0


class Waiting:
    """How long one push has been blocked (at the cap, or at Redis' maxmemory): each
    try reports only its own wait, and a data-parallel producer looks whether to hand
    the shard back once per HANDBACK_S at a full list."""

    def __init__(self) -> None:
        self.since: float | None = None  # blocked since (the last try), or None
        self.full_since = 0.0  # when the hand-back was last looked at

    def start(self) -> bool:
        """Blocked now; False if this is the first time (the clocks just started)."""
        if self.since is None:
            self.since = self.full_since = time.monotonic()
            return False
        return True

    def restart(self) -> None:
        """Still blocked, for another reason: count from now."""
        if self.since is not None:
            self.since = time.monotonic()

    def since_last_try_ms(self) -> int:
        """The wait since the last try (0 before the first block), and restart the count."""
        if self.since is None:
            return 0
        now = time.monotonic()
        waited_ms = int((now - self.since) * 1000)
        self.since = now
        return waited_ms

    def hand_back_due(self) -> bool:
        """True once per HANDBACK_S of being blocked at a full list."""
        if time.monotonic() - self.full_since < HANDBACK_S:
            return False
        self.full_since = time.monotonic()
        return True


def hand_back_reason(
    client: redis.Redis, keys: QueueKeys, rank: int, world: int, mask: int = 1
) -> str | None:
    """Why a producer blocked at rank ``rank``'s full list should hand its shard back, or
    None to keep waiting (one pipelined read of the ranks' claims and lists).

    Hand it back if that rank's trainer holds no live claim (it crashed, or closed), or
    if another rank still reading has an empty list: it may be waiting for this
    producer, while this rank waits for the others (its share of an epoch is evened,
    consumer/balance.py), so holding on could stall them all. In a run read by several
    groups, the ranks of every group the shard is for (``mask``) are looked at.
    """
    for slot in slots_of(mask):
        reading, depths = _ranks_reading(client, keys, world, slot)
        if not reading[rank]:
            return "it is not reading"
        if any(depth == 0 and reading[r] for r, depth in enumerate(depths) if r != rank):
            return "another rank's list is empty"
    return None


def _ranks_reading(
    client: redis.Redis, keys: QueueKeys, world: int, slot: int = 0
) -> tuple[list[bool], list[int]]:
    """Which ranks of group slot ``slot`` are reading (a live claim, not done), and each
    rank's list length."""
    fields = [reader_field(MetaField.CLAIM_DEADLINE, slot, r, world) for r in range(world)]
    fields += [reader_field(MetaField.DONE, slot, r, world) for r in range(world)]
    view = keys.slot_view(slot)

    def build(pipe: Any) -> None:
        pipe.hmget(keys.meta, fields)
        pipe.time()
        for r in range(world):
            pipe.llen(view.data_of(r, world))

    meta, now, *depths = execute_pipeline(client, build)
    now_ms = time_ms(now)
    reading = [
        _reads(deadline, done, now_ms)
        for deadline, done in zip(meta[:world], meta[world:], strict=True)
    ]
    return reading, depths


def _reads(claim_deadline: Any, done: Any, now_ms: int) -> bool:
    """A rank reads while its claim is live and it has not finished."""
    return claim_deadline is not None and int(claim_deadline) > now_ms and done is None


def hand_back(
    client: redis.Redis,
    keys: QueueKeys,
    position: RunPosition,
    producer: str,
    aim: tuple[int, int],
    entry: str,
) -> str | None:
    """At a full list of rank ``rank`` (``aim``: the rank, the group slots of the shard as
    a mask) for HANDBACK_S: hand the shard of lease ``entry`` back (handback.lua, to the
    end of the work list) when :func:`hand_back_reason` finds a reason, and say why;
    returns handback.lua's status, or None: keep waiting."""
    rank, mask = aim
    # The world of the shard's groups (a shard is only shared by groups of one world).
    why = hand_back_reason(client, keys, rank, position.world_of(slots_of(mask)[0]), mask)
    if why is None:
        return None
    return give_back(client, keys, position, producer, entry, f"rank {rank}'s list is full, {why}")


def give_back(
    client: redis.Redis, keys: QueueKeys, position: RunPosition, producer: str, entry: str,
    why: str,
) -> str:  # fmt: skip
    """Hand the shard of lease ``entry`` back (handback.lua, to the end of the work list),
    saying ``why``; returns handback.lua's status."""
    reply = producer_scripts.handback(
        client, keys, incarnation=position.incarnation, run=position.run, producer=producer,
        entry=entry,
    )  # fmt: skip
    log.info("producer %s: %s: %s handed back", producer, why, entry)
    return reply.status
