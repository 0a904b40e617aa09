"""A stream's start: its claim, where its run starts, and the readers that read it.

:class:`consumer.ServerDataStream` calls :func:`claim`, then :func:`open_reading` once, at
its first epoch, and :func:`release` at its close. The claim is the stream's from the
moment it is made, so its ``close`` releases it whatever failed after. Every Redis call
goes through :func:`batchq.client.connection.retrying`, so a connection dropped meanwhile
is survived within the stream's ``timeout_s``.

A plain queue is a stripe set of one. A queue of N stripes (:mod:`batchq.protocol.stripes`)
is N queues: the stream claims stripe 0 (the queue itself) as any queue; once its plan
says how many stripes the run has, the others are claimed. Stripe 0's claim is the
authority (it fences other trainers): the other stripes are taken over whatever claim
they hold, and they follow stripe 0's start:

- stripe 0 adopted a run the producers had started: each stripe's run is adopted too
  (the producers started them together, from the plan's first shard);
- stripe 0 started a new run, a checkpoint is resumed, or a stripe's run is of another
  world size: each stripe starts again with resume.lua (a new run id, its share of the
  checkpoint's ledger pairs and its floor of the checkpoint's first shard, or nothing),
  the old data going with it. A group's resume keeps the run its claim landed in (others
  may have claimed it since), unless stripe 0's run was replaced.

Each stripe has its own session (claim, run id, incarnation), client, shared-memory host
and reader thread; the readers file into the one buffer (a striped queue's through a
:class:`consumer.reader.buffer.StripeView` each). Only stripe 0's reader sends the
trainer's figures; every stripe's checks frames against the params log (each stripe has
its own, a copy of stripe 0's: :mod:`consumer.params`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import redis

from batchq.client.connection import retrying
from batchq.errors import ConfigError, ConnectionLost, StateLost, TrainerConflict
from batchq.protocol.admin import check_eviction_policy
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import stripe_run_id
from batchq.protocol.ranks import RankLayout
from batchq.protocol.stripes import Stripes
from batchq.protocol.words import as_text
from consumer.balance import Balancer, StaticPads, even_counts
from consumer.checkpoint import (
    EPOCH_KEY,
    REMAP_KEY,
    RUN_KEY,
    Resumed,
    resume_position,
    resume_run_id,
)
from consumer.params import StreamParams
from consumer.plan import BLOCK_S, Plan
from consumer.reader.buffer import Buffer, StripeView
from consumer.reader.fetch import drain_group
from consumer.reader.ledger import Ledger, global_pairs
from consumer.reader.prepare import FramePrep
from consumer.reader.shm_frames import TrainerShm
from consumer.reader.stats import TrainerStats
from consumer.reader.thread import Reader, Readers
from consumer.session import Session
from consumer.stream_options import ReaderSettings, StreamOptions

log = logging.getLogger(__name__)

__all__ = [
    "DELETE_CHUNK",
    "Started",
    "Stripe",
    "claim",
    "claim_to_finish",
    "delete_old_frames",
    "new_session",
    "open_reading",
    "release",
]

# Old frames are deleted this many keys per DEL (one command never holds Redis long).
DELETE_CHUNK = 500


class Stripe(NamedTuple):
    """One stripe of a stream (stripe 0: the queue itself): its keys, session, shared
    memory and the client of its claims (the stream's side)."""

    keys: QueueKeys
    session: Session
    shm: TrainerShm
    client: redis.Redis


class Started(NamedTuple):
    """What a stream holds once reading started: its stripes (stripe 0's first; one for a
    plain queue), the buffer (the ledger's one owner), the readers (one per stripe,
    started), how this rank's counts come out equal (the stream's epochs use it:
    :class:`consumer.epoch.EpochFeed`), and S of the run's plan."""

    stripes: list[Stripe]
    buffer: Buffer
    readers: Readers
    evener: Balancer | StaticPads | None
    plan_shards: int


def new_session(
    client: redis.Redis,
    keys: QueueKeys,
    options: StreamOptions,
    shm: TrainerShm,
    resume_run: str = "",
    params: StreamParams | None = None,
) -> Session:
    """The trainer's session on ``keys``' queue (not claimed yet), as its group
    (:mod:`consumer.session`); it publishes this trainer's host after every claim
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
        drain=lambda view, data_key: drain_group(
            client, view, data_key, shm.release_unread, options.timeout_s
        ),
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
    run = resume_run_id(resume, options.world_size, options.group) if resume else ""
    session = new_session(client, keys, options, shm, run, params)
    # A single trainer resuming may take the checkpoint's run over as it is, where a
    # trainer of this host detached at that state (design.md "Resume").
    session.can_keep, session.shm_identity = bool(resume) and not run, shm.identity
    new_run = session.acquire(
        takeover=resume[RUN_KEY] if resume else "", resuming=resume is not None
    )
    return session, new_run


def open_reading(
    session: Session,
    new_run: bool,
    *,
    options: StreamOptions,
    resume: dict[str, Any] | None,
    step: int,
    shm: TrainerShm,
    prep: FramePrep,
    stats: TrainerStats,
    params: StreamParams,
    connect: Callable[[QueueKeys], redis.Redis],
) -> Started:
    """Find where the claimed run starts (the plan's first epoch, or ``resume``'s
    position), claim a striped queue's other stripes, and start a reader per stripe.

    Args:
        session: the trainer's session, just claimed (:func:`claim`).
        new_run: the claim started a new run.
        options: the stream's settings.
        resume: the checkpoint (one rank's state) to resume, or None.
        step: batches yielded before the checkpoint.
        shm: the trainer's shared memory (its run and array access are set here; a
            striped queue's other stripes get a sibling each).
        prep: the stream's frame preparation (the one owner of the array access).
        stats: the trainer's figures (stripe 0's reader sends them).
        params: the stream's params log (bound to the session and the rank's split
            here; stripe 0's reader checks each frame's params version against it).
        connect: a new client for a queue's keys (each reader's, each stripe's).
    """
    timeout_s = options.timeout_s
    start = start_position(
        session, resume, new_run=new_run, ordered=options.ordered, step=step, timeout_s=timeout_s
    )
    stripes = [Stripe(session.keys, session, shm, session.client)]
    striped = _striped_plan(session)
    count = striped.stripes if striped is not None else 1
    for k in range(1, count):
        keys = session.keys.stripe(k, count)
        client, sibling = connect(keys), shm.sibling(keys)
        # The ranks of a job name a stripe's new run alike: after stripe 0's run.
        member = new_session(
            client, keys, options, sibling, stripe_run_id(session.run, k), params
        )  # its resumes write the params log too
        stripes.append(Stripe(keys, member, sibling, client))
        _start_stripe(session, member, striped, start, k, new_run, step, timeout_s)
    if count > 1 and start.ledger.window is not None:
        start.ledger.window *= count  # each stripe mints W of its own shards past its floor
    params.bind(session, start.layout, [stripe.session for stripe in stripes[1:]])
    params.refresh(session.client)  # another rank's changes, if any
    settings = ReaderSettings(options, writable=prep.writable, layout=start.layout)
    buffer = Buffer(start.ledger)
    members = []
    for k, stripe in enumerate(stripes):
        view = buffer if count == 1 else StripeView(buffer, k, Stripes(count))
        reader = Reader(
            connect(stripe.keys), stripe.session.keys, stripe.session, view, settings,
            stats=stats if k == 0 else TrainerStats(), shm=_for_run(stripe, prep),
            prepare=prep, screen=params,
        )  # fmt: skip
        members.append(reader)
    readers = Readers(members)
    evener = _evener(session, start.layout, options, resume)
    readers.start()
    return Started(stripes, buffer, readers, evener, start.plan_shards)


def _evener(
    session: Session, layout: RankLayout, options: StreamOptions, resume: dict[str, Any] | None
) -> Balancer | StaticPads | None:
    """How this rank's counts come out equal (:func:`consumer.balance.even_counts`):
    from the plan's figures where they count every shard's batches (not where shards
    may be skipped on a producer's error), a re-split epoch's from its remap."""
    plan = session.plan
    counted = plan is not None and options.on_producer_error != "skip"
    remap = (int(resume[EPOCH_KEY]), resume[REMAP_KEY]) if resume and REMAP_KEY in resume else None
    return even_counts(
        layout, plan is not None and plan.epoch_batches == plan.shards, session.client,
        session.keys, session.rank, options.timeout_s, keep=options.hwm,
        figures=(plan.shard_batches, plan.epoch_batches) if counted and plan else None,
        remap=remap, ordered=options.ordered,
    )  # fmt: skip


def claim_to_finish(
    client: redis.Redis, keys: QueueKeys, options: StreamOptions, shm: TrainerShm, takeover: str
) -> Session | None:
    """Claim the queue to finish a run this stream never read (``takeover``: a
    checkpoint's run); None where another trainer keeps it. A claim that lapses within
    claim_ttl_s (a trainer that just died) is waited out; a live one (a stream this job
    made beside the one it trains from) is left to its trainer, whose run it is to
    finish."""
    session = new_session(client, keys, options, shm)
    try:
        _acquire_waiting(session, takeover)
    except TrainerConflict:
        log.warning(
            "close(finished=True) of a stream that never read: queue %s is held by a live "
            "trainer, whose run is left to it",
            keys.queue,
        )
        return None
    return session


def _striped_plan(session: Session) -> Plan | None:
    """The claimed run's plan where it deals its shards to several stripes; None for a
    plain queue (a stripe set of one)."""
    plan = session.plan
    return None if plan is None or plan.stripes <= 1 else plan


def _for_run(stripe: Stripe, prep: FramePrep) -> TrainerShm:
    """The stripe's shared memory, set for its run: other runs' segments go (nothing will
    pop them), and the array access is the one owner's, fixed from here."""
    stripe.shm.new_run(stripe.session.run)
    stripe.shm.access = prep.access
    return stripe.shm


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
    position (:func:`consumer.checkpoint.resume_position`); the ledger told the plan's
    window and batches per epoch.

    Args:
        session: the trainer's session, just claimed (its plan is set here).
        resume: the checkpoint (one rank's state), or None.
        new_run: the claim started a new run: frames an older run stored go (as they
            do where a resume replaced the run claimed).
        ordered: the ledger yields in plan order.
        step: batches yielded before the checkpoint.
        timeout_s: the stream's reconnect bound, and how long to wait for a plan.
    """
    claimed = session.run
    if new_run and resume is None:
        # Before the wait: at maxmemory, the older run's frames are the room the
        # producers' join needs.
        delete_old_frames(session.client, session.keys, claimed, timeout_s)
    if resume is None:
        plan = session.wait_for_plan(timeout_s, BLOCK_S)
        layout = session.layout(plan.shards)
        start = Resumed(layout, Ledger(layout.per_rank, ordered=ordered), plan.shards)
    else:
        start = resume_position(session, resume, ordered=ordered, step=step, timeout_s=timeout_s)
    if (new_run and resume is not None) or session.run != claimed:  # the run read now
        delete_old_frames(session.client, session.keys, session.run, timeout_s)
    known = session.plan
    if known is not None:
        start.ledger.window = known.window if known.has_window else None
        start.ledger.epoch_batches = known.epoch_batches
    return start


def _start_stripe(
    first: Session,
    session: Session,
    plan: Plan | None,
    start: Resumed,
    k: int,
    new_run: bool,
    step: int,
    timeout_s: float,
) -> None:
    """Take stripe ``k`` of ``plan``'s stripes over and start it as stripe 0 started (the
    module's docstring)."""
    if plan is None:  # a plain queue has no stripe k > 0
        raise ConfigError(f"{first.what}: stripe {k} of a queue that is not striped")
    client, keys = session.client, session.keys

    def current() -> list[bytes | None]:
        return client.hmget(keys.meta, [MetaField.RUN, MetaField.WORLD])  # type: ignore[return-value]

    run, world = retrying(current, f"reading queue {keys.queue}", timeout_s, client=client)
    again = new_run or start.stripe_pairs is not None or int(world or 1) != first.world
    # A group that comes back without a checkpoint starts again at 0 in every stripe, as
    # claim.lua starts it in stripe 0: its old claim is not taken over but waited out.
    takeover = "" if first.grouped and not again else (run or b"").decode()
    # A claim taken over (a run this job's stripe 0 started) is not waited for.
    _acquire_waiting(session, takeover, resuming=again or run is None, wait=not takeover)
    if first.grouped and first.checkpoint_run and first.run != first.checkpoint_run:
        # Stripe 0's run was replaced: so is this stripe's, by every rank alike (into the
        # id they derive), even a run this claim started (a rank that kept its own would
        # lose it to the next rank's resume).
        session.checkpoint_run = ""
    else:
        # The run claimed lives on through the resume, even one this claim or another
        # rank's started since the run was read: another group may have joined it (its
        # claim would go with a replaced run).
        session.checkpoint_run = session.run
    session.plan = plan  # the run's plan is stripe 0's: one pipeline serves every stripe
    # A rank whose slot claim.lua took over for a resume (a group back with another
    # number of ranks, in a run the job's ranks name alike) is done until it resumes.
    if not (again or run is None or session.awaits_resume(client)):
        return
    claimed = session.run
    _resume_stripe(first, session, plan, start, k, step)
    # A group resumed in a live run deletes nothing: the run and its frames live on.
    if new_run or not first.grouped or session.run != claimed:
        delete_old_frames(client, keys, session.run, timeout_s)


def _acquire_waiting(
    session: Session, takeover: str, *, resuming: bool = False, wait: bool = True
) -> None:
    """Claim, waiting out (with ``wait``) a claim that lapses within claim_ttl_s: a
    trainer that just died without closing its connections, or a group's earlier trainer.

    Raises:
        TrainerConflict: the claim is still held (at once without ``wait``).
    """
    deadline = time.monotonic() + session.claim_ttl_ms / 1000 + 1.0
    while True:
        try:
            session.acquire(takeover=takeover, resuming=resuming)
            return
        except TrainerConflict:
            if not wait or time.monotonic() >= deadline:
                raise
            time.sleep(0.2)  # the claim lapses claim_ttl_s after its last heartbeat


def _resume_stripe(
    first: Session, session: Session, plan: Plan, start: Resumed, k: int, step: int
) -> None:
    """Start stripe k > 0's run at the start's position: its share of a checkpoint (and
    of an elastic re-split), or at 0."""
    remap = None
    if start.stripe_pairs is not None:  # a checkpoint: the stripe's share of it
        pairs = global_pairs(start.stripe_pairs[k], start.layout, first.rank)
        origin = Stripes(plan.stripes).floor_of(start.first, k)
        if start.stripe_remaps is not None:  # re-split for another number of ranks
            pairs, remap = start.stripe_remaps[k]
    else:
        pairs, origin = [], 0
    session.resume(
        session.client, origin, plan.fingerprint, pairs, step=step, shards=plan.shards,
        remap=remap,
    )  # fmt: skip


def release(
    session: Session | None,
    client: redis.Redis,
    shm: TrainerShm,
    finished: bool,
    timeout_s: float,
    others: list[Stripe] | None = None,
) -> None:
    """Give the claim up (``finished``: the run ends at its last rank of its last group,
    and its frames and segments go; a group that finished before the others lets go of
    what its list still holds) and close the stream's client; a striped queue's other
    stripes (``others``) first.

    Raises:
        ConnectionLost: Redis is unreachable and ``finished`` (the end of the run
            cannot be announced); otherwise the claim lapses by itself, logged.
        StateLost: ``finished``, and Redis lost a stripe's queue since the claim (every
            stripe is released first): the caller finishes the run again
            (:func:`claim_to_finish`).
    """
    lost: StateLost | None = None
    for stripe in others or ():
        try:
            release(stripe.session, stripe.client, stripe.shm, finished, timeout_s)
        except StateLost as e:
            lost = e
    try:
        ended = session is not None and session.release(finished)
        if ended and session is not None:
            delete_old_frames(client, session.keys, session.run, timeout_s, ended=True)
            shm.finish(session.run)
        elif finished and session is not None and session.grouped:
            drain_group(client, session.keys, session.data_key, shm.release_unread, timeout_s)
    except StateLost as e:
        lost = e
    except ConnectionLost as e:
        log.warning("queue %s: could not release the claim: %s", session and session.keys.queue, e)
        if finished:
            raise
    finally:
        client.close()
    if lost is not None:
        raise lost


def delete_old_frames(
    client: redis.Redis, keys: QueueKeys, run: str, timeout_s: float, *, ended: bool = False
) -> int:
    """Delete the frames stored by reference whose names nobody will pop: those of every
    run but ``run`` (the run this trainer reads: the others' lists went when it started
    or resumed it), or with ``ended`` those of ``run`` (it finished). Returns how many
    keys were deleted.

    The run is in a frame's name (:meth:`QueueKeys.frame`): producers push frames of
    ``run`` while this runs (another group's, another rank's claim let them), and those
    must stay (a SCAN of the whole queue once deleted them: missing_ref).
    """
    what = f"queue {keys.queue}"
    ours = keys.run_frames(run)

    def scan() -> list[Any]:
        return list(client.scan_iter(match=keys.frame_pattern, count=1000))

    found = retrying(scan, f"listing old frames ({what})", timeout_s, client=client)
    names = [name for name in found if as_text(name).startswith(ours) == ended]
    deleted = 0
    for i in range(0, len(names), DELETE_CHUNK):
        chunk = names[i : i + DELETE_CHUNK]

        def delete(chunk: list[Any] = chunk) -> int:
            return int(client.delete(*chunk))

        deleted += retrying(delete, f"deleting old frames ({what})", timeout_s, client=client)
    return deleted
