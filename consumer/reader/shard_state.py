"""One shard as the ledger holds it (its unit, :mod:`consumer.reader.ledger`): what the
trainer has of it (:class:`ShardState`), and which frames cannot be ones batchq's
producers wrote for it (:func:`why_impossible`, the ledger's rules).

A frame's count must fit its position (a last batch at k counts k + 1 batches, an END or
ERROR frame at k counts k), it must lie within the plan's batches per epoch, and it must
fit what its shard's last frame already said. Such a frame goes to the dead list as
``impossible`` (:meth:`consumer.reader.ledger.Ledger.impossible`); a frame past the
look-ahead window is not impossible, only early (:meth:`Ledger.ahead`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from batchq.wire.codec import Frame, FrameKind

__all__ = ["ShardState", "why_impossible"]


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


def why_impossible(frame: Frame, epoch_batches: int | None, shard_count: int | None) -> str | None:
    """Why ``frame`` is impossible, or None.

    Args:
        epoch_batches: the plan's batches per epoch (None or negative: not known).
        shard_count: the batches of the frame's shard, as its last frame said (None: not
            arrived yet).
    """
    why = _count_error(frame)
    if why is None:
        why = _plan_error(frame, epoch_batches)
    if why is None:
        why = _shard_error(frame, shard_count)
    if why is None:
        return None
    return f"epoch {frame.epoch} shard {frame.shard} k {frame.k}: {why}"


def _count_error(frame: Frame) -> str | None:
    k, count = frame.k, frame.count
    if frame.kind != FrameKind.BATCH:
        if count != k:
            return f"an {frame.kind.name} frame at k {k} must count {k}, it says {count}"
    elif frame.last and count != k + 1:
        return f"a last batch must count {k + 1} batches, it says {count}"
    return None


def _plan_error(frame: Frame, eb: int | None) -> str | None:
    if eb is None or eb < 0:
        return None
    k = frame.k
    if k >= eb if frame.kind == FrameKind.BATCH else k > eb:
        return f"beyond the plan's {eb} batches per epoch"
    return None


def _shard_error(frame: Frame, shard_count: int | None) -> str | None:
    if shard_count is None or frame.kind == FrameKind.ERROR:
        return None
    if frame.kind == FrameKind.BATCH and frame.k >= shard_count:
        return f"the shard has {shard_count} batches"
    if frame.last and frame.count != shard_count:
        return f"says {frame.count} batches, the shard's last frame said {shard_count}"
    return None
