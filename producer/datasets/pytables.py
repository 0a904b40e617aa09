"""``PytablesDataset``: an HDF5 file written with PyTables (an optional extra, ``tables``).

The layout is Fuel's: the sources are nodes under ``/<data_node>`` (one row per
example); ``start``/``stop`` pick a range of rows. PyTables is imported when a file is
opened, so the rest of batchq works without it. As Fuel's, the dataset reads through a
file it keeps open (``h5file``, ``nodes``; ``close_file()`` closes it) when no state is
given; a stream's state is its own handle (:meth:`PytablesDataset.open`). Pickling
drops the open file: the copy reopens it by path when it first reads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from producer.datasets.base import Dataset, normalize_request
from producer.errors import ConfigError, MissingDependencyError, SourceError
from producer.schemes import SequentialExampleScheme

__all__ = ["PytablesDataset"]

log = logging.getLogger(__name__)


def _tables() -> Any:
    try:
        import tables
    except ImportError as e:
        raise MissingDependencyError(
            "PytablesDataset needs the tables package (PyTables), which is not installed: "
            "pip install tables (or batchq[pytables])"
        ) from e
    return tables


class PytablesDataset(Dataset):
    """A dataset stored with PyTables under one data node (Fuel's ``PytablesDataset``).

    Args:
        path: the HDF5 file.
        sources: the source names the dataset returns.
        start: the first row to use (default 0).
        stop: one past the last row (default: the first source's row count).
        data_node: the node the sources live under (default ``'Data'``).
        sources_in_file: the node names of the sources, if not ``sources``.

    Raises:
        MissingDependencyError: tables is not installed.
        SourceError: a node is missing under ``data_node``.
        ConfigError: ``sources_in_file`` has another length than ``sources``, or
            ``start``/``stop`` are outside the rows.
    """

    def __init__(
        self,
        path: Any,
        sources: Sequence[str],
        start: int = 0,
        stop: int | None = None,
        data_node: str = "Data",
        sources_in_file: Sequence[str] | None = None,
    ) -> None:
        sources = (sources,) if isinstance(sources, str) else tuple(sources)
        in_file = sources if sources_in_file is None else tuple(sources_in_file)
        if len(in_file) != len(sources):
            raise ConfigError(
                f"sources_in_file={list(in_file)} must name one node per source {list(sources)}"
            )
        self.provides_sources = sources
        super().__init__(sources)
        self.path = os.fspath(path)
        self.data_node = data_node
        self.sources_in_file = in_file
        self._h5file: Any = None
        rows = int(self.nodes[0].nrows)
        self.stop = rows if stop is None else int(stop)
        self.start = int(start)
        if not 0 <= self.start <= self.stop <= rows:
            raise ConfigError(
                f"start={start!r}, stop={stop!r} are not valid for {self.path}: expected "
                f"0 <= start <= stop <= {rows}"
            )
        self.num_examples = self.stop - self.start
        self.example_iteration_scheme = SequentialExampleScheme(self.num_examples)

    @property
    def h5file(self) -> Any:
        """The file the dataset reads when no state is given (opened on first use)."""
        if self._h5file is None:
            self._h5file = _tables().open_file(self.path, mode="r")
        return self._h5file

    @property
    def nodes(self) -> list[Any]:
        """The sources' nodes in :attr:`h5file`, in source order."""
        return self._nodes(self.h5file)

    def open_file(self, path: Any) -> None:
        """Read from ``path`` from now on (Fuel's method; the file opens on first use)."""
        self.close_file()
        self.path = os.fspath(path)

    def load(self) -> None:
        """Reopen the file (Fuel's method)."""
        self.open_file(self.path)

    def close_file(self) -> None:
        """Close :attr:`h5file` if it is open."""
        if self._h5file is not None:
            self._h5file.close()
            self._h5file = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_h5file"] = None  # a copy reopens the file by path
        return state

    def _nodes(self, handle: Any) -> list[Any]:
        tables = _tables()
        nodes = []
        for name in self.sources_in_file:
            try:
                nodes.append(handle.get_node(f"/{self.data_node.strip('/')}", name))
            except tables.NoSuchNodeError as e:
                raise SourceError(
                    f"{self.path} has no node {name!r} under /{self.data_node}"
                ) from e
        return nodes

    def open(self) -> Any:
        """Open the file for reading; the handle is the stream's state."""
        return _tables().open_file(self.path, mode="r")

    def close(self, state: Any) -> None:
        """Close the handle ``state``."""
        if state is not None:
            state.close()

    def get_data(self, state: Any = None, request: Any = None) -> tuple[Any, ...]:
        """Read the rows ``request`` (a slice or a list of indices) names.

        Raises:
            InvalidRequestError: (a ``ValueError``, as Fuel's) ``request`` is None or
                malformed.
            RequestError: it names a row outside ``[start, stop)``.
        """
        request = normalize_request(request, self.num_examples)
        nodes = self._nodes(state) if state is not None else self.nodes
        if isinstance(request, int):
            return tuple(np.asarray(node[self.start + request]) for node in nodes)
        if isinstance(request, slice):
            rows = range(self.num_examples)[request]
            window = slice(self.start + rows.start, self.start + rows.stop, rows.step)
            return tuple(np.asarray(node[window]) for node in nodes)
        return self._read_rows(nodes, request)

    def _read_rows(self, nodes: Sequence[Any], request: np.ndarray) -> tuple[Any, ...]:
        """Read a list of rows: the distinct rows once, in file order, then put back
        in the requested order."""
        unique, inverse = np.unique(request, return_inverse=True)
        if not unique.size:
            return tuple(np.empty((0, *node.shape[1:]), node.dtype) for node in nodes)
        low, high = int(unique[0]) + self.start, int(unique[-1]) + self.start + 1
        if high - low <= 4 * unique.size:
            # One read of the covering rows: cheaper than one read per row.
            return tuple(np.asarray(node[low:high])[unique + self.start - low][inverse]
                         for node in nodes)  # fmt: skip
        return tuple(
            np.stack([np.asarray(node[int(r) + self.start]) for r in unique])[inverse]
            for node in nodes
        )
