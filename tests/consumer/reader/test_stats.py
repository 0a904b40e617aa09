"""The trainer's figures are right, not merely present."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from pipelines import numbered

from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream
from consumer.reader.stats import WAIT_BUCKETS_S, TrainerStats


def test_stall_fractions_percentiles_and_rates_from_known_numbers() -> None:
    stats = TrainerStats(window=10)
    stats.start_epoch(0)
    for i in range(10):
        stats.batch(wait_s=0.03 if i % 2 else 0.01, busy_s=0.02, nbytes=1_000_000)
    snap = stats.snapshot()
    # 10 batches: waits 5 x 0.01 + 5 x 0.03 = 0.2 s, work 10 x 0.02 = 0.2 s.
    assert snap["stall_fraction_recent"] == pytest.approx(0.5)
    assert snap["stall_fraction_epoch"] == pytest.approx(0.5)
    assert snap["wait_p50_s"] in (0.01, 0.03) and snap["wait_p99_s"] == 0.03
    assert snap["batches_per_s"] == pytest.approx(10 / 0.4)
    assert snap["mb_per_s"] == pytest.approx(10 / 0.4)
    stats.end_epoch()
    assert stats.snapshot()["last_epoch"]["stall_fraction"] == pytest.approx(0.5)
    wait_ms, busy_ms, epochs, buckets, figures, history = stats.drain(depth=3, force=True)
    assert (wait_ms, busy_ms, epochs) == (200, 200, 1)
    counts = [int(c) for c in buckets.split(",")]
    assert len(counts) == len(WAIT_BUCKETS_S) + 1
    assert counts[WAIT_BUCKETS_S.index(0.01)] == 5 and counts[WAIT_BUCKETS_S.index(0.05)] == 5
    assert json.loads(figures)["stall_fraction_recent"] == pytest.approx(0.5)
    assert json.loads(history)["depth"] == 3
    assert stats.drain(depth=3)[:3] == [0, 0, 0]  # drained


@pytest.mark.parametrize(
    ("load_ms", "train_ms", "stall_low", "stall_high"),
    [(40, 10, 0.55, 0.9), (2, 25, 0.0, 0.15)],
)
def test_measured_stall_matches_the_pipeline_and_trainer_speeds(
    redis_url: str,
    queue_name: str,
    producer_thread: Callable[..., Any],
    redis_client: Any,
    load_ms: float,
    train_ms: float,
    stall_low: float,
    stall_high: float,
) -> None:
    from pipelines import Slow

    producer_thread(Slow(numbered(300, 10, shuffled=False), slowdown=load_ms / 1000), hwm=4)
    with ServerDataStream(("features", "targets"), url=redis_url, queue=queue_name) as stream:
        len(stream)  # the producer is up: the clock starts now, as in the demo
        it = stream.get_epoch_iterator()
        next(it)
        start, n = time.monotonic(), 0
        for _ in it:
            time.sleep(train_ms / 1000)  # the trainer's "work"
            n += 1
        elapsed = time.monotonic() - start
        snap = stream.stats
    # Expected stall: the part of each step spent waiting for a slower producer.
    assert stall_low <= snap["stall_fraction_epoch"] <= stall_high
    # The rate it reports agrees with the test's own clock.
    assert snap["batches_per_s"] == pytest.approx(n / elapsed, rel=0.3)
    stats = redis_client.hgetall(QueueKeys(queue_name).stats)
    assert int(stats[b"trainer_wait_ms"]) + int(stats[b"trainer_busy_ms"]) > 0
