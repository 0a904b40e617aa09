"""A producer blocked at a full list or at Redis' maxmemory: the clock of its wait, and
whether a data-parallel producer should hand its shard back (:mod:`producer.serving.pushing`
waits; this decides).
"""

from __future__ import annotations

import time
from typing import Any

import redis

from batchq.protocol.calls import execute_pipeline
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import time_ms
from batchq.protocol.ranks import rank_field

__all__ = ["HANDBACK_S", "Waiting", "hand_back_reason"]

# A data-parallel producer blocked this long at a rank's full list looks whether that
# rank's trainer is still alive; if not, the shard goes back to the work list so that
# one stopped rank never holds the producers serving the others.
HANDBACK_S = 1.0


class Waiting:
    """How long one push has been blocked (at the hwm, or at Redis' maxmemory): each
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


def hand_back_reason(client: redis.Redis, keys: QueueKeys, rank: int, world: int) -> str | None:
    """Why a producer blocked at rank ``rank``'s full list should hand its shard back, or
    None to keep waiting (one pipelined read of the ranks' claims and lists).

    Hand it back if that rank's trainer holds no live claim (it crashed, or closed), or
    if another rank still reading has an empty list: it may be waiting for this
    producer, while this rank waits for the others (its share of an epoch is evened,
    consumer/balance.py), so holding on could stall them all.
    """
    fields = [rank_field(MetaField.CLAIM_DEADLINE, r, world) for r in range(world)]
    fields += [rank_field(MetaField.DONE, r, world) for r in range(world)]

    def build(pipe: Any) -> None:
        pipe.hmget(keys.meta, fields)
        pipe.time()
        for r in range(world):
            pipe.llen(keys.data_of(r, world))

    meta, now, *depths = execute_pipeline(client, build)
    now_ms = time_ms(now)
    reading = [d is not None and int(d) > now_ms and meta[world + r] is None
               for r, d in enumerate(meta[:world])]  # fmt: skip
    if not reading[rank]:
        return "it is not reading"
    if any(depth == 0 and reading[r] for r, depth in enumerate(depths) if r != rank):
        return "another rank's list is empty"
    return None
