"""Stripes compose (issue 38): a queue striped 2 ways read by several groups, and steered
by ``set_params``, against a real redis-server with producer processes, one of them
SIGKILLed mid-epoch; every epoch exact.

A plain redis-server holds both stripes (each is a queue of its own, in a slot of its
own: a cluster is not needed for the arithmetic tested here).
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from pipelines import builds, examples_of, numbered
from train import argv as train_argv
from train import lines
from waiting import wait_until

from batchq.protocol.admin import delete_queue
from batchq.protocol.keys import QueueKeys

STRIPES = 2
EXAMPLES, BATCH = 400, 10  # 40 batches (one shard each) per epoch, 20 per stripe
PER_EPOCH = EXAMPLES // BATCH
EPOCHS = 3
HWM = 4


def reference(epochs: int = EPOCHS) -> list[list[Any]]:
    """What every trainer must read: each epoch once, in plan order."""
    stream = numbered(EXAMPLES, BATCH)
    return [[e, examples_of(f)] for e in range(epochs) for f, _ in stream.get_epoch_iterator()]


@pytest.fixture
def striped(redis_client: redis.Redis, queue_name: str) -> Iterator[list[QueueKeys]]:
    """Every stripe's keys; stripes 1.. (named apart from the queue) deleted afterwards."""
    stripes = [QueueKeys(queue_name).stripe(k, STRIPES) for k in range(STRIPES)]
    yield stripes
    for keys in stripes[1:]:
        delete_queue(redis_client, keys.queue)


def registered(client: redis.Redis, stripes: list[QueueKeys], n: int) -> bool:
    """Whether ``n`` groups have registered in every stripe's run."""
    return all(int(client.hlen(keys.groups)) >= n for keys in stripes)


@pytest.mark.timeout(120)
def test_two_groups_read_a_striped_queue_exactly_built_once_through_a_producer_kill(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    striped: list[QueueKeys],
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    log = tmp_path / "builds.log"
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=3, build_log=log)
    groups = ("g0", "g1")
    outs = {g: tmp_path / f"{g}.jsonl" for g in groups}

    def trainer(g: str) -> Any:
        argv = train_argv(redis_url, queue_name, outs[g], EPOCHS, "--group", g, "--finish")
        return spawn_proc(argv, env=env)

    trainers = {g: trainer(g) for g in groups}
    wait_until(lambda: registered(redis_client, striped[:1], 2), timeout_s=60, what="2 groups")
    serve = serve_argv("--hwm", str(HWM), "--stripes", str(STRIPES), "--heartbeat-ttl-s", "10")
    producers = [spawn_proc(serve, env=env) for _ in range(2)]
    wait_until(
        lambda: min(len(lines(outs[g])) for g in groups) >= PER_EPOCH + 8,
        timeout_s=60,
        what="every group in epoch 1",
    )
    assert registered(redis_client, striped, 2)  # each group holds a slot of every stripe
    os.killpg(producers[0].pid, signal.SIGKILL)  # mid-epoch, holding leases in both stripes
    producers[0].wait(timeout=10)
    for g, proc in trainers.items():
        assert proc.wait(timeout=90) == 0, g
    assert producers[1].wait(timeout=30) == 0  # the run ended in every stripe: it exits 0

    expected = reference()
    for g in groups:
        assert [list(x) for x in lines(outs[g])] == expected, g
    # Built once for both groups: each stripe's rebuilds are what the kill forced.
    redone = sum(int(redis_client.hget(k.stats, "redone_shards") or 0) for k in striped)
    counts = Counter(builds(str(log)))
    batches = {tuple(b) for _, b in expected}
    assert all(counts[b] >= 1 for b in batches)
    wanted = sum(counts[b] for b in batches)
    assert len(expected) <= wanted <= len(expected) + redone
    assert wanted < 2 * len(expected)
    # The run ended in every stripe: no frame, data list or reference count is left.
    for keys in striped:
        found = [k.decode() for k in redis_client.scan_iter(match=keys.pattern, count=1000)]
        assert [k for k in found if ":frame:" in k or ":data" in k or k == keys.refs] == []
