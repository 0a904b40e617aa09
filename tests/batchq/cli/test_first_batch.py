"""The first batch's figures: the trainer's time from its first iteration to its first
batch (stream.stats, status, the exporter's family) and a producer's time from its
start to its first push (status)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from waiting import wait_until

from batchq.monitoring.metric_families import producer_families, queue_families
from batchq.monitoring.rows import queue_status
from consumer import ServerDataStream


def test_first_batch_and_first_push_are_reported(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
) -> None:
    launched = time.time()
    proc = spawn_proc(serve_argv("--heartbeat-ttl-s", "1"), env=serve_env(examples=100))
    stream = ServerDataStream(("features", "targets"), False, url=redis_url, queue=queue_name)
    try:
        assert stream.stats["first_batch_s"] is None  # not iterated yet
        asked = time.monotonic()
        it = stream.get_epoch_iterator()
        next(it)
        held_s = time.monotonic() - asked
        first = stream.stats["first_batch_s"]
        assert first is not None and 0 < first <= held_s
        assert sum(1 for _ in it) == 4  # the rest of the epoch: the figures get sent
        row = wait_until(
            lambda: (
                (r := queue_status(redis_client, queue_name))["first_batch_s"] is not None
                and r["producers"]
                and r["producers"][0]["first_push_s"] is not None
                and r
            ),
            what="the trainer's figures and the producer's first push in status",
        )
        assert row["first_batch_s"] == pytest.approx(first, abs=1e-5)
        pushed = row["producers"][0]["first_push_s"]
        assert 0 < pushed <= time.time() - launched  # from its process's start
        names = {m.name: m for m in [*queue_families([row]), *producer_families([row])]}
        (sample,) = names["batchq_producer_first_push_seconds"].samples
        assert sample.value == pushed
        (sample,) = names["batchq_trainer_first_batch_seconds"].samples
        assert sample.value == row["first_batch_s"]
        stream.close(finished=True)
    finally:
        stream.close()
    assert proc.wait(timeout=30) == 0
