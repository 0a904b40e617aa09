"""The trainer's sources and dtypes are honoured (on the real redis-server)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from pipelines import FEATURES, examples_of, numbered

from batchq.errors import ConfigError
from batchq.wire import codec
from consumer import ServerDataStream
from consumer.reader.prepare import FramePrep


def trainer(url: str, queue: str, sources: Any, **kw: Any) -> ServerDataStream:
    kw.setdefault("timeout_s", 20)
    return ServerDataStream(sources, False, url=url, queue=queue, **kw)


def test_tuples_come_in_the_trainers_order(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(60, 20, shuffled=False))
    with trainer(redis_url, queue_name, ("targets", "features")) as stream:
        for epoch in range(2):
            batches = list(stream.get_epoch_iterator())
            assert len(batches) == 3, epoch
            for targets, features in batches:
                assert features.shape == (20, FEATURES)
                assert targets.shape == (20,)
                assert examples_of(features) == targets.tolist()
        as_dict = next(iter(stream.get_epoch_iterator(as_dict=True)))
        assert list(as_dict) == ["targets", "features"]


def test_a_subset_holds_just_those_sources(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(60, 20, shuffled=False))
    with trainer(redis_url, queue_name, ("targets",)) as stream:
        batches = list(stream.get_epoch_iterator())
        assert [len(b) for b in batches] == [1, 1, 1]
        assert sorted(int(t) for (targets,) in batches for t in targets) == list(range(60))
        as_dict = next(iter(stream.get_epoch_iterator(as_dict=True)))
        assert list(as_dict) == ["targets"]
        assert stream.sources == ("targets",)


def test_an_unknown_source_raises_naming_what_is_served(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(60, 20, shuffled=False))
    stream = trainer(redis_url, queue_name, ("features", "labels"))
    with stream, pytest.raises(ConfigError) as info:
        next(iter(stream.get_epoch_iterator()))
    message = str(info.value)
    assert "'labels'" in message
    assert "['features', 'targets']" in message


def test_sources_none_takes_the_producers(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(40, 20, shuffled=False))
    with trainer(redis_url, queue_name, None) as stream:
        assert stream.sources == ()
        features, targets = next(iter(stream.get_epoch_iterator()))
        assert stream.sources == ("features", "targets")
        assert examples_of(features) == targets.tolist()


def test_declared_dtypes_are_cast_with_one_warning_per_source(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    # The producers send int64 for both sources.
    producer_thread(numbered(100, 20, shuffled=False))
    dtypes = {"features": "float32", "targets": np.int32}
    stream = trainer(redis_url, queue_name, ("features", "targets"), dtypes=dtypes)
    with stream, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(stream.get_epoch_iterator()) + list(stream.get_epoch_iterator())
    assert len(batches) == 10
    for features, targets in batches:
        assert features.dtype == np.float32
        assert targets.dtype == np.int32
        assert examples_of(features.astype(np.int64)) == targets.tolist()
    messages = [str(w.message) for w in caught if "cast" in str(w.message)]
    assert len(messages) == 2, messages
    assert any("'features'" in m and "int64" in m and "float32" in m for m in messages)
    assert any("'targets'" in m and "int32" in m for m in messages)


def test_no_warning_when_the_dtype_already_matches(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(40, 20, shuffled=False))
    stream = trainer(redis_url, queue_name, ("features",), dtypes={"features": "int64"})
    with stream, warnings.catch_warnings():
        warnings.simplefilter("error")
        (features,) = next(iter(stream.get_epoch_iterator()))
    assert features.dtype == np.int64
    assert not features.flags.writeable  # no cast: still the zero-copy view


@pytest.mark.parametrize(
    ("dtypes", "needle"),
    [
        ({"features": "object"}, "plain-data"),
        ({"features": "not-a-dtype"}, "not-a-dtype"),
        ({"labels": "float32"}, "'labels'"),
        (["float32"], "expected a dict"),
    ],
)
def test_bad_dtypes_are_refused_naming_the_value(dtypes: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ServerDataStream(("features", "targets"), False, dtypes=dtypes)


def test_bad_sources_are_refused() -> None:
    for sources in ("features", ("a", "a"), ("a", 3)):
        with pytest.raises(ConfigError, match="sources"):
            ServerDataStream(sources, False)  # type: ignore[arg-type]


def _frame(**data: Any) -> codec.Frame:
    raw = codec.encode_frame(
        codec.FrameHeader(
            codec.FrameKind.BATCH, run="r", epoch=0, shard=0, k=0, producer="p", sources=list(data)
        ),
        list(data.values()),
    )
    return codec.decode_frame(bytes(raw))


def test_prep_casts_ragged_sources_element_by_element() -> None:
    ragged = np.empty(2, dtype=object)
    ragged[0], ragged[1] = np.arange(3), np.arange(5)
    prep = FramePrep(("seq",), {"seq": "float32"}, "q")
    out = prep(_frame(seq=ragged))
    assert [a.dtype for a in out.data[0]] == [np.float32, np.float32]
    assert len(prep.take_warnings()) == 1
    assert prep.take_warnings() == []


def test_prep_refuses_to_cast_a_string_value() -> None:
    prep = FramePrep(("name",), {"name": "float32"}, "q")
    with pytest.raises(ConfigError, match="'name'"):
        prep(_frame(name="hello"))


def test_prep_says_whether_its_frames_keep_their_values() -> None:
    """What a detaching stream may give back (consumer/detach.py)."""
    x, y = np.arange(3, dtype=np.int64), np.zeros(2)
    same = FramePrep(("y", "x"), {"x": "int64"}, "q")  # reordered, a cast that casts nothing
    same(_frame(x=x, y=y))
    assert same.keeps_frames()
    subset = FramePrep(("x",), None, "q")
    subset(_frame(x=x, y=y))
    assert not subset.keeps_frames()
    cast = FramePrep(None, {"x": "int32"}, "q")
    cast(_frame(x=x, y=y))
    assert not cast.keeps_frames() and cast.take_warnings()
    hooked = FramePrep(None, None, "q")
    hooked.add_hook(lambda f: f, keeps_values=True)  # a copy into pinned memory, say
    assert hooked.keeps_frames()
    hooked.add_hook(lambda f: f)
    assert not hooked.keeps_frames()
