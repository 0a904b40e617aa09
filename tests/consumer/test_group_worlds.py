"""The groups of a run are separate jobs (issue 38): each reads with its own world size,
against a real redis-server with producer processes, one of them SIGKILLed mid-epoch.

A shard is shared only by the groups of one world (its global slot number means another
slice of the plan in another world): group ``one`` (a single trainer) and group ``two``
(two ranks) read every batch of every epoch exactly once each, in their own split.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import redis
from data_parallel import BATCH, EXAMPLES, check_epoch, plans, shares
from train import argv as train_argv
from train import lines
from waiting import wait_until

from batchq.errors import GroupWorldMismatch
from batchq.protocol.fields import MetaField
from batchq.protocol.groups import reader_field
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream
from tests.consumer.test_groups import left_behind

EPOCHS = 3


@pytest.mark.timeout(180)
def test_groups_of_one_and_two_ranks_read_exact_epochs_through_a_producer_kill(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=3)
    worlds = {"one": 1, "two": 2}
    outs = {(g, r): tmp_path / f"{g}{r}.jsonl" for g, w in worlds.items() for r in range(w)}

    def trainer(g: str, r: int) -> Any:
        extra = ("--group", g, "--rank", str(r), "--world", str(worlds[g]), "--finish")
        return spawn_proc(train_argv(redis_url, queue_name, outs[g, r], EPOCHS, *extra), env=env)

    trainers = [trainer(g, r) for g, r in outs]
    keys = QueueKeys(queue_name)
    wait_until(lambda: redis_client.hlen(keys.groups) == 2, timeout_s=60, what="two groups")
    serve = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "10")
    producers = [spawn_proc(serve, env=env) for _ in range(2)]
    per_epoch = len(plans(1)[0])
    wait_until(
        lambda: (
            min(len(lines(o)) for (g, _), o in outs.items() if g == "one") >= per_epoch + 5
            and min(len(lines(o)) for (g, _), o in outs.items() if g == "two") >= per_epoch // 2 + 3
        ),
        timeout_s=60,
        what="both groups in epoch 1",
    )
    os.killpg(producers[0].pid, signal.SIGKILL)  # mid-epoch, holding leases
    producers[0].wait(timeout=10)
    for proc in trainers:
        assert proc.wait(timeout=120) == 0
    assert producers[1].wait(timeout=30) == 0  # the run ended: it exits 0

    # Each group's slot kept its own world.
    slots = {g.decode(): int(s) for g, s in redis_client.hgetall(keys.groups).items()}
    for g, w in worlds.items():
        field = reader_field(MetaField.WORLD, slots[g])
        assert int(redis_client.hget(keys.meta, field) or 1) == w, g
    for g, w in worlds.items():
        got = shares([outs[g, r] for r in range(w)], EPOCHS)
        for plan, per_rank in zip(plans(EPOCHS), got, strict=True):
            check_epoch(plan, per_rank, w)
    assert left_behind(redis_client, queue_name) == []  # every slot's lists went


@pytest.mark.timeout(60)
def test_a_group_rank_of_another_world_is_refused_while_its_ranks_read(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH)
    spawn_proc(serve_argv("--hwm", "4"), env=env)
    first = ServerDataStream(
        ("features",), url=redis_url, queue=queue_name, group="a", rank=0, world_size=2
    )
    other = ServerDataStream(("features",), url=redis_url, queue=queue_name, group="a")
    try:
        next(first.get_epoch_iterator())  # group a reads with world_size 2
        with pytest.raises(GroupWorldMismatch, match=r"group a has world_size 1.*world_size 2"):
            next(other.get_epoch_iterator())
    finally:
        other.close()
        first.close()
