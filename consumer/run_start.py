"""What a trainer does to a run as it starts it: a checkpoint's position recreated, and
the frames an older run stored by reference deleted.

:class:`consumer.ServerDataStream` calls these once, at its first epoch; every Redis call
goes through :func:`batchq.client.connection.retrying`, so a connection dropped meanwhile is
survived within the stream's ``timeout_s``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import redis

from batchq.client.connection import retrying
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import DONE, ledger_field
from batchq.protocol.ranks import RankLayout
from consumer.rank_state import remap_pairs
from consumer.reader.ledger import Ledger
from consumer.session import Plan, Session
from consumer.state_keys import (
    CONSUMED_KEY,
    DONE_KEY,
    EPOCH_KEY,
    FINGERPRINT_KEY,
    PLAN_SHARDS_KEY,
    REMAP_KEY,
    SHARDS_KEY,
)

__all__ = ["DELETE_CHUNK", "Resumed", "delete_old_frames", "resume_position"]

# Old frames are deleted this many keys per DEL (one command never holds Redis long).
DELETE_CHUNK = 500


class Resumed(NamedTuple):
    """Where a resumed run stands: this rank's slots, its preloaded ledger, and S of the
    run's plan (the checkpoint's, where no producer has joined this Redis yet)."""

    layout: RankLayout
    ledger: Ledger
    plan_shards: int


def resume_position(
    session: Session,
    client: redis.Redis,
    keys: QueueKeys,
    resume: dict[str, Any],
    *,
    rank: int,
    ordered: bool,
    step: int,
    timeout_s: float,
    block_s: float,
) -> Resumed:
    """Recreate a checkpoint's position: the ledger preloaded with what the state says
    was yielded, the same pairs sent to resume.lua (the producers re-plan the saved epoch
    from them).

    Args:
        session: the trainer's session (its plan is set here).
        client: the stream's client.
        keys: the queue's keys.
        resume: the checkpoint (one rank's state, see :mod:`consumer.state_keys`).
        rank: this process's rank.
        ordered: the ledger yields in plan order.
        step: batches yielded before the checkpoint (resume.lua checks it).
        timeout_s: the stream's reconnect bound, and how long to wait for a plan.
        block_s: one wait's block while waiting for a plan.
    """

    def read_meta() -> dict[bytes, bytes]:
        return client.hgetall(keys.meta)  # type: ignore[return-value]

    # A producer may never have joined this Redis (it restarted): the plan's shape comes
    # from the checkpoint then.
    meta = retrying(read_meta, f"reading meta (queue {keys.queue})", timeout_s, client=client)
    session.plan = Plan(meta) if MetaField.SHARDS.encode() in meta else None
    shards, epoch = int(resume[SHARDS_KEY]), int(resume[EPOCH_KEY])
    plan_shards = int(resume.get(PLAN_SHARDS_KEY, shards))
    layout = session.layout(plan_shards)
    ledger = Ledger(shards, ordered=ordered, first_epoch=epoch)
    done = set(resume[DONE_KEY])
    pairs = []
    for shard in sorted(done | {int(k) for k in resume[CONSUMED_KEY]}):
        had = int(resume[CONSUMED_KEY].get(str(shard), 0))
        ledger.preload(epoch, shard, had, done=shard in done)
        slot = layout.slot(shard, rank)
        pairs.append((ledger_field(epoch, slot), DONE if shard in done else str(had)))
    remap = None
    if REMAP_KEY in resume:  # another number of ranks: the epoch's rest re-split
        pairs, slots = remap_pairs(resume, layout)
        remap = (epoch, slots)
    session.resume(
        client,
        epoch * shards,
        resume[FINGERPRINT_KEY],
        pairs,
        step=step,
        shards=plan_shards,
        remap=remap,
    )
    if session.plan is None:
        session.plan = session.wait_for_plan(timeout_s, block_s)
    return Resumed(layout, ledger, plan_shards)


def delete_old_frames(client: redis.Redis, keys: QueueKeys, timeout_s: float) -> int:
    """Delete the frames stored by reference by an older run (nobody will pop their
    names); returns how many keys were deleted."""
    what = f"queue {keys.queue}"

    def scan() -> list[Any]:
        return list(client.scan_iter(match=keys.frame_pattern, count=1000))

    names = retrying(scan, f"listing old frames ({what})", timeout_s, client=client)
    deleted = 0
    for i in range(0, len(names), DELETE_CHUNK):
        chunk = names[i : i + DELETE_CHUNK]

        def delete(chunk: list[Any] = chunk) -> int:
            return int(client.delete(*chunk))

        deleted += retrying(delete, f"deleting old frames ({what})", timeout_s, client=client)
    return deleted
