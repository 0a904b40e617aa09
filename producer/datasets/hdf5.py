"""Fuel's module path ``fuel.datasets.hdf5``: ``H5PYDataset``, Fuel's HDF5 dataset format read
with h5py (an optional extra), and ``PytablesDataset`` (re-exported from its module).

The file layout is Fuel's: one HDF5 dataset per source, and a ``split`` attribute on the
file, a structured array with one row per (split, source) (:mod:`producer.datasets.hdf5_split`
builds and reads it): splits are ranges of rows, or index lists. Variable-length
sources (one axis of vlen elements, with ``shapes`` and ``shape_labels`` dimension
scales on that axis, as Fuel's converters write them) are reshaped to their stored
shapes, and labelled from ``shape_labels``. h5py is imported when first needed, so the
rest of batchq works without it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from producer.datasets.base import Dataset, normalize_request
from producer.datasets.hdf5_split import (
    check_subset,
    h5py_module,
    read_splits,
    select_rows,
    split_array,
    text,
)
from producer.datasets.pytables import PytablesDataset
from producer.errors import ConfigError, ShapeError
from producer.schemes import SequentialExampleScheme

__all__ = ["H5PYDataset", "PytablesDataset"]

log = logging.getLogger(__name__)


def _rows_of(rows: range | np.ndarray, request: Any) -> range | np.ndarray | int:
    """The file rows of the examples ``request`` (normalized) names."""
    if isinstance(rows, range) and isinstance(request, np.ndarray):
        return rows.start + request * rows.step
    selected = rows[request]
    return int(selected) if np.ndim(selected) == 0 and not isinstance(selected, range) else selected


class _FileHandle:
    """An h5py file opened on first use; pickles as its path, so streams pickle."""

    def __init__(self, path: str, driver: str | None, external: Any = None) -> None:
        self.path = path
        self.driver = driver
        self._external = external
        self._file: Any = None

    def _handle(self) -> Any:
        if self._external is not None:
            return self._external
        if self._file is None:
            self._file = h5py_module().File(self.path, mode="r", driver=self.driver)
        return self._file

    def __getitem__(self, name: str) -> Any:
        return self._handle()[name]

    def close(self) -> None:
        """Close the file if this handle opened it (a caller's open file stays open)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "driver": self.driver, "_external": None, "_file": None}


class H5PYDataset(Dataset):
    """A dataset stored in an HDF5 file in Fuel's format.

    Args:
        file_or_path: a path, or an open ``h5py.File`` (which the dataset does not close).
        which_sets: the names of the splits to read, e.g. ``('train',)``; their examples
            are concatenated in this order.
        subset: which examples of those splits: a slice (step 1), or a list of
            indices read as Fuel reads it (as a sorted set: ``[0, 4, 2]`` gives
            examples 0, 2, 4). Default: all.
        load_in_memory: read all the selected rows into memory at construction.
        driver: the h5py driver to open the file with (e.g. ``'core'``).
        sort_indices: read list requests in sorted order (h5py requires it), then put
            the rows back in the requested order.
        **kwargs: ``sources``, ``axis_labels`` (default: the HDF5 dimension labels).

    Raises:
        MissingDependencyError: h5py is not installed.
        ConfigError: ``which_sets`` is a string, or the file has no such split.
        SourceError: a requested source is not available in every split.
    """

    def __init__(
        self,
        file_or_path: Any,
        which_sets: Sequence[str],
        subset: slice | Sequence[int] | None = None,
        load_in_memory: bool = False,
        driver: str | None = None,
        sort_indices: bool = True,
        **kwargs: Any,
    ) -> None:
        h5py = h5py_module()
        if isinstance(which_sets, str) or not all(isinstance(w, str) for w in which_sets):
            raise ConfigError(
                f"which_sets={which_sets!r} is not valid: expected an iterable of split "
                "names (strings), e.g. ('train',)"
            )
        self.which_sets = tuple(which_sets)
        self.driver = driver
        self.sort_indices = sort_indices
        self.load_in_memory = load_in_memory
        self.subset = check_subset(subset)
        self._external = isinstance(file_or_path, h5py.File)
        self.path = file_or_path.filename if self._external else os.fspath(file_or_path)
        self._file = file_or_path if self._external else None
        self._requested_sources = kwargs.pop("sources", None)
        self._given_labels = kwargs.pop("axis_labels", None)
        if kwargs:
            raise ConfigError(f"H5PYDataset got unexpected arguments {sorted(kwargs)}")
        self._load()

    def _load(self) -> None:
        """Read the split table, the rows of each source and (if asked) the data."""
        handle = self._open_file()
        try:
            ranges = read_splits(handle, self.path, self.which_sets)
            self.provides_sources = tuple(ranges)
            super().__init__(sources=self._requested_sources, axis_labels=self._given_labels)
            if self.axis_labels is None:
                self.axis_labels = self._dimension_labels(handle)
            self.vlen_sources = tuple(
                s for s in self.get_vlen_sources(handle) if s in self.provides_sources
            )
            self._rows = {s: select_rows(ranges[s], self.subset) for s in self.sources}
            lengths = {s: len(r) for s, r in self._rows.items()}
            if len(set(lengths.values())) != 1:
                raise ConfigError(
                    f"the sources have different lengths in {self.which_sets}: {lengths}"
                )
            self._num_examples = next(iter(lengths.values()))
            self._data = (
                [self._read_source(handle, s, np.asarray(self._rows[s])) for s in self.sources]
                if self.load_in_memory
                else None
            )
        finally:
            if not self._external:
                handle.close()
        self.example_iteration_scheme = SequentialExampleScheme(self._num_examples)

    def __getstate__(self) -> dict[str, Any]:
        # As Fuel's: neither the file handle nor the in-memory data is pickled; the
        # copy reopens the file by its path (and reloads the data) when unpickled.
        state = dict(self.__dict__)
        state["_file"] = None
        state["_external"] = False
        state["_data"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.load_in_memory:
            self._load()

    @property
    def data_sources(self) -> tuple[Any, ...] | None:
        """The in-memory data, one array per source (None unless ``load_in_memory``)."""
        return None if self._data is None else tuple(self._data)

    @staticmethod
    def get_all_splits(h5file: Any) -> tuple[str, ...]:
        """The names of all the splits of a Fuel HDF5 file (an open ``h5py.File``)."""
        return tuple(dict.fromkeys(text(row["split"]) for row in h5file.attrs["split"]))

    @staticmethod
    def get_all_sources(h5file: Any) -> tuple[str, ...]:
        """The names of all the sources of a Fuel HDF5 file (an open ``h5py.File``)."""
        return tuple(dict.fromkeys(text(row["source"]) for row in h5file.attrs["split"]))

    @staticmethod
    def get_provided_sources(h5file: Any, split: str) -> tuple[str, ...]:
        """The sources available in ``split``."""
        return tuple(
            text(row["source"])
            for row in h5file.attrs["split"]
            if text(row["split"]) == split and bool(row["available"])
        )

    @staticmethod
    def get_vlen_sources(h5file: Any) -> tuple[str, ...]:
        """The variable-length sources: one axis, with a ``shapes`` dimension scale.

        Raises:
            ShapeError: (a ``ValueError``) such a source has more than one axis.
        """
        found = []
        for source in H5PYDataset.get_all_sources(h5file):
            dims = h5file[source].dims
            if len(dims) > 0 and "shapes" in dims[0]:
                if len(dims) > 1:
                    raise ShapeError(
                        f"variable-length source {source!r} has {len(dims)} axes: expected one"
                    )
                found.append(source)
        return tuple(found)

    @staticmethod
    def get_axis_labels(h5file: Any) -> dict[str, tuple[str, ...]]:
        """The axis labels of every source; a variable-length one's come from its
        ``shape_labels`` dimension scale, after the first axis's label."""
        vlen = H5PYDataset.get_vlen_sources(h5file)
        labels = {}
        for source in H5PYDataset.get_all_sources(h5file):
            dims = h5file[source].dims
            if source in vlen:
                shape_labels = tuple(text(x) for x in dims[0]["shape_labels"][()])
                labels[source] = (text(dims[0].label), *shape_labels)
            else:
                labels[source] = tuple(text(d.label) for d in dims)
        return labels

    @staticmethod
    def create_split_array(split_dict: Mapping[str, Mapping[str, Sequence[Any]]]) -> np.ndarray:
        """Build the ``split`` attribute for a file, as Fuel's function of the same name.

        Args:
            split_dict: ``{split: {source: (start, stop[, indices][, comment])}}``;
                ``indices``, when given, is an ``h5py.Reference`` to a dataset of row
                indices (an index-list split; ``start``/``stop`` are then ignored).

        Returns:
            The structured array to store as ``h5file.attrs['split']``.
        """
        return split_array(split_dict)

    def _open_file(self) -> Any:
        if self._external:
            return self._file
        return h5py_module().File(self.path, mode="r", driver=self.driver)

    def _dimension_labels(self, handle: Any) -> dict[str, Any] | None:
        labels = {s: v for s, v in self.get_axis_labels(handle).items() if s in self.sources}
        return labels if all(all(v) for v in labels.values()) else None

    def _read_source(self, handle: Any, source: str, rows: range | np.ndarray | int) -> Any:
        """Read ``rows`` of ``source``; variable-length examples get their stored shapes."""
        data = self._read(handle[source], rows)
        if source not in self.vlen_sources:
            return data
        shapes = self._read(handle[source].dims[0]["shapes"], rows)
        if isinstance(rows, int):
            return np.asarray(data).reshape(tuple(int(x) for x in shapes))
        out = np.empty(len(data), dtype=object)
        for i, (example, shape) in enumerate(zip(data, shapes, strict=True)):
            out[i] = np.asarray(example).reshape(tuple(int(x) for x in shape))
        return out

    def _read(self, dataset: Any, rows: range | np.ndarray | int) -> np.ndarray:
        if isinstance(rows, int):
            return np.asarray(dataset[rows])
        if isinstance(rows, range):
            return np.asarray(dataset[rows.start : rows.stop : rows.step])
        if rows.size == 0:
            return np.empty((0, *dataset.shape[1:]), dtype=dataset.dtype)
        if not self.sort_indices:
            return np.asarray(dataset[rows])
        unique, inverse = np.unique(rows, return_inverse=True)
        return np.asarray(dataset[unique])[inverse]

    @property
    def num_examples(self) -> int:
        """The number of examples in the selected splits and subset."""
        return self._num_examples

    def open(self) -> Any:
        """The stream's state: a handle on the file (None when the data is in memory).

        The handle pickles as the file's path (a stream over this dataset pickles, as
        Fuel's does) and reopens the file when next read.
        """
        if self._data is not None:
            return None
        return _FileHandle(self.path, self.driver, self._file if self._external else None)

    def close(self, state: Any) -> None:
        """Close the file handle ``state`` (unless the caller passed an open file)."""
        if state is not None:
            state.close()

    def get_data(self, state: Any = None, request: Any = None) -> tuple[Any, ...]:
        """Read the examples ``request`` names, one array per source.

        Raises:
            InvalidRequestError: ``request`` is None or malformed.
            RequestError: it names an example outside the dataset.
        """
        request = normalize_request(request, self.num_examples)
        if self._data is not None:
            return tuple(data[request] for data in self._data)
        handle = state if state is not None else self.open()
        try:
            out = []
            for source in self.sources:
                out.append(self._read_source(handle, source, _rows_of(self._rows[source], request)))
            return tuple(out)
        finally:
            if state is None:
                self.close(handle)
