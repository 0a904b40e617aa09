"""producer.serving.membership: a join's reply turned into the position served, or into
the error that ends serving; waiting for a lost run's trainer; the axis labels."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from batchq.errors import PipelineMismatch, RunFinished
from batchq.protocol import producer_scripts
from batchq.protocol.keys import QueueKeys
from batchq.protocol.producer_scripts import JoinReply
from batchq.protocol.words import Status
from producer.datasets import IndexableDataset
from producer.schemes import SequentialScheme
from producer.serving import membership
from producer.serving.membership import Membership, RunPosition, axis_labels_json
from producer.serving.sharding import ShardPlan
from producer.streams import DataStream


def _membership(stop: threading.Event | None = None) -> Membership:
    stream = DataStream(
        IndexableDataset({"x": np.arange(8)}), iteration_scheme=SequentialScheme(8, 2)
    )
    return Membership(
        None,  # type: ignore[arg-type]  # every call is patched: no Redis
        QueueKeys("m"), "p", ShardPlan(stream), lease_window=6, heartbeat_ttl_ms=1000,
        orphan_wait_s=30.0, axis_labels=None, stop=stop or threading.Event(),
    )  # fmt: skip


def _replies(monkeypatch: pytest.MonkeyPatch, *replies: JoinReply) -> list[dict[str, Any]]:
    """join.lua answers ``replies`` in turn; returns each call's arguments."""
    calls: list[dict[str, Any]] = []
    it = iter(replies)

    def join(client: Any, keys: QueueKeys, **kw: Any) -> JoinReply:
        calls.append(kw)
        return next(it)

    monkeypatch.setattr(producer_scripts, "join", join)
    monkeypatch.setattr(membership, "record_client", lambda *a: True)
    return calls


def test_a_join_gives_the_position_of_the_run_it_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _replies(monkeypatch, JoinReply(Status.OK, "inc", "run", "3", 4, 6, True, 2))
    joined = _membership().join(RunPosition(list_cap=3))
    assert joined == RunPosition("run", "inc", 2, list_cap=3)  # the cap goes on
    assert calls[0]["hwm"] == 3 and calls[0]["window"] == 6


def test_a_refused_join_raises_what_it_means(monkeypatch: pytest.MonkeyPatch) -> None:
    _replies(
        monkeypatch,
        JoinReply(Status.FINISHED),
        JoinReply(Status.MISMATCH, what="hwm", expected="5"),
        JoinReply(Status.MISMATCH, what="version", expected="1"),
    )
    m = _membership()
    with pytest.raises(RunFinished):
        m.join(RunPosition(list_cap=3))
    with pytest.raises(PipelineMismatch, match="hwm"):
        m.join(RunPosition(list_cap=3))
    with pytest.raises(PipelineMismatch, match="version is '1', this producer has '2'; run one"):
        m.join(RunPosition(list_cap=3))


def test_after_redis_lost_the_run_a_producer_that_served_it_waits_without_creating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _replies(
        monkeypatch, JoinReply(Status.WAIT), JoinReply(Status.OK, "inc2", "run", "3", 4, 6, False)
    )
    monkeypatch.setattr(membership, "JOIN_POLL_S", 0.0)
    served = RunPosition("run", "inc", list_cap=3)
    assert _membership().join(served) == RunPosition("run", "inc2", list_cap=3)
    assert [c["no_create"] for c in calls] == [True, True]  # within orphan_wait_s


def test_a_producer_stopped_while_waiting_joins_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _replies(monkeypatch, JoinReply(Status.WAIT))
    stop = threading.Event()
    stop.set()
    assert _membership(stop).join(RunPosition("run", "inc", list_cap=3)) is None


def test_axis_labels_as_the_trainer_reads_them() -> None:
    stream = DataStream(
        IndexableDataset({"x": np.zeros((2, 3)), "y": np.zeros(2)}, axis_labels={"x": ("b", "f")})
    )
    assert axis_labels_json(stream) == '{"x": ["b", "f"]}'
    assert axis_labels_json(DataStream(IndexableDataset({"x": np.zeros(2)}))) is None
