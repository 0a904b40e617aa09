"""The ledger's part in steering the producers: the floor it publishes never runs more
than the window past the trainer's position (so the look-ahead D is fixed), and frames
held that a change made stale are purged, their shards' counts forgotten."""

from __future__ import annotations

import dataclasses

from batchq.wire.codec import Frame, FrameKind
from consumer.reader.ledger import Ledger


def frame(
    shard: int, k: int, *, count: int | None = None, version: int = 0, epoch: int = 0
) -> Frame:
    return Frame(
        kind=FrameKind.BATCH, run="r", epoch=epoch, shard=shard, k=k, g=-1, producer="p",
        last=count is not None, count=count, sources=("x",), data=((shard, k),), error=None,
        error_name=None, nbytes=0, produced_at=None, params_version=version,
    )  # fmt: skip


def test_the_published_floor_stays_within_the_window_of_the_position() -> None:
    ledger = Ledger(20)
    ledger.window = 4
    for s in range(10):
        ledger.add(frame(s, 0, count=1))
    assert ledger.floor() == 10  # complete, not handed out
    assert ledger.base() == 0 and ledger.window_base() == 4  # capped: position + window
    for _ in range(3):
        ledger.next_frame()
    assert ledger.base() == 3 and ledger.window_base() == 7
    # Frames past the capped base plus the window are not filed (they come again).
    assert ledger.ahead(frame(11, 0)) and not ledger.ahead(frame(10, 0))
    # Handed out completely, an epoch's shards move the base on; it never moves back.
    while ledger.next_frame() is not None:
        pass
    assert ledger.base() == 10 and ledger.window_base() == 10


def test_purge_drops_stale_frames_held_and_the_count_they_said() -> None:
    ledger = Ledger(4)
    for k in range(3):
        ledger.add(frame(0, k, count=3 if k == 2 else None))
    ledger.add(frame(1, 0, count=1))
    assert ledger.next_frame() is not None  # shard 0, batch 0 handed out
    assert ledger.floor() == 2
    # A change from shard 0's batch 1 on: its batches 1 and 2 and shard 1 are stale.
    stale = {(0, 1), (0, 2), (1, 0)}
    rows = ledger.purge(lambda epoch, f: (f.shard, f.k) in stale)
    assert rows == [(0, 0, 1, 2), (0, 1, 0, 1)]  # (epoch, shard, kept, dropped)
    assert ledger.buffered == 0 and ledger.floor() == 0
    assert ledger.next_frame() is None  # batch 1 must come again
    # The rebuilt batches arrive with the new version and the shard completes again.
    for k in (1, 2):
        ledger.add(dataclasses.replace(frame(0, k, count=3 if k == 2 else None), params_version=1))
    assert [ledger.next_frame().k for _ in range(2)] == [1, 2]  # type: ignore[union-attr]
    assert ledger.prefix(0, 0) == 3 and ledger.prefix(0, 1) == 0


def test_purge_forgets_an_end_frame_that_said_a_shard_was_empty() -> None:
    ledger = Ledger(2)
    end = dataclasses.replace(frame(0, 0, count=0), kind=FrameKind.END)
    ledger.add(end)
    assert ledger.floor() == 1
    assert ledger.purge(lambda epoch, f: f.kind == FrameKind.END) == [(0, 0, 0, 0)]
    assert ledger.floor() == 0
