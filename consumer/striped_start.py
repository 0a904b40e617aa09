"""A striped queue's start: every stripe claimed and started like the queue itself, and a
reader per stripe, all filing into the stream's one buffer.

A queue of N stripes (:mod:`batchq.protocol.stripes`) is N queues. The stream claims
stripe 0 (the queue itself) as any queue; once its plan says how many stripes the run
has, :func:`claim_stripes` claims the others. Stripe 0's claim is the authority (it
fences other trainers): the other stripes are taken over whatever claim they hold, and
they follow stripe 0's start:

- stripe 0 adopted a run the producers had started: each stripe's run is adopted too
  (the producers started them together, from the plan's first shard);
- stripe 0 started a new run, a checkpoint is resumed, or a stripe's run is of another
  world size: each stripe starts again with resume.lua (a new run id, its share of the
  checkpoint's ledger pairs and its floor of the checkpoint's first shard, or nothing),
  the old data going with it.

Each stripe then has its own session (claim, run id, incarnation), client, shared-memory
host and reader thread (:class:`StripeReaders`); the readers file into the one buffer
through a :class:`consumer.reader.stripe_view.StripeView` each. Only stripe 0's reader
sends the trainer's figures.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import NamedTuple

import redis

from batchq.client.connection import retrying
from batchq.errors import ConfigError
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.stripes import Stripes
from consumer.reader.buffer import Buffer
from consumer.reader.prepare import FramePrep
from consumer.reader.settings import ReaderSettings
from consumer.reader.shm_frames import TrainerShm
from consumer.reader.stripe_view import StripeView
from consumer.reader.thread import Reader, global_pairs
from consumer.run_start import Resumed, delete_old_frames
from consumer.session import Plan, Session
from consumer.stats import TrainerStats

__all__ = ["Stripe", "StripeReaders", "StripeSet", "claim_stripes"]

#: Makes the session of a stripe: (its client, keys, shared memory, the run id its ranks
#: resume into) -> a Session (``consumer.stream_start.new_session``).
MakeSession = Callable[[redis.Redis, QueueKeys, TrainerShm, str], Session]


class Stripe(NamedTuple):
    """One of a striped stream's stripes past stripe 0: its keys, session, shared memory
    and the client of its claims (the stream's side)."""

    keys: QueueKeys
    session: Session
    shm: TrainerShm
    client: redis.Redis


class StripeReaders:
    """The reader threads of a striped stream (stripe 0's first), seen as one."""

    def __init__(self, members: list[Reader]) -> None:
        self.members = members

    def start(self) -> None:
        for reader in self.members:
            reader.start()

    def stop(self, flush: bool = False) -> None:
        """Stop every reader (each sends its last accounting with ``flush``)."""
        for reader in self.members:
            reader.stop(flush=flush)

    def is_alive(self) -> bool:
        """Whether every reader still runs (one that stopped handed its error over)."""
        return all(reader.is_alive() for reader in self.members)

    @property
    def bad_frames(self) -> int:
        """Bad elements moved to the dead lists, all stripes."""
        return sum(reader.bad_frames for reader in self.members)


class StripeSet:
    """The stripes of a striped stream past stripe 0, claimed (:func:`claim_stripes`).

    Args:
        stripes: how the run's shards are dealt.
        members: stripes 1..N-1.
        connect: a new client for a stripe's keys (each reader has its own).
    """

    def __init__(
        self,
        stripes: Stripes,
        members: list[Stripe],
        connect: Callable[[QueueKeys], redis.Redis],
    ) -> None:
        self.stripes = stripes
        self.members = members
        self._connect = connect

    def view(self, buffer: Buffer, stripe: int) -> StripeView:
        """Stripe ``stripe``'s view of the stream's buffer."""
        return StripeView(buffer, stripe, self.stripes)

    def readers(
        self, first: Reader, buffer: Buffer, settings: ReaderSettings, prep: FramePrep
    ) -> StripeReaders:
        """A reader for each stripe past 0 beside ``first`` (stripe 0's), not started."""
        readers = [first]
        for k, member in enumerate(self.members, start=1):
            member.shm.new_run(member.session.run)  # other runs' segments: nobody pops them
            member.shm.access = prep.access
            readers.append(
                Reader(
                    self._connect(member.keys), member.keys, member.session,
                    self.view(buffer, k), settings, stats=TrainerStats(), shm=member.shm,
                    prepare=prep,
                )
            )  # fmt: skip
        return StripeReaders(readers)


def claim_stripes(
    first: Session,
    start: Resumed,
    *,
    new_run: bool,
    connect: Callable[[QueueKeys], redis.Redis],
    make_session: MakeSession,
    make_shm: Callable[[QueueKeys], TrainerShm],
    step: int,
    timeout_s: float,
) -> StripeSet | None:
    """Claim the other stripes of ``first``'s queue (claimed, its plan known) and start
    them as its start says (see the module's docstring); None for a queue of one
    stripe.

    Args:
        first: stripe 0's session.
        start: where stripe 0's run starts (a checkpoint's pairs for every stripe).
        new_run: stripe 0's claim started a new run.
        connect: a new client for a stripe's keys.
        make_session: the session of a stripe.
        make_shm: the trainer's shared memory for a stripe's keys.
        step: the batches yielded at the checkpoint (ranks agree on it).
        timeout_s: the stream's reconnect bound.
    """
    plan = first.plan
    if plan is None or plan.stripes <= 1:
        return None
    if getattr(first, "grouped", False):
        raise ConfigError(
            f"{first.what}: groups (a run read by several groups) on a queue striped "
            f"{plan.stripes} ways are not supported; expected one trainer (or one job's "
            "ranks) per striped queue"
        )
    stripes = Stripes(plan.stripes)
    members = []
    for k in range(1, stripes.count):
        keys = first.keys.stripe(k, stripes.count)
        client = connect(keys)
        shm = make_shm(keys)
        # The ranks of a job name a stripe's new run alike: after stripe 0's run.
        run = hashlib.sha1(f"{first.run}:stripe:{k}".encode()).hexdigest()[:16]
        session = make_session(client, keys, shm, run)
        members.append(Stripe(keys, session, shm, client))
        _start_stripe(first, session, plan, start, k, stripes, new_run, step, timeout_s)
    return StripeSet(stripes, members, connect)


def _start_stripe(
    first: Session,
    session: Session,
    plan: Plan,
    start: Resumed,
    k: int,
    stripes: Stripes,
    new_run: bool,
    step: int,
    timeout_s: float,
) -> None:
    """Take stripe ``k`` over and start it as stripe 0 started."""
    client, keys = session.client, session.keys

    def current() -> list[bytes | None]:
        return client.hmget(keys.meta, [MetaField.RUN, MetaField.WORLD])  # type: ignore[return-value]

    run, world = retrying(current, f"reading queue {keys.queue}", timeout_s, client=client)
    again = new_run or start.stripe_pairs is not None or int(world or 1) != first.world
    session.acquire(takeover=(run or b"").decode(), resuming=again or run is None)
    session.plan = plan  # the run's plan is stripe 0's: one pipeline serves every stripe
    if not (again or run is None):
        return
    delete_old_frames(client, keys, timeout_s)
    if start.stripe_pairs is not None:  # a checkpoint: the stripe's share of it
        pairs = global_pairs(start.stripe_pairs[k], start.layout, first.rank)
        origin = stripes.floor_of(start.first, k)
    else:
        pairs, origin = [], 0
    session.resume(client, origin, plan.fingerprint, pairs, step=step, shards=plan.shards)
