"""Shards: built one by one, an epoch equals the in-process epoch, for every scheme."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchq.errors import ConfigError
from producer.datasets import IndexableDataset
from producer.schemes import (
    ConcatenatedScheme,
    ConstantScheme,
    SequentialExampleScheme,
    SequentialScheme,
    ShuffledExampleScheme,
    ShuffledScheme,
)
from producer.serving.sharding import ShardPlan
from producer.streams import DataStream
from producer.transformers import Batch, Cache, Filter, Mapping, Unpack
from producer.transformers.image import RandomFixedSizeCrop

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def dataset(n: int) -> IndexableDataset:
    return IndexableDataset({"x": np.arange(n, dtype=np.int64), "y": np.arange(n) * 10})


def in_process(make: Callable[[], Any], epoch: int) -> list[list[int]]:
    stream = make()
    for _ in range(epoch):
        stream.get_epoch_iterator()
    return [np.atleast_1d(x).tolist() for x, _ in stream.get_epoch_iterator()]


def sharded(plan: ShardPlan, epoch: int) -> list[list[int]]:
    out = []
    for s in range(plan.shards):
        marked = list(plan.iter_shard_marked(epoch, s))
        assert [last for _, last in marked] == [False] * (len(marked) - 1) + [True] * bool(marked)
        out += [np.atleast_1d(x).tolist() for (x, _), _ in marked]
    return out


def check_exact(make: Callable[[], Any], rps: int | None = None) -> ShardPlan:
    plan = ShardPlan(make(), rps)
    for epoch in (0, 1):
        expected = in_process(make, epoch)
        assert sharded(plan, epoch) == expected
        if plan.epoch_batches is not None:
            assert plan.epoch_batches == len(expected)
    return plan


sizes = st.integers(1, 60)
batch = st.integers(1, 13)


@SETTINGS
@given(n=sizes, b=batch, seed=st.integers(0, 1000), mult=st.integers(1, 3))
def test_batch_schemes_map_style(n: int, b: int, seed: int, mult: int) -> None:
    for make in (
        lambda: DataStream(dataset(n), iteration_scheme=SequentialScheme(n, b)),
        lambda: Mapping(
            DataStream(dataset(n), iteration_scheme=ShuffledScheme(n, b, rng=seed)),
            lambda d: (d[0] * 2, d[1]),
        ),
    ):
        plan = check_exact(make, mult)
        assert plan.map_only and plan.shards == math.ceil(math.ceil(n / b) / mult)


@SETTINGS
@given(n=sizes, k=batch, seed=st.integers(0, 1000), strictness=st.sampled_from([0, 1]))
def test_example_schemes_under_batch(n: int, k: int, seed: int, strictness: int) -> None:
    for scheme in (lambda: SequentialExampleScheme(n), lambda: ShuffledExampleScheme(n, seed)):

        def make(scheme: Any = scheme) -> Any:
            stream = DataStream(dataset(n), iteration_scheme=scheme())
            return Batch(stream, ConstantScheme(k), strictness=strictness)

        plan = check_exact(make)
        assert plan.requests_per_shard == k  # one batch per shard


@SETTINGS
@given(n=sizes, b=batch, k=batch)
def test_unpack_then_batch_and_cache(n: int, b: int, k: int) -> None:
    def unpack_batch() -> Any:
        stream = DataStream(dataset(n), iteration_scheme=SequentialScheme(n, b))
        return Batch(Unpack(stream), ConstantScheme(k))

    def cache() -> Any:
        return Cache(
            DataStream(dataset(n), iteration_scheme=SequentialScheme(n, b)), ConstantScheme(k)
        )

    check_exact(unpack_batch)
    check_exact(cache)


@SETTINGS
@given(n1=sizes, n2=sizes, b=batch)
def test_concatenated_scheme(n1: int, n2: int, b: int) -> None:
    n = n1 + n2

    def make() -> Any:
        scheme = ConcatenatedScheme(
            [SequentialScheme(list(range(n1)), b), SequentialScheme(list(range(n1, n)), b)]
        )
        return DataStream(dataset(n), iteration_scheme=scheme)

    check_exact(make)


def test_filter_then_batch_is_one_shard_per_epoch_unless_told() -> None:
    def make() -> Any:
        stream = DataStream(dataset(50), iteration_scheme=ShuffledExampleScheme(50, 3))
        return Batch(Filter(stream, lambda d: d[0] % 3 != 0), ConstantScheme(4))

    plan = check_exact(make)
    assert plan.shards == 1 and plan.epoch_batches is None
    told = ShardPlan(make(), 10)
    assert told.shards == 5 and not told.exact
    for epoch in (0, 1):  # grouping may differ at the cuts; each example still once
        got = sorted(v for b in sharded(told, epoch) for v in b)
        assert got == [v for v in range(50) if v % 3 != 0]


def test_filter_over_batches_cuts_anywhere() -> None:
    def make() -> Any:
        stream = DataStream(dataset(40), iteration_scheme=SequentialScheme(40, 5))
        return Filter(stream, lambda d: int(d[0][0]) % 10 == 0)

    plan = check_exact(make)
    assert plan.shards == 8 and not plan.map_only


def test_cut_must_be_a_multiple_of_the_unit() -> None:
    stream = Batch(
        DataStream(dataset(20), iteration_scheme=SequentialExampleScheme(20)), ConstantScheme(4)
    )
    with pytest.raises(ConfigError, match="multiple of 4"):
        ShardPlan(stream, 6)
    with pytest.raises(ConfigError, match="requests_per_shard 0"):
        ShardPlan(stream, 0)


def test_random_transformers_redo_a_shard_identically() -> None:
    images = np.arange(6 * 8 * 8, dtype=np.float32).reshape(6, 1, 8, 8)
    stream = RandomFixedSizeCrop(
        DataStream(IndexableDataset({"img": images}), iteration_scheme=SequentialScheme(6, 2)),
        (4, 4),
        which_sources=("img",),
        rng=7,
    )
    plan = ShardPlan(stream)
    first = [b[0].copy() for b in plan.iter_shard(1, 2)]
    plan.iter_shard(0, 0)
    list(plan.iter_shard(3, 1))  # other shards in between
    again = [b[0] for b in plan.iter_shard(1, 2)]
    np.testing.assert_array_equal(first[0], again[0])


def test_fingerprint_tells_seeds_and_sizes_apart() -> None:
    def fp(n: int, seed: int) -> str:
        return ShardPlan(
            DataStream(dataset(n), iteration_scheme=ShuffledScheme(n, 5, rng=seed))
        ).fingerprint

    assert fp(30, 1) == fp(30, 1)
    assert fp(30, 1) != fp(30, 2)
    assert fp(30, 1) != fp(31, 1)
