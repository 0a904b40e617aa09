"""The trainer's prefetching reader: a thread that pops, fetches and decodes frames.

While the caller trains on one batch, this thread pops the next frames (up to the
trainer's hwm, more only when the next batch in order is still missing), resolves them
(:mod:`consumer.reader.fetch`: frames stored by reference fetched, shared memory mapped),
decodes and files them (:mod:`consumer.reader.filing`). It also keeps the trainer's
claim alive, publishes the trainer's floor (the look-ahead window's base) and notices
when no producer is left (:mod:`consumer.reader.repair`).

The thread talks to the iterator through one channel, the buffer
(:class:`consumer.reader.buffer.Buffer`, seen through its reader side,
:class:`consumer.plan.ReaderBuffer`): frames go in with ``put``, the error that stops
the thread is handed over as a value (``fail``), and everything the thread reads of the
ledger it reads through the buffer's methods. It knows the run through a
:class:`consumer.plan.RunView` (the trainer's session, shared with the
stream) and changes it only through its methods (refresh, and after Redis lost the
queue: reclaim and resume).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from batchq.client.connection import is_wrong_type, reconnect
from batchq.client.redis_internals import hold, release_hold
from batchq.errors import BatchQueueError, ConnectionLost, StateLost
from batchq.protocol import trainer_scripts
from batchq.protocol.admin import is_oom
from batchq.protocol.calls import round_trip
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.trainer_scripts import PopReply
from batchq.protocol.words import Status, as_int, status_error
from batchq.wire import codec
from consumer.plan import BLOCK_S, ReaderBuffer, RunView
from consumer.reader.fetch import Fetched, Fetcher
from consumer.reader.filing import DeadList, Filer, FrameScreen
from consumer.reader.ledger import global_pairs
from consumer.reader.repair import KeyGuard, StallRepair
from consumer.reader.shm_frames import TrainerShm
from consumer.reader.stats import Accounting, TrainerStats
from consumer.stream_options import ReaderSettings

__all__ = ["QUICK_S", "Reader", "Readers"]

log = logging.getLogger(__name__)

# A trainer that keeps up gets its frames one by one by BRPOP, each right after it was
# pushed. It then skips the pop script (about half its CPU per frame and a third of
# Redis') while the list stays empty and the last script ran at most this long ago: the
# claim, the accounting and the wakes ride on the next one (docs/design.md, "The
# trainer").
QUICK_S = 0.05


class Reader(threading.Thread):
    """Pops frames for one trainer into its buffer.

    Args:
        client: a client from :func:`batchq.client.connection.make_client` (owned by the reader).
        keys: the queue's keys.
        session: the trainer's claim on the queue (shared with the stream).
        buffer: where frames go (the ledger behind its lock, shared with the iterator).
        settings: the reader's settings (:class:`ReaderSettings`).
        stats: the trainer's figures, drained into each pop script call.
        shm: the trainer's shared memory (default: none, frames come through Redis).
        prepare: applied to each frame of this run before it is filed (the trainer's
            sources, dtypes and hooks: :class:`consumer.reader.prepare.FramePrep`).
        screen: what frames pass before they are filed (the stream's params log:
            frames built with params since changed are dropped and their shards built
            again, :class:`consumer.params.StreamParams`); None: every frame is filed.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        session: RunView,
        buffer: ReaderBuffer,
        settings: ReaderSettings,
        *,
        stats: TrainerStats | None = None,
        shm: TrainerShm | None = None,
        prepare: Callable[[codec.Frame], codec.Frame] | None = None,
        screen: FrameScreen | None = None,
    ) -> None:
        super().__init__(name=f"batchq-reader-{keys.queue}", daemon=True)
        self.client = client
        self.keys = keys
        self.session = session
        self.buffer = buffer
        self.settings = settings
        self.shm = shm or TrainerShm(keys, "redis", None)
        self._halt = threading.Event()
        self._flush_on_stop = False
        self.guard = KeyGuard(keys.queue, settings.options.timeout_s, self._halt)
        self._accounting = Accounting(stats or TrainerStats())
        self._dead = DeadList(client, keys, settings.options.on_bad_frame)
        self._fetcher = Fetcher(
            client, keys, self.shm.resolve, settings.options.max_frame_bytes, self._dead.record
        )
        self._fetcher.shared = session.grouped
        self._filer = Filer(
            session, buffer, settings, prepare, self._dead, self._accounting, screen
        )
        self._repair = StallRepair(client, keys, session, buffer, settings)
        # The pop loop's own pace.
        self._popped_once = False
        self._published_floor = -1  # the floor the last successful pop sent
        self._quick = False  # the last BRPOP left the list empty: BRPOP-only may follow
        self._last_script = 0.0  # monotonic time of the last pop script
        self._last_claim = time.monotonic()

    @property
    def bad_frames(self) -> int:
        """Bad elements moved to the dead list."""
        return self._dead.count

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
        hold(self.client)  # this thread pops: one connection, no pool per batch
        try:
            while not self._halt.is_set():
                claim_s = self.session.claim_ttl_ms / 3000
                idle, stale = self.buffer.idle(
                    self.settings.options.hwm, self._published_floor, claim_s
                )
                if self._halt.is_set():
                    break
                try:
                    self._step(idle, stale, claim_s)
                except ConnectionLost as e:
                    self._reconnect(e)
                except redis.ResponseError as e:
                    self._refused(e)
                except StateLost as e:
                    self._recover(e)
        except BaseException as e:  # handed to the iterator, which raises it
            log.debug("reader stopped by %r", e)
            self.buffer.fail(e)
        finally:
            if self._flush_on_stop and self.buffer.error is None:
                self.flush()
            release_hold(self.client)
            self.client.close()

    def _step(self, idle: bool, stale: bool, claim_s: float) -> None:
        """One turn of the loop: publish a stale floor, pop, send the figures, or keep the
        claim alive."""
        if stale:
            self._pop_round(room=0)
        elif not idle:
            self._pop_round()
            self.shm.maybe_sweep(self.client)  # gone producers' segments
        elif self._accounting.stats.figures_due():
            self._pop_round(room=0)  # idle: the trainer's progress still shows
        elif time.monotonic() - self._last_claim > claim_s:
            # Every pop refreshes the claim too: refresh only when idle long.
            self.session.refresh(self.client)
            self._last_claim = time.monotonic()

    def _refused(self, error: redis.ResponseError) -> None:
        """Redis refused a call of the loop's: a foreign type or a full Redis is waited
        out; anything else stops the reader."""
        if is_wrong_type(error):
            # A foreign type under a key a reap or requeue script reads: waited out like
            # a replaced data list (bounded).
            self.guard.wrong_type(f"a key of queue {self.keys.queue}", "foreign type")
            return
        # At maxmemory an idle claim refresh is refused; pops still work (they pop
        # before they write) and refresh the claim themselves.
        if not is_oom(error):
            raise error
        log.debug("queue %s: %s", self.keys.queue, error)
        self._last_claim = time.monotonic()

    def _reconnect(self, error: ConnectionLost) -> None:
        """Wait for Redis to answer again: bounded backoff, logged.

        Raises:
            ConnectionLost: no answer for timeout_s.
        """
        log.warning("queue %s: %s; reconnecting", self.keys.queue, error)
        # AuthFailed and RedisConfigError are not retried: they propagate.
        if reconnect(self.client, self.settings.options.timeout_s, self._halt):
            log.warning("queue %s: reconnected", self.keys.queue)

    def _recover(self, error: StateLost) -> None:
        """Redis lost the queue: re-create the run from what this trainer has received.

        The producers (waiting for this) join the new run and build only the shards, or
        the tails of shards, that the republished ledger does not have.
        """
        s = self.session
        log.warning("%s: %s; republishing the ledger", s.what, error)
        s.reclaim(self.client)
        first, pairs = self.buffer.received()
        pairs = global_pairs(pairs, self.settings.layout, s.rank)
        plan = s.plan
        # Not a checkpoint: the ranks are where they are (no step to agree on). A remap
        # names only its epoch's slots: sent again, it is inert once that epoch is past;
        # the slots past it are done for every rank (none is built before its rank is back).
        fingerprint = plan.fingerprint if plan else ""
        pairs = [*s.remap_done, *pairs]
        s.resume(self.client, first, fingerprint, pairs, step=-1, remap=s.remap)
        self.shm.new_run(s.run)
        self.buffer.lost()  # the published shard counts went with the queue
        if s.keys is not self.keys:  # a group registered again, in another slot
            self.keys = self._fetcher.keys = self._dead.keys = self._repair.keys = s.keys

    def flush(self) -> None:
        """Send the accounting not yet sent (at close), popping nothing."""
        try:
            self._pop_round(room=0, last=True)
        except (BatchQueueError, redis.RedisError) as e:
            log.debug("queue %s: last figures not sent: %s", self.keys.queue, e)

    # -- one round: a pop script (or a BRPOP alone), then fetch and file ----------------

    def _pop_round(self, room: int | None = None, *, last: bool = False) -> None:
        """One pop script (or a BRPOP alone, keeping up); ``room`` 0 pops nothing (a stale
        floor published, the figures sent); ``last``: the figures now, at close."""
        if room is None and self._quick and self._quick_ok():
            self._take(self._brpop())
            return
        room, floor = self._room(room)
        reply = self._pop_script(room, floor, force=last)
        if reply is None or room == 0:
            return
        if reply.alive:
            self._repair.producers_alive()
        if reply.elements:
            # Filed first: the reap's CLIENT LIST (due at a reader's first round) waits
            # behind the batch the trainer may be waiting for.
            self._file(self._fetcher.fetch(reply.elements))
            self._repair.reap_closed()
            return
        self._repair.reap_closed()
        self._repair.check()
        self._take(self._brpop())

    def _room(self, room: int | None) -> tuple[int, int]:
        """(how many frames to pop, the floor to publish); ``room`` 0 pops nothing."""
        buffered, floor = self.buffer.fill()
        if room is None:
            room = max(1, self.settings.options.hwm - buffered)
            if not self._popped_once:
                # The first batch as soon as it can be, rather than after fetching and
                # decoding a whole buffer; later pops take all there is room for
                # (fewer round trips per frame).
                room = min(room, 2)
                self._popped_once = True
        return room, floor

    def _pop_script(self, room: int, floor: int, force: bool = False) -> PopReply | None:
        """The pop script: pops up to ``room`` frames, refreshes the claim, publishes the
        floor, sends the accounting. None: a key of the wrong type (waited on)."""
        s = self.session
        # The figures about once a second, whatever the pop: a stale floor's pops come as
        # often as the trainer takes a frame from a full buffer, and forcing them there
        # wrote a history sample per batch (and judged a run on its first samples).
        figures, extra, nbytes = self._accounting.for_pop(force=force)
        reply = trainer_scripts.pop(
            self.client, self.keys, data=s.data_key,
            trainer=self.keys.trainer_of(s.rank, s.world),
            history=self.keys.history_of(s.rank, s.world), incarnation=s.incarnation,
            run=s.run, token=s.token, room=room, floor=floor, claim_ttl_ms=s.claim_ttl_ms,
            extra_popped=extra, nbytes=nbytes, figures=figures, suffix=s.suffix,
        )  # fmt: skip
        self._last_claim = self._last_script = time.monotonic()
        self._quick = False
        if reply.status == Status.WRONG_TYPE:
            self.guard.wrong_type(reply.key, reply.found)
            return None
        self.guard.repaired()
        if reply.status != Status.OK:
            raise status_error(reply.status, s.what)
        self._published_floor = max(self._published_floor, floor)
        self._accounting.depth = reply.depth
        self._saw_groups(reply.groups)
        return reply

    def _saw_groups(self, groups: int) -> None:
        """A pop says the run is read by several groups (others joined since the claim):
        frames stored by reference may be stored once for all of them, so they are read
        and released from here (never GETDELed), and the session finishes through the
        group scripts."""
        if groups and not self._fetcher.shared:
            self._fetcher.shared = True
            self.session.saw_groups(groups)

    def _quick_ok(self) -> bool:
        """May this round be a BRPOP alone? Only while the pop script's work can wait:
        it ran less than QUICK_S ago and the floor moved less than a quarter of the
        producers' window since it was published (a producer at the window's edge then
        still has three quarters of it to build meanwhile)."""
        if time.monotonic() - self._last_script >= QUICK_S:
            return False
        plan = self.session.plan
        step = max(1, (plan.window if plan else 1) // 4)
        return self.buffer.floor() - self._published_floor < step

    def _brpop(self) -> Any:
        """Wait for one frame (BLOCK_S at most); the list's length after it says whether
        the next round may be a BRPOP alone. Returns the element or None."""
        self._quick = False
        try:
            popped, depth, groups = round_trip(
                self.client,
                [
                    ("BRPOP", self.session.data_key, BLOCK_S),
                    ("LLEN", self.session.data_key),
                    ("HGET", self.keys.meta, MetaField.GROUPS),
                ],
                "waiting for data",
            )
        except redis.ResponseError as e:
            if not is_wrong_type(e):
                raise
            return None  # replaced since the pop script looked: its next call says so
        if popped is None:
            return None
        # Read after the pop: a frame stored once for several groups brings the count.
        self._saw_groups(as_int(groups))
        # Only while the list is empty, and was not full before this pop (it held this
        # one frame, below a cap of 2 or more): a producer refused at the hwm waits for
        # the wake that only the pop script sends (it counts the frames popped here).
        plan = self.session.plan
        cap = plan.list_cap if plan and plan.list_cap > 0 else 1
        self._quick = depth == 0 and cap > 1
        return popped[1]

    def _take(self, element: Any) -> None:
        """File a frame popped outside the pop script (counted with the next one)."""
        if element is None:
            return
        self._accounting.extra_popped += 1
        self._file(self._fetcher.fetch([element]))

    def _file(self, fetched: list[Fetched]) -> None:
        decoded = self._filer.decode(fetched)
        if decoded.frames:
            self._repair.frames_arrived()
        self._filer.file(decoded, self.client)
        self._accounting.count_ahead(self.client, self.keys, self.buffer.dropped_ahead)


class Readers:
    """The reader threads of a stream, one per stripe (stripe 0's first), seen as one."""

    def __init__(self, members: list[Reader]) -> None:
        self.members = members

    @property
    def first(self) -> Reader:
        """Stripe 0's reader (the queue's own; a plain queue's only one)."""
        return self.members[0]

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

    def stopped(self) -> bool:
        """Whether no reader runs any more (a stop's join may give up on one)."""
        return not any(reader.is_alive() for reader in self.members)

    @property
    def bad_frames(self) -> int:
        """Bad elements moved to the dead lists, all stripes."""
        return sum(reader.bad_frames for reader in self.members)
