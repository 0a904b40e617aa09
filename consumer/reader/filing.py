"""From resolved frame bytes to frames in the buffer: decoded (zero-copy), frames of
other runs dropped, a rank's slots renumbered as its local shards, prepared for the
trainer (:class:`consumer.reader.prepare.FramePrep`), screened (a :class:`FrameScreen`
the filer holds: the stream's params log drops frames built with params since changed),
then filed (:meth:`ReaderBuffer.put`).

What fails on the way is a bad frame: a frame that does not decode, a slot that is not
this rank's, a frame the ledger finds impossible. **The dead list** (:class:`DeadList`)
is where the reader moves every element it cannot use, with its reason (those, and a
reference that cannot be read, a shared-memory descriptor that does not check out):
each is recorded there, counted in the queue's stats by reason, and then the trainer's
policy applies: ``on_bad_frame='raise'`` raises the :class:`~batchq.errors.FrameError`
(the iterator raises it), ``'skip'`` goes on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

import msgpack
import redis

from batchq.errors import FrameError
from batchq.protocol.calls import execute_pipeline
from batchq.protocol.fields import dead_field
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import DEAD_CAP
from batchq.protocol.ranks import RankLayout
from batchq.wire import codec
from consumer.plan import ReaderBuffer, RunView
from consumer.reader.fetch import Fetched
from consumer.reader.stats import Accounting
from consumer.stream_options import ReaderSettings

__all__ = ["DeadList", "Decoded", "Filer", "FrameScreen"]

log = logging.getLogger(__name__)


class Decoded(NamedTuple):
    """One round's frames, ready to file: (frame, its raw element) in arrival order, and
    how many belonged to another run."""

    frames: list[tuple[codec.Frame, bytes]]
    stale: int


class FrameScreen(Protocol):
    """What a round's frames pass before they are filed (the stream's params log,
    :class:`consumer.params.StreamParams`): frames it says must not be yielded are
    dropped, and the shards they belong to handed back after the filing."""

    @property
    def filing(self) -> AbstractContextManager[Any]:
        """Held across a round's screening and filing (a change of the screen's own
        waits for it: a frame is filed before the change or screened after it)."""

    def screen(self, decoded: Decoded, client: redis.Redis, buffer: ReaderBuffer) -> Decoded:
        """``decoded`` less the frames that must not be filed."""

    def send_rebuilds(self, client: redis.Redis, buffer: ReaderBuffer) -> None:
        """Hand back the shards of the frames the last screens dropped."""


class Filer:
    """Decodes and files one reader's frames.

    Args:
        session: the trainer's claim (the run it reads, its rank).
        buffer: where frames go.
        settings: the reader's settings (writable, max_frame_bytes, layout).
        prepare: applied to each frame of this run before it is filed.
        dead: where bad frames go.
        accounting: where the bytes received are counted.
        screen: what a round's frames pass before they are filed (None: all are).
    """

    def __init__(
        self,
        session: RunView,
        buffer: ReaderBuffer,
        settings: ReaderSettings,
        prepare: Callable[[codec.Frame], codec.Frame] | None,
        dead: DeadList,
        accounting: Accounting,
        screen: FrameScreen | None = None,
    ) -> None:
        self.session = session
        self.screen = screen
        self.buffer = buffer
        self.settings = settings
        self.prepare = prepare
        self.dead = dead
        self.accounting = accounting

    def decode(self, fetched: list[Fetched]) -> Decoded:
        """Decode a round's resolved elements (those that are None were bad already)."""
        frames = []
        stale = 0
        writable, limit = self.settings.writable, self.settings.options.max_frame_bytes
        layout, prepare, run = self.settings.layout, self.prepare, self.session.run
        accounting = self.accounting
        for raw, _element, _key in fetched:
            if raw is None:
                continue
            accounting.nbytes += len(raw)
            # A buffer of its own (memoryview) is made writable in place by prepare.
            copy = writable and isinstance(raw, bytes)
            try:
                frame = codec.decode_frame(raw, writable=copy, max_frame_bytes=limit)
            except FrameError as e:
                self.dead.record(bytes(raw[:4096]), e)
                continue
            if frame.run != run:
                stale += 1  # counted by the buffer, under its lock
                continue
            if layout is not None:
                local = self._local(frame, raw, layout)
                if local is None:
                    continue
                frame = local
            if prepare is not None:
                frame = prepare(frame)
            frames.append((frame, raw))
        return Decoded(frames, stale)

    def _local(self, frame: codec.Frame, raw: bytes, layout: RankLayout) -> codec.Frame | None:
        """A rank's frame renumbered as its local shard; None (a bad frame) for a slot
        that is not this rank's."""
        rank = self.session.rank
        local = layout.local(frame.shard, rank)
        if local is None:
            why = f"epoch {frame.epoch} slot {frame.shard} is not rank {rank}'s"
            self.dead.record(bytes(raw[:4096]), FrameError("impossible", why))
            return None
        return dataclasses.replace(frame, shard=local)

    def file(self, decoded: Decoded, client: redis.Redis) -> None:
        """File a round's decoded frames, those the screen keeps, as one step against a
        change of the screen's; the impossible ones, and those the ledger purged, go to
        the dead list."""
        screen = self.screen
        if screen is None:
            self._put(decoded)
            return
        with screen.filing:
            self._put(screen.screen(decoded, client, self.buffer))
        screen.send_rebuilds(client, self.buffer)

    def _put(self, decoded: Decoded) -> None:
        for element, reason in self.buffer.put(decoded.frames, decoded.stale):
            self.dead.record(element, FrameError("impossible", reason))


class DeadList:
    """Records one reader's bad elements.

    Args:
        client: the reader's client.
        keys: the queue's keys.
        on_bad_frame: 'raise' or 'skip'.
    """

    def __init__(self, client: redis.Redis, keys: QueueKeys, on_bad_frame: str) -> None:
        self.client = client
        self.keys = keys
        self.on_bad_frame = on_bad_frame
        self.count = 0  # bad elements recorded

    def record(self, element: bytes, error: FrameError) -> None:
        """Move a bad element to the dead list with its reason, count it, apply the policy.

        Raises:
            FrameError: ``error`` itself, under on_bad_frame='raise'.
            ConnectionLost: the connection dropped.
        """
        self.count += 1
        record = msgpack.packb(
            {"reason": error.reason, "detail": error.detail, "element": bytes(element[:4096])}
        )
        keys = self.keys

        def record_it(pipe: Any) -> None:
            pipe.lpush(keys.dead, record)
            pipe.ltrim(keys.dead, 0, DEAD_CAP - 1)
            pipe.hincrby(keys.stats, dead_field(error.reason), 1)

        try:  # a lost connection raises ConnectionLost (converted in calls.round_trip)
            execute_pipeline(self.client, record_it)
        except redis.ResponseError as e:
            # The dead list or the counters replaced by a foreign type (or Redis full):
            # the record is lost, the policy below still applies.
            log.warning("queue %s: could not record a bad frame: %s", self.keys.queue, e)
        log.warning("queue %s: bad frame moved to the dead list: %s", self.keys.queue, error)
        if self.on_bad_frame == "raise":
            raise error
