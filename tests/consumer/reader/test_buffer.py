"""consumer.reader.buffer: the ledger behind its lock, between a reader thread and the iterator."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from waiting import wait_until

from batchq.errors import ConnectionLost, StreamStopped
from batchq.wire.codec import Frame, FrameKind
from consumer.reader.buffer import Buffer
from consumer.reader.ledger import Ledger


def frame(epoch: int, shard: int, k: int, count: int | None = None) -> Frame:
    return Frame(
        kind=FrameKind.BATCH, run="r", epoch=epoch, shard=shard, k=k, g=-1, producer="p",
        last=count is not None, count=count, sources=("x",), data=((epoch, shard, k),),
        error=None, error_name=None, nbytes=0, produced_at=None,
    )  # fmt: skip


def started(shards: int = 1) -> Buffer:
    buffer = Buffer(Ledger(shards))
    buffer.start_epoch(0)
    return buffer


def alive() -> bool:
    return True


def test_frames_put_are_taken_in_order_then_the_epoch_ends() -> None:
    buffer = started()
    assert not buffer.ready()
    assert buffer.put([(frame(0, 0, 1, count=2), b"b"), (frame(0, 0, 0), b"a")], stale=0) == []
    assert buffer.ready()
    got = [buffer.take(alive, 0.05), buffer.take(alive, 0.05)]
    assert [f.k for f in got if f is not None] == [0, 1]
    assert buffer.max_buffered == 2
    assert buffer.take(alive, 0.05) is None  # every batch of the epoch handed out
    assert buffer.consumed(None) == (1, {}, [])  # the next epoch, nothing of it yet


def test_a_waiting_take_gets_the_frame_another_thread_puts() -> None:
    buffer = started()
    got: list[Any] = []
    taker = threading.Thread(target=lambda: got.append(buffer.take(alive, 0.05)))
    taker.start()
    wait_until(lambda: buffer.waiting_since is not None, what="the taker to wait")
    buffer.put([(frame(0, 0, 0, count=1), b"a")], stale=0)
    taker.join(timeout=10)
    assert not taker.is_alive() and got[0].k == 0
    assert buffer.waiting_since is None


def test_the_readers_error_is_raised_by_a_waiting_take() -> None:
    buffer = started()
    raised: list[BaseException] = []

    def take() -> None:
        try:
            buffer.take(alive, 0.05)
        except ConnectionLost as e:
            raised.append(e)

    taker = threading.Thread(target=take)
    taker.start()
    wait_until(lambda: buffer.waiting_since is not None, what="the taker to wait")
    error = ConnectionLost("redis went away")
    buffer.fail(error)
    taker.join(timeout=10)
    assert raised == [error] and buffer.ready()


def test_a_take_when_the_reader_is_gone_stops_the_stream() -> None:
    with pytest.raises(StreamStopped, match="reader thread stopped"):
        started().take(lambda: False, 0.05)


def test_impossible_frames_come_back_as_bad_with_their_reason() -> None:
    buffer = started(shards=1)
    bad = buffer.put([(frame(0, 0, 0, count=5), b"x" * 5000)], stale=2)  # a last k 0 of 5?
    assert len(bad) == 1 and bad[0][0] == b"x" * 4096 and "must count 1 batches" in bad[0][1]
    assert not buffer.ready()
    assert buffer.ledger.stale == 2


def test_a_cut_ends_the_epoch_without_the_frames_not_yet_due() -> None:
    buffer = started(shards=2)
    buffer.put([(frame(0, 1, 0), b"b")], stale=0)  # shard 1 waits for shard 0 (plan order)
    assert not buffer.ready()
    buffer.cut_epoch()  # a rank evening its count by dropping the rest
    assert buffer.ready() and buffer.take(alive, 0.05) is None


def test_a_frame_past_the_window_is_dropped_and_counted_not_bad() -> None:
    buffer = started(shards=2)
    buffer.ledger.window = 2
    # Global shard 2 (epoch 1 shard 0) is past [0, 2): a shard leased under a floor
    # further ahead; the run builds it again when the window reaches it.
    assert buffer.put([(frame(1, 0, 0, count=1), b"a")], stale=0) == []
    assert buffer.ledger.dropped_ahead == 1 and buffer.ledger.buffered == 0
    assert buffer.put([(frame(0, 0, 0, count=1), b"b")], stale=0) == []
    assert buffer.put([(frame(1, 0, 0, count=1), b"a")], stale=0) == []  # [1, 3) now
    assert buffer.ledger.dropped_ahead == 1 and buffer.ledger.buffered == 2
