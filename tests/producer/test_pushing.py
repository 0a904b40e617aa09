"""producer.pushing on its own: what counts as "the user's pipeline raised"."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import redis

from producer import Producer
from producer.datasets import IndexableDataset
from producer.schemes import SequentialScheme
from producer.streams import DataStream
from producer.transformers import Mapping


def _producer(fail_at: int | None = None) -> Producer:
    def boom(batch: Any) -> Any:
        if fail_at is not None and int(batch[0][0]) == fail_at:
            raise ValueError("the user's bug")
        return batch

    dataset = IndexableDataset({"x": np.arange(40)})
    stream = Mapping(DataStream(dataset, iteration_scheme=SequentialScheme(40, 10)), boom)
    p = Producer(stream, "redis://127.0.0.1:1/0", "q", transport="redis")
    p._run, p._incarnation = "run", "inc"
    return p


def test_a_pipeline_that_raises_is_counted_against_the_shard() -> None:
    p = _producer(fail_at=0)
    failed: list[tuple[int, int, str]] = []
    p._retry_elsewhere = lambda e, s, entry: failed.append((e, s, entry)) or True  # type: ignore[method-assign]
    p._serve_shard(0, 0, "0:t")
    assert failed == [(0, 0, "0:t")]


def test_a_redis_error_while_pushing_is_a_redis_error_not_the_pipelines() -> None:
    p = _producer()
    p._retry_elsewhere = lambda *a: pytest.fail("counted against the shard")  # type: ignore[method-assign]

    def push(*args: Any, **kwargs: Any) -> bool:
        raise redis.ResponseError("NOPERM this user has no permissions to run 'evalsha'")

    p._push = push  # type: ignore[method-assign]
    with pytest.raises(redis.ResponseError, match="NOPERM"):
        p._serve_shard(0, 0, "0:t")


def test_a_shard_the_trainer_has_entirely_sends_only_its_count() -> None:
    p = _producer()
    ends: list[tuple[int, int, int]] = []
    p._push_end = lambda e, s, count, entry: ends.append((e, s, count))  # type: ignore[method-assign]
    p._push = lambda *a, **k: pytest.fail("pushed a batch the trainer has")  # type: ignore[method-assign]
    p._serve_shard(0, 2, "2:t", skip=1)
    assert ends == [(0, 2, 1)]
