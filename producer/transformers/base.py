"""The transformer base classes (``fuel.transformers.Transformer`` and friends)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from producer.errors import (
    AxisLabelsMismatchError,
    InvalidRequestError,
    SourceError,
    StreamError,
    UnsupportedInputError,
)
from producer.randomness import RandomStateMixin
from producer.streams import AbstractDataStream

__all__ = [
    "AgnosticSourcewiseTransformer",
    "AgnosticTransformer",
    "ExpectsAxisLabels",
    "RandomStateMixin",
    "SourcewiseTransformer",
    "Transformer",
    "check_sources",
    "stack_examples",
]

log = logging.getLogger(__name__)

_KIND = {True: "examples", False: "batches"}


def check_sources(what: str, names: Sequence[str], available: Sequence[str]) -> tuple[str, ...]:
    """Return ``names`` as a tuple, or raise if one is not in ``available``.

    Raises:
        SourceError: naming the missing sources and listing the available ones.
    """
    names = (names,) if isinstance(names, str) else tuple(names)
    missing = [n for n in names if n not in available]
    if missing:
        raise SourceError(
            f"{what}: the stream has no source {', '.join(map(repr, missing))}; its "
            f"sources are {list(available)}"
        )
    return names


def stack_examples(examples: Sequence[Any]) -> np.ndarray:
    """Stack examples into one array; ragged ones (e.g. sequences) into an object array."""
    try:
        return np.asarray(examples)
    except ValueError:
        # numpy >= 1.24 refuses ragged nesting; keep one object per example.
        stacked = np.empty(len(examples), dtype=object)
        for i, example in enumerate(examples):
            stacked[i] = example
        return stacked


class Transformer(AbstractDataStream):
    """A stream that wraps another stream (its ``data_stream``).

    Subclasses define ``transform_example`` and/or ``transform_batch``, or override
    :meth:`get_data` when they change the kind of stream or need the request.

    Args:
        data_stream: the wrapped stream.
        produces_examples: whether this transformer yields examples. When None and no
            iteration scheme is given, it is the wrapped stream's (Fuel would raise on
            access instead).
        **kwargs: ``iteration_scheme``, ``axis_labels``.

    Attributes:
        data_stream: the wrapped stream (walk ``.data_stream`` to find the root
            DataStream; :class:`~producer.transformers.Merge` has ``.data_streams``).
        child_epoch_iterator: the wrapped stream's current epoch iterator, replaced by
            each :meth:`get_epoch_iterator` call.
    """

    child_epoch_iterator: Iterator[Any]

    def __init__(self, data_stream: Any, produces_examples: bool | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        if produces_examples is not None:
            self.produces_examples = produces_examples
        self.data_stream = data_stream

    def _default_produces_examples(self) -> bool:
        return bool(self.data_stream.produces_examples)

    @property
    def sources(self) -> tuple[str, ...]:
        """The wrapped stream's sources, unless set on this transformer."""
        if hasattr(self, "_sources"):
            return self._sources
        return tuple(self.data_stream.sources)

    @sources.setter
    def sources(self, value: Sequence[str]) -> None:
        self._sources = tuple(value)

    @property
    def plan_fingerprint(self) -> Any:
        """The wrapped stream's ``plan_fingerprint`` (what the plan's fingerprint adds:
        read on the top of the chain, said by its root, e.g. that it quarantines), unless
        set on this transformer."""
        if hasattr(self, "_plan_fingerprint"):
            return self._plan_fingerprint
        return getattr(self.data_stream, "plan_fingerprint", None)

    @plan_fingerprint.setter
    def plan_fingerprint(self, value: Any) -> None:
        self._plan_fingerprint = value

    def close(self) -> None:
        """Close the wrapped stream."""
        self.data_stream.close()

    def reset(self) -> None:
        """Reset the wrapped stream."""
        self.data_stream.reset()

    def next_epoch(self) -> None:
        """Move the wrapped stream to its next epoch."""
        self.data_stream.next_epoch()

    def get_epoch_iterator(self, as_dict: bool = False) -> Iterator[Any]:
        """Start a new epoch of the wrapped stream, then return this stream's iterator."""
        self.child_epoch_iterator = self.data_stream.get_epoch_iterator()
        return super().get_epoch_iterator(as_dict=as_dict)

    def _next_child(self) -> Any:
        if getattr(self, "child_epoch_iterator", None) is None:
            raise StreamError(f"{type(self).__name__}: call get_epoch_iterator() before get_data()")
        return next(self.child_epoch_iterator)

    def get_data(self, request: Any = None) -> Any:
        """Take the wrapped stream's next item and transform it.

        Raises:
            InvalidRequestError: ``request`` is not None.
            UnsupportedInputError: this transformer and the wrapped stream disagree on
                examples versus batches.
        """
        if request is not None:
            raise InvalidRequestError(f"{type(self).__name__} takes no request, got {request!r}")
        data = self._next_child()
        if self.produces_examples != self.data_stream.produces_examples:
            raise UnsupportedInputError(
                f"the wrapped data stream produces {_KIND[self.data_stream.produces_examples]} "
                f"while the {type(self).__name__} transformer produces "
                f"{_KIND[self.produces_examples]}, which it does not support"
            )
        if self.produces_examples:
            return self.transform_example(data)
        return self.transform_batch(data)

    def transform_example(self, example: Any) -> Any:
        """Transform one example (a tuple in source order)."""
        raise UnsupportedInputError(
            f"{type(self).__name__} does not support examples as input, but the wrapped "
            "data stream produces examples"
        )

    def transform_batch(self, batch: Any) -> Any:
        """Transform one batch (a tuple in source order)."""
        raise UnsupportedInputError(
            f"{type(self).__name__} does not support batches as input, but the wrapped "
            "data stream produces batches"
        )


class AgnosticTransformer(Transformer):
    """A transformer that does the same to examples and batches: define ``transform_any``."""

    def transform_any(self, data: Any) -> Any:
        """Transform an example or a batch."""
        raise NotImplementedError(f"{type(self).__name__} does not implement transform_any")

    def transform_example(self, example: Any) -> Any:
        """Apply :meth:`transform_any`."""
        return self.transform_any(example)

    def transform_batch(self, batch: Any) -> Any:
        """Apply :meth:`transform_any`."""
        return self.transform_any(batch)


class SourcewiseTransformer(Transformer):
    """A transformer applied to each selected source separately.

    Subclasses define ``transform_source_example`` and/or ``transform_source_batch``.

    Args:
        data_stream: the wrapped stream.
        produces_examples: whether this transformer yields examples.
        which_sources: the sources to transform (default: all).
        **kwargs: ``iteration_scheme``, ``axis_labels``.

    Raises:
        SourceError: a name in ``which_sources`` is not a source of ``data_stream``.
    """

    def __init__(
        self,
        data_stream: Any,
        produces_examples: bool | None,
        which_sources: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        if which_sources is None:
            which_sources = tuple(data_stream.sources)
        self.which_sources = check_sources(
            f"{type(self).__name__}(which_sources=...)", which_sources, data_stream.sources
        )
        super().__init__(data_stream, produces_examples, **kwargs)

    def _apply_sourcewise_transformation(self, data: Sequence[Any], method: Any) -> tuple[Any, ...]:
        return tuple(
            method(value, source) if source in self.which_sources else value
            for source, value in zip(self.data_stream.sources, data, strict=True)
        )

    def transform_source_example(self, source_example: Any, source_name: str) -> Any:
        """Transform the example of one source."""
        raise UnsupportedInputError(
            f"{type(self).__name__} does not support examples as input, but the wrapped "
            "data stream produces examples"
        )

    def transform_source_batch(self, source_batch: Any, source_name: str) -> Any:
        """Transform the batch of one source."""
        raise UnsupportedInputError(
            f"{type(self).__name__} does not support batches as input, but the wrapped "
            "data stream produces batches"
        )

    def transform_example(self, example: Any) -> Any:
        """Apply :meth:`transform_source_example` to each selected source."""
        return self._apply_sourcewise_transformation(example, self.transform_source_example)

    def transform_batch(self, batch: Any) -> Any:
        """Apply :meth:`transform_source_batch` to each selected source."""
        return self._apply_sourcewise_transformation(batch, self.transform_source_batch)


class AgnosticSourcewiseTransformer(AgnosticTransformer, SourcewiseTransformer):
    """A sourcewise transformer that does the same to examples and batches.

    Subclasses define ``transform_any_source(source_data, source_name)``.
    """

    def transform_any(self, data: Any) -> Any:
        """Apply :meth:`transform_any_source` to each selected source."""
        return self._apply_sourcewise_transformation(data, self.transform_any_source)

    def transform_any_source(self, source_data: Any, source_name: str) -> Any:
        """Transform the example or batch of one source."""
        raise NotImplementedError(f"{type(self).__name__} does not implement transform_any_source")


class ExpectsAxisLabels:
    """Mixin for transformers that check the axis labels of their input (Fuel's).

    :meth:`verify_axis_labels` is called with the labels a source should have and the
    ones it has. Missing labels (None) log a warning; different ones raise
    :class:`~producer.errors.AxisLabelsMismatchError` (a ``ValueError``, as Fuel's).
    Each source is checked once, at its first item.
    """

    def verify_axis_labels(self, expected: Any, actual: Any, source_name: str) -> None:
        """Check ``actual`` against ``expected`` for ``source_name``, once per source.

        Raises:
            AxisLabelsMismatchError: ``actual`` is not None and differs from ``expected``.
        """
        checked: set[str] = self.__dict__.setdefault("_checked_axis_labels", set())
        if source_name in checked:
            return
        if actual is None:
            log.warning(
                "%s instance could not verify the axis labels of source %r: expected %s, got None",
                type(self).__name__,
                source_name,
                expected,
            )
        elif tuple(expected) != tuple(actual):
            raise AxisLabelsMismatchError(
                f"{type(self).__name__} expected axis labels {tuple(expected)} for source "
                f"{source_name!r}, got {tuple(actual)} instead"
            )
        checked.add(source_name)
