"""consumer.epoch: how a stream's epochs are handed out and counted (fakeredis, frames
made here)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from batchq.protocol.keys import QueueKeys
from batchq.wire.codec import FrameHeader, FrameKind, decode_frame, encode_frame
from consumer.balance import Balancer
from consumer.epoch import EpochFeed
from consumer.reader.buffer import Buffer
from consumer.reader.ledger import Ledger
from consumer.reader.prepare import FramePrep
from consumer.reader.stats import TrainerStats

KEYS = QueueKeys("q")


def feed_of(fake_redis: Any, shards: int, totals: list[int]) -> tuple[EpochFeed, Buffer]:
    """Rank 0 of 2, its epoch of ``shards`` one-batch shards in the buffer, its count
    and the other rank's fixed by the plan (``totals``), 'pad'."""
    buffer = Buffer(Ledger(shards))
    for shard in range(shards):
        header = FrameHeader(FrameKind.BATCH, "r", 0, shard, 0, "p", ("x",), last=True, count=1)
        raw = bytes(encode_frame(header, (np.arange(2) + shard,)))
        assert buffer.put([(decode_frame(raw), raw)], 0) == []
    evener = Balancer(fake_redis, KEYS, 0, 2, "pad", 1.0, keep=2, counted=lambda e: totals)
    prep = FramePrep(("x",), None, "q")
    return EpochFeed(buffer, lambda: True, evener, TrainerStats(), prep, Counter()), buffer


def test_the_epoch_yielded_counts_pads_and_moves_on_once_the_epoch_ended(
    fake_redis: Any,
) -> None:
    feed, _ = feed_of(fake_redis, 2, [2, 4])
    frames = feed.frames(0, skip_errors=False, queue="q", progress=False, total=None)
    assert [next(frames).shard for _ in range(3)] == [0, 1, 0]  # its share, then a pad
    assert feed.yielding(0) == (0, 3) and feed.yielding(1) == (0, 2)
    assert [f.shard for f in frames] == [1]
    assert feed.yielding(0) == (1, 0)  # the epoch ended: the next one, none yielded
    assert feed.yielding(1) == (0, 3)  # a wrapper still holds its last batch


def test_a_wrapper_s_held_pads_are_no_batches_of_the_ledger(fake_redis: Any) -> None:
    feed, buffer = feed_of(fake_redis, 2, [2, 4])
    frames = feed.frames(0, skip_errors=False, queue="q", progress=False, total=None)
    assert [next(frames).shard for _ in range(4)] == [0, 1, 0, 1]
    # The wrapper holds the last three it took: shard 1's batch and two pads.
    held = {0: 1, 1: 2}
    assert feed.ledger_held(held) == {1: 1}
    assert buffer.consumed(feed.ledger_held(held)) == (0, {0: 1}, [0])
    assert feed.ledger_held({0: 1, 1: 1}) is None  # the two pads alone
    assert buffer.consumed(feed.ledger_held({0: 1, 1: 1})) == (1, {}, [])


def test_a_state_before_the_epoch_s_first_batch_says_where_the_rank_is(
    fake_redis: Any,
) -> None:
    # Resumed 3 batches into epoch 2 (the feed made with the checkpoint's count): a
    # state taken before the first batch, even with the epoch's iterator open, is there.
    buffer = Buffer(Ledger(2))
    evener = Balancer(fake_redis, KEYS, 0, 2, "pad", 1.0, keep=2)
    prep = FramePrep(("x",), None, "q")
    feed = EpochFeed(buffer, lambda: True, evener, TrainerStats(), prep, Counter(), (2, 3))
    assert feed.yielding(0) == (2, 3)
    frames = feed.frames(2, skip_errors=False, queue="q", progress=False, total=None, already=3)
    assert feed.yielding(0) == (2, 3)  # opened, nothing taken yet
    del frames


def test_shard_counts_are_said_again_once_redis_lost_the_queue(fake_redis: Any) -> None:
    # A Filter's plan: the rank says each shard's count as its ledger learns it; Redis
    # losing the queue takes them, and the reader re-creating the run has them said again
    # (a state taken after would have put the rank in its shard 0).
    buffer = Buffer(Ledger(3))
    for shard in range(3):
        header = FrameHeader(FrameKind.BATCH, "r", 0, shard, 0, "p", ("x",), last=True, count=1)
        raw = bytes(encode_frame(header, (np.arange(2) + shard,)))
        assert buffer.put([(decode_frame(raw), raw)], 0) == []
    evener = Balancer(fake_redis, KEYS, 0, 2, "drop", 1.0, keep=2, shards=3, ordered=True)
    fake_redis.hset(KEYS.counts, mapping={"0:1": "=9", "n:0:1:0": "1"})  # the other rank
    feed = EpochFeed(
        buffer, lambda: True, evener, TrainerStats(), FramePrep(("x",), None, "q"), Counter()
    )
    frames = feed.frames(0, skip_errors=False, queue="q", progress=False, total=None)
    assert next(frames).shard == 0
    assert evener.shard_counts(0) == [[1, 1, 1], [1]]
    fake_redis.delete(KEYS.counts)  # Redis restarted empty
    buffer.lost()
    assert next(frames).shard == 1
    assert evener.shard_counts(0) == [[1, 1, 1], []]
