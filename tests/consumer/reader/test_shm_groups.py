"""Shared memory for a run read by several groups: one segment mapped by every group's
trainer on the host, reused only once every group it went to released it (one release
word per group slot in the segment's header, batchq.wire.shm)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import fakeredis
import numpy as np
from frame_args import encode_with

from batchq.protocol.keys import QueueKeys
from batchq.wire import codec
from batchq.wire.codec import FrameKind
from consumer.reader.shm_frames import SWEEP_S, TrainerShm
from producer.serving.membership import RunPosition
from producer.serving.transport import ShmFrame, Transport

FIELDS: dict[str, Any] = {"run": "ab12", "epoch": 0, "shard": 0, "k": 0, "producer": "p"}


def groups_pair(
    folder: Path, client: fakeredis.FakeRedis, slots: tuple[int, ...]
) -> tuple[Transport, dict[int, TrainerShm]]:
    """A producer of a run of ``max(slots) + 1`` group slots, and a trainer per slot of
    ``slots`` on this host (each published its host for its slot)."""
    keys = QueueKeys("q")
    trainers = {}
    for slot in slots:
        trainers[slot] = TrainerShm(keys, "auto", str(folder))
        trainers[slot].publish(client, 10, slot)
    producer = Transport("auto", str(folder), keys, "p", 2)
    producer.joined(client, RunPosition("ab12", groups=max(slots) + 1))
    return producer, trainers


def send(producer: Transport, value: np.ndarray, mask: int) -> ShmFrame:
    frame = encode_with(
        producer.encode, FrameKind.BATCH, **FIELDS, sources=("x",), data=(value,), mask=mask
    )
    assert isinstance(frame, ShmFrame)
    return frame


def test_a_segment_is_free_once_every_group_it_went_to_released_it(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    producer, trainers = groups_pair(tmp_path, fake_redis, (0, 2))
    frame = send(producer, np.arange(100, dtype=np.int64), mask=0b101)
    held = {}
    for slot, trainer in trainers.items():
        (held[slot],) = codec.decode_frame(trainer.resolve(frame.element)).data
        np.testing.assert_array_equal(held[slot], np.arange(100))
    del held[0]
    gc.collect()
    assert not frame.segment.is_free()  # slot 2's trainer still holds the batch
    del held[2]
    gc.collect()
    assert frame.segment.is_free()


def test_only_the_groups_a_frame_went_to_release_it(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    producer, trainers = groups_pair(tmp_path, fake_redis, (0, 1, 2))
    frame = send(producer, np.zeros(10), mask=0b111)
    frame.retarget(0b011)  # the push left slot 2 out (its list was full): 0 and 1 got it
    for slot in (0, 1):
        codec.decode_frame(trainers[slot].resolve(frame.element), writable=True)
    gc.collect()
    assert frame.segment.is_free()


def test_a_frame_goes_into_a_segment_only_if_every_group_it_is_for_is_on_this_host(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    producer, _trainers = groups_pair(tmp_path, fake_redis, (0, 2))  # slot 1: elsewhere
    assert producer.active_for(0, 0b101) and not producer.active_for(0, 0b011)
    pieces = encode_with(
        producer.encode, FrameKind.BATCH, **FIELDS, sources=("x",), data=(np.zeros(4),),
        mask=0b011,
    )  # fmt: skip
    assert not isinstance(pieces, ShmFrame)


def test_a_finished_group_releases_what_it_will_not_read(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    producer, trainers = groups_pair(tmp_path, fake_redis, (0, 1))
    frame = send(producer, np.zeros(10), mask=0b011)
    codec.decode_frame(trainers[0].resolve(frame.element), writable=True)
    gc.collect()
    assert not frame.segment.is_free()
    assert trainers[1].release_unread(frame.element)  # its list still held the descriptor
    assert frame.segment.is_free()


def test_the_sweep_removes_a_gone_producers_segment_only_once_all_released(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    producer, trainers = groups_pair(tmp_path, fake_redis, (0, 1))
    frame = send(producer, np.zeros(10), mask=0b011)  # producer p is in no producers set
    path = tmp_path / frame.segment.name
    codec.decode_frame(trainers[0].resolve(frame.element), writable=True)
    gc.collect()
    trainers[0].new_run("ab12")
    trainers[0]._swept = -SWEEP_S  # due now
    assert trainers[0].maybe_sweep(fake_redis) == 0 and path.exists()  # slot 1 has it
    trainers[1].release_unread(frame.element)
    trainers[0]._swept = -SWEEP_S
    assert trainers[0].maybe_sweep(fake_redis) == 1 and not path.exists()
