"""Transformers that map one item to one item (or drop it): Fuel's simple transformers."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from collections.abc import Mapping as MappingABC
from typing import Any

import numpy as np

from producer.config import floatx
from producer.errors import ConfigError, InvalidRequestError, SourceError
from producer.transformers.base import (
    AgnosticSourcewiseTransformer,
    AgnosticTransformer,
    SourcewiseTransformer,
    Transformer,
    check_sources,
)

__all__ = [
    "FLOATX",
    "Cast",
    "Filter",
    "FilterSources",
    "Flatten",
    "ForceFloatX",
    "Mapping",
    "Rename",
    "ScaleAndShift",
    "SortMapping",
]

log = logging.getLogger(__name__)

#: floatX when nothing is configured; the configured one is
#: :func:`producer.config.floatx` (``BATCHQ_FLOATX``, else ``FUEL_FLOATX``).
FLOATX = "float32"


def _copy_labels(data_stream: Any, kwargs: dict[str, Any]) -> None:
    if data_stream.axis_labels:
        kwargs.setdefault("axis_labels", dict(data_stream.axis_labels))


class Mapping(Transformer):
    """Applies a function to each item of the wrapped stream.

    Args:
        data_stream: the wrapped stream.
        mapping: called with the item; returns the new item. With ``mapping_accepts``
            ``list`` (the default) it takes and returns a tuple in source order; with
            ``dict`` it takes an ordered ``{source: value}`` dict and returns a dict
            (from which the values of this stream's sources, or of ``add_sources``,
            are taken).
        add_sources: if given, the mapping's result is appended to the item as these
            new sources, instead of replacing it.
        mapping_accepts: ``list`` or ``dict``, as in Fuel.
        **kwargs: ``axis_labels``.

    Raises:
        ConfigError: (a ``ValueError``) ``mapping_accepts`` is neither ``list`` nor
            ``dict``.
    """

    def __init__(
        self,
        data_stream: Any,
        mapping: Callable[[Any], Any],
        add_sources: Sequence[str] | None = None,
        mapping_accepts: type = list,
        **kwargs: Any,
    ) -> None:
        super().__init__(data_stream, data_stream.produces_examples, **kwargs)
        if mapping_accepts not in (list, dict):
            raise ConfigError(
                f"mapping_accepts={mapping_accepts!r} is not valid: Mapping accepts list or dict"
            )
        self.mapping_accepts = mapping_accepts
        self.mapping = mapping
        self.add_sources = (add_sources,) if isinstance(add_sources, str) else add_sources

    @property
    def sources(self) -> tuple[str, ...]:
        """The wrapped stream's sources, followed by ``add_sources``."""
        return tuple(self.data_stream.sources) + tuple(self.add_sources or ())

    @sources.setter
    def sources(self, value: Sequence[str]) -> None:
        raise ConfigError("the sources of a Mapping are set by its add_sources argument")

    def get_data(self, request: Any = None) -> Any:
        """The mapping's result (or the item followed by it, with ``add_sources``).

        Raises:
            SourceError: (``mapping_accepts=dict``) the returned dict lacks a source.
        """
        if request is not None:
            raise InvalidRequestError(f"Mapping takes no request, got {request!r}")
        data = self._next_child()
        if self.mapping_accepts is dict:
            named = OrderedDict(zip(self.data_stream.sources, data, strict=True))
            result = self.mapping(named)
            wanted = tuple(self.add_sources or self.sources)
            missing = [s for s in wanted if s not in result]
            if missing:
                raise SourceError(
                    f"the mapping returned a dict without the sources {missing}; it must "
                    f"have {list(wanted)}"
                )
            image = tuple(result[s] for s in wanted)
        else:
            image = self.mapping(data)
        if not self.add_sources:
            return image
        return tuple(data) + tuple(image)


class SortMapping:
    """A mapping (for :class:`Mapping`) that sorts the examples of a batch.

    Args:
        key: called with one example (a tuple, one value per source); returns the value
            to sort on.
        reverse: sort in decreasing order.
    """

    def __init__(self, key: Callable[[tuple[Any, ...]], Any], reverse: bool = False) -> None:
        self.key = key
        self.reverse = reverse

    def __call__(self, batch: Sequence[Any]) -> tuple[Any, ...]:
        """Sort ``batch``; arrays stay arrays and other sources become lists."""
        order = sorted(zip(*batch, strict=True), key=self.key, reverse=self.reverse)
        columns = list(zip(*order, strict=True)) if order else [() for _ in batch]
        return tuple(
            np.asarray(column) if isinstance(original, np.ndarray) else list(column)
            for column, original in zip(columns, batch, strict=True)
        )


class Flatten(SourcewiseTransformer):
    """Flattens the selected sources (batches: all axes but the first).

    Args:
        data_stream: the wrapped stream.
        **kwargs: ``which_sources``, ``axis_labels``.
    """

    def __init__(self, data_stream: Any, **kwargs: Any) -> None:
        if data_stream.axis_labels:
            which = kwargs.get("which_sources") or data_stream.sources
            labels: dict[str, Any] = {}
            for source, axes in data_stream.axis_labels.items():
                if source not in which:
                    labels[source] = axes
                elif not axes:
                    labels[source] = None
                elif data_stream.produces_examples:
                    labels[source] = ("feature",)
                else:
                    labels[source] = (axes[0], "feature")
            kwargs.setdefault("axis_labels", labels)
        super().__init__(data_stream, data_stream.produces_examples, **kwargs)

    def transform_source_example(self, source_example: Any, source_name: str) -> np.ndarray:
        """Flatten one example."""
        return np.asarray(source_example).flatten()

    def transform_source_batch(self, source_batch: Any, source_name: str) -> np.ndarray:
        """Flatten each example of the batch."""
        array = np.asarray(source_batch)
        return array.reshape((array.shape[0], -1))


class ScaleAndShift(AgnosticSourcewiseTransformer):
    """Computes ``data * scale + shift`` on the selected sources.

    Args:
        data_stream: the wrapped stream.
        scale: the factor.
        shift: the offset.
        **kwargs: ``which_sources``, ``axis_labels``.
    """

    def __init__(self, data_stream: Any, scale: float, shift: float, **kwargs: Any) -> None:
        self.scale = scale
        self.shift = shift
        _copy_labels(data_stream, kwargs)
        super().__init__(data_stream, data_stream.produces_examples, **kwargs)

    def transform_any_source(self, source_data: Any, source_name: str) -> Any:
        """Scale and shift."""
        return np.asarray(source_data) * self.scale + self.shift


class Cast(AgnosticSourcewiseTransformer):
    """Casts the selected sources to a dtype.

    Args:
        data_stream: the wrapped stream.
        dtype: any numpy dtype, or ``'floatX'`` (the configured floatX, read now:
            see :mod:`producer.config`).
        **kwargs: ``which_sources``, ``axis_labels``.
    """

    def __init__(self, data_stream: Any, dtype: Any, **kwargs: Any) -> None:
        self.dtype = np.dtype(floatx() if dtype == "floatX" else dtype)
        _copy_labels(data_stream, kwargs)
        super().__init__(data_stream, data_stream.produces_examples, **kwargs)

    def transform_any_source(self, source_data: Any, source_name: str) -> np.ndarray:
        """Cast."""
        return np.asarray(source_data, dtype=self.dtype)


class ForceFloatX(AgnosticSourcewiseTransformer):
    """Casts floating-point arrays of the selected sources to floatX; leaves the rest.

    floatX is the configured one (``BATCHQ_FLOATX``, else ``FUEL_FLOATX``, else
    float32; see :mod:`producer.config`), read when the transformer is built.

    Args:
        data_stream: the wrapped stream.
        **kwargs: ``which_sources``, ``axis_labels``.

    Attributes:
        floatX: the dtype float arrays are cast to.
    """

    def __init__(self, data_stream: Any, **kwargs: Any) -> None:
        _copy_labels(data_stream, kwargs)
        super().__init__(data_stream, data_stream.produces_examples, **kwargs)
        self.floatX = np.dtype(floatx())

    def transform_any_source(self, source_data: Any, source_name: str) -> Any:
        """Cast float arrays of another precision."""
        if (
            isinstance(source_data, np.ndarray)
            and source_data.dtype.kind == "f"
            and source_data.dtype != self.floatX
        ):
            return source_data.astype(self.floatX)
        return source_data


class Filter(Transformer):
    """Keeps the items for which a predicate is true.

    Args:
        data_stream: the wrapped stream.
        predicate: called with an item (a tuple in source order); True keeps it.
        **kwargs: ``axis_labels``.
    """

    def __init__(self, data_stream: Any, predicate: Callable[[Any], bool], **kwargs: Any) -> None:
        _copy_labels(data_stream, kwargs)
        super().__init__(data_stream, data_stream.produces_examples, **kwargs)
        self.predicate = predicate

    def get_data(self, request: Any = None) -> Any:
        """The wrapped stream's next item that satisfies the predicate."""
        if request is not None:
            raise InvalidRequestError(f"Filter takes no request, got {request!r}")
        while True:
            data = self._next_child()
            if self.predicate(data):
                return data


class Rename(AgnosticTransformer):
    """Renames sources.

    Args:
        data_stream: the wrapped stream.
        names: maps old source names to new ones.
        on_non_existent: what to do with an old name the stream does not have:
            ``'raise'`` (a :class:`~producer.errors.SourceError`), ``'warn'`` (log a
            warning) or ``'ignore'``.
        **kwargs: ``axis_labels``.

    Raises:
        SourceError: an old name is missing (with ``'raise'``), or two sources would
            end up with the same name.
        ConfigError: ``on_non_existent`` is not one of the three values.
    """

    def __init__(
        self,
        data_stream: Any,
        names: MappingABC[str, str],
        on_non_existent: str = "raise",
        **kwargs: Any,
    ) -> None:
        if on_non_existent not in ("raise", "ignore", "warn"):
            raise ConfigError(
                f"on_non_existent={on_non_existent!r} is not valid: expected 'raise', "
                "'ignore' or 'warn'"
            )
        _check_old_names(names, data_stream.sources, on_non_existent)
        sources = _renamed(names, data_stream.sources)
        if data_stream.axis_labels:
            kwargs.setdefault(
                "axis_labels",
                {names.get(s, s): labels for s, labels in data_stream.axis_labels.items()},
            )
        super().__init__(data_stream, data_stream.produces_examples, **kwargs)
        self.sources = tuple(sources)

    def transform_any(self, data: Any) -> Any:
        """The data, unchanged."""
        return data


def _check_old_names(
    names: MappingABC[str, str], sources: Sequence[str], on_non_existent: str
) -> None:
    """Raise, warn about or ignore (``on_non_existent``) old names not in ``sources``."""
    for old, new in names.items():
        if old not in sources:
            message = (
                f"renaming source {old!r} to {new!r}: the stream has no source {old!r}; "
                f"its sources are {list(sources)}"
            )
            if on_non_existent == "raise":
                raise SourceError(message)
            log.log(logging.WARNING if on_non_existent == "warn" else logging.DEBUG, message)


def _renamed(names: MappingABC[str, str], sources: Sequence[str]) -> list[str]:
    """The new names, in one pass over the old ones (so that swaps such as
    ``{'a': 'b', 'b': 'a'}`` work); two sources may not end with one name."""
    renamed = [names.get(source, source) for source in sources]
    if len(set(renamed)) != len(renamed):
        duplicated = sorted({s for s in renamed if renamed.count(s) > 1})
        raise SourceError(
            f"renaming {dict(names)} would give several sources the names {duplicated} "
            f"(the stream's sources are {list(sources)})"
        )
    return renamed


class FilterSources(AgnosticTransformer):
    """Keeps a subset of the sources, in the wrapped stream's order.

    Args:
        data_stream: the wrapped stream.
        sources: the names of the sources to keep (order does not matter).
        **kwargs: ``axis_labels``.

    Raises:
        SourceError: a name is not a source of ``data_stream``.
    """

    def __init__(self, data_stream: Any, sources: Sequence[str], **kwargs: Any) -> None:
        keep = check_sources("FilterSources", sources, data_stream.sources)
        if data_stream.axis_labels:
            kwargs.setdefault(
                "axis_labels",
                {s: labels for s, labels in data_stream.axis_labels.items() if s in keep},
            )
        super().__init__(data_stream, data_stream.produces_examples, **kwargs)
        self.sources = tuple(s for s in data_stream.sources if s in keep)

    def transform_any(self, data: Any) -> tuple[Any, ...]:
        """The values of the kept sources."""
        return tuple(
            value
            for value, source in zip(data, self.data_stream.sources, strict=True)
            if source in self.sources
        )
