"""Datasets: where the data lives and how a request reads it (``fuel.datasets.base``).

A dataset is stateless apart from the optional state object that :meth:`Dataset.open`
returns and the stream threads through ``get_data(state, request)``. Requests are what
the iteration schemes of :mod:`producer.schemes` produce: an example index (int), a
list of indices, or a slice.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from producer.errors import ConfigError, InvalidRequestError, RequestError, SourceError
from producer.schemes import SequentialExampleScheme

__all__ = [
    "Dataset",
    "IndexableDataset",
    "IterableDataset",
    "NpyDataset",
    "normalize_request",
]

log = logging.getLogger(__name__)

Request = int | slice | np.ndarray


def normalize_request(request: Any, num_examples: int) -> Request:
    """Check an indexing request against the dataset size and normalize it.

    Indices must lie in ``[0, num_examples)``; negative indices are rejected (a request
    that silently wraps around would hide a bug in a scheme). Slices must have bounds in
    ``[0, num_examples]`` (or None) and a positive step.

    Args:
        request: an int, a slice, or a 1-d sequence of ints.
        num_examples: the dataset's size.

    Returns:
        The int, the slice, or a 1-d ``np.intp`` array.

    Raises:
        InvalidRequestError: the request is None or has the wrong type or dtype.
        RequestError: it names an example outside the dataset.
    """
    if request is None:
        raise InvalidRequestError("this dataset needs a request (indices or a slice), got None")
    if isinstance(request, slice):
        return _checked_slice(request, num_examples)
    if isinstance(request, numbers.Integral) and not isinstance(request, bool):
        if not 0 <= int(request) < num_examples:
            raise RequestError(
                f"index {request} is outside the dataset of {num_examples} examples "
                f"({_valid(num_examples)})"
            )
        return int(request)
    return _checked_indices(request, num_examples)


def _valid(num_examples: int) -> str:
    return f"valid indices are 0 to {num_examples - 1}" if num_examples else "it is empty"


def _checked_slice(request: slice, num_examples: int) -> slice:
    """A slice request: a positive step, bounds in ``[0, num_examples]`` or None."""
    if request.step is not None and request.step <= 0:
        raise InvalidRequestError(f"slice request {request} must have a positive step")
    for bound in (request.start, request.stop):
        if bound is not None and not 0 <= bound <= num_examples:
            raise RequestError(
                f"slice request {request} reaches index {bound}, outside the dataset "
                f"of {num_examples} examples (slice bounds must be 0 to {num_examples})"
            )
    return request


def _checked_indices(request: Any, num_examples: int) -> np.ndarray:
    """A list request: a 1-d sequence of ints in ``[0, num_examples)``, as np.intp."""
    indices = np.asarray(request)
    if indices.ndim != 1 or (indices.size and indices.dtype.kind not in "iu"):
        raise InvalidRequestError(
            f"request {request!r} is not valid: expected an int, a slice or a 1-d sequence "
            f"of ints (got dtype {indices.dtype}, shape {indices.shape})"
        )
    outside = indices[(indices < 0) | (indices >= num_examples)]
    if outside.size:
        raise RequestError(
            f"index {int(outside[0])} is outside the dataset of {num_examples} examples "
            f"({_valid(num_examples)}; {outside.size} of the {indices.size} requested "
            "indices are outside)"
        )
    return indices.astype(np.intp, copy=False)


def _take(indexable: Any, request: Request) -> Any:
    """Index ``indexable`` as Fuel does: arrays by fancy indexing, anything else (a
    list stays a list) one example at a time."""
    if isinstance(indexable, np.ndarray) or not isinstance(request, np.ndarray):
        return indexable[request]
    return [indexable[int(i)] for i in request]


class Dataset:
    """Base of all datasets.

    Subclasses set ``provides_sources`` (before calling ``super().__init__``) and
    implement :meth:`get_data`.

    Args:
        sources: the subset of ``provides_sources`` to return, in this order; default all.
        axis_labels: maps source names to tuples naming each axis, or None.

    Attributes:
        provides_sources: the sources the dataset can give.
        sources: the sources it gives, in the order of the data tuples.
        axis_labels: as given.
        default_transformers: ``(cls, args, kwargs)`` triples that
            :meth:`apply_default_transformers` wraps a stream in, in order.
        requests_by_index: whether :meth:`get_data` takes the example indices an
            iteration scheme requests (False for :class:`IterableDataset`).

    Raises:
        SourceError: a requested source is not provided.
        ConfigError: ``provides_sources`` is not set, or ``sources`` is empty.
    """

    # What on_sample_error='quarantine' needs to replace one example's read.
    requests_by_index = True

    provides_sources: tuple[str, ...] | None = None
    default_transformers: tuple[tuple[type, list[Any], dict[str, Any]], ...] = ()

    def __init__(
        self, sources: Sequence[str] | None = None, axis_labels: dict[str, Any] | None = None
    ) -> None:
        if not self.provides_sources:
            raise ConfigError(f"{type(self).__name__} does not set provides_sources")
        if sources is not None:
            if isinstance(sources, str):
                sources = (sources,)
            if not sources:
                raise ConfigError(f"sources={sources!r} is empty: expected at least one source")
            missing = [s for s in sources if s not in self.provides_sources]
            if missing:
                raise SourceError(
                    f"{type(self).__name__} cannot provide the sources {missing}; it provides "
                    f"{list(self.provides_sources)}"
                )
            self.sources = tuple(sources)
        self.axis_labels = axis_labels

    @property
    def sources(self) -> tuple[str, ...]:
        """The sources this dataset gives (``provides_sources`` unless a subset was chosen)."""
        return getattr(self, "_sources", None) or tuple(self.provides_sources or ())

    @sources.setter
    def sources(self, sources: Sequence[str]) -> None:
        self._sources = tuple(sources)

    @property
    def example_iteration_scheme(self) -> Any:
        """The scheme that reads this dataset example by example.

        Raises:
            AttributeError: the dataset has none.
        """
        if not hasattr(self, "_example_iteration_scheme"):
            raise AttributeError(f"{type(self).__name__} does not provide an example scheme")
        return self._example_iteration_scheme

    @example_iteration_scheme.setter
    def example_iteration_scheme(self, value: Any) -> None:
        self._example_iteration_scheme = value

    def apply_default_transformers(self, stream: Any) -> Any:
        """Wrap ``stream`` in :attr:`default_transformers`, in order, and return the result."""
        for cls, args, kwargs in self.default_transformers:
            stream = cls(stream, *args, **kwargs)
        return stream

    def get_example_stream(self) -> Any:
        """A DataStream reading this dataset with :attr:`example_iteration_scheme`."""
        from producer.streams import DataStream  # streams import nothing of datasets/

        return DataStream(self, iteration_scheme=self.example_iteration_scheme)

    def open(self) -> Any:
        """Return the state a stream passes back to :meth:`get_data` (None by default)."""
        return None

    def reset(self, state: Any) -> Any:
        """Return a fresh state (by default: close ``state`` and open a new one)."""
        self.close(state)
        return self.open()

    def next_epoch(self, state: Any) -> Any:
        """Return the state for the next epoch (by default: :meth:`reset`)."""
        return self.reset(state)

    def close(self, state: Any) -> None:
        """Release what ``state`` holds."""

    def get_data(self, state: Any = None, request: Any = None) -> tuple[Any, ...]:
        """Return the data for ``request``, a tuple in :attr:`sources` order."""
        raise NotImplementedError(f"{type(self).__name__} does not implement get_data")

    def filter_sources(self, data: Sequence[Any]) -> tuple[Any, ...]:
        """Keep the values of :attr:`sources` from values given for ``provides_sources``."""
        by_source = dict(zip(self.provides_sources or (), data, strict=False))
        return tuple(by_source[s] for s in self.sources)


class IterableDataset(Dataset):
    """A dataset over iterables, read from the start again every epoch; takes no request.

    Args:
        iterables: a dict source -> iterable, or one iterable (source ``'data'``). Each
            epoch calls ``iter()`` on them again, so pass containers, not iterators.
        **kwargs: ``sources``, ``axis_labels``.

    Raises:
        ConfigError: a value is not iterable, or sized iterables differ in length.
    """

    example_iteration_scheme = None
    requests_by_index = False

    def __init__(self, iterables: Any, **kwargs: Any) -> None:
        if isinstance(iterables, Mapping):
            self.provides_sources = tuple(iterables)
        else:
            self.provides_sources = ("data",)
            iterables = {"data": iterables}
        super().__init__(**kwargs)
        for source, iterable in iterables.items():
            if not isinstance(iterable, Iterable):
                raise ConfigError(f"source {source!r} is not iterable: {type(iterable).__name__}")
            if iter(iterable) is iterable:
                log.warning("source %r is an iterator: it will be empty after one epoch", source)
        self.iterables = [iterables[s] for s in self.sources]
        lengths = {
            s: len(it)
            for s, it in zip(self.sources, self.iterables, strict=True)
            if hasattr(it, "__len__")
        }
        if len(set(lengths.values())) > 1:
            raise ConfigError(f"the iterables have different lengths: {lengths}")

    @property
    def num_examples(self) -> float:
        """The common length of the iterables, or NaN if one has no length."""
        if all(hasattr(it, "__len__") for it in self.iterables):
            return len(self.iterables[0])
        return float("nan")

    def open(self) -> Iterator[tuple[Any, ...]]:
        """Start new iterators over the iterables."""
        return zip(*(iter(it) for it in self.iterables), strict=False)

    def get_data(self, state: Any = None, request: Any = None) -> tuple[Any, ...]:
        """Return the next example of the epoch.

        Raises:
            InvalidRequestError: ``request`` is not None, or ``state`` is missing.
            StopIteration: the epoch is over.
        """
        if request is not None:
            raise InvalidRequestError(
                f"IterableDataset takes no request, got {request!r}: use no iteration scheme"
            )
        if state is None:
            raise InvalidRequestError("IterableDataset.get_data needs the state from open()")
        return next(state)


class IndexableDataset(Dataset):
    """A dataset over indexable containers (arrays), read by index, list or slice.

    Args:
        indexables: a dict source -> container, or one container (source ``'data'``).
            They are kept as given (as in Fuel): a list source gives lists for list
            requests and slices, an array source arrays.
        start: the first example to use (default 0).
        stop: one past the last example to use (default: all).
        **kwargs: ``sources``, ``axis_labels``.

    Raises:
        ConfigError: the sources have different lengths.
    """

    def __init__(
        self, indexables: Any, start: int | None = None, stop: int | None = None, **kwargs: Any
    ) -> None:
        if isinstance(indexables, Mapping):
            self.provides_sources = tuple(indexables)
        else:
            self.provides_sources = ("data",)
            indexables = {"data": indexables}
        super().__init__(**kwargs)
        self.start = start
        self.stop = stop
        # As in Fuel, containers are kept as given: a list source gives lists.
        self.indexables = [indexables[s][start:stop] for s in self.sources]
        lengths = {s: len(x) for s, x in zip(self.sources, self.indexables, strict=True)}
        if len(set(lengths.values())) != 1:
            raise ConfigError(f"the sources have different lengths: {lengths}")
        self.example_iteration_scheme = SequentialExampleScheme(self.num_examples)

    def __getattr__(self, name: str) -> Any:
        # ``dataset.features`` reads a source, as in Fuel. Only called for missing names.
        sources = self.__dict__.get("_sources") or self.__dict__.get("provides_sources") or ()
        if "indexables" in self.__dict__ and name in sources:
            return self.__dict__["indexables"][tuple(sources).index(name)]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def num_examples(self) -> int:
        """The number of examples (after ``start``/``stop``)."""
        return len(self.indexables[0])

    def get_data(self, state: Any = None, request: Any = None) -> tuple[Any, ...]:
        """Return the examples ``request`` names, one value per source.

        Raises:
            InvalidRequestError: ``request`` is None or malformed, or a ``state`` was
                given (this dataset has none; Fuel raises ``ValueError`` too).
            RequestError: it names an example outside the dataset.
        """
        if state is not None:
            raise InvalidRequestError(
                f"IndexableDataset.get_data takes no state (its open() returns None), got "
                f"{type(state).__name__}: pass state=None"
            )
        request = normalize_request(request, self.num_examples)
        return tuple(_take(indexable, request) for indexable in self.indexables)


class NpyDataset(Dataset):
    """A dataset over ``.npy`` files, memory-mapped: a request reads only its rows.

    Args:
        files: a dict source -> path of a ``.npy`` file; axis 0 indexes examples.
        start: the first example to use (default 0).
        stop: one past the last example to use (default: all).
        **kwargs: ``sources``, ``axis_labels``.

    Raises:
        ConfigError: a file holds a 0-d array, or the sources have different lengths.
    """

    def __init__(
        self,
        files: Mapping[str, Any],
        start: int | None = None,
        stop: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.provides_sources = tuple(files)
        super().__init__(**kwargs)
        self.files = {s: files[s] for s in self.sources}
        self.arrays = [np.load(self.files[s], mmap_mode="r") for s in self.sources]
        for source, array in zip(self.sources, self.arrays, strict=True):
            if array.ndim == 0:
                raise ConfigError(f"{self.files[source]} ({source!r}) holds a 0-d array")
        spans = {
            s: range(len(a))[start:stop] for s, a in zip(self.sources, self.arrays, strict=True)
        }
        if len({len(r) for r in spans.values()}) != 1:
            raise ConfigError(
                f"the sources have different lengths: { {s: len(r) for s, r in spans.items()} }"
            )
        self.start = start
        self.stop = stop
        self._offset = next(iter(spans.values())).start
        self._num_examples = len(next(iter(spans.values())))
        self.example_iteration_scheme = SequentialExampleScheme(self._num_examples)

    @property
    def num_examples(self) -> int:
        """The number of examples (after ``start``/``stop``)."""
        return self._num_examples

    def get_data(self, state: Any = None, request: Any = None) -> tuple[Any, ...]:
        """Read the rows ``request`` names, one in-memory array per source.

        A list of indices is read in sorted order without duplicates (local reads on
        disk), then put back in the requested order.

        Raises:
            InvalidRequestError: ``request`` is None or malformed.
            RequestError: it names an example outside the dataset.
        """
        request = normalize_request(request, self.num_examples)
        if isinstance(request, int):
            return tuple(np.array(a[self._offset + request]) for a in self.arrays)
        if isinstance(request, slice):
            rows = range(self.num_examples)[request]
            window = slice(self._offset + rows.start, self._offset + rows.stop, rows.step)
            return tuple(np.array(a[window]) for a in self.arrays)
        unique, inverse = np.unique(request, return_inverse=True)
        return tuple(np.asarray(a[unique + self._offset])[inverse] for a in self.arrays)
