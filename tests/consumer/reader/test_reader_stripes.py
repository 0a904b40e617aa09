"""consumer.reader.buffer's StripeView: one stripe's reader reads the one buffer in its numbers."""

from __future__ import annotations

from batchq.protocol.layout import ledger_field
from batchq.protocol.stripes import Stripes
from batchq.wire.codec import Frame, FrameKind
from consumer.reader.buffer import Buffer, StripeView
from consumer.reader.ledger import Ledger

SHARDS = 10  # per epoch; shard n of the trainer belongs to stripe n % 3


def frame(epoch: int, shard: int) -> Frame:
    return Frame(
        kind=FrameKind.BATCH, run="r", epoch=epoch, shard=shard, k=0, g=-1, producer="p",
        last=True, count=1, sources=("x",), data=((epoch, shard),), error=None,
        error_name=None, nbytes=0, produced_at=None,
    )  # fmt: skip


def three() -> tuple[Buffer, list[StripeView]]:
    buffer = Buffer(Ledger(SHARDS))
    buffer.start_epoch(0)
    return buffer, [StripeView(buffer, k, Stripes(3)) for k in range(3)]


def test_each_stripe_publishes_how_many_of_its_shards_are_below_the_floor() -> None:
    buffer, views = three()
    for shard in range(4):  # shards 0-3 complete: the trainer's floor is 4
        views[shard % 3].put([(frame(0, shard), b"")], stale=0)
    assert buffer.floor() == 4
    assert [v.floor() for v in views] == [2, 1, 1]  # 0,3 | 1 | 2
    assert [v.fill() for v in views] == [(4, 2), (4, 1), (4, 1)]


def test_a_stripes_published_floor_is_stale_once_the_trainers_passed_it() -> None:
    buffer, views = three()
    for shard in range(4):
        buffer.put([(frame(0, shard), b"")], stale=0)
    # Idle (the buffer holds its hwm): stripe 1 published 1 (shard 1 below): not stale
    # until a shard of its own (4) completes.
    assert views[1].idle(hwm=1, published_floor=1, wait_s=0) == (True, False)
    buffer.put([(frame(0, 4), b"")], stale=0)
    assert views[1].idle(hwm=1, published_floor=1, wait_s=0) == (True, True)
    assert views[2].idle(hwm=1, published_floor=1, wait_s=0) == (True, False)


def test_requeues_and_lost_runs_are_told_in_the_stripes_numbers() -> None:
    buffer, views = three()
    buffer.put([(frame(0, 0), b""), (frame(0, 5), b"")], stale=0)
    # The window of 4 of a stripe's shards past its floor: 12 of the trainer's.
    assert buffer.incomplete(12) == [1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert views[1].incomplete(4) == [0, 1, 2, 3]  # shards 1, 4, 7, 10 as its m
    assert views[2].incomplete(4) == [0, 2, 3]  # 2, 8, 11 (5 arrived)
    first, pairs = views[2].received()
    assert first == 0 and pairs == [(ledger_field(0, 1), "d")]  # shard 5 = its m 1
    assert views[0].received() == (0, [(ledger_field(0, 0), "d")])


def test_errors_and_waits_are_the_buffers() -> None:
    buffer, views = three()
    error = RuntimeError("stripe 2's reader stopped")
    views[2].fail(error)
    assert buffer.error is error and views[0].error is error
    assert views[1].dropped_ahead == 0 and views[0].dropped_ahead == buffer.dropped_ahead
