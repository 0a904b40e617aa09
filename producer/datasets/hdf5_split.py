"""Fuel's split table: the ``split`` attribute of a Fuel HDF5 file (:mod:`producer.datasets.hdf5`).

One row per (split, source), with the fields ``split``, ``source``, ``start``, ``stop``,
``indices``, ``available`` and ``comment``. A split is a range ``[start, stop)`` of rows,
or an index list (``indices``: a reference to a dataset of row indices, read as a sorted
set as Fuel reads it). This module builds the table (:func:`split_array`, Fuel's
``create_split_array``), reads which rows the requested splits give each source
(:func:`read_splits`), joins them and picks a subset (:func:`select_rows`,
:func:`check_subset`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from producer.datasets.base import normalize_request
from producer.errors import ConfigError, MissingDependencyError, SourceError

__all__ = ["check_subset", "h5py_module", "read_splits", "select_rows", "split_array", "text"]

Rows = range | np.ndarray  # the file rows of a split's (or the splits') examples
SplitRow = tuple[str, str, Any, Any, Any, bool, str]  # a row of the table, before encoding


def h5py_module() -> Any:
    """h5py, imported when first needed (an optional extra)."""
    try:
        import h5py
    except ImportError as e:
        raise MissingDependencyError(
            "H5PYDataset needs the h5py package, which is not installed: pip install h5py"
        ) from e
    return h5py


def text(value: Any) -> str:
    """A table field as text."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def check_subset(subset: Any) -> slice | list[int] | None:
    """Fuel's ``subset``: a slice with step 1, or a list of indices read as a set,
    sorted (``[0, 4, 2]`` is examples 0, 2 and 4, in that order)."""
    if subset is None or (not isinstance(subset, slice) and len(subset) == 0):
        return None
    if isinstance(subset, slice):
        return _check_slice(subset)
    indices = sorted({int(i) for i in subset})
    if indices and indices[0] < 0:
        raise ConfigError(f"subset={list(subset)!r} is not valid: it has negative indices")
    return indices


def _check_slice(subset: slice) -> slice:
    bounds = [b for b in (subset.start, subset.stop, subset.step) if b is not None]
    if any(b < 0 for b in bounds) or subset.step not in (None, 1):
        raise ConfigError(
            f"subset={subset} is not valid: expected a slice with non-negative bounds "
            "and a step of 1, or a list of indices"
        )
    return subset


def split_array(split_dict: Mapping[str, Mapping[str, Sequence[Any]]]) -> np.ndarray:
    """The ``split`` attribute for a file (see ``H5PYDataset.create_split_array``)."""
    h5py = h5py_module()
    sources = sorted({source for split in split_dict.values() for source in split})
    rows = [
        _split_row(h5py, split, source, tuple(entries.get(source, ())))
        for split, entries in split_dict.items()
        for source in sources
    ]
    array = np.empty(len(rows), dtype=_split_dtype(h5py, rows))
    for i, (split, source, start, stop, ref, available, comment) in enumerate(rows):
        array[i] = (
            split.encode(),
            source.encode(),
            start,
            stop,
            ref if ref is not None else h5py.Reference(),
            available,
            comment.encode(),
        )
    return array


def _split_row(h5py: Any, split: str, source: str, value: tuple[Any, ...]) -> SplitRow:
    """The row of ``split`` and ``source`` from ``(start, stop[, indices][, comment])``
    (empty: the source is not available in that split)."""
    ref = value[2] if len(value) > 2 and not isinstance(value[2], str) else None
    if ref is not None and not isinstance(ref, h5py.Reference):
        raise ConfigError(
            f"split {split!r} source {source!r}: indices={ref!r} is not valid: "
            "expected None or an h5py.Reference to a dataset of row indices"
        )
    comment = value[-1] if len(value) > 2 and isinstance(value[-1], str) else ""
    start, stop = value[:2] if value else (0, 0)
    return (split, source, start, stop, ref, bool(value), comment)


def _split_dtype(h5py: Any, rows: list[SplitRow]) -> np.dtype[Any]:
    """The table's dtype, its text fields as wide as the longest value."""

    def width(values: list[str]) -> int:
        return max([len(v) for v in values] + [1])

    return np.dtype(
        [
            ("split", "S", width([r[0] for r in rows])),
            ("source", "S", width([r[1] for r in rows])),
            ("start", np.int64),
            ("stop", np.int64),
            ("indices", h5py.special_dtype(ref=h5py.Reference)),
            ("available", np.bool_),
            ("comment", "S", width([r[6] for r in rows])),
        ]
    )


def read_splits(handle: Any, path: str, which_sets: tuple[str, ...]) -> dict[str, list[Rows]]:
    """Per source available in every split of ``which_sets``: each split's rows.

    Raises:
        ConfigError: the file has no split table, or not one of the splits.
        SourceError: no source is available in all of them.
    """
    if "split" not in handle.attrs:
        raise ConfigError(f"{path} has no 'split' attribute: not a Fuel HDF5 file")
    ranges, known = _available(handle, which_sets)
    missing = [w for w in which_sets if w not in known]
    if missing:
        raise ConfigError(f"{path} has no splits {missing}; it has {sorted(known)}")
    usable = _in_every_split(ranges, which_sets)
    if not usable:
        raise SourceError(f"no source is available in all of the splits {which_sets}")
    return usable


def _in_every_split(
    ranges: dict[str, dict[str, Rows]], which_sets: tuple[str, ...]
) -> dict[str, list[Rows]]:
    """The sources every split of ``which_sets`` provides (only those are provided),
    with each split's rows in that order."""
    return {
        source: [per[w] for w in which_sets]
        for source, per in ranges.items()
        if all(w in per for w in which_sets)
    }


def _available(
    handle: Any, which_sets: tuple[str, ...]
) -> tuple[dict[str, dict[str, Rows]], set[str]]:
    """Source -> split -> rows for the splits of ``which_sets`` that have the source
    available, and the names of every split in the file."""
    ranges: dict[str, dict[str, Rows]] = {}
    known: set[str] = set()
    for row in handle.attrs["split"]:
        split, source = text(row["split"]), text(row["source"])
        known.add(split)
        if split in which_sets and bool(row["available"]):
            ranges.setdefault(source, {})[split] = _split_rows(handle, row)
    return ranges, known


def _split_rows(handle: Any, row: Any) -> Rows:
    """The rows of one table row: its range, or its index list (read as Fuel reads a
    list subset: a sorted set)."""
    ref = row["indices"] if "indices" in row.dtype.names else None
    if ref:
        return np.unique(np.asarray(handle[ref][()]))
    return range(int(row["start"]), int(row["stop"]))


def select_rows(spans: list[Rows], subset: slice | list[int] | None) -> Rows:
    """The rows of the splits ``spans`` in order, then of those the ``subset``."""
    rows = _joined(spans)
    if subset is None:
        return rows
    if isinstance(subset, slice):
        if subset.stop is not None and subset.stop > len(rows):
            raise ConfigError(
                f"subset={subset} reaches past the {len(rows)} examples of the splits"
            )
        return rows[subset]
    request = normalize_request(list(subset), len(rows))
    return np.asarray(rows)[request]


def _joined(spans: list[Rows]) -> Rows:
    """Consecutive ranges as one range, anything else as one index array."""
    if len(spans) <= 1:
        return spans[0]
    ranges = [r for r in spans if isinstance(r, range)]
    if len(ranges) == len(spans) and all(a.stop == b.start for a, b in itertools.pairwise(ranges)):
        return range(ranges[0].start, ranges[-1].stop)
    return np.concatenate([np.asarray(r, dtype=np.int64) for r in spans])
