"""The next shard, leased ahead and built while the current shard's last push travels.

A producer alone on a fast transport is latency-bound, not CPU-bound: it encodes a
frame, sends the capped push and waits for the reply before it builds the next one,
and on a busy host that wait (Redis and the producer being scheduled in turn) is as
long as the build. Measured on the project's 2-core machine (1.57 MB batches, shared
memory, one shard per batch): one producer ~1600 batches/s, two ~2500, with every
process below 60 % of a core. So a producer whose shards build quickly keeps one shard
*ahead*: the lease for shard s+1 is in hand when shard s's last push is sent, and s+1's
first batch is built and encoded while that push and its reply travel
(:func:`batchq.protocol.calls.round_trip`'s ``between``). The lease after it rides on the
same push, as the one lease held ahead always did.

Two quantities are "ahead" here, each with its name: the *leases ahead* a producer holds
past the shard it serves (lease.lua's ``prefetch`` k, 1 or :data:`MAX_LEASES_AHEAD`:
:attr:`Ahead.leases`, :meth:`Ahead.wanted`), and the *shard built ahead*, the first
batch of the next leased shard (:class:`Ready`, :meth:`Ahead.build_next`). Neither is
the trainer's reader prefetch (:mod:`producer.serving.transport`) nor the run's lease
window (the shards minted past the trainer's oldest incomplete one, join.lua's
``window``).

Holding a second lease serialises two shards on one producer, which costs a slow
pipeline the parallelism of other producers; so the second lease is asked for only
while the shard just built took under :data:`AHEAD_MAX_BUILD_S` (then serialising
costs at most that) and the trainer is waiting (the producer's last push found the
list empty: a trainer-bound run gains nothing, and a frame built ahead there would
take a segment the pool keeps for the list), and lease.lua grants leases ahead only if
the push it rides behind went through (its entry left the lease list) and the producer
then holds fewer than k leases: a producer blocked at the cap is never granted another
shard (it keeps the one it held ahead, already built: at most two in all).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis

from batchq.protocol.calls import Call
from batchq.protocol.layout import lease_entry
from batchq.protocol.producer_scripts import LeaseReply
from batchq.protocol.ranks import RankLayout, shard_of_slot
from batchq.protocol.stripes import Stripes
from batchq.protocol.words import Status
from producer.control import ProducerParams, ShardParams
from producer.serving.sharding import ShardPlan
from producer.serving.transport import ShmFrame

__all__ = ["AHEAD_MAX_BUILD_S", "MAX_LEASES_AHEAD", "Ahead", "Encode", "Lease", "Ready"]

# A shard built faster than this makes its producer keep one more shard leased ahead.
AHEAD_MAX_BUILD_S = 0.002
MAX_LEASES_AHEAD = 2  # leases a producer asks to hold behind a last push: the next two


class Lease(NamedTuple):
    """One leased slot (see :mod:`batchq.protocol.ranks`): its global number, the batches the
    trainer has already, the lease's token, the run's slots per epoch and world, and the
    group slots it is built for (:mod:`batchq.protocol.groups`; 1: slot 0 alone), and the
    stripe it was leased from (:mod:`batchq.protocol.stripes`: ``g`` is then the
    stripe's number), and the run it was granted in (its lease entry names it)."""

    g: int
    skip: int
    token: str
    slots: int
    world: int
    shard: int | None = None  # the shard to build, where a resume remapped the slot
    params: str = ""  # the params log's stamp when it was granted
    mask: int = 1
    stripe: int = 0
    stripes: int = 1
    run: str = ""
    attempts: int = 0  # failed attempts on the shard before this lease (lease.lua)

    @classmethod
    def from_reply(
        cls,
        reply: LeaseReply,
        token: str,
        shards: int,
        run: str,
        stripe: int = 0,
        stripes: int = 1,
    ) -> Lease:
        """From lease.lua's OK reply to a request of run ``run`` (a world-1 run of one
        group says no slots: the plan's S)."""
        slots = reply.slots or shards
        return cls(
            reply.g, reply.skip, token, slots, reply.world, reply.shard, reply.params, reply.mask,
            stripe, stripes, run, reply.attempts,
        )  # fmt: skip

    def address(self, shards: int) -> tuple[int, int, int]:
        """(epoch, slot, the shard to build) in a plan of ``shards`` shards (a stripe's
        slot number turned into the plan's)."""
        g = self.g
        if self.stripes > 1:
            g = Stripes(self.stripes).plan_g(g, self.stripe, RankLayout(self.slots, self.world))
        epoch, slot = divmod(g, self.slots)
        return epoch, slot, self.shard if self.shard is not None else shard_of_slot(slot, shards)

    @property
    def entry(self) -> str:
        """The lease's entry in the producer's lease list."""
        return lease_entry(self.g, self.run, self.token, self.mask)


# (epoch, slot, k, batch, last, rank, params version, group mask) -> the batch's frame
# (the shard pusher's encoding, producer.serving.pushing)
Encode = Callable[[int, int, int, Any, bool, int, int, int], Any]


@dataclass
class Ready:
    """A shard's first batch, built ahead: what the serving loop would have computed.

    Attributes:
        entry: the lease entry of the shard.
        batches: the shard's batch iterator, past the first batch.
        step: the first (batch, last), or None for a shard without batches.
        frame: its encoded frame (None with ``error`` or without batches).
        error: what the pipeline or the encoding raised, if it did.
        took_s: how long building it took (the produce time, and whether it was quick).
        params: the params of the shard's batches (each built under its own; None:
            the current log's).
    """

    entry: str
    batches: Iterator[tuple[Any, bool]]
    step: tuple[Any, bool] | None
    frame: Any
    error: Exception | None
    took_s: float
    params: ShardParams | None = None

    def discard(self) -> None:
        """Never to be pushed: a segment it holds is free again."""
        if isinstance(self.frame, ShmFrame):
            self.frame.abandon()


class Ahead:
    """The leases a producer holds beyond the shard it serves, and the next one built."""

    def __init__(self, stripe: int = 0, stripes: int = 1) -> None:
        self.stripe, self.stripes = stripe, stripes  # where its leases come from
        self.leases: deque[Lease] = deque()
        self.ready: Ready | None = None
        self.depth = -1  # the list's length after this producer's last push (-1: none yet)

    def wanted(self, build_s: float) -> int:
        """The leases ahead to hold behind a last push after a shard built in
        ``build_s``: two when it built quickly and the trainer is waiting."""
        quick = build_s < AHEAD_MAX_BUILD_S and self.depth == 1
        return MAX_LEASES_AHEAD if quick else 1

    def keep_granted(
        self,
        requests: Sequence[tuple[Call[LeaseReply], str]],
        raw: Sequence[Any],
        shards: int,
        run: str,
    ) -> list[bool]:
        """Keep the leases that rode with a shard's last push (requests of run ``run``),
        those granted (``raw``: their replies; an OOM refusal is the error itself);
        returns which were."""
        granted = []
        for (request, token), value in zip(requests, raw, strict=True):
            reply = None if isinstance(value, redis.ResponseError) else request.parse(value)
            ok = reply is not None and reply.status == Status.OK
            if reply is not None and ok:
                lease = Lease.from_reply(reply, token, shards, run, self.stripe, self.stripes)
                self.leases.append(lease)
            granted.append(ok)
        return granted

    def build_next(self, plan: ShardPlan, encode: Encode, params: ProducerParams) -> None:
        """Build the next leased shard's first batch (while the last push travels: no
        Redis here), under the params ``params`` holds. What the pipeline raises is kept
        for the serving loop, which reports it as if raised there."""
        lease = self.leases[0]
        # A resume's shard, or one that failed before (it is isolated first: never
        # built outside that); built already.
        if lease.skip or lease.attempts or self.ready is not None:
            return
        epoch, slot, shard = lease.address(plan.shards)
        started = time.perf_counter()
        shard_params = params.shard(epoch * lease.slots + slot)  # the plan's g
        batches = iter(plan.iter_shard_marked(epoch, shard, shard_params.around))
        step: tuple[Any, bool] | None = None
        frame: Any = None
        error: Exception | None = None
        try:
            step = next(batches, None)
            if step is not None:
                version = shard_params.version(0)
                frame = encode(epoch, slot, 0, *step, slot % lease.world, version, lease.mask)
        except Exception as e:
            error = e
        took_s = time.perf_counter() - started
        self.ready = Ready(lease.entry, batches, step, frame, error, took_s, shard_params)

    def take_ready(self, entry: str) -> Ready | None:
        """The built first batch of the shard of ``entry``, if it was built ahead."""
        ready, self.ready = self.ready, None
        if ready is not None and ready.entry != entry:
            ready.discard()  # built for another lease (never the case in order)
            return None
        return ready

    def drop(self) -> None:
        """The run was left (a join, an exit): its leases are gone, a built frame too."""
        self.leases.clear()
        if self.ready is not None:
            self.ready.discard()
            self.ready = None
