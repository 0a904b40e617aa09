"""The frames between the reader thread, which files them, and the iterator, which takes
them: the ledger and the one lock that guards it.

The :class:`Buffer` is the only owner of the ledger once the reader has started: the
reader puts frames in (:meth:`Buffer.put`), hands its error over as a value
(:meth:`Buffer.fail`) and reads what it needs (room, the floor, what is missing, what
arrived) through the methods here, as the stream starts epochs, takes frames, skips
errors and reads its position. Each method takes the lock itself and
wakes the other side when it changed something the other side waits for (a frame, room
in the look-ahead, a new epoch, an error).

A striped queue (:mod:`batchq.protocol.stripes`) is read by one reader thread per
stripe, all filing into the stream's one buffer (the ledger, in the trainer's own shard
numbers). A :class:`StripeView` is that buffer (the same ledger, lock and error) for the
reader of stripe k: what the reader sends to its stripe (the floor it publishes, the
shards it requeues, the ledger it re-creates a lost run from) comes out in the stripe's
numbers, and only the stripe's own shards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from batchq.errors import StreamStopped
from batchq.protocol.stripes import Stripes
from batchq.wire.codec import Frame
from consumer.reader.ledger import Ledger

__all__ = ["Buffer", "StripeView"]


class Buffer:
    """The ledger behind its lock, shared by one reader thread and one iterator.

    Args:
        ledger: the stream's ledger (preloaded for a resume before the reader starts).
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.cond = threading.Condition()  # guards the ledger; each side waits on it
        self.error: BaseException | None = None  # what stopped the reader
        self.waiting_since: float | None = None  # the iterator waits for a frame
        self.max_buffered = 0  # the most frames held at once (a figure)
        self.losses = 0  # times a reader re-created the run Redis lost (counts to say again)

    # -- the reader's side ---------------------------------------------------------------

    def put(self, frames: list[tuple[Frame, bytes]], stale: int) -> list[tuple[bytes, str]]:
        """File decoded frames (with their raw element); returns the bad ones, (element,
        reason), for the dead list: impossible frames and those the ledger purged.

        Frames past the look-ahead window are dropped and counted
        (``ledger.dropped_ahead``): the run builds them again when they are due.
        """
        bad: list[tuple[bytes, str]] = []
        with self.cond:
            ledger = self.ledger
            ledger.stale += stale
            for frame, raw in frames:
                reason = ledger.impossible(frame)
                if reason is not None:
                    bad.append((raw[:4096], reason))
                elif ledger.ahead(frame):
                    ledger.dropped_ahead += 1
                else:
                    ledger.add(frame)
            for frame, why in ledger.purged:
                where = f"epoch {frame.epoch} shard {frame.shard} k {frame.k}"
                bad.append((b"", f"{where} ({frame.producer}): {why}"))
            ledger.purged.clear()
            self.cond.notify_all()
        return bad

    def fail(self, error: BaseException) -> None:
        """The reader stopped on ``error``: the iterator raises it."""
        with self.cond:
            self.error = error
            self.cond.notify_all()

    def lost(self) -> None:
        """Redis lost the queue (the reader re-created the run): the iterator says its
        shard counts again (:meth:`consumer.epoch.EpochFeed` reads ``losses``)."""
        with self.cond:
            self.losses += 1

    def wake(self) -> None:
        """Wake whoever waits (the reader is asked to stop)."""
        with self.cond:
            self.cond.notify_all()

    def idle(self, hwm: int, published_floor: int, wait_s: float) -> tuple[bool, bool]:
        """Whether the reader has nothing to pop, and whether the floor is stale; idle
        and not stale, it first waits (at most ``wait_s``) for the iterator to make room.

        Args:
            hwm: the trainer's prefetch bound; past it the reader pops only while the
                next frame in order is missing.
            published_floor: the floor the last pop sent. It was read before the frames
                that pop brought were filed: an idle reader publishes the floor they
                advanced it to (stale: True) rather than wait, or producers may wait at
                the window meanwhile.

        Returns:
            (idle, stale).
        """
        with self.cond:
            ledger = self.ledger
            idle = ledger.buffered >= hwm and not ledger.needs_more()
            stale = idle and ledger.window_base() > published_floor
            if idle and not stale:
                self.cond.wait(timeout=wait_s)
        return idle, stale

    def fill(self) -> tuple[int, int]:
        """(frames held, floor): how much room a pop has, and the floor it publishes (the
        look-ahead window's base, :meth:`Ledger.window_base`)."""
        with self.cond:
            return self.ledger.buffered, self.ledger.window_base()

    def floor(self) -> int:
        """The floor the trainer publishes: the look-ahead window's base (global number,
        :meth:`Ledger.window_base`)."""
        with self.cond:
            return self.ledger.window_base()

    def purge(self, stale: Callable[[int, Frame], bool]) -> list[tuple[int, int, int, int]]:
        """Drop held frames built with params since changed (:meth:`Ledger.purge`):
        (epoch, shard, batches kept, frames dropped) per shard."""
        with self.cond:
            return self.ledger.purge(stale)

    def prefix(self, epoch: int, shard: int) -> int:
        """The leading batches of a shard the trainer has (handed out or held)."""
        with self.cond:
            return self.ledger.prefix(epoch, shard)

    def held_frames(self) -> list[Frame] | None:
        """The frames held and not handed out (:meth:`Ledger.held_frames`)."""
        with self.cond:
            return self.ledger.held_frames()

    def waited_since(self) -> float | None:
        """Since when the iterator waits for a frame (None: it does not)."""
        with self.cond:
            return self.waiting_since

    def missing(self) -> tuple[int, list[int]]:
        """(epoch, its shards not complete): what the iterator waits for."""
        with self.cond:
            return self.ledger.epoch, self.ledger.missing_shards()

    def incomplete(self, window: int) -> list[int]:
        """The shards of the look-ahead window (``window`` shards from the floor) that are
        not complete, as global shard numbers."""
        with self.cond:
            return self.ledger.incomplete(self.ledger.floor(), window)

    def received(self) -> tuple[int, list[tuple[str, str]]]:
        """(the current epoch's first shard, every shard received from it on as ledger
        pairs): what a run re-created after Redis lost the queue starts from."""
        with self.cond:
            ledger = self.ledger
            return ledger.epoch * ledger.shards, ledger.received_pairs()

    @property
    def dropped_ahead(self) -> int:
        """Frames past the look-ahead window dropped so far (written by :meth:`put`)."""
        return self.ledger.dropped_ahead

    # -- the iterator's side -------------------------------------------------------------

    def start_epoch(self, epoch: int) -> None:
        """The iterator starts ``epoch``: frames of earlier ones go, room opens."""
        with self.cond:
            self.ledger.start_epoch(epoch)
            self.cond.notify_all()

    def ready(self) -> bool:
        """Whether the epoch's next step (a frame, its end, an error) needs no wait."""
        with self.cond:
            ledger = self.ledger
            return self.error is not None or ledger.epoch_done() or ledger.next_frame_ready()

    def take(self, alive: Callable[[], bool], poll_s: float) -> Frame | None:
        """The epoch's next frame (waiting for it), or None at the epoch's end.

        Args:
            alive: whether the reader thread still runs (checked every ``poll_s``).
            poll_s: how often a wait looks at the reader.

        Raises:
            BaseException: what stopped the reader.
            StreamStopped: the reader thread ended without an error.
        """
        with self.cond:
            ledger = self.ledger
            while True:
                self.max_buffered = max(self.max_buffered, ledger.buffered)
                frame = ledger.next_frame()
                if frame is not None:
                    self.cond.notify_all()  # room in the look-ahead
                    return frame
                if ledger.epoch_done():
                    self.cond.notify_all()
                    return None
                self._wait(alive, poll_s)

    def _wait(self, alive: Callable[[], bool], poll_s: float) -> None:
        """Wait (holding the lock) until a frame arrives or the reader fails."""
        ledger = self.ledger
        self.waiting_since = time.monotonic()
        try:
            while ledger.next_frame_ready() is False and not ledger.epoch_done():
                if self.error is not None:
                    raise self.error
                if not alive():
                    raise StreamStopped("the reader thread stopped")
                self.cond.wait(timeout=poll_s)
        finally:
            self.waiting_since = None

    def cut_epoch(self) -> None:
        """End the epoch where it is (a rank evening its count by dropping the rest)."""
        with self.cond:
            self.ledger.cut_epoch()
            self.cond.notify_all()

    def skip_error(self, frame: Frame) -> None:
        """Skip the shard whose ERROR frame this is (``on_producer_error='skip'``)."""
        with self.cond:
            self.ledger.skip_error(frame)

    def consumed(self, held_back: dict[int, int] | None) -> tuple[int, dict[int, int], list[int]]:
        """The ledger's position (see :meth:`Ledger.consumed`), read under the lock."""
        with self.cond:
            return self.ledger.consumed(held_back)

    def counts_since(self, since: int) -> tuple[int, dict[int, int]]:
        """The shard counts the ledger came to know after cursor ``since``
        (:meth:`Ledger.counts_since`), read under the lock."""
        with self.cond:
            return self.ledger.counts_since(since)

    @property
    def shards(self) -> int:
        """Shards per epoch in the ledger's terms (a rank's: its local shards)."""
        return self.ledger.shards

    @property
    def skipped(self) -> int:
        """Shards skipped under ``on_producer_error='skip'``."""
        return self.ledger.skipped


class StripeView(Buffer):
    """The shared ``buffer`` as stripe ``stripe`` of ``stripes`` reads it.

    Args:
        buffer: the stream's buffer (the one ledger).
        stripe: this reader's stripe.
        stripes: how the run's shards are dealt among its stripes.
    """

    def __init__(self, buffer: Buffer, stripe: int, stripes: Stripes) -> None:
        # The same ledger and lock: no state of its own but its numbers.
        self.ledger = buffer.ledger
        self.cond = buffer.cond
        self.shared = buffer
        self.stripe = stripe
        self.stripes = stripes

    @property
    def error(self) -> BaseException | None:
        return self.shared.error

    @error.setter
    def error(self, value: BaseException | None) -> None:
        self.shared.error = value

    @property
    def waiting_since(self) -> float | None:
        return self.shared.waiting_since

    @waiting_since.setter
    def waiting_since(self, value: float | None) -> None:
        self.shared.waiting_since = value

    @property
    def max_buffered(self) -> int:
        return self.shared.max_buffered

    @max_buffered.setter
    def max_buffered(self, value: int) -> None:
        self.shared.max_buffered = value

    def lost(self) -> None:
        self.shared.lost()

    def idle(self, hwm: int, published_floor: int, wait_s: float) -> tuple[bool, bool]:
        """As :meth:`Buffer.idle`, ``published_floor`` being the stripe's: stale once the
        trainer's floor has passed the last one that stripe floor stands for."""
        return super().idle(hwm, self.stripes.below(published_floor, self.stripe), wait_s)

    def fill(self) -> tuple[int, int]:
        """(frames held, the stripe's floor)."""
        held, floor = super().fill()
        return held, self.stripes.floor_of(floor, self.stripe)

    def floor(self) -> int:
        """The stripe's floor: its shards below the trainer's."""
        return self.stripes.floor_of(super().floor(), self.stripe)

    def incomplete(self, window: int) -> list[int]:
        """The stripe's shards (its m) not complete among the ``window`` of the stripe
        past its floor (the trainer's N x ``window``)."""
        every = super().incomplete(window * self.stripes.count)
        return self.stripes.shards_of(every, self.stripe)

    def received(self) -> tuple[int, list[tuple[str, str]]]:
        """(the stripe's floor at the current epoch's first shard, the stripe's pairs of
        what was received from it on, in the stripe's numbers)."""
        first, pairs = super().received()
        split = self.stripes.split(pairs, self.ledger.shards)
        return self.stripes.floor_of(first, self.stripe), split[self.stripe]

    @property
    def dropped_ahead(self) -> int:
        """Counted once, by stripe 0's reader (it is the stream's figure)."""
        return self.shared.dropped_ahead if self.stripe == 0 else 0
