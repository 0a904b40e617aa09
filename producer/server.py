"""The producer: lease shards, build their batches, push them under the hwm.

``start_server(stream, ...)`` is Fuel's ``fuel.server.start_server`` on Redis: it blocks,
serving epoch after epoch, until the trainer finishes the run (then it returns 0) or the
process is asked to stop (SIGINT/SIGTERM: its leases go back to the work list first).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from typing import Any

import redis

from batchq.client import held
from batchq.client.connection import (
    Backoff,
    call,
    is_wrong_type,
    make_client,
    resolve_url,
    tune_malloc,
)
from batchq.errors import (
    BatchQueueError,
    ConfigError,
    ConnectionLost,
    PipelineMismatch,
    ProtocolError,
    RunFinished,
)
from batchq.protocol import scripts
from batchq.protocol.admin import check_eviction_policy, is_oom
from batchq.protocol.calls import Call
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys, check_name
from batchq.protocol.layout import lease_entry
from batchq.protocol.ranks import shard_of_slot
from batchq.protocol.reaper import record_client
from batchq.protocol.replies import JoinReply, LeaseReply, status_error
from batchq.protocol.words import PROTOCOL_VERSION, Status
from producer.serving.heartbeat import Heartbeat
from producer.serving.pushing import INLINE_MAX_BYTES, Lease, PushSettings, RunPosition, ShardPusher
from producer.serving.sharding import ShardPlan
from producer.serving.transport import Transport

__all__ = ["Producer", "start_server"]

log = logging.getLogger(__name__)

# A producer that joins a run finished less than this long ago exits (a late replica of
# the same job); after it, a producer starts the queue's next run.
FINISHED_GRACE_S = 60.0


def _check_options(
    hwm: Any, window: Any, heartbeat_ttl_s: float, max_attempts: Any, orphan_exit_s: float | None
) -> None:
    """Refuse a Producer argument that cannot work, naming it and what was expected.

    Raises:
        ConfigError: the first invalid argument.
    """
    if not isinstance(hwm, int) or hwm < 1:
        raise ConfigError(f"hwm {hwm!r} is not valid: expected an integer >= 1")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ConfigError(f"window {window!r} is not valid: expected an integer >= 1")
    if heartbeat_ttl_s <= 0:
        raise ConfigError(f"heartbeat_ttl_s {heartbeat_ttl_s!r} is not valid: expected > 0")
    if not isinstance(max_attempts, int) or max_attempts < 1:
        raise ConfigError(f"max_attempts {max_attempts!r} is not valid: expected >= 1")
    if orphan_exit_s is not None and orphan_exit_s <= 0:
        raise ConfigError(f"orphan_exit_s {orphan_exit_s!r} is not valid: expected > 0")


def _default_producer_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return f"{host[:40] or 'host'}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Producer:
    """Serves one stream into one queue.

    Args:
        stream: a DataStream or transformer chain (Fuel's API).
        url: the Redis URL (see :func:`batchq.client.connection.resolve_url`).
        queue: the queue's name.
        hwm: the most elements the queue's data list may hold.
        producer_id: this producer's id (default: host-pid-random).
        window: look-ahead in shards past the trainer's oldest incomplete shard
            (default 2 x hwm).
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
            (hwm + the trainer's look-ahead + 2) + 1, see :mod:`producer.serving.transport`).
        shm_max_bytes: the most bytes of segments it holds at once (default: only
            the folder's own size limits it).
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
    ) -> None:
        _check_options(hwm, window, heartbeat_ttl_s, max_attempts, orphan_exit_s)
        self.stream = stream
        self.url = url
        self.keys = QueueKeys(queue)
        self.hwm = hwm
        self.window = window or 2 * hwm
        self.id = check_name(producer_id or _default_producer_id(), "producer id")
        self.heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self.inline_max_bytes = inline_max_bytes
        self.max_frame_bytes = max_frame_bytes
        self.checksum = checksum
        self.reconnect_timeout_s = reconnect_timeout_s
        self.max_attempts = max_attempts
        self.orphan_wait_s = orphan_wait_s
        self.orphan_exit_s = orphan_exit_s
        self.plan = ShardPlan(stream, requests_per_shard)
        self.sources = tuple(stream.sources)
        self._axis_labels = _axis_labels_json(stream)  # for the trainer's axis_labels
        self.client = make_client(url)
        self._stop = threading.Event()
        self._pos = RunPosition()  # the run served: only _join writes it
        self._lease_seq = 0
        self._beat = Heartbeat(
            url, self.keys, self.id, self.heartbeat_ttl_ms, self._pos, self._stop, orphan_exit_s
        )
        self._record_id = True  # False once the server refused CLIENT ID (ACL)
        self._finished = False
        self._transport = Transport(
            transport, shm_dir, self.keys, self.id, shm_segments, shm_max_bytes, hwm=hwm
        )
        settings = PushSettings(
            self.keys, self.id, self.sources, checksum, max_frame_bytes, inline_max_bytes,
            self.heartbeat_ttl_ms, max_attempts,
        )  # fmt: skip
        self._pusher = ShardPusher(
            settings, self.client, self.plan, self._transport, self._pos, self._stop,
            self._lease_request, self._handle_status,
        )  # fmt: skip

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

    def serve(self) -> int:
        """Serve until the run finishes (returns 0) or :meth:`stop` is called (returns 0).

        Raises:
            PipelineMismatch: the run was created by a different pipeline.
            ConnectionLost: Redis could not be reached.
        """
        tune_malloc()
        held.hold(self.client)  # this thread pushes: one connection, no pool per batch
        check_eviction_policy(self.client)
        try:
            self._join()
            self._beat.start()
            while not self._stop.is_set():
                try:
                    lease = self._lease()
                    if lease is None:
                        continue
                    epoch, slot = divmod(lease.g, lease.slots)
                    self._pusher.aim(slot % lease.world, lease.world)
                    self._pusher.serve_shard(
                        epoch,
                        lease.shard
                        if lease.shard is not None
                        else shard_of_slot(slot, self.plan.shards),
                        lease_entry(lease.g, lease.token),
                        lease.skip,
                        slot=slot,
                    )
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
        except RunFinished as e:
            log.info("producer %s: %s", self.id, e)
            self._finished = True
        finally:
            self._stop.set()
            self._leave()
        return 0

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
        # After Redis lost the queue's state the trainer re-creates the run from its
        # ledger: a producer that had joined before waits for that (bounded) instead of
        # creating a fresh run that would re-plan from scratch.
        deadline = time.monotonic() + (self.orphan_wait_s if self._pos.incarnation else 0.0)
        while True:
            wait = time.monotonic() < deadline
            reply = self._join_once(no_create=wait)
            if reply.status != Status.WAIT:
                break
            if self._stop.wait(0.25):
                return
        if reply.status == Status.FINISHED:
            raise RunFinished(f"queue {self.keys.queue}: the run finished moments ago")
        if reply.status == Status.MISMATCH:
            got = self.plan.fingerprint if reply.what == "fingerprint" else str(self.hwm)
            raise PipelineMismatch(reply.what, reply.expected, got)
        if reply.status != Status.OK:
            raise status_error(reply.status, f"producer {self.id} joining")
        self._pos.incarnation, self._pos.run = reply.incarnation, reply.run
        self._pos.world = reply.world
        if self._record_id:
            # Redis tells a killed producer by its closed connection (batchq.protocol.reaper).
            self._record_id = record_client(self.client, self.keys, self.id)
        if self._axis_labels is not None:
            try:  # a convenience for the trainer (ServerDataStream.axis_labels): best effort
                self.client.hset(self.keys.meta, MetaField.AXIS_LABELS, self._axis_labels)
            except redis.RedisError as e:
                log.debug("producer %s: axis labels not published: %s", self.id, e)
        self._lease_seq = 0
        self._pusher.ahead.drop()  # leases of the run we left are gone, and what was built
        self._transport.joined(self.client, self._pos.run, self._pos.world)
        log.info(
            "producer %s joined queue %s (run %s, S=%d, hwm=%s)",
            self.id,
            self.keys.queue,
            self._pos.run,
            self.plan.shards,
            reply.hwm,
        )

    def _join_once(self, *, no_create: bool) -> JoinReply:
        return scripts.join(
            self.client,
            self.keys,
            producer=self.id,
            fingerprint=self.plan.fingerprint,
            hwm=self.hwm,
            shards=self.plan.shards,
            window=self.window,
            new_run=uuid.uuid4().hex[:16],
            new_incarnation=uuid.uuid4().hex,
            heartbeat_ttl_ms=self.heartbeat_ttl_ms,
            version=PROTOCOL_VERSION,
            epoch_batches=self.plan.epoch_batches,
            served=self._pos.run,
            grace_ms=int(FINISHED_GRACE_S * 1000),
            no_create=no_create,
        )

    def _leave(self) -> None:
        try:
            if self._pusher.pending_ref:
                self.client.delete(self._pusher.pending_ref)
            scripts.reap(
                self.client, self.keys, incarnation=self._pos.incarnation, why="leave",
                producers=[self.id],
            )  # fmt: skip
            self.client.hdel(self.keys.clients, self.id, f"{self.id}:hb")
        except (redis.RedisError, OSError, BatchQueueError) as e:
            log.warning("producer %s: could not hand back its leases: %s", self.id, e)
        self._pusher.ahead.drop()  # a frame built ahead: its segment is free again
        self._transport.close(self._finished)
        self._beat.join(timeout_s=5)
        held.release(self.client)
        self.client.close()

    # -- leasing -----------------------------------------------------------------------

    def _lease_request(self, prefetch: int = 0, after: str = "") -> tuple[Call[LeaseReply], str]:
        """The next lease request, and its token (``prefetch``, ``after``: see
        :func:`batchq.protocol.scripts.lease_call`)."""
        self._lease_seq += 1
        token = f"{self.id}.{self._lease_seq}"
        request = scripts.lease_call(
            self.keys,
            incarnation=self._pos.incarnation,
            run=self._pos.run,
            producer=self.id,
            token=token,
            heartbeat_ttl_ms=self.heartbeat_ttl_ms,
            prefetch=prefetch,
            world=self._pos.world,
            after=after,
        )
        return request, token

    def _lease(self) -> Lease | None:
        """Lease the next shard, or None."""
        if self._pusher.ahead.leases:
            # Leased in the same round trip as an earlier shard's last push.
            return self._pusher.ahead.leases.popleft()
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
            return Lease.from_reply(reply, token, self.plan.shards)
        if status == Status.WAIT:
            self._pusher.wait_for_room()
            return None
        self._handle_status(status)
        return None

    def _handle_status(self, status: str) -> None:
        if status == Status.FINISHED:
            raise RunFinished(f"queue {self.keys.queue}: the trainer finished the run")
        if status in (Status.RUN_CHANGED, Status.REAPED, Status.STATE_LOST):
            log.info("producer %s: %s; joining again", self.id, status)
            self._join()
            return
        raise ProtocolError(f"producer {self.id}: unexpected reply {status!r}")


def start_server(
    data_stream: Any,
    port: int | None = None,
    hwm: int = 10,
    *,
    host: str | None = None,
    queue: str = "default",
    url: str | None = None,
    handle_signals: bool = True,
    **options: Any,
) -> int:
    """Serve ``data_stream`` into a Redis queue, epoch after epoch (Fuel's start_server).

    Args:
        data_stream: the stream to serve.
        port: Redis port (default 6379; see the connection order in the README).
        hwm: the most elements the queue may hold (the run's cap).
        host: Redis host (default localhost).
        queue: the queue's name.
        url: a redis:// or rediss:// URL; wins over host/port.
        handle_signals: stop cleanly on SIGINT/SIGTERM (main thread only).
        **options: passed to :class:`Producer` (window, requests_per_shard, ...).

    Returns:
        0 once the trainer finished the run or a stop was requested.
    """
    producer = Producer(data_stream, resolve_url(url, host, port), queue, hwm, **options)
    installed: dict[signal.Signals, Any] = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            installed[sig] = signal.signal(sig, lambda *_: producer.stop())
    try:
        return producer.serve()
    finally:
        for sig, handler in installed.items():
            signal.signal(sig, handler)


def _axis_labels_json(stream: Any) -> str | None:
    """The stream's axis labels as the trainer reads them from meta: JSON source ->
    list of axis names (or null), or None when the stream has none."""
    labels = getattr(stream, "axis_labels", None)
    if not labels:
        return None
    return json.dumps(
        {str(s): None if v is None else [str(a) for a in v] for s, v in dict(labels).items()}
    )
