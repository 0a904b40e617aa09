"""ServerDataStream: the trainer's side, Fuel's ``fuel.streams.ServerDataStream`` on Redis.

Constructing one touches nothing that can be lost: Redis is first asked for anything
when the first epoch iterator is requested (or ``len()`` is called), and nothing is
popped before the first iteration.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from batchq.client.connection import make_client, name_client, resolve_url, retrying, tune_malloc
from batchq.errors import (
    BatchQueueError,
    ConfigError,
    LengthUnknown,
    StateLost,
    StreamStopped,
    TrainerConflict,
)
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import trainer_client_name
from batchq.protocol.params_log import ParamsLog
from batchq.wire.codec import Frame
from consumer.balance import Balancer
from consumer.checkpoint import (
    CONSUMED_KEY,
    DONE_KEY,
    EPOCH_KEY,
    PARAMS_KEY,
    REMAP_KEY,
    RUN_KEY,
    STEP_KEY,
    load_state,
    resumed_batches,
    stream_state,
    unstarted_state,
)
from consumer.detach import detach
from consumer.epoch import EpochFeed
from consumer.fuel_stream import FuelStreamMixin
from consumer.params import StreamParams, refuse_grouped
from consumer.plan import epoch_length
from consumer.rank_state import pick_rank_state
from consumer.reader.buffer import Buffer
from consumer.reader.prepare import ArrayAccess, FrameHook, FramePrep
from consumer.reader.shm_frames import TrainerShm
from consumer.reader.stats import RunFigures, TrainerStats
from consumer.reader.thread import Reader
from consumer.session import Session
from consumer.start import Started, claim, claim_to_finish, open_reading, release
from consumer.stream_options import StreamOptions

__all__ = ["ServerDataStream"]

log = logging.getLogger(__name__)

# The stream of this process that reads each (url, queue, group, rank), from its claim to
# its close: a later one takes over from it where it stands between two epochs
# (ServerDataStream._take_over_earlier). Held strongly: a stream a framework dropped
# still holds its claim through its reader thread.
_READING: dict[tuple[str, str, str | None, int], ServerDataStream] = {}


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
        rank: this process's rank in a data-parallel job. None: found, from the
            initialised ``torch.distributed`` process group, else from the ``RANK`` and
            ``WORLD_SIZE`` environment variables, else 0 (a single process); found again
            at the first iteration if the process group was initialised since.
        world_size: the job's number of ranks (None: found, as ``rank``); every rank
            has the same. Ranks share one run and one pool of producers; each yields
            its own share of every epoch (disjoint, in plan order, the same count on
            every rank).
        even_batches: how ranks get equal counts when the epoch does not split evenly:
            'pad' (each yields ceil(N / world) batches, the extra ones being the
            epoch plan's first batches, as torch's DistributedSampler) or 'drop' (each
            share cut to floor(N / world)).
        group: this trainer's group (a trial of a sweep): every group of a run reads
            every batch of every epoch, each built once for all, with its own claim,
            position and figures; ranks split a group's share. None: the default group.
        max_lag_batches: how many batches this group may fall behind the leading group
            before the others go on without it (its batches are then built for it
            alone, until it catches up); None: the others wait for it.
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
        rank: int | None = None,
        world_size: int | None = None,
        even_batches: str = "pad",
        group: str | None = None,
        max_lag_batches: int | None = None,
    ) -> None:
        arguments = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        arguments["axis_labels"] = None if axis_labels is None else dict(axis_labels)
        # The rank and world size not given are found (torch.distributed, else
        # RANK/WORLD_SIZE), and found again before reading starts (a process group
        # initialised after the constructor).
        self.options = StreamOptions.checked(arguments)
        self.url = resolve_url(url, host, port)
        self.keys = QueueKeys(queue)
        self._step = 0  # batches yielded before this stream's ledger (a resume)
        self._prep = FramePrep(sources, dtypes, queue, writable=writable)
        self.produces_examples = produces_examples  # Fuel's attribute
        self._axis_labels = self.options.axis_labels
        self._data_iter: Iterator[Any] | None = None  # get_data's epoch
        self.epoch = -1  # the epoch of the latest iterator; -1 before the first
        self._client: Any = None
        # Every connection of this trainer carries one name: a restart finds the claim of
        # a trainer whose process died by the name's absence, not by its lapse.
        self._client_name = trainer_client_name()
        # The claim (kept from the moment it is made), then, once reading starts (the
        # first epoch), the parts that read the run (consumer.start.Started) and the
        # feed of its epochs from their buffer.
        self._session: Session | None = None
        self._started: Started | None = None
        self._feed: EpochFeed | None = None
        self._resume: dict[str, Any] | None = None
        self._closed = False
        # Batches handed out, by the producer that made them (monitoring, tests).
        self.producers_seen: Counter[str] = Counter()
        self._stats = TrainerStats()
        self._run_figures = RunFigures()
        self._shm = _trainer_shm(self.keys, self.options)
        self._params = StreamParams()  # the run's params log (set_params)
        # The object whose state_dict() and close() speak for this stream's loop: a
        # wrapper holding batches it prefetched (TorchStream), else the stream itself.
        self.wrapper: Any = None

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
        return self._started is not None

    @property
    def _buffer(self) -> Buffer | None:
        return self._started.buffer if self._started is not None else None

    @property
    def _reader(self) -> Reader | None:
        """Stripe 0's reader (the queue's own)."""
        return self._started.readers.first if self._started is not None else None

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
        hook_keeps_values: bool = False,
    ) -> None:
        """Change how frames are prepared on the reader thread, before the first epoch.

        Args:
            dtypes: more declared dtypes (source -> dtype), merged over the stream's own.
            access: what the arrays may be (:class:`ArrayAccess`); the constructor's
                ``writable`` chose READ_ONLY or WRITABLE.
            hook: run on every batch frame after the casts (on the reader thread).
            hook_keeps_values: ``hook`` returns the frame's values unchanged (copied into
                other memory, say): a stream that detaches may then give its frames back
                (:meth:`close`).

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
            self._prep.add_hook(hook, keeps_values=hook_keeps_values)

    def open_epoch(self) -> Iterator[Frame]:
        """Begin the next epoch and return its frames, in the order they are yielded.

        A frame taken from it counts as consumed in :meth:`state_dict` (less what the
        caller says it holds back). The Fuel iterator is this, frame by frame.
        """
        if self._closed:
            raise StreamStopped("this ServerDataStream is closed")
        self._stats.iterating()  # the clock of first_batch_s, from the first call
        feed = self._start()
        self.epoch += 1
        plan = self._session.plan if self._session is not None else None
        total = plan.epoch_batches if plan is not None and plan.epoch_batches >= 0 else None
        frames = feed.frames(
            self.epoch,
            skip_errors=self.options.on_producer_error == "skip",
            queue=self.keys.queue,
            progress=self.progress,
            total=total,
            already=resumed_batches(self._resume, self.epoch),
        )
        return self._params.track(self._while_open(frames))

    def _while_open(self, frames: Iterator[Frame]) -> Iterator[Frame]:
        """``frames`` until :meth:`close` (called inside the loop): what the buffer still
        holds then was given back, and would be yielded twice."""
        while not self._closed:
            frame = next(frames, None)
            if frame is None:
                return
            yield frame
        raise StreamStopped("this ServerDataStream was closed during its epoch")

    def set_params(
        self,
        params: Mapping[str, Any],
        *,
        at_batch: int | None = None,
        at_epoch: int | None = None,
        held_back: Mapping[int, int] | None = None,
    ) -> int:
        """Merge ``params`` (a JSON mapping) over the producers' params in effect, for the
        whole run, from a global batch index on (:class:`consumer.params.StreamParams`).

        Args:
            at_batch: apply from this global batch index; at_epoch: from this epoch's
                first batch; neither: from the trainer's position plus the run's
                look-ahead (the same at the same step of a loop, resumed or not).
            held_back: as :meth:`state_dict`'s (a wrapper's prefetch).

        Returns:
            The global batch index from which it applies.

        Raises:
            ConfigError: bad arguments, or an index before the trainer's position.
        """
        if self._closed:
            raise StreamStopped("this ServerDataStream is closed")
        self._start()
        if self._buffer is None or self._feed is None:
            raise StreamStopped("this ServerDataStream is closed")
        refuse_grouped(self._session)  # one build serves every group: none steers it alone
        held = dict(held_back) if held_back else None
        step = self._step + self._feed.yielded - sum((held or {}).values())
        consumed = self._buffer.consumed(self._feed.ledger_held(held))
        return self._params.set_params(
            params, at_batch, at_epoch, buffer=self._buffer, consumed=consumed, step=step
        )

    @property
    def params(self) -> Mapping[str, Any]:
        """The params the batch just yielded was built with (read-only; empty before any
        :meth:`set_params`)."""
        if self._session is None:
            return self._params.params_of(None, self._client)
        return self._params.last_params(self._session.client)

    def frame_ready(self) -> bool:
        """Whether the epoch's next step (a frame, its end, an error) needs no wait."""
        return self._buffer is not None and self._reader is not None and self._buffer.ready()

    def __len__(self) -> int:
        """Batches per epoch (this rank's share), from the run's plan (waits for a
        producer to publish it).

        Raises:
            LengthUnknown: the plan cannot tell, or the next epoch is one re-split for
                another number of ranks (its count is its remap's, on top of the
                batches the old ranks had: an iterator's end tells it).
        """
        self._refind_rank()
        resumed = self._resume or {}
        if REMAP_KEY in resumed and int(resumed[EPOCH_KEY]) == self.epoch + 1:
            raise LengthUnknown(
                f"queue {self.keys.queue}: epoch {self.epoch + 1} was re-split for "
                f"{self.world_size} ranks; its length is known at its end"
            )
        self._connect()
        return epoch_length(
            self._client,
            self.keys,
            world=self.world_size,
            even=self.even_batches,
            timeout_s=self.timeout_s,
            epoch=self.epoch,
        )

    def close(self, finished: bool = False, *, held: Sequence[Frame] = ()) -> None:
        """Stop reading and release the queue.

        Without ``finished`` a single trainer gives back the frames it popped and did
        not yield, so that one resumed from the :meth:`state_dict` taken right before
        reads on at once (:mod:`consumer.detach`).

        Args:
            finished: end the run: the producers finish and exit 0.
            held: frames taken from :meth:`open_epoch` that the caller has not handed
                on (a wrapper's prefetch; the ``held_back`` of its :meth:`state_dict`),
                in the order taken: given back first.
        """
        if self._closed:
            return
        self._closed = True
        if _READING.get(self._reading_key()) is self:
            del _READING[self._reading_key()]
        if self._started is not None:
            self._stop_reading(self._started, finished, held)
        if self._session is None and finished:
            # Never started (a restarted job whose checkpoint is past its last batch):
            # finishing still has to reach the producers, or they serve for ever.
            self._refind_rank()
            self._connect()
            takeover = str((self._resume or {}).get(RUN_KEY) or "")
            self._session = claim_to_finish(
                self._client, self.keys, self.options, self._shm, takeover
            )
            if self._session is None:
                return
        if self._client is not None:
            others = self._started.stripes[1:] if self._started is not None else []
            try:
                release(self._session, self._client, self._shm, finished, self.timeout_s, others)
            except StateLost as e:
                self._finish_again(e)

    def _finish_again(self, lost: StateLost) -> None:
        """Finish the run once more where Redis lost the queue (restarted empty) before
        the finish reached it: the producers serve the run they made again, which only
        a finish ends (else they serve until ``orphan_exit_s``); the queue is claimed
        again to finish it, as a stream that never read does."""
        run = self._session.run if self._session is not None else ""
        log.warning("%s; claiming the queue again to finish the run", lost)
        self._client = None  # release() closed it
        self._connect()
        session = claim_to_finish(self._client, self.keys, self.options, self._shm, run)
        if session is not None:
            self._session = session
            release(session, self._client, self._shm, True, self.timeout_s)

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
        if self._buffer is None or self._session is None or self._feed is None:
            if self._resume is not None:
                return dict(self._resume)
            return unstarted_state(self.keys.queue)
        run, plan = self._session.position()
        held = sum((held_back or {}).values())
        position = self._buffer.consumed(self._feed.ledger_held(held_back))
        evener = self._feed.evener
        return stream_state(
            self.options, run, plan, self._buffer.shards, position,
            step=self._step + self._feed.yielded - held,
            plan_shards=self._started.plan_shards if self._started else 0,
            params=self._params.state(), resumed=self._resume,
            yielding=self._feed.yielding(held),
            published=evener.shard_counts if isinstance(evener, Balancer) else None,
        )  # fmt: skip

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
        self._refind_rank()
        state = pick_rank_state(state, self.rank, self.world_size)
        self._resume = load_state(state, self.options)
        self._params = StreamParams(ParamsLog.from_json(self._resume.get(PARAMS_KEY)))
        if self._resume.get(RUN_KEY):
            self._step = int(self._resume.get(STEP_KEY, 0))
        self.epoch = self._resume.get(EPOCH_KEY, 0) - 1 if self._resume.get(RUN_KEY) else -1

    def __enter__(self) -> ServerDataStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def padded(self) -> int:
        """Batches this rank yielded a second time so that every rank yields as many
        (``even_batches='pad'``), over all epochs."""
        return self._feed.padded if self._feed is not None else 0

    @property
    def skipped_shards(self) -> int:
        """Shards skipped under ``on_producer_error='skip'``."""
        return self._buffer.skipped if self._buffer is not None else 0

    def __repr__(self) -> str:
        return f"ServerDataStream(sources={self.sources!r}, queue={self.keys.queue!r})"

    @property
    def rank(self) -> int:
        """This process's rank in its data-parallel job (``rank``, or found)."""
        return self.options.rank

    @property
    def world_size(self) -> int:
        """The job's number of ranks (``world_size``, or found)."""
        return self.options.world_size

    @property
    def even_batches(self) -> str:
        """How ranks get equal counts ('pad' or 'drop')."""
        return self.options.even_batches

    @property
    def hwm(self) -> int:
        """The trainer's prefetch bound (decoded frames held ahead of the caller)."""
        return self.options.hwm

    @property
    def timeout_s(self) -> float:
        """How long without a live producer before ProducersLost."""
        return self.options.timeout_s

    @property
    def ordered(self) -> bool:
        """Whether epochs are yielded in plan order."""
        return self.options.ordered

    @property
    def progress(self) -> bool:
        """Whether a progress bar is shown per epoch."""
        return self.options.progress

    # -- internals ---------------------------------------------------------------------

    def _connect(self) -> None:
        if self._client is None:
            tune_malloc()
            self._client = self._named_client(self.keys)

    def _stop_reading(self, started: Started, finished: bool, held: Sequence[Frame]) -> None:
        """Stop the readers; stopping without finishing, a single trainer then gives back
        the frames it holds unread, once every reader stopped (:mod:`consumer.detach`)."""
        # The readers send the last epoch's figures themselves, as their last act: only
        # their threads ever pop, even when stopping takes longer than the join.
        started.readers.stop(flush=True)
        if not finished and self._session and self._buffer and started.readers.stopped():
            exact = len(started.stripes) == 1 and self._prep.keeps_frames()
            try:
                held_back = Counter(frame.shard for frame in held)
                detach(
                    self._session, self._client, self._buffer,
                    state=self.state_dict(held_back=held_back), taken=held,
                    host=self._shm.identity, exact=exact, shm=self._shm,
                )  # fmt: skip
            except Exception:  # the release below must run whatever a detach meets
                log.exception("%s: the frames held were not given back", self._session.what)

    def _named_client(self, keys: QueueKeys) -> Any:
        """A client for ``keys``' queue, its connections named this trainer's."""
        client = make_client(self.url, key=keys.meta)
        retrying(
            lambda: name_client(client, self._client_name), "naming the client", self.timeout_s
        )
        return client

    def _start(self) -> EpochFeed:
        """Start reading, once: claim the queue, find where the run starts, start the
        reader threads (:mod:`consumer.start`). The claim is kept from the moment
        it is made: :meth:`close` releases it whatever failed after."""
        if self._feed is not None:
            return self._feed
        self._refind_rank()
        earlier = self._take_over_earlier()
        self._connect()
        resume = self._resume if self._resume and self._resume.get(RUN_KEY) else None
        try:
            self._session, new_run = claim(
                self._client, self.keys, self.options, self._shm, resume, self._params
            )
        except TrainerConflict as e:
            if earlier is None:
                raise
            where = (
                f"rank {self.rank} of a data-parallel job (where it is not taken over: "
                "its resume would restart the run under the other ranks)"
                if self.world_size > 1
                else f"in the middle of its epoch {earlier.epoch}"
            )
            raise TrainerConflict(
                f"{e}; the holder is an earlier stream of this process, {where}: close() "
                "it first, or give the framework the same stream again (keep what the "
                "dataloader hook returns)"
            ) from None
        _READING[self._reading_key()] = self
        self._started = open_reading(
            self._session,
            new_run,
            options=self.options,
            resume=resume,
            step=self._step,
            shm=self._shm,
            prep=self._prep,
            stats=self._stats,
            params=self._params,
            connect=self._named_client,
        )
        started = self._started
        # The epoch opened next and its batches had before (a checkpoint's), so that a
        # state taken before that epoch's first batch says where every rank is.
        at = (self.epoch + 1, resumed_batches(self._resume, self.epoch + 1))
        self._feed = EpochFeed(
            started.buffer, started.readers.is_alive, started.evener, self._stats, self._prep,
            self.producers_seen, at,
        )  # fmt: skip
        return self._feed

    def _reading_key(self) -> tuple[str, str, str | None, int]:
        return (self.url, self.keys.queue, self.options.group, self.rank)

    def _take_over_earlier(self) -> ServerDataStream | None:
        """Take over from an earlier stream of this process that reads the same queue
        (group and rank) and stands between two epochs: a framework asked a
        ``*_dataloader()`` hook again (Lightning's ``reload_dataloaders_every_n_epochs``,
        a second ``fit()``, ``validate()`` after ``fit()``, the transformers Trainer's
        evaluation loader). Its claim held on (its reader thread refreshes it), so this
        one got TrainerConflict. Now it is closed (the frames it prefetched go back)
        and this stream reads on from its state, in the same run, at the next epoch;
        from a state loaded here instead where one was. One mid-epoch is another
        trainer still reading: the claim refuses it, as before (returned, to say so);
        so is any in a data-parallel job (world > 1), whose takeover, a resume, would
        replace the run under the other ranks."""
        earlier = _READING.get(self._reading_key())
        if earlier is None or earlier is self:
            return None
        if self.world_size > 1:
            # The takeover is a resume, and one rank's resume replaces the run: the
            # other ranks' finish and reading would go with it (found by review).
            return earlier
        loop = earlier.wrapper if earlier.wrapper is not None else earlier
        try:
            state = loop.state_dict()
        except BatchQueueError:  # it failed: its claim is the claim's business
            return None
        if state.get(CONSUMED_KEY) or state.get(DONE_KEY):
            return earlier  # mid-epoch: a live trainer's, refused by the claim
        log.info(
            "queue %s: an earlier stream of this process stands between two epochs: it "
            "is closed, and this one reads on at epoch %s",
            self.keys.queue,
            state.get(EPOCH_KEY),
        )
        loop.close()
        if self._resume is None:
            self.load_state_dict(state)
        return None

    def _refind_rank(self) -> None:
        """Before the claim, find the rank again where it was not given: a process group
        initialised after the constructor (a stream made at import time) counts."""
        if self._session is not None:
            return
        options = self.options.refound()
        if options is not self.options:
            self.options = options
            self._shm = _trainer_shm(self.keys, options)

    @staticmethod
    def _iterate(frames: Iterator[Frame], as_dict: bool) -> Iterator[Any]:
        for frame in frames:
            yield frame.as_dict() if as_dict else frame.data

    @property
    def max_buffered(self) -> int:
        """The most frames the reader held at once (not yet handed out)."""
        return self._buffer.max_buffered if self._buffer is not None else 0

    @property
    def stats(self) -> dict[str, Any]:
        """The trainer's figures: stall fraction of the last epoch and of the last 100
        batches, wait percentiles, batches/s and MB/s (see :mod:`consumer.reader.stats`), and
        ``dropped_ahead``: frames past the look-ahead window dropped, to be built again
        (shards leased before the run's floor moved back, see docs/design.md);
        ``rebuilt_params``: frames built with params a later :meth:`set_params` changed,
        dropped and built again; ``quarantined``: examples of the run its dataset could
        not read, replaced by substitutes (``on_sample_error='quarantine'``);
        ``cache``: the live producers' cache figures (hits, misses, hit_rate, bytes,
        saved_s, producers; None when none caches a stage). Those two are read from
        Redis at most once a second (:class:`consumer.reader.stats.RunFigures`)."""
        out = self._stats.snapshot()
        out["dropped_ahead"] = self._buffer.dropped_ahead if self._buffer is not None else 0
        out["rebuilt_params"] = self._params.rebuilt
        run = self._session.position()[0] if self._session is not None else ""
        out["cache"], out["quarantined"] = self._run_figures.read(self._client, self.keys, run)
        return out


def _trainer_shm(keys: QueueKeys, options: StreamOptions) -> TrainerShm:
    """The trainer's shared memory for ``options``' rank."""
    return TrainerShm(
        keys, options.transport, options.shm_dir, writable=options.writable,
        rank=options.rank, world=options.world_size,
    )  # fmt: skip
