"""The trainer's ledger: epochs assembled from frames in any order, duplicates dropped."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from batchq.wire.codec import Frame, FrameKind
from consumer.reader.ledger import Ledger


def frame(
    epoch: int,
    shard: int,
    k: int,
    *,
    count: int | None = None,
    kind: FrameKind = FrameKind.BATCH,
) -> Frame:
    return Frame(
        kind=kind,
        run="r",
        epoch=epoch,
        shard=shard,
        k=k,
        g=-1,
        producer="p",
        last=count is not None,
        count=count,
        sources=("x",),
        data=((epoch, shard, k),),
        error="Traceback: boom" if kind == FrameKind.ERROR else None,
        error_name="RuntimeError" if kind == FrameKind.ERROR else None,
        nbytes=0,
        produced_at=None,
    )


def drain(ledger: Ledger) -> list[tuple[int, int, int]]:
    out = []
    while (f := ledger.next_frame()) is not None:
        out.append(f.data[0])
    return out


def epoch_frames(epoch: int, sizes: list[int]) -> list[Frame]:
    return [
        frame(epoch, s, k, count=n if k == n - 1 else None)
        for s, n in enumerate(sizes)
        for k in range(n)
    ]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    dup=st.booleans(),
)
def test_any_arrival_order_gives_plan_order_once(sizes: list[int], seed: int, dup: bool) -> None:
    frames = epoch_frames(0, sizes) + epoch_frames(1, sizes)
    if dup:
        frames += frames[: len(frames) // 2]
    random.Random(seed).shuffle(frames)
    ledger = Ledger(len(sizes), ordered=True)
    for f in frames:
        ledger.add(f)
    expected0 = [(0, s, k) for s, n in enumerate(sizes) for k in range(n)]
    assert drain(ledger) == expected0
    assert ledger.epoch_done()
    ledger.start_epoch(1)
    assert drain(ledger) == [(1, s, k) for s, k in ((s, k) for _, s, k in expected0)]
    assert ledger.epoch_done() and ledger.buffered == 0


def test_ordered_waits_for_the_gap_and_floor_follows_completion() -> None:
    ledger = Ledger(2, ordered=True)
    ledger.add(frame(0, 1, 0, count=1))
    assert ledger.next_frame() is None and ledger.needs_more()
    assert ledger.floor() == 0
    ledger.add(frame(0, 0, 0))
    assert drain(ledger) == [(0, 0, 0)]
    ledger.add(frame(0, 0, 1, count=2))
    assert ledger.floor() == 2  # epoch 0 fully received: the next is epoch 1 shard 0
    assert drain(ledger) == [(0, 0, 1), (0, 1, 0)]
    assert ledger.epoch_done()


def test_arrival_order_and_duplicates_and_stale_frames() -> None:
    ledger = Ledger(2, ordered=False)
    for f in (frame(0, 1, 0, count=1), frame(0, 0, 0, count=1), frame(0, 1, 0, count=1)):
        ledger.add(f)
    assert drain(ledger) == [(0, 1, 0), (0, 0, 0)]
    assert ledger.duplicates == 1 and ledger.epoch_done()
    ledger.start_epoch(1)
    assert not ledger.add(frame(0, 0, 0, count=1))
    assert ledger.stale == 1


def test_empty_shard_end_frame_completes_it() -> None:
    ledger = Ledger(1)
    ledger.add(frame(0, 0, 0, count=0, kind=FrameKind.END))
    assert ledger.next_frame() is None and ledger.epoch_done()


def test_error_frame_is_handed_out_after_the_batches_before_it() -> None:
    ledger = Ledger(1)
    ledger.add(frame(0, 0, 0))
    ledger.add(frame(0, 0, 1, count=1, kind=FrameKind.ERROR))
    first = ledger.next_frame()
    assert first is not None and first.kind == FrameKind.BATCH
    error = ledger.next_frame()
    assert error is not None and error.kind == FrameKind.ERROR
    assert ledger.missing_shards() == [0]


def test_arrival_order_hands_a_shards_batches_out_as_a_prefix() -> None:
    # Batches 1 and 2 of shard 0 arrived without batch 0 (it was dropped past the window):
    # they wait for the shard's rebuild, so what was handed out stays a prefix, which is
    # what consumed() counts (a state saved meanwhile resumes exactly).
    ledger = Ledger(2, ordered=False)
    ledger.add(frame(0, 0, 1))
    ledger.add(frame(0, 0, 2, count=3))
    ledger.add(frame(0, 1, 0, count=1))
    assert drain(ledger) == [(0, 1, 0)]
    assert ledger.needs_more() and ledger.consumed() == (0, {1: 1}, [1])
    for k in range(3):  # the rebuild: 1 and 2 are duplicates
        ledger.add(frame(0, 0, k, count=3 if k == 2 else None))
    assert ledger.duplicates == 2
    assert drain(ledger) == [(0, 0, 0), (0, 0, 1), (0, 0, 2)]
    assert ledger.epoch_done()


def test_the_frames_held_are_listed_in_plan_order_for_a_detach() -> None:
    ledger = Ledger(3)
    for f in [frame(0, 1, 1, count=2), frame(0, 0, 0), frame(1, 0, 0), frame(0, 1, 0)]:
        ledger.add(f)
    ledger.add(frame(0, 0, 1, kind=FrameKind.END, count=1))  # shard 0: one batch
    assert ledger.next_frame() is not None  # (0, 0, 0) handed out
    held = ledger.held_frames()
    assert held is not None
    # Shard 0 is handed out entirely; its END frame is not given back.
    assert [(f.epoch, f.shard, f.k) for f in held] == [(0, 1, 0), (0, 1, 1), (1, 0, 0)]
    ledger.add(frame(0, 2, 0, kind=FrameKind.ERROR))
    assert ledger.held_frames() is None  # a failed shard is built again instead


def test_an_end_frame_of_a_shard_not_handed_out_is_given_back_after_its_batches() -> None:
    ledger = Ledger(2)
    ledger.add(frame(0, 1, 1, kind=FrameKind.END, count=1))
    ledger.add(frame(0, 1, 0))
    held = ledger.held_frames()
    assert held is not None
    assert [(f.shard, f.k, f.kind) for f in held] == [
        (1, 0, FrameKind.BATCH),
        (1, 1, FrameKind.END),
    ]
