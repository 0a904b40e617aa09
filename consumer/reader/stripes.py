"""One stripe's view of the trainer's buffer: the reader of a stripe files into the one
ledger and reads it in its stripe's numbers.

A striped queue (:mod:`batchq.protocol.stripes`) is read by one reader thread per
stripe, all filing into the stream's one :class:`Buffer` (the ledger, in the trainer's
own shard numbers). A :class:`StripeView` is that buffer (the same ledger, lock and
error) for the reader of stripe k: what the reader sends to its stripe (the floor it
publishes, the shards it requeues, the ledger it re-creates a lost run from) comes out
in the stripe's numbers, and only the stripe's own shards.
"""

from __future__ import annotations

from batchq.protocol.stripes import Stripes
from consumer.reader.buffer import Buffer

__all__ = ["StripeView"]


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
