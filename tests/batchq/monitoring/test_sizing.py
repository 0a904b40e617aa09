"""Sizing: demand, supply, the recommendation; and the verdict's causes."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from sleepy import SleepyTrainer
from waiting import wait_until

from batchq.monitoring import sizing
from batchq.monitoring.rows import queue_status
from batchq.monitoring.text import render_table
from batchq.monitoring.verdict import cause
from batchq.protocol.keys import QueueKeys

# --------------------------------------------------------------------------- arithmetic


def test_demand_is_the_rate_over_the_busy_fraction() -> None:
    assert sizing.demand_rate(15.5, 0.81) == pytest.approx(81.58, abs=0.01)  # the issue's
    assert sizing.demand_rate(10.0, 0.0) == 10.0
    assert sizing.busy_ms_per_batch(10.0, 0.5) == pytest.approx(50.0)
    assert sizing.demand_rate(None, 0.5) is None
    assert sizing.demand_rate(10.0, None) is None
    assert sizing.demand_rate(0.0, 0.5) is None
    assert sizing.demand_rate(1.0, 0.999) is None  # busy time within the noise


def test_recommendation_meets_demand_with_the_margin() -> None:
    assert sizing.recommended_producers(81.6, 16.2) == 6  # 5.04 x 1.05 = 5.3
    assert sizing.recommended_producers(40.0, 10.0) == 5  # 4 x 1.05 = 4.2
    assert sizing.recommended_producers(20.0, 20.0 / 0.999) == 2  # 1.05 x 0.999
    assert sizing.recommended_producers(1.0, 50.0) == 1  # never 0
    assert sizing.recommended_producers(None, 5.0) is None
    assert sizing.recommended_producers(5.0, None) is None
    assert sizing.recommended_producers(5.0, 0.0) is None


def _sample(t: float, producers: int, built: int, build_ms: int, pushed: int) -> dict[str, Any]:
    return {"t": t, "producers": producers, "built": built, "build_ms": build_ms, "pushed": pushed}


def test_rates_from_samples_skip_the_steps_where_a_producer_left() -> None:
    newest_first = [
        _sample(13, 2, 210, 20_000, 300),  # a producer left: its totals left the sums
        _sample(12, 3, 400, 40_000, 280),
        _sample(11, 3, 370, 37_000, 250),
        _sample(10, 2, 350, 35_000, 220),  # the third one joined after this
    ]
    # Steps 10->11 and 11->12 count: (50 batches) / (5000 ms) = 10/s; 12->13 is skipped.
    assert sizing.sample_rate(newest_first) == pytest.approx(10.0)
    assert sizing.producer_rate(newest_first, 1, 1000) == pytest.approx(10.0)
    assert sizing.producer_rate(newest_first[:1], 30, 1000) == pytest.approx(30.0)  # fallback
    assert sizing.producer_rate([], 0, 0) is None
    assert sizing.delivered_rate(newest_first) == pytest.approx(80 / 3)
    assert sizing.delivered_rate(newest_first[:1]) is None
    assert sizing.delivered_rate([{"t": 2}, {"t": 1}]) is None  # samples from before v3
    assert [s["t"] for s in sizing.recent_samples(newest_first, 11.5)] == [13, 12]


# --------------------------------------------------------------------------- causes


def _producer(pid: str, rate: float | None) -> dict[str, Any]:
    return {"id": pid, "batches_per_s": rate}


def test_causes_are_named_only_when_the_figures_show_them() -> None:
    ok = [_producer("a", 10.0), _producer("b", 11.0), _producer("c", 9.0)]
    base: dict[str, Any] = dict(
        verdict="input-bound", depths=[0], hwm=10, producers=ok, samples=[], supply=30.0,
        delivered=28.0,
    )  # fmt: skip
    assert cause(**base) is None
    assert cause(**{**base, "verdict": "balanced", "delivered": 1.0}) is None
    got = cause(**{**base, "delivered": 10.0})
    assert got is not None and got[0] == "transport-saturated" and "30.0" in got[1]
    assert cause(**{**base, "delivered": 10.0, "depths": [9]}) is None  # not low: no
    slow = [*ok[:2], _producer("c", 3.0)]
    got = cause(**{**base, "producers": slow})
    assert got is not None and got[0] == "slow-producer" and "producer c" in got[1]
    # 2 producers built 10/s each, then 4 only 6/s each: CPU-starved.
    samples = [_sample(20 - i, 4, 1000 - 6 * i, 100_000 - 1000 * i, 0) for i in range(5)]
    samples += [_sample(15 - i, 2, 970 - 10 * i, 95_000 - 1000 * i, 0) for i in range(5)]
    got = cause(**{**base, "samples": samples})
    assert got is not None and got[0] == "cpu-starved", got
    assert "10.0 batches/s with 2" in got[1] and "6.0/s with 4" in got[1]


# --------------------------------------------------------------------------- live


PRODUCERS = 4  # 40 batches/s: the trainer's 130 batches in about 3 s


@pytest.mark.timeout(180)
@pytest.mark.parametrize("need", [2, 4, 8])
def test_recommendation_is_within_one_of_the_true_need(
    need: int,
    redis_url: str,
    redis_client: Any,
    queue_name: str,
    spawn_proc: Callable[..., Any],
    serve_argv: Callable[..., list[str]],
    serve_env: Callable[..., dict[str, str]],
) -> None:
    # Producers sleep 100 ms a batch (10/s each); the trainer sleeps 100/need ms (its
    # demand is 10 x need /s). Four producers, whatever the need (over- or under-supplied):
    # the figures must say.
    env = serve_env(examples=4000, batch_size=10, slow_ms=100)
    spawn_proc(serve_argv("--workers", str(PRODUCERS), "--hwm", "8"), env=env)
    with SleepyTrainer(redis_url, queue_name, busy_s=0.1 / need) as trainer:
        # The trainer's figures cover its last 100 batches: wait until they hold no start-up.
        wait_until(lambda: trainer.batches >= 130 or trainer.error, 120, "130 batches")
        assert trainer.error is None
        row = wait_until(
            lambda: (
                (r := queue_status(redis_client, queue_name))["recommended_producers"]
                and r["producers_alive"] == PRODUCERS
                and r
            ),
            30,
            "a recommendation",
        )
    # The pop script adds the queue side to the trainer's history samples.
    newest = json.loads(redis_client.lindex(QueueKeys(queue_name).history, 0))
    assert newest["producers"] == PRODUCERS and newest["built"] > 0 and newest["build_ms"] > 0
    assert newest["pushed"] >= newest["batches"]
    assert abs(row["recommended_producers"] - need) <= 1, row
    assert row["demand_batches_per_s"] == pytest.approx(10 * need, rel=0.3)
    assert row["producer_batches_per_s"] == pytest.approx(10, rel=0.3)
    assert row["producers_deficit"] == row["recommended_producers"] - PRODUCERS
    text = render_table([row])
    assert f"recommend {row['recommended_producers']} producers (now {PRODUCERS})" in text


@pytest.mark.timeout(180)
def test_the_verdict_names_one_slow_producer(
    redis_url: str,
    redis_client: Any,
    queue_name: str,
    spawn_proc: Callable[..., Any],
    serve_argv: Callable[..., list[str]],
    serve_env: Callable[..., dict[str, str]],
) -> None:
    # Same pipeline (the delay is not part of its fingerprint), one producer 10x slower.
    for slow_ms in (20, 200):
        spawn_proc(serve_argv("--hwm", "8"), env=serve_env(examples=4000, batch_size=10,
                                                            slow_ms=slow_ms))  # fmt: skip
    with SleepyTrainer(redis_url, queue_name, busy_s=0.005) as trainer:
        row = wait_until(
            lambda: (
                (r := queue_status(redis_client, queue_name))["verdict_cause"] == "slow-producer"
                and r
            ),
            120,
            "the slow-producer cause",
        )
        assert trainer.error is None
    assert row["verdict"] == "input-bound"
    slowest = min(row["producers"], key=lambda p: p["batches_per_s"])
    assert f"producer {slowest['id']} builds" in row["verdict_reason"]
    assert slowest["batches_per_s"] < 6  # 200 ms a batch
