"""producer.serving.transport: a frame waits a little for a segment the trainer lets go, and
goes through Redis at once while the trainer keeps every segment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fakeredis
import numpy as np
import pytest
from frame_args import encode_with
from shm_pair import shm_pair

from batchq.wire import codec
from batchq.wire.codec import FrameKind
from batchq.wire.frame import Pieces
from consumer.reader.shm_frames import TrainerShm
from producer.serving import transport as transport_module
from producer.serving.transport import ShmFrame, Transport

FIELDS: dict[str, Any] = {"run": "ab12", "epoch": 0, "shard": 0, "k": 0, "producer": "p"}


@pytest.fixture
def pair(tmp_path: Path, fake_redis: fakeredis.FakeRedis) -> tuple[Transport, TrainerShm]:
    return shm_pair(tmp_path, fake_redis, 1)


def send(producer: Transport, k: int) -> Any:
    value = np.full(1000, k, dtype=np.float32)
    fields = {**FIELDS, "k": k}
    return encode_with(producer.encode, FrameKind.BATCH, **fields, sources=("x",), data=(value,))


def test_a_frame_waits_for_the_segment_the_trainer_lets_go(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer, trainer = pair
    first = send(producer, 0)
    assert isinstance(first, ShmFrame)
    held = [codec.decode_frame(trainer.resolve(first.element)).data[0]]  # the trainer's

    def trainer_moves_on(_s: float) -> None:  # the producer's first look finds no room
        held.clear()  # the caller dropped the batch: its segment goes back

    monkeypatch.setattr(transport_module.time, "sleep", trainer_moves_on)
    second = send(producer, 1)
    assert isinstance(second, ShmFrame) and second.segment is first.segment
    assert (producer.fallbacks, producer.no_room_waits) == (0, 1)
    (x,) = codec.decode_frame(trainer.resolve(second.element)).data
    np.testing.assert_array_equal(x, np.full(1000, 1, dtype=np.float32))


def test_a_trainer_keeping_its_batches_gets_them_through_redis_without_waits(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer, trainer = pair
    first = send(producer, 0)
    kept = codec.decode_frame(trainer.resolve(first.element)).data[0]  # never dropped
    clock = [0.0]

    def sleep(seconds: float) -> None:  # time passes only while the producer waits
        clock[0] += seconds

    monkeypatch.setattr(transport_module.time, "sleep", sleep)
    monkeypatch.setattr(transport_module.time, "monotonic", lambda: clock[0])
    second = send(producer, 1)
    assert isinstance(second, Pieces)  # waited NO_ROOM_WAIT_S, then through Redis
    assert clock[0] >= transport_module.NO_ROOM_WAIT_S
    waited = clock[0]
    third = send(producer, 2)
    assert isinstance(third, Pieces) and clock[0] == waited  # at once: no second wait
    assert (producer.fallbacks, producer.no_room_waits) == (2, 1)
    np.testing.assert_array_equal(kept, np.zeros(1000, dtype=np.float32))
    del kept  # the segment is free again: the next frame uses it, and may wait again
    fourth = send(producer, 3)
    assert isinstance(fourth, ShmFrame) and fourth.segment is first.segment
    assert producer._patient
