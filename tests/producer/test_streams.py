"""Tests of producer.streams and producer.iterator, including the Fuel tutorial chain."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from producer.datasets import IndexableDataset, IterableDataset
from producer.errors import StreamError
from producer.iterator import DataIterator
from producer.schemes import (
    SequentialExampleScheme,
    SequentialScheme,
    ShuffledExampleScheme,
    ShuffledScheme,
)
from producer.streams import AbstractDataStream, DataStream
from producer.transformers import Transformer


def dataset(n: int = 8) -> IndexableDataset:
    return IndexableDataset(
        OrderedDict([("features", np.arange(n * 2).reshape(n, 2)), ("targets", np.arange(n))]),
        axis_labels={"features": ("batch", "feature"), "targets": ("batch",)},
    )


def targets_of(epoch: Iterator[Any]) -> list[list[int]]:
    return [np.asarray(t).tolist() for _, t in epoch]


def test_data_stream_batches_in_source_order() -> None:
    stream = DataStream(dataset(), iteration_scheme=SequentialScheme(8, 3))
    assert stream.sources == ("features", "targets")
    assert stream.produces_examples is False
    batches = list(stream.get_epoch_iterator())
    assert [b[1].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert all(isinstance(b, tuple) and len(b) == 2 for b in batches)
    assert batches[0][0].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert stream.axis_labels == {"features": ("batch", "feature"), "targets": ("batch",)}


def test_as_dict() -> None:
    stream = DataStream(dataset(), iteration_scheme=SequentialScheme(8, 4))
    first = next(stream.get_epoch_iterator(as_dict=True))
    assert set(first) == {"features", "targets"} and first["targets"].tolist() == [0, 1, 2, 3]


def test_example_streams_drop_the_batch_axis_label() -> None:
    stream = DataStream(dataset(), iteration_scheme=SequentialExampleScheme(8))
    assert stream.produces_examples is True
    assert stream.axis_labels == {"features": ("feature",), "targets": ()}
    assert [int(t) for _, t in stream.get_epoch_iterator()] == list(range(8))
    assert DataStream(IterableDataset([1, 2])).produces_examples is True


def test_each_epoch_iterator_is_the_next_epoch_of_the_scheme() -> None:
    scheme = ShuffledScheme(8, 3, rng=4)
    stream = DataStream(dataset(), iteration_scheme=ShuffledScheme(8, 3, rng=4))
    for epoch in range(3):
        expected = list(scheme.get_request_iterator(epoch=epoch))
        assert targets_of(stream.get_epoch_iterator()) == expected
    example_stream = DataStream(dataset(), iteration_scheme=ShuffledExampleScheme(8))
    first, second = (list(example_stream.get_epoch_iterator()) for _ in range(2))
    assert sorted(int(t) for _, t in first) == list(range(8))
    assert [int(t) for _, t in first] != [int(t) for _, t in second]


class FixedRequests:
    """What the sharding plan swaps in: a fixed list, no ``requests_examples``."""

    def __init__(self, requests: list[Any]) -> None:
        self.requests = requests
        self.calls: list[tuple[Any, ...]] = []

    def get_request_iterator(self, *args: Any) -> list[Any]:
        self.calls.append(args)
        return self.requests


def test_sharding_contract_reads_the_scheme_at_call_time() -> None:
    stream = DataStream(dataset(), iteration_scheme=ShuffledScheme(8, 2))
    saved = stream.iteration_scheme
    fixed = FixedRequests([[5, 1], [7]])
    stream.iteration_scheme = fixed
    iterator = stream.get_epoch_iterator()
    # The scheme was asked right away and without arguments.
    assert fixed.calls == [()]
    assert stream.produces_examples is False  # kept from construction
    stream.iteration_scheme = saved
    assert targets_of(iterator) == [[5, 1], [7]]
    # The real scheme has not moved: the next epoch is its epoch 0.
    assert targets_of(stream.get_epoch_iterator()) == list(
        ShuffledScheme(8, 2).get_request_iterator(epoch=0)
    )


def test_reset_restarts_an_iterable_dataset() -> None:
    stream = DataStream(IterableDataset({"x": [1, 2, 3]}))
    iterator = stream.get_epoch_iterator()
    assert next(iterator) == (1,)
    stream.reset()
    assert list(stream.get_epoch_iterator()) == [(1,), (2,), (3,)]
    stream.close()


def test_iterate_epochs() -> None:
    stream = DataStream(IterableDataset({"x": [1, 2]}))
    epochs = stream.iterate_epochs()
    assert [list(next(epochs)) for _ in range(3)] == [[(1,), (2,)]] * 3


def test_produces_examples_rules() -> None:
    stream = DataStream(dataset(), iteration_scheme=SequentialScheme(8, 2))
    with pytest.raises(StreamError, match="determined by its iteration scheme"):
        stream.produces_examples = True

    class Bare(AbstractDataStream):
        pass

    bare = Bare()
    with pytest.raises(StreamError, match="cannot infer") as info:
        _ = bare.produces_examples
    assert isinstance(info.value, ValueError)
    bare.produces_examples = False
    assert bare.produces_examples is False
    with pytest.raises(NotImplementedError):
        bare.get_data()


def test_data_iterator_with_a_list_of_requests() -> None:
    stream = DataStream(dataset(), iteration_scheme=SequentialScheme(8, 2))
    iterator = DataIterator(stream, [[1], [2, 3]], as_dict=True)
    assert [d["targets"].tolist() for d in iterator] == [[1], [2, 3]]
    assert iter(iterator) is iterator


# --- the tutorial (Fuel's "server" tutorial) -----------------------------------------


class Bottleneck(Transformer):
    """Fuel's tutorial transformer, verbatim."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.slowdown = kwargs.pop("slowdown", 0)
        super(Bottleneck, self).__init__(*args, **kwargs)  # noqa: UP008  (verbatim Fuel)

    def get_data(self, request: Any = None) -> Any:
        if request is not None:
            raise ValueError
        time.sleep(self.slowdown)
        return next(self.child_epoch_iterator)


def test_tutorial_chain_yields_ten_batches_of_each_example_once() -> None:
    stream = Bottleneck(
        DataStream.default_stream(
            IndexableDataset({"features": [[0] * 128] * 1000}),
            iteration_scheme=ShuffledScheme(examples=1000, batch_size=100),
        ),
        slowdown=0,
    )
    assert stream.sources == ("features",)
    assert stream.produces_examples is False
    for _ in range(2):
        batches = list(stream.get_epoch_iterator())
        assert len(batches) == 10
        # As in Fuel, a list source gives lists: each batch is 100 lists of 128 zeros.
        assert all(len(b) == 1 and np.asarray(b[0]).shape == (100, 128) for b in batches)
        assert all(isinstance(b[0], list) for b in batches)


def test_tutorial_chain_with_distinct_examples() -> None:
    features = np.arange(1000)[:, None] * np.ones((1, 128), dtype=np.int64)
    stream = Bottleneck(
        DataStream.default_stream(
            IndexableDataset({"features": features}),
            iteration_scheme=ShuffledScheme(examples=1000, batch_size=100),
        )
    )
    orders = []
    for _ in range(2):
        order = [int(row[0]) for (batch,) in stream.get_epoch_iterator() for row in batch]
        counts = Counter(order)
        assert sorted(counts) == list(range(1000)) and set(counts.values()) == {1}
        orders.append(order)
    assert orders[0] != orders[1]
