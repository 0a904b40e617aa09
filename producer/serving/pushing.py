"""Serving a leased shard: building its batches and pushing their frames under the cap
(the producer's hot path).

:class:`ShardPusher` turns one leased shard into frames: it builds the batches, encodes
them (:mod:`producer.serving.frames`, :mod:`producer.serving.transport`), hands each to
the :class:`producer.serving.frame_push.FramePusher` it holds (the element, the round
trip, each reply, the waits), folds the END into the last batch, and for shards that
build quickly builds the next shard's first batch while the last push travels
(:mod:`producer.serving.ahead`). A pipeline that raises has its shard retried elsewhere,
or reported in an ERROR frame.

:class:`producer.server.Producer` makes both and hands each everything it uses
explicitly: the frame pusher gets the fixed
:class:`producer.serving.frames.PushSettings`, the client, the transport, the run it
serves (:class:`producer.serving.membership.RunPosition`, a value the producer's join
replaces: :meth:`ShardPusher.joined`), its stop event, the leases held ahead and
``lease_request(leases_ahead, after)`` (the next lease's call and token); the shard
pusher gets the frame pusher, the plan, the transport and the leases held ahead. What
is the producer's business (the run finished or changed)
:meth:`ShardPusher.serve_shard` returns as a status, for the Producer to act on. Only
the pipeline's ``next()`` and the encoding of what it made count as "the pipeline
raised"; Redis' errors propagate as Redis errors.

**A build that takes too long** (``build_timeout_s``) is given up, and its producer
stops. With ``build_timeout_s`` set, a producer builds each batch on a worker thread of
its own (:class:`BuildWatch`) and waits for it at most that long. A build past it raises
:class:`~producer.errors.BuildTimeout` in the serving thread, naming the shard and,
where the stream's root says what it is reading (``reading``: a
:class:`producer.torch.dataset.DatasetStream` names the example, :func:`reading_of`),
the example: the pusher counts it as a failed attempt (handback.lua: the shard goes back to
the work list, or after ``max_attempts`` the trainer gets ``ProducerFailed`` with that
message), and the producer then stops serving and raises it (``batchq serve`` exits
non-zero, a ``--workers`` pool starts another). It cannot go on: the build still runs
(a thread cannot be stopped) and would draw from the global generators and move the
stream's state under the next shard's build. The worker is a daemon thread, so a process
whose build never returns still exits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from batchq.client.connection import Pieces
from batchq.protocol import producer_scripts
from batchq.protocol.layout import entry_slot
from batchq.protocol.words import Status
from batchq.wire import codec
from producer.control import ProducerParams
from producer.errors import BuildTimeout
from producer.serving.ahead import Ahead, Ready
from producer.serving.frame_push import FramePusher, Handover, OnePush, Pushed
from producer.serving.frames import batch_header, end_frame
from producer.serving.membership import RunPosition
from producer.serving.sharding import ShardPlan, find_root
from producer.serving.transport import ShmFrame, Transport

__all__ = ["BuildWatch", "ShardPusher", "reading_of"]

log = logging.getLogger(__name__)

Frame = Pieces | memoryview | ShmFrame
Step = tuple[Any, bool]  # a batch, and whether it is the shard's last
T = TypeVar("T")


class ShardPusher:
    """Serving one leased shard at a time for one producer: its batches built, their
    frames encoded and handed to the frame pusher it holds.

    Args:
        frames: the producer's frame pusher (each frame's capped push; it holds the
            run served, the settings and the client this uses too).
        plan: the shard plan of the producer's pipeline.
        transport: shared memory or Redis, per frame.
        ahead: the leases held ahead, and the next shard's first batch built ahead.
    """

    def __init__(
        self, frames: FramePusher, plan: ShardPlan, transport: Transport, ahead: Ahead
    ) -> None:
        self.frames = frames
        self.settings = frames.settings
        self.client = frames.client
        self.plan = plan
        self._transport = transport
        self.ahead = ahead
        # The run's params log as last read, and the params of the shard being built.
        self.params = ProducerParams(self.settings.keys, plan.shard_batches)
        self._shard_params = self.params.shard(0)
        self.watch: BuildWatch | None = None  # build_timeout_s: builds on a watched thread
        # The shard is built isolated (producer.isolation): every read of the root is
        # bounded there; the stages above the root (transformers) are not, so only a
        # pipeline that is its root alone is built unwatched then.
        self.isolated = False
        self._root_only = plan.root is plan.stream

    def joined(self, position: RunPosition) -> None:
        """The producer joined (again): push for ``position``'s run; the leases held
        ahead were the run's we left, and what was built ahead goes with them."""
        self.frames.follow(position)
        self.ahead.drop()
        self.params.joined(position.run)

    def serve_shard(
        self, epoch: int, shard: int, entry: str, skip: int = 0, slot: int | None = None,
        g: int | None = None,
    ) -> str | None:  # fmt: skip
        """Build a shard and push its batches from batch ``skip`` on (the trainer has the
        ones before: a resumed checkpoint).

        Args:
            slot: the slot the shard fills (data-parallel runs: frames name it, and a
                pad slot rebuilds an earlier shard); None: the shard itself.
            g: the plan's global slot number (its batches' params indices); None: the
                lease entry's (a stripe's entry names the stripe's number).

        Returns:
            the status of a reply that is the producer's business (the run finished or
            changed, the producer was reaped: :class:`Handover`), else None.
        """
        label = shard if slot is None else slot
        ready = self.ahead.take_ready(entry)
        # The params of each batch (a shard spanning a change gets each batch's own).
        built = ready.params if ready is not None else None
        self._shard_params = built or self.params.shard(entry_slot(entry) if g is None else g)
        batches = (
            ready.batches
            if ready
            else iter(self.plan.iter_shard_marked(epoch, shard, self._shard_params.around))
        )
        k = 0
        started = time.perf_counter()
        built_s = 0.0  # building this shard took, pushes apart
        while True:
            # Shared memory or Redis, from this batch on (also for a batch built ahead:
            # its frame is made already, the next ones are not).
            self._transport.refresh(self.client)
            try:
                step, frame, took_s = self._next_frame(
                    epoch, label, k, skip, ready, batches, started
                )
            except Exception as e:
                return _status(self._pipeline_failed(epoch, label, k, entry, e))
            ready = None
            if step is None:
                break
            built_s += took_s
            if frame is not None:
                pushed = self._push_batch(frame, entry, step[1], int(took_s * 1000), built_s)
                if pushed is not True:
                    return _status(pushed)
                started = time.perf_counter()
            elif step[1]:  # k < skip, and the trainer has every batch: only the count
                return _status(self._push_end(epoch, label, k + 1, entry))
            k += 1
        return _status(self._push_end(epoch, label, 0, entry)) if k == 0 else None

    def _next_frame(
        self,
        epoch: int,
        label: int,
        k: int,
        skip: int,
        ready: Ready | None,
        batches: Iterator[Step],
        started: float,
    ) -> tuple[Step | None, Frame | None, float]:
        """The next batch, its frame (None before ``skip``: the trainer has it), and how
        long building it took (since ``started``, or ahead). Only the user's pipeline
        (next) and what it made (encoding its arrays) are "the pipeline raised": what
        this raises."""
        if ready is not None:  # the first batch, built while the last push travelled
            if ready.error is not None:
                raise ready.error
            return ready.step, ready.frame, ready.took_s
        if self.watch is None or (self.isolated and self._root_only):
            step = next(batches, None)  # no watch, or every read bounded in the child
        else:  # at most build_timeout_s, else BuildTimeout: the pipeline failed
            what = f"epoch {epoch} shard {label} batch {k}"
            # Isolated under transformers: twice the bound, so that a read that hangs is
            # named by the child's own verdict (build_timeout_s per read) first.
            bound_s = self.watch.timeout_s * (2 if self.isolated else 1)
            step = self.watch.call(lambda: next(batches, None), what, bound_s)
        frame = None
        if step is not None and k >= skip:
            version = self._shard_params.version(k)
            frame = self._encode_batch(epoch, label, k, *step, params_version=version)
        return step, frame, time.perf_counter() - started

    def _pipeline_failed(
        self, epoch: int, label: int, k: int, entry: str, error: Exception
    ) -> Pushed | None:
        """Count the failure; retry the shard elsewhere, or tell the trainer (ERROR)."""
        log.error(
            "producer %s: pipeline raised in epoch %d shard %d",
            self.settings.producer,
            epoch,
            label,
            exc_info=error,
        )
        retried = self._retry_elsewhere(epoch, label, entry)
        if not retried:  # given up: the trainer gets the error
            return self._push_end(epoch, label, k, entry, error=error)
        return retried

    def _push_end(
        self, epoch: int, shard: int, count: int, entry: str, error: Exception | None = None
    ) -> Pushed:
        """The shard's end after ``count`` batches: an END frame, or with ``error`` the
        ERROR frame carrying the pipeline's traceback."""
        version = self._shard_params.version(count)
        frame = end_frame(
            self.settings.producer, self.frames.position.run, epoch, shard, count, error, version
        )
        return self._push(frame, entry, last=True)

    def _retry_elsewhere(self, epoch: int, shard: int, entry: str) -> Pushed:
        """Count the failure (handback.lua): True if the shard went back to the work list
        for a retry (or was taken from us), False if it gave up (report it), or a
        :class:`Handover`."""
        s, position = self.settings, self.frames.position
        reply = producer_scripts.fail(
            self.client, s.keys, incarnation=position.incarnation, run=position.run,
            producer=s.producer, entry=entry, max_attempts=s.max_attempts,
        )  # fmt: skip
        if reply.status == Status.RETRY:
            log.warning(
                "producer %s: epoch %d shard %d failed (attempt %d of %d); handed back",
                s.producer,
                epoch,
                shard,
                reply.first,
                s.max_attempts,
            )
            return True
        if reply.status == Status.GIVE_UP:
            return False
        return True if reply.status == Status.LEASE_LOST else Handover(reply.status)

    def _encode_batch(
        self,
        epoch: int,
        shard: int,
        k: int,
        batch: Any,
        last: bool,
        rank: int | None = None,
        params_version: int = 0,
        mask: int | None = None,
    ) -> Frame:
        """One batch's frame: into shared memory, else pieces for Redis (raises what the
        codec finds wrong with the pipeline's arrays); ``params_version``: the params
        log's version the batch was built with; ``rank``, ``mask``: whose lists it goes
        to (default: the current shard's)."""
        values = batch.values() if isinstance(batch, dict) else batch
        # A list that is a regular array travels as one, as over Fuel's server (Fuel's
        # send_arrays made every value an array): a Fuel trainer reads batch.shape.
        data = tuple(codec.array_or_value(v) for v in values)
        s = self.settings
        header = batch_header(
            s,
            self.frames.position.run,
            epoch,
            shard,
            k,
            last,
            self.plan.shard_batches,
            params_version,
        )
        return self._transport.encode(
            header,
            data,
            checksum=s.checksum,
            max_frame_bytes=s.max_frame_bytes,
            rank=self.frames.rank if rank is None else rank,
            mask=self.frames.targets if mask is None else mask,
        )

    def _push_batch(
        self, frame: Frame, entry: str, last: bool, produce_ms: int, built_s: float = 1.0
    ) -> Pushed:
        """Push a batch's frame; a segment whose descriptor never reached the list is
        free again, one whose push lost its reply is remembered as uncertain."""
        try:
            pushed = self._push(frame, entry, last=last, produce_ms=produce_ms, built_s=built_s)
        except BaseException:
            if isinstance(frame, ShmFrame):  # the reply was lost: maybe listed, maybe not
                self._transport.uncertain(frame, self.frames.data_key)
            raise
        if pushed is not True and isinstance(frame, ShmFrame):
            frame.abandon()  # its descriptor never reached the list
        return pushed

    def _push(
        self, frame: Frame, entry: str, *, last: bool, produce_ms: int = 0, built_s: float = 1.0
    ) -> Pushed:
        """Push one frame, waiting at the cap (:meth:`FramePusher.push`).

        ``built_s``: how long the shard took to build; under AHEAD_MAX_BUILD_S its last
        push asks to hold two leases ahead, and a last push with the next shard leased
        builds that shard's first batch while it travels."""
        ahead = self.ahead
        # Not with build_timeout_s: a build ahead would run outside the watch.
        between = (
            self._build_ahead
            if last and ahead.leases and ahead.ready is None and self.watch is None
            else None
        )
        return self.frames.push(frame, OnePush(entry, last, produce_ms, built_s), between)

    def _build_ahead(self) -> None:
        """Build the next leased shard's first batch while the last push travels (not
        when the params log changed since: that shard is built once the log is read)."""
        if self.ahead.leases and self.params.current(self.ahead.leases[0].params):
            self.ahead.build_next(self.plan, self._encode_batch, self.params)


def _status(pushed: Pushed | None) -> str | None:
    """The status the Producer acts on, if what happened was a :class:`Handover`."""
    return pushed.status if isinstance(pushed, Handover) else None


class BuildWatch:
    """Runs builds on a daemon worker thread, each for at most ``timeout_s``.

    Args:
        timeout_s: the longest a build may take.
        reading: ``() -> str``: what the stream is reading now ('' when it cannot tell),
            for the error's message.
    """

    def __init__(self, timeout_s: float, reading: Callable[[], str]) -> None:
        self.timeout_s = timeout_s
        self.reading = reading
        self.hung: BuildTimeout | None = None  # set once a build ran past timeout_s
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue[Any]]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None

    def call(self, build: Callable[[], T], what: str, timeout_s: float | None = None) -> T:
        """``build()`` on the worker thread: its result, or what it raised.

        Args:
            timeout_s: this build's bound; None: :attr:`timeout_s`.

        Raises:
            BuildTimeout: it took more than the bound (``what``: the batch, named in the
                message); the watch is then :attr:`hung` and runs nothing more.
        """
        bound_s = self.timeout_s if timeout_s is None else timeout_s
        if self.hung is not None:
            raise self.hung
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="batchq-build", daemon=True)
            self._thread.start()
        done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._jobs.put((build, done))
        try:
            ok, value = done.get(timeout=bound_s)
        except queue.Empty:
            reading = self.reading()
            self.hung = BuildTimeout(
                f"{what}: no batch after build_timeout_s={self.timeout_s}"
                + (f" x {bound_s / self.timeout_s:g}" if bound_s != self.timeout_s else "")
                + (f" (reading {reading})" if reading else "")
            )
            raise self.hung from None
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def _work(self) -> None:
        while True:
            build, done = self._jobs.get()
            try:
                done.put((True, build()))
            except BaseException as e:  # handed to the serving thread, which raises it
                done.put((False, e))


def reading_of(stream: Any) -> Callable[[], str]:
    """``() -> str``: what the root of ``stream`` reads now, where it says (its
    ``reading`` attribute), else ''."""
    root = find_root(stream)
    return lambda: str(getattr(root, "reading", "") or "")
