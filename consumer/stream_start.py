"""A stream's first epoch: claim the queue, find where the run starts, start reading.

:class:`consumer.ServerDataStream` calls :func:`open_reading` once; what it returns is
everything a started stream holds (:class:`Started`). The claim is the session's from
the moment it is made, so the stream's ``close`` releases it whatever failed after.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import redis

from batchq.errors import ConnectionLost
from batchq.protocol.admin import check_eviction_policy
from batchq.protocol.keys import QueueKeys
from consumer.epoch import EpochFeed
from consumer.group_drain import drain_group
from consumer.group_session import group_resume_run_id
from consumer.rank_state import resume_run_id
from consumer.reader.buffer import Buffer
from consumer.reader.prepare import FramePrep
from consumer.reader.settings import ReaderSettings
from consumer.reader.shm_frames import TrainerShm
from consumer.reader.thread import Reader
from consumer.run_start import delete_old_frames, start_position, start_reading
from consumer.session import Session
from consumer.state_keys import RUN_KEY
from consumer.stats import TrainerStats
from consumer.stream_options import StreamOptions
from consumer.striped_start import StripeReaders, StripeSet, claim_stripes

if TYPE_CHECKING:
    from consumer.params import StreamParams

log = logging.getLogger(__name__)

__all__ = ["Started", "claim", "new_session", "open_reading", "release"]


class Started(NamedTuple):
    """What a stream holds once reading started: its claim (the session), the buffer
    (the ledger's one owner), the reader thread, the feed of epochs, S of the run's
    plan, and a striped queue's other stripes (their claims, each with a reader)."""

    session: Session
    buffer: Buffer
    reader: Reader | StripeReaders
    feed: EpochFeed
    plan_shards: int
    stripes: StripeSet | None = None


def new_session(
    client: redis.Redis,
    keys: QueueKeys,
    options: StreamOptions,
    shm: TrainerShm,
    resume_run: str = "",
    params: StreamParams | None = None,
) -> Session:
    """The trainer's session on ``keys``' queue (not claimed yet), as its group
    (:mod:`consumer.group_session`); it publishes this trainer's host after every claim
    and resume (they drop it), and writes ``params``'s log before every resume."""
    return Session(
        client,
        keys,
        options.claim_ttl_ms,
        retry_s=options.timeout_s,
        group=options.group,
        max_lag_batches=options.max_lag_batches,
        rank=options.rank,
        world=options.world_size,
        even=options.even_batches,
        resume_run=resume_run,
        publish=lambda acting, slot: shm.publish(acting, options.hwm, slot),
        before_resume=params.load if params is not None else None,
    )


def claim(
    client: redis.Redis,
    keys: QueueKeys,
    options: StreamOptions,
    shm: TrainerShm,
    resume: dict[str, Any] | None,
    params: StreamParams | None = None,
) -> tuple[Session, bool]:
    """Claim the queue for this trainer: ``(the session, whether a new run started)``.

    A checkpoint's run is taken over (``resume``, one rank's state); the stream keeps
    the session from here, so its ``close`` releases the claim whatever fails after.
    """
    check_eviction_policy(client)
    run = resume_run_id(resume, options.world_size) if resume else ""
    if resume and options.group is not None:  # the groups of a sweep resume into one run
        run = group_resume_run_id(resume, options.world_size)
    session = new_session(client, keys, options, shm, run, params)
    new_run = session.acquire(
        takeover=resume[RUN_KEY] if resume else "", resuming=resume is not None
    )
    return session, new_run


def open_reading(
    session: Session,
    new_run: bool,
    reader_client: redis.Redis,
    options: StreamOptions,
    *,
    resume: dict[str, Any] | None,
    step: int,
    parts: tuple[TrainerShm, FramePrep, TrainerStats, Counter[str]],
    params: StreamParams | None = None,
    connect: Callable[[QueueKeys], redis.Redis] | None = None,
    make_shm: Callable[[QueueKeys], TrainerShm] | None = None,
) -> Started:
    """Find where the claimed run starts (the plan's first epoch, or ``resume``'s
    position) and start the reader thread.

    Args:
        session: the trainer's session, just claimed (:func:`claim`).
        new_run: the claim started a new run.
        reader_client: the reader thread's own client (it owns and closes it).
        options: the stream's settings.
        resume: the checkpoint (one rank's state) to resume, or None.
        step: batches yielded before the checkpoint.
        parts: the stream's shared memory, frame preparation, figures and batches seen
            by producer.
        params: the stream's params log (bound to the session and the rank's split
            here; the reader checks each frame's params version against it).
        connect: a new client for a queue's keys (a striped queue's other stripes).
        make_shm: the trainer's shared memory for a queue's keys (likewise).
    """
    shm, prep, stats, seen = parts
    start = start_position(
        session,
        resume,
        new_run=new_run,
        ordered=options.ordered,
        step=step,
        timeout_s=options.timeout_s,
    )
    settings = ReaderSettings(
        hwm=options.hwm,
        timeout_s=options.timeout_s,
        writable=prep.writable,
        max_frame_bytes=options.max_frame_bytes,
        on_bad_frame=options.on_bad_frame,
        stall_s=options.stall_s,
        layout=start.layout,
    )
    stripes = None
    if connect is not None and make_shm is not None:
        stripes = claim_stripes(
            session, start, new_run=new_run, connect=connect, make_shm=make_shm, step=step,
            make_session=lambda c, k, s, run: new_session(c, k, options, s, run),
            timeout_s=options.timeout_s,
        )  # fmt: skip
        if stripes is not None and start.ledger.window is not None:
            # Each stripe mints W of its own shards past its floor.
            start.ledger.window *= stripes.stripes.count
    if params is not None:
        params.bind(session, start.layout)
        params.refresh(session.client)  # another rank's changes, if any
    reading = start_reading(
        session, start, settings, reader_client, shm=shm, prep=prep, stats=stats, seen=seen,
        params=params, stripes=stripes,
    )  # fmt: skip
    return Started(session, *reading, start.plan_shards, stripes)


def release(
    session: Session | None,
    client: redis.Redis,
    shm: TrainerShm,
    finished: bool,
    timeout_s: float,
    stripes: StripeSet | None = None,
) -> None:
    """Give the claim up (``finished``: the run ends at its last rank of its last group,
    and its frames and segments go; a group that finished before the others lets go of
    what its list still holds) and close the stream's client; a striped queue's other
    stripes first.

    Raises:
        ConnectionLost: Redis is unreachable and ``finished`` (the end of the run
            cannot be announced); otherwise the claim lapses by itself, logged.
    """
    for stripe in stripes.members if stripes is not None else ():
        release(stripe.session, stripe.client, stripe.shm, finished, timeout_s)
    try:
        ended = session is not None and session.release(finished)
        if ended and session is not None:
            delete_old_frames(client, session.keys, timeout_s)
            shm.finish()
        elif finished and session is not None and session.grouped:
            drain_group(client, session.keys, session.data_key, shm, timeout_s)
    except ConnectionLost as e:
        log.warning("queue %s: could not release the claim: %s", session and session.keys.queue, e)
        if finished:
            raise
    finally:
        client.close()
