"""What a trainer does to a run as it starts it: where it starts (the plan's first epoch,
or a checkpoint's position recreated), the frames an older run stored by reference
deleted, and the parts that read it assembled (the buffer, the reader thread, the feed of
epochs).

:class:`consumer.ServerDataStream` calls these once, at its first epoch; every Redis call
goes through :func:`batchq.client.connection.retrying`, so a connection dropped meanwhile is
survived within the stream's ``timeout_s``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, NamedTuple

import redis

from batchq.client.connection import retrying
from batchq.errors import ConfigError
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import DONE, ledger_field
from batchq.protocol.ranks import RankLayout
from batchq.protocol.stripes import Stripes
from consumer.balance import even_counts
from consumer.epoch import EpochFeed
from consumer.rank_state import remap_pairs
from consumer.reader.buffer import Buffer
from consumer.reader.ledger import Ledger
from consumer.reader.prepare import FramePrep
from consumer.reader.settings import ReaderSettings
from consumer.reader.shm_frames import TrainerShm
from consumer.reader.thread import BLOCK_S, Reader, global_pairs
from consumer.session import Session
from consumer.state_keys import (
    CONSUMED_KEY,
    DONE_KEY,
    EPOCH_KEY,
    FINGERPRINT_KEY,
    PLAN_SHARDS_KEY,
    REMAP_KEY,
    SHARDS_KEY,
)
from consumer.stats import TrainerStats

if TYPE_CHECKING:  # consumer.striped_start builds on this module
    from consumer.params import StreamParams
    from consumer.striped_start import StripeReaders, StripeSet

__all__ = [
    "DELETE_CHUNK",
    "Reading",
    "Resumed",
    "delete_old_frames",
    "resume_position",
    "start_position",
    "start_reading",
]

# Old frames are deleted this many keys per DEL (one command never holds Redis long).
DELETE_CHUNK = 500


class Resumed(NamedTuple):
    """Where a resumed run stands: this rank's slots, its preloaded ledger, and S of the
    run's plan (the checkpoint's, where no producer has joined this Redis yet); for a
    checkpoint of a striped queue also the first shard and every stripe's ledger pairs
    (in its numbers, local), which its other stripes resume from
    (:mod:`consumer.striped_start`)."""

    layout: RankLayout
    ledger: Ledger
    plan_shards: int
    first: int = 0
    stripe_pairs: dict[int, list[tuple[str, str]]] | None = None


class Reading(NamedTuple):
    """The parts that read a started run: the buffer (the ledger's one owner from here),
    the reader thread (started; a striped queue's: one per stripe), and the feed that
    hands the epochs out."""

    buffer: Buffer
    reader: Reader | StripeReaders
    feed: EpochFeed


def start_reading(
    session: Session,
    start: Resumed,
    settings: ReaderSettings,
    client: redis.Redis,
    *,
    shm: TrainerShm,
    prep: FramePrep,
    stats: TrainerStats,
    seen: Counter[str],
    params: StreamParams | None = None,
    stripes: StripeSet | None = None,
) -> Reading:
    """Assemble what reads a claimed run from ``start`` on, and start the reader thread.

    Args:
        session: the trainer's session, claimed (its client is the stream's).
        start: where the run starts (:func:`start_position`).
        settings: the reader's settings.
        client: the reader's own client (it owns and closes it).
        shm: the trainer's shared memory (its run and array access are set here).
        prep: the stream's frame preparation (the one owner of the array access).
        stats: the trainer's figures.
        seen: batches handed out, by producer (the stream's ``producers_seen``).
        params: the stream's params log (the reader checks frames against it).
        stripes: a striped queue's other stripes, claimed: a reader each, all filing
            into the one buffer (``session`` is stripe 0's; a striped queue has no
            params log to check: ``set_params`` is refused there).
    """
    shm.new_run(session.run)  # other runs' segments: nothing will pop them
    shm.access = prep.access  # the one owner's setting, fixed from here
    buffer = Buffer(start.ledger)
    plan = session.plan
    evener = even_counts(
        start.layout,
        plan is not None and plan.epoch_batches == plan.shards,
        session.client,
        session.keys,
        session.rank,
        settings.timeout_s,
        keep=settings.hwm,
    )
    first = Reader(
        client, session.keys, session, buffer if stripes is None else stripes.view(buffer, 0),
        settings, stats=stats, shm=shm, prepare=prep, params=params,
    )  # fmt: skip
    reader = first if stripes is None else stripes.readers(first, buffer, settings, prep)
    feed = EpochFeed(buffer, reader.is_alive, evener, stats, prep, seen)
    reader.start()
    return Reading(buffer, reader, feed)


def start_position(
    session: Session,
    resume: dict[str, Any] | None,
    *,
    new_run: bool,
    ordered: bool,
    step: int,
    timeout_s: float,
) -> Resumed:
    """Where a claimed run starts: at the plan's first epoch, or at a checkpoint's
    position (:func:`resume_position`); the ledger told the plan's window and batches
    per epoch.

    Args:
        session: the trainer's session, just claimed (its plan is set here).
        resume: the checkpoint (one rank's state), or None.
        new_run: the claim started a new run: frames an older run stored go.
        ordered: the ledger yields in plan order.
        step: batches yielded before the checkpoint.
        timeout_s: the stream's reconnect bound, and how long to wait for a plan.
    """
    if new_run:
        delete_old_frames(session.client, session.keys, timeout_s)
    if resume is None:
        plan = session.wait_for_plan(timeout_s, BLOCK_S)
        layout = session.layout(plan.shards)
        start = Resumed(layout, Ledger(layout.per_rank, ordered=ordered), plan.shards)
    else:
        start = resume_position(session, resume, ordered=ordered, step=step, timeout_s=timeout_s)
    known = session.plan
    if known is not None:
        start.ledger.window = known.window if known.has_window else None
        start.ledger.epoch_batches = known.epoch_batches
    return start


def resume_position(
    session: Session, resume: dict[str, Any], *, ordered: bool, step: int, timeout_s: float
) -> Resumed:
    """Recreate a checkpoint's position: the ledger preloaded with what the state says
    was yielded, the same pairs sent to resume.lua (the producers re-plan the saved epoch
    from them).

    Args:
        session: the trainer's session (its plan is set here; its client is the stream's).
        resume: the checkpoint (one rank's state, see :mod:`consumer.state_keys`).
        ordered: the ledger yields in plan order.
        step: batches yielded before the checkpoint (resume.lua checks it).
        timeout_s: the stream's reconnect bound, and how long to wait for a plan.
    """
    client, keys = session.client, session.keys

    def read_meta() -> dict[bytes, bytes]:
        return client.hgetall(keys.meta)  # type: ignore[return-value]

    # The plan first: a striped queue's stripes are resumed each from its own pairs.
    # (A producer may never have joined this Redis: it restarted.)
    meta = retrying(read_meta, f"reading meta (queue {keys.queue})", timeout_s, client=client)
    plan = session.use_plan(meta) or session.wait_for_plan(timeout_s, BLOCK_S)
    stripes = Stripes(plan.stripes)
    shards, epoch = int(resume[SHARDS_KEY]), int(resume[EPOCH_KEY])
    plan_shards = int(resume.get(PLAN_SHARDS_KEY, shards))
    layout = session.layout(plan_shards)
    ledger = Ledger(shards, ordered=ordered, first_epoch=epoch)
    local = _preload(ledger, resume)
    split = stripes.split(local, shards)
    pairs = global_pairs(split[0], layout, session.rank)
    remap = None
    if REMAP_KEY in resume:  # another number of ranks: the epoch's rest re-split
        if stripes.striped:
            raise ConfigError(
                f"queue {keys.queue}: resuming with another number of ranks is not "
                f"supported for a striped queue ({stripes.count} stripes); expected the "
                "checkpoint's world size"
            )
        pairs, slots = remap_pairs(resume, layout)
        remap = (epoch, slots)
    first = epoch * shards
    session.resume(
        client,
        stripes.floor_of(first, 0),
        resume[FINGERPRINT_KEY],
        pairs,
        step=step,
        shards=plan_shards,
        remap=remap,
    )
    if session.plan is None:
        session.wait_for_plan(timeout_s, BLOCK_S)
    return Resumed(layout, ledger, plan_shards, first, split if stripes.striped else None)


def _preload(ledger: Ledger, resume: dict[str, Any]) -> list[tuple[str, str]]:
    """Mark in the ledger what the checkpoint says was yielded; the same as ledger pairs
    of the rank's own (local) shards, ``'<epoch>:<j>'``."""
    epoch = int(resume[EPOCH_KEY])
    done = set(resume[DONE_KEY])
    pairs = []
    for shard in sorted(done | {int(k) for k in resume[CONSUMED_KEY]}):
        had = int(resume[CONSUMED_KEY].get(str(shard), 0))
        ledger.preload(epoch, shard, had, done=shard in done)
        pairs.append((ledger_field(epoch, shard), DONE if shard in done else str(had)))
    return pairs


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
