"""Tests of producer.transformers, ported from Fuel's documentation and tests."""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.datasets import IndexableDataset, IterableDataset
from producer.errors import (
    ConfigError,
    IncompleteBatchError,
    InvalidRequestError,
    SchemeError,
    ShapeError,
    SourceError,
    StreamError,
    StreamMismatchError,
    UnsupportedInputError,
)
from producer.schemes import ConstantScheme, SequentialExampleScheme, SequentialScheme
from producer.streams import DataStream
from producer.transformers import (
    AgnosticSourcewiseTransformer,
    Batch,
    Cache,
    Cast,
    Filter,
    FilterSources,
    Flatten,
    ForceFloatX,
    Mapping,
    Merge,
    MinimumImageDimensions,
    Padding,
    Random2DRotation,
    RandomFixedSizeCrop,
    Rename,
    ScaleAndShift,
    SortMapping,
    Transformer,
    Unpack,
)
from producer.transformers.image import resize, rotate


def iterable_stream(data: Any) -> DataStream:
    return DataStream(IterableDataset(data))


def as_lists(epoch: Any) -> list[tuple[Any, ...]]:
    return [tuple(np.asarray(v).tolist() for v in item) for item in epoch]


def batch_stream(n: int = 4, batch_size: int = 2) -> DataStream:
    return DataStream(
        IndexableDataset(
            OrderedDict([("features", np.ones((n, 2, 2))), ("targets", np.arange(n))]),
            axis_labels={"features": ("batch", "width", "height"), "targets": ("batch",)},
        ),
        iteration_scheme=SequentialScheme(n, batch_size),
    )


# --- Transformer ---------------------------------------------------------------------


class Double(Transformer):
    def transform_batch(self, batch: Any) -> Any:
        return tuple(2 * b for b in batch)


def test_transformer_basics() -> None:
    child = batch_stream()
    stream = Double(child)
    assert stream.data_stream is child and stream.sources == child.sources
    assert stream.produces_examples is False  # inherited from the child
    with pytest.raises(StreamError, match="get_epoch_iterator"):
        stream.get_data()
    assert as_lists(stream.get_epoch_iterator())[1][1] == [4, 6]
    assert stream.child_epoch_iterator is not None
    with pytest.raises(InvalidRequestError):
        stream.get_data(request=[0])
    example_stream = Double(DataStream(IterableDataset([1, 2])))
    with pytest.raises(UnsupportedInputError, match="does not support examples") as info:
        next(example_stream.get_epoch_iterator())
    assert isinstance(info.value, NotImplementedError)


def test_declared_kind_mismatch_raises_at_read_time_as_in_fuel() -> None:
    stream = Double(batch_stream(), produces_examples=True)
    with pytest.raises(UnsupportedInputError, match="produces batches while the Double"):
        next(stream.get_epoch_iterator())


# --- Mapping, SortMapping, Filter ----------------------------------------------------


def test_mapping_fuel_example() -> None:
    stream = iterable_stream([1, 2, 3])
    assert list(Mapping(stream, lambda d: (2 * d[0],)).get_epoch_iterator()) == [(2,), (4,), (6,)]
    adding = Mapping(stream, lambda d: (2 * d[0],), add_sources=("doubled",))
    assert adding.sources == ("data", "doubled")
    assert list(adding.get_epoch_iterator()) == [(1, 2), (2, 4), (3, 6)]
    assert next(adding.get_epoch_iterator(as_dict=True)) == {"data": 1, "doubled": 2}


def test_sort_mapping_fuel_example() -> None:
    stream = iterable_stream([[1, 2, 3], [2, 3, 1], [3, 2, 1]])
    ascending = Mapping(stream, SortMapping(operator.itemgetter(0)))
    assert list(ascending.get_epoch_iterator()) == [([1, 2, 3],)] * 3
    descending = Mapping(stream, SortMapping(operator.itemgetter(0), reverse=True))
    assert list(descending.get_epoch_iterator()) == [([3, 2, 1],)] * 3
    sorted_batch = SortMapping(lambda e: e[1])((np.array([1, 2, 3]), [30, 10, 20]))
    assert sorted_batch[0].tolist() == [2, 3, 1] and sorted_batch[1] == [10, 20, 30]


def test_filter() -> None:
    stream = Filter(iterable_stream(range(10)), lambda d: d[0] % 3 == 0)
    assert list(stream.get_epoch_iterator()) == [(0,), (3,), (6,), (9,)]
    assert list(stream.get_epoch_iterator(as_dict=True))[1] == {"data": 3}


# --- sourcewise transformers ---------------------------------------------------------


def test_flatten_fuel_example() -> None:
    stream = Flatten(batch_stream(), which_sources=("features",))
    assert as_lists(stream.get_epoch_iterator()) == [
        ([[1.0] * 4] * 2, [0, 1]),
        ([[1.0] * 4] * 2, [2, 3]),
    ]
    assert stream.axis_labels == {"features": ("batch", "feature"), "targets": ("batch",)}
    examples = Flatten(DataStream(IterableDataset({"x": [np.ones((2, 3))]})))
    assert next(examples.get_epoch_iterator())[0].shape == (6,)


def test_scale_and_shift_cast_force_floatx() -> None:
    scaled = ScaleAndShift(batch_stream(), 2.0, -1.0, which_sources=("targets",))
    assert as_lists(scaled.get_epoch_iterator())[0][1] == [-1.0, 1.0]
    cast = Cast(scaled, "floatX", which_sources=("targets",))
    assert next(cast.get_epoch_iterator())[1].dtype == np.float32
    assert Cast(batch_stream(), "int8").dtype == np.int8
    forced = next(ForceFloatX(batch_stream()).get_epoch_iterator())
    assert forced[0].dtype == np.float32 and forced[1].dtype == np.arange(1).dtype
    assert scaled.axis_labels == batch_stream().axis_labels


def test_which_sources_must_exist() -> None:
    with pytest.raises(SourceError, match=r"'labels'.*\['features', 'targets'\]"):
        ScaleAndShift(batch_stream(), 1, 0, which_sources=("labels",))


class Negate(AgnosticSourcewiseTransformer):
    def __init__(self, data_stream: Any, **kwargs: Any) -> None:
        super().__init__(data_stream, data_stream.produces_examples, **kwargs)

    def transform_any_source(self, source_data: Any, source_name: str) -> Any:
        return -np.asarray(source_data)


def test_agnostic_sourcewise_on_examples_and_batches() -> None:
    assert list(Negate(iterable_stream([1, 2])).get_epoch_iterator()) == [(-1,), (-2,)]
    assert as_lists(Negate(batch_stream(), which_sources="targets").get_epoch_iterator())[0][1] == [
        0,
        -1,
    ]


# --- Batch, Unpack, Cache ------------------------------------------------------------


def test_batch_fuel_example_and_strictness() -> None:
    def build(strictness: int) -> Batch:
        return Batch(iterable_stream([1, 2, 3, 4, 5]), ConstantScheme(2), strictness=strictness)

    assert as_lists(build(0).get_epoch_iterator()) == [([1, 2],), ([3, 4],), ([5],)]
    assert as_lists(build(1).get_epoch_iterator()) == [([1, 2],), ([3, 4],)]
    with pytest.raises(IncompleteBatchError, match="after 1 of the 2") as info:
        list(build(2).get_epoch_iterator())
    assert isinstance(info.value, ValueError)
    assert build(0).produces_examples is False


def test_batch_over_an_example_scheme() -> None:
    examples = DataStream(
        IndexableDataset({"x": np.arange(10) * 10}), iteration_scheme=SequentialExampleScheme(7)
    )
    batched = Batch(examples, iteration_scheme=ConstantScheme(3))
    assert as_lists(batched.get_epoch_iterator()) == [([0, 10, 20],), ([30, 40, 50],), ([60],)]
    ragged = Batch(iterable_stream([[1], [2, 3]]), ConstantScheme(2))
    (seqs,) = next(ragged.get_epoch_iterator())
    assert seqs.dtype == object and len(seqs) == 2


def test_batch_errors() -> None:
    with pytest.raises(StreamMismatchError, match="must produce examples"):
        Batch(batch_stream(), ConstantScheme(2))
    with pytest.raises(StreamMismatchError, match="must request batches"):
        Batch(iterable_stream([1]), SequentialExampleScheme(1))
    with pytest.raises(ConfigError, match="strictness=3"):
        Batch(iterable_stream([1]), ConstantScheme(1), strictness=3)


def test_unpack_fuel_example() -> None:
    batched = Batch(iterable_stream(range(10)), iteration_scheme=ConstantScheme(3))
    unpacked = Unpack(batched)
    assert unpacked.produces_examples is True
    for _ in range(2):
        assert [tuple(int(v) for v in d) for d in unpacked.get_epoch_iterator()] == [
            (i,) for i in range(10)
        ]
    with pytest.raises(StreamMismatchError, match="must produce batches"):
        Unpack(iterable_stream([1]))


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.integers(-100, 100), max_size=30), size=st.integers(1, 8))
def test_unpack_inverts_batch(values: list[int], size: int) -> None:
    stream = Unpack(Batch(iterable_stream(values), ConstantScheme(size)))
    assert [int(v) for (v,) in stream.get_epoch_iterator()] == values


def test_cache_fuel_example() -> None:
    batched = Batch(iterable_stream(range(100)), ConstantScheme(11))
    cached = Cache(batched, ConstantScheme(7))
    epoch = cached.get_epoch_iterator()
    for (_,), size in zip(epoch, [4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 0, 4], strict=False):
        assert len(cached.cache[0]) == size
    *_, (last,) = cached.get_epoch_iterator()
    assert len(last) == 100 % 7 and not cached.cache[0]
    three = Cache(batched, ConstantScheme(7, times=3))
    for _, epoch in zip(range(2), three.iterate_epochs(), strict=False):
        got = [features.tolist() for (features,) in epoch]
        assert got == [list(range(i * 7, (i + 1) * 7)) for i in range(3)]
    with pytest.raises(SchemeError, match="BatchSizeScheme"):
        Cache(batched, SequentialScheme(10, 2))


# --- Padding -------------------------------------------------------------------------


def test_padding_fuel_example() -> None:
    stream = Batch(iterable_stream([[1], [2, 3], [], [4, 5, 6], [7]]), ConstantScheme(2))
    padded = Padding(stream)
    assert padded.sources == ("data", "data_mask")
    assert as_lists(padded.get_epoch_iterator()) == [
        ([[1, 0], [2, 3]], [[1, 0], [1, 1]]),
        ([[0, 0, 0], [4, 5, 6]], [[0, 0, 0], [1, 1, 1]]),
        ([[7]], [[1]]),
    ]
    data, mask = next(padded.get_epoch_iterator())
    assert mask.dtype == np.float32 and data.dtype.kind == "i"


def test_padding_multidimensional_and_selected_sources() -> None:
    features = [np.ones((2, 3)), np.ones((1, 3)) * 2]
    stream = Batch(
        DataStream(IterableDataset(OrderedDict([("f", features), ("t", [0, 1])]))),
        ConstantScheme(2),
    )
    padded = Padding(stream, mask_sources=("f",), mask_dtype="int8")
    assert padded.sources == ("f", "f_mask", "t")
    f, mask, t = next(padded.get_epoch_iterator())
    assert f.shape == (2, 2, 3) and f[1, 1].tolist() == [0, 0, 0] and f[1, 0, 0] == 2
    assert mask.dtype == np.int8 and mask.tolist() == [[1, 1], [1, 0]] and t.tolist() == [0, 1]
    with pytest.raises(SourceError, match="'g'"):
        Padding(stream, mask_sources=("g",))
    with pytest.raises(StreamMismatchError):
        Padding(iterable_stream([[1]]))
    bad = Padding(Batch(iterable_stream([np.ones((1, 2)), np.ones((1, 3))]), ConstantScheme(2)))
    with pytest.raises(ShapeError, match="except length"):
        next(bad.get_epoch_iterator())


# --- Merge, Rename, FilterSources ----------------------------------------------------


def test_merge_fuel_example() -> None:
    streams = (iterable_stream(["Hello world!"]), iterable_stream(["Bonjour le monde!"]))
    merged = Merge(streams, ("english", "french"))
    assert merged.sources == ("english", "french")
    assert merged.data_streams == list(streams)
    assert next(merged.get_epoch_iterator()) == ("Hello world!", "Bonjour le monde!")
    assert merged.produces_examples is True


def test_merge_errors() -> None:
    with pytest.raises(StreamMismatchError, match="same type"):
        Merge((iterable_stream([1]), batch_stream()), ("a", "b", "c"))
    with pytest.raises(SourceError, match="sources="):
        Merge((iterable_stream([1]), iterable_stream([2])), ("a",))


def test_rename() -> None:
    stream = Rename(batch_stream(), {"features": "x"})
    assert stream.sources == ("x", "targets")
    assert stream.axis_labels == {"x": ("batch", "width", "height"), "targets": ("batch",)}
    assert next(stream.get_epoch_iterator(as_dict=True))["x"].shape == (2, 2, 2)
    with pytest.raises(SourceError, match=r"no source 'nope'.*\['features', 'targets'\]") as info:
        Rename(batch_stream(), {"nope": "x"})
    assert isinstance(info.value, KeyError)
    assert Rename(batch_stream(), {"nope": "x"}, on_non_existent="ignore").sources == (
        "features",
        "targets",
    )
    with pytest.raises(SourceError, match="several sources"):
        Rename(batch_stream(), {"features": "targets"})
    swapped = Rename(batch_stream(), {"features": "targets", "targets": "features"})
    assert swapped.sources == ("targets", "features")
    with pytest.raises(ConfigError, match="on_non_existent='loud'"):
        Rename(batch_stream(), {}, on_non_existent="loud")


def test_rename_warns(caplog: pytest.LogCaptureFixture) -> None:
    Rename(batch_stream(), {"nope": "x"}, on_non_existent="warn")
    assert "no source 'nope'" in caplog.text


def test_filter_sources_keeps_stream_order() -> None:
    stream = FilterSources(batch_stream(), ("targets",))
    assert stream.sources == ("targets",)
    assert as_lists(stream.get_epoch_iterator()) == [([0, 1],), ([2, 3],)]
    both = FilterSources(batch_stream(), ("targets", "features"))
    assert both.sources == ("features", "targets")
    with pytest.raises(SourceError, match=r"'labels'.*\['features', 'targets'\]") as info:
        FilterSources(batch_stream(), ("labels",))
    assert isinstance(info.value, ValueError)


# --- images --------------------------------------------------------------------------


def image_stream(images: Any, batch_size: int | None = None) -> DataStream:
    dataset = IndexableDataset({"images": images, "labels": np.arange(len(images))})
    if batch_size is None:
        return DataStream(dataset, iteration_scheme=SequentialExampleScheme(len(images)))
    return DataStream(dataset, iteration_scheme=SequentialScheme(len(images), batch_size))


def test_rotate_and_resize_helpers() -> None:
    image = np.arange(12, dtype=np.uint8).reshape(3, 4)
    square = np.arange(16).reshape(4, 4)
    assert np.array_equal(rotate(square, math.pi / 2), np.rot90(square))
    assert np.array_equal(rotate(square, -math.pi / 2), np.rot90(square, -1))
    assert np.array_equal(rotate(image, 0.0, "bilinear"), image)
    assert np.array_equal(resize(image, (6, 8)), image.repeat(2, 0).repeat(2, 1))
    assert resize(image[None], (5, 5), "bilinear").shape == (1, 5, 5)


def test_minimum_image_dimensions_keeps_aspect_ratio() -> None:
    images = np.empty(2, dtype=object)
    images[0], images[1] = np.ones((3, 4, 8), dtype=np.uint8), np.ones((3, 20, 20), dtype=np.uint8)
    stream = MinimumImageDimensions(image_stream(images), (8, 6), which_sources=("images",))
    shapes = [im.shape for im, _ in stream.get_epoch_iterator()]
    assert shapes == [(3, 8, 16), (3, 20, 20)]
    batches = MinimumImageDimensions(
        image_stream(np.ones((2, 1, 2, 2))), (4, 4), which_sources="images"
    )
    batched = MinimumImageDimensions(
        image_stream(np.ones((2, 1, 2, 2)), 2), (4, 4), "bilinear", which_sources=("images",)
    )
    assert next(batched.get_epoch_iterator())[0].shape == (2, 1, 4, 4)
    assert next(batches.get_epoch_iterator())[0].shape == (1, 4, 4)
    with pytest.raises(ConfigError, match="resample='bicubic'"):
        MinimumImageDimensions(image_stream(np.ones((1, 2, 2))), (4, 4), resample="bicubic")


def test_random_fixed_size_crop_is_deterministic_and_reseedable() -> None:
    images = np.arange(4 * 1 * 10 * 10).reshape(4, 1, 10, 10)

    def build(rng: Any = 3) -> RandomFixedSizeCrop:
        return RandomFixedSizeCrop(
            image_stream(images, 2), (4, 5), which_sources=("images",), rng=rng
        )

    a, b = build(), build()
    first = [im for im, _ in a.get_epoch_iterator()]
    assert all(im.shape == (2, 1, 4, 5) for im in first)
    assert all(
        np.array_equal(x, y)
        for x, y in zip(first, [im for im, _ in b.get_epoch_iterator()], strict=True)
    )
    a.reseed(11)
    redo = [im for im, _ in a.get_epoch_iterator()]
    a.reseed(11)  # a shard built again gives the same batches
    assert all(
        np.array_equal(x, y)
        for x, y in zip(redo, [im for im, _ in a.get_epoch_iterator()], strict=True)
    )
    a.reseed(12)
    assert not all(
        np.array_equal(x, y)
        for x, y in zip(redo, [im for im, _ in a.get_epoch_iterator()], strict=True)
    )
    crop = first[0][0, 0]
    top, left = divmod(int(crop[0, 0]), 10)
    assert np.array_equal(crop, images[0, 0, top : top + 4, left : left + 5])
    with pytest.raises(ConfigError, match="reseed"):
        a.reseed(-1)
    small = RandomFixedSizeCrop(image_stream(np.ones((1, 1, 3, 3))), (4, 4), which_sources="images")
    with pytest.raises(ShapeError, match="smaller than the window"):
        next(small.get_epoch_iterator())


def test_random_2d_rotation() -> None:
    images = np.random.default_rng(0).integers(0, 255, size=(3, 1, 6, 6)).astype(np.uint8)
    with pytest.raises(ConfigError, match=r"maximum_rotation=0\.0"):  # Fuel's ValueError
        Random2DRotation(image_stream(images, 3), maximum_rotation=0.0, which_sources="images")
    spin = Random2DRotation(
        image_stream(images), resample="bilinear", which_sources="images", rng=5
    )
    spin.reseed(1)
    once = [im for im, _ in spin.get_epoch_iterator()]
    spin.reseed(1)
    again = [im for im, _ in spin.get_epoch_iterator()]
    assert all(
        np.array_equal(x, y) and x.dtype == np.uint8 for x, y in zip(once, again, strict=True)
    )
    assert any(not np.array_equal(x, y) for x, y in zip(once, images, strict=True))
    with pytest.raises(ConfigError, match="maximum_rotation"):
        Random2DRotation(image_stream(images), maximum_rotation=4.0)
