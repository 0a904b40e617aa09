"""The Lua scripts on the real redis-server: join, lease, push, pop, claim, reap."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis

from batchq.client.connection import make_client
from batchq.protocol import recovery_scripts, trainer_scripts
from batchq.protocol.calls import build_call, decode_reply
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import HISTORY_CAP, WAKE_CAP
from batchq.protocol.trainer_scripts import ResumeArgs

TTL_MS = 10_000


def raw(name: str, client: redis.Redis, keys: dict, args: dict, **tails: Any) -> list:
    """Run a script with its header's names, returning its decoded raw reply."""
    return build_call(name, decode_reply, keys, args, **tails).run(client)


class Q:
    """Drives the scripts of one queue the way producers and the trainer do."""

    def __init__(self, client: redis.Redis, queue: str) -> None:
        self.c = client
        self.k = QueueKeys(queue)
        self.inc = ""
        self.run = ""

    def join(
        self,
        p: str,
        fp: str = "fp",
        hwm: int = 3,
        shards: int = 4,
        window: int = 6,
        age: int = 3_600_000,
        version: str = "1",
    ) -> list:
        k = self.k
        reply = raw(
            "join",
            self.c,
            {"meta": k.meta, "incarnation": k.incarnation, "producers": k.producers,
             "lease": k.lease(p), "work": k.work, "data": k.data, "failures": k.failures,
             "ledger": k.ledger, "stats": k.stats, "wake": k.wake, "planwait": k.planwait},
            {"producer": p, "fingerprint": fp, "hwm": hwm, "shards": shards, "window": window,
             "new_run": "run1", "new_incarnation": "inc1", "heartbeat_ttl_ms": TTL_MS,
             "version": version, "epoch_batches": shards, "age_ms": age,
             "no_create": "0", "shard_batches": 1, "stripes": 1},
        )  # fmt: skip
        if reply[0] == "OK":
            self.inc, self.run = reply[1], reply[2]
        return reply

    def lease(self, p: str, token: str, prefetch: int = 0, after: str = "") -> list:
        k = self.k
        return raw(
            "lease",
            self.c,
            {"meta": k.meta, "incarnation": k.incarnation, "work": k.work, "lease": k.lease(p),
             "producers": k.producers, "failures": k.failures},
            {"incarnation": self.inc, "run": self.run, "producer": p, "token": token,
             "heartbeat_ttl_ms": TTL_MS, "prefetch": prefetch, "after": after, "groups": 0},
            more_keys=k.lease_tails[0, 1],
        )  # fmt: skip

    def push(
        self, p: str, entry: str, element: bytes, last: bool = False, shm_host: str = ""
    ) -> list:
        k = self.k
        return raw(
            "push",
            self.c,
            {"meta": k.meta, "incarnation": k.incarnation, "stats": k.stats,
             "producers": k.producers, "lease": k.lease(p), "pstats": k.pstats, "refs": k.refs,
             "work": k.work},
            {"incarnation": self.inc, "run": self.run, "producer": p, "entry": entry,
             "element": element, "last": int(last), "heartbeat_ttl_ms": TTL_MS,
             "frame_bytes": len(element), "blocked_ms": 0, "produce_ms": 3, "shm_host": shm_host,
             "rank": 0, "world": 1, "targets": 1, "groups": 0, "by_ref": "0"},
            more_keys=k.push_tails[1, 0, 1],
        )  # fmt: skip

    def claim(self, token: str, op: str = "acquire", takeover: str = "") -> list:
        k = self.k
        return raw(
            "claim",
            self.c,
            {"meta": k.meta, "incarnation": k.incarnation, "data": k.data, "groups": k.groups,
             "work": k.work, "wake": k.wake, "failures": k.failures, "refs": k.refs,
             "remap": k.remap},
            {"token": token, "claim_ttl_ms": TTL_MS, "op": op, "run_id": "run2",
             "new_incarnation": "inc2", "takeover_run": takeover, "version": "1", "group": "",
             "rank": 0, "world": 1, "even": "pad", "resumed": "", "incarnation": "",
             "groups": 0, "key_world": 1, "max_lag": "", "slot_arg": 0, "max_groups": 32,
             "name": "", "dead": ""},
            more_keys=k.slot_tails[0, 1],
        )  # fmt: skip

    def pop(self, token: str, n: int = 10, floor: int = 0, extra_popped: int = 0) -> Any:
        """The raw reply (its frames stay bytes)."""
        k = self.k
        return build_call(
            "pop",
            lambda reply: reply,
            {"meta": k.meta, "incarnation": k.incarnation, "data": k.data, "wake": k.wake,
             "stats": k.stats, "producers": k.producers, "trainer": k.trainer,
             "history": k.history, "pstats": k.pstats},
            {"incarnation": self.inc, "run": self.run, "token": token, "room": n,
             "floor": floor, "claim_ttl_ms": TTL_MS, "extra_popped": extra_popped, "nbytes": 0,
             "waited_ms": 0, "busy_ms": 0, "epochs": 0, "buckets": "", "figures": "",
             "sample": "", "sfx": "", "wake_cap": WAKE_CAP, "history_cap": HISTORY_CAP},
        ).run(self.c)  # fmt: skip


@pytest.fixture
def q(redis_url: str, queue_name: str) -> Any:
    client = make_client(redis_url)
    yield Q(client, queue_name)
    client.close()


def test_join_creates_the_queue_and_refuses_another_pipeline(q: Q) -> None:
    assert q.join("p1")[:2] == ["OK", "inc1"]
    meta = q.c.hgetall(q.k.meta)
    assert meta[b"fingerprint"] == b"fp" and meta[b"hwm"] == b"3" and meta[b"shards"] == b"4"
    assert q.c.get(q.k.incarnation) == b"inc1"
    assert q.join("p2", fp="other") == ["MISMATCH", "fingerprint", "fp"]
    assert q.join("p2", hwm=5) == ["MISMATCH", "hwm", "3"]
    # A producer of another batchq version: refused, nothing written (not a producer).
    assert q.join("p3", version="2") == ["MISMATCH", "version", "1"]
    assert q.c.zscore(q.k.producers, "p3") is None


def test_lease_is_idempotent_and_bounded_by_the_window(q: Q) -> None:
    q.join("p1")
    # slots 0: a world-1 run of one group (the plan's S); world 1, mask 1; '': no params log
    assert q.lease("p1", "t1") == ["OK", "0", 0, 0, 1, 1, "", 0]
    assert q.lease("p1", "t1") == ["OK", "0", 0, 0, 1, 1, "", 0]  # a retry: the same shard
    got = [q.lease("p1", f"t{i}")[1] for i in range(2, 7)]
    assert got == ["1", "2", "3", "4", "5"]
    assert q.lease("p1", "t7") == ["WAIT"]  # window 6 past floor 0
    assert q.c.lrange(q.k.lease("p1"), 0, -1)[0] == b"0:run1:t1"


def test_push_never_exceeds_the_hwm_and_pop_wakes_producers(q: Q) -> None:
    q.join("p1")
    q.lease("p1", "t1")
    for i in range(3):
        assert q.push("p1", "0:run1:t1", b"f%d" % i)[0] == "OK"
    assert q.push("p1", "0:run1:t1", b"f3") == ["FULL", 3]
    assert q.claim("tok")[0] == "OK"
    reply = q.pop("tok", n=1)
    assert reply[0] == b"OK" and reply[3] == [b"f0"]  # oldest first
    assert q.c.llen(q.k.wake) == 1  # the list was at the cap: one token
    assert q.push("p1", "0:run1:t1", b"f3", last=True)[0] == "OK"
    assert q.c.llen(q.k.lease("p1")) == 0  # the last frame released the lease
    stats = q.c.hgetall(q.k.stats)
    assert stats[b"pushed"] == b"4" and stats[b"popped"] == b"1" and stats[b"shards_done"] == b"1"
    pstats = q.c.hgetall(q.k.pstats)
    assert pstats[b"p1:batches"] == b"4" and pstats[b"p1:produce_ms"] == b"12"


def test_a_prefetch_is_granted_only_behind_a_push_that_went_through_and_under_k(q: Q) -> None:
    q.join("p1", window=10)
    assert q.lease("p1", "t0")[:2] == ["OK", "0"]
    # Behind a push that did not go through (its entry is still held): never, whatever k.
    assert q.lease("p1", "t1", prefetch=2, after="0:run1:t0") == ["BUSY"]
    q.push("p1", "0:run1:t0", b"f0", last=True)  # went through: the entry is gone
    assert q.lease("p1", "t1", prefetch=2, after="0:run1:t0")[:2] == ["OK", "1"]
    assert q.lease("p1", "t2", prefetch=2, after="0:run1:t0")[:2] == ["OK", "2"]  # one ahead
    assert q.lease("p1", "t3", prefetch=2, after="0:run1:t0") == ["BUSY"]  # holds 2 already
    assert q.lease("p1", "t3", prefetch=1, after="0:run1:t0") == ["BUSY"]  # k=1: only if none
    assert q.c.lrange(q.k.lease("p1"), 0, -1) == [b"1:run1:t1", b"2:run1:t2"]
    # A retried request (its reply lost) gets its shard again, though 2 are held.
    assert q.lease("p1", "t2", prefetch=2, after="0:run1:t0")[:2] == ["OK", "2"]


def test_a_descriptor_is_pushed_only_while_its_host_is_the_trainers(q: Q) -> None:
    q.join("p1")
    q.lease("p1", "t1")
    assert q.push("p1", "0:run1:t1", b"BQM\x01d0", shm_host="here") == ["REROUTE"]  # none yet
    q.c.hset(q.k.meta, "shm_host", "here")
    assert q.push("p1", "0:run1:t1", b"BQM\x01d1", shm_host="here")[0] == "OK"
    q.c.hset(q.k.meta, "shm_host", "elsewhere")  # a trainer on another host took over
    assert q.push("p1", "0:run1:t1", b"BQM\x01d2", shm_host="here") == ["REROUTE"]
    assert q.push("p1", "0:run1:t1", b"frame", last=True)[0] == "OK"  # a frame goes anywhere
    assert q.c.lrange(q.k.data, 0, -1) == [b"frame", b"BQM\x01d1"]
    assert q.c.llen(q.k.lease("p1")) == 0 and q.c.hget(q.k.stats, "pushed") == b"2"


def test_an_acquire_drops_the_published_host_until_the_trainer_publishes_its_own(q: Q) -> None:
    q.join("p1")
    q.c.hset(q.k.meta, mapping={"shm_host": "old-host", "shm_lookahead": 10})
    assert q.claim("tok")[0] == "OK"
    assert q.c.hmget(q.k.meta, ["shm_host", "shm_lookahead"]) == [None, None]


def test_frames_brpop_took_from_a_full_list_wake_producers_at_the_next_pop(q: Q) -> None:
    q.join("p1")
    q.lease("p1", "t1")
    for i in range(3):
        q.push("p1", "0:run1:t1", b"f%d" % i)
    assert q.push("p1", "0:run1:t1", b"f3") == ["FULL", 3]  # the producer now waits for a wake
    assert q.claim("tok")[0] == "OK"
    assert q.c.brpop([q.k.data], timeout=1) == (q.k.data.encode(), b"f0")  # the reader's BRPOP
    reply = q.pop("tok", n=0, extra_popped=1)  # the next pop script counts it
    assert reply[0] == b"OK" and reply[3] == []
    assert q.c.llen(q.k.wake) == 1  # 2 left + 1 taken: the list was at the cap
    assert int(q.c.hget(q.k.stats, "popped") or 0) == 1
    q.c.delete(q.k.wake)
    q.c.brpop([q.k.data], timeout=1)
    q.pop("tok", n=0, extra_popped=1)  # 1 left + 1 taken: below the cap, nobody waits
    assert q.c.llen(q.k.wake) == 0


def test_racing_pushes_at_hwm_minus_one_admit_exactly_one(q: Q, redis_url: str) -> None:
    q.join("p1", hwm=5)
    q.lease("p1", "t1")
    for i in range(4):
        q.push("p1", "0:run1:t1", b"x%d" % i)
    barrier = threading.Barrier(8)
    results: list[str] = []

    def racer(i: int) -> None:
        client = make_client(redis_url)
        mine = Q(client, q.k.queue)
        mine.inc, mine.run = q.inc, q.run
        barrier.wait(timeout=10)
        results.append(mine.push("p1", "0:run1:t1", b"r%d" % i)[0])
        client.close()

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(results) == ["FULL"] * 7 + ["OK"]
    assert q.c.llen(q.k.data) == 5


def test_lease_lost_after_reap_and_returned_shards_go_first(q: Q) -> None:
    q.join("p1")
    q.join("p2")
    assert q.lease("p1", "a")[1] == "0"
    assert q.lease("p1", "b")[1] == "1"
    k = q.k
    reply = recovery_scripts.reap(q.c, k, incarnation=q.inc, why="leave", producers=["p1"])
    assert (reply.status, reply.first, reply.second) == ("OK", 1, 2)
    assert q.c.hget(k.stats, "redone_shards") == b"2"
    assert q.lease("p2", "c")[1] == "0"  # the returned shards, in order, before fresh ones
    assert q.lease("p2", "d")[1] == "1"
    assert q.lease("p2", "e")[1] == "2"
    assert q.push("p1", "0:a", b"late") == ["REAPED"]


def test_a_join_hands_its_own_leases_back_counted(q: Q) -> None:
    q.join("p1")
    assert [q.lease("p1", t)[1] for t in ("a", "b")] == ["0", "1"]  # then p1 restarts
    assert q.join("p1")[0] == "OK"  # the same id, joining again (a reconnect)
    assert q.c.lrange(q.k.work, 0, -1) == [b"0", b"1"]  # built again: counted
    assert q.c.hget(q.k.stats, "redone_shards") == b"2"


def test_dead_reap_spares_live_producers(q: Q) -> None:
    q.join("p1")
    q.lease("p1", "a")
    k = q.k
    reply = recovery_scripts.reap(q.c, k, incarnation=q.inc, why="dead", producers=["p1"])
    assert (reply.status, reply.first, reply.second) == ("OK", 0, 0)
    assert q.c.llen(k.lease("p1")) == 1


def test_a_dead_producers_shards_count_a_failed_attempt_and_leases_say_so(q: Q) -> None:
    # A producer killed mid-shard (gone: its sockets closed; or its heartbeat lapsed)
    # counts a failed attempt on each shard it held: the next builder isolates them
    # (producer/isolation.py). One that leaves (SIGTERM) counts none.
    for p in ("p1", "p2", "p3", "p4"):
        q.join(p)
    k = q.k
    assert q.lease("p1", "a")[1:2] == ["0"] and q.lease("p1", "a")[7] == 0
    q.c.hset(k.clients, mapping={"p1": "11", "p1:hb": "12"})  # as the producer records them
    assert recovery_scripts.gone(q.c, k, incarnation=q.inc, closed={"p1": "11,12"}).first == 1
    assert q.lease("p2", "b")[1:2] == ["0"] and q.lease("p2", "b")[7] == 1
    q.c.zadd(k.producers, {"p2": 1}, xx=True)  # its heartbeat deadline long past
    reply = recovery_scripts.reap(q.c, k, incarnation=q.inc, why="dead", producers=["p2"])
    assert reply.first == 1 and q.c.hget(k.failures, "0") == b"2"
    assert q.lease("p3", "c")[7] == 2
    recovery_scripts.reap(q.c, k, incarnation=q.inc, why="leave", producers=["p3"])
    assert q.lease("p4", "d")[1:2] == ["0"] and q.lease("p4", "d")[7] == 2  # not counted
    assert q.lease("p4", "e")[1:3] == ["1", 0] and q.lease("p4", "e")[7] == 0


def test_a_reap_in_a_new_run_drops_the_old_runs_leases(q: Q) -> None:
    q.join("p1")
    q.join("p2")
    assert [q.lease("p1", t)[1] for t in ("a", "b")] == ["0", "1"]  # p1 is then killed
    k = q.k
    assert q.claim("t1")[:4] == ["OK", "inc1", "run1", 0]
    assert q.claim("t1", op="release") == ["OK"]
    assert q.claim("t2")[:4] == ["OK", "inc1", "run2", 1]  # a trainer without state
    q.join("p2")  # the producer that lived follows the new run
    reply = recovery_scripts.reap(q.c, k, incarnation=q.inc, why="leave", producers=["p1"])
    assert (reply.status, reply.first, reply.second) == ("OK", 1, 0)
    assert q.c.llen(k.work) == 0 and q.c.exists(k.lease("p1")) == 0
    assert q.c.hget(k.stats, "stale_leases") == b"2" and q.c.hget(k.stats, "redone_shards") is None
    assert q.lease("p2", "c")[1] == "0"  # the new run's own first shard, minted


def test_gone_in_a_new_run_drops_the_old_runs_leases(q: Q) -> None:
    q.join("p1")
    assert q.lease("p1", "a")[1] == "0"
    k = q.k
    q.c.hset(k.clients, mapping={"p1": "11", "p1:hb": "12"})  # as the producer records them
    q.claim("t1")
    q.claim("t1", op="release")
    assert q.claim("t2")[2] == "run2"
    reply = recovery_scripts.gone(q.c, k, incarnation=q.inc, closed={"p1": "11,12"})
    assert (reply.status, reply.first, reply.second) == ("OK", 1, 0)
    assert q.c.llen(k.work) == 0 and q.c.hget(k.stats, "stale_leases") == b"1"


def test_a_reap_after_the_run_finished_leaves_no_work_behind(q: Q) -> None:
    q.join("p1")
    assert q.lease("p1", "a")[1] == "0"
    q.claim("t1")
    assert q.claim("t1", op="finish") == ["OK", 1, 1]  # the group done, the run ended
    reply = recovery_scripts.reap(q.c, q.k, incarnation=q.inc, why="leave", producers=["p1"])
    assert (reply.status, reply.first, reply.second) == ("OK", 1, 0)
    assert q.c.exists(q.k.work, q.k.lease("p1")) == 0


def test_claim_conflict_takeover_and_new_run(q: Q) -> None:
    q.join("p1")
    # Adopts the producers' run (not held before; slot 0 of a run of one group).
    assert q.claim("t1") == ["OK", "inc1", "run1", 0, 1, 0, 0, 0]
    assert q.claim("t2")[0] == "CONFLICT"
    assert q.claim("t2", takeover="run1")[:4] == ["OK", "inc1", "run1", 0]
    assert q.pop("t1")[0] == b"CLAIM_LOST"  # the fenced-out trainer cannot pop
    assert q.claim("t2", op="release") == ["OK"]
    # A trainer arriving after the last one left, with no state, starts a new run.
    assert q.claim("t3")[:4] == ["OK", "inc1", "run2", 1]
    assert q.lease("p1", "z") == ["RUN_CHANGED"]


def test_finish_tells_producers(q: Q) -> None:
    q.join("p1")
    q.claim("t1")
    assert q.claim("t1", op="finish") == ["OK", 1, 1]  # the group done, the run ended
    assert q.lease("p1", "a") == ["FINISHED"]
    assert q.push("p1", "0:a", b"x") == ["FINISHED"]
    assert q.join("p2") == ["FINISHED"]  # a late replica of the job (started before)
    reply = q.join("p3", age=0)  # started since: the next job's first producer
    assert reply[0] == "OK" and reply[-1] == 1


def test_every_script_notices_a_lost_incarnation(q: Q) -> None:
    q.join("p1")
    q.lease("p1", "a")
    q.claim("t1")
    q.c.delete(q.k.incarnation)
    assert q.lease("p1", "b") == ["STATE_LOST"]
    assert q.push("p1", "0:a", b"x") == ["STATE_LOST"]
    assert q.pop("t1")[0] == b"STATE_LOST"


def _dumped(q: Q) -> dict[bytes, bytes | None]:
    """Every key of the queue, dumped: what a refused script must leave as it was."""
    return {key: q.c.dump(key) for key in sorted(q.c.scan_iter(match=q.k.pattern))}


PUSH_KEYS = ("meta", "incarnation", "stats", "producers", "lease", "pstats", "data")


@pytest.mark.parametrize("name", PUSH_KEYS)
def test_a_push_names_a_key_of_a_foreign_type_and_writes_nothing(q: Q, name: str) -> None:
    q.join("p1")
    q.lease("p1", "t1")
    assert q.push("p1", "0:run1:t1", b"f0")[0] == "OK"  # every key exists, of its type
    key = q.k.lease("p1") if name == "lease" else getattr(q.k, name)
    q.c.delete(key)
    q.c.sadd(key, "foreign")  # a set is none of the push's types
    before = _dumped(q)
    assert q.push("p1", "0:run1:t1", b"f1", last=True) == ["WRONG_TYPE", key, "set"]
    assert _dumped(q) == before


@pytest.mark.parametrize("name", ("meta", "incarnation", "data"))
def test_a_pop_names_a_key_of_a_foreign_type_and_pops_nothing(q: Q, name: str) -> None:
    q.join("p1")
    q.lease("p1", "t1")
    assert q.push("p1", "0:run1:t1", b"f0")[0] == "OK"
    assert q.claim("tok")[0] == "OK"
    key = getattr(q.k, name)
    q.c.delete(key)
    q.c.sadd(key, "foreign")
    assert q.pop("tok") == [b"WRONG_TYPE", key.encode(), b"set"]
    if name != "data":
        assert q.c.llen(q.k.data) == 1  # the frame stays for the repaired queue


def _resume_keeping(q: Q, token: str, keep: str) -> Any:
    """resume.lua for a single trainer of the checkpoint's run ``run1`` at epoch 0."""
    return trainer_scripts.resume(
        q.c, q.k, ResumeArgs(
            token=token, new_run="run9", takeover_run="run1", first=0, fingerprint="fp",
            hwm=3, shards=4, window=6, epoch_batches=4, group="", rank=0, world=1,
            even="pad", step=0, held=False, slot=0, acquired="run1", claim_ttl_ms=TTL_MS,
            keep=keep,
        ),
        groups=0, key_world=1, remap=None, ledger=[("0:0", "d")],
    )  # fmt: skip


def test_a_detach_gives_frames_back_in_order_and_a_resume_at_its_mark_keeps_the_run(
    q: Q,
) -> None:
    q.join("p1")
    q.lease("p1", "t1")
    q.push("p1", "0:run1:t1", b"f1")
    assert q.claim("tok", takeover="run1")[0] == "OK"
    args = {"incarnation": q.inc, "run": q.run, "position": "pos"}
    refused = trainer_scripts.detach(q.c, q.k, token="other", frames=[b"g"], **args)
    assert refused.status == "CLAIM_LOST" and q.c.llen(q.k.data) == 1
    # The last to hand out first: the next one ends at the popping end.
    given = trainer_scripts.detach(q.c, q.k, token="tok", frames=[b"g3", b"g2"], **args)
    assert (given.status, given.first) == ("OK", 2)
    assert q.c.hget(q.k.meta, "detached") == b"run1:pos"
    assert q.c.lrange(q.k.data, 0, -1) == [b"f1", b"g3", b"g2"]
    next_before = q.c.hget(q.k.meta, "next")
    assert q.claim("tok2", takeover="run1")[0] == "OK"  # the resumed trainer's
    reply = _resume_keeping(q, "tok2", "pos")
    assert (reply.status, reply.run) == ("OK", "run1")
    assert q.c.lrange(q.k.data, 0, -1) == [b"f1", b"g3", b"g2"]  # nothing dropped
    assert q.c.hget(q.k.meta, "next") == next_before  # nor the cursor moved
    assert q.c.hget(q.k.meta, "detached") is None
    assert q.c.lrange(q.k.lease("p1"), 0, -1) == [b"0:run1:t1"]  # the lease stands


def test_a_detach_gives_back_more_frames_than_one_unpack_takes(q: Q) -> None:
    q.join("p1")
    assert q.claim("tok")[0] == "OK"
    frames = [b"%d" % i for i in range(2500, 0, -1)]  # the last to hand out first
    reply = trainer_scripts.detach(
        q.c, q.k, incarnation=q.inc, run=q.run, token="tok", position="p", frames=frames
    )
    assert (reply.status, reply.first) == ("OK", 2500)
    assert q.c.rpop(q.k.data, 3) == [b"1", b"2", b"3"]
    assert q.c.llen(q.k.data) == 2497 and q.c.hget(q.k.stats, "given_back") == b"2500"


def test_a_detach_in_chunks_marks_the_run_with_its_last_only(q: Q) -> None:
    q.join("p1")
    assert q.claim("tok")[0] == "OK"
    args = {"incarnation": q.inc, "run": q.run, "token": "tok", "position": "p"}
    trainer_scripts.detach(q.c, q.k, frames=[b"4", b"3"], final=False, **args)
    assert q.c.hget(q.k.meta, "detached") is None  # given back in part: unmarked
    trainer_scripts.detach(q.c, q.k, frames=[b"2", b"1"], final=True, **args)
    assert q.c.hget(q.k.meta, "detached") == b"run1:p"
    assert q.c.rpop(q.k.data, 4) == [b"1", b"2", b"3", b"4"]


@pytest.mark.parametrize("change", ["another_state", "params", "finished"])
def test_a_resume_off_the_mark_or_of_a_changed_run_starts_a_new_run(q: Q, change: str) -> None:
    q.join("p1")
    q.lease("p1", "t1")
    q.push("p1", "0:run1:t1", b"f1")
    assert q.claim("tok", takeover="run1")[0] == "OK"
    trainer_scripts.detach(
        q.c, q.k, incarnation=q.inc, run=q.run, token="tok", position="pos", frames=[b"g"]
    )
    keep = "other" if change == "another_state" else "pos"
    if change == "params":
        q.c.hset(q.k.meta, "params", "run1:1")
    if change == "finished":
        q.c.hset(q.k.meta, "finished", 1)
    assert q.claim("tok2", takeover="run1")[0] == "OK"
    reply = _resume_keeping(q, "tok2", keep)
    assert (reply.status, reply.run) == ("OK", "run9")
    assert q.c.llen(q.k.data) == 0  # the old run's frames went with it


def test_a_stale_params_stamp_of_an_older_run_does_not_block_the_takeover(q: Q) -> None:
    q.join("p1")
    assert q.claim("tok", takeover="run1")[0] == "OK"
    q.c.hset(q.k.meta, "params", "run0:2")  # left by a run before this one
    trainer_scripts.detach(
        q.c, q.k, incarnation=q.inc, run=q.run, token="tok", position="pos", frames=[b"g"]
    )
    assert q.claim("tok2", takeover="run1")[0] == "OK"
    reply = _resume_keeping(q, "tok2", "pos")
    assert (reply.status, reply.run) == ("OK", "run1") and q.c.lrange(q.k.data, 0, -1) == [b"g"]


@pytest.mark.parametrize("max_attempts", [0, -1])
def test_fail_refuses_max_attempts_below_one_before_any_call(max_attempts: int) -> None:
    # handback.lua reads max_attempts 0 as an untouched handback: a failure sent with 0
    # would not be counted, and the shard would be retried for ever.
    from batchq.errors import ConfigError
    from batchq.protocol import producer_scripts

    with pytest.raises(ConfigError, match=f"max_attempts={max_attempts}: expected"):
        producer_scripts.fail(
            None,  # type: ignore[arg-type]  # never reached: refused first
            QueueKeys("q"),
            incarnation="i",
            run="r",
            producer="p",
            entry="e",
            max_attempts=max_attempts,
        )


def test_a_run_a_resume_made_takes_the_version_of_its_first_producer(q: Q) -> None:
    # Before: the replaced run kept the older run's version, so after an upgrade every
    # producer of the new version was refused by a run the new trainer had just made.
    q.join("p1", version="1")  # a run of the older version, never finished
    assert q.claim("tok", takeover="run1")[0] == "OK"
    assert _resume_keeping(q, "tok", "").run == "run9"  # a checkpoint: the run replaced
    assert q.c.hget(q.k.meta, "version") is None
    assert q.join("p2", version="2")[0] == "OK"
    assert q.join("p3", version="1") == ["MISMATCH", "version", "2"]
