"""Building a leased shard and pushing its frames under the hwm (the producer's hot path).

:class:`ShardPusher` turns one leased shard into frames: it builds the batches,
encodes them, pushes each through the capped-push script (inline, or stored by
reference first), waits at the hwm or at Redis' maxmemory, folds the END into the last
batch, asks for the next lease in the same round trip (and, for shards that build
quickly, builds the next shard's first batch while that round trip travels:
:mod:`producer.serving.ahead`), and reports a failing pipeline (retry elsewhere, or an ERROR
frame).

:class:`producer.server.Producer` owns one and hands it everything it uses explicitly:
fixed :class:`PushSettings`, the client, the plan, the transport, the run it serves
(:class:`RunPosition`, which only the producer's join writes), its stop event, and two
callables: ``lease_request(prefetch, after)`` (the next lease's call and token) and
``on_status(status)`` (a reply that is the producer's business: the run finished or
changed). Only the pipeline's ``next()`` and the encoding of what it made count as
"the pipeline raised"; Redis' errors propagate as Redis errors.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from batchq.client.connection import Pieces, call, convert_error, is_wrong_type
from batchq.protocol import scripts
from batchq.protocol.admin import is_oom
from batchq.protocol.calls import Call, Command, round_trip
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import lease_entry
from batchq.protocol.ranks import shard_of_slot
from batchq.protocol.replies import LeaseReply, PushReply
from batchq.protocol.words import Status
from batchq.wire import codec, refs
from producer.serving.ahead import Ahead, Lease, Ready
from producer.serving.blocking import HANDBACK_S, Waiting, hand_back_reason
from producer.serving.sharding import ShardPlan
from producer.serving.transport import ShmFrame, Transport

__all__ = [
    "HANDBACK_S",
    "INLINE_MAX_BYTES",
    "PENDING_FRAME_TTL_MS",
    "WAIT_S",
    "Lease",
    "PushSettings",
    "RunPosition",
    "ShardPusher",
]

log = logging.getLogger(__name__)

# A producer at the hwm waits on the wake list this long between tries: 2 commands per
# try keeps a waiting producer under 20 commands/s with its heartbeat.
WAIT_S = 0.15
# Large frames travel by reference (a plain SET, then the capped-push script gets only the
# key's name): a value passed through Lua is copied twice more. bench/frame_path.py, push
# + pop against plain LPUSH/RPOP: inline 0.81/0.88/0.72/0.76 and by reference
# 0.61/0.76/0.71/0.91 of raw at 64 KiB/256 KiB/512 KiB/1.5 MiB (docs/design.md).
INLINE_MAX_BYTES = 256 * 1024
# A frame stored by reference but not yet in the list expires after this long, so a
# producer killed at the hwm leaves nothing behind; in the list it never expires.
PENDING_FRAME_TTL_MS = 10 * 60 * 1000


@dataclass(frozen=True)
class PushSettings:
    """What a producer's pushes carry that never changes while it serves."""

    keys: QueueKeys
    producer: str
    sources: tuple[str, ...]
    checksum: bool
    max_frame_bytes: int | None
    inline_max_bytes: int
    heartbeat_ttl_ms: int
    max_attempts: int


@dataclass
class RunPosition:
    """The run a producer serves: written by its join only, read by its pusher."""

    run: str = ""
    incarnation: str = ""
    world: int = 1  # ranks of the run's trainer (batchq/protocol/ranks.py)


LeaseRequest = Callable[[int, str], tuple[Call[LeaseReply], str]]


class ShardPusher:
    """Serving one leased shard at a time for one producer.

    Args:
        settings: the producer's fixed settings.
        client: the producer's client (the serving thread's).
        plan: the shard plan of the producer's pipeline.
        transport: shared memory or Redis, per frame.
        position: the run served (the producer's join updates it in place).
        stop: set when the producer stops.
        lease_request: ``(prefetch, after) -> (call, token)``: the next lease request
            (see :func:`batchq.protocol.scripts.lease_call`).
        on_status: handles a reply status that is not the pusher's (the run finished,
            changed, the producer was reaped: raises or joins again).
    """

    def __init__(
        self,
        settings: PushSettings,
        client: redis.Redis,
        plan: ShardPlan,
        transport: Transport,
        position: RunPosition,
        stop: threading.Event,
        lease_request: LeaseRequest,
        on_status: Callable[[str], None],
    ) -> None:
        self.keys = settings.keys
        self.id = settings.producer
        self.sources = settings.sources
        self.checksum = settings.checksum
        self.max_frame_bytes = settings.max_frame_bytes
        self.inline_max_bytes = settings.inline_max_bytes
        self.heartbeat_ttl_ms = settings.heartbeat_ttl_ms
        self.max_attempts = settings.max_attempts
        self.client = client
        self.plan = plan
        self._transport = transport
        self._pos = position
        self._stop = stop
        self._lease_request = lease_request
        self._on_status = on_status
        self.oom_waits = 0  # pushes and leases refused by Redis at maxmemory
        self._oom_logged = False
        self._frame_seq = 0
        self.pending_ref: str | None = None  # a frame stored by reference, not yet listed
        self.ahead = Ahead()  # leased with the last pushes; the next shard built ahead
        self._data_key = self.keys.data  # the data list of the current shard's rank
        self._rank = 0
        self._world = 1
        self._wrong_logged: tuple[str, str] | None = None

    def aim(self, rank: int, world: int) -> None:
        """The next shard is for ``rank`` of ``world``: push into that rank's list."""
        self._rank, self._world = rank, world
        self._data_key = self.keys.data_of(rank, world)

    def note_oom(self, error: redis.ResponseError) -> None:
        """Log Redis' OOM once, then count quietly (``oom_waits``)."""
        self.oom_waits += 1
        if not self._oom_logged:
            self._oom_logged = True
            log.warning(
                "producer %s: Redis is at maxmemory (%s); waiting for the trainer to drain",
                self.id,
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
            self.id,
            key,
            got,
        )

    def wait_for_room(self) -> None:
        # Blocks until a trainer's pop wakes us or WAIT_S passes: no spinning. A trainer
        # that just arrived published its host before popping: look at it next time.
        self._transport.recheck()
        try:
            call(lambda: self.client.blpop([self.keys.wake], timeout=WAIT_S), "waiting for room")
        except redis.ResponseError as e:
            if not is_wrong_type(e):
                raise
            self.note_wrong_type(self.keys.wake, "key of another type")
            self._stop.wait(WAIT_S)

    # -- building and pushing a shard --------------------------------------------------

    def serve_shard(
        self, epoch: int, shard: int, entry: str, skip: int = 0, slot: int | None = None
    ) -> None:
        """Build a shard and push its batches from batch ``skip`` on (the trainer has the
        ones before: a resumed checkpoint).

        Args:
            slot: the slot the shard fills (data-parallel runs: frames name it, and a
                pad slot rebuilds an earlier shard); None: the shard itself.
        """
        label = shard if slot is None else slot
        ready = self.ahead.take_ready(entry)
        batches = ready.batches if ready else iter(self.plan.iter_shard_marked(epoch, shard))
        k = 0
        started = time.perf_counter()
        built_s = 0.0  # building this shard took, pushes apart
        ready_took: float | None = None
        while True:
            # Shared memory or Redis, from this batch on (also for a batch built ahead:
            # its frame is made already, the next ones are not).
            self._transport.refresh(self.client)
            # Only the user's pipeline (next) and what it made (encoding its arrays) are
            # "the pipeline raised"; Redis' errors come from outside this block.
            try:
                if ready is not None:  # the first batch, built while the last push travelled
                    step, frame, error = ready.step, ready.frame, ready.error
                    ready_took, ready = ready.took_s, None
                    if error is not None:
                        raise error
                else:
                    step = next(batches, None)
                    frame = None
                    if step is not None and k >= skip:
                        frame = self._encode_batch(epoch, label, k, *step)
            except Exception as e:
                self._pipeline_failed(epoch, label, k, entry, e)
                return
            if step is None:
                break
            last = step[1]
            took_s = time.perf_counter() - started if ready_took is None else ready_took
            ready_took = None
            built_s += took_s
            produce_ms = int(took_s * 1000)  # monitoring
            if frame is None:  # k < skip: the trainer has this batch
                if last:  # ... and every one: only the count is news
                    self._push_end(epoch, label, k + 1, entry)
                    return
                k += 1
                continue
            if not self._push_batch(frame, entry, last, produce_ms, built_s):
                return
            k += 1
            started = time.perf_counter()
        if k == 0:  # a shard without batches still says that it ended
            self._push_end(epoch, label, 0, entry)

    def _pipeline_failed(
        self, epoch: int, label: int, k: int, entry: str, error: Exception
    ) -> None:
        """Count the failure; retry the shard elsewhere, or tell the trainer (ERROR)."""
        log.error(
            "producer %s: pipeline raised in epoch %d shard %d",
            self.id,
            epoch,
            label,
            exc_info=error,
        )
        if self._retry_elsewhere(epoch, label, entry):
            return
        self._push_end(epoch, label, k, entry, error=error)

    def _push_end(
        self, epoch: int, shard: int, count: int, entry: str, error: Exception | None = None
    ) -> None:
        """The shard's end after ``count`` batches: an END frame, or with ``error`` the
        ERROR frame carrying the pipeline's traceback."""
        extra: dict[str, Any] = {}
        if error is not None:
            extra = {
                "error": "".join(traceback.format_exception(error)),
                "error_name": type(error).__name__,
            }
        header = codec.FrameHeader(
            codec.FrameKind.END if error is None else codec.FrameKind.ERROR,
            run=self._pos.run,
            epoch=epoch,
            shard=shard,
            k=count,
            producer=self.id,
            last=True,
            count=count,
            **extra,
        )
        frame = codec.encode_frame(header)
        self._push(frame, entry, last=True)

    def _retry_elsewhere(self, epoch: int, shard: int, entry: str) -> bool:
        """Count the failure; True if the shard went back to the work list for a retry."""
        reply = scripts.fail(
            self.client,
            self.keys,
            incarnation=self._pos.incarnation,
            run=self._pos.run,
            producer=self.id,
            entry=entry,
            max_attempts=self.max_attempts,
        )
        if reply.status == Status.RETRY:
            log.warning(
                "producer %s: epoch %d shard %d failed (attempt %d of %d); handed back",
                self.id,
                epoch,
                shard,
                reply.first,
                self.max_attempts,
            )
            return True
        if reply.status == Status.GIVE_UP:
            return False
        if reply.status != Status.LEASE_LOST:
            self._on_status(reply.status)
        return True

    def _encode_batch(
        self, epoch: int, shard: int, k: int, batch: Any, last: bool, rank: int | None = None
    ) -> Pieces | memoryview | ShmFrame:
        """One batch's frame: into shared memory, else pieces for Redis (raises what the
        codec finds wrong with the pipeline's arrays)."""
        values = batch.values() if isinstance(batch, dict) else batch
        # A list that is a regular array travels as one, as over Fuel's server (Fuel's
        # send_arrays made every value an array): a Fuel trainer reads batch.shape.
        data = tuple(codec.array_or_value(v) for v in values)
        header = codec.FrameHeader(
            codec.FrameKind.BATCH,
            run=self._pos.run,
            epoch=epoch,
            shard=shard,
            k=k,
            g=-1 if self.plan.shard_batches is None else self.plan.shard_batches * shard + k,
            producer=self.id,
            sources=self.sources,
            last=last,
            count=k + 1 if last else None,
            produced_at=time.time(),
        )
        return self._transport.encode(
            header,
            data,
            checksum=self.checksum,
            max_frame_bytes=self.max_frame_bytes,
            rank=self._rank if rank is None else rank,
        )

    def _push_batch(
        self,
        frame: Pieces | memoryview | ShmFrame,
        entry: str,
        last: bool,
        produce_ms: int,
        built_s: float = 1.0,
    ) -> bool:
        try:
            pushed = self._push(frame, entry, last=last, produce_ms=produce_ms, built_s=built_s)
        except BaseException:
            if isinstance(frame, ShmFrame):  # the reply was lost: maybe listed, maybe not
                self._transport.uncertain(frame, self._data_key)
            raise
        if not pushed and isinstance(frame, ShmFrame):
            frame.abandon()  # its descriptor never reached the list
        return pushed

    def _push(
        self,
        frame: Pieces | memoryview | ShmFrame,
        entry: str,
        *,
        last: bool,
        produce_ms: int = 0,
        built_s: float = 1.0,
    ) -> bool:
        """Push one frame, waiting at the hwm; False if the shard was taken from us.

        ``built_s``: how long the shard took to build; under AHEAD_MAX_BUILD_S its last
        push asks to hold two leases ahead (:mod:`producer.serving.ahead`)."""
        ref = None
        element: Any = frame
        shm_host = ""
        if isinstance(frame, ShmFrame):  # the list gets its small descriptor, inline
            element, shm_host = frame.element, frame.host
        elif len(frame) > self.inline_max_bytes:
            self._frame_seq += 1
            ref = self.keys.frame(self.id, self._frame_seq)
            element = refs.encode_ref(ref)
        # The shard's last push also asks for the next lease (two ahead for a quick
        # shard): one round trip saved per shard (per batch for map-style pipelines).
        # Only on the first send, which also builds the next shard if it is leased.
        leases: list[tuple[Call[LeaseReply], str]] = []
        between = None
        if last:
            want = self.ahead.wanted(built_s)
            more = want - len(self.ahead.leases)
            leases = [self._lease_request(want, entry) for _ in range(more)]
            if self.ahead.leases and self.ahead.ready is None:
                between = self._build_ahead
        wait = Waiting()
        stored = False  # the frame is under its key (sent once, again after GONE)
        while not self._stop.is_set():
            request = scripts.push_call(
                self.keys, data=self._data_key, frame_key=ref, incarnation=self._pos.incarnation,
                run=self._pos.run, producer=self.id, entry=entry, element=element, last=last,
                heartbeat_ttl_ms=self.heartbeat_ttl_ms, frame_bytes=len(frame),
                blocked_ms=wait.since_last_try_ms(), produce_ms=produce_ms,
                shm_host=shm_host, host_field=self._transport.host_field(self._rank, self._world),
            )  # fmt: skip
            store = None if stored or isinstance(frame, ShmFrame) or ref is None else frame
            replies = self._send(ref, store, request, leases, between)
            between = None  # built once, whatever the replies say
            # Each command's own reply: an OOM refused that command alone (a script that
            # writes is refused before it runs), so a lease's OOM never hides a push that
            # went through, and leases refused behind a refused push are asked again.
            granted = self._note_prefetch(leases, replies[len(replies) - len(leases) :])
            leases = [r for r, ok in zip(leases, granted, strict=True) if not ok]
            del replies[len(replies) - len(granted) :]
            oom = next((r for r in replies if isinstance(r, redis.ResponseError)), None)
            if oom is not None:
                # Redis is full (noeviction): backpressure, like the hwm; nothing is lost.
                self.note_oom(oom)
                wait.start()
                stored = False
                self.wait_for_room()
                continue
            leases = []
            if ref is not None:
                stored = True
                self.pending_ref = ref
            reply = request.parse(replies[-1])
            if reply.status == Status.REROUTE and isinstance(frame, ShmFrame):
                # The rank's trainer is not on this host (any more): the frame itself.
                self._transport.rerouted()
                detached = frame.detach()
                return self._push(
                    detached, entry, last=last, produce_ms=produce_ms, built_s=built_s
                )
            pushed = self._after(reply, entry, ref, wait)
            if pushed is not None:
                return pushed
            stored = stored and reply.status != Status.GONE
        return False

    def _note_prefetch(
        self, requests: list[tuple[Call[LeaseReply], str]], raw: list[Any]
    ) -> list[bool]:
        """Keep the leases that rode with a shard's last push, those granted; returns
        which were (a refused one, OOM, is not)."""
        granted = []
        for (call_, token), value in zip(requests, raw, strict=True):
            reply = None if isinstance(value, redis.ResponseError) else call_.parse(value)
            if reply is not None and reply.status == Status.OK:
                self.ahead.leases.append(Lease.from_reply(reply, token, self.plan.shards))
            granted.append(reply is not None and reply.status == Status.OK)
        return granted

    def _build_ahead(self) -> None:
        """Build the next leased shard's first batch (while the last push travels: no
        Redis here). What the pipeline raises is kept for the serving loop."""
        lease = self.ahead.leases[0]
        if lease.skip or self.ahead.ready is not None:  # a resume's shard; built already
            return
        epoch, slot = divmod(lease.g, lease.slots)
        shard = lease.shard if lease.shard is not None else shard_of_slot(slot, self.plan.shards)
        started = time.perf_counter()
        batches = iter(self.plan.iter_shard_marked(epoch, shard))
        step: tuple[Any, bool] | None = None
        frame: Any = None
        error: Exception | None = None
        try:
            step = next(batches, None)
            if step is not None:
                frame = self._encode_batch(epoch, slot, 0, *step, rank=slot % lease.world)
        except Exception as e:  # the serving loop reports it, as if raised there
            error = e
        entry = lease_entry(lease.g, lease.token)
        took_s = time.perf_counter() - started
        self.ahead.ready = Ready(entry, batches, step, frame, error, took_s)

    def _after(self, reply: PushReply, entry: str, ref: str | None, wait: Waiting) -> bool | None:
        """What a push's reply means: True pushed, False the shard is no longer ours,
        None try again (after waiting for room where the list was full)."""
        status = reply.status
        if status == Status.OK:
            self.pending_ref = None
            self.ahead.depth = reply.depth  # 1: the trainer had taken everything before
            return True
        if status == Status.FULL:
            # A data-parallel rank's full list: once per HANDBACK_S, maybe hand back.
            blocked = wait.start()
            if blocked and self._pos.world > 1 and wait.hand_back_due() and self._hand_back(entry):
                self._drop_ref(ref)
                return False
            self.wait_for_room()
            return None
        wait.restart()
        if status == Status.GONE:  # the stored frame expired: store it again
            return None
        if status == Status.WRONG_TYPE:
            # A foreign writer replaced a queue key: keep the shard, wait for a repair.
            self.note_wrong_type(reply.key, reply.found)
            self._stop.wait(WAIT_S)
            return None
        self._drop_ref(ref)
        if status == Status.LEASE_LOST:
            log.info("producer %s: lease %s was taken back; dropping it", self.id, entry)
            return False
        self._on_status(status)
        return False

    def _drop_ref(self, ref: str | None) -> None:
        """Delete a frame stored by reference that will never be listed."""
        if ref is not None:
            self.client.delete(ref)
            self.pending_ref = None

    def _hand_back(self, entry: str) -> bool:
        """At a data-parallel rank's full list for HANDBACK_S: hand the shard back (and
        say why) when :func:`producer.serving.blocking.hand_back_reason` finds a reason."""
        why = hand_back_reason(self.client, self.keys, self._rank, self._pos.world)
        if why is None:
            return False
        reply = scripts.handback(
            self.client, self.keys, incarnation=self._pos.incarnation, run=self._pos.run,
            producer=self.id, entry=entry,
        )  # fmt: skip
        if reply.status not in (Status.OK, Status.LEASE_LOST):
            self._on_status(reply.status)
        log.info(
            "producer %s: rank %d's list is full, %s: %s handed back",
            self.id,
            self._rank,
            why,
            entry,
        )
        return True

    def _send(
        self,
        ref: str | None,
        store: Pieces | memoryview | None,
        push: Call[PushReply],
        leases: list[tuple[Call[LeaseReply], str]] | None = None,
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
