"""StripedProducer (producer/striped.py): its lanes' job starts before its plan's probe
batch. Serving striped queues end to end: tests/consumer/test_cluster_runs.py and the
``stripes`` parametrization of the consumer scenarios."""

from __future__ import annotations

import time
from typing import Any

import pytest
from pipelines import numbered

import producer.striped
from producer.serving.sharding import ShardPlan
from producer.striped import StripedProducer


def test_the_lanes_job_starts_before_the_plans_probe_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A run that finishes while the probe batch builds was this job's: its lanes are
    # late replicas (join.lua), as a Producer's own start is taken before its probe.
    planned: list[float] = []

    def plan(*args: Any) -> ShardPlan:
        planned.append(time.time())
        return ShardPlan(*args)

    monkeypatch.setattr(producer.striped, "ShardPlan", plan)
    striped = StripedProducer(numbered(40, 20), "redis://127.0.0.1:1/0", "q", 4, stripes=2)
    starts = [lane._membership.started_s for lane in striped.lanes]
    assert len(starts) == 2 and all(s <= planned[0] for s in starts)
    assert (
        StripedProducer(
            numbered(40, 20), "redis://127.0.0.1:1/0", "q", 4, stripes=2, job_started_s=12.5
        )
        .lanes[0]
        ._membership.started_s
        == 12.5
    )
