"""What the trainer has of one shard (the ledger's unit, :mod:`consumer.reader.ledger`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from batchq.wire.codec import Frame

__all__ = ["ShardState"]


@dataclass
class ShardState:
    """What the trainer has of one shard."""

    frames: dict[int, Frame] = field(default_factory=dict)
    received: set[int] = field(default_factory=set)
    count: int | None = None  # batches in the shard, once its last frame arrived
    error: Frame | None = None
    skip: int = 0  # batches handed out before a resume (a prefix of the shard)
    given: int = 0  # batches handed out since
    end: Frame | None = None  # the END frame that said the count, if one did

    @property
    def prefix(self) -> int:
        """How many leading batches (k = 0, 1, ...) have arrived."""
        n = 0
        while n in self.received:
            n += 1
        return n

    @property
    def complete(self) -> bool:
        """True once the last frame and every batch before it arrived."""
        return self.count is not None and len(self.received) >= self.count

    @property
    def handed_out(self) -> bool:
        """True once every batch of a complete shard was handed out."""
        return self.skip + self.given >= (self.count or 0)

    def drop(self, stale: Callable[[Frame], bool]) -> tuple[list[Frame], bool]:
        """Drop the held frames (and an ERROR or END frame) that ``stale`` says go; a
        count said by a frame at or past the first one dropped goes too.

        Returns:
            (the held batch frames dropped, whether anything was: an ERROR or END frame
            is not held, so it is not among them).
        """
        gone = [k for k, f in self.frames.items() if stale(f)]
        first = min(gone, default=None)
        for frame in (self.error, self.end):
            if frame is not None and stale(frame):
                first = frame.k if first is None else min(first, frame.k)
                self.error = None if frame is self.error else self.error
                self.end = None if frame is self.end else self.end
        if first is None:
            return [], False
        dropped = [self.frames.pop(k) for k in gone]
        self.received.difference_update(gone)
        if self.count is not None and first <= self.count:
            self.count = None
        return dropped, True
