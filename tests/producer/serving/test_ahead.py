"""producer.serving.ahead: when a producer keeps a shard leased ahead, what a dropped one frees."""

from __future__ import annotations

from pathlib import Path

import fakeredis
import numpy as np
from frame_args import encode_with
from shm_pair import shm_pair

from batchq.wire.codec import FrameKind
from producer.serving.ahead import AHEAD_MAX_BUILD_S, MAX_LEASES_AHEAD, Ahead, Lease, Ready
from producer.serving.transport import ShmFrame

FIELDS = {"run": "ab12", "epoch": 0, "shard": 0, "k": 0, "producer": "p"}


def test_two_ahead_only_for_quick_shards_while_the_trainer_waits() -> None:
    ahead = Ahead()
    assert ahead.wanted(0.0) == 1  # no push seen yet: the list's state is unknown
    ahead.depth = 1  # the last push found the list empty: the trainer waits for us
    assert ahead.wanted(AHEAD_MAX_BUILD_S / 2) == MAX_LEASES_AHEAD == 2
    assert ahead.wanted(AHEAD_MAX_BUILD_S * 2) == 1  # a slow shard: others build in parallel
    ahead.depth = 5  # the list holds frames: trainer-bound, nothing to gain
    assert ahead.wanted(0.0) == 1


def test_a_ready_shard_is_handed_to_its_own_lease_only(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    transport, _trainer = shm_pair(tmp_path, fake_redis, 2)
    frame = encode_with(
        transport.encode, FrameKind.BATCH, **FIELDS, sources=("x",), data=(np.zeros(10),)
    )
    assert isinstance(frame, ShmFrame)
    ahead = Ahead()
    ahead.ready = Ready("3:t", iter(()), (None, True), frame, None, 0.001)
    assert ahead.take_ready("4:t") is None  # another lease: discarded, its segment freed
    assert frame.segment.is_free() and ahead.ready is None
    ahead.ready = Ready("3:t", iter(()), None, None, None, 0.001)
    assert ahead.take_ready("3:t") is not None


def test_dropping_frees_the_built_frame_and_forgets_the_leases(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    transport, _trainer = shm_pair(tmp_path, fake_redis, 2)
    frame = encode_with(
        transport.encode, FrameKind.BATCH, **FIELDS, sources=("x",), data=(np.zeros(10),)
    )
    ahead = Ahead()
    ahead.leases.append(Lease(3, 0, "t", 4, 1))
    ahead.ready = Ready("3:t", iter(()), (None, True), frame, None, 0.001)
    ahead.drop()
    assert not ahead.leases and ahead.ready is None
    assert isinstance(frame, ShmFrame) and frame.segment.is_free()
