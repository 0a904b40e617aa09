"""producer.serving.pushing on its own: a ShardPusher and the FramePusher it holds, built
from explicit parts (no Producer), and what counts as "the user's pipeline raised"; the
BuildWatch: a build's result or error as if called in place, past build_timeout_s a
BuildTimeout naming what was read, and nothing more runs."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import fakeredis
import numpy as np
import pytest
import redis
from shm_pair import shm_pair

from batchq.errors import ConnectionLost
from batchq.protocol import producer_scripts
from batchq.protocol.calls import CountReply
from batchq.protocol.keys import QueueKeys
from batchq.protocol.words import Status
from batchq.wire import codec, shm
from producer.datasets import IndexableDataset
from producer.errors import BuildTimeout
from producer.schemes import SequentialScheme
from producer.serving import ahead, frame_push
from producer.serving.ahead import Ahead, Lease
from producer.serving.blocking import HANDBACK_S, Waiting
from producer.serving.frame_push import FramePusher, Handover
from producer.serving.frames import PushSettings
from producer.serving.membership import RunPosition
from producer.serving.pushing import BuildWatch, ShardPusher
from producer.serving.sharding import ShardPlan
from producer.serving.transport import ShmFrame, Transport
from producer.streams import DataStream
from producer.transformers import Mapping


@pytest.fixture
def quick_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shard counts as quick to build (two leases ahead), however loaded the machine:
    the tests below are about what a prefetching push does, not about the 2 ms line."""
    monkeypatch.setattr(ahead, "AHEAD_MAX_BUILD_S", 60.0)


def _pusher(
    fail_at: int | None = None,
    transport: Transport | None = None,
    leasing: bool = False,
) -> ShardPusher:
    def boom(batch: Any) -> Any:
        if fail_at is not None and int(batch[0][0]) == fail_at:
            raise ValueError("the user's bug")
        return batch

    dataset = IndexableDataset({"x": np.arange(40)})
    stream = Mapping(DataStream(dataset, iteration_scheme=SequentialScheme(40, 10)), boom)
    keys = QueueKeys("q")
    settings = PushSettings(keys, "p", ("x",), False, None, 256 * 1024, 10_000, 3)

    def no_lease(prefetch: int, after: str) -> Any:
        if not leasing:
            pytest.fail("asked for a lease")
        call = producer_scripts.lease_call(
            keys, incarnation="inc", run="run", producer="p", token="t9",
            heartbeat_ttl_ms=10_000, prefetch=prefetch, world=1, after=after,
        )  # fmt: skip
        return call, "t9"

    plan = ShardPlan(stream, None)
    transport = transport or Transport("redis", None, keys, "p", None)
    held = Ahead()
    frames = FramePusher(
        settings,
        redis.Redis.from_url("redis://127.0.0.1:1/0"),  # never reached: pushes are patched
        transport,
        RunPosition("run", "inc"),
        threading.Event(),
        no_lease,
        held,
        plan.shards,
    )
    return ShardPusher(frames, plan, transport, held)


def test_a_pipeline_that_raises_is_counted_against_the_shard() -> None:
    p = _pusher(fail_at=0)
    failed: list[tuple[int, int, str]] = []
    p._retry_elsewhere = lambda e, s, entry: failed.append((e, s, entry)) or True  # type: ignore[method-assign]
    p.serve_shard(0, 0, "0:t")
    assert failed == [(0, 0, "0:t")]


def test_a_redis_error_while_pushing_is_a_redis_error_not_the_pipelines() -> None:
    p = _pusher()
    p._retry_elsewhere = lambda *a: pytest.fail("counted against the shard")  # type: ignore[method-assign]

    def push(*args: Any, **kwargs: Any) -> bool:
        raise redis.ResponseError("NOPERM this user has no permissions to run 'evalsha'")

    p._push = push  # type: ignore[method-assign]
    with pytest.raises(redis.ResponseError, match="NOPERM"):
        p.serve_shard(0, 0, "0:t")


def test_a_shard_the_trainer_has_entirely_sends_only_its_count() -> None:
    p = _pusher()
    ends: list[tuple[int, int, int]] = []
    p._push_end = lambda e, s, count, entry: ends.append((e, s, count))  # type: ignore[method-assign]
    p._push = lambda *a, **k: pytest.fail("pushed a batch the trainer has")  # type: ignore[method-assign]
    p.serve_shard(0, 2, "2:t", skip=1)
    assert ends == [(0, 2, 1)]


def test_every_batch_of_a_shard_is_pushed_in_order_the_last_one_marked() -> None:
    p = _pusher()
    pushed: list[tuple[Any, bool]] = []

    def push(frame: Any, entry: str, *, last: bool, produce_ms: int = 0, **_: Any) -> bool:
        assert entry == "0:t"
        pushed.append((frame, last))
        return True

    p._push = push  # type: ignore[method-assign]
    p.serve_shard(0, 0, "0:t")
    expected = list(p.plan.iter_shard_marked(0, 0))
    assert len(pushed) == len(expected) >= 1
    assert [last for _, last in pushed] == [last for _, last in expected]


def test_a_status_that_is_not_the_pushers_goes_to_the_producer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p = _pusher(fail_at=0)
    reply = CountReply(Status.FINISHED)
    monkeypatch.setattr(producer_scripts, "fail", lambda *a, **k: reply)
    p._push = lambda *a, **k: pytest.fail("pushed for a finished run")  # type: ignore[method-assign]
    # Returned to the caller (the Producer acts once the pusher is done), not acted on.
    assert p._retry_elsewhere(0, 0, "0:t") == Handover(Status.FINISHED)
    assert p.serve_shard(0, 0, "0:t") == Status.FINISHED


def test_aim_points_the_pushes_at_a_ranks_list() -> None:
    p = _pusher()
    p.frames.aim(2, 4)
    assert p.frames.data_key == QueueKeys("q").data_of(2, 4)


def test_a_descriptor_refused_with_reroute_goes_through_redis_and_frees_its_segment(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport, _trainer = shm_pair(tmp_path, fake_redis, 2)
    p = _pusher(transport=transport)
    p.ahead.leases.append(Lease(1, 0, "t", 4, 1))  # the next lease is in hand: none rides along
    frame = p._encode_batch(0, 0, 0, (np.arange(10),), True)
    assert isinstance(frame, ShmFrame)
    pushed: list[tuple[bytes, str]] = []
    real_push_call = frame_push.push_call

    def push_call(keys: QueueKeys, **kw: Any) -> Any:
        pushed.append((bytes(kw["element"]), kw["shm_host"]))
        return real_push_call(keys, **kw)

    monkeypatch.setattr(frame_push, "push_call", push_call)
    replies = iter([[b"REROUTE"], [b"OK", 1]])
    p.frames._send = lambda *args: [next(replies)]  # type: ignore[method-assign]
    assert p._push_batch(frame, "0:t", True, 0) is True
    (descriptor, host), (inline, no_host) = pushed
    assert shm.is_descriptor(descriptor) and host == transport.identity
    assert not shm.is_descriptor(inline) and no_host == ""
    assert codec.decode_frame(inline).data[0].tolist() == list(range(10))
    assert frame.segment.is_free() and transport.reroutes == 1


def test_a_descriptor_whose_push_lost_its_connection_is_remembered_as_uncertain(
    tmp_path: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    transport, _trainer = shm_pair(tmp_path, fake_redis, 2)
    p = _pusher(transport=transport)
    p.ahead.leases.append(Lease(1, 0, "t", 4, 1))
    frame = p._encode_batch(0, 0, 0, (np.arange(10),), True)

    def send(*args: Any) -> list[Any]:
        raise ConnectionLost("Redis connection lost while pushing a frame")

    p.frames._send = send  # type: ignore[method-assign]
    with pytest.raises(ConnectionLost):
        p._push_batch(frame, "0:t", True, 0)
    assert transport._uncertain == [(frame, QueueKeys("q").data)]


@pytest.mark.usefixtures("quick_builds")
def test_the_next_leased_shard_is_built_while_the_last_push_travels() -> None:
    p = _pusher(leasing=True)
    p.ahead.leases.append(Lease(1, 0, "t1", 4, 1, run="run"))  # shard 1, leased ahead
    p.ahead.depth = 1
    order: list[str] = []

    def send(ref: Any, store: Any, push: Any, leases: Any = None, between: Any = None) -> Any:
        order.append("sent")
        if between is not None:
            between()
            order.append("built")
        order.append("read")
        return [[b"OK", 1], *([[b"BUSY"]] * len(leases or ()))]

    p.frames._send = send  # type: ignore[method-assign]
    p.serve_shard(0, 0, "0:run:t0")
    assert order[-3:] == ["sent", "built", "read"]  # the last push built shard 1 meanwhile
    ready = p.ahead.ready
    assert ready is not None and ready.entry == "1:run:t1" and ready.error is None
    expected = next(iter(p.plan.iter_shard_marked(0, 1)))
    assert ready.step is not None and ready.step[1] == expected[1]
    pushed: list[Any] = []
    p._push = lambda frame, *a, **k: pushed.append(frame) or True  # type: ignore[method-assign]
    p.serve_shard(0, 1, "1:run:t1")  # served from what was built: the same frame object
    assert pushed[0] is ready.frame and p.ahead.ready is None


def _pushed_and_busy(
    ref: Any, store: Any, push: Any, leases: Any = None, between: Any = None
) -> list[Any]:
    """A push round trip that runs ``between`` (the build ahead), pushes, and grants no
    further lease."""
    if between is not None:
        between()
    return [[b"OK", 1], *([[b"BUSY"]] * len(leases or ()))]


@pytest.mark.usefixtures("quick_builds")
def test_a_pipeline_error_met_while_building_ahead_is_reported_by_that_shard() -> None:
    p = _pusher(fail_at=10, leasing=True)  # shard 1's first batch raises
    p.ahead.leases.append(Lease(1, 0, "t1", 4, 1, run="run"))
    p.ahead.depth = 1
    p.frames._send = _pushed_and_busy  # type: ignore[method-assign]
    p.serve_shard(0, 0, "0:run:t0")
    assert p.ahead.ready is not None and isinstance(p.ahead.ready.error, ValueError)
    failed: list[tuple[int, int, str]] = []
    p._retry_elsewhere = lambda e, s, entry: failed.append((e, s, entry)) or True  # type: ignore[method-assign]
    p.serve_shard(0, 1, "1:run:t1")
    assert failed == [(0, 1, "1:run:t1")]


@pytest.mark.usefixtures("quick_builds")
def test_a_lease_refused_for_oom_never_hides_the_push_that_went_through() -> None:
    p = _pusher(leasing=True)
    p.ahead.depth = 1
    sends: list[int] = []
    oom = redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")

    def send(ref: Any, store: Any, push: Any, leases: Any = None, between: Any = None) -> Any:
        sends.append(len(leases or ()))
        return [[b"OK", 1], *([oom] * len(leases or ()))]  # the push went through

    p.frames._send = send  # type: ignore[method-assign]
    p.serve_shard(0, 0, "0:run:t0")  # would be LEASE_LOST (and drop the listed frame) if resent
    assert sends == [2] and not p.ahead.leases and p.frames.oom_waits == 0


@pytest.mark.usefixtures("quick_builds")
def test_a_push_refused_for_oom_is_sent_again_with_its_leases() -> None:
    p = _pusher(leasing=True)
    p.ahead.depth = 1
    oom = redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
    replies = iter(
        [
            [oom, [b"BUSY"], [b"BUSY"]],
            [[b"OK", 1], [b"OK", b"1", 0, 0, 1, 1, b""], [b"OK", b"2", 0, 0, 1, 1, b""]],
        ]
    )
    sends: list[int] = []

    def send(ref: Any, store: Any, push: Any, leases: Any = None, between: Any = None) -> Any:
        sends.append(len(leases or ()))
        return next(replies)

    p.frames._send = send  # type: ignore[method-assign]
    p.frames.wait_for_room = lambda: None  # type: ignore[method-assign]
    p.serve_shard(0, 0, "0:run:t0")
    assert sends == [2, 2] and p.frames.oom_waits == 1
    assert [lease.g for lease in p.ahead.leases] == [1, 2]


@pytest.mark.usefixtures("quick_builds")
def test_a_push_sent_again_after_oom_does_not_build_the_next_shard_again() -> None:
    p = _pusher(leasing=True)
    p.ahead.leases.append(Lease(1, 0, "t1", 4, 1, run="run"))
    p.ahead.depth = 1
    oom = redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
    replies = iter([[oom, [b"BUSY"]], [[b"OK", 1], [b"BUSY"]]])
    built: list[Any] = []

    def send(ref: Any, store: Any, push: Any, leases: Any = None, between: Any = None) -> Any:
        if between is not None:
            between()
            built.append(p.ahead.ready)
        return next(replies)

    p.frames._send = send  # type: ignore[method-assign]
    p.frames.wait_for_room = lambda: None  # type: ignore[method-assign]
    p.serve_shard(0, 0, "0:run:t0")
    assert len(built) == 1 and p.ahead.ready is built[0]


@pytest.mark.usefixtures("quick_builds")
def test_a_shard_served_from_a_batch_built_ahead_still_follows_the_trainers_host() -> None:
    p = _pusher(leasing=True)
    p.ahead.leases.append(Lease(1, 0, "t1", 4, 1, run="run"))
    p.ahead.depth = 1
    p.frames._send = _pushed_and_busy  # type: ignore[method-assign]
    p.serve_shard(0, 0, "0:run:t0")
    assert p.ahead.ready is not None
    refreshed: list[Any] = []
    p._transport.refresh = lambda client, **kw: refreshed.append(client)  # type: ignore[method-assign]
    p.serve_shard(0, 1, "1:run:t1")  # every batch of it was built ahead
    # Without this a producer that started before the trainer, once every shard is
    # built ahead, would never see the trainer's host appear (tests/consumer/test_torch_shm).
    assert refreshed


@pytest.mark.usefixtures("quick_builds")
def test_a_reply_that_is_the_producers_business_is_returned_with_nothing_dropped() -> None:
    p = _pusher(leasing=True)
    p.ahead.leases.append(Lease(1, 0, "t1", 4, 1, run="run"))
    p.ahead.depth = 1

    def send(ref: Any, store: Any, push: Any, leases: Any = None, between: Any = None) -> Any:
        if between is not None:
            between()
        return [[b"RUN_CHANGED"], *([[b"BUSY"]] * len(leases or ()))]

    p.frames._send = send  # type: ignore[method-assign]
    assert p.serve_shard(0, 0, "0:run:t0") == Status.RUN_CHANGED
    # The pusher did not act on it: what it holds ahead is the Producer's to drop when
    # it joins again (before, the reply's callback joined while the pusher's call ran).
    leased = [Lease(1, 0, "t1", 4, 1, run="run")]
    assert p.ahead.ready is not None and list(p.ahead.leases) == leased
    p.joined(RunPosition("run2", "inc2"))
    assert p.ahead.ready is None and not p.ahead.leases


def test_a_hand_back_refused_by_a_changed_run_is_handed_to_the_producer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p = _pusher()
    p.joined(RunPosition("run", "inc", world=2))
    p.frames.aim(0, 2)
    monkeypatch.setattr(frame_push, "hand_back", lambda *a: Status.RUN_CHANGED)
    p.frames.wait_for_room = lambda: None  # type: ignore[method-assign]
    wait = Waiting()
    wait.start()
    wait.full_since -= HANDBACK_S
    assert p.frames._full("0:t", None, wait) == Handover(Status.RUN_CHANGED)
    monkeypatch.setattr(frame_push, "hand_back", lambda *a: Status.OK)
    wait.full_since -= HANDBACK_S
    assert p.frames._full("0:t", None, wait) is False  # handed back: the shard is no longer ours


def test_a_build_returns_or_raises_as_if_called_here() -> None:
    watch = BuildWatch(5.0, lambda: "")
    assert watch.call(lambda: 41 + 1, "batch 0") == 42
    with pytest.raises(KeyError, match="boom"):
        watch.call(lambda: {}["boom"], "batch 1")
    assert watch.hung is None and watch.call(lambda: "again", "batch 2") == "again"


def test_a_build_past_the_timeout_names_what_it_read_and_the_watch_stops() -> None:
    release = threading.Event()
    watch = BuildWatch(0.05, lambda: "example 7")
    with pytest.raises(BuildTimeout, match=r"batch 3: no batch after build_timeout_s=0.05 "
                       r"\(reading example 7\)"):  # fmt: skip
        watch.call(lambda: release.wait(30), "batch 3")
    ran = []
    with pytest.raises(BuildTimeout):  # the hung build still runs: nothing else may
        watch.call(lambda: ran.append(1), "batch 4")
    release.set()
    assert ran == []
