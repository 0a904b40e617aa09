"""One group of a run resumes with another number of ranks (growing and shrinking) while
the other group reads on (issue 38), against a real redis-server with producer processes,
one of them SIGKILLed mid-epoch: every epoch exact for both groups.

Group ``steady`` reads three epochs with ``old`` ranks; group ``el`` reads ``stop``
batches per rank with ``old`` ranks, saves every rank's state and stops (``steady``, paced
by it, waits), then resumes from those states with ``new`` ranks: it reads a new group
slot of its world (the old one retires), the rest of epoch 0 re-split among its new ranks
(the elastic resume of batchq/consumer/rank_state.py), then whole epochs.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from data_parallel import (
    BATCH,
    EXAMPLES,
    check_epoch,
    plans,
    shares,
    spawn_ranks,
)
from train import lines
from waiting import wait_until

from batchq.protocol.fields import MetaField
from batchq.protocol.groups import reader_field
from batchq.protocol.keys import QueueKeys
from tests.consumer.test_groups import left_behind

EPOCHS = 3


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("old", "new", "stop"), [(2, 3, 4), (3, 2, 3)])
def test_a_group_resumes_with_other_ranks_while_the_other_reads_on(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
    old: int,
    new: int,
    stop: int,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=20)
    keys = QueueKeys(queue_name)
    outs_s = [tmp_path / f"s{r}.jsonl" for r in range(old)]
    steady = spawn_ranks(
        spawn_proc, redis_url, queue_name, outs_s, EPOCHS, "--group", "steady", "--finish"
    )
    outs_a = [tmp_path / f"a{r}.jsonl" for r in range(old)]
    states = [tmp_path / f"state{r}.json" for r in range(old)]
    first = spawn_ranks(
        spawn_proc, redis_url, queue_name, outs_a, EPOCHS, "--group", "el",
        "--stop-after", str(stop), per_rank=lambda r: ["--state-out", str(states[r])],
    )  # fmt: skip
    wait_until(lambda: redis_client.hlen(keys.groups) == 2, timeout_s=60, what="two groups")
    serve = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "2")
    producers = [spawn_proc(serve, env=env) for _ in range(2)]
    for proc in first:
        assert proc.wait(timeout=60) == 3
    saved = tmp_path / "all.json"
    saved.write_text(json.dumps([json.loads(s.read_text()) for s in states]))

    outs_b = [tmp_path / f"b{r}.jsonl" for r in range(new)]
    second = spawn_ranks(
        spawn_proc, redis_url, queue_name, outs_b, EPOCHS, "--group", "el", "--finish",
        "--state-in", str(saved),
    )  # fmt: skip
    wait_until(lambda: sum(len(lines(o)) for o in outs_b) >= 4, timeout_s=60, what="el resumed")
    os.killpg(producers[0].pid, signal.SIGKILL)  # mid-epoch, holding leases
    producers[0].wait(timeout=10)
    for proc in steady + second:
        assert proc.wait(timeout=120) == 0
    assert producers[1].wait(timeout=30) == 0  # the run ended: it exits 0

    # The group left its slot of `old` ranks for a new one of `new`.
    slots = {g.decode(): int(s) for g, s in redis_client.hgetall(keys.groups).items()}
    assert slots["el"] == 2
    assert int(redis_client.hget(keys.meta, reader_field(MetaField.WORLD, 2)) or 1) == new

    plan = plans(EPOCHS)
    for e, per_rank in enumerate(shares(outs_s, EPOCHS)):
        check_epoch(plan[e], per_rank, old)  # the other group: every epoch, unmoved
    before = [b for o in outs_a for _, b in lines(o)]
    assert len(before) == old * stop  # of epoch 0, one slot per rank at a time
    after = shares(outs_b, EPOCHS)
    units = plan[0][old * stop :]  # the rest of epoch 0, re-split with the least padding
    per = -(-len(units) // new)
    padded = units + units[: per * new - len(units)]
    assert after[0] == [padded[r::new] for r in range(new)]
    got = Counter(tuple(b) for b in before + [b for s in after[0] for b in s])
    assert got == Counter(tuple(b) for b in plan[0] + units[: per * new - len(units)])
    for e in range(1, EPOCHS):
        check_epoch(plan[e], after[e], new)
    assert left_behind(redis_client, queue_name) == []  # every slot's lists went
