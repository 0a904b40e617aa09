"""consumer.reader.shm_frames: zero-copy views that own their segment; hostile descriptors."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import fakeredis
import numpy as np
import pytest
from frame_args import encode_with
from shm_pair import shm_pair

from batchq.errors import FrameError
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.wire import codec, shm
from batchq.wire.codec import FrameKind
from consumer.reader.prepare import make_writable
from consumer.reader.shm_frames import TrainerShm
from producer.serving.membership import RunPosition
from producer.serving.transport import ShmFrame, Transport

FIELDS: dict[str, Any] = {"run": "ab12", "epoch": 0, "shard": 0, "k": 0, "producer": "p"}


@pytest.fixture
def pair(tmp_path: Path, fake_redis: fakeredis.FakeRedis) -> tuple[Transport, TrainerShm]:
    return shm_pair(tmp_path, fake_redis, 2)


def send(producer: Transport, value: np.ndarray) -> ShmFrame:
    frame = encode_with(producer.encode, FrameKind.BATCH, **FIELDS, sources=("x",), data=(value,))
    assert isinstance(frame, ShmFrame)
    return frame


def test_views_own_the_segment_until_the_last_one_goes(pair: Any) -> None:
    producer, trainer = pair
    first = send(producer, np.arange(1000, dtype=np.float32))
    second = send(producer, np.arange(1000, dtype=np.float32) + 1)
    (x,) = codec.decode_frame(trainer.resolve(first.element)).data
    np.testing.assert_array_equal(x, np.arange(1000, dtype=np.float32))
    assert not x.flags.writeable and not x.flags.owndata
    part = x[10:20]  # a view of a view: the base chain still holds the owner
    del x
    gc.collect()
    assert producer.pool.acquire(4000) == "no_room"  # `part` still references batch 1
    codec.decode_frame(trainer.resolve(second.element), writable=True)  # copies: free now
    gc.collect()
    reused = producer.pool.acquire(4000)
    assert reused is second.segment
    np.testing.assert_array_equal(part, np.arange(10, 20, dtype=np.float32))
    del part
    gc.collect()
    assert first.segment.is_free()


def test_a_writable_trainer_copies_the_batch_and_releases_its_segment_at_once(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    producer, _ = shm_pair(tmp_path, fake_redis, 2)
    trainer = TrainerShm(QueueKeys("q"), "auto", str(tmp_path), writable=True)
    frame = send(producer, np.arange(100, dtype=np.float32))
    raw = trainer.resolve(frame.element)
    gc.collect()
    assert frame.segment.is_free()  # the arrays will own a copy: nothing holds it
    (x,) = codec.decode_frame(raw).data
    x = make_writable(x)
    assert x.flags.writeable
    x[0] = 7.0
    np.testing.assert_array_equal(x[1:], np.arange(1, 100, dtype=np.float32))
    assert trainer.resolve(frame.element) is None  # a duplicate: had, released, not read


def test_a_duplicate_descriptor_shares_the_batch_and_releases_nothing(pair: Any) -> None:
    producer, trainer = pair
    frame = send(producer, np.arange(100, dtype=np.float32))
    (x,) = codec.decode_frame(trainer.resolve(frame.element)).data
    duplicate = trainer.resolve(frame.element)  # a replayed push, say: dropped below
    del duplicate
    gc.collect()
    assert not frame.segment.is_free()  # `x` still holds the batch
    del x
    gc.collect()
    assert frame.segment.is_free()
    # Released: the producer may be writing the next frame there already. This
    # trainer had that batch: a late duplicate, dropped unread; another trainer
    # (which never had it) finds the generation stale.
    assert trainer.resolve(frame.element) is None and trainer.duplicates == 1
    stranger = TrainerShm(QueueKeys("q"), "auto", trainer.shm_dir)
    assert reason(stranger, frame.element) == "shm_stale"
    send(producer, np.zeros(100))  # the segment reused: the old descriptor is still had
    assert trainer.resolve(frame.element) is None and trainer.duplicates == 2


def test_trainer_without_shm_publishes_nothing(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    keys = QueueKeys("q")
    fake_redis.hset(keys.meta, mapping={MetaField.SHM_HOST: "stale", MetaField.SHM_LOOKAHEAD: 4})
    TrainerShm(keys, "redis", str(tmp_path)).publish(fake_redis, 10)
    assert fake_redis.hmget(keys.meta, [MetaField.SHM_HOST, MetaField.SHM_LOOKAHEAD]) == [
        None,
        None,
    ]


def test_trainer_publishes_its_host_and_look_ahead_together(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    keys = QueueKeys("q")
    trainer = TrainerShm(keys, "auto", str(tmp_path))
    trainer.publish(fake_redis, 7)
    host, lookahead = fake_redis.hmget(keys.meta, [MetaField.SHM_HOST, MetaField.SHM_LOOKAHEAD])
    assert host == (trainer.identity or "").encode() and lookahead == b"7"


def reason(trainer: TrainerShm, element: bytes) -> str:
    with pytest.raises(FrameError) as info:
        trainer.resolve(element)
    return info.value.reason


def test_missing_segment(pair: Any, tmp_path: Path) -> None:
    producer, trainer = pair
    frame = send(producer, np.zeros(100))
    os.unlink(frame.segment.path)
    assert reason(trainer, frame.element) == "shm_missing"


def test_a_batch_had_listed_again_after_its_segment_went_is_a_duplicate(pair: Any) -> None:
    # A Redis failover lost the pop: the descriptor is listed again, and its segment was
    # removed meanwhile (its producer was reaped, the trainer swept it).
    producer, trainer = pair
    frame = send(producer, np.zeros(100))
    codec.decode_frame(trainer.resolve(frame.element))
    gc.collect()
    os.unlink(frame.segment.path)
    assert trainer.resolve(frame.element) is None and trainer.duplicates == 1
    other = send(producer, np.ones(100))  # never had: still a bad frame
    if os.path.exists(other.segment.path):  # (the pool may have reused the gone one)
        os.unlink(other.segment.path)
    assert reason(trainer, other.element) == "shm_missing"


def test_wrong_size(pair: Any, tmp_path: Path) -> None:
    producer, trainer = pair
    frame = send(producer, np.zeros(100))
    desc = shm.decode_descriptor(frame.element, "q")
    too_long = shm.encode_descriptor(desc.segment, desc.gen, 10**9, desc.host)
    assert reason(trainer, too_long) == "shm_wrong_size"
    os.truncate(frame.segment.path, 10)
    assert reason(trainer, frame.element) == "shm_wrong_size"


def test_stale_generation(pair: Any) -> None:
    producer, trainer = pair
    frame = send(producer, np.zeros(100))
    desc = shm.decode_descriptor(frame.element, "q")
    old = shm.encode_descriptor(desc.segment, desc.gen + 1, desc.length, desc.host)
    assert reason(trainer, old) == "shm_stale"
    shorter = shm.encode_descriptor(desc.segment, desc.gen, desc.length - 8, desc.host)
    assert reason(trainer, shorter) == "shm_stale"


def test_foreign_host_and_no_shm(pair: Any, tmp_path: Path) -> None:
    producer, trainer = pair
    frame = send(producer, np.zeros(100))
    desc = shm.decode_descriptor(frame.element, "q")
    foreign = shm.encode_descriptor(desc.segment, desc.gen, desc.length, "other:1:2")
    assert reason(trainer, foreign) == "shm_foreign_host"
    redis_only = TrainerShm(QueueKeys("q"), "redis", str(tmp_path))
    assert reason(redis_only, frame.element) == "shm_unavailable"


def test_symlinks_and_foreign_files_are_outside(pair: Any, tmp_path: Path) -> None:
    _producer, trainer = pair
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 4096)
    link = shm.segment_name("q", "ab12", "evil", 1)
    os.symlink(secret, tmp_path / link)
    assert reason(trainer, shm.encode_descriptor(link, 1, 100, trainer.identity)) == ("shm_outside")
    folder = shm.segment_name("q", "ab12", "evil", 2)
    (tmp_path / folder).mkdir()
    assert reason(trainer, shm.encode_descriptor(folder, 1, 100, trainer.identity)) in (
        "shm_outside",
        "shm_wrong_size",
    )
    garbage = shm.segment_name("q", "ab12", "evil", 3)
    (tmp_path / garbage).write_bytes(b"\xff" * 4096)  # right size, no segment header
    assert reason(trainer, shm.encode_descriptor(garbage, 1, 100, trainer.identity)) == (
        "shm_outside"  # mode 0644: not a segment a producer made
    )
    os.chmod(tmp_path / garbage, 0o600)
    assert reason(trainer, shm.encode_descriptor(garbage, 1, 100, trainer.identity)) == (
        "shm_stale"
    )
    # A hard link to a real segment (another queue's, say): releasing through it would
    # hand that queue's batch back.
    real = send(_producer, np.arange(10))
    linked = shm.segment_name("q", "ab12", "evil", 4)
    os.link(tmp_path / real.segment.name, tmp_path / linked)
    hard = shm.encode_descriptor(linked, real.gen, len(real), trainer.identity)
    assert reason(trainer, hard) == "shm_outside"


def test_sweep_removes_only_free_segments_of_producers_that_are_gone(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    keys = QueueKeys("q")
    trainer = TrainerShm(keys, "auto", str(tmp_path))
    trainer.publish(fake_redis, 10)
    trainer.new_run("ab12")
    pools = {}
    for name in ("gone", "alive"):
        transport = Transport("auto", str(tmp_path), keys, name, 4)
        transport.joined(fake_redis, RunPosition("ab12"))
        pools[name] = transport
    free = send(pools["gone"], np.zeros(100))
    busy = send(pools["gone"], np.ones(100))
    codec.decode_frame(trainer.resolve(free.element), writable=True)  # released at once
    gc.collect()
    send(pools["alive"], np.zeros(100)).abandon()
    fake_redis.zadd(keys.producers, {"alive": 1})  # "gone" was reaped
    trainer._swept = -1e9  # due now
    assert trainer.maybe_sweep(fake_redis) == 1
    left = {shm.parse_segment_name(n).producer for n in os.listdir(tmp_path)}  # type: ignore[union-attr]
    assert not os.path.exists(free.segment.path) and os.path.exists(busy.segment.path)
    assert left == {"gone", "alive"}
    assert trainer.maybe_sweep(fake_redis) == 0  # not due again yet


def test_a_rejoin_of_the_same_run_never_reuses_an_old_segment(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    keys = QueueKeys("q")
    trainer = TrainerShm(keys, "auto", str(tmp_path))
    trainer.publish(fake_redis, 10)
    producer = Transport("auto", str(tmp_path), keys, "p", 4)
    producer.joined(fake_redis, RunPosition("ab12"))
    busy = send(producer, np.ones(100))
    free = send(producer, np.zeros(100))
    free.abandon()
    producer.joined(fake_redis, RunPosition("ab12"))  # e.g. after being reaped, or a reconnect
    assert not os.path.exists(free.segment.path)
    assert os.path.exists(busy.segment.path)  # its batch may still be popped
    again = send(producer, np.zeros(100))
    assert again.segment.name not in (free.segment.name, busy.segment.name)
    (x,) = codec.decode_frame(trainer.resolve(busy.element)).data
    del x
    gc.collect()
    assert not os.path.exists(busy.segment.path)  # retired: removed by its release


def test_a_batch_handed_over_is_given_back_as_its_descriptor_and_released_by_the_next(
    pair: Any,
) -> None:
    producer, trainer = pair
    sent = send(producer, np.arange(100, dtype=np.float32))
    frame = codec.decode_frame(trainer.resolve(sent.element))
    (given,) = trainer.descriptors([frame])
    assert given is not None
    descriptor, key = given
    assert bytes(descriptor) == bytes(sent.element)  # the descriptor as popped
    trainer.hand_over([key])
    del frame
    gc.collect()
    assert not sent.segment.is_free()  # the batch is the next trainer's to release
    after = TrainerShm(QueueKeys("q"), "auto", trainer.shm_dir)  # the resumed trainer
    (x,) = codec.decode_frame(after.resolve(descriptor)).data
    np.testing.assert_array_equal(x, np.arange(100, dtype=np.float32))
    del x
    gc.collect()
    assert sent.segment.is_free()


def test_only_a_batch_still_in_its_segment_has_a_descriptor(pair: Any) -> None:
    producer, trainer = pair
    sent = send(producer, np.arange(100, dtype=np.float32))
    frame = codec.decode_frame(trainer.resolve(sent.element))
    copied = codec.decode_frame(bytes(trainer.resolve(sent.element)))  # a copy of its own
    made = codec.decode_frame(bytes(codec.encode_frame(*_header_and_data(frame))))
    # A copy of its own, a frame encoded anew: not the segment's.
    assert trainer.descriptors([copied, made]) == [None, None]
    assert TrainerShm(QueueKeys("q"), "redis", trainer.shm_dir).descriptors([frame]) == [None]
    given = trainer.descriptors([frame])[0]
    assert given is not None
    trainer.hand_over([given[1]])
    trainer.hand_over([given[1]], handed=False)  # the give-back was refused: taken back
    del frame, copied, made  # not handed over: released as any
    gc.collect()
    assert sent.segment.is_free()


def _header_and_data(frame: codec.Frame) -> tuple[codec.FrameHeader, tuple[Any, ...]]:
    header = codec.FrameHeader(
        frame.kind, frame.run, frame.epoch, frame.shard, frame.k, frame.producer, frame.sources
    )
    return header, frame.data


def test_a_finished_run_removes_its_segments_and_not_a_new_runs(tmp_path: Path) -> None:
    # Before: the finish removed every segment of the queue on this host, those a new
    # run's producers had made meanwhile too (once a run is marked finished, a new one
    # may start).
    names = [shm.segment_name("q", run, "p", 1) for run in ("ab12", "cd34")]
    for name in names:
        (tmp_path / name).write_bytes(b"x" * 100)
    TrainerShm(QueueKeys("q"), "auto", str(tmp_path)).finish("ab12")
    assert os.listdir(tmp_path) == [names[1]]
