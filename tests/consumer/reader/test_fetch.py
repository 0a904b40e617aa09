"""consumer.reader.fetch: popped elements resolved into frame bytes; what cannot be is a bad
frame with its reason, never an exception out of the round."""

from __future__ import annotations

import fakeredis
import pytest

from batchq.errors import FrameError
from batchq.protocol.keys import QueueKeys
from batchq.wire import refs
from batchq.wire.shm import encode_descriptor, segment_name
from consumer.reader.fetch import Fetcher
from consumer.reader.shm_frames import TrainerShm

KEYS = QueueKeys("fq")


def fetcher(
    client: fakeredis.FakeRedis, max_frame_bytes: int | None = None
) -> tuple[Fetcher, list]:
    dead: list[tuple[bytes, str]] = []
    shm = TrainerShm(KEYS, "redis", None)  # this trainer maps nothing
    return Fetcher(
        client, KEYS, shm, max_frame_bytes, lambda e, err: dead.append((e, err.reason))
    ), dead


def test_inline_frames_pass_and_stored_ones_are_fetched_once(
    fake_redis: fakeredis.FakeRedis,
) -> None:
    f, dead = fetcher(fake_redis)
    key = f"{KEYS.frame_prefix}1"
    fake_redis.set(key, b"stored frame")
    element = refs.encode_ref(key)
    out = f.fetch([b"inline frame", element])
    assert [(bytes(raw), el, k) for raw, el, k in out] == [
        (b"inline frame", b"inline frame", ""),
        (b"stored frame", element, key),
    ]
    assert not dead and not fake_redis.exists(key)  # GETDEL: fetched once


def test_a_missing_or_foreign_stored_frame_is_a_bad_frame(fake_redis: fakeredis.FakeRedis) -> None:
    f, dead = fetcher(fake_redis)
    gone, foreign = f"{KEYS.frame_prefix}gone", f"{KEYS.frame_prefix}list"
    fake_redis.rpush(foreign, "x")
    out = f.fetch([refs.encode_ref(gone), refs.encode_ref(foreign), b"ok"])
    assert [raw for raw, _, _ in out] == [None, None, b"ok"]
    assert [reason for _, reason in dead] == ["missing_ref", "wrong_type"]


def test_an_oversized_stored_frame_is_dropped_unfetched(fake_redis: fakeredis.FakeRedis) -> None:
    f, dead = fetcher(fake_redis, max_frame_bytes=4)
    key = f"{KEYS.frame_prefix}big"
    fake_redis.set(key, b"x" * 100)
    ((raw, _, _),) = f.fetch([refs.encode_ref(key)])
    assert raw is None and [reason for _, reason in dead] == ["too_large"]
    assert not fake_redis.exists(key)


@pytest.mark.parametrize(
    "element, reason",
    [
        (refs.REF_MAGIC + b"\xff not a key", "bad_ref"),
        (encode_descriptor(segment_name("fq", "ab12", "p", 1), 1, 10, "host"), "shm_unavailable"),
    ],
)
def test_hostile_elements_are_bad_frames(
    fake_redis: fakeredis.FakeRedis, element: bytes, reason: str
) -> None:
    f, dead = fetcher(fake_redis)
    ((raw, el, _),) = f.fetch([element])
    assert raw is None and el == element
    assert [r for _, r in dead] == [reason]


def test_a_policy_that_raises_stops_the_round(fake_redis: fakeredis.FakeRedis) -> None:
    def raising(_element: bytes, error: FrameError) -> None:
        raise error

    f = Fetcher(fake_redis, KEYS, TrainerShm(KEYS, "redis", None), None, raising)
    with pytest.raises(FrameError, match="gone"):
        f.fetch([refs.encode_ref(f"{KEYS.frame_prefix}gone")])
