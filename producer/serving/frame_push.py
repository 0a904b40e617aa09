"""The capped push of one frame: what the list gets, the round trip, each reply, and the
waits at a full list or at Redis' maxmemory (:class:`FramePusher`, which the shard
pusher, :mod:`producer.serving.pushing`, holds and hands each frame to).

A frame reaches the data list as one of three elements, each with its own function:
a frame in shared memory as its small descriptor (:meth:`FramePusher._push_descriptor`;
push.lua refuses it with REROUTE when the rank's trainer is not on this host, and the
frame's bytes go instead), a small frame inline, a large one stored under its own key
first and listed by reference (:meth:`FramePusher._push_bytes`). A shard's last push
carries the next leases in the same round trip (:mod:`producer.serving.ahead`). Each
reply status has its own small function; each says what happened as a value
(:data:`Pushed`): pushed, the shard is no longer ours, try again (None), or a
:class:`Handover`: a status that is the producer's business (the run finished or
changed, the producer was reaped), which the pusher hands back to its caller instead of
acting on it: the Producer joins again or stops once the pusher has returned.

In a run read by several groups (:mod:`batchq.protocol.groups`) every push goes into the
lists of every group the shard is for, in one push.lua call; a group whose full list
was left out (detached) is left out of the shard's later frames too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis

from batchq.client.connection import Pieces, StopEvent, call, convert_error, is_wrong_type
from batchq.protocol.admin import is_oom
from batchq.protocol.calls import Call, Command, round_trip
from batchq.protocol.producer_scripts import LeaseReply, PushReply, push_call
from batchq.protocol.words import Status
from batchq.wire.frame import encode_ref
from producer.serving.ahead import Ahead
from producer.serving.blocking import Waiting, give_back, hand_back
from producer.serving.frames import PushSettings
from producer.serving.heartbeat import FirstPush
from producer.serving.membership import RunPosition
from producer.serving.transport import ShmFrame, Transport

__all__ = [
    "PENDING_FRAME_TTL_MS",
    "WAIT_S",
    "FramePusher",
    "Handover",
    "LeaseRequest",
    "OnePush",
    "Pushed",
]

log = logging.getLogger(__name__)

# A producer at the cap (a full list) waits on the wake list this long between tries:
# 2 commands per try keeps a waiting producer under 20 commands/s with its heartbeat.
WAIT_S = 0.15
# A frame stored by reference but not yet in the list expires after this long, so a
# producer killed at the cap leaves nothing behind; in the list it never expires.
PENDING_FRAME_TTL_MS = 10 * 60 * 1000

LeaseRequest = Callable[[int, str], tuple[Call[LeaseReply], str]]
Riders = list[tuple[Call[LeaseReply], str]]  # lease requests riding on a push


class OnePush(NamedTuple):
    """One frame's push: for which lease (its entry), whether it is the shard's last,
    how long the batch took to build (``produce_ms``, for the figures) and the whole
    shard so far (``built_s``: a quick one keeps two leases ahead)."""

    entry: str
    last: bool
    produce_ms: int
    built_s: float


@dataclass(frozen=True)
class Handover:
    """A reply status that is the producer's business (FINISHED, RUN_CHANGED, REAPED,
    STATE_LOST, or one it does not know): the shard is no longer ours, and the caller
    acts on the status once the pusher has returned."""

    status: str


# What became of a push: True pushed; False the shard is no longer ours (taken back,
# handed back); a Handover: neither, and the producer's business.
Pushed = bool | Handover


class FramePusher:
    """Pushes one frame at a time under the cap for the shard being served (see the
    module docstring): the element, the round trip, each reply, the waits at a full list
    or at maxmemory. Serving a shard (its batches, their frames) is
    :class:`producer.serving.pushing.ShardPusher`'s, which holds this pusher.

    Args:
        settings: the producer's fixed settings.
        client: the producer's client (the serving thread's).
        transport: shared memory or Redis, per frame.
        position: the run served (replaced by :meth:`follow`).
        stop: set when the producer stops.
        lease_request: ``(leases_ahead, after) -> (call, token)``: the next lease
            request (see :func:`batchq.protocol.producer_scripts.lease_call`, whose
            ``prefetch`` is ``leases_ahead``).
        ahead: the leases held ahead, which a shard's last push asks for and fills.
        shards: the plan's shards (S; the leases riding on a push name slots of it).
        first_push: told of the first push (:class:`producer.serving.heartbeat.FirstPush`),
            if given.
    """

    def __init__(
        self,
        settings: PushSettings,
        client: redis.Redis,
        transport: Transport,
        position: RunPosition,
        stop: StopEvent,
        lease_request: LeaseRequest,
        ahead: Ahead,
        shards: int,
        first_push: FirstPush | None = None,
    ) -> None:
        self.settings = settings
        self.first_push = first_push
        self.client = client
        self.shards = shards
        self._transport = transport
        self.position = position
        self._stop = stop
        self._lease_request = lease_request
        self.ahead = ahead
        self.oom_waits = 0  # pushes and leases refused by Redis at maxmemory
        self._oom_logged = False
        self._frame_seq = 0
        self.pending_ref: str | None = None  # a frame stored by reference, not yet listed
        self.data_key = settings.keys.data  # the data list of the current shard's rank
        self.rank = 0
        self.world = 1
        self.targets = 1  # the group slots the current shard goes to (a mask)
        # A striped producer's lane: whether another stripe's list is empty (its trainer
        # may wait there while this push waits for room here); None for one queue.
        self.starved: Callable[[], bool] | None = None
        self._wrong_logged: tuple[str, str] | None = None

    def aim(self, rank: int, world: int, mask: int = 1) -> None:
        """The next shard is for ``rank`` of ``world`` of the group slots of ``mask``:
        push into those lists (the first of them: where an uncertain push is looked for)."""
        self.rank, self.world, self.targets = rank, world, mask
        first = (mask & -mask).bit_length() - 1
        self.data_key = self.settings.keys.slot_view(first).data_of(rank, world)

    def follow(self, position: RunPosition) -> None:
        """Push for ``position``'s run: the one a join gave, or the same run read by
        more groups now."""
        self.position = position

    def push(
        self, frame: Pieces | memoryview | ShmFrame, push: OnePush,
        between: Callable[[], None] | None = None,
    ) -> Pushed:  # fmt: skip
        """Push one frame under the cap (its descriptor for a frame in shared memory,
        else its bytes: inline or by reference), waiting at the cap; ``between`` (a
        shard's last push: the next shard built ahead) runs while the first round trip
        travels."""
        if isinstance(frame, ShmFrame):
            return self._push_descriptor(frame, push, between)
        return self._push_bytes(frame, push, between)

    def note_oom(self, error: redis.ResponseError) -> None:
        """Log Redis' OOM once, then count quietly (``oom_waits``)."""
        self.oom_waits += 1
        if not self._oom_logged:
            self._oom_logged = True
            log.warning(
                "producer %s: Redis is at maxmemory (%s); waiting for the trainer to drain",
                self.settings.producer,
                error,
            )

    def note_wrong_type(self, key: str, got: str) -> None:
        """Log a replaced queue key (once per key and type)."""
        if self._wrong_logged == (key, got):
            return
        self._wrong_logged = (key, got)
        log.warning(
            "producer %s: a Redis key (%s) holds a %s, not what batchq wrote; waiting "
            "for it to be repaired (deleted or restored)",
            self.settings.producer,
            key,
            got,
        )

    def wait_for_room(self, slot: int = -1) -> None:
        """Block until a trainer's pop wakes us or WAIT_S passes: no spinning. In a run
        read by several groups each group's pops wake its own list: a producer waiting
        for group ``slot`` (its full list, or its floor holding the shared stream) waits
        for that group's (and the queue's), anything else for any group's."""
        # A trainer that just arrived published its host before popping: look next time.
        self._transport.recheck()
        keys, groups = self.settings.keys, self.position.groups
        if groups and slot >= 0:
            wakes = list(dict.fromkeys((keys.slots[slot].wake, keys.wake)))
        else:
            wakes = [keys.slots[i].wake for i in range(max(groups, 1))]
        try:
            call(lambda: self.client.blpop(wakes, timeout=WAIT_S), "waiting for room")
        except redis.ResponseError as e:
            if not is_wrong_type(e):
                raise
            self.note_wrong_type(" or ".join(wakes), "key of another type")
            self._stop.wait(WAIT_S)

    # -- each kind of element ----------------------------------------------------------

    def _push_descriptor(
        self, frame: ShmFrame, push: OnePush, between: Callable[[], None] | None
    ) -> Pushed:
        """A frame in shared memory: the list gets its descriptor; refused with REROUTE
        (the rank's trainer is not on this host any more), the frame's bytes instead."""
        targets = self.targets
        pushed = self._capped_push(frame, frame.element, None, frame.host, push, between)
        if pushed is True and self.targets != targets:
            frame.retarget(self.targets)  # left out of a detached group's full list
        if not isinstance(pushed, Handover) or pushed.status != Status.REROUTE:
            return pushed
        self._transport.rerouted()
        return self._push_bytes(frame.detach(), push, None)

    def _push_bytes(
        self, frame: Pieces | memoryview, push: OnePush, between: Callable[[], None] | None
    ) -> Pushed:
        """A frame for Redis: inline, or (larger than inline_max_bytes) stored under a
        key of its own and listed by reference."""
        if len(frame) <= self.settings.inline_max_bytes:
            return self._capped_push(frame, frame, None, "", push, between)
        self._frame_seq += 1
        ref = self.settings.keys.frame(self.position.run, self.settings.producer, self._frame_seq)
        return self._capped_push(frame, encode_ref(ref), ref, "", push, between)

    # -- the capped push ---------------------------------------------------------------

    def _capped_push(
        self,
        frame: Pieces | memoryview | ShmFrame,
        element: Any,
        ref: str | None,
        shm_host: str,
        push: OnePush,
        between: Callable[[], None] | None,
    ) -> Pushed:
        """Push ``element`` (the frame, a reference to it under ``ref``, or a descriptor
        of ``shm_host``), trying again at the cap, at maxmemory and after GONE.

        A last push also asks for the next leases (:meth:`_lease_riders`), and runs
        ``between`` (the next shard built ahead) while its first round trip travels."""
        leases = self._lease_riders(push.entry, push.built_s) if push.last else []
        wait = Waiting()
        store = frame if ref is not None and not isinstance(frame, ShmFrame) else None
        stored = False  # the frame is under its key (sent once, again after GONE)
        while not self._stop.is_set():
            request = self._push_call(element, len(frame), ref, shm_host, push, wait)
            replies = self._send(ref, None if stored else store, request, leases, between)
            between = None  # built once, whatever the replies say
            leases = self._keep_granted(leases, replies)
            if self._refused_for_oom(replies, wait):
                stored = False
                continue
            leases = []
            if ref is not None:
                stored = True
                self.pending_ref = ref
            reply = request.parse(replies[-1])
            pushed = self._after(reply, push.entry, ref, wait)
            if pushed is not None:
                return pushed
            stored = stored and reply.status != Status.GONE
        return False

    def _push_call(
        self,
        element: Any,
        nbytes: int,
        ref: str | None,
        shm_host: str,
        push: OnePush,
        wait: Waiting,
    ) -> Call[PushReply]:
        """One try's push.lua call (it reports the wait since the last try)."""
        s, run = self.settings, self.position
        return push_call(
            s.keys, incarnation=run.incarnation, run=run.run, producer=s.producer,
            entry=push.entry, element=element, last=push.last,
            heartbeat_ttl_ms=s.heartbeat_ttl_ms, frame_bytes=nbytes,
            blocked_ms=wait.since_last_try_ms(), produce_ms=push.produce_ms, frame_key=ref,
            rank=self.rank, world=self.world, targets=self.targets, groups=run.groups,
            shm_host=shm_host,
        )  # fmt: skip

    def _lease_riders(self, entry: str, built_s: float) -> Riders:
        """The leases a shard's last push asks for (two ahead after a shard built in
        under AHEAD_MAX_BUILD_S while the trainer waits): one round trip saved per shard
        (per batch for map-style pipelines)."""
        want = self.ahead.wanted(built_s)
        return [self._lease_request(want, entry) for _ in range(want - len(self.ahead.leases))]

    def _keep_granted(self, leases: Riders, replies: list[Any]) -> Riders:
        """Keep the leases granted, and take their replies off ``replies``; returns those
        refused at maxmemory, to be asked again with the push (with the same tokens).

        Each command has its own reply: an OOM refused that command alone (a script that
        writes is refused before it runs), so a lease's OOM never hides a push that went
        through, and leases refused behind a refused push are asked again."""
        if not leases:
            return leases
        raw = replies[len(replies) - len(leases) :]
        granted = self.ahead.keep_granted(leases, raw, self.shards, self.position.run)
        del replies[len(replies) - len(leases) :]
        return [r for r, ok in zip(leases, granted, strict=True) if not ok]

    def _refused_for_oom(self, replies: list[Any], wait: Waiting) -> bool:
        """Redis is full (noeviction) and refused the push: backpressure, like the cap;
        nothing is lost. Waits for room, then True: send it again."""
        oom = next((r for r in replies if isinstance(r, redis.ResponseError)), None)
        if oom is None:
            return False
        self.note_oom(oom)
        wait.start()
        self.wait_for_room()
        return True

    def _send(
        self,
        ref: str | None,
        store: Pieces | memoryview | None,
        push: Call[PushReply],
        leases: Riders | None = None,
        between: Callable[[], None] | None = None,
    ) -> list[Any]:
        """One round trip: store the frame under its key if asked, the capped push, and
        the next leases if asked; ``between`` runs while it travels."""
        commands: list[Command] = []
        if store is not None and ref is not None:
            commands.append(("SET", ref, store, "PX", PENDING_FRAME_TTL_MS))
        commands.append(push.command())
        commands += [lease[0].command() for lease in leases or ()]
        replies = round_trip(self.client, commands, "pushing a frame", between, keep_errors=True)
        for r in replies:  # OOM is the caller's, per command; any other error is raised
            if isinstance(r, redis.ResponseError) and not is_oom(r):
                converted = convert_error(r, "pushing a frame", self.client)
                if converted is None:
                    raise r
                raise converted from r
        return replies

    # -- each reply --------------------------------------------------------------------

    def _after(self, reply: PushReply, entry: str, ref: str | None, wait: Waiting) -> Pushed | None:
        """What a push's reply means (None: try again)."""
        status = reply.status
        if status == Status.OK:
            return self._pushed(reply)
        if status == Status.DROPPED:
            return self._dropped(entry, ref)
        if status == Status.FULL:
            return self._full(entry, ref, wait, reply.slot)
        if status == Status.GONE:
            return self._gone(wait)
        if status == Status.WRONG_TYPE:
            return self._wrong_type(reply, wait)
        if status == Status.LEASE_LOST:
            return self._lease_lost(entry, ref)
        return self._handover(status, ref)

    def _pushed(self, reply: PushReply) -> Pushed:
        """OK: the element is in the list (the lists); groups whose full lists it left
        out (detached) are left out of the shard's next frames: it went back for them."""
        self.pending_ref = None
        self.ahead.depth = reply.depth  # 1: the trainer had taken everything before
        if self.first_push is not None:
            self.first_push.pushed()
        if reply.dropped:
            self.targets &= ~reply.dropped
        return True

    def _dropped(self, entry: str, ref: str | None) -> Pushed:
        """DROPPED: every group the shard was for finished or was left behind (its
        shard went back for it): the shard is no longer ours."""
        self._drop_ref(ref)
        log.debug("producer %s: no group takes %s any more", self.settings.producer, entry)
        return False

    def _full(self, entry: str, ref: str | None, wait: Waiting, slot: int = -1) -> Pushed | None:
        """FULL: wait for room (in a run of groups, for the pops of group ``slot``, whose
        list is full); a data-parallel rank's full list, once per HANDBACK_S,
        may make us hand the shard back (:func:`producer.serving.blocking.hand_back`)."""
        blocked = wait.start()
        if blocked and (self.world > 1 or self.starved is not None) and wait.hand_back_due():
            keys, producer = self.settings.keys, self.settings.producer
            status = None
            if self.world > 1:
                aim = (self.rank, self.targets)
                status = hand_back(self.client, keys, self.position, producer, aim, entry)
            if status is None and self.starved is not None and self.starved():
                # A striped producer's one thread: held here, it would never serve the
                # stripe whose trainer waits (a run the ranks restarted waits for its plan).
                why = "this stripe's list is full, another stripe's is empty"
                status = give_back(self.client, keys, self.position, producer, entry, why)
            if status is not None:
                self._drop_ref(ref)
                return False if status in (Status.OK, Status.LEASE_LOST) else Handover(status)
        self.wait_for_room(slot)
        return None

    def _gone(self, wait: Waiting) -> Pushed | None:
        """GONE: the stored frame expired: store it again."""
        wait.restart()
        return None

    def _wrong_type(self, reply: PushReply, wait: Waiting) -> Pushed | None:
        """WRONG_TYPE: a foreign writer replaced a queue key: keep the shard, wait for a
        repair."""
        wait.restart()
        self.note_wrong_type(reply.key, reply.found)
        self._stop.wait(WAIT_S)
        return None

    def _lease_lost(self, entry: str, ref: str | None) -> Pushed:
        """LEASE_LOST: the shard was taken back (reaped, requeued): drop it."""
        self._drop_ref(ref)
        log.info("producer %s: lease %s was taken back; dropping it", self.settings.producer, entry)
        return False

    def _handover(self, status: str, ref: str | None) -> Pushed:
        """Any other status is the producer's business: hand it over."""
        self._drop_ref(ref)
        return Handover(status)

    def _drop_ref(self, ref: str | None) -> None:
        """Delete a frame stored by reference that will never be listed."""
        if ref is not None:
            self.client.delete(ref)
            self.pending_ref = None
