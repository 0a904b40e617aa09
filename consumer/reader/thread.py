"""The trainer's prefetching reader: a thread that pops, fetches and decodes frames.

While the caller trains on one batch, this thread pops the next frames (up to the
trainer's hwm, more only when the next batch in order is still missing), resolves them
(:mod:`consumer.reader.fetch`: frames stored by reference fetched, shared memory mapped),
decodes them (zero-copy) and files them in the ledger. It also keeps the trainer's
claim alive, publishes the trainer's floor (the look-ahead window's base) and notices
when no producer is left.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import redis

from batchq.client import held
from batchq.client.connection import is_wrong_type, reconnect, redis_errors
from batchq.errors import (
    BatchQueueError,
    ConnectionLost,
    FrameError,
    ProducersLost,
    StateLost,
)
from batchq.protocol import scripts
from batchq.protocol.admin import is_oom
from batchq.protocol.calls import round_trip
from batchq.protocol.fields import dead_field
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import DEAD_CAP, ledger_field, parse_ledger_field
from batchq.protocol.ranks import RankLayout
from batchq.protocol.reaper import reap_dead, requeue_gaps
from batchq.protocol.replies import status_error
from batchq.protocol.words import Status
from batchq.wire import codec
from consumer.reader.buffer import Buffer
from consumer.reader.fetch import Fetched, Fetcher
from consumer.reader.guards import ReaderGuards
from consumer.reader.shm_frames import TrainerShm
from consumer.session import Session
from consumer.stats import TrainerStats

__all__ = ["Reader"]

log = logging.getLogger(__name__)

# When the list is empty the reader blocks on BRPOP this long at most, so that the claim
# is refreshed and a lost producer is noticed; well below the socket timeout.
BLOCK_S = 0.2
# A trainer that keeps up gets its frames one by one by BRPOP, each right after it was
# pushed. It then skips the pop script (about half its CPU per frame and a third of
# Redis') while the list stays empty and the last script ran at most this long ago: the
# claim, the accounting and the wakes ride on the next one (docs/design.md, "The
# trainer").
QUICK_S = 0.05


class Reader(ReaderGuards, threading.Thread):
    """Pops frames for one trainer into a :class:`Ledger`.

    Args:
        client: a client from :func:`batchq.client.connection.make_client` (owned by the reader).
        keys: the queue's keys.
        session: the trainer's claim on the queue (shared with the stream).
        buffer: where frames go (the ledger behind its lock, shared with the iterator).
        hwm: the trainer's prefetch bound (frames held but not handed out).
        timeout_s: raise ProducersLost after this long with no producer alive.
        writable: writable arrays: frames stored by reference are received into buffers
            of their own (no copy); frames inside the list are copied once.
        max_frame_bytes: frames above this go to the dead list without being decoded.
        on_bad_frame: 'raise' (the iterator raises FrameError) or 'skip'.
        stall_s: after this long without a frame while the trainer waits, reap dead
            producers and hand shards with a gap back to the work list.
        stats: the trainer's figures, drained into each pop script call.
        prepare: applied to each frame of this run before it is filed (the trainer's
            sources, dtypes and hooks: :class:`consumer.reader.prepare.FramePrep`).
        layout: a data-parallel job's split (world > 1): the ledger holds this rank's
            local shards.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        session: Session,
        buffer: Buffer,
        *,
        hwm: int,
        timeout_s: float,
        writable: bool = False,
        max_frame_bytes: int | None = None,
        on_bad_frame: str = "raise",
        stall_s: float = 5.0,
        stats: TrainerStats | None = None,
        shm: TrainerShm | None = None,
        prepare: Callable[[codec.Frame], codec.Frame] | None = None,
        layout: RankLayout | None = None,
    ) -> None:
        super().__init__(name=f"batchq-reader-{keys.queue}", daemon=True)
        self.client = client
        self.keys = keys
        self.session = session
        self.buffer = buffer
        # The reader's own reads of the ledger take the buffer's lock; the iterator's
        # side goes through the buffer's methods only.
        self.ledger = buffer.ledger
        self.hwm = hwm
        self.timeout_s = timeout_s
        self.writable = writable
        self.max_frame_bytes = max_frame_bytes
        self.on_bad_frame = on_bad_frame
        self.prepare = prepare
        self.cond = buffer.cond
        self._halt = threading.Event()
        self._flush_on_stop = False
        self._extra_popped = 0
        self._bytes = 0
        self.stats = stats or TrainerStats()
        self._depth = 0
        self._popped_once = False
        self._last_alive = time.monotonic()
        self.bad_frames = 0
        self.stall_s = stall_s
        self._last_frame = time.monotonic()
        self._last_repair = 0.0
        self._last_claim = time.monotonic()
        self._wrong_since: float | None = None  # since when the data list is no list
        self._last_gone = 0.0
        self._no_client_list = False
        self._ahead_counted = 0  # ledger.dropped_ahead already added to the stats
        self._published_floor = -1  # the floor the last successful pop sent
        self._quick = False  # the last BRPOP left the list empty: BRPOP-only may follow
        self._last_script = 0.0  # monotonic time of the last pop script
        self.shm = shm or TrainerShm(keys, "redis", None)
        self._fetcher = Fetcher(client, keys, self.shm, max_frame_bytes, self._dead)
        # Ranks of a data-parallel job read their own list and file their own slots,
        # renumbered as local shards (batchq/protocol/ranks.py).
        self.layout = layout if layout is not None and layout.world > 1 else None

    # -- called by the iterator (other thread) -----------------------------------------

    def stop(self, flush: bool = False) -> None:
        """Ask the thread to stop and wait for it (bounded).

        Args:
            flush: the thread sends the accounting not yet sent before it ends (and
                closes its client): nothing else pops, even if the join gives up.
        """
        self._flush_on_stop = flush
        self._halt.set()
        self.buffer.wake()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=BLOCK_S * 10)

    # -- the thread --------------------------------------------------------------------

    def run(self) -> None:
        held.hold(self.client)  # this thread pops: one connection, no pool per batch
        try:
            while not self._halt.is_set():
                with self.cond:
                    idle = self.ledger.buffered >= self.hwm and not self.ledger.needs_more()
                    # The floor sent with the last pop was read before the frames it
                    # popped were filed: publish the one they advanced it to before
                    # idling, or producers may wait at the window meanwhile.
                    stale = idle and self.ledger.floor() > self._published_floor
                    if idle and not stale:
                        self.cond.wait(timeout=self.session.claim_ttl_ms / 3000)
                if self._halt.is_set():
                    break
                try:
                    if stale:
                        self._pop_round(room=0)
                    elif not idle:
                        self._pop_round()
                        self.shm.maybe_sweep(self.client)  # gone producers' segments
                    elif time.monotonic() - self._last_claim > self.session.claim_ttl_ms / 3000:
                        # Every pop refreshes the claim too: refresh only when idle long.
                        self._refresh_claim()
                except ConnectionLost as e:
                    self._reconnect(e)
                except redis.ResponseError as e:
                    if is_wrong_type(e):
                        # A foreign type under a key a reap or requeue script reads:
                        # waited out like a replaced data list (bounded).
                        self._wrong_type(f"a key of queue {self.keys.queue}", "foreign type")
                        continue
                    # At maxmemory an idle claim refresh is refused; pops still work
                    # (they pop before they write) and refresh the claim themselves.
                    if not is_oom(e):
                        raise
                    log.debug("queue %s: %s", self.keys.queue, e)
                    self._last_claim = time.monotonic()
                except StateLost as e:
                    self._recover(e)
        except BaseException as e:  # handed to the iterator, which raises it
            log.debug("reader stopped by %r", e)
            self.buffer.fail(e)
        finally:
            if self._flush_on_stop and self.buffer.error is None:
                self.flush()
            held.release(self.client)
            self.client.close()

    def _refresh_claim(self) -> None:
        self.session.refresh(self.client)
        self._last_claim = time.monotonic()

    def _reconnect(self, error: ConnectionLost) -> None:
        """Wait for Redis to answer again: bounded backoff, logged.

        Raises:
            ConnectionLost: no answer for timeout_s.
        """
        log.warning("queue %s: %s; reconnecting", self.keys.queue, error)
        # AuthFailed and RedisConfigError are not retried: they propagate.
        if reconnect(self.client, self.timeout_s, self._halt):
            log.warning("queue %s: reconnected", self.keys.queue)

    def _recover(self, error: StateLost) -> None:
        """Redis lost the queue: re-create the run from what this trainer has received.

        The producers (waiting for this) join the new run and build only the shards, or
        the tails of shards, that the republished ledger does not have.
        """
        log.warning("%s: %s; republishing the ledger", self.session.what, error)
        s = self.session
        s.resume_run = ""
        s.acquire(client=self.client, resuming=True)
        if self.layout is not None:
            # Every rank recovers into the same run, named after the new incarnation.
            s.resume_run = hashlib.sha1(f"lost:{s.incarnation}".encode()).hexdigest()[:16]
        with self.cond:
            first = self.ledger.epoch * self.ledger.shards
            pairs = self.global_pairs(self.ledger.received_pairs())
        plan = s.plan
        # Not a checkpoint: the ranks are where they are (no step to agree on).
        s.resume(self.client, first, plan.fingerprint if plan else "", pairs, step=-1)
        self.shm.new_run(self.session.run)

    def global_pairs(self, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Ledger pairs of local shards ('<epoch>:<j>') as Redis names them (slots)."""
        if self.layout is None:
            return pairs
        out = []
        for field, value in pairs:
            epoch, local = parse_ledger_field(field)
            out.append((ledger_field(epoch, self.layout.slot(local, self.session.rank)), value))
        return out

    def flush(self) -> None:
        """Send the accounting not yet sent (at close), popping nothing."""
        try:
            self._pop_round(room=0)
        except (BatchQueueError, redis.RedisError) as e:
            log.debug("queue %s: last figures not sent: %s", self.keys.queue, e)

    def _pop_round(self, room: int | None = None) -> None:
        if room is None and self._quick and self._quick_ok():
            self._take(self._brpop())
            return
        with self.cond:
            if room is None:
                room = max(1, self.hwm - self.ledger.buffered)
                if not self._popped_once:
                    # The first batch as soon as it can be, rather than after fetching and
                    # decoding a whole buffer; later pops take all there is room for
                    # (fewer round trips per frame).
                    room = min(room, 2)
                    self._popped_once = True
            floor = self.ledger.floor()
        s = self.session
        figures = self.stats.drain(self._depth, force=room == 0)
        extra, nbytes = self._extra_popped, self._bytes
        # Counted as sent before the call: if its reply is lost the script may have run,
        # and sending them again would count them twice (an undercount is the lesser harm).
        self._extra_popped = self._bytes = 0
        reply = scripts.pop(
            self.client, self.keys, data=s.data_key,
            trainer=self.keys.trainer_of(s.rank, s.world),
            history=self.keys.history_of(s.rank, s.world), incarnation=s.incarnation,
            run=s.run, token=s.token, room=room, floor=floor, claim_ttl_ms=s.claim_ttl_ms,
            extra_popped=extra, nbytes=nbytes, figures=figures, suffix=s.suffix,
        )  # fmt: skip
        self._last_claim = self._last_script = time.monotonic()
        self._quick = False
        if reply.status == Status.WRONG_TYPE:
            self._wrong_type(reply.key, reply.found)
            return
        self._wrong_since = None
        if reply.status != Status.OK:
            raise status_error(reply.status, s.what)
        self._published_floor = max(self._published_floor, floor)
        alive, self._depth = reply.alive, reply.depth
        elements: list[Any] = reply.elements
        if room == 0:
            return
        if alive:
            self._last_alive = time.monotonic()
        self._reap_closed()
        if elements:
            self._file(self._fetcher.fetch(elements))
            return
        self._check_producers()
        self._take(self._brpop())

    def _quick_ok(self) -> bool:
        """May this round be a BRPOP alone? Only while the pop script's work can wait:
        it ran less than QUICK_S ago and the floor moved less than a quarter of the
        producers' window since it was published (a producer at the window's edge then
        still has three quarters of it to build meanwhile)."""
        if time.monotonic() - self._last_script >= QUICK_S:
            return False
        plan = self.session.plan
        step = max(1, (plan.window if plan else 1) // 4)
        with self.cond:
            return self.ledger.floor() - self._published_floor < step

    def _brpop(self) -> Any:
        """Wait for one frame (BLOCK_S at most); the list's length after it says whether
        the next round may be a BRPOP alone. Returns the element or None."""
        self._quick = False
        try:
            popped, depth = round_trip(
                self.client,
                [("BRPOP", self.session.data_key, BLOCK_S), ("LLEN", self.session.data_key)],
                "waiting for data",
            )
        except redis.ResponseError as e:
            if not is_wrong_type(e):
                raise
            return None  # replaced since the pop script looked: its next call says so
        if popped is None:
            return None
        # Only while the list is empty, and was not full before this pop (it held this
        # one frame, below a cap of 2 or more): a producer refused at the hwm waits for
        # the wake that only the pop script sends (it counts the frames popped here).
        plan = self.session.plan
        cap = int(plan.hwm) if plan and plan.hwm.isdigit() else 1
        self._quick = depth == 0 and cap > 1
        return popped[1]

    def _take(self, element: Any) -> None:
        """File a frame popped outside the pop script (counted with the next one)."""
        if element is None:
            return
        self._extra_popped += 1
        self._file(self._fetcher.fetch([element]))

    def _check_producers(self) -> None:
        with self.cond:
            waiting = self.buffer.waiting_since is not None
        if not waiting:
            return
        now = time.monotonic()
        if now - self._last_alive > self.timeout_s:
            with self.cond:
                raise ProducersLost(self.ledger.epoch, self.ledger.missing_shards(), self.timeout_s)
        if now - self._last_frame > self.stall_s and now - self._last_repair > self.stall_s:
            self._repair()

    def _repair(self) -> None:
        """After a stall: reap dead producers, then requeue shards nobody will deliver."""
        self._last_repair = time.monotonic()
        reap_dead(self.client, self.keys, self.session.incarnation)
        with self.cond:
            first = self.ledger.floor()
            candidates = self.ledger.incomplete(
                first, self.session.plan.window if self.session.plan else 1
            )
        s = self.session
        if self.layout is None:
            requeue_gaps(self.client, self.keys, s.incarnation, s.run, candidates)
            return
        # A rank asks in global slot numbers, checked against its own counter.
        requeue_gaps(
            self.client,
            self.keys,
            s.incarnation,
            s.run,
            [self.layout.to_global(n, s.rank) for n in candidates],
            rank=(s.data_key, f"next{s.suffix}", candidates),
        )

    def _file(self, fetched: list[Fetched]) -> None:
        frames = []
        stale = 0
        for raw, _element, _key in fetched:
            if raw is None:
                continue
            self._bytes += len(raw)
            # A buffer of its own (memoryview) is made writable in place by prepare.
            copy = self.writable and isinstance(raw, bytes)
            try:
                frame = codec.decode_frame(raw, writable=copy, max_frame_bytes=self.max_frame_bytes)
            except FrameError as e:
                self._dead(bytes(raw[:4096]), e)
                continue
            if frame.run != self.session.run:
                stale += 1  # counted below, under the ledger's lock
                continue
            if self.layout is not None:
                local = self.layout.local(frame.shard, self.session.rank)
                if local is None:
                    where = f"epoch {frame.epoch} slot {frame.shard}"
                    why = f"{where} is not rank {self.session.rank}'s"
                    self._dead(bytes(raw[:4096]), FrameError("impossible", why))
                    continue
                frame = dataclasses.replace(frame, shard=local)
            if self.prepare is not None:
                frame = self.prepare(frame)
            frames.append((frame, raw))
        if frames:
            self._last_frame = time.monotonic()
        for element, reason in self.buffer.put(frames, stale):
            self._dead(element, FrameError("impossible", reason))
        self._count_ahead()

    def _dead(self, element: bytes, error: FrameError) -> None:
        """Move a bad element to the dead list with its reason, count it, apply the policy."""
        self.bad_frames += 1
        record = msgpack.packb(
            {"reason": error.reason, "detail": error.detail, "element": bytes(element[:4096])}
        )
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.lpush(self.keys.dead, record)
            pipe.ltrim(self.keys.dead, 0, DEAD_CAP - 1)
            pipe.hincrby(self.keys.stats, dead_field(error.reason), 1)
            pipe.execute()
        except redis_errors as e:  # the one tuple of connection errors (batchq.client.connection)
            raise ConnectionLost(f"Redis connection lost while recording a bad frame: {e}") from e
        except redis.ResponseError as e:
            # The dead list or the counters replaced by a foreign type (or Redis full):
            # the record is lost, the policy below still applies.
            log.warning("queue %s: could not record a bad frame: %s", self.keys.queue, e)
        log.warning("queue %s: bad frame moved to the dead list: %s", self.keys.queue, error)
        if self.on_bad_frame == "raise":
            raise error
