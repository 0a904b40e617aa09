"""``H5PYDataset``: Fuel's HDF5 dataset format, read with h5py (an optional extra).

The file layout is Fuel's: one HDF5 dataset per source, and a ``split`` attribute on the
file, a structured array with one row per (split, source) and the fields ``split``,
``source``, ``start``, ``stop``, ``indices``, ``available`` and ``comment``. Splits are
ranges ``[start, stop)`` of rows; index-list splits (``indices`` references) are not
supported. h5py is imported when first needed, so the rest of batchq works without it.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from producer.datasets import Dataset, normalize_request
from producer.errors import ConfigError, MissingDependencyError, SourceError
from producer.schemes import SequentialExampleScheme

__all__ = ["H5PYDataset"]

log = logging.getLogger(__name__)


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as e:
        raise MissingDependencyError(
            "H5PYDataset needs the h5py package, which is not installed: pip install h5py"
        ) from e
    return h5py


def _rows_of(rows: range | np.ndarray, request: Any) -> range | np.ndarray | int:
    """The file rows of the examples ``request`` (normalized) names."""
    if isinstance(rows, range) and isinstance(request, np.ndarray):
        return rows.start + request * rows.step
    selected = rows[request]
    return int(selected) if np.ndim(selected) == 0 and not isinstance(selected, range) else selected


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class H5PYDataset(Dataset):
    """A dataset stored in an HDF5 file in Fuel's format.

    Args:
        file_or_path: a path, or an open ``h5py.File`` (which the dataset does not close).
        which_sets: the names of the splits to read, e.g. ``('train',)``; their examples
            are concatenated in this order.
        subset: a slice or list of example indices within those splits (default: all).
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
        h5py = _h5py()
        if isinstance(which_sets, str):
            raise ConfigError(
                f"which_sets={which_sets!r} is a string: expected a tuple of split names, "
                f"e.g. ({which_sets!r},)"
            )
        self.which_sets = tuple(which_sets)
        self.driver = driver
        self.sort_indices = sort_indices
        self.load_in_memory = load_in_memory
        self._external = isinstance(file_or_path, h5py.File)
        self.path = file_or_path.filename if self._external else os.fspath(file_or_path)
        self._file = file_or_path if self._external else None
        handle = self._open_file()
        try:
            ranges = self._read_split(handle)
            self.provides_sources = tuple(ranges)
            super().__init__(sources=kwargs.pop("sources", None), **kwargs)
            if self.axis_labels is None:
                self.axis_labels = self._dimension_labels(handle)
            self._rows = {s: self._select(ranges[s], subset) for s in self.sources}
            lengths = {s: len(r) for s, r in self._rows.items()}
            if len(set(lengths.values())) != 1:
                raise ConfigError(f"the sources have different lengths in {which_sets}: {lengths}")
            self._num_examples = next(iter(lengths.values()))
            self._data = (
                [self._read(handle[s], np.asarray(self._rows[s])) for s in self.sources]
                if load_in_memory
                else None
            )
        finally:
            if not self._external:
                handle.close()
        self.example_iteration_scheme = SequentialExampleScheme(self._num_examples)

    @staticmethod
    def create_split_array(split_dict: Mapping[str, Mapping[str, Sequence[Any]]]) -> np.ndarray:
        """Build the ``split`` attribute for a file, as Fuel's function of the same name.

        Args:
            split_dict: ``{split: {source: (start, stop[, indices][, comment])}}``;
                ``indices`` must be None (index-list splits are not supported).

        Returns:
            The structured array to store as ``h5file.attrs['split']``.
        """
        h5py = _h5py()
        sources = sorted({source for split in split_dict.values() for source in split})
        rows = []
        for split, entries in split_dict.items():
            for source in sources:
                value = tuple(entries.get(source, ()))
                if len(value) > 2 and value[2] is not None and not isinstance(value[2], str):
                    raise ConfigError(
                        f"split {split!r} source {source!r}: indices are not supported"
                    )
                comment = value[-1] if len(value) > 2 and isinstance(value[-1], str) else ""
                start, stop = value[:2] if value else (0, 0)
                rows.append((split, source, start, stop, None, bool(value), comment))
        width = {
            "split": max([len(r[0]) for r in rows] + [1]),
            "source": max([len(r[1]) for r in rows] + [1]),
            "comment": max([len(r[6]) for r in rows] + [1]),
        }
        dtype = np.dtype(
            [
                ("split", "S", width["split"]),
                ("source", "S", width["source"]),
                ("start", np.int64),
                ("stop", np.int64),
                ("indices", h5py.special_dtype(ref=h5py.Reference)),
                ("available", np.bool_),
                ("comment", "S", width["comment"]),
            ]
        )
        array = np.empty(len(rows), dtype=dtype)
        for i, (split, source, start, stop, _, available, comment) in enumerate(rows):
            array[i] = (
                split.encode(),
                source.encode(),
                start,
                stop,
                None,
                available,
                comment.encode(),
            )
        return array

    def _open_file(self) -> Any:
        if self._external:
            return self._file
        return _h5py().File(self.path, mode="r", driver=self.driver)

    def _read_split(self, handle: Any) -> dict[str, list[range]]:
        if "split" not in handle.attrs:
            raise ConfigError(f"{self.path} has no 'split' attribute: not a Fuel HDF5 file")
        ranges: dict[str, dict[str, range]] = {}
        known: set[str] = set()
        for row in handle.attrs["split"]:
            split, source = _text(row["split"]), _text(row["source"])
            known.add(split)
            if split in self.which_sets and bool(row["available"]):
                if "indices" in row.dtype.names and row["indices"]:
                    raise ConfigError(f"split {split!r}: index-list splits are not supported")
                ranges.setdefault(source, {})[split] = range(int(row["start"]), int(row["stop"]))
        missing = [w for w in self.which_sets if w not in known]
        if missing:
            raise ConfigError(f"{self.path} has no splits {missing}; it has {sorted(known)}")
        # A source is provided only if every requested split has it.
        usable = [s for s, per in ranges.items() if all(w in per for w in self.which_sets)]
        if not usable:
            raise SourceError(f"no source is available in all of the splits {self.which_sets}")
        return {s: [ranges[s][w] for w in self.which_sets] for s in usable}

    @staticmethod
    def _select(spans: list[range], subset: Any) -> range | np.ndarray:
        rows: range | np.ndarray = spans[0]
        if len(spans) > 1:
            if all(a.stop == b.start for a, b in itertools.pairwise(spans)):
                rows = range(spans[0].start, spans[-1].stop)
            else:
                rows = np.concatenate([np.arange(r.start, r.stop) for r in spans])
        if subset is None:
            return rows
        if isinstance(subset, slice):
            return rows[subset]
        request = normalize_request(list(subset), len(rows))
        return np.asarray(rows)[request]

    def _dimension_labels(self, handle: Any) -> dict[str, Any] | None:
        labels = {
            s: tuple(_text(d.label) for d in handle[s].dims) for s in self.provides_sources or ()
        }
        return labels if all(all(v) for v in labels.values()) else None

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
        """Open the file (None when the data is in memory)."""
        return None if self._data is not None else self._open_file()

    def close(self, state: Any) -> None:
        """Close the file handle ``state`` (unless the caller passed an open file)."""
        if state is not None and not self._external:
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
        handle = state if state is not None else self._open_file()
        try:
            out = []
            for source in self.sources:
                out.append(self._read(handle[source], _rows_of(self._rows[source], request)))
            return tuple(out)
        finally:
            if state is None:
                self.close(handle)
