"""params.lua on a real redis-server: the log's versions, a call made twice (ranks),
a checkpoint's log written before its run exists, shards handed back to be built again;
the stamp lease.lua returns with every lease; join.lua publishes the plan's B."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from batchq.client.connection import make_client
from batchq.protocol import params_scripts, producer_scripts, trainer_scripts
from batchq.protocol.calls import build_call, decode_reply
from batchq.protocol.keys import QueueKeys
from batchq.protocol.params_log import ParamsLog
from batchq.protocol.producer_scripts import JoinReply
from batchq.protocol.words import PROTOCOL_VERSION, Status

TOKEN = "tok"


class Run:
    """A queue with a run a producer created and a trainer claimed."""

    def __init__(self, client: redis.Redis, queue: str) -> None:
        self.c, self.k = client, QueueKeys(queue)
        joined = self.join("p1", shard_batches=3)
        self.inc, self.run = joined.incarnation, joined.run
        claimed = trainer_scripts.claim(
            client, self.k, op="acquire", token=TOKEN, claim_ttl_ms=10_000, run_id="unused",
            new_incarnation="unused", takeover_run="", version=PROTOCOL_VERSION, rank=0,
            world=1, even="pad", resumed="",
        )  # fmt: skip
        assert claimed.status == Status.OK and claimed.run == self.run

    def join(self, producer: str, shard_batches: int | None) -> JoinReply:
        return producer_scripts.join(
            self.c, self.k, producer=producer, fingerprint="fp", hwm=3, shards=4, window=2,
            new_run="run1", new_incarnation="inc1", heartbeat_ttl_ms=10_000,
            version=PROTOCOL_VERSION, epoch_batches=12, age_ms=0,
            no_create=False, shard_batches=shard_batches,
        )  # fmt: skip

    def params(self, op: Any, **kw: Any) -> params_scripts.ParamsReply:
        kw.setdefault("run", self.run)
        kw.setdefault("token", TOKEN)
        return params_scripts.params(
            self.c, self.k, op=op, incarnation=kw.pop("incarnation", self.inc), suffix="", **kw
        )

    def lease(self, token: str) -> Any:
        return producer_scripts.lease_call(
            self.k, incarnation=self.inc, run=self.run, producer="p1", token=token,
            heartbeat_ttl_ms=10_000, prefetch=0, world=1,
        ).run(self.c)  # fmt: skip


@pytest.fixture
def run(redis_url: str, queue_name: str) -> Iterator[Run]:
    client = make_client(redis_url)
    yield Run(client, queue_name)
    client.close()


def test_add_gives_versions_in_call_order_and_the_stamp_rides_with_every_lease(run: Run) -> None:
    assert run.lease("t1").params == ""  # no log yet
    first = run.params("add", index=9, body='{"a":1}', call_id="c1")
    assert (first.status, first.version) == (Status.OK, 1)
    second = run.params("add", index=4, body='{"b":[1,2.5]}', call_id="c2")
    assert second.version == 2
    log = ParamsLog.from_stored(second.log, run.run)
    assert [(e.version, e.index, e.call_id) for e in log.entries] == [(1, 9, "c1"), (2, 4, "c2")]
    assert log.params_at(9) == {"a": 1, "b": (1, 2.5)}
    assert json.loads(run.c.get(run.k.params))["run"] == run.run
    assert run.c.hget(run.k.meta, "params") == f"{run.run}:2".encode()
    assert run.lease("t2").params == f"{run.run}:2"
    # The same call again (another rank making it, or a retry): nothing is added.
    again = run.params("add", index=99, body='{"a":1}', call_id="c1")
    assert again.version == 2 and ParamsLog.from_stored(again.log, run.run) == log


def test_a_log_over_its_cap_is_refused(run: Run) -> None:
    reply = build_call(
        "params",
        decode_reply,
        {"meta": run.k.meta, "incarnation": run.k.incarnation, "params": run.k.params,
         "work": run.k.work, "ledger": run.k.ledger, "stats": run.k.stats},
        {"incarnation": run.inc, "run": run.run, "token": TOKEN, "sfx": "", "op": "add",
         "index": 0, "body": '{"x":"' + "y" * 100 + '"}', "call_id": "c", "max_bytes": 64},
    ).run(run.c)  # fmt: skip
    assert reply[0] == Status.TOO_BIG and int(reply[1]) > 64
    assert run.c.get(run.k.params) is None  # nothing written


def test_load_writes_a_checkpoints_log_for_a_run_not_yet_created(run: Run) -> None:
    saved = ParamsLog().add(3, {"a": 1}, "c1").add(5, {"a": 2}, "c2")
    body = saved.entries_json()
    # The resumed run does not exist yet: load checks the claim, not the run.
    reply = run.params("load", run="resumed1", index=2, body=body)
    assert reply.status == Status.OK and ParamsLog.from_stored(reply.log, "resumed1") == saved
    assert run.c.hget(run.k.meta, "params") == b"resumed1:2"
    # A shorter log (a rank whose checkpoint missed a change, a retry) keeps the longer.
    prefix = ParamsLog().add(3, {"a": 1}, "c1").entries_json()
    short = run.params("load", run="resumed1", index=1, body=prefix)
    assert ParamsLog.from_stored(short.log, "resumed1") == saved
    # Another run's log is not this run's: adding to the current run starts it afresh.
    assert run.params("add", index=1, body="{}", call_id="c9").version == 1


def test_rebuild_hands_shards_back_oldest_first_with_the_batches_kept(run: Run) -> None:
    run.c.rpush(run.k.work, "7")
    reply = run.params(
        "rebuild",
        index=5,
        rebuild=[params_scripts.Rebuild("0:2", 1, 2), params_scripts.Rebuild("1:3", 0, 7)],
    )
    assert reply.status == Status.OK
    assert run.c.lrange(run.k.work, 0, -1) == [b"2", b"7"]  # no duplicate of 7
    assert run.c.hgetall(run.k.ledger) == {b"0:2": b"1", b"1:3": b"0"}
    assert run.c.hget(run.k.stats, "rebuilt_params") == b"5"
    leased = run.lease("t1")
    assert (leased.g, leased.skip) == (2, 1)  # build it, push from batch 1 on


def test_every_op_checks_the_incarnation_the_claim_and_the_run(run: Run) -> None:
    assert run.params("add", index=1, body="{}", call_id="c", token="other").status == (
        Status.CLAIM_LOST
    )
    assert run.params("add", index=1, body="{}", call_id="c", run="old").status == (
        Status.RUN_CHANGED
    )
    assert run.params("rebuild", run="old").status == Status.RUN_CHANGED
    assert run.params("load", incarnation="gone", index=0, body="[]").status == Status.STATE_LOST
    with pytest.raises(redis.ResponseError, match="never sends"):
        run.params("add", index=1, body="{}", call_id='x"y')


def test_join_publishes_the_plans_batches_per_shard(run: Run) -> None:
    assert run.c.hget(run.k.meta, "shard_batches") == b"3"
    run.c.hdel(run.k.meta, "shard_batches")  # a resume re-created the figures without it
    assert run.join("p2", shard_batches=3).status == Status.OK
    assert run.c.hget(run.k.meta, "shard_batches") == b"3"
