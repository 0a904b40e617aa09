"""The scripts in a run read by several groups, on the real redis-server: registering
groups (claim), one lease for every group at a cursor (lease), one push into every
group's list with the frame stored once (push, release), the pace, a group left behind,
and a caller with the view of one group told the run's groups."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from batchq.protocol import producer_scripts, recovery_scripts, trainer_scripts
from batchq.protocol.calls import round_trip
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import lease_entry
from batchq.protocol.producer_scripts import LeaseReply, PushReply
from batchq.protocol.trainer_scripts import ClaimReply
from batchq.protocol.words import Status
from batchq.wire.frame import encode_ref

TTL_MS = 10_000
HWM, SHARDS, WINDOW = 3, 10, 4


class Run:
    """Drives one queue's run of several groups the way trainers and producers do."""

    def __init__(self, client: redis.Redis, queue: str) -> None:
        self.c = client
        self.k = QueueKeys(queue)
        self.tokens: dict[str, str] = {}
        self.slots: dict[str, int] = {}
        self.inc = self.run = ""

    def groups(self) -> int:
        return int(self.c.hget(self.k.meta, "groups") or 0)

    def claim(self, group: str, op: str = "acquire", max_lag: int | None = None) -> ClaimReply:
        token = self.tokens.setdefault(group, f"tok-{group}")
        reply = trainer_scripts.claim(
            self.c, self.k, op=op, token=token, claim_ttl_ms=TTL_MS, run_id="run1",  # type: ignore[arg-type]
            new_incarnation="inc1", takeover_run="", version="1", group=group, rank=0,
            world=1, even="pad", resumed="", incarnation="" if op == "acquire" else self.inc,
            groups=self.groups(), key_world=1, max_lag=max_lag, slot=self.slots.get(group, 0),
        )  # fmt: skip
        if op == "acquire" and reply.status == Status.OK:
            self.slots[group] = reply.slot
            self.inc, self.run = reply.incarnation, reply.run
        return reply

    def join(self, producer: str) -> None:
        reply = producer_scripts.join(
            self.c, self.k, producer=producer, fingerprint="fp", hwm=HWM, shards=SHARDS,
            window=WINDOW, new_run="runX", new_incarnation="incX", heartbeat_ttl_ms=TTL_MS,
            version="1", epoch_batches=SHARDS, age_ms=3_600_000, no_create=False,
        )  # fmt: skip
        assert reply.status == Status.OK and reply.groups == self.groups()

    def lease(self, producer: str, token: str) -> LeaseReply:
        return producer_scripts.lease_call(
            self.k, incarnation=self.inc, run=self.run, producer=producer, token=token,
            heartbeat_ttl_ms=TTL_MS, prefetch=0, groups=self.groups(), world=1,
        ).run(self.c)  # fmt: skip

    def push(
        self, producer: str, lease: LeaseReply, token: str, element: bytes, frame: str | None
    ) -> PushReply:
        entry = lease_entry(lease.g, self.run, token, lease.mask)
        return producer_scripts.push_call(
            self.k, targets=lease.mask, rank=0, world=1, groups=self.groups(), frame_key=frame,
            incarnation=self.inc, run=self.run, producer=producer, entry=entry, element=element,
            last=True, heartbeat_ttl_ms=TTL_MS, frame_bytes=len(element), blocked_ms=0,
            produce_ms=0,
        ).run(self.c)  # fmt: skip

    def list_of(self, group: str) -> str:
        return self.k.slot_view(self.slots[group]).data

    def floor(self, group: str, value: int) -> None:
        slot = self.slots[group]
        self.c.hset(self.k.meta, "floor" if slot == 0 else f"floor@{slot}", value)


@pytest.fixture
def run(redis_client: redis.Redis, queue_name: str) -> Run:
    r = Run(redis_client, queue_name)
    for g in ("a", "b", "c"):
        assert r.claim(g).status == Status.OK
    r.join("p")
    return r


def test_groups_take_slots_in_order_of_their_first_claim(run: Run) -> None:
    assert run.slots == {"a": 0, "b": 1, "c": 2}
    assert run.c.hgetall(run.k.groups) == {b"a": b"0", b"b": b"1", b"c": b"2"}
    again = run.claim("b")  # its own claim again: the same slot
    assert (again.status, again.slot, again.groups) == (Status.OK, 1, 3)


def test_one_shard_is_leased_for_every_group_and_pushed_into_each_list(run: Run) -> None:
    lease = run.lease("p", "t1")
    assert (lease.status, lease.g, lease.mask) == (Status.OK, 0, 0b111)
    assert run.push("p", lease, "t1", b"frame-0", None).status == Status.OK
    assert [run.c.lrange(run.list_of(g), 0, -1) for g in "abc"] == [[b"frame-0"]] * 3
    stats = run.c.hgetall(run.k.stats)
    assert stats[b"pushed"] == b"1"  # built once


def test_a_frame_stored_once_goes_with_its_last_readers_release(run: Run) -> None:
    frame = run.k.frame(run.run, "p", 1)
    run.c.set(frame, b"bytes of a large frame")
    lease = run.lease("p", "t1")
    assert run.push("p", lease, "t1", encode_ref(frame), frame).status == Status.OK
    assert run.c.hget(run.k.refs, frame) == b"3" and run.c.ttl(frame) == -1
    for reader in range(3):
        got = round_trip(
            run.c, [("GET", frame), trainer_scripts.release_call(run.k, [frame]).command()], "test"
        )
        assert got[0] == b"bytes of a large frame"  # read before the count drops
        assert run.c.exists(frame) == (reader < 2)
    assert run.c.exists(run.k.refs) == 0


def test_a_group_behind_the_others_gets_its_shards_alone_first(run: Run) -> None:
    for g in ("a", "b"):  # a and b read 0..2 and have 3 and 4 leased; c joined late, at 0
        run.c.hset(run.k.meta, "next" if run.slots[g] == 0 else f"next@{run.slots[g]}", 5)
        run.floor(g, 3)
    lease = run.lease("p", "t1")
    assert (lease.g, lease.mask) == (0, 0b100)  # c has fewest shards above its floor
    run.c.hset(run.k.meta, "next@2", 5)  # c caught up: one stream again
    run.floor("c", 3)
    assert run.lease("p", "t2").mask == 0b111


def test_the_shared_stream_waits_within_the_window_of_its_slowest_group(run: Run) -> None:
    for i in range(WINDOW):  # nobody reads: the window of every group fills
        assert run.lease("p", f"t{i}").mask == 0b111
    assert run.lease("p", "t9").status == Status.WAIT
    run.floor("a", 3)
    run.floor("b", 3)
    assert run.lease("p", "t10").status == Status.WAIT  # c holds it
    run.floor("c", 1)
    assert (run.lease("p", "t11").g, run.lease("p", "t12").status) == (4, Status.WAIT)


def test_a_group_with_max_lag_stops_pacing_the_others_once_behind(run: Run) -> None:
    run.c.hset(run.k.meta, "max_lag@2", 2)  # c's max_lag_batches (its claim sets it)
    for i in range(WINDOW):
        run.lease("p", f"t{i}")
    run.floor("a", 4)
    run.floor("b", 4)  # c (floor 0) is 4 batches behind, more than its 2
    lease = run.lease("p", "t9")
    assert (lease.status, lease.g, lease.mask) == (Status.OK, 4, 0b011)


def test_a_full_list_holds_the_push_unless_its_group_may_be_left_behind(run: Run) -> None:
    run.c.rpush(run.list_of("c"), *[b"x"] * HWM)  # c's list is full; c paces the run
    lease = run.lease("p", "t1")
    assert lease.mask == 0b111
    assert run.push("p", lease, "t1", b"f", None).status == Status.FULL  # the others wait
    run.c.hset(run.k.meta, "max_lag@2", 0)  # c may be left behind: it is, by 1 batch
    reply = run.push("p", lease, "t1", b"f", None)
    assert (reply.status, reply.dropped) == (Status.OK, 0b100)  # built for it alone later
    assert run.c.lrange(run.k.work, 0, -1) == [b"0/4"]
    assert run.c.hget(run.k.slot_view(2).stats, "detached_drops") == b"1"
    assert [run.c.llen(run.list_of(g)) for g in "abc"] == [1, 1, HWM]


def test_a_finished_group_takes_no_frame_and_the_last_finish_ends_the_run(run: Run) -> None:
    reply = run.claim("b", op="finish")
    assert (reply.status, reply.group_done, reply.run_done) == (Status.OK, True, False)
    lease = run.lease("p", "t1")
    assert lease.mask == 0b101
    assert run.claim("a", op="finish").run_done is False
    assert run.claim("c", op="finish").run_done is True
    assert run.c.hget(run.k.meta, "finished") == b"1"
    assert not any(run.c.exists(run.list_of(g)) for g in "abc")


def test_a_view_of_one_group_is_told_the_runs_groups(run: Run) -> None:
    lease = producer_scripts.lease_call(
        run.k, incarnation=run.inc, run=run.run, producer="p", token="t", heartbeat_ttl_ms=1,
        prefetch=0, groups=0, world=1,
    ).run(run.c)  # fmt: skip
    assert lease.status == Status.GROUPS
    claim = trainer_scripts.claim(
        run.c, run.k, op="acquire", token="x", claim_ttl_ms=1, run_id="r", new_incarnation="i",
        takeover_run="", version="1", group="", rank=0, world=1, even="pad", resumed="",
        incarnation="", groups=0, key_world=1, max_lag=None, slot=0,
    )  # fmt: skip
    assert claim.status == Status.GROUPS


def test_a_lease_handed_back_goes_back_for_the_same_groups(run: Run) -> None:
    lease = run.lease("p", "t1")
    reply = recovery_scripts.reap(run.c, run.k, incarnation=run.inc, why="leave", producers=["p"])
    assert reply.second == 1
    assert run.c.lrange(run.k.work, 0, -1) == [f"{lease.g}/7".encode()]
    run.join("p")
    again = run.lease("p", "t2")
    assert (again.g, again.mask) == (lease.g, 0b111)


def test_a_groups_reap_counts_the_shards_it_hands_back_in_the_queues_stats(
    run: Run,
) -> None:
    run.lease("p", "t1")  # p is then killed: the reader of group c (slot 2) reaps it
    view = run.k.slot_view(run.slots["c"])
    reply = recovery_scripts.reap(run.c, view, incarnation=run.inc, why="leave", producers=["p"])
    assert reply.second == 1
    # Built again for the pool: the queue's counter (status, the exporter), not c's.
    assert run.c.hget(run.k.stats, "redone_shards") == b"1"
    assert run.c.hget(view.stats, "redone_shards") is None


def test_a_stale_view_of_the_groups_is_told_to_read_them_again(run: Run) -> None:
    call: Any = producer_scripts.lease_call(
        run.k, incarnation=run.inc, run=run.run, producer="p", token="t", heartbeat_ttl_ms=1,
        prefetch=0, groups=2, world=1,
    )  # fmt: skip
    reply = call.run(run.c)
    assert (reply.status, reply.groups) == (Status.GROUPS, 3)
