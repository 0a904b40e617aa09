"""A run's plan: what the producers published of it (:class:`Plan`), the one wait for it
(:func:`wait_for_plan`), ``len(stream)`` read from it (:func:`epoch_length`: this rank's
share; a pipeline that filters or regroups examples, or a rank where shards hold several
batches, cannot tell: :class:`~batchq.errors.LengthUnknown`), and what a trainer's resume
sends of it (:class:`Shape`, within the :class:`Restart` it was asked for); and the run as
the trainer's reader sees it.

The reader (:mod:`consumer.reader`) is a lower layer than the stream: it knows the run
through :class:`RunView` (its claim's keys, rank, plan and refresh: the trainer's session
is one) and the buffer it files into through :class:`ReaderBuffer` (the buffer's reader
side: :class:`consumer.reader.buffer.Buffer` and a stripe's view of it are ones), never
their modules. ``BLOCK_S`` bounds each of the trainer's waits.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

import redis

from batchq.client.connection import call, is_wrong_type, retrying, wrong_type_error
from batchq.errors import BatchQueueError, LengthUnknown, ProducersLost
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import DONE, parse_ledger_field
from batchq.protocol.ranks import RankLayout
from batchq.wire.codec import Frame

__all__ = [
    "BLOCK_S",
    "PLAN_WAIT_SAID_S",
    "Plan",
    "ReaderBuffer",
    "Restart",
    "RunView",
    "Shape",
    "epoch_length",
    "past_remap",
    "resumed_shape",
    "wait_for_plan",
]

# When the list is empty the reader blocks on BRPOP this long at most, so that the claim
# is refreshed and a lost producer is noticed; well below the socket timeout. Every wait
# of the trainer's (for a frame, for the plan) wakes this often.
BLOCK_S = 0.2

log = logging.getLogger(__name__)


class Plan:
    """What the producers published about the run: enough to re-create it."""

    def __init__(self, meta: dict[bytes, bytes]) -> None:
        def get(name: str, default: str = "") -> str:
            return meta.get(name.encode(), default.encode()).decode()

        f = MetaField
        self.fingerprint = get(f.FINGERPRINT)
        # The run's cap on each data list (meta `hwm`, Fuel's name), an integer: 0 where
        # no producer published the plan (a resume's placeholder).
        hwm = get(f.HWM)
        self.list_cap = int(hwm) if hwm.isdigit() else 0
        self.shards = int(get(f.SHARDS, "0"))
        self.window = int(get(f.WINDOW, "1"))
        self.has_window = f.WINDOW.encode() in meta  # published by the run's first producer
        self.epoch_batches = int(get(f.EPOCH_BATCHES, "-1"))
        self.world = int(get(f.WORLD, "1"))
        self.even = get(f.EVEN, "pad")
        # B, batches per full shard (0: the plan cannot count them; -1: not published).
        stride = get(f.SHARD_BATCHES, "-1")
        self.shard_batches = int(stride) if stride.lstrip("-").isdigit() else -1
        self.stripes = int(get(f.STRIPES, "1"))  # batchq/protocol/stripes.py


#: How long the plan is waited for before the wait says so (once, a warning).
PLAN_WAIT_SAID_S = 10.0


def wait_for_plan(
    read: Callable[[], dict[bytes, bytes]],
    idle: Callable[[], None],
    timeout_s: float,
    epoch: int = 0,
    queue: str = "",
) -> Plan:
    """The run's plan, once a producer has published it: ``read()`` the queue's meta
    until it holds the plan, ``idle()`` between reads (a bounded wait on the wake list,
    which the join that publishes the plan pushes a token to for each rank holding a
    claim and each ``len()`` caller in the waiters' set: either wait ends with that
    join).

    The one wait for the plan: the session's (claimed: its ``read`` checks the run and
    its ``idle`` keeps the claim) and ``len()``'s (before any claim).

    Raises:
        ProducersLost: no producer published the plan within ``timeout_s`` (naming
            ``epoch`` and ``queue``).
    """
    started = time.monotonic()
    deadline, said = started + timeout_s, False
    while True:
        meta = read()
        if MetaField.SHARDS.encode() in meta:
            return Plan(meta)
        now = time.monotonic()
        if now > deadline:
            raise ProducersLost(max(epoch, 0), [], timeout_s, queue=queue, no_plan=True)
        if not said and now - started >= PLAN_WAIT_SAID_S:
            said = True  # a trainer started first is usual; one this long, worth a word
            log.warning(
                "queue %r: no producer has joined for %.0f s; waiting up to %g s in all",
                queue,
                now - started,
                timeout_s,
            )
        idle()


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

    # Unclaimed, this wait is counted in the waiters' set, for which the join that
    # publishes the plan pushes a wake token (join.lua). The first idle() only joins the
    # set: the read after it finds a plan published between the first read and the SADD.
    waiter = uuid.uuid4().hex
    asked = joined = False

    def idle() -> None:
        nonlocal asked, joined
        if not asked:
            asked = True
            joined = _join_waiters(client, keys, waiter, retry)
            if joined:
                return
        retry(lambda: client.blpop([keys.wake], timeout=BLOCK_S), "waiting for the plan")

    try:
        plan = wait_for_plan(
            lambda: retry(lambda: client.hgetall(keys.meta), "reading the plan"),
            idle,
            timeout_s,
            epoch,
            keys.queue,
        )
    finally:
        if joined:  # gone already where a join published the plan; else one try: a
            # member left behind costs one early wake-up, when a join publishes
            with contextlib.suppress(BatchQueueError, redis.RedisError):
                call(lambda: client.srem(keys.planwait, waiter), "leaving the plan's waiters")
    total = plan.epoch_batches
    if total < 0:
        raise LengthUnknown(
            f"queue {keys.queue}: this pipeline cannot tell its batches per "
            "epoch in advance (it filters or regroups examples)"
        )
    if world == 1:
        return total
    layout = RankLayout(plan.shards, world, even)
    shares = layout.slot_batches(plan.shard_batches, total) if plan.shards != total else None
    if plan.shards != total and shares is None:
        raise LengthUnknown(
            f"queue {keys.queue}: with shards of more than one batch that the plan cannot "
            "count, a rank's share is only known at the epoch's end"
        )
    return layout.epoch_count(shares) if shares is not None else layout.per_rank


def _join_waiters(
    client: redis.Redis, keys: QueueKeys, waiter: str, retry: Callable[[Any, str], Any]
) -> bool:
    """Add ``waiter`` to the queue's set of ``len()`` callers waiting for the plan.

    Returns:
        Whether it was added: not where the server refuses SADD (an ACL file from
        before the set, deploy/acl.conf): that wait reads again every ``BLOCK_S``.

    Raises:
        WrongKeyType: another type is kept under the set's key.
    """
    try:
        retry(lambda: client.sadd(keys.planwait, waiter), "waiting for the plan")
    except redis.exceptions.NoPermissionError:
        return False
    except redis.ResponseError as e:
        if is_wrong_type(e):
            raise wrong_type_error(client, keys.types("planwait"), e) from e
        raise
    return True


class Shape(NamedTuple):
    """The plan's figures a resume sends (resume.lua writes them into meta; ``list_cap``
    0: the first producer sets them)."""

    list_cap: int
    shards: int
    window: int
    epoch_batches: int


class Restart(NamedTuple):
    """A :meth:`Session.resume` as asked: the first shard, the pipeline, the ledger's
    pairs, the checkpoint's step, the plan's figures, the remap (if any), and the
    state's digest where a detached run may be taken over as it is (or '')."""

    first_shard: int
    fingerprint: str
    ledger: list[tuple[str, str]]
    step: int
    shape: Shape
    remap: tuple[int, dict[int, int]] | None
    keep: str = ""  # the state's digest: its detached run may be taken over (resume.lua)


def resumed_shape(plan: Plan | None, fingerprint: str, shards: int | None) -> Shape:
    """What a resume tells of the plan: the published plan's (its hwm only for the same
    pipeline), or where no producer published one, S from the checkpoint."""
    if plan is None:
        return Shape(0, shards or 0, 1, -1)
    same = plan.fingerprint == fingerprint and plan.list_cap > 0
    return Shape(plan.list_cap if same else 0, plan.shards, plan.window, plan.epoch_batches)


def past_remap(
    ledger: Iterable[tuple[str, str]], remap: tuple[int, dict[int, int]] | None
) -> list[tuple[str, str]]:
    """Of a resume's ledger pairs, the remapped epoch's slots past the remap (done for
    every rank): a run re-created after Redis lost the queue sends them again with the
    remap, so that none is built before the rank it belongs to has recovered."""
    if remap is None:
        return []
    epoch, slots = remap
    fields = [(parse_ledger_field(f), f, v) for f, v in ledger if v == DONE]
    return [(f, v) for (e, slot), f, v in fields if e == epoch and slot not in slots]


class RunView(Protocol):
    """The run a reader reads, as it sees it: the claim's keys and figures, the run's
    plan, and the calls that keep the claim (the trainer's session is one; its reader
    thread is the only other thread that calls them).

    Attributes:
        keys: the keys the claim reads (a group's slot: its own).
        data_key: the list this rank pops.
        rank, world: this rank of the job's ranks.
        run, incarnation, token, suffix, claim_ttl_ms: the claim, as the pop script
            checks it (``suffix``: a rank's meta fields end in it).
        plan: what the producers published of the run (None before).
        slot: the group slot the claim reads (0: the run's first group).
        grouped: the run is read by several groups (frames stored once for all).
        remap: (epoch, slot -> shard) the run was resumed with (an elastic resume's),
            or None; remap_done: that epoch's slots past it, done (ledger pairs).
    """

    keys: QueueKeys
    data_key: str
    rank: int
    world: int
    run: str
    incarnation: str
    token: str
    suffix: str
    claim_ttl_ms: int
    plan: Plan | None
    slot: int
    grouped: bool
    remap: tuple[int, dict[int, int]] | None
    remap_done: list[tuple[str, str]]

    @property
    def what(self) -> str:
        """The claim, for messages ('queue Q[ group G][ rank r]')."""

    def refresh(self, client: redis.Redis) -> None:
        """Keep the claim alive (idle; every pop refreshes it too)."""

    def reclaim(self, client: redis.Redis) -> None:
        """Claim again after Redis lost the queue (a :meth:`resume` follows)."""

    def resume(
        self,
        client: redis.Redis,
        first_shard: int,
        fingerprint: str,
        ledger: Iterable[tuple[str, str]],
        *,
        step: int = 0,
        shards: int | None = None,
        remap: tuple[int, dict[int, int]] | None = None,
    ) -> None:
        """Re-create the run at ``first_shard`` from the ledger's pairs."""

    def saw_groups(self, groups: int) -> None:
        """A pop said the run is read by ``groups`` group slots."""


class ReaderBuffer(Protocol):
    """The buffer as the reader sees it: its reader side (the stream's
    :class:`consumer.reader.buffer.Buffer`, or a stripe's view of it), what the reader
    thread, its filer and repair, and the params screen call.

    Attributes:
        error: what stopped the reader (handed to the iterator), or None.
        dropped_ahead: frames past the look-ahead window dropped so far.
    """

    @property
    def error(self) -> BaseException | None: ...

    @property
    def dropped_ahead(self) -> int: ...

    def put(self, frames: list[tuple[Frame, bytes]], stale: int) -> list[tuple[bytes, str]]:
        """File decoded frames; returns the bad ones (element, reason)."""

    def fail(self, error: BaseException) -> None:
        """The reader stopped on ``error``: the iterator raises it."""

    def lost(self) -> None:
        """Redis lost the queue (the reader re-created the run)."""

    def wake(self) -> None:
        """Wake whoever waits."""

    def idle(self, hwm: int, published_floor: int, wait_s: float) -> tuple[bool, bool]:
        """(whether the reader has nothing to pop, whether the floor is stale)."""

    def fill(self) -> tuple[int, int]:
        """(frames held, the floor a pop publishes)."""

    def floor(self) -> int:
        """The floor the trainer publishes."""

    def purge(self, stale: Callable[[int, Frame], bool]) -> list[tuple[int, int, int, int]]:
        """Drop held frames built with params since changed: (epoch, shard, batches
        kept, frames dropped) per shard."""

    def prefix(self, epoch: int, shard: int) -> int:
        """The leading batches of a shard the trainer has."""

    def waited_since(self) -> float | None:
        """Since when the iterator waits for a frame (None: it does not)."""

    def missing(self) -> tuple[int, list[int]]:
        """(epoch, its shards not complete)."""

    def incomplete(self, window: int) -> list[int]:
        """The shards of the look-ahead window not complete."""

    def received(self) -> tuple[int, list[tuple[str, str]]]:
        """(the current epoch's first shard, what arrived from it on as ledger pairs)."""
