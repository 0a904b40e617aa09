"""Compatibility with Fuel's documented behaviour (written from Fuel's docs and API).

Each test states the Fuel behaviour it checks; the README's porting table lists what
batchq deliberately does differently.
"""

from __future__ import annotations

import importlib
import logging
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from producer.datasets import IndexableDataset
from producer.errors import AxisLabelsMismatchError
from producer.schemes import (
    ConstantScheme,
    SequentialExampleScheme,
    SequentialScheme,
    ShuffledScheme,
    cross_validation,
)
from producer.streams import DataStream
from producer.transformers import (
    Batch,
    Cast,
    ExpectsAxisLabels,
    ForceFloatX,
    Mapping,
    Padding,
    SourcewiseTransformer,
)
from producer.transformers.defaults import ToBytes, uint8_pixels_to_floatX
from producer.transformers.image import (
    MinimumImageDimensions,
    Random2DRotation,
    RandomFixedSizeCrop,
)

# --- module paths ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("producer.datasets", ["Dataset", "IndexableDataset", "IterableDataset", "H5PYDataset"]),
        ("producer.datasets.base", ["Dataset", "IndexableDataset", "IterableDataset"]),
        ("producer.datasets.hdf5", ["H5PYDataset", "PytablesDataset"]),
        ("producer.schemes", ["IndexScheme", "BatchScheme", "ShuffledScheme", "cross_validation"]),
        ("producer.streams", ["DataStream", "AbstractDataStream"]),
        ("producer.transformers", ["Transformer", "AgnosticSourcewiseTransformer", "Mapping"]),
        ("producer.transformers.defaults", ["ToBytes", "uint8_pixels_to_floatX"]),
        ("producer.transformers.image", ["RandomFixedSizeCrop", "Random2DRotation"]),
        ("producer.iterator", ["DataIterator"]),
        ("producer.exceptions", ["AxisLabelsMismatchError", "ConfigurationError"]),
        ("producer.config", ["floatX", "default_seed"]),
        ("producer", ["start_server"]),
    ],
)
def test_fuels_module_paths_import(module: str, names: list[str]) -> None:
    imported = importlib.import_module(module)
    for name in names:
        assert getattr(imported, name) is not None, (module, name)


# --- Mapping ---------------------------------------------------------------------------


def stream_of(data: dict[str, Any], batch_size: int | None = None) -> DataStream:
    dataset = IndexableDataset(OrderedDict(data))
    n = dataset.num_examples
    scheme = SequentialExampleScheme(n) if batch_size is None else SequentialScheme(n, batch_size)
    return DataStream(dataset, iteration_scheme=scheme)


def test_mapping_accepts_dict() -> None:
    stream = stream_of({"x": np.arange(3), "y": np.arange(3) * 10})

    def swap(item: OrderedDict[str, Any]) -> dict[str, Any]:
        assert list(item) == ["x", "y"]  # an ordered dict, keyed by source
        return {"x": item["y"], "y": item["x"]}

    mapped = Mapping(stream, swap, mapping_accepts=dict)
    assert [tuple(map(int, v)) for v in mapped.get_epoch_iterator()] == [
        (0, 0),
        (10, 1),
        (20, 2),
    ]
    added = Mapping(
        stream, lambda d: {"z": d["x"] + d["y"]}, add_sources=("z",), mapping_accepts=dict
    )
    assert added.sources == ("x", "y", "z")
    assert [int(v[2]) for v in added.get_epoch_iterator()] == [0, 11, 22]


def test_mapping_refuses_other_accepts() -> None:
    with pytest.raises(ValueError, match="mapping_accepts"):
        Mapping(stream_of({"x": np.arange(3)}), lambda d: d, mapping_accepts=tuple)


# --- list sources, cross_validation, raises --------------------------------------------


def test_list_sources_stay_lists_through_a_batch_scheme() -> None:
    # Fuel: batch schemes work with more than ndarrays; a list source gives lists.
    dataset = IndexableDataset(OrderedDict([("a", list(range(20))), ("b", list(range(1, 21)))]))
    stream = DataStream(dataset, iteration_scheme=ShuffledScheme(20, 6))
    columns = [
        [value for batch in batches for value in batch]  # each batch is a list
        for batches in zip(*stream.get_epoch_iterator(), strict=True)
    ]
    assert all(isinstance(b, list) for item in stream.get_epoch_iterator() for b in item)
    assert sorted(columns[0]) == list(range(20)) and sorted(columns[1]) == list(range(1, 21))
    assert IndexableDataset({"a": (1, 2)}).a == (1, 2)  # attribute access, kept as given


def test_cross_validation_strict_is_the_fourth_positional_argument() -> None:
    folds = cross_validation(SequentialExampleScheme, 10, 3, False)
    train, valid, size = next(folds)
    assert list(valid.get_request_iterator()) == [0, 1, 2] and size == 3
    assert list(train.get_request_iterator()) == list(range(3, 10))
    strict = cross_validation(SequentialExampleScheme, 10, 3)  # nothing raised yet
    with pytest.raises(ValueError, match="not divisible"):
        next(strict)
    train, valid = next(cross_validation(SequentialScheme, 8, 2, batch_size=2))
    assert list(train.get_request_iterator()) == [[4, 5], [6, 7]]


def test_indexable_dataset_get_data_with_a_state_raises_value_error() -> None:
    with pytest.raises(ValueError, match="state"):
        IndexableDataset([1, 2, 3]).get_data(True, [1, 2])
    with pytest.raises(ValueError):
        IndexableDataset([1, 2, 3]).get_data(None, None)


def test_random_image_transformers_refuse_2d_images() -> None:
    flat = stream_of({"x": np.zeros((2, 6, 6))})
    for make in (
        lambda: RandomFixedSizeCrop(flat, (3, 3)),
        lambda: Random2DRotation(flat),
    ):
        with pytest.raises(ValueError, match="channels, height, width"):
            next(make().get_epoch_iterator())
    batches = stream_of({"x": np.zeros((2, 6, 6))}, 2)
    with pytest.raises(ValueError, match="4 axes"):
        next(RandomFixedSizeCrop(batches, (3, 3)).get_epoch_iterator())


def test_maximum_rotation_must_be_in_zero_to_pi() -> None:
    stream = stream_of({"x": np.zeros((2, 1, 6, 6))})
    for bad in (0, -0.1, 3.2):
        with pytest.raises(ValueError, match="maximum_rotation"):
            Random2DRotation(stream, maximum_rotation=bad)


def test_minimum_image_dimensions_of_a_4d_example_is_not_implemented() -> None:
    stream = stream_of({"x": np.zeros((2, 1, 1, 2, 2))})
    with pytest.raises(NotImplementedError):
        next(MinimumImageDimensions(stream, (4, 4)).get_epoch_iterator())


# --- ExpectsAxisLabels -----------------------------------------------------------------


class Checked(ExpectsAxisLabels, SourcewiseTransformer):
    def __init__(self, data_stream: Any) -> None:
        super().__init__(data_stream, data_stream.produces_examples)

    def transform_source_example(self, source_example: Any, source_name: str) -> Any:
        labels = (self.data_stream.axis_labels or {}).get(source_name)
        self.verify_axis_labels(("channel", "height", "width"), labels, source_name)
        return source_example


def test_expects_axis_labels(caplog: pytest.LogCaptureFixture) -> None:
    good = IndexableDataset(
        {"x": np.zeros((2, 1, 2, 2))}, axis_labels={"x": ("batch", "channel", "height", "width")}
    )
    assert (
        len(list(Checked(DataStream(good, SequentialExampleScheme(2))).get_epoch_iterator())) == 2
    )
    bad = IndexableDataset(
        {"x": np.zeros((2, 1, 2, 2))}, axis_labels={"x": ("batch", "c", "h", "w")}
    )
    with pytest.raises(AxisLabelsMismatchError, match="expected axis labels") as info:
        next(Checked(DataStream(bad, SequentialExampleScheme(2))).get_epoch_iterator())
    assert isinstance(info.value, ValueError)
    with caplog.at_level(logging.WARNING):
        list(Checked(stream_of({"x": np.zeros((2, 1, 2, 2))})).get_epoch_iterator())
    assert sum("could not verify" in r.message for r in caplog.records) == 1  # once


def test_crop_checks_axis_labels_as_fuel() -> None:
    dataset = IndexableDataset(
        {"x": np.zeros((2, 1, 6, 6))}, axis_labels={"x": ("batch", "height", "width", "channel")}
    )
    crop = RandomFixedSizeCrop(DataStream(dataset, SequentialScheme(2, 2)), (3, 3))
    with pytest.raises(AxisLabelsMismatchError):
        next(crop.get_epoch_iterator())


# --- ToBytes, floatX -------------------------------------------------------------------


def test_to_bytes() -> None:
    data = np.empty(2, dtype=object)
    data[0], data[1] = np.frombuffer(b"abc", np.uint8), np.frombuffer(b"de", np.uint8)
    examples = ToBytes(stream_of({"raw": data}))
    assert examples.axis_labels == {"raw": ("bytes",)}
    assert [v for (v,) in examples.get_epoch_iterator()] == [b"abc", b"de"]
    dataset = IndexableDataset({"raw": data}, axis_labels={"raw": ("batch", "index")})
    batches = ToBytes(DataStream(dataset, iteration_scheme=SequentialScheme(2, 2)))
    assert batches.axis_labels == {"raw": ("batch", "bytes")}
    assert next(batches.get_epoch_iterator()) == ([b"abc", b"de"],)


def test_uint8_pixels_to_floatx_recipe() -> None:
    class Pixels(IndexableDataset):
        default_transformers = uint8_pixels_to_floatX(("x",))

    stream = DataStream.default_stream(
        Pixels({"x": np.full((2, 2), 255, dtype=np.uint8)}),
        iteration_scheme=SequentialScheme(2, 2),
    )
    (x,) = next(stream.get_epoch_iterator())
    assert x.dtype == np.float32 and np.allclose(x, 1.0)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, np.float32),
        ({"FUEL_FLOATX": "float64"}, np.float64),
        ({"BATCHQ_FLOATX": "float16"}, np.float16),
        ({"BATCHQ_FLOATX": "float16", "FUEL_FLOATX": "float64"}, np.float16),
    ],
)
def test_floatx_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: type
) -> None:
    for name in ("BATCHQ_FLOATX", "FUEL_FLOATX"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    import producer.config

    assert producer.config.floatX == np.dtype(expected).name
    stream = stream_of({"x": np.ones(4, dtype=np.float64), "i": np.arange(4)}, 2)
    x, i = next(ForceFloatX(stream).get_epoch_iterator())
    assert x.dtype == expected and i.dtype == np.int64
    (cast,) = next(Cast(stream_of({"x": np.arange(4)}, 2), "floatX").get_epoch_iterator())
    assert cast.dtype == expected
    seqs = stream_of({"s": [[1, 2], [3]]}, 2)
    assert next(Padding(seqs).get_epoch_iterator())[1].dtype == expected


def test_floatx_refuses_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHQ_FLOATX", "float8")
    with pytest.raises(ValueError, match="BATCHQ_FLOATX='float8'"):
        ForceFloatX(stream_of({"x": np.ones(2)}))


def test_batch_of_list_examples_stacks_arrays() -> None:
    stream = Batch(stream_of({"x": [1, 2, 3]}), ConstantScheme(2))
    assert [b[0].tolist() for b in stream.get_epoch_iterator()] == [[1, 2], [3]]


# --- H5PYDataset -----------------------------------------------------------------------


@pytest.fixture
def vlen_file(tmp_path: Path) -> Path:
    h5py = pytest.importorskip("h5py")
    from producer.datasets.hdf5 import H5PYDataset

    path = tmp_path / "vlen.hdf5"
    shapes = [(1, 2, 3), (1, 1, 4), (1, 3, 2), (1, 2, 2), (1, 4, 1)]
    with h5py.File(path, "w") as f:
        images = f.create_dataset("images", (5,), dtype=h5py.vlen_dtype(np.dtype("uint8")))
        for i, shape in enumerate(shapes):
            images[i] = np.arange(int(np.prod(shape)), dtype=np.uint8) + i
        f["image_shapes"] = np.array(shapes, dtype=np.int64)
        f["image_shape_labels"] = [b"channel", b"height", b"width"]
        f["image_shapes"].make_scale("shapes")
        images.dims[0].attach_scale(f["image_shapes"])
        f["image_shape_labels"].make_scale("shape_labels")
        images.dims[0].attach_scale(f["image_shape_labels"])
        images.dims[0].label = "batch"
        targets = f.create_dataset("targets", data=np.arange(5, dtype=np.int64)[:, None])
        targets.dims[0].label, targets.dims[1].label = "batch", "index"
        f.attrs["split"] = H5PYDataset.create_split_array(
            {
                "train": {"images": (0, 4), "targets": (0, 4)},
                "test": {"images": (4, 5), "targets": (4, 5)},
            }
        )
    return path


def test_h5py_variable_length_sources_get_their_shapes_and_labels(vlen_file: Path) -> None:
    from producer.datasets.hdf5 import H5PYDataset

    for memory in (False, True):
        train = H5PYDataset(vlen_file, which_sets=("train",), load_in_memory=memory)
        assert train.axis_labels["images"] == ("batch", "channel", "height", "width")
        assert train.vlen_sources == ("images",)
        state = train.open()
        images, _ = train.get_data(state, [2, 0])
        assert [im.shape for im in images] == [(1, 3, 2), (1, 2, 3)]
        assert images[1].ravel().tolist() == list(range(6))
        (one, _) = train.get_data(state, 1)
        assert one.shape == (1, 1, 4)
        sliced, _ = train.get_data(state, slice(0, 2))
        assert [im.shape for im in sliced] == [(1, 2, 3), (1, 1, 4)]
        train.close(state)


def test_h5py_split_and_source_queries(vlen_file: Path) -> None:
    import h5py

    from producer.datasets.hdf5 import H5PYDataset

    with h5py.File(vlen_file, "r") as f:
        assert set(H5PYDataset.get_all_splits(f)) == {"train", "test"}
        assert set(H5PYDataset.get_all_sources(f)) == {"images", "targets"}
        assert set(H5PYDataset.get_provided_sources(f, "test")) == {"images", "targets"}
        assert H5PYDataset.get_vlen_sources(f) == ("images",)
        assert H5PYDataset.get_axis_labels(f)["targets"] == ("batch", "index")


def test_h5py_data_sources_pickling_and_subset_lists(vlen_file: Path) -> None:
    import h5py

    from producer.datasets.hdf5 import H5PYDataset

    memory = H5PYDataset(vlen_file, ("train",), load_in_memory=True, sources=("targets",))
    (data,) = memory.data_sources
    assert isinstance(data, np.ndarray) and data.ravel().tolist() == [0, 1, 2, 3]
    assert H5PYDataset(vlen_file, ("train",)).data_sources is None
    copy = pickle.loads(pickle.dumps(memory))
    assert copy.data_sources[0].ravel().tolist() == [0, 1, 2, 3]
    with h5py.File(vlen_file, "r") as handle:  # an open file: the copy reopens the path
        from_handle = H5PYDataset(handle, ("train",), sources=("targets",))
        blob = pickle.dumps(from_handle)
    reopened = pickle.loads(blob)
    assert reopened.get_data(None, [3])[0].ravel().tolist() == [3]
    # Fuel reads a list subset as a sorted set of indices.
    subset = H5PYDataset(vlen_file, ("train",), subset=[0, 3, 2, 3], sources=("targets",))
    assert subset.num_examples == 3
    assert subset.get_data(None, slice(0, 3))[0].ravel().tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match="step of 1"):
        H5PYDataset(vlen_file, ("train",), subset=slice(0, 4, 2))


# --- PytablesDataset -------------------------------------------------------------------


def test_pytables_dataset(tmp_path: Path) -> None:
    tables = pytest.importorskip("tables")
    from producer.datasets.hdf5 import PytablesDataset

    path = tmp_path / "data.h5"
    with tables.open_file(str(path), mode="w") as f:
        group = f.create_group("/", "Data")
        f.create_array(group, "features", np.arange(20).reshape(10, 2))
        f.create_array(group, "labels", np.arange(10) * 10)
    dataset = PytablesDataset(path, ("features", "targets"), start=2, stop=8,
                              sources_in_file=("features", "labels"))  # fmt: skip
    assert dataset.num_examples == 6 and dataset.sources == ("features", "targets")
    features, targets = dataset.get_data(None, slice(0, 2))
    assert features.tolist() == [[4, 5], [6, 7]] and targets.tolist() == [20, 30]
    state = dataset.open()
    assert dataset.get_data(state, [5, 0])[1].tolist() == [70, 20]
    assert dataset.get_data(state, [5, 0, 5])[0].tolist() == [[14, 15], [4, 5], [14, 15]]
    dataset.close(state)
    stream = DataStream(dataset, iteration_scheme=SequentialScheme(6, 4))
    assert [len(b[1]) for b in stream.get_epoch_iterator()] == [4, 2]
    stream.close()  # the stream's state is an open file
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy.get_data(None, [1])[1].tolist() == [30]
    with pytest.raises(IndexError):
        dataset.get_data(None, [6])
    assert len(copy.nodes) == 2
    for opened in (dataset, copy):
        opened.close_file()  # Fuel's method: the file the dataset reads through


def test_h5py_index_list_splits(tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    from producer.datasets.hdf5 import H5PYDataset

    path = tmp_path / "lists.hdf5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(10) * 10)
        f["odd"] = np.array([9, 1, 5, 3, 7])  # read as Fuel reads it: a sorted set
        f["even"] = np.arange(0, 10, 2)
        f.attrs["split"] = H5PYDataset.create_split_array(
            {"odd": {"x": (-1, -1, f["odd"].ref)}, "even": {"x": (-1, -1, f["even"].ref)}}
        )
    odd = H5PYDataset(path, ("odd",))
    assert odd.num_examples == 5
    assert odd.get_data(None, slice(0, 5))[0].tolist() == [10, 30, 50, 70, 90]
    both = H5PYDataset(path, ("even", "odd"), subset=slice(3, 7))
    assert both.get_data(None, [0, 3, 1])[0].tolist() == [60, 30, 80]
    with pytest.raises(ValueError, match="indices="):
        H5PYDataset.create_split_array({"a": {"x": (0, 1, [1, 2])}})


def test_a_stream_over_an_h5py_dataset_pickles(vlen_file: Path) -> None:
    from producer.datasets.hdf5 import H5PYDataset

    stream = DataStream(
        H5PYDataset(vlen_file, ("train",), sources=("targets",)), SequentialScheme(4, 2)
    )
    first = [b[0].ravel().tolist() for b in stream.get_epoch_iterator()]
    copy = pickle.loads(pickle.dumps(stream))  # the state, an open file, pickles as a path
    assert [b[0].ravel().tolist() for b in copy.get_epoch_iterator()] == first == [[0, 1], [2, 3]]
    stream.close()
    copy.close()


def test_shuffled_schemes_expose_rng_as_fuel() -> None:
    given = np.random.RandomState(3)
    assert ShuffledScheme(5, 2, rng=given).rng is given
    assert ShuffledScheme(5, 2).rng is not None  # as Fuel's default
