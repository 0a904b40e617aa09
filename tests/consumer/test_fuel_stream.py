"""ServerDataStream is a Fuel stream: get_data, epochs, axis labels, trainer-side
transformers, pickling (on the real redis-server)."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from pipelines import FEATURES, examples_of, numbered

from batchq.errors import ConfigError
from consumer import ServerDataStream
from producer.transformers import Cast, ForceFloatX, Mapping

EXAMPLES, BATCH = 60, 20  # 3 batches per epoch


def trainer(url: str, queue: str, **kw: Any) -> ServerDataStream:
    kw.setdefault("timeout_s", 20)
    return ServerDataStream(("features", "targets"), False, url=url, queue=queue, **kw)


def reference(epochs: int) -> list[list[int]]:
    local = numbered(EXAMPLES, BATCH)
    return [examples_of(f) for _ in range(epochs) for f, _ in local.get_epoch_iterator()]


@pytest.fixture
def served(producer_thread: Callable[..., Any]) -> None:
    stream = numbered(EXAMPLES, BATCH)
    stream.axis_labels = {"features": ("batch", "feature"), "targets": ("batch",)}
    producer_thread(stream)


def test_get_data_walks_epochs_with_stop_iteration_between(
    redis_url: str, queue_name: str, served: None
) -> None:
    got: list[list[int]] = []
    with trainer(redis_url, queue_name) as stream:
        for epoch in range(2):
            while True:
                try:
                    features, _ = stream.get_data()
                except StopIteration:
                    break
                got.append(examples_of(features))
            assert stream.epoch == epoch
        with pytest.raises(ConfigError, match="request"):
            stream.get_data(request=[0, 1])
    assert got == reference(2)


def test_reset_and_next_epoch_are_as_fuels(redis_url: str, queue_name: str, served: None) -> None:
    with trainer(redis_url, queue_name) as stream:
        stream.get_data()
        stream.next_epoch()  # nothing: the producers plan epochs
        stream.reset()  # leaves the get_data epoch: the next call begins epoch 1
        stream.get_data()
        assert stream.epoch == 1


def test_fuel_attributes(redis_url: str, queue_name: str, served: None) -> None:
    stream = trainer(redis_url, queue_name)
    assert stream.sources == ("features", "targets")
    assert stream.produces_examples is False
    assert stream.axis_labels is None  # nothing asked of Redis before the first epoch
    with stream:
        next(iter(stream.get_epoch_iterator()))
        assert stream.axis_labels == {"features": ("batch", "feature"), "targets": ("batch",)}
    given = ServerDataStream(("x",), False, "localhost", 6380, 5, {"x": ("batch",)})
    assert given.axis_labels == {"x": ("batch",)}
    assert given.hwm == 5


def test_trainer_side_transformers_wrap_it(redis_url: str, queue_name: str, served: None) -> None:
    stream = trainer(redis_url, queue_name)
    first = Cast(stream, "float64", which_sources=("features",))
    second = ForceFloatX(first)
    mapped = Mapping(second, lambda batch: (batch[0] + 1, batch[1]))
    assert mapped.sources == ("features", "targets")
    with stream:
        for epoch in range(2):
            batches = list(mapped.get_epoch_iterator())
            assert len(batches) == EXAMPLES // BATCH, epoch
            for features, targets in batches:
                assert features.dtype == np.float32  # float64, then floatX
                assert features.shape == (BATCH, FEATURES)
                assert examples_of(features.astype(np.int64) - 1) == targets.tolist()
        as_dict = next(mapped.get_epoch_iterator(as_dict=True))
        assert set(as_dict) == {"features", "targets"}


def test_pickled_stream_resumes_where_it_was(redis_url: str, queue_name: str, served: None) -> None:
    expected = reference(2)
    stream = trainer(redis_url, queue_name)
    got = [examples_of(f) for f, _ in stream.get_epoch_iterator()]
    it = stream.get_epoch_iterator()
    got.append(examples_of(next(it)[0]))
    blob = pickle.dumps(stream)
    stream.close()
    for word in (b"socket", b"Lock", b"Thread", b"Condition"):
        assert word not in blob
    copy = pickle.loads(blob)
    assert copy.sources == stream.sources and copy.url == stream.url
    with copy:
        got += [examples_of(f) for f, _ in copy.get_epoch_iterator()]
    assert got == expected


def test_a_stream_pickled_before_its_first_epoch_starts_fresh() -> None:
    stream = ServerDataStream(
        ("features",), False, url="redis://127.0.0.1:1/0", queue="q1", dtypes={"features": "f4"}
    )
    copy = pickle.loads(pickle.dumps(stream))
    assert copy.keys.queue == "q1"
    assert copy.epoch == -1
    assert copy._prep.dtypes == {"features": np.dtype("float32")}
    assert copy.state_dict()["run"] == ""
