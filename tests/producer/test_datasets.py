"""Tests of producer.datasets: Fuel's datasets, request checks, .npy and HDF5 files."""

from __future__ import annotations

import logging
import math
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.datasets import (
    Dataset,
    H5PYDataset,
    IndexableDataset,
    IterableDataset,
    NpyDataset,
    normalize_request,
)
from producer.errors import (
    ConfigError,
    InvalidRequestError,
    MissingDependencyError,
    RequestError,
    SourceError,
)
from producer.schemes import SequentialExampleScheme
from producer.streams import DataStream
from producer.transformers import ScaleAndShift


def fuel_overview_dataset() -> tuple[IndexableDataset, np.ndarray, np.ndarray]:
    """The dataset of Fuel's overview documentation."""
    rng = np.random.RandomState(1234)
    features = rng.randint(256, size=(8, 2, 2))
    targets = rng.randint(4, size=(8, 1))
    dataset = IndexableDataset(
        indexables=OrderedDict([("features", features), ("targets", targets)]),
        axis_labels=OrderedDict(
            [("features", ("batch", "height", "width")), ("targets", ("batch", "index"))]
        ),
    )
    return dataset, features, targets


# --- IndexableDataset ----------------------------------------------------------------


def test_fuel_overview_indexable_dataset() -> None:
    dataset, _, _ = fuel_overview_dataset()
    assert dataset.sources == ("features", "targets")
    assert dataset.provides_sources == ("features", "targets")
    assert dataset.axis_labels == {
        "features": ("batch", "height", "width"),
        "targets": ("batch", "index"),
    }
    assert dataset.num_examples == 8
    state = dataset.open()
    features, targets = dataset.get_data(state=state, request=[0, 1])
    assert features.tolist() == [[[47, 211], [38, 53]], [[204, 116], [152, 249]]]
    assert targets.tolist() == [[0], [3]]
    dataset.close(state=state)


def test_indexable_dataset_requests() -> None:
    dataset, features, targets = fuel_overview_dataset()
    f, t = dataset.get_data(request=slice(2, 5))
    assert np.array_equal(f, features[2:5]) and np.array_equal(t, targets[2:5])
    f, t = dataset.get_data(request=[6, 1, 6])
    assert np.array_equal(f, features[[6, 1, 6]])
    f, t = dataset.get_data(request=3)
    assert np.array_equal(f, features[3]) and f.shape == (2, 2)
    f, t = dataset.get_data(request=np.array([], dtype=int))
    assert f.shape == (0, 2, 2)
    assert isinstance(dataset.example_iteration_scheme, SequentialExampleScheme)
    assert np.array_equal(dataset.features, features)


def test_sources_subset_in_the_given_order() -> None:
    data = OrderedDict([("a", np.arange(4)), ("b", np.arange(4) * 10), ("c", np.ones(4))])
    dataset = IndexableDataset(data, sources=("c", "a"))
    assert dataset.sources == ("c", "a")
    c, a = dataset.get_data(request=[1])
    assert a.tolist() == [1] and c.tolist() == [1.0]
    with pytest.raises(AttributeError):
        _ = dataset.b
    with pytest.raises(SourceError, match=r"\['nope'\].*\['a', 'b', 'c'\]") as info:
        IndexableDataset(data, sources=("a", "nope"))
    assert isinstance(info.value, ValueError) and isinstance(info.value, KeyError)
    with pytest.raises(ConfigError, match="empty"):
        IndexableDataset(data, sources=())


def test_list_sources_stay_lists_as_in_fuel() -> None:
    dataset = IndexableDataset({"features": [[0] * 128] * 1000})
    (batch,) = dataset.get_data(request=list(range(100)))
    assert isinstance(batch, list) and len(batch) == 100 and batch[0] == [0] * 128
    (single,) = IndexableDataset([5, 6, 7]).get_data(request=[2, 0])
    assert single == [7, 5]
    assert IndexableDataset([5, 6, 7]).get_data(request=slice(1, 3)) == ([6, 7],)
    assert IndexableDataset([5, 6]).sources == ("data",)
    ragged = IndexableDataset({"seq": [[1], [2, 3], []]})
    (seqs,) = ragged.get_data(request=[1, 2])
    assert seqs == [[2, 3], []]
    (arrays,) = IndexableDataset({"x": np.arange(4)}).get_data(request=[3, 1])
    assert isinstance(arrays, np.ndarray) and arrays.tolist() == [3, 1]


def test_start_and_stop() -> None:
    dataset = IndexableDataset({"x": np.arange(10), "y": list(range(10, 20))}, start=2, stop=6)
    assert dataset.num_examples == 4
    x, y = dataset.get_data(request=[0, 3])
    assert x.tolist() == [2, 5] and y == [12, 15]  # the list source stays a list
    with pytest.raises(RequestError, match="index 4 is outside the dataset of 4 examples"):
        dataset.get_data(request=[4])


def test_sources_of_different_lengths() -> None:
    with pytest.raises(ConfigError, match=r"different lengths.*'a': 3.*'b': 2"):
        IndexableDataset({"a": [1, 2, 3], "b": [1, 2]})


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        ([0, 8], "index 8 is outside the dataset of 8 examples"),
        ([-1], "index -1 is outside"),
        (9, "index 9 is outside the dataset of 8 examples"),
        (slice(0, 12), "reaches index 12, outside the dataset of 8 examples"),
    ],
)
def test_requests_outside_the_dataset(request_: Any, match: str) -> None:
    dataset, _, _ = fuel_overview_dataset()
    with pytest.raises(RequestError, match=match) as info:
        dataset.get_data(request=request_)
    assert isinstance(info.value, IndexError)


@pytest.mark.parametrize("request_", [None, [0.5], [[0, 1]], slice(3, 0, -1), "ab"])
def test_malformed_requests(request_: Any) -> None:
    dataset, _, _ = fuel_overview_dataset()
    with pytest.raises(InvalidRequestError):
        dataset.get_data(request=request_)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 50), data=st.data())
def test_normalize_request_accepts_exactly_the_indices_inside(n: int, data: st.DataObject) -> None:
    indices = data.draw(st.lists(st.integers(-5, n + 5), max_size=10))
    if all(0 <= i < n for i in indices):
        assert np.asarray(normalize_request(indices, n)).tolist() == indices
    else:
        with pytest.raises(RequestError):
            normalize_request(indices, n)


# --- IterableDataset -----------------------------------------------------------------


def test_iterable_dataset_restarts_every_epoch() -> None:
    dataset = IterableDataset(OrderedDict([("x", [1, 2, 3]), ("y", "abc")]))
    assert dataset.sources == ("x", "y") and dataset.num_examples == 3
    assert dataset.example_iteration_scheme is None
    stream = DataStream(dataset)
    for _ in range(3):
        assert list(stream.get_epoch_iterator()) == [(1, "a"), (2, "b"), (3, "c")]
    state = dataset.open()
    assert dataset.get_data(state) == (1, "a")
    with pytest.raises(InvalidRequestError, match="takes no request"):
        dataset.get_data(state, request=[0])
    with pytest.raises(InvalidRequestError, match="state"):
        dataset.get_data(None)
    assert IterableDataset(range(4)).sources == ("data",)


def test_iterable_dataset_checks() -> None:
    with pytest.raises(ConfigError, match="different lengths"):
        IterableDataset({"a": [1, 2], "b": [1]})
    with pytest.raises(ConfigError, match="'a' is not iterable"):
        IterableDataset({"a": 5})
    assert math.isnan(IterableDataset({"a": (i for i in range(3))}).num_examples)


def test_iterable_dataset_warns_about_iterators(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="producer.datasets"):
        IterableDataset({"a": iter([1, 2])})
    assert "empty after one epoch" in caplog.text


# --- Dataset base --------------------------------------------------------------------


class Pairs(Dataset):
    provides_sources = ("features", "targets")
    default_transformers = ((ScaleAndShift, [2, 1], {"which_sources": ("features",)}),)

    def get_data(self, state: Any = None, request: Any = None) -> tuple[Any, ...]:
        return self.filter_sources((np.array([request]), np.array([-request])))


def test_dataset_base_class() -> None:
    dataset = Pairs(sources=("targets",))
    assert dataset.get_data(request=3)[0].tolist() == [-3]
    with pytest.raises(AttributeError, match="example scheme"):
        _ = dataset.example_iteration_scheme
    stream = DataStream.default_stream(Pairs(), iteration_scheme=SequentialExampleScheme(2))
    assert isinstance(stream, ScaleAndShift)
    assert [tuple(v.tolist() for v in d) for d in stream.get_epoch_iterator()] == [
        ([1], [0]),
        ([3], [-1]),
    ]

    class NoSources(Dataset):
        pass

    with pytest.raises(ConfigError, match="provides_sources"):
        NoSources()


def test_get_example_stream() -> None:
    dataset = IndexableDataset({"x": np.arange(3)})
    assert [int(x) for (x,) in dataset.get_example_stream().get_epoch_iterator()] == [0, 1, 2]


# --- NpyDataset ----------------------------------------------------------------------


def test_npy_dataset_reads_rows_in_request_order(tmp_path: Path) -> None:
    features = np.arange(60, dtype=np.float32).reshape(20, 3)
    targets = np.arange(20, dtype=np.int64) * 2
    np.save(tmp_path / "f.npy", features)
    np.save(tmp_path / "t.npy", targets)
    files = {"features": tmp_path / "f.npy", "targets": str(tmp_path / "t.npy")}
    dataset = NpyDataset(files)
    assert dataset.sources == ("features", "targets") and dataset.num_examples == 20
    f, t = dataset.get_data(request=[7, 2, 7, 19])
    assert np.array_equal(f, features[[7, 2, 7, 19]]) and t.tolist() == [14, 4, 14, 38]
    assert type(f) is np.ndarray and f.flags.writeable
    f, t = dataset.get_data(request=slice(3, 6))
    assert np.array_equal(f, features[3:6]) and type(f) is np.ndarray
    f, t = dataset.get_data(request=4)
    assert np.array_equal(f, features[4]) and int(t) == 8
    with pytest.raises(RequestError, match="index 20 is outside the dataset of 20"):
        dataset.get_data(request=[20])
    window = NpyDataset(files, start=5, stop=9, sources=("targets",))
    assert window.num_examples == 4
    assert window.get_data(request=[3, 0])[0].tolist() == [16, 10]
    assert window.get_data(request=slice(1, 3))[0].tolist() == [12, 14]


def test_npy_dataset_checks(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.zeros(3))
    np.save(tmp_path / "b.npy", np.zeros(4))
    np.save(tmp_path / "s.npy", np.float64(1.0))
    with pytest.raises(ConfigError, match="different lengths"):
        NpyDataset({"a": tmp_path / "a.npy", "b": tmp_path / "b.npy"})
    with pytest.raises(ConfigError, match="0-d array"):
        NpyDataset({"s": tmp_path / "s.npy"})


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_npy_dataset_reads_only_the_requested_rows_of_a_2gb_file(tmp_path: Path) -> None:
    rows, width = 2**19, 1024  # float32: 2 GiB of data
    path = tmp_path / "big.npy"
    with path.open("wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<f4", "fortran_order": False, "shape": (rows, width)}
        )
        header = f.tell()
        f.truncate(header + rows * width * 4)  # sparse: nothing written
    marked = np.lib.format.open_memmap(path, mode="r+")
    marked[[5, 400_000, 77]] = np.array([[1.0], [2.0], [3.0]], dtype=np.float32)
    marked.flush()
    del marked
    before = _rss_bytes()
    dataset = NpyDataset({"x": path})
    (batch,) = dataset.get_data(request=[400_000, 5, 123_456, 77])
    grown = _rss_bytes() - before
    assert batch.shape == (4, width)
    assert batch[:, 0].tolist() == [2.0, 1.0, 0.0, 3.0]
    assert grown < 64 * 2**20, f"RSS grew by {grown} bytes reading 4 rows of a 2 GiB file"


# --- H5PYDataset ---------------------------------------------------------------------


def test_h5py_dataset_without_h5py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "h5py", None)  # makes `import h5py` fail
    with pytest.raises(MissingDependencyError, match="pip install h5py") as info:
        H5PYDataset("data.hdf5", which_sets=("train",))
    assert isinstance(info.value, ImportError)


@pytest.fixture
def hdf5_file(tmp_path: Path) -> Path:
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "data.hdf5"
    with h5py.File(path, "w") as f:
        features = f.create_dataset("features", data=np.arange(20).reshape(10, 2))
        f.create_dataset("targets", data=np.arange(10) * 10)
        features.dims[0].label = "batch"
        features.dims[1].label = "feature"
        f.attrs["split"] = H5PYDataset.create_split_array(
            {
                "train": {"features": (0, 6), "targets": (0, 6)},
                "valid": {"features": (6, 8), "targets": (6, 8)},
                "test": {"features": (8, 10)},
            }
        )
    return path


def test_h5py_dataset_splits_and_requests(hdf5_file: Path) -> None:
    train = H5PYDataset(hdf5_file, which_sets=("train",))
    assert train.sources == ("features", "targets") and train.num_examples == 6
    state = train.open()
    f, t = train.get_data(state, request=[4, 1, 4])
    assert f.tolist() == [[8, 9], [2, 3], [8, 9]] and t.tolist() == [40, 10, 40]
    f, t = train.get_data(state, request=slice(1, 3))
    assert t.tolist() == [10, 20]
    train.close(state)
    both = H5PYDataset(str(hdf5_file), which_sets=("valid", "train"), subset=slice(1, 4))
    assert both.get_data(request=[0, 1, 2])[1].tolist() == [70, 0, 10]
    test = H5PYDataset(hdf5_file, which_sets=("test",))
    assert test.sources == ("features",)
    assert test.axis_labels is None or test.axis_labels["features"] == ("batch", "feature")
    stream = DataStream(test, iteration_scheme=SequentialExampleScheme(2))
    assert [f.tolist() for (f,) in stream.get_epoch_iterator()] == [[16, 17], [18, 19]]


def test_h5py_dataset_in_memory_and_errors(hdf5_file: Path) -> None:
    memory = H5PYDataset(hdf5_file, ("valid",), load_in_memory=True, sources=("targets",))
    assert memory.open() is None
    assert memory.get_data(request=[1, 0])[0].tolist() == [70, 60]
    with pytest.raises(ConfigError, match="string"):
        H5PYDataset(hdf5_file, which_sets="train")
    with pytest.raises(ConfigError, match="no splits \\['nope'\\]"):
        H5PYDataset(hdf5_file, which_sets=("nope",))
    with pytest.raises(SourceError, match="targets"):
        H5PYDataset(hdf5_file, which_sets=("test",), sources=("targets",))
    with pytest.raises(RequestError):
        memory.get_data(request=[2])
