"""Which frames cannot be ones batchq's producers wrote for the run: the ledger's rules.

A frame's count must fit its position (a last batch at k counts k + 1 batches, an END or
ERROR frame at k counts k), it must lie within the plan's batches per epoch, and it must
fit what its shard's last frame already said. Such a frame goes to the dead list as
``impossible`` (:meth:`consumer.reader.ledger.Ledger.impossible`); a frame past the
look-ahead window is not impossible, only early (:meth:`Ledger.ahead`).
"""

from __future__ import annotations

from batchq.wire.codec import Frame, FrameKind

__all__ = ["why_impossible"]


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
