"""ServerDataStream: the trainer's side, Fuel's ``fuel.streams.ServerDataStream`` on Redis.

Constructing one touches nothing that can be lost: Redis is first asked for anything
when the first epoch iterator is requested (or ``len()`` is called), and nothing is
popped before the first iteration.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

from batchq.client.connection import make_client, resolve_url, retrying, tune_malloc
from batchq.errors import (
    ConfigError,
    ConnectionLost,
    LengthUnknown,
    ProducerFailed,
    ProducersLost,
    StreamStopped,
)
from batchq.protocol.admin import check_eviction_policy
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.ranks import RankLayout
from batchq.wire.codec import Frame, FrameKind
from consumer.balance import Balancer
from consumer.fuel_stream import FuelStreamMixin
from consumer.progress import EpochProgress
from consumer.rank_state import (
    check_rank_state,
    check_state,
    pick_rank_state,
    resume_run_id,
)
from consumer.reader.buffer import Buffer
from consumer.reader.ledger import Ledger
from consumer.reader.prepare import ArrayAccess, FrameHook, FramePrep
from consumer.reader.shm_frames import TrainerShm
from consumer.reader.thread import BLOCK_S, Reader
from consumer.run_start import delete_old_frames, resume_position
from consumer.session import Plan, Session
from consumer.state_keys import (
    EPOCH_KEY,
    RUN_KEY,
    STEP_KEY,
    position_state,
    rank_fields,
    unstarted_state,
)
from consumer.stats import TrainerStats
from consumer.stream_options import check_stream_options

__all__ = ["ServerDataStream"]

log = logging.getLogger(__name__)


class ServerDataStream(FuelStreamMixin):
    """Batches served by producers through a Redis queue, epoch by epoch.

    It is a Fuel stream: ``get_epoch_iterator``, ``get_data``, ``next_epoch``,
    ``reset``, ``sources``, ``produces_examples`` and ``axis_labels``, so trainer-side
    transformers (``ForceFloatX(ServerDataStream(...))``, ``Mapping``, ``Cast``) wrap it;
    and it pickles as Fuel's does: the connection settings and the position
    (:meth:`state_dict`), never a socket or a lock. Unpickled, it resumes there.

    Args:
        sources: the names of the sources, in the order batches are yielded; a subset
            of what the producers serve is fine; a name they do not serve raises
            ConfigError naming those they do. None: the producers' sources, as sent.
        produces_examples: as Fuel's; batchq serves batches, so this is usually False.
        host: Redis host (default localhost; see the connection order in the README).
        port: Redis port (default 6379).
        hwm: how many decoded frames the prefetching reader may hold ahead of the
            caller (the queue's own cap is the run's hwm, set by the producers).
        axis_labels: as Fuel's (source -> axis names); None takes the producers' (see
            :attr:`axis_labels`).
        dtypes: source -> dtype (``{'features': 'float32'}``): what the loop receives is
            guaranteed; other dtypes are cast on the reader thread, with a warning once
            per source.
        queue: the queue's name.
        url: a redis:// or rediss:// URL; wins over host/port.
        timeout_s: raise ProducersLost when no producer has been alive this long while
            waiting for data.
        ordered: yield each epoch in plan order (the order the stream yields
            in-process); False yields in arrival order.
        writable: yield writable arrays instead of read-only views: frames stored by
            reference (over 256 KiB) are received into buffers of their own, which the
            arrays then own (no copy); smaller frames, and frames through shared
            memory (whose segment is then released at once), are copied once.
        claim_ttl_s: the trainer's claim lapses this long after its last heartbeat.
        max_frame_bytes: frames larger than this are refused (dead list).
        on_bad_frame: 'raise' a FrameError for a frame that fails validation, or 'skip'.
        on_producer_error: 'raise' ProducerFailed when a shard's pipeline kept raising
            (after the producers' retries), or 'skip' the rest of that shard and count
            it (``skipped_shards``).
        stall_s: after this long without a frame while waiting, reap dead producers
            and hand shards with a gap back to the work list.
        progress: show a progress bar per epoch (batches, rate, stall %) on stderr.
        transport: 'auto' (frames of producers on this host come through shared
            memory) or 'redis' (never); None reads ``BATCHQ_TRANSPORT``, else 'auto'.
        shm_dir: the shared-memory folder (default /dev/shm).
        rank: this process's rank in a data-parallel job (torch.distributed's RANK).
        world_size: the job's number of ranks; every rank passes the same. Ranks share
            one run and one pool of producers; each yields its own share of every
            epoch (disjoint, in plan order, the same count on every rank).
        even_batches: how ranks get equal counts when the epoch does not split evenly:
            'pad' (each yields ceil(N / world) batches, the extra ones being the
            epoch plan's first batches, as torch's DistributedSampler) or 'drop' (each
            share cut to floor(N / world)).
    """

    def __init__(
        self,
        sources: Sequence[str],
        produces_examples: bool = False,
        host: str | None = None,
        port: int | None = None,
        hwm: int = 10,
        axis_labels: Mapping[str, Sequence[str] | None] | None = None,
        *,
        dtypes: Mapping[str, Any] | None = None,
        queue: str = "default",
        url: str | None = None,
        timeout_s: float = 60.0,
        ordered: bool = True,
        writable: bool = False,
        claim_ttl_s: float = 10.0,
        max_frame_bytes: int | None = None,
        on_bad_frame: str = "raise",
        on_producer_error: str = "raise",
        stall_s: float = 5.0,
        progress: bool = False,
        transport: str | None = None,
        shm_dir: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        even_batches: str = "pad",
    ) -> None:
        self._config = {
            k: v for k, v in locals().items() if k not in ("self", "__class__", "axis_labels")
        }
        check_stream_options(self._config)
        self.url = resolve_url(url, host, port)
        self.keys = QueueKeys(queue)
        self.rank, self.world_size, self.even_batches = rank, world_size, even_batches
        self._step = 0  # batches yielded before this stream's ledger (a resume)
        self._yielded = 0  # batches this stream yielded
        self._prep = FramePrep(sources, dtypes, queue, writable=writable)
        self.produces_examples = produces_examples
        self._axis_labels = None if axis_labels is None else dict(axis_labels)
        self._config["axis_labels"] = self._axis_labels
        self._data_iter: Iterator[Any] | None = None  # get_data's epoch
        self.hwm = hwm
        self.timeout_s = timeout_s
        self.ordered = ordered
        self.claim_ttl_ms = int(claim_ttl_s * 1000)
        self.max_frame_bytes = max_frame_bytes
        self.on_bad_frame = on_bad_frame
        self.on_producer_error = on_producer_error
        self.stall_s = stall_s
        self.epoch = -1  # the epoch of the latest iterator; -1 before the first
        self._client: Any = None
        self._reader: Reader | None = None
        self._ledger: Ledger | None = None  # built here; once read, the buffer's
        self._buffer: Buffer | None = None
        self._session: Session | None = None
        self._resume: dict[str, Any] | None = None
        self._closed = False
        # Batches handed out, by the producer that made them (monitoring, tests).
        self.producers_seen: Counter[str] = Counter()
        self.progress = progress
        self._stats = TrainerStats()
        self._plan_shards = 0  # S of the run's plan, once known
        self._balancer: Balancer | None = None  # evens counts at run time (ranks)
        self._static: RankLayout | None = None  # where pads are known slots (ranks)
        self._pads = 0  # pad slots yielded
        self._shm = TrainerShm(
            self.keys, transport, shm_dir, writable=writable, rank=rank, world=world_size
        )

    # -- Fuel's interface --------------------------------------------------------------

    def get_epoch_iterator(self, as_dict: bool = False) -> Iterator[Any]:
        """Yield exactly the batches of the next epoch, then stop.

        Args:
            as_dict: yield dicts source -> array instead of tuples in source order.

        Raises:
            ProducerFailed: a producer's pipeline raised in this epoch.
            ProducersLost: no producer alive for timeout_s while waiting.
            FrameError: a frame failed validation (with on_bad_frame='raise').
            TrainerConflict: another trainer holds the queue.
        """
        return self._iterate(self.open_epoch(), as_dict)

    # -- the adapter interface (what wrappers such as consumer.torch build on) ---------

    @property
    def started(self) -> bool:
        """Whether reading has started (the first epoch was opened)."""
        return self._reader is not None

    @property
    def writable(self) -> bool:
        """Whether the arrays handed out are writable (see ``writable`` and
        :meth:`configure_frames`)."""
        return self._prep.writable

    @property
    def dtypes(self) -> dict[str, Any]:
        """The declared dtypes: source -> numpy dtype the loop receives."""
        return dict(self._prep.dtypes)

    def configure_frames(
        self,
        *,
        dtypes: Mapping[str, Any] | None = None,
        access: ArrayAccess | None = None,
        hook: FrameHook | None = None,
    ) -> None:
        """Change how frames are prepared on the reader thread, before the first epoch.

        Args:
            dtypes: more declared dtypes (source -> dtype), merged over the stream's own.
            access: what the arrays may be (:class:`ArrayAccess`); the constructor's
                ``writable`` chose READ_ONLY or WRITABLE.
            hook: run on every batch frame after the casts (on the reader thread).

        Raises:
            ConfigError: the stream has started, or an argument is invalid.
        """
        if self.started or self._closed:
            raise ConfigError("configure_frames must be called before the first epoch")
        if dtypes:
            self._prep.add_dtypes(dtypes)
        if access is not None:
            self._prep.set_access(access)
        if hook is not None:
            self._prep.add_hook(hook)

    def open_epoch(self) -> Iterator[Frame]:
        """Begin the next epoch and return its frames, in the order they are yielded.

        A frame taken from it counts as consumed in :meth:`state_dict` (less what the
        caller says it holds back). The Fuel iterator is this, frame by frame.
        """
        if self._closed:
            raise StreamStopped("this ServerDataStream is closed")
        self._start()
        self.epoch += 1
        return self._iterate_frames(self.epoch)

    def frame_ready(self) -> bool:
        """Whether the epoch's next step (a frame, its end, an error) needs no wait."""
        return self._buffer is not None and self._reader is not None and self._buffer.ready()

    def __len__(self) -> int:
        """Batches per epoch (this rank's share), from the run's plan (waits for a
        producer to publish it)."""
        total = self._plan_len()
        if self.world_size == 1:
            return total
        shards = self._retry(lambda: self._client.hget(self.keys.meta, MetaField.SHARDS), "reading")
        if shards is None or int(shards) != total:
            raise LengthUnknown(
                f"queue {self.keys.queue}: with shards of more than one batch a rank's share "
                "is only known at the epoch's end"
            )
        return RankLayout(total, self.world_size, self.even_batches).per_rank

    def _plan_len(self) -> int:
        self._connect()
        deadline = time.monotonic() + self.timeout_s
        while True:
            value = self._retry(
                lambda: self._client.hget(self.keys.meta, MetaField.EPOCH_BATCHES),
                "reading the plan",
            )
            if value is not None and int(value) >= 0:
                return int(value)
            if value is not None:
                raise LengthUnknown(
                    f"queue {self.keys.queue}: this pipeline cannot tell its batches per "
                    "epoch in advance (it filters or regroups examples)"
                )
            if time.monotonic() > deadline:
                raise ProducersLost(max(self.epoch, 0), [], self.timeout_s)
            # No producer has joined yet: wait for one (bounded, a few checks a second).
            self._retry(
                lambda: self._client.blpop([self.keys.wake], timeout=BLOCK_S),
                "waiting for the plan",
            )

    def close(self, finished: bool = False) -> None:
        """Stop reading and release the queue.

        Args:
            finished: end the run: the producers finish and exit 0.
        """
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            # The reader sends the last epoch's figures itself, as its last act: only
            # its thread ever pops, even when stopping takes longer than the join.
            self._reader.stop(flush=True)
        if self._session is None and finished:
            # Never started (a restarted job whose checkpoint is past its last batch):
            # finishing still has to reach the producers, or they serve for ever.
            self._connect()
            self._session = self._new_session()
            resume = self._resume or {}
            self._session.acquire(takeover=str(resume.get(RUN_KEY) or ""))
        if self._client is None:
            return
        try:
            # Frames and segments go with the run: at its last rank's finish.
            if self._session is not None and self._session.release(finished):
                delete_old_frames(self._client, self.keys, self.timeout_s)
                self._shm.finish()
        except ConnectionLost as e:
            # The claim lapses by itself; a finished run cannot be announced, though.
            log.warning("queue %s: could not release the claim: %s", self.keys.queue, e)
            if finished:
                raise
        finally:
            self._client.close()

    def state_dict(self, held_back: Mapping[int, int] | None = None) -> dict[str, Any]:
        """Where the caller is: a small JSON-serialisable dict for checkpoints.

        It reflects what the iterators have yielded to the caller, not what was
        prefetched: ``epoch`` (the epoch in progress, or the next one if the last was
        yielded completely), ``consumed`` (shard -> batches yielded in that epoch, as
        strings for JSON), ``done`` (shards yielded completely), the run id, the
        pipeline's fingerprint and S.

        Args:
            held_back: shard -> frames taken from :meth:`open_epoch` that the caller has
                not handed on yet (a wrapper's prefetch): they come again after a resume.
        """
        held_back = dict(held_back) if held_back else None
        if self._buffer is None or self._session is None:
            if self._resume is not None:
                return dict(self._resume)
            return unstarted_state(self.keys.queue)
        epoch, counts, done = self._buffer.consumed(held_back)
        run, plan = self._session.position()
        state = position_state(
            self.keys.queue, run, plan.fingerprint if plan else "", self._buffer.ledger.shards,
            epoch, counts, done,
        )  # fmt: skip
        if self.world_size > 1:
            step = self._step + self._yielded - sum((held_back or {}).values())
            state |= rank_fields(
                self.rank, self.world_size, self.even_batches, self._plan_shards, step
            )
        return state

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Resume from a :meth:`state_dict`; call before iterating.

        A rank of a data-parallel job passes its own state, or the list of every
        rank's states (it takes its own; the list must be one checkpoint's).

        The queue's stale contents are discarded, the producers re-plan the saved epoch
        from it, and the next batches are exactly those after the saved position (in
        the same order with ordered=True). With the queue's current run id this takes
        over at once, even from a killed trainer whose claim has not lapsed yet.

        Raises:
            ConfigError: the state is malformed, or the stream has started already.
        """
        if self._reader is not None or self._closed:
            raise ConfigError("load_state_dict must be called before the first iteration")
        state = pick_rank_state(state, self.rank, self.world_size)
        self._resume = check_state(state, self.keys.queue)
        if self._resume.get(RUN_KEY):
            check_rank_state(self._resume, self.rank, self.world_size)
            self._step = int(self._resume.get(STEP_KEY, 0))
        self.epoch = self._resume.get(EPOCH_KEY, 0) - 1 if self._resume.get(RUN_KEY) else -1

    def __enter__(self) -> ServerDataStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def padded(self) -> int:
        """Batches this rank yielded a second time so that every rank yields as many
        (``even_batches='pad'``), over all epochs."""
        return self._pads + (self._balancer.padded if self._balancer is not None else 0)

    @property
    def skipped_shards(self) -> int:
        """Shards skipped under ``on_producer_error='skip'``."""
        return self._ledger.skipped if self._ledger is not None else 0

    def __repr__(self) -> str:
        return f"ServerDataStream(sources={self.sources!r}, queue={self.keys.queue!r})"

    # -- internals ---------------------------------------------------------------------

    def _connect(self) -> None:
        if self._client is None:
            tune_malloc()
            self._client = make_client(self.url)

    def _retry(self, fn: Any, what: str) -> Any:
        """Run one of the stream's own Redis calls through the bounded reconnect."""
        return retrying(
            fn, f"{what} (queue {self.keys.queue})", self.timeout_s, client=self._client
        )

    def _new_session(self) -> Session:
        session = Session(
            self._client,
            self.keys,
            self.claim_ttl_ms,
            retry_s=self.timeout_s,
            rank=self.rank,
            world=self.world_size,
            even=self.even_batches,
        )
        # This trainer's host, after every claim and resume (they drop it).
        session.publish = lambda client: self._shm.publish(client, self.hwm)
        return session

    def _start(self) -> None:
        if self._reader is not None:
            return
        self._connect()
        check_eviction_policy(self._client)
        session = self._new_session()
        resume = self._resume if self._resume and self._resume.get(RUN_KEY) else None
        if resume is not None:
            session.resume_run = resume_run_id(resume, self.world_size)
        new_run = session.acquire(
            takeover=resume[RUN_KEY] if resume else "", resuming=resume is not None
        )
        self._session = session
        if new_run:
            delete_old_frames(self._client, self.keys, self.timeout_s)
        if resume is None:
            plan = session.wait_for_plan(self.timeout_s, BLOCK_S)
            self._plan_shards = plan.shards
            layout = session.layout(plan.shards)
            ledger = Ledger(layout.per_rank, ordered=self.ordered, first_epoch=0)
        else:
            layout, ledger, self._plan_shards = resume_position(
                session,
                self._client,
                self.keys,
                resume,
                rank=self.rank,
                ordered=self.ordered,
                step=self._step,
                timeout_s=self.timeout_s,
                block_s=BLOCK_S,
            )
        if session.plan is not None:
            ledger.window = session.plan.window if session.plan.has_window else None
            ledger.epoch_batches = session.plan.epoch_batches
        self._shm.new_run(session.run)  # other runs' segments: nothing will pop them
        self._shm.access = self._prep.access  # the one owner's setting, fixed from here
        self._ledger = ledger
        self._buffer = Buffer(ledger)
        self._even_up(layout, session.plan)
        self._reader = Reader(
            make_client(self.url),
            self.keys,
            session,
            self._buffer,
            hwm=self.hwm,
            timeout_s=self.timeout_s,
            writable=self._prep.writable,
            max_frame_bytes=self.max_frame_bytes,
            on_bad_frame=self.on_bad_frame,
            stall_s=self.stall_s,
            stats=self._stats,
            shm=self._shm,
            prepare=self._prep,
            layout=layout,
        )
        self._reader.start()

    def _even_up(self, layout: RankLayout, plan: Plan | None) -> None:
        """How this rank's counts come out equal: by the slots alone where every shard is
        one batch (pads counted as they are yielded), else by telling the other ranks
        (:mod:`consumer.balance`)."""
        if layout.world == 1:
            return
        if plan is not None and plan.epoch_batches == plan.shards:
            self._static = layout if layout.pads else None
            return
        self._balancer = Balancer(
            self._client,
            self.keys,
            self.rank,
            self.world_size,
            self.even_batches,
            self.timeout_s,
            keep=self.hwm,
        )

    @staticmethod
    def _iterate(frames: Iterator[Frame], as_dict: bool) -> Iterator[Any]:
        for frame in frames:
            yield frame.as_dict() if as_dict else frame.data

    def _iterate_frames(self, epoch: int) -> Iterator[Frame]:
        reader, buffer = self._reader, self._buffer
        if reader is None or buffer is None:  # pragma: no cover - _start sets both
            raise StreamStopped("the reader did not start")
        buffer.start_epoch(epoch)
        self._stats.start_epoch(epoch)
        bar = self._progress_bar(epoch)
        handed_out: float | None = None  # when the previous batch left this generator
        frames = self._buffer_frames(reader, buffer)
        if self._balancer is not None:
            self._balancer.start_epoch(epoch)
            frames = self._balancer.balance(epoch, frames, buffer.cut_epoch)
        try:
            while True:
                asked = time.monotonic()
                frame = next(frames, None)
                if frame is None:
                    self._stats.end_epoch()
                    return
                now = time.monotonic()
                busy = asked - handed_out if handed_out is not None else 0.0
                self._stats.batch(now - asked, busy, frame.nbytes)
                self.producers_seen[frame.producer] += 1
                self._yielded += 1
                if bar is not None:
                    bar.update(self._stats.snapshot())
                for message in self._prep.take_warnings():
                    warnings.warn(message, UserWarning, stacklevel=3)
                handed_out = time.monotonic()
                yield frame
        finally:
            if bar is not None:
                bar.close()

    def _buffer_frames(self, reader: Reader, buffer: Buffer) -> Iterator[Frame]:
        while (frame := self._next(reader, buffer)) is not None:
            static = self._static
            if static is not None and static.slot(frame.shard, self.rank) >= static.shards:
                self._pads += 1  # a pad slot: one of the epoch's first batches again
            yield frame

    def _next(self, reader: Reader, buffer: Buffer) -> Any:
        """The next batch frame of the epoch (waiting for it), or None at its end."""
        while True:
            frame = buffer.take(reader.is_alive, BLOCK_S)
            if frame is None:
                return None
            if frame.kind != FrameKind.ERROR:
                return frame
            if self.on_producer_error != "skip":
                raise ProducerFailed(
                    frame.epoch,
                    frame.shard,
                    frame.producer,
                    frame.error or "",
                    f"the producer's pipeline raised {frame.error_name or 'an exception'}",
                )
            log.warning(
                "queue %s: skipping epoch %d shard %d, whose pipeline raised %s",
                self.keys.queue,
                frame.epoch,
                frame.shard,
                frame.error_name,
            )
            buffer.skip_error(frame)

    def _progress_bar(self, epoch: int) -> EpochProgress | None:
        if not self.progress:
            return None
        total = None
        if self._session is not None and self._session.plan is not None:
            total = (
                self._session.plan.epoch_batches if self._session.plan.epoch_batches >= 0 else None
            )
        return EpochProgress(epoch, total)

    @property
    def max_buffered(self) -> int:
        """The most frames the reader held at once (not yet handed out)."""
        return self._buffer.max_buffered if self._buffer is not None else 0

    @property
    def stats(self) -> dict[str, Any]:
        """The trainer's figures: stall fraction of the last epoch and of the last 100
        batches, wait percentiles, batches/s and MB/s (see :mod:`consumer.stats`), and
        ``dropped_ahead``: frames past the look-ahead window dropped, to be built again
        (shards leased before the run's floor moved back, see docs/design.md)."""
        out = self._stats.snapshot()
        out["dropped_ahead"] = self._ledger.dropped_ahead if self._ledger is not None else 0
        return out
