"""``len(stream)``: batches per epoch, this rank's share, from the run's plan.

Read from the queue's meta, where the producers publish the plan; waits (bounded) for
the first producer to join. A pipeline that filters or regroups examples cannot tell
its batches per epoch in advance, and neither can a rank where shards hold several
batches: :class:`~batchq.errors.LengthUnknown`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from batchq.client.connection import retrying
from batchq.errors import LengthUnknown
from batchq.protocol.keys import QueueKeys
from batchq.protocol.ranks import RankLayout
from consumer.plan import BLOCK_S, wait_for_plan

__all__ = ["epoch_length"]


def epoch_length(
    client: redis.Redis, keys: QueueKeys, *, world: int, even: str, timeout_s: float, epoch: int
) -> int:
    """Batches per epoch of this rank's share (a single trainer: the plan's).

    Args:
        client: the stream's client.
        keys: the queue's keys.
        world, even: the job's ranks and how their counts are evened.
        timeout_s: how long to wait for a producer (and to survive a lost connection).
        epoch: the stream's epoch (named by ProducersLost).

    Raises:
        LengthUnknown: the plan cannot tell.
        ProducersLost: no producer published the plan within timeout_s.
    """

    def retry(fn: Callable[[], Any], what: str) -> Any:
        return retrying(fn, f"{what} (queue {keys.queue})", timeout_s, client=client)

    plan = wait_for_plan(
        lambda: retry(lambda: client.hgetall(keys.meta), "reading the plan"),
        lambda: retry(lambda: client.blpop([keys.wake], timeout=BLOCK_S), "waiting for the plan"),
        timeout_s,
        epoch,
    )
    total = plan.epoch_batches
    if total < 0:
        raise LengthUnknown(
            f"queue {keys.queue}: this pipeline cannot tell its batches per "
            "epoch in advance (it filters or regroups examples)"
        )
    if world == 1:
        return total
    if plan.shards != total:
        raise LengthUnknown(
            f"queue {keys.queue}: with shards of more than one batch a rank's share "
            "is only known at the epoch's end"
        )
    return RankLayout(total, world, even).per_rank
