"""What the reader thread is told once, when reading starts: its settings as one value."""

from __future__ import annotations

from dataclasses import dataclass

from batchq.protocol.ranks import RankLayout

__all__ = ["ReaderSettings"]


@dataclass(frozen=True)
class ReaderSettings:
    """The reader's settings, fixed when reading starts (the stream's, at its first epoch).

    Attributes:
        hwm: the trainer's prefetch bound (frames held but not handed out).
        timeout_s: raise ProducersLost after this long with no producer alive; also the
            bound of a reconnect and of the wait for a replaced key's repair.
        writable: writable arrays: frames stored by reference are received into buffers
            of their own (no copy); frames inside the list are copied once.
        max_frame_bytes: frames above this go to the dead list without being decoded.
        on_bad_frame: 'raise' (the iterator raises FrameError) or 'skip'.
        stall_s: after this long without a frame while the trainer waits, reap dead
            producers and hand shards with a gap back to the work list.
        layout: a data-parallel job's split: the ledger holds this rank's local shards.
            None for a single trainer (a layout of world 1 is stored as None).
    """

    hwm: int
    timeout_s: float
    writable: bool = False
    max_frame_bytes: int | None = None
    on_bad_frame: str = "raise"
    stall_s: float = 5.0
    layout: RankLayout | None = None

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout.world == 1:
            # Ranks of a data-parallel job read their own list and renumber their slots
            # as local shards; a single trainer does neither.
            object.__setattr__(self, "layout", None)
