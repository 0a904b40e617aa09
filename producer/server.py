"""The producer: lease shards, build their batches, push them under the run's cap.

:class:`Producer` serves one queue (or one stripe of a striped queue); ``start_server``
(:mod:`producer.start`) runs one, or a :class:`producer.striped.StripedProducer`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from batchq.client.connection import (
    Backoff,
    StopEvent,
    call,
    is_wrong_type,
    make_client,
    tune_malloc,
)
from batchq.client.redis_internals import hold, release_hold
from batchq.errors import ConnectionLost, ProtocolError, RunFinished
from batchq.protocol.admin import check_eviction_policy, is_oom
from batchq.protocol.calls import Call, execute_pipeline
from batchq.protocol.keys import QueueKeys, check_name
from batchq.protocol.layout import default_id
from batchq.protocol.producer_scripts import LeaseReply, lease_call
from batchq.protocol.stripes import check_stripes
from batchq.protocol.words import Status
from producer.isolation import isolation_of
from producer.producer_options import check_options, check_stream, is_positive, require
from producer.quarantine import bind_records
from producer.serving.ahead import Ahead, Lease
from producer.serving.frame_push import FramePusher
from producer.serving.frames import INLINE_MAX_BYTES, PushSettings
from producer.serving.heartbeat import FirstPush, Heartbeat
from producer.serving.membership import Membership, RunPosition, axis_labels_json
from producer.serving.pushing import BuildWatch, ShardPusher, reading_of
from producer.serving.sharding import ShardPlan
from producer.serving.transport import Transport

__all__ = ["Producer"]

log = logging.getLogger(__name__)


class Producer:
    """Serves one stream into one queue.

    Args:
        stream: a DataStream or transformer chain (Fuel's API).
        url: the Redis URL (see :func:`batchq.client.connection.resolve_url`).
        queue: the queue's name.
        hwm: the most elements the queue's data list may hold.
        producer_id: this producer's id (default: host-pid-random).
        window: the lease window: how many shards past the trainer's oldest incomplete
            shard the run mints (default 2 x hwm).
        requests_per_shard: how many consecutive requests make a shard (default: the
            smallest exact cut of the pipeline, see :mod:`producer.serving.sharding`).
        heartbeat_ttl_s: a producer silent for this long is declared dead.
        inline_max_bytes: frames larger than this travel by reference.
        max_frame_bytes: refuse to push a batch larger than this.
        checksum: add a CRC32 of the buffers to every frame.
        reconnect_timeout_s: how long to keep trying when Redis is unreachable.
        max_attempts: a shard whose pipeline raised this many times (on any producer)
            is reported to the trainer as ProducerFailed; before that it is retried.
        orphan_wait_s: after Redis lost the queue's state, how long to wait for the
            trainer to re-create the run from its ledger before starting afresh.
        orphan_exit_s: stop serving (``serve`` returns 0, logged) once no trainer has
            held a live claim on the run for this long (a crashed trainer); None: never.
        transport: 'auto' (shared memory while the run's trainer is on this host) or
            'redis' (never); None reads ``BATCHQ_TRANSPORT``, else 'auto'.
        shm_dir: the shared-memory folder (default /dev/shm).
        shm_segments: the most shared-memory segments this producer holds at once
            (one frame each; default: what the run can hold of its frames, ranks x
            (hwm + the trainer's reader prefetch + 2) + 2, see
            :mod:`producer.serving.transport`).
        shm_max_bytes: the most bytes of segments it holds at once (default: only
            the folder's own size limits it).
        stripe: (k, N): serve stripe k of the queue striped N ways (one lane of a
            :class:`producer.striped.StripedProducer`, which
            :func:`start_server` makes for ``stripes=N``); (0, 1): the queue itself.
        shard_plan: the plan, where the caller made it already (a striped producer's
            lanes share one; a forked worker's pool made it before the fork).
        build_timeout_s: the longest a batch's build may take (None: no limit); past it
            the attempt counts as failed (the trainer gets ProducerFailed naming the
            example after max_attempts) and :meth:`serve` raises BuildTimeout (see
            :class:`producer.serving.pushing.BuildWatch`); it also bounds each example's read in
            a shard built isolated (:mod:`producer.isolation`).
        started_at: when this producer started (wall clock, s), the zero of its
            ``first_push_s`` in ``batchq status``; None: its process's start.
        job_started_s: when the job this producer serves started (wall clock, s): a run
            that finished after it is this job's (the producer exits 0 at its join), one
            finished before it an earlier job's (its join starts the queue's next run).
            None: this object's construction (a process may serve one job after
            another). ``batchq serve`` passes its process's start, a pool's workers the
            pool's.
    """

    def __init__(
        self,
        stream: Any,
        url: str,
        queue: str = "default",
        hwm: int = 10,
        *,
        producer_id: str | None = None,
        window: int | None = None,
        requests_per_shard: int | None = None,
        heartbeat_ttl_s: float = 10.0,
        inline_max_bytes: int = INLINE_MAX_BYTES,
        max_frame_bytes: int | None = None,
        checksum: bool = False,
        reconnect_timeout_s: float = 60.0,
        max_attempts: int = 3,
        orphan_wait_s: float = 30.0,
        orphan_exit_s: float | None = 600.0,
        transport: str | None = None,
        shm_dir: str | None = None,
        shm_segments: int | None = None,
        shm_max_bytes: int | None = None,
        stripe: tuple[int, int] = (0, 1),
        shard_plan: ShardPlan | None = None,
        build_timeout_s: float | None = None,
        started_at: float | None = None,
        job_started_s: float | None = None,
    ) -> None:
        made_s = time.time()  # before the plan's probe batch: the job's start by default
        check_stream(stream)
        check_options(hwm, window, heartbeat_ttl_s, max_attempts, orphan_exit_s)
        require(
            build_timeout_s is None or is_positive(build_timeout_s), "build_timeout_s",
            build_timeout_s, "seconds > 0, or None",
        )  # fmt: skip
        require(
            is_positive(reconnect_timeout_s), "reconnect_timeout_s", reconnect_timeout_s,
            "seconds > 0",
        )  # fmt: skip
        k, stripes = stripe
        require(0 <= k < check_stripes(stripes), "stripe", stripe, f"0..{stripes - 1}")
        self.stream = stream
        self.url = url
        self.keys = QueueKeys(queue).stripe(k, stripes)
        self.id = check_name(producer_id or default_id(), "producer id")
        self.reconnect_timeout_s = reconnect_timeout_s
        self.orphan_exit_s = orphan_exit_s
        self.plan = shard_plan or ShardPlan(stream, requests_per_shard)
        self.sources = tuple(stream.sources)
        self.settings = PushSettings(
            self.keys, self.id, self.sources, checksum, max_frame_bytes, inline_max_bytes,
            int(heartbeat_ttl_s * 1000), max_attempts, k, stripes,
        )  # fmt: skip
        self.client = make_client(url, key=self.keys.meta)
        self._stop = StopEvent()  # a signal handler sets it (stop())
        # The run served, replaced by each _join; it carries the run's cap (hwm), which
        # each join asks for, from the first on.
        self._pos = RunPosition(list_cap=hwm)
        self._lease_seq = 0
        self.first_push = FirstPush(started_at)
        self._membership = Membership(
            self.client, self.keys, self.id, self.plan, lease_window=window or 2 * hwm,
            heartbeat_ttl_ms=self.settings.heartbeat_ttl_ms, orphan_wait_s=orphan_wait_s,
            axis_labels=axis_labels_json(stream), stop=self._stop, stripes=stripes,
            started_s=made_s if job_started_s is None else job_started_s,
        )  # fmt: skip
        self._beat = Heartbeat(
            url, self.keys, self.id, self.settings.heartbeat_ttl_ms, self._pos, self._stop,
            orphan_exit_s, self.first_push,
        )  # fmt: skip
        self._finished = False
        self._transport = Transport(
            transport, shm_dir, self.keys, self.id, shm_segments, shm_max_bytes
        )
        # Leased with the last pushes, and the next shard built ahead.
        self._ahead = Ahead(k, stripes)
        # Each frame's capped push, and each leased shard's batches built and pushed.
        self._pusher = FramePusher(
            self.settings, self.client, self._transport, self._pos, self._stop,
            self._lease_request, self._ahead, self.plan.shards, self.first_push,
        )  # fmt: skip
        self._shards = ShardPusher(self._pusher, self.plan, self._transport, self._ahead)
        # Examples replaced by substitutes (on_sample_error='quarantine') go to the run.
        self._records = bind_records(
            stream, url, self.keys, self.id, lambda: (self._pos.incarnation, self._pos.run)
        )
        if self._records is not None:  # and those other producers met are learnt
            self._beat.on_beat = self._records.learn
        if build_timeout_s is not None:
            self._shards.watch = BuildWatch(build_timeout_s, reading_of(stream))
        # A shard that failed before is built isolated (producer.isolation), where the
        # stream's root can: each example read in a forked child first.
        self._isolate = isolation_of(stream)
        self._build_timeout_s = build_timeout_s

    @property
    def orphaned(self) -> bool:
        """Whether serve() stopped because no trainer claimed the run (orphan_exit_s)."""
        return self._beat.orphaned

    @property
    def oom_waits(self) -> int:
        """Pushes and leases refused by Redis at maxmemory (waited out, nothing lost)."""
        return self._pusher.oom_waits

    # -- lifecycle ---------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the serving loop to stop after the current step (thread- and signal-safe)."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        """Whether serving stops (asked to, orphaned, or the run finished)."""
        return self._stop.is_set()

    def serve(self) -> int:
        """Serve until the run finishes (returns 0) or :meth:`stop` is called (returns 0).

        Raises:
            PipelineMismatch: the run was created by a different pipeline.
            ConnectionLost: Redis could not be reached.
        """
        tune_malloc()
        finished = False
        try:
            self.begin()
            while not self._stop.is_set():
                self.step()
        except RunFinished as e:
            log.info("producer %s: %s", self.id, e)
            finished = True
        finally:
            self.end(finished)
        return 0

    def begin(self) -> None:
        """Join the queue's run and start the heartbeat (the calling thread serves).

        Redis not answering yet (a producer started before it, a pool's replacement
        during an outage) is waited for as a drop mid-run is: up to
        ``reconnect_timeout_s``, logged.

        Raises:
            ConnectionLost: Redis stayed unreachable for reconnect_timeout_s.
        """
        hold(self.client)  # this thread pushes: one connection, no pool per batch
        try:
            check_eviction_policy(self.client)
            self._join()
        except ConnectionLost as e:
            self._reconnect(e)  # joins once Redis answers
        if not self._stop.is_set():
            self._beat.start()

    def end(self, finished: bool) -> None:
        """Stop serving: leases handed back, segments freed (all of them once the run
        ``finished``), the heartbeat stopped, the client closed."""
        self._finished = self._finished or finished
        self._stop.set()
        self._leave()

    @property
    def groups(self) -> int:
        """The run's group slots as this producer last read them (0: one group)."""
        return self._pos.groups

    def step(self, wait: bool = True, groups: int = 0) -> bool:
        """Lease the next shard and serve it; a connection lost or a queue key of a
        foreign type is waited out here. Returns whether a shard was served.

        Args:
            wait: when the run has nothing to lease (the lease window or the list is full),
                wait for a trainer's wake (bounded) before returning; False returns at
                once (a striped producer tries its next stripe).
            groups: lease only once the run has this many group slots (read again
                while it has fewer: a striped queue's stripe k waits for the groups of
                stripe 0, so that a shard is built once for all of them).

        Raises:
            RunFinished: the trainer finished the run.
        """
        try:
            if groups > self._pos.groups:
                known = self._membership.groups()
                if known[0] > self._pos.groups:
                    self._regroup(known)
                if known[0] < groups:
                    return False
            lease = self._lease(wait)
            if lease is not None:
                self._serve(lease)
                return True
        except ConnectionLost as e:
            self._reconnect(e)
        except redis.ResponseError as e:
            # A foreign writer replaced a queue key the lease or join reads: keep
            # serving once it is repaired (nothing was leased by the failed call).
            if not is_wrong_type(e):
                raise
            self._pusher.note_wrong_type("read by a lease or join", f"foreign type ({e})")
            self._stop.wait(0.5)
            self._rejoin()
        return False

    def wait_for_room(self) -> None:
        """Wait (bounded) for a trainer's wake: its pop made room in the list or the
        lease window."""
        self._pusher.wait_for_room()

    def watch_others(self, starved: Callable[[], bool]) -> None:
        """A striped producer's lane: a push of this lane blocked at a full list hands
        its shard back (once per HANDBACK_S) when ``starved()`` says another stripe's
        list is empty, so that the one serving thread goes on to that stripe."""
        self._pusher.starved = starved

    def list_empty(self) -> bool:
        """Whether one of this stripe's data lists (of the run it serves) is empty: a
        trainer may be waiting there. A lost connection says no (one pipeline)."""
        world = max(self._pos.world, 1)
        names = [self.keys.data_of(r, world) for r in range(world)]

        def build(pipe: Any) -> None:
            for name in names:
                pipe.llen(name)

        try:
            lengths = call(lambda: execute_pipeline(self.client, build), "reading the lists")
        except ConnectionLost:
            return False
        return any(int(n) == 0 for n in lengths)

    def _serve(self, lease: Lease) -> None:
        """Build and push the shard of ``lease``, then act on a reply that was ours."""
        epoch, slot, shard = lease.address(self.plan.shards)
        self._pusher.aim(slot % lease.world, lease.world, lease.mask)
        self._shards.params.follow(self.client, lease.params)  # read again if it changed
        g = epoch * lease.slots + slot  # the plan's: a stripe's lease names the stripe's
        if self._isolate is not None:  # isolated: each read bounded there, no watch
            self._shards.isolated = self._isolate(lease.attempts > 0, self._build_timeout_s)
        status = self._shards.serve_shard(epoch, shard, lease.entry, lease.skip, slot=slot, g=g)
        watch = self._shards.watch
        if watch is not None and watch.hung is not None:
            # Counted as a failed attempt already; the build still runs: stop serving.
            log.error("producer %s: %s; stopping", self.id, watch.hung)
            raise watch.hung
        if status is not None:
            self._handle_status(status)

    def _reconnect(self, error: ConnectionLost) -> None:
        """Wait for Redis to come back (bounded backoff), then join the run again.

        Raises:
            ConnectionLost: Redis stayed unreachable for reconnect_timeout_s.
        """
        backoff = Backoff(self.reconnect_timeout_s, self._stop.wait)
        log.warning("producer %s: %s; reconnecting", self.id, error)
        while not self._stop.is_set():
            try:
                # AuthFailed and RedisConfigError are not retried: they propagate.
                call(self.client.ping, "reconnecting", self.client)
                self._join()
                log.warning("producer %s: reconnected", self.id)
                return
            except ConnectionLost as e:
                if not backoff.pause():
                    raise ConnectionLost(
                        f"producer {self.id}: Redis unreachable for "
                        f"{self.reconnect_timeout_s:g} s: {e}"
                    ) from e
                log.warning("producer %s: still no Redis (%s); retrying", self.id, e)

    def _rejoin(self) -> None:
        """Join again after a foreign type broke a call mid-shard: join.lua hands this
        producer's leases back to the work list, so no shard stays held by nobody."""
        try:
            self._join()
        except redis.ResponseError as e:
            if not is_wrong_type(e):
                raise
            # Still broken: the next lease fails the same way and brings us back here.

    def _join(self) -> None:
        """Join the queue's run (:class:`producer.serving.membership.Membership`); the
        pusher, the heartbeat and the transport follow the position it gives."""
        position = self._membership.join(self._pos)
        if position is None:  # stopped while waiting for a lost run's trainer
            return
        self._pos = position
        self._lease_seq = 0
        self._shards.joined(position)  # leases of the run we left are gone, what was built too
        self._beat.follow(position)
        self._transport.joined(self.client, position)

    def _regroup(self, known: tuple[int, tuple[int, ...]] | None = None) -> None:
        """The run is read by (more) groups than this producer knew: lease and push with
        the keys of every group from now on (the same run: leases held stay ours).

        Args:
            known: the group slots and each slot's world as just read (None: read them).
        """
        # Read together: n and each slot's world.
        groups, worlds = known if known is not None else self._membership.groups()
        position = dataclasses.replace(self._pos, groups=groups, worlds=worlds)
        log.info("producer %s: the run is read by %d group(s)", self.id, groups)
        self._pos = position
        self._pusher.follow(position)
        self._beat.follow(position)
        self._transport.regrouped(self.client, position)

    def _leave(self) -> None:
        self._membership.leave(self._pos.incarnation, self._pusher.pending_ref)
        self._ahead.drop()  # a frame built ahead: its segment is free again
        self._transport.close(self._finished)
        self._beat.join(timeout_s=5)
        if self._records is not None:
            self._records.close()
        release_hold(self.client)
        self.client.close()

    # -- leasing -----------------------------------------------------------------------

    def _lease_request(
        self, leases_ahead: int = 0, after: str = ""
    ) -> tuple[Call[LeaseReply], str]:
        """The next lease request, and its token: a plain one, or riding behind the last
        push of lease ``after``, asking to hold ``leases_ahead`` leases (lease.lua's
        ``prefetch``; see :func:`batchq.protocol.producer_scripts.lease_call`)."""
        self._lease_seq += 1
        token = f"{self.id}.{self._lease_seq}"
        pos = self._pos
        request = lease_call(
            self.keys, incarnation=pos.incarnation, run=pos.run, producer=self.id,
            token=token, heartbeat_ttl_ms=self.settings.heartbeat_ttl_ms, prefetch=leases_ahead,
            groups=pos.groups, world=pos.slot_worlds(), after=after,
        )  # fmt: skip
        return request, token

    def _lease(self, wait: bool = True) -> Lease | None:
        """Lease the next shard, or None (``wait``: after waiting for room when the run
        had none)."""
        if self._ahead.leases:
            # Leased in the same round trip as an earlier shard's last push.
            return self._ahead.leases.popleft()
        request, token = self._lease_request()
        try:
            reply = request.run(self.client)
        except redis.ResponseError as e:
            if not is_oom(e):
                raise
            self._pusher.note_oom(e)
            self._lease_seq -= 1
            self._pusher.wait_for_room()
            return None
        except ConnectionLost as e:
            # The same token makes a retried lease idempotent.
            log.warning("producer %s: lease failed (%s); retrying", self.id, e)
            self._lease_seq -= 1
            self._stop.wait(0.5)
            return None
        status = reply.status
        if status == Status.OK:
            stripe = self.settings.stripe, self.settings.stripes
            return Lease.from_reply(reply, token, self.plan.shards, self._pos.run, *stripe)
        if status == Status.WAIT:
            # In a run of several groups, the pops of the group that holds the shared
            # stream make room: wait for those (woken by another's would be in vain).
            if wait:
                self._pusher.wait_for_room(reply.slot)
            return None
        if status == Status.GROUPS:
            self._lease_seq -= 1  # nothing was leased with it
            self._regroup()
            return None
        self._handle_status(status)
        return None

    def _handle_status(self, status: str) -> None:
        """A reply that is the producer's business: the run finished (stop), changed or
        was lost, or the producer was reaped (join again); anything else is a bug."""
        if status == Status.FINISHED:
            raise RunFinished(f"queue {self.keys.queue}: the trainer finished the run")
        if status in (Status.RUN_CHANGED, Status.REAPED, Status.STATE_LOST):
            log.info("producer %s: %s; joining again", self.id, status)
            self._join()
            return
        raise ProtocolError(f"producer {self.id}: unexpected reply {status!r}")
