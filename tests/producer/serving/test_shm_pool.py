"""producer.serving.shm_pool and producer.serving.transport: segments, reuse, limits, the switch."""

from __future__ import annotations

import functools
import logging
import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fakeredis
import numpy as np
import pytest
from frame_args import encode_with
from shm_pair import shm_pair
from small_tmpfs import small_tmpfs

from batchq.errors import ConfigError
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from batchq.protocol.ranks import rank_field
from batchq.wire import shm
from batchq.wire.codec import FrameKind
from producer.serving import transport as transport_module
from producer.serving.membership import RunPosition
from producer.serving.shm_pool import FULL, NO_ROOM, Segment, SegmentPool
from producer.serving.transport import (
    DEFAULT_READER_PREFETCH,
    MAX_READER_PREFETCH,
    ShmFrame,
    Transport,
    pool_size,
)

FIELDS: dict[str, Any] = {"run": "ab12", "epoch": 0, "shard": 0, "k": 0, "producer": "p"}


def pool(tmp_path: Path, **kw: Any) -> SegmentPool:
    kw.setdefault("max_segments", 4)
    kw.setdefault("max_bytes", None)
    p = SegmentPool(str(tmp_path), "q", "p", **kw)
    p.reset("ab12")
    return p


def release(seg: Segment) -> None:
    """What the trainer's finalizer does."""
    seg.mm[shm.OFF_RELEASED : shm.OFF_RELEASED + 8] = seg.gen.to_bytes(8, "little")


def test_a_segment_is_created_once_private_and_reserved(tmp_path: Path) -> None:
    p = pool(tmp_path)
    seg = p.acquire(10_000)
    assert isinstance(seg, Segment)
    st = os.stat(seg.path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == shm.HEADER_BYTES + seg.capacity >= 10_000
    assert st.st_blocks * 512 >= st.st_size  # allocated up front, not sparse
    assert shm.parse_segment_name(seg.name) == shm.SegmentName("q", "ab12", "p", 1)


def test_a_segment_is_reused_only_once_released(tmp_path: Path) -> None:
    p = pool(tmp_path, max_segments=2)
    first = p.acquire(1000)
    assert isinstance(first, Segment)
    first.commit(1000)
    second = p.acquire(1000)
    assert isinstance(second, Segment) and second is not first
    second.commit(1000)
    assert p.acquire(1000) == NO_ROOM  # both still hold a batch
    release(first)
    assert p.acquire(1000) is first  # the same file and mapping: no allocation
    assert len(os.listdir(tmp_path)) == 2


def test_abandoned_frames_free_their_segment(tmp_path: Path) -> None:
    p = pool(tmp_path, max_segments=1)
    seg = p.acquire(100)
    assert isinstance(seg, Segment)
    gen = seg.commit(100)
    assert p.acquire(100) == NO_ROOM
    seg.abandon(gen)
    assert p.acquire(100) is seg


def test_byte_cap_is_full_and_small_free_segments_make_room(tmp_path: Path) -> None:
    p = pool(tmp_path, max_bytes=300_000)
    small = p.acquire(100_000)
    assert isinstance(small, Segment)
    assert p.acquire(250_000) != FULL  # the free small one went to make room
    assert not os.path.exists(small.path)
    big = p.segments[0]
    big.commit(250_000)
    assert p.acquire(100_000) == FULL
    assert "shm_max_bytes" in p.last_error


def test_full_tmpfs_is_full_not_a_crash(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", 256 * 1024) as folder:
        p = SegmentPool(folder, "q", "p", 8, None)
        p.reset("ab12")
        seg = p.acquire(150_000)
        assert isinstance(seg, Segment)
        seg.commit(150_000)
        assert p.acquire(150_000) == FULL
        assert "No space" in p.last_error
        assert len(os.listdir(folder)) == 1  # the failed one is not left behind


def test_close_keeps_only_segments_the_trainer_may_still_read(tmp_path: Path) -> None:
    p = pool(tmp_path)
    busy = p.acquire(100)
    assert isinstance(busy, Segment)
    busy.commit(100)
    free = p.acquire(100)
    assert isinstance(free, Segment) and free is not busy
    free.commit(100)
    release(free)
    p.close(finished=False)
    assert os.listdir(tmp_path) == [busy.name]
    assert int.from_bytes(busy.mm[shm.OFF_RETIRED : shm.OFF_RETIRED + 8], "little") == 1


def test_transport_follows_the_trainers_published_host(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis, caplog: pytest.LogCaptureFixture
) -> None:
    keys = QueueKeys("q")
    transport = Transport("auto", str(tmp_path), keys, "p", 4)
    transport.joined(fake_redis, RunPosition("ab12"))
    data = (np.arange(1000, dtype=np.float32),)
    fields = {**FIELDS, "sources": ("x",), "data": data}
    assert not transport.active
    assert not isinstance(
        encode_with(transport.encode, FrameKind.BATCH, **fields), ShmFrame
    )  # no trainer yet
    fake_redis.hset(keys.meta, MetaField.SHM_HOST, transport.identity or "")
    transport.refresh(fake_redis, force=True)
    frame = encode_with(transport.encode, FrameKind.BATCH, **fields)
    assert isinstance(frame, ShmFrame) and len(frame) > 4000
    desc = shm.decode_descriptor(frame.element, "q")
    assert (desc.segment, desc.gen, desc.length) == (frame.segment.name, 1, len(frame))
    fake_redis.hset(keys.meta, MetaField.SHM_HOST, "another-host:1:2")  # a takeover elsewhere
    with caplog.at_level(logging.INFO):
        transport.refresh(fake_redis, force=True)
    assert not transport.active and "through Redis" in caplog.text


def test_pool_size_covers_every_list_reader_prefetch_and_hand_of_the_run() -> None:
    assert pool_size(3, 10, 1) == 3 + 10 + 2 + 2  # list, reader prefetch, in hand; pushed, ahead
    assert pool_size(3, 10, 4) == 4 * (3 + 10 + 2) + 2  # every rank's may be all ours


@pytest.mark.parametrize(
    ("published", "expected"),
    [
        (b"4", pool_size(5, 4, 2)),
        (None, pool_size(5, DEFAULT_READER_PREFETCH, 2)),  # an older trainer: its default hwm
        (b"0", pool_size(5, DEFAULT_READER_PREFETCH, 2)),
        (b"lots", pool_size(5, DEFAULT_READER_PREFETCH, 2)),
        (b"99999999999", pool_size(5, MAX_READER_PREFETCH, 2)),  # memory stays bounded
    ],
)
def test_the_pool_follows_the_trainers_published_reader_prefetch(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis, published: bytes | None, expected: int
) -> None:
    keys = QueueKeys("q")
    transport = Transport("auto", str(tmp_path), keys, "p", None)
    for rank in (0, 1):  # both ranks of the job on this host
        fake_redis.hset(keys.meta, rank_field(MetaField.SHM_HOST, rank, 2), transport.identity)
        if published is not None:
            fake_redis.hset(keys.meta, rank_field(MetaField.SHM_LOOKAHEAD, rank, 2), published)
    transport.joined(fake_redis, RunPosition("ab12", world=2, list_cap=5))
    assert transport.active and transport.pool.max_segments == expected


def test_frames_for_a_rank_on_another_host_go_through_redis(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    keys = QueueKeys("q")
    transport = Transport("auto", str(tmp_path), keys, "p", None)
    fake_redis.hset(
        keys.meta,
        mapping={
            "shm_host:0": "another-host:1:2:3",
            "shm_host:1": transport.identity,
            "shm_lookahead:1": 4,
        },
    )
    transport.joined(fake_redis, RunPosition("ab12", world=2, list_cap=5))
    assert not transport.active_for(0) and transport.active_for(1)
    assert transport.pool.max_segments == pool_size(5, 4, 1)  # room for rank 1's alone
    fields = {**FIELDS, "sources": ("x",), "data": (np.zeros(10),)}
    to_rank_0 = encode_with(functools.partial(transport.encode, rank=0), FrameKind.BATCH, **fields)
    to_rank_1 = encode_with(functools.partial(transport.encode, rank=1), FrameKind.BATCH, **fields)
    assert not isinstance(to_rank_0, ShmFrame) and isinstance(to_rank_1, ShmFrame)
    assert transport.host_field(1, 2) == "shm_host:1"


def test_an_explicit_shm_segments_is_kept_whatever_the_trainer_publishes(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    keys = QueueKeys("q")
    transport = Transport("auto", str(tmp_path), keys, "p", 3)
    fake_redis.hset(
        keys.meta,
        mapping={MetaField.SHM_HOST: transport.identity or "", MetaField.SHM_LOOKAHEAD: 50},
    )
    transport.joined(fake_redis, RunPosition("ab12"))
    assert transport.pool.max_segments == 3
    with pytest.raises(ConfigError, match="shm_segments 0"):
        Transport("auto", str(tmp_path), keys, "p", 0)


@pytest.mark.parametrize("bad", ["1g", 0, -5, 1.5, True])
def test_a_bad_shm_max_bytes_is_refused_naming_it(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ConfigError, match=f"shm_max_bytes {bad!r} is not valid"):
        Transport("auto", str(tmp_path), QueueKeys("q"), "p", None, bad)


def test_transport_redis_never_maps_anything(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    keys = QueueKeys("q")
    auto = Transport("auto", str(tmp_path), keys, "p", 4)
    fake_redis.hset(keys.meta, MetaField.SHM_HOST, auto.identity or "")
    transport = Transport("redis", str(tmp_path), keys, "p", 4)
    transport.joined(fake_redis, RunPosition("ab12"))
    frame = encode_with(
        transport.encode, FrameKind.BATCH, **FIELDS, sources=("x",), data=(np.zeros(10),)
    )
    assert not isinstance(frame, ShmFrame) and os.listdir(tmp_path) == []


def test_a_full_folder_warns_once_and_frames_go_through_redis(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis, caplog: pytest.LogCaptureFixture
) -> None:
    keys = QueueKeys("q")
    transport = Transport("auto", str(tmp_path), keys, "p", 8, max_bytes=100_000)
    fake_redis.hset(keys.meta, MetaField.SHM_HOST, transport.identity or "")
    transport.joined(fake_redis, RunPosition("ab12"))
    data = (np.zeros(60_000, dtype=np.uint8),)
    with caplog.at_level(logging.WARNING):
        frames = [
            encode_with(transport.encode, FrameKind.BATCH, **FIELDS, sources=("x",), data=data)
            for _ in range(4)
        ]
    assert isinstance(frames[0], ShmFrame)
    assert not any(isinstance(f, ShmFrame) for f in frames[1:])
    assert transport.fallbacks == 3
    assert caplog.text.count("no room in") == 1


def test_joining_removes_other_runs_segments_of_producers_no_longer_alive(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    keys = QueueKeys("q")
    names = {
        "dead, old run": shm.segment_name("q", "0dd", "gone", 1),
        "alive, old run": shm.segment_name("q", "0dd", "alive", 1),  # it may rejoin later
        "dead, this run": shm.segment_name("q", "ab12", "gone", 2),  # may still be popped
        "mine, old run": shm.segment_name("q", "0dd", "p", 1),
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    fake_redis.zadd(keys.producers, {"alive": 1, "p": 1})
    Transport("auto", str(tmp_path), keys, "p", 4).joined(fake_redis, RunPosition("ab12"))
    left = set(os.listdir(tmp_path))
    assert left == {names["alive, old run"], names["dead, this run"]}


def test_a_push_that_lost_its_reply_frees_its_segment_after_the_rejoin_unless_it_is_listed(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = QueueKeys("q")
    transport, _trainer = shm_pair(tmp_path, fake_redis, 4)
    data = (np.zeros(1000),)
    fields = {**FIELDS, "sources": ("x",), "data": data}
    lost = encode_with(transport.encode, FrameKind.BATCH, **fields)
    listed = encode_with(transport.encode, FrameKind.BATCH, **fields)
    assert isinstance(lost, ShmFrame) and isinstance(listed, ShmFrame)
    fake_redis.lpush(keys.data, listed.element)  # this one's push went through
    transport.uncertain(lost, keys.data)
    transport.uncertain(listed, keys.data)
    transport.joined(fake_redis, RunPosition("ab12"))  # the rejoin after the reconnect
    # Not listed: never pushed, or popped just before the look and not mapped yet, so
    # it stays for UNLISTED_GRACE_S (removed at once, the trainer found it missing).
    assert os.path.exists(lost.segment.path)
    later = transport_module.time.monotonic() + transport_module.UNLISTED_GRACE_S + 1
    monkeypatch.setattr(transport_module, "time", SimpleNamespace(monotonic=lambda: later))
    transport.refresh(fake_redis)
    assert not os.path.exists(lost.segment.path)  # never released: it would have stayed
    assert os.path.exists(listed.segment.path)  # the trainer will pop, release, remove
